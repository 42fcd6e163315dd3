"""Listing and garbage collection of a Posix store's files: the store's own collector (:class:`Collector`) and the
operator CLI (``python -m ucm.store``) share them.

What lives under a storage directory (see :mod:`ucm.store.posix.format` for the placement and the file format):

- block files: ``*.ucmb`` not starting with ``.``;
- not regular files at block paths (:attr:`StoreScan.irregular`): a FIFO, device, socket or directory named like a
  block file (never a block; damage, listed by ``verify`` and removed by ``verify --remove`` and ``clear``; the
  store's next write of that key replaces it; a directory there is not descended into);
- temp files: ``.*.tmp``, a dump in progress or left behind by a killed writer. A temp file is *stale* when its
  mtime is older than a given age (default :data:`DEFAULT_TMP_AGE_S`); a live writer finishes a block in well
  under that, so only stale temps are ever removed, which is safe with several instances sharing the directory;
- namespace files: ``namespaces/<tag>.json`` directly under a storage directory, one per model namespace that
  wrote blocks there (see :meth:`ucm.store.posix.PosixStore.set_namespace`); not listed by :func:`scan_store`;
- anything else: never touched.

Last use of a block is ``max(atime, mtime)``: a block file is never modified after its rename, so its mtime is its
write time; :class:`~ucm.store.posix.PosixStore` sets the atime of a block file when it serves it (a hit), so
least-recently-used order holds whatever the mount's ``relatime`` / ``noatime`` setting.

Deleting a block file is safe while other processes use the store: a reader that has the file open keeps reading
it (POSIX unlink semantics); a later lookup or load sees a miss, never wrong data. Shard directories are never
removed (a writer may be about to create its temp file there).

A store with a capacity collects while it serves (:class:`Collector`, thread ``ucm-posix-gc``): at start, stale
temp files are removed; block files are removed least recently used first down to ``GC_LOW_WATERMARK`` of the
capacity whenever the store's estimate of the directories' block bytes (the last scan plus this process's writes
since) exceeds it; the directories are re-scanned every ``gc_interval_s`` while this process writes, so other
instances' writes are counted too; the store's ``close`` runs a last collection, so a stopped store is within its
capacity. Several instances may share the directories, each collecting.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from ucm.affinity import daemon_thread
from ucm.logger import init_logger
from ucm.store.observe import NO_RECORDER, Recorder
from ucm.store.posix.format import (
    FILE_SUFFIX,
    FORMAT_VERSION,
    HEADER,
    HEADER_NBYTES,
    MAGIC,
    NAMESPACE_DIR,
    TMP_SUFFIX,
    TRACES_DIR,
    key_of_path,
    not_regular,
)

logger = init_logger(__name__)

DEFAULT_TMP_AGE_S = 3600.0
GC_LOW_WATERMARK = 0.9  # a collection removes blocks down to this fraction of the capacity
DEFAULT_GC_INTERVAL_S = 30.0


@dataclass(frozen=True)
class FileInfo:
    """One file found in the store: absolute path, size in bytes, last use and mtime in ns since the epoch."""

    path: str
    size: int
    last_used_ns: int
    mtime_ns: int


@dataclass
class StoreScan:
    """What :func:`scan_store` found, sorted by kind (see the module docstring)."""

    dirs: list[str]
    blocks: list[FileInfo] = field(default_factory=list)
    temps: list[FileInfo] = field(default_factory=list)
    others: list[FileInfo] = field(default_factory=list)
    irregular: list[FileInfo] = field(default_factory=list)  # not regular files named like block files

    @property
    def block_bytes(self) -> int:
        """Total size of the block files in bytes."""
        return sum(f.size for f in self.blocks)

    def stale_temps(self, tmp_age_s: float, now_ns: int | None = None) -> list[FileInfo]:
        """Temp files whose mtime is more than ``tmp_age_s`` seconds before ``now_ns`` (default: now)."""
        now_ns = time.time_ns() if now_ns is None else now_ns
        limit = now_ns - int(tmp_age_s * 1e9)
        return [f for f in self.temps if f.mtime_ns < limit]


def _is_block_name(name: str) -> bool:
    return name.endswith(FILE_SUFFIX) and not name.startswith(".")


def _walk_files(root: str) -> Iterator[os.DirEntry[str]]:
    """Regular files under ``root``, recursively, except ``root/namespaces/`` and ``root/traces/``, and the entries
    named like block files that are neither regular files nor symlinks (a directory so named is listed, not
    descended into); symlinks are neither followed nor listed. Lists names and types only: nothing is opened."""
    stack = [root]
    skip = {os.path.join(root, NAMESPACE_DIR), os.path.join(root, TRACES_DIR)}
    while stack:
        with contextlib.suppress(FileNotFoundError), os.scandir(stack.pop()) as it:
            for entry in it:
                if entry.is_symlink():
                    continue
                if entry.is_file(follow_symlinks=False) or _is_block_name(entry.name):
                    yield entry
                elif entry.is_dir(follow_symlinks=False) and entry.path not in skip:
                    stack.append(entry.path)


def scan_store(dirs: Sequence[str]) -> StoreScan:
    """List the block, temp and other files under ``dirs`` with their sizes and times (reads no file data), and
    the not regular files at block paths (:attr:`StoreScan.irregular`).

    A file or directory that disappears during the scan (a concurrent gc or rename) is skipped.

    Raises:
        OSError: a directory cannot be listed (permissions).
    """
    scan = StoreScan(dirs=list(dirs))
    for d in dirs:
        for entry in _walk_files(d):
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            info = FileInfo(entry.path, st.st_size, max(st.st_atime_ns, st.st_mtime_ns), st.st_mtime_ns)
            name = entry.name
            if not_regular(st.st_mode) is not None:
                scan.irregular.append(info)
            elif _is_block_name(name):
                scan.blocks.append(info)
            elif name.endswith(TMP_SUFFIX) and name.startswith("."):
                scan.temps.append(info)
            else:
                scan.others.append(info)
    return scan


def gc_plan(scan: StoreScan, target_bytes: int) -> list[FileInfo]:
    """The block files to delete, least recently used first, so that the rest total at most ``target_bytes``.

    Raises:
        ValueError: ``target_bytes`` < 0.
    """
    if target_bytes < 0:
        raise ValueError(f"target must be >= 0 bytes, got {target_bytes}")
    excess = scan.block_bytes - target_bytes
    plan: list[FileInfo] = []
    for f in sorted(scan.blocks, key=lambda f: (f.last_used_ns, f.path)):
        if excess <= 0:
            break
        plan.append(f)
        excess -= f.size
    return plan


def remove_path(path: str) -> None:
    """Remove the file at ``path``: ``unlink``, or ``rmdir`` for a directory (a directory at a block path; only an
    empty one is removed: UCM never deletes a tree it did not write).

    Raises:
        OSError: the removal failed (``ENOTEMPTY`` for a directory with entries; ``FileNotFoundError`` when gone).
    """
    try:
        os.unlink(path)
    except IsADirectoryError:
        os.rmdir(path)
    except PermissionError:  # unlink of a directory is EPERM on some systems (EISDIR on Linux)
        if not os.path.isdir(path):
            raise
        os.rmdir(path)


@dataclass
class Deletion:
    """Result of :func:`delete_files`: files and bytes freed, and ``(path, error)`` for each failed deletion."""

    files: int = 0
    bytes: int = 0
    errors: list[tuple[str, str]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)  # the files freed


def delete_files(
    files: Sequence[FileInfo], progress: Callable[[Sequence[FileInfo]], Iterable[FileInfo]] = iter
) -> Deletion:
    """Remove ``files`` (iterated through ``progress``, e.g. a progress bar; :func:`remove_path`: an empty directory
    too); a file already gone counts as freed, other errors are collected, never raised."""
    result = Deletion()
    for f in progress(files):
        try:
            remove_path(f.path)
        except FileNotFoundError:
            pass
        except OSError as err:
            result.errors.append((f.path, err.strerror or str(err)))
            continue
        result.files += 1
        result.bytes += f.size
        result.paths.append(f.path)
    return result


def keys_of_paths(paths: Iterable[str]) -> list[bytes]:
    """The block keys of the block files at ``paths`` (other names skipped)."""
    return [key for key in map(key_of_path, paths) if key is not None]


def open_noatime(path: str) -> int:
    """Open ``path`` read-only without updating its atime where allowed (``O_NOATIME`` needs file ownership), with
    ``O_NONBLOCK`` and ``O_NOCTTY``, so that a FIFO or device in place of a block file never blocks the open (a
    caller reading a regular file may then clear ``O_NONBLOCK``; a read of a FIFO fails with ``ESPIPE``).

    Raises:
        OSError: the file cannot be opened (``ENXIO`` for a socket).
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY
    noatime = getattr(os, "O_NOATIME", 0)
    if noatime:
        try:
            return os.open(path, flags | noatime)
        except PermissionError:
            pass
    return os.open(path, flags)


def read_namespace_tag(path: str) -> int | None:
    """The namespace tag in the header of the block file at ``path`` (0: not set); ``None`` when the file is not a
    readable UCM block file of this format version."""
    try:
        fd = open_noatime(path)
        try:
            head = os.pread(fd, HEADER_NBYTES, 0)
        finally:
            os.close(fd)
    except OSError:
        return None
    if len(head) != HEADER_NBYTES:
        return None
    magic, version, _codec, tag, _nbytes, _key, _checksum = HEADER.unpack(head)
    return tag if (magic, version) == (MAGIC, FORMAT_VERSION) else None


def namespace_blocks(scan: StoreScan, tag: int) -> list[FileInfo]:
    """The block files of ``scan`` whose header names namespace ``tag`` (reads each block's header)."""
    return [f for f in scan.blocks if read_namespace_tag(f.path) == tag]


@dataclass(frozen=True)
class GcResult:
    """Outcome of one :meth:`Collector.collect` pass (sizes in bytes).

    Attributes:
        block_bytes: block files' total size found by the scan, before removals.
        removed_blocks / removed_temps: what was deleted (files, bytes, errors).
    """

    block_bytes: int
    removed_blocks: Deletion
    removed_temps: Deletion


class Collector:
    """Garbage collection of one store: capacity accounting, collection passes and the maintenance thread
    ``ucm-posix-gc`` (see the module docstring).

    Args:
        dirs: the directories it collects (the store's writable ones).
        where: the store's directories as one string, for log lines.
        capacity_bytes: most bytes of block files over ``dirs`` (``None``: unbounded; only stale temps removed).
        tmp_age_s: temp files older than this (seconds, mtime) are stale.
        gc_interval_s: with a capacity, how often (seconds) the directories are re-scanned while this process
            writes.
    """

    def __init__(
        self, dirs: list[str], where: str, capacity_bytes: int | None, tmp_age_s: float, gc_interval_s: float
    ) -> None:
        self._dirs = dirs
        self._where = where
        self._capacity = capacity_bytes
        self._tmp_age_s = tmp_age_s
        self._gc_interval_s = gc_interval_s
        # Capacity accounting: block bytes found by the last scan plus what this process wrote since.
        self._usage_lock = threading.Lock()
        self._usage_estimate = 0
        self._written_since_scan = 0
        self._deleted_blocks = 0  # block files removed by this collector since start
        self._deleted_bytes = 0
        self._gc_lock = threading.Lock()  # one collection at a time in this process
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._thread = daemon_thread(self._maintain, "ucm-posix-gc")
        self.recorder: Recorder = NO_RECORDER  # told which block files a collection deleted (KV events)

    def start(self) -> None:
        """Start the maintenance thread (a first collection, then collections as writes call for them)."""
        self._thread.start()

    def stop(self) -> None:
        """Stop the maintenance thread and, with a capacity, run a last collection. Call once."""
        self._stop.set()
        self._wakeup.set()
        if self._thread.is_alive() or self._thread.ident is not None:
            self._thread.join()
            if self._capacity is not None:
                self.collect_logged()

    def account_write(self, nbytes: int) -> None:
        """Count a block file of ``nbytes`` bytes written by this process; wake the thread above the capacity."""
        with self._usage_lock:
            self._usage_estimate += nbytes
            self._written_since_scan += nbytes
            over = self._capacity is not None and self._usage_estimate > self._capacity
        if over:
            self._wakeup.set()

    def gauges(self) -> dict[str, float]:
        """For metrics: ``storage:used_bytes`` (block bytes found by the last scan, minus what it removed, plus this
        process's writes since), ``storage:capacity_bytes`` (with a capacity), ``storage:evicted_blocks_total`` /
        ``storage:evicted_bytes_total`` (removed by this collector's garbage collection since start)."""
        with self._usage_lock:
            gauges = {
                "storage:used_bytes": float(self._usage_estimate),
                "storage:evicted_blocks_total": float(self._deleted_blocks),
                "storage:evicted_bytes_total": float(self._deleted_bytes),
            }
        if self._capacity is not None:
            gauges["storage:capacity_bytes"] = float(self._capacity)
        return gauges

    def collect(self) -> GcResult:
        """Scan the directories, remove stale temp files and, above the capacity, least recently used block files
        down to ``GC_LOW_WATERMARK * capacity_bytes``.

        Raises:
            OSError: a storage directory cannot be listed.
        """
        with self._gc_lock:
            with self._usage_lock:
                self._written_since_scan = 0
            scan = scan_store(self._dirs)
            temps = delete_files(scan.stale_temps(self._tmp_age_s))
            plan = []
            if self._capacity is not None and scan.block_bytes > self._capacity:
                plan = gc_plan(scan, int(self._capacity * GC_LOW_WATERMARK))
            blocks = delete_files(plan)
            if self.recorder.tracks_keys:
                self.recorder.record_keys(False, "storage", keys_of_paths(blocks.paths))
            with self._usage_lock:
                self._usage_estimate = scan.block_bytes - blocks.bytes + self._written_since_scan
                self._deleted_blocks += blocks.files
                self._deleted_bytes += blocks.bytes
            return GcResult(scan.block_bytes, blocks, temps)

    def collect_logged(self) -> None:
        """:meth:`collect`, logging what it removed (info) and what it could not (one warning); never raises."""
        try:
            r = self.collect()
        except OSError as exc:
            logger.warning("posix store: garbage collection cannot scan %s: %s", self._where, exc)
            return
        if r.removed_temps.files:
            logger.info("posix store: removed %d stale temp files left by killed writers", r.removed_temps.files)
        if r.removed_blocks.files:
            logger.info(
                "posix store: block files total %.1f MiB, over the capacity of %.1f MiB: removed the %d least "
                "recently used (%.1f MiB)",
                r.block_bytes / 2**20,
                (self._capacity or 0) / 2**20,
                r.removed_blocks.files,
                r.removed_blocks.bytes / 2**20,
            )
        for path, err in (r.removed_blocks.errors + r.removed_temps.errors)[:1]:
            logger.warning("posix store: garbage collection cannot remove %s: %s", path, err)

    def _maintain(self) -> None:
        """Maintenance thread: a first collection (stale temps; capacity), then collections when woken by a write
        over the capacity or every ``gc_interval_s`` while this process writes (only with a capacity)."""
        self.collect_logged()
        if self._capacity is None:
            return
        while not self._stop.is_set():
            self._wakeup.wait(self._gc_interval_s)
            self._wakeup.clear()
            if self._stop.is_set():
                return
            with self._usage_lock:
                due = self._usage_estimate > self._capacity or self._written_since_scan > 0
            if due:
                self.collect_logged()
