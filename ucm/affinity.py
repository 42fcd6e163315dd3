"""CPU affinity of UCM's own threads: they run on every CPU the process may use, not on the core of the thread
that started them.

Why: vLLM's CPU worker binds its OpenMP threads one per core (``VLLM_CPU_OMP_THREADS_BIND``), and the worker's main
thread is OpenMP thread 0, so it ends up bound to a single core. Linux threads inherit the affinity of the thread
that creates them, so without this every UCM thread (Posix I/O, KVfold codec, DRAM-cache write-back, CPU copy
slices) started from the worker would share that one core with the model's first OpenMP thread while the others sit
idle during a blockwise load (the slowdown seen is in benchmarks/RESULTS.md, "Other one-off costs"). On GPU and NPU
servers the worker is not bound and this changes nothing.

UCM's thread pools come from :func:`thread_pool` and its other threads from :func:`daemon_thread`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ucm.logger import init_logger

logger = init_logger(__name__)

_logged = False
_log_lock = threading.Lock()


def widen_thread_affinity() -> None:
    """Let the calling thread run on every CPU of this process's cpuset (Linux; elsewhere a no-op).

    The requested set is CPUs ``0 .. os.cpu_count() - 1``; the kernel keeps those the process's cgroup allows, so a
    container limited to some CPUs stays on them. The first thread that gets a different set than the one it
    inherited logs both once (info). Never raises: a refusal (``OSError``) is logged at debug and the thread keeps
    its inherited affinity.
    """
    global _logged
    if not hasattr(os, "sched_setaffinity"):
        return
    try:
        inherited = os.sched_getaffinity(0)
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
        now = os.sched_getaffinity(0)
    except OSError as exc:
        logger.debug("cannot widen the CPU affinity of thread %s: %s", threading.current_thread().name, exc)
        return
    if now != inherited and not _logged:
        with _log_lock:
            if not _logged:
                _logged = True
                logger.info(
                    "UCM threads run on CPUs %s (the thread that started them was bound to CPUs %s)",
                    _cpu_list(now),
                    _cpu_list(inherited),
                )


def thread_pool(max_workers: int, name: str) -> ThreadPoolExecutor:
    """A ``ThreadPoolExecutor`` of ``max_workers`` threads named ``name-<i>`` whose threads first call
    :func:`widen_thread_affinity`."""
    return ThreadPoolExecutor(max_workers, thread_name_prefix=name, initializer=widen_thread_affinity)


def daemon_thread(target: Callable[[], None], name: str) -> threading.Thread:
    """A daemon ``threading.Thread`` named ``name`` (not started) that calls :func:`widen_thread_affinity`, then
    ``target``."""

    def run() -> None:
        widen_thread_affinity()
        target()

    return threading.Thread(target=run, name=name, daemon=True)


def _cpu_list(cpus: set[int]) -> str:
    """``{0, 1, 2, 5}`` -> ``"0-2,5"``."""
    runs: list[list[int]] = []  # [first, last] of each run of consecutive CPUs
    for c in sorted(cpus):
        if runs and runs[-1][1] == c - 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
