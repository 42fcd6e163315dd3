"""UCM's own threads: they run on every CPU the process may use, not on the core of the thread that started them,
and run torch's operators single-threaded.

Why: vLLM's CPU worker binds its OpenMP threads one per core (``VLLM_CPU_OMP_THREADS_BIND``), and the worker's main
thread is OpenMP thread 0, so it ends up bound to a single core. Linux threads inherit the affinity of the thread
that creates them, so without this every UCM thread (Posix I/O, KVfold codec, DRAM-cache write-back, CPU copy
slices) started from the worker would share that one core with the model's first OpenMP thread while the others sit
idle during a blockwise load (the slowdown seen is in benchmarks/RESULTS.md, "Other one-off costs"). On GPU and NPU
servers the worker is not bound and this changes nothing.

Single-threaded torch: a torch operator large enough to run in parallel (``fill_`` of a DRAM slot, KVfold's encode
of a block), called on a thread other than the one running the model, starts a second OpenMP team of
``torch.get_num_threads()`` threads for that thread, which then competes with the model's own team for the same
cores: on a 2-vCPU host, one such ``fill_`` per DRAM slot written in the background made the later forward passes of
prefix hits much slower (``benchmarks/hit_breakdown.py``; the figures in benchmarks/RESULTS.md, "Hit breakdown"). So
each UCM thread sets its own OpenMP thread count to 1 (``omp_set_num_threads`` of the OpenMP runtime torch loaded, a
per-thread setting: the model's threads keep theirs) after torch's per-thread initialisation, which would otherwise
reset it. UCM's threads run their copies side by side instead (several I/O threads, the CPU copy slices of
``ucm.kernels.block_copy.cpu``).

UCM's thread pools come from :func:`thread_pool` and its other threads from :func:`daemon_thread`.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
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


@functools.cache
def _omp_set_num_threads() -> Callable[[int], None] | None:
    """``omp_set_num_threads`` of the OpenMP runtime loaded in this process (libgomp, libiomp5 or libomp, found in
    ``/proc/self/maps``; the one in torch's own ``lib`` folder first), or ``None`` where none is loaded or it cannot
    be read."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if ".so" in line}
    except OSError:
        return None
    runtimes = sorted(
        (p for p in paths if os.path.basename(p).startswith(("libgomp", "libiomp", "libomp"))),
        key=lambda p: (f"{os.sep}torch{os.sep}lib{os.sep}" not in p, p),
    )
    for path in runtimes:
        try:
            fn = ctypes.CDLL(path).omp_set_num_threads  # the library already loaded: the same runtime
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_int]
        fn.restype = None
        return fn
    return None


def single_threaded_torch() -> None:
    """Make torch's operators on the calling thread run on that thread alone (see the module doc). A no-op where
    torch is not imported yet or no OpenMP runtime is found. Never raises."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    try:
        torch.get_num_threads()  # torch's per-thread initialisation first: it sets the OpenMP count itself
        setter = _omp_set_num_threads()
        if setter is not None:
            setter(1)
    except Exception as exc:  # a thread that keeps torch's default count is slower, not wrong
        logger.debug("cannot make torch single-threaded on %s: %s", threading.current_thread().name, exc)


def _init_ucm_thread() -> None:
    """What every UCM thread runs first: :func:`widen_thread_affinity`, :func:`single_threaded_torch`."""
    widen_thread_affinity()
    single_threaded_torch()


def thread_pool(max_workers: int, name: str) -> ThreadPoolExecutor:
    """A ``ThreadPoolExecutor`` of ``max_workers`` threads named ``name-<i>`` whose threads first call
    :func:`widen_thread_affinity` and :func:`single_threaded_torch`."""
    return ThreadPoolExecutor(max_workers, thread_name_prefix=name, initializer=_init_ucm_thread)


def daemon_thread(target: Callable[[], None], name: str) -> threading.Thread:
    """A daemon ``threading.Thread`` named ``name`` (not started) that calls :func:`widen_thread_affinity` and
    :func:`single_threaded_torch`, then ``target``."""

    def run() -> None:
        _init_ucm_thread()
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
