"""A passthrough FUSE filesystem over a directory, run as its own process: the tests' real slow or hung mount.

``python -m ucm.testing.fusefs SOURCE MOUNTPOINT [--read-delay-ms MS] [--write-delay-ms MS] [--attr-timeout-s S]``
mounts ``SOURCE`` at
``MOUNTPOINT`` and serves every operation UCM's Posix stage uses (lookup, stat, open, create, read, write, rename,
unlink, mkdir, readdir, utimens, statfs...) from the files under ``SOURCE``, in the foreground, until it is
unmounted (``fusermount3 -u MOUNTPOINT``) or sent SIGTERM.

- ``--read-delay-ms``: every read request sleeps that long before it is answered (a slow disk or server). The
  filesystem is mounted with ``direct_io``, so every read of a file reaches this process (no page cache).
- ``--write-delay-ms``: the same for every write request (a slow disk or server on the dump path).
- A stopped daemon (``kill -STOP``) is a hung mount, as a dead NFS server is: every access that reaches it (open,
  read, write, a lookup of a name the kernel has not cached) blocks until ``kill -CONT``.
- ``--attr-timeout-s``: how long the kernel keeps names and attributes it was told (as an NFS client's attribute
  cache does); ``stat`` of a name seen within it is answered by the kernel without asking this process, so on a
  stopped daemon it still succeeds while ``open`` blocks.

Uses ``mfusepy`` (ctypes bindings of libfuse 2 or 3; Debian's ``fuse3`` package provides libfuse3 and
``fusermount3``). Helpers for tests: :func:`mount`, :func:`stopped`, :func:`resumed_after`.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# The stat fields a FUSE getattr answers with.
_STAT_FIELDS = ("st_mode", "st_nlink", "st_size", "st_uid", "st_gid", "st_atime", "st_mtime", "st_ctime")


def _operations(source: str, read_delay_s: float, attr_timeout_s: float, write_delay_s: float = 0.0) -> Any:
    """The ``mfusepy.Operations`` of a passthrough filesystem over ``source`` (imported here: only the daemon needs
    the library)."""
    import mfusepy

    class Passthrough(mfusepy.Operations):
        use_ns = True

        def _real(self, path: str) -> str:
            return os.path.join(source, path.lstrip("/"))

        def init_with_config(self, conn_info: Any, config_3: Any) -> None:
            if config_3 is not None:  # libfuse 3: cache names and attributes, no page cache for reads
                config_3.entry_timeout = attr_timeout_s
                config_3.attr_timeout = attr_timeout_s
                config_3.negative_timeout = 0.0
                config_3.direct_io = 1

        def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
            st = os.fstat(fh) if fh is not None else os.lstat(self._real(path))
            attrs: dict[str, Any] = {k: getattr(st, k) for k in _STAT_FIELDS}
            attrs.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
            return attrs

        def access(self, path: str, amode: int) -> int:
            if not os.access(self._real(path), amode):
                raise mfusepy.FuseOSError(errno.EACCES)
            return 0

        def readdir(self, path: str, fh: int) -> list[str]:
            return [".", "..", *os.listdir(self._real(path))]

        def mkdir(self, path: str, mode: int) -> int:
            os.mkdir(self._real(path), mode)
            return 0

        def rmdir(self, path: str) -> int:
            os.rmdir(self._real(path))
            return 0

        def unlink(self, path: str) -> int:
            os.unlink(self._real(path))
            return 0

        def rename(self, old: str, new: str) -> int:
            os.replace(self._real(old), self._real(new))
            return 0

        def chmod(self, path: str, mode: int) -> int:
            os.chmod(self._real(path), mode)
            return 0

        def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
            if times is None:
                os.utime(self._real(path))
            else:
                os.utime(self._real(path), ns=times)
            return 0

        def truncate(self, path: str, length: int, fh: int | None = None) -> int:
            if fh is not None:
                os.ftruncate(fh, length)
            else:
                os.truncate(self._real(path), length)
            return 0

        def open(self, path: str, flags: int) -> int:
            return os.open(self._real(path), flags & ~os.O_NONBLOCK)

        def create(self, path: str, mode: int, fi: Any = None) -> int:
            return os.open(self._real(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)

        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            if read_delay_s > 0:
                time.sleep(read_delay_s)
            return os.pread(fh, size, offset)

        def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
            if write_delay_s > 0:
                time.sleep(write_delay_s)
            return os.pwrite(fh, data, offset)

        def flush(self, path: str, fh: int) -> int:
            return 0

        def fsync(self, path: str, datasync: int, fh: int) -> int:
            os.fsync(fh)
            return 0

        def release(self, path: str, fh: int) -> int:
            os.close(fh)
            return 0

        def statfs(self, path: str) -> dict[str, Any]:
            st = os.statvfs(self._real(path))
            names = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files", "f_frsize")
            return {k: getattr(st, k) for k in (*names, "f_namemax")}

    return Passthrough()


def serve(
    source: str, mountpoint: str, read_delay_s: float = 0.0, attr_timeout_s: float = 1.0, write_delay_s: float = 0.0
) -> None:
    """Mount ``source`` at ``mountpoint`` and serve it in the foreground until unmounted (see the module doc).

    Raises:
        ValueError: ``source`` or ``mountpoint`` is not a directory, or ``read_delay_s`` / ``write_delay_s`` /
            ``attr_timeout_s`` < 0.
    """
    for name, path in (("source", source), ("mountpoint", mountpoint)):
        if not os.path.isdir(path):
            raise ValueError(f"{name} {path!r} is not a directory")
    if read_delay_s < 0 or write_delay_s < 0 or attr_timeout_s < 0:
        raise ValueError(
            f"read_delay_s, write_delay_s and attr_timeout_s must be >= 0, got {read_delay_s}, {write_delay_s} and "
            f"{attr_timeout_s}"
        )
    import mfusepy

    mfusepy.FUSE(
        _operations(os.path.abspath(source), read_delay_s, attr_timeout_s, write_delay_s),
        mountpoint,
        foreground=True,
        fsname="ucm-testing-fusefs",
    )


def unavailable_reason() -> str | None:
    """Why a FUSE mount cannot be made here (``None``: it can): no ``/dev/fuse``, or no libfuse / ``fusermount3``
    / ``mfusepy`` (installed by ``make setup``)."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is absent (no FUSE in this kernel or container)"
    if shutil.which("fusermount3") is None and shutil.which("fusermount") is None:
        return "no fusermount3 (Debian package fuse3)"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as exc:  # OSError: libfuse itself is missing
        return f"mfusepy cannot load libfuse: {exc}"
    return None


@contextlib.contextmanager
def mount(
    source: Path,
    mountpoint: Path,
    read_delay_ms: float = 0.0,
    attr_timeout_s: float = 1.0,
    start_timeout_s: float = 30,
    write_delay_ms: float = 0.0,
) -> Iterator[subprocess.Popen[bytes]]:
    """Run the daemon (``python -m ucm.testing.fusefs``) mounting ``source`` at ``mountpoint``; yield its process
    (``proc.pid``: the pid to stop with SIGSTOP). On exit, whatever happened: SIGCONT the daemon, unmount, end it.

    Raises:
        RuntimeError: the mount did not appear within ``start_timeout_s`` seconds (the daemon's stderr is named).
    """
    mountpoint.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "ucm.testing.fusefs", str(source), str(mountpoint)]
    cmd += ["--read-delay-ms", str(read_delay_ms), "--write-delay-ms", str(write_delay_ms)]
    cmd += ["--attr-timeout-s", str(attr_timeout_s)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + start_timeout_s
        while not os.path.ismount(mountpoint):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                raise RuntimeError(f"FUSE mount of {source} at {mountpoint} did not appear: {err[-2000:]}")
            time.sleep(0.05)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        fusermount = shutil.which("fusermount3") or shutil.which("fusermount") or "fusermount3"
        if subprocess.run([fusermount, "-u", str(mountpoint)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


def _wait_all_threads_stopped(pid: int, timeout_s: float) -> None:
    """Poll ``/proc/PID/task/*/stat`` until every thread's state is ``T`` (stopped by a signal).

    Raises:
        TimeoutError: not all were stopped within ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError):  # a thread that exited meanwhile
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
                states.append(stat[stat.rindex(")") + 2])  # the field after "(comm)"
        if states and all(s == "T" for s in states):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"FUSE daemon {pid}: threads not all stopped after {timeout_s} s (states {states})")
        time.sleep(0.001)


@contextlib.contextmanager
def resumed_after(pid: int, after_s: float) -> Iterator[threading.Event]:
    """Send SIGCONT to the daemon ``pid`` after ``after_s`` seconds unless the ``with`` block has ended by then: a
    daemon stopped from elsewhere (an engine's command, :func:`stopped`) cannot stay stopped, and a process blocked on
    the mount cannot wait, without bound. A request the daemon had read before it stopped is waited for even by a
    killed process, so without this a test blocked on the mount would hang the whole run.

    Yields:
        An event set when the watchdog fired (the test should then fail: something waited on the mount too long).
    """
    fired = threading.Event()

    def resume() -> None:
        fired.set()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)

    watchdog = threading.Timer(after_s, resume)
    watchdog.daemon = True
    watchdog.start()
    try:
        yield fired
    finally:
        watchdog.cancel()


@contextlib.contextmanager
def stopped(pid: int, max_s: float = 60.0) -> Iterator[None]:
    """Stop the daemon ``pid`` (SIGSTOP: the mount hangs) for the ``with`` block; resume it (SIGCONT) on exit, or
    after ``max_s`` seconds (:func:`resumed_after`), so that a test blocked on the mount cannot hang forever.

    The block is entered only once every thread of the daemon is stopped. ``kill`` returns as soon as the signal is
    queued, and the kernel wakes one thread, which then stops the others: on a busy machine the others could still
    answer requests for a while, and a test's "hung" read would succeed.

    Raises:
        TimeoutError: some thread of ``pid`` was not stopped within 10 s (the daemon is resumed first).
    """
    with resumed_after(pid, max_s):
        os.kill(pid, signal.SIGSTOP)
        try:
            _wait_all_threads_stopped(pid, timeout_s=10.0)
            yield
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ucm.testing.fusefs", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="directory whose files the mount serves")
    parser.add_argument("mountpoint", help="empty directory to mount at")
    parser.add_argument("--read-delay-ms", type=float, default=0.0, help="sleep before answering each read (ms)")
    parser.add_argument("--write-delay-ms", type=float, default=0.0, help="sleep before answering each write (ms)")
    parser.add_argument("--attr-timeout-s", type=float, default=1.0, help="kernel cache of names and attributes (s)")
    args = parser.parse_args(argv)
    try:
        serve(args.source, args.mountpoint, args.read_delay_ms / 1e3, args.attr_timeout_s, args.write_delay_ms / 1e3)
    except ValueError as exc:
        parser.error(str(exc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
