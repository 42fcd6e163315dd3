"""The block files of one Posix store, and what both I/O engines do around a block's transfer.

:class:`BlockFiles` knows where each key's file lives (:mod:`ucm.store.posix.format`) and does the steps that the
``psync`` and ``aio`` engines share: before a write, its temp name and header, and the check that the storage
directory is still the one of start (a directory deleted or unmounted while serving is never re-created nor written
to: ``ENOENT`` / ``ENODEV``); after a write, the failure path (the temp file removed) or the success; after a read,
its outcome: a hit, a miss, or a damaged file (removed) or foreign one (kept).

I/O faults never raise out of a transfer: an ``OSError`` fails the key, and :class:`FaultLog` logs the first
failure of each kind (operation and errno) as a warning, later ones at debug level, and the first success after
failures at info level (which re-arms the warnings).
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from stat import S_ISDIR, S_ISREG
from typing import NamedTuple

import torch

from ucm.logger import init_logger
from ucm.store.base import FOREIGN
from ucm.store.codecs import CODEC_RAW
from ucm.store.observe import NO_RECORDER, Observation, Recorder
from ucm.store.posix.direct import AlignedBuffers
from ucm.store.posix.format import DIR_MODE, block_file_path, dir_of, not_regular, pack_header, temp_file_path
from ucm.store.posix.scan import remove_path

logger = init_logger(__name__)


def row_bytes(row: torch.Tensor) -> memoryview:
    """A flat ``B`` memoryview of a contiguous CPU ``torch.uint8`` row (the row's own memory, no copy)."""
    return row.numpy().data.cast("B")


def remove_if_unchanged(path: str, stat: os.stat_result) -> bool:
    """Remove the damaged file at ``path`` if it is still the file that was read (``stat``: from that read; a writer
    may have replaced it with a good block meanwhile; the check narrows, but cannot close, that window: at worst a
    good block is lost, which is a miss, never wrong data). A directory in place of a block file is removed only
    when empty (:func:`~ucm.store.posix.scan.remove_path`). Errors are ignored: the block is a miss either way.
    Returns whether the file was removed."""
    try:
        now = os.stat(path)
        if (now.st_dev, now.st_ino, now.st_size, now.st_mtime_ns) != (
            stat.st_dev,
            stat.st_ino,
            stat.st_size,
            stat.st_mtime_ns,
        ):
            return False
        remove_path(path)
    except OSError:
        return False
    return True


def open_block_file(path: str, flags: int) -> tuple[int, os.stat_result]:
    """Open the block file at ``path`` for reading with ``flags`` (``os.open`` flags) and ``fstat`` it, never waiting
    on something that is not a regular file: the open adds ``O_NONBLOCK`` (a FIFO opens at once instead of waiting
    for a writer, a device is not waited for) and ``O_NOCTTY``; a regular file then gets ``O_NONBLOCK`` cleared
    (io_uring would otherwise answer ``EAGAIN`` for data not in the page cache).

    Returns ``(fd, stat)``; ``fd`` is -1 (nothing left open) when the file is not a regular file:
    ``not_regular(stat.st_mode)`` says what it is (also when the open failed because of that: ``O_DIRECT`` refused
    with ``EINVAL`` on a FIFO or directory, ``ENXIO`` on a socket).

    Raises:
        OSError: the open, ``fstat`` or ``fcntl`` failed.
    """
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENXIO):
            raise
        st = os.stat(path)  # classify the refusal: a file that cannot be a block, or a fault of a regular file
        if not_regular(st.st_mode) is None:
            raise
        return -1, st
    try:
        st = os.fstat(fd)
        if not_regular(st.st_mode) is None:
            os.set_blocking(fd, True)
            return fd, st
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return -1, st


class FaultLog:
    """Logs I/O failures once per kind: the first ``(operation, errno)`` failure as a warning, repeats at debug
    level; the first success of an operation after failures at info level, re-arming its warnings."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._warned: set[tuple[str, int]] = set()
        self._failures: dict[str, int] = {}

    def failed(self, op: str, exc: OSError, what: str, outcome: str = "not cached") -> None:
        """Log a failed ``op`` (``"read"``, ``"write"``) on ``what`` (a phrase naming the block and file)."""
        code = exc.errno if exc.errno is not None else -1
        with self._lock:
            first = (op, code) not in self._warned
            self._warned.add((op, code))
            self._failures[op] = self._failures.get(op, 0) + 1
        name = errno.errorcode.get(code, str(code))
        if first:
            logger.warning(
                "posix store: cannot %s %s: %s; %s (further %s %s errors are logged at debug level)",
                op,
                what,
                exc,
                outcome,
                op,
                name,
            )
        else:
            logger.debug("posix store: cannot %s %s: %s", op, what, exc)

    def succeeded(self, op: str) -> None:
        """Record a successful ``op``; the first one after failures is logged and re-arms the warnings."""
        if not self._failures.get(op):  # the common path: no lock
            return
        with self._lock:
            failures = self._failures.pop(op, 0)
            self._warned = {w for w in self._warned if w[0] != op}
        if failures:
            logger.info("posix store: %s works again after %d failed block %ss", op, failures, op)


@dataclass(frozen=True)
class Decoded:
    """What reading and decoding one KVfold file found: ``reason`` (``None``: the row holds the decoded block),
    ``stored_nbytes`` (the container's bytes, 0 when not read), ``raw_nbytes`` (the row's, when decoded), ``mode``
    (the container's, when decoded), and ``seconds`` spent reading and decoding."""

    reason: str | None
    stored_nbytes: int = 0
    raw_nbytes: int = 0
    mode: str | None = None
    seconds: float = 0.0


class DecodeTally:
    """The KVfold files one load met (for its debug line). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.met = 0  # KVfold files whose whole read was attempted
        self.decoded = 0
        self.lossy = 0  # decoded from int8 (fixed_rate) containers
        self.stored_nbytes = 0
        self.raw_nbytes = 0
        self.seconds = 0.0

    def add(self, decoded: Decoded) -> str | None:
        """Count ``decoded``; return its reason."""
        with self._lock:
            self.met += 1
            self.seconds += decoded.seconds
            if decoded.reason is None:
                self.decoded += 1
                self.lossy += decoded.mode == "int8"
                self.stored_nbytes += decoded.stored_nbytes
                self.raw_nbytes += decoded.raw_nbytes
        return decoded.reason


class PreparedWrite(NamedTuple):
    """A block file about to be written: its final ``path``, the ``tmp`` path written first, its ``header`` and
    ``payload``."""

    path: str
    tmp: str
    header: bytes
    payload: memoryview


class BlockFiles:
    """The block files of one store: placement over ``dirs`` and the steps both engines share (see the module
    docstring).

    Args:
        dirs: the storage directories (absolute paths, existing), in placement order.
        direct: this store's per-thread aligned buffers with ``io_direct`` (``O_DIRECT`` reads and writes), else
            ``None``.
        on_written: called with a block file's size in bytes once it is published (capacity accounting).
    """

    def __init__(self, dirs: list[str], direct: AlignedBuffers | None, on_written: Callable[[int], None]) -> None:
        self.dirs = dirs
        self.direct = direct
        self.faults = FaultLog()
        self.ns_tag = 0  # the namespace tag written into the headers from now on (0: not set)
        self.recorder: Recorder = NO_RECORDER  # where failed loads are recorded, with their cause
        self._on_written = on_written
        # The filesystem each directory is on at start: a directory found on another one later was unmounted (its
        # mount point shows) and is not written to until it is back.
        self._dir_devs = {d: os.stat(d).st_dev for d in dirs}

    def path(self, key: bytes) -> str:
        """Path of the file holding ``key``'s block (16-byte key), whether or not it exists."""
        return block_file_path(self.dirs, key)

    def read_flags(self) -> int:
        """``os.open`` flags of a block file read (``O_DIRECT`` with ``io_direct``)."""
        return os.O_RDONLY | (os.O_DIRECT if self.direct is not None else 0)

    def prepare_write(self, key: bytes, payload: memoryview, codec: int = CODEC_RAW) -> PreparedWrite | None:
        """The file to write for ``key``'s block (``payload``: ``B``-format, stored with codec ``codec``), or ``None``
        when its file already exists (content is addressed by key: nothing to write). Anything else at the path (a
        FIFO, device, socket: not a block) is replaced by the write's rename; an empty directory there is removed
        now (a rename cannot replace it; one with entries stays, and the write fails with ``EISDIR``/``ENOTEMPTY``)."""
        path = self.path(key)
        try:
            mode = os.stat(path).st_mode
        except OSError:  # no file (or no access to it): write it
            mode = None
        if mode is not None and S_ISREG(mode):
            return None
        if mode is not None and S_ISDIR(mode):
            with contextlib.suppress(OSError):
                os.rmdir(path)
        return PreparedWrite(path, temp_file_path(path), pack_header(codec, self.ns_tag, key, payload), payload)

    def make_dirs(self, key: bytes, shard: str) -> None:
        """Check that ``key``'s storage directory is still the one of start; create its shard directories ``shard``
        (the two levels below it; never the storage directory itself: one that vanished stays a failure, ENOENT,
        instead of being re-created on the mount point).

        Raises:
            OSError: the storage directory is gone (``ENOENT``) or on another filesystem than at start
                (``ENODEV``), or a shard directory cannot be created.
        """
        root = dir_of(self.dirs, key)
        if os.stat(root).st_dev != self._dir_devs[root]:
            raise OSError(errno.ENODEV, f"storage directory {root} is not on its filesystem of start (unmounted?)")
        if not os.path.isdir(shard):
            for d in (os.path.dirname(shard), shard):
                with contextlib.suppress(FileExistsError):
                    os.mkdir(d, DIR_MODE)

    def write_failed(self, key: bytes, path: str, tmp: str, fd: int, exc: OSError) -> bool:
        """A failed write, either engine: close ``fd`` (when >= 0), remove the temp file, log; returns False."""
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        self.faults.failed("write", exc, f"block {key.hex()} to {path}")
        return False

    def written(self, nbytes: int) -> bool:
        """A block file of ``nbytes`` bytes published; returns True."""
        self.faults.succeeded("write")
        self._on_written(nbytes)
        return True

    def read_outcome(self, key: bytes, path: str, reason: str | OSError | None, stat: os.stat_result | None) -> bool:
        """A read's end, either engine: ``reason`` is ``None`` (valid block), an ``OSError`` (missing file: debug;
        else a fault) or why the file is damaged or foreign (a damaged file, a not regular one included, is removed
        when still ``stat``). Returns the key's success."""
        if isinstance(reason, FileNotFoundError):
            logger.debug("posix store: block %s not found at %s", key.hex(), path)
            self._record_failure(key, "missing")
            return False
        if isinstance(reason, OSError):
            self.faults.failed("read", reason, f"block file {path}", "treating it as a miss")
            self._record_failure(key, "io_error")
            return False
        self.faults.succeeded("read")
        if reason is not None:
            kept = reason.startswith(FOREIGN)
            self._record_failure(key, "foreign" if kept else "damaged")
            removed = False
            if not kept and stat is not None:
                removed = remove_if_unchanged(path, stat)
                self.recorder.record_keys(False, "storage", (key,))
            logger.warning(
                "posix store: damaged block file %s: %s; treating as a miss%s",
                path,
                reason,
                " (file kept: another format, codec or block size)"
                if kept
                else (" and removed it" if removed else " (left in place: changed since read, or not removable)"),
            )
            return False
        return True

    def _record_failure(self, key: bytes, cause: str) -> None:
        """Record one block that failed to load, and why (:data:`ucm.store.observe.FAILURE_CAUSES`)."""
        if self.recorder.enabled:
            self.recorder.record(Observation("load_failure", "storage", 1, cause=cause, key=key.hex()))
