"""``Posix`` store stage: one file per block under one or more directories.

Placement: a key goes to directory ``dirs[int.from_bytes(key[:8], "little") % len(dirs)]`` and, inside it, to
``<hex[0:2]>/<hex[2:4]>/<hex>.ucmb`` where ``hex = key.hex()``. Shard directories are created on demand. The
mapping depends only on the key and on the ordered directory list, so every process configured with the same
``storage_backends`` finds the same files.

File format (version 1), all integers little-endian, ``HEADER_NBYTES`` = 44 bytes of header then the payload:

======  =====  =============================================================
offset  size   field
======  =====  =============================================================
0       4      magic ``b"UCMB"``
4       2      format version (u16, ``FORMAT_VERSION`` = 1)
6       2      codec (u16): ``CODEC_RAW`` = 0: the payload is the block's bytes; ``CODEC_KVFOLD`` = 1: a KVfold
               container (``ucm.store.kvfold``) written through :meth:`PosixStore.dump_encoded`
8       4      namespace tag (u32): the first 4 bytes of the model namespace digest, 0 when not set (see
               ``set_namespace``); informational (the key already separates namespaces), not checked on load
12      8      payload size in bytes (u64)
20      16     the block key
36      8      checksum of the payload: ``xxhash.xxh3_64_intdigest(payload)`` (u64)
44      n      payload
======  =====  =============================================================

A file is complete or absent: ``dump`` writes a hidden temporary file
(``.<hex>.<pid>.<thread id>.<random hex>.tmp``) in the final shard directory and renames it over the final
name (``os.replace``), so ``lookup`` never sees a half-written block. Files are not fsync'ed: a file torn by a
power loss fails the size or checksum check on ``load`` and is reported as a miss, never as data.

Encoded blocks (the ``Compress`` stage): :meth:`PosixStore.dump_encoded` stores a payload of any size with the
codec the caller names; :meth:`PosixStore.load_encoded` hands a file's codec and payload to the caller's decoder,
on the I/O thread that read it, after checking magic, version, key, exact size and checksum (the checksum covers the
stored, i.e. compressed, bytes). Encoded loads run on the pool threads with positional reads for either engine, each
thread reading into a buffer of its own that it reuses; encoded dumps use the configured engine.

A plain ``load``/``load_sharded`` (``Cache|Posix``, ``Posix``) also reads KVfold files, so a store filled by
``Cache|Compress|Posix`` stays readable after switching back to ``Cache|Posix``, and instances of both pipelines can
share a directory: such a file is read whole into the reading thread's buffer, checked as by ``load_encoded``, and
decoded into the row by :func:`ucm.store.kvfold.decode_block` (bit-exact for lossless containers; a fixed-rate
container decodes to its lossy values, as the Compress stage reads it). Raw files keep the direct path (read
straight into the row). The codec module is imported on the first KVfold file met (its kernels are not needed for raw
files; the first decode in a process also loads numba's compiled kernels).

``load`` validates magic, version, codec, payload size, key, exact file size (no trailing bytes) and checksum
before reporting a block as loaded (for a KVfold file: the stored size and checksum, then the container decodes to a
block of the row's size); anything else is a failed key (a cache miss for the caller). A damaged file (including a
KVfold container that does not decode) is removed, so the block is recomputed and stored again instead of failing
every later load; a file of another format version, codec, block size or KVfold container version (another UCM
version sharing the directory, or a caller's size mismatch) is left in place.

Files are created with mode ``0o600`` and shard directories with ``0o700`` (the process umask applies on top): only
the serving user reads the KV it wrote. The storage directories themselves must exist or be creatable at start,
and be writable unless the store is opened with ``require_writable=False`` (a ``kv_consumer``: read-only
directories are then only read). A storage directory that disappears while serving (deleted, or unmounted: found on
another filesystem than at start) is not re-created nor written to: dumps to it fail with one warning per error kind
(``ENOENT``, ``ENODEV``) and loads miss, until it is back.

Faults never raise out of ``load``/``dump``: an ``OSError`` (``ENOSPC``, ``EROFS``, ``EACCES``, ``EIO``, ``ENOENT``,
...) fails the key, which the caller treats as a miss (load) or as a block not cached (dump). The first failure of
each kind (operation and errno) is logged as a warning, later ones at debug level; the first success after failures
is logged at info level and re-arms the warnings.

Maintenance (a background thread ``ucm-posix-gc``): at start, stale temp files (mtime older than ``tmp_age_s``,
left by killed writers) are removed. With ``capacity_bytes``, block files are garbage-collected least recently used
first (see :mod:`ucm.store.posix_scan`; serving a block refreshes its recency) down to
``GC_LOW_WATERMARK * capacity_bytes`` whenever the store's estimate of the directory's block bytes (the last scan
plus this process's writes since) exceeds the capacity; the directories are re-scanned every ``gc_interval_s``
while this process writes, so other instances' writes are counted too; ``close`` runs a last collection, so a
stopped store is within its capacity. Several instances may share the directories, each collecting: a block removed
under a reader is a miss, never wrong data.
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import secrets
import struct
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Any, Literal

import torch
import xxhash

from ucm.affinity import daemon_thread, thread_pool
from ucm.logger import init_logger
from ucm.store.base import (
    BlockCorruptedError,
    RowCallback,
    ShardProgress,
    Task,
    TaskResult,
    UcmKVStoreBase,
    call_on_row,
    check_keys,
    check_keys_and_buffer,
    check_shards,
    report_whole,
)
from ucm.store.posix_scan import (
    DEFAULT_TMP_AGE_S,
    FILE_SUFFIX,
    NAMESPACE_DIR,
    TMP_SUFFIX,
    Deletion,
    delete_files,
    gc_plan,
    scan_store,
)
from ucm.store.posix_uring import Uring

logger = init_logger(__name__)

MAGIC = b"UCMB"
FORMAT_VERSION = 1
CODEC_RAW = 0
CODEC_KVFOLD = 1  # a KVfold container (ucm.store.kvfold), written by the Compress stage
FILE_MODE = 0o600
DIR_MODE = 0o700
GC_LOW_WATERMARK = 0.9  # a collection removes blocks down to this fraction of the capacity
DEFAULT_GC_INTERVAL_S = 30.0
DIRECT_ALIGN = 4096  # O_DIRECT: buffers, offsets and lengths in multiples of this (covers 512 B and 4 KiB sectors)
# aio + O_DIRECT: most bytes of aligned buffers held by operations in flight (16 blocks of 16 MiB; the io_uring's depth
# bounds small blocks first). psync + O_DIRECT holds one buffer per I/O thread instead.
AIO_DIRECT_BUFFER_BYTES = 256 << 20
# load_sharded: the least bytes one read of a key's shards covers (small layer shards are read several at a time).
SHARDED_READ_BYTES = 512 << 10
# magic, version, codec, namespace tag, payload nbytes, key, checksum
HEADER = struct.Struct("<4sHHIQ16sQ")
HEADER_NBYTES = HEADER.size  # 44


def _split_backends(storage_backends: str | Sequence[str]) -> list[str]:
    if isinstance(storage_backends, (str, os.PathLike)):
        parts = os.fspath(storage_backends).split(":")
    else:
        parts = [os.fspath(p) for p in storage_backends]
    if not parts or any(not p for p in parts):
        raise ValueError(f"storage_backends must name one or more directories joined by ':', got {storage_backends!r}")
    return [os.path.abspath(p) for p in parts]


def _prepare_dir(path: str, require_writable: bool) -> bool:
    """Check (and create) a storage directory; return whether this process can write to it.

    Raises:
        ValueError: ``path`` is not a directory, cannot be created, or (with ``require_writable``) is not writable.
    """
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"storage backend {path!r} exists and is not a directory")
    try:
        os.makedirs(path, mode=DIR_MODE, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"storage backend {path!r} cannot be created: {exc}") from exc
    if not os.access(path, os.R_OK | os.X_OK):
        raise ValueError(f"storage backend {path!r} is not readable")
    writable = os.access(path, os.W_OK | os.X_OK)
    if not writable and require_writable:
        raise ValueError(
            f"storage backend {path!r} is not writable (a read-only store can only serve kv_role: kv_consumer)"
        )
    return writable


class _Gather:
    """Combines per-key futures (each resolving to ``True`` on success) into one ``Future[TaskResult]``;
    ``on_row`` (optional) is called as ``on_row(index, ok)`` as each key is done; ``on_finish`` (optional) runs once
    all keys are done, just before the result is set (so whoever waits for the task sees what it did, e.g. a log
    line)."""

    def __init__(
        self,
        num_keys: int,
        what: str,
        on_finish: Callable[[], None] | None = None,
        on_row: RowCallback | None = None,
    ) -> None:
        self.future: Future[TaskResult] = Future()
        self._num_keys = num_keys
        self._what = what
        self._on_finish = on_finish
        self._on_row = on_row
        self._remaining = num_keys
        self._failed: set[int] = set()
        self._lock = threading.Lock()

    def add(self, index: int, future: Future[bool]) -> None:
        future.add_done_callback(lambda f: self._done(index, f))

    def _done(self, index: int, future: Future[bool]) -> None:
        ok = False
        exc = future.exception()
        if exc is not None:
            # A bug, not an I/O error (those are handled per key): report the key as failed, loudly.
            logger.error("posix store: unexpected error in %s of key index %d", self._what, index, exc_info=exc)
        else:
            ok = future.result()
        call_on_row(self._on_row, index, ok)  # before the key counts as done: the task's result follows every hook
        with self._lock:
            if not ok:
                self._failed.add(index)
            self._remaining -= 1
            finished = self._remaining == 0
        if finished:
            if self._on_finish is not None:
                try:
                    self._on_finish()
                except Exception:  # a bug in a log line must not hang the task
                    logger.exception("posix store: unexpected error finishing a %s", self._what)
            self.future.set_result(TaskResult(self._num_keys, frozenset(self._failed)))


@dataclass(frozen=True)
class GcResult:
    """Outcome of one :meth:`PosixStore.collect_garbage` pass (sizes in bytes).

    Attributes:
        block_bytes: block files' total size found by the scan, before removals.
        removed_blocks / removed_temps: what was deleted (files, bytes, errors).
    """

    block_bytes: int
    removed_blocks: Deletion
    removed_temps: Deletion


class PosixStore(UcmKVStoreBase):
    """Store stage keeping one file per block on POSIX directories (local SSD, NFS, 3FS...).

    Buffers follow the contract of :mod:`ucm.store.base`: CPU ``torch.uint8`` tensors
    ``[num_keys, block_nbytes]``, one row per key. Loads and dumps run on a thread pool, one file per job; with the
    ``aio`` engine the pool only opens files and queues their data transfer on an io_uring (see
    :mod:`ucm.store.posix_uring`), whose reaper thread validates, closes and renames. KVfold files (written by a
    ``Compress`` stage sharing the directories) are read too and decoded into their rows (see :meth:`load`). See the
    module docstring for the file format, fault handling and garbage collection.

    Args:
        storage_backends: one directory, several joined by ``':'``, or a sequence of directories. Missing
            directories are created. The order matters: it decides which directory holds which key.
        io_threads: number of I/O worker threads (>= 1).
        capacity_bytes: most bytes of block files to keep over all directories (file sizes; ``None``: unbounded).
        tmp_age_s: temp files older than this (seconds, mtime) are removed at start as left by killed writers.
        gc_interval_s: with a capacity, how often (seconds) the directories are re-scanned while this process
            writes.
        io_direct: read and write block files with ``O_DIRECT`` (bypassing the page cache) through page-aligned
            buffers, in whole ``DIRECT_ALIGN`` (4 KiB) units; files keep their exact size (the padded last unit is
            truncated away), byte-identical to buffered ones. ``psync``: one buffer per pool thread; ``aio``: one
            buffer per operation in flight, at most ``AIO_DIRECT_BUFFER_BYTES`` (256 MiB) of them at once. Checked
            at start on every directory.
        io_engine: ``"psync"``: the pool threads read and write with positional syscalls (``preadv``/``write``);
            ``"aio"``: block data moves through io_uring ``readv``/``writev`` with many blocks in flight (needs the
            ``liburing`` package and a kernel allowing io_uring), buffered or with ``io_direct``. Encoded blocks
            (:meth:`load_encoded`) and KVfold files met by :meth:`load` / :meth:`load_sharded` are read and decoded
            on the pool threads with either engine.
        require_writable: refuse directories this process cannot write to (default). With ``False`` (a
            ``kv_consumer``, which only loads) a read-only directory (read-only mount or permissions) is accepted
            and only read: no namespace file, no temp clean-up or garbage collection there, and a damaged block in
            it is a miss that stays in place (logged once at start).

    Raises:
        ValueError: ``storage_backends`` is empty or has an empty entry; a path exists but is not a directory,
            cannot be created, or is not writable; ``io_threads`` < 1; ``capacity_bytes`` <= 0; ``tmp_age_s`` or
            ``gc_interval_s`` <= 0; ``io_direct`` and a directory's filesystem refuses ``O_DIRECT``; an unknown
            ``io_engine``, or ``aio`` where io_uring is not usable (no silent fallback).
    """

    def __init__(
        self,
        storage_backends: str | Sequence[str],
        *,
        io_threads: int = 4,
        capacity_bytes: int | None = None,
        tmp_age_s: float = DEFAULT_TMP_AGE_S,
        gc_interval_s: float = DEFAULT_GC_INTERVAL_S,
        io_direct: bool = False,
        io_engine: Literal["psync", "aio"] = "psync",
        require_writable: bool = True,
    ) -> None:
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0 or None (unbounded), got {capacity_bytes}")
        if tmp_age_s <= 0 or gc_interval_s <= 0:
            raise ValueError(f"tmp_age_s and gc_interval_s must be > 0, got {tmp_age_s} and {gc_interval_s}")
        if io_engine not in ("psync", "aio"):
            raise ValueError(f"posix_io_engine must be 'psync' or 'aio', got {io_engine!r}")
        self._dirs = _split_backends(storage_backends)
        self._read_only_dirs = {d for d in self._dirs if not _prepare_dir(d, require_writable)}
        for d in sorted(self._read_only_dirs):
            logger.info("posix store: storage backend %s is read-only: blocks are only loaded from it", d)
        # The filesystem each directory is on at start: a directory found on another one later was unmounted (its
        # mount point shows) and is not written to until it is back.
        self._dir_devs = {d: os.stat(d).st_dev for d in self._dirs}
        self._direct: _AlignedBuffers | None = None
        if io_direct:
            if not hasattr(os, "O_DIRECT"):
                raise ValueError("io_direct: true needs O_DIRECT, which this platform lacks; allowed: io_direct: false")
            for d in self._dirs:
                _check_direct_io(d)
            self._direct = _AlignedBuffers()
        # Last of the checks that may refuse the start: nothing is left running when it raises.
        self._uring: Uring | None = Uring() if io_engine == "aio" else None
        # aio + O_DIRECT: aligned buffers owned per operation (filled on a pool thread, released on the reaper).
        self._direct_pool: _DirectBufferPool | None = None
        if self._uring is not None and io_direct:
            self._direct_pool = _DirectBufferPool(AIO_DIRECT_BUFFER_BYTES)
        self._capacity = capacity_bytes
        self._tmp_age_s = tmp_age_s
        self._gc_interval_s = gc_interval_s
        self._pool = thread_pool(io_threads, "ucm-posix")
        self._closed = False
        self._close_lock = threading.Lock()
        self._tasks: set[Future[TaskResult]] = set()  # aio: tasks not done yet, which close waits for
        self._tasks_lock = threading.Lock()
        self._faults = _FaultLog()
        self._lossy_logged = False
        self._ns_tag = 0
        # Capacity accounting: block bytes found by the last scan plus what this process wrote since.
        self._usage_lock = threading.Lock()
        self._usage_estimate = 0
        self._written_since_scan = 0
        self._gc_lock = threading.Lock()  # one collection at a time in this process
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._maintenance = daemon_thread(self._maintain, "ucm-posix-gc")
        if len(self._read_only_dirs) < len(self._dirs):  # nothing to clean up or collect where nothing is written
            self._maintenance.start()

    @property
    def dirs(self) -> list[str]:
        """The storage directories (absolute paths), in placement order."""
        return list(self._dirs)

    @property
    def capacity_bytes(self) -> int | None:
        """The capacity in bytes of block files, ``None`` when unbounded."""
        return self._capacity

    def block_path(self, key: bytes) -> str:
        """Path of the file holding ``key``'s block (16-byte key), whether or not it exists."""
        return block_file_path(self._dirs, key)

    def _dir_of(self, key: bytes) -> str:
        return _dir_of(self._dirs, key)

    # -- contract -------------------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` (16-byte ``bytes``) whose block file exists. Reads no block data.

        Raises:
            TypeError / ValueError: a key is not 16 ``bytes``.
        """
        check_keys(keys)
        n = 0
        for key in keys:
            if not os.path.exists(self.block_path(key)):
                break
            n += 1
        return n

    def load(self, keys: Sequence[bytes], dst: torch.Tensor) -> Task:
        """Start reading the blocks of ``keys`` into the rows of ``dst`` (uint8 ``[len(keys), nbytes]``).

        A key fails (its index is in ``TaskResult.failed``, its row unspecified) when its file is missing or
        fails validation (header, size, key, trailing bytes, checksum) or on any ``OSError``. A block served
        refreshes its file's recency (atime) for garbage collection.

        Raw files (codec ``CODEC_RAW``) are read straight into their rows. A KVfold file (codec ``CODEC_KVFOLD``,
        written by a ``Compress`` stage) is read whole into the pool thread's buffer (with either
        engine), checked as :meth:`load_encoded` does (header, key, exact size, checksum of the stored bytes), then
        decoded into its row with :func:`ucm.store.kvfold.decode_block`: bit-exact for a lossless container; a
        fixed-rate (``int8``, lossy) container decodes to its lossy values, exactly as the ``Compress`` stage reads
        it (logged once at info level). A container that does not decode is damaged (a miss; removed); one that
        decodes to another size than the row (another block size) or that this version does not know (container
        version, mode or dtype) is foreign (a miss; kept). Files of other codecs are foreign. With
        ``UC_LOGGER_LEVEL=debug``, a load that met KVfold files logs one line with how many blocks it decoded.

        Raises:
            TypeError / ValueError: bad keys or ``dst`` (see :func:`~ucm.store.base.check_keys_and_buffer`).
            RuntimeError: the store is closed.
        """
        check_keys_and_buffer(keys, dst, "dst")
        tally = _DecodeTally()
        return self._submit_all(
            keys,
            lambda i: self._load_one(keys[i], dst[i], tally),
            lambda i, done: self._load_start(keys[i], dst[i], done, tally),
            "load",
            lambda: self._log_decodes(tally, len(keys)),
        )

    def load_sharded(
        self,
        keys: Sequence[bytes],
        dst: torch.Tensor,
        num_shards: int,
        progress: ShardProgress | None = None,
        on_row: RowCallback | None = None,
    ) -> Task:
        """Start reading the blocks of ``keys`` into ``dst`` shard by shard (``num_shards`` equal byte ranges of
        each row; a layerwise load: one per layer), all rows' shard 0 first, then shard 1, and so on, so that
        :meth:`~ucm.store.base.Task.wait_shard` returns shard ``s`` while later shards are still being read.

        Each key's file is opened once; its shards are read in runs of consecutive shards of at least
        ``SHARDED_READ_BYTES`` (one positional read per run and key, on the I/O threads, with either
        ``posix_io_engine``; with ``io_direct``, through an aligned buffer covering the range), all keys' first run
        before any key's second, and so on. The header is read with the first run; once all its runs are in, the
        block is validated exactly as by :meth:`load` (header, key, exact size, checksum of the whole payload) and
        the task reports it loaded or failed. Shards handed out by ``wait_shard`` are therefore not validated yet:
        a caller that uses them early must drop a row that the task's result names as failed. ``progress`` and
        ``on_row`` (called on the I/O thread that validated the row, or failed it): as in
        :meth:`~ucm.store.base.UcmKVStoreBase.load_sharded`.

        KVfold files (codec ``CODEC_KVFOLD``): the run that opens a file whose size is not the raw block's reads its
        header; for a KVfold file it reads the whole file and decodes it into the row as :meth:`load` does, holding
        the key's other runs until it is done (they then read nothing), so none of the row's shards is reported
        before the decoded bytes are in it (the layerwise connector scatters shards as they are reported and does
        not scatter a valid row again). A KVfold file of exactly the raw file's size (possible in principle for a
        barely compressible lossless block) is only recognized from the header read with shard 0, after other
        shards of the row may have been reported with the file's compressed bytes: such a row is reported failed
        (a miss; the file is kept and :meth:`load` decodes it), never as loaded.

        Raises:
            TypeError / ValueError: bad keys or ``dst`` (see :func:`~ucm.store.base.check_keys_and_buffer`), or
                ``num_shards`` not dividing the row size.
            RuntimeError: the store is closed.
        """
        check_keys_and_buffer(keys, dst, "dst")
        shard_nbytes = check_shards(dst, num_shards)
        if num_shards == 1 or not keys:
            return report_whole(self.load(keys, dst), progress, len(keys), on_row)
        if self._closed:
            raise RuntimeError("PosixStore is closed")
        if progress is None:
            progress = ShardProgress(num_shards, len(keys))
        tally = _DecodeTally()
        gather = _Gather(len(keys), "load", lambda: self._log_decodes(tally, len(keys)), on_row)
        per_read = max(1, -(-SHARDED_READ_BYTES // shard_nbytes))  # shards per read
        ranges = [(a, min(a + per_read, num_shards)) for a in range(0, num_shards, per_read)]
        reads = [_ShardedRead(key, self.block_path(key), dst[i], len(ranges), tally) for i, key in enumerate(keys)]
        for i, read in enumerate(reads):
            gather.add(i, read.future)
        for first, stop in ranges:
            for read in reads:
                self._pool.submit(self._load_shards, read, first, stop, shard_nbytes, progress)
        return Task(gather.future, progress)

    def dump(self, keys: Sequence[bytes], src: torch.Tensor) -> Task:
        """Start writing the rows of ``src`` (uint8 ``[len(keys), block_nbytes]``) as the blocks of ``keys``.

        A key whose file already exists is skipped and counted as stored (content is addressed by key). I/O
        errors never raise: the key is reported failed and one warning per errno kind is logged.

        Raises:
            TypeError / ValueError: bad keys or ``src`` (see :func:`~ucm.store.base.check_keys_and_buffer`).
            RuntimeError: the store is closed.
        """
        check_keys_and_buffer(keys, src, "src")
        return self._submit_all(
            keys,
            lambda i: self._dump_one(keys[i], _bytes_of(src[i])),
            lambda i, done: self._dump_start(keys[i], _bytes_of(src[i]), done),
            "dump",
        )

    def dump_encoded(
        self, keys: Sequence[bytes], payloads: Sequence[bytes | bytearray | memoryview], codecs: Sequence[int]
    ) -> Task:
        """Start writing ``payloads[i]`` (any size, may differ per key) as the block of ``keys[i]``, recording
        ``codecs[i]`` (u16) in its header. Same semantics as :meth:`dump` otherwise (existing files are skipped and
        count as stored; errors fail the key). ``payloads`` must stay unchanged until the task is done.

        Raises:
            TypeError / ValueError: bad keys; ``payloads`` or ``codecs`` not one per key; a codec outside u16.
            RuntimeError: the store is closed.
        """
        check_keys(keys)
        if len(payloads) != len(keys) or len(codecs) != len(keys):
            raise ValueError(
                f"need one payload and one codec per key: {len(keys)} keys, {len(payloads)} payloads, "
                f"{len(codecs)} codecs"
            )
        for c in codecs:
            if not 0 <= c <= 0xFFFF:
                raise ValueError(f"codec must be a u16, got {c}")
        views = [memoryview(p).cast("B") for p in payloads]
        return self._submit_all(
            keys,
            lambda i: self._dump_one(keys[i], views[i], codecs[i]),
            lambda i, done: self._dump_start(keys[i], views[i], done, codecs[i]),
            "dump",
        )

    def load_encoded(
        self,
        keys: Sequence[bytes],
        max_nbytes: int,
        consume: Callable[[int, EncodedBlock], str | None],
    ) -> Task:
        """Start reading the blocks of ``keys`` whatever their codec, each handed to ``consume(i, block)`` on the I/O
        thread that read it, as soon as it is read and checked (magic, version, key, exact size, checksum of the
        stored bytes), so the caller decodes block ``i`` while later blocks are still being read.

        ``block.payload`` is a view of the reading thread's buffer (reused for its next read: no allocation, no copy
        per block), valid only during the call: ``consume`` must copy or decode it before returning. It returns
        ``None`` when it used the block, else why not: a reason starting with :data:`FOREIGN` (e.g. a codec or
        container it does not know) fails the key and keeps the file; any other reason fails the key as damaged
        (warning; the file is removed). An exception from ``consume`` fails the key (logged as an error). A missing
        file, a file failing the checks or one whose payload is over ``max_nbytes`` bytes (foreign: kept) is never
        handed over. Reads use the pool threads with positional reads (``O_DIRECT`` with ``io_direct``) for either
        engine; each pool thread keeps one buffer of the largest file it read (``io_threads`` buffers in all).

        Raises:
            TypeError / ValueError: bad keys; ``max_nbytes`` < 1.
            RuntimeError: the store is closed.
        """
        check_keys(keys)
        if max_nbytes < 1:
            raise ValueError(f"max_nbytes must be >= 1, got {max_nbytes}")

        def job(i: int) -> bool:
            return self._load_encoded_one(keys[i], i, max_nbytes, consume)

        def aio_job(i: int, done: Future[bool]) -> None:
            done.set_result(job(i))

        return self._submit_all(keys, job, aio_job, "load")

    def set_namespace(self, tag: bytes, info: dict[str, Any]) -> None:
        """Tag the blocks dumped from now on with ``namespace_tag(tag)`` (header field) and describe the namespace
        in ``<dir>/namespaces/<tag as 8 hex digits>.json`` of every storage directory, for ``python -m ucm.store
        stats``/``clear --namespace``. A file that cannot be written is a warning, never an error.

        Raises:
            ValueError: ``tag`` is shorter than 4 bytes; TypeError: ``info`` is not JSON-serializable.
        """
        self._ns_tag = namespace_tag(tag)
        text = json.dumps({"tag": f"{self._ns_tag:08x}", **info}, sort_keys=True, indent=1)
        for d in self._dirs:
            if d in self._read_only_dirs:
                continue
            path = os.path.join(d, NAMESPACE_DIR, f"{self._ns_tag:08x}.json")
            try:
                with open(path) as f:
                    if f.read() == text:
                        continue
            except OSError:
                pass
            tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}"
            try:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(os.path.dirname(path), DIR_MODE)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
                with open(fd, "w") as f:
                    f.write(text)
                os.replace(tmp, path)
            except OSError as exc:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                logger.warning("posix store: cannot write namespace file %s: %s", path, exc)

    def close(self) -> None:
        """Wait for the running I/O jobs (with ``aio``, until the io_uring has no operation in flight), stop the
        worker threads and, with a capacity, run a last collection so that the directories are within it.
        Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if self._uring is not None:
            # An io_uring request is cancelled when the thread that submitted it exits: let every task finish
            # (its operations completed) before the pool's threads stop.
            with self._tasks_lock:
                tasks = list(self._tasks)
            futures_wait(tasks)
        self._pool.shutdown(wait=True)
        if self._uring is not None:  # nothing in flight: stop the reaper, release the ring
            self._uring.close()
        self._stop.set()
        self._wakeup.set()
        if self._maintenance.is_alive() or self._maintenance.ident is not None:
            self._maintenance.join()
            if self._capacity is not None:
                self._collect_logged()

    def collect_garbage(self) -> GcResult:
        """Scan the directories, remove stale temp files and, above the capacity, least recently used block files
        down to ``GC_LOW_WATERMARK * capacity_bytes``. Runs in the maintenance thread; callable directly.

        Raises:
            OSError: a storage directory cannot be listed.
        """
        with self._gc_lock:
            with self._usage_lock:
                self._written_since_scan = 0
            scan = scan_store([d for d in self._dirs if d not in self._read_only_dirs])
            temps = delete_files(scan.stale_temps(self._tmp_age_s))
            plan = []
            if self._capacity is not None and scan.block_bytes > self._capacity:
                plan = gc_plan(scan, int(self._capacity * GC_LOW_WATERMARK))
            blocks = delete_files(plan)
            with self._usage_lock:
                self._usage_estimate = scan.block_bytes - blocks.bytes + self._written_since_scan
            return GcResult(scan.block_bytes, blocks, temps)

    # -- internals ------------------------------------------------------------------------------------------

    def _collect_logged(self) -> None:
        try:
            r = self.collect_garbage()
        except OSError as exc:
            logger.warning("posix store: garbage collection cannot scan %s: %s", ":".join(self._dirs), exc)
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
        """Maintenance thread: a first collection (stale temps; capacity), then collections when woken by a dump
        over the capacity or every ``gc_interval_s`` while this process writes (only with a capacity)."""
        self._collect_logged()
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
                self._collect_logged()

    def _account_write(self, nbytes: int) -> None:
        if self._capacity is None:
            return
        with self._usage_lock:
            self._usage_estimate += nbytes
            self._written_since_scan += nbytes
            over = self._usage_estimate > self._capacity
        if over:
            self._wakeup.set()

    def _submit_all(
        self,
        keys: Sequence[bytes],
        job: Callable[[int], bool],
        aio_job: Callable[[int, Future[bool]], None],
        what: str,
        on_finish: Callable[[], None] | None = None,
    ) -> Task:
        """Run ``job(i)`` (psync: the whole transfer, returns success) or ``aio_job(i, done)`` (aio: opens and
        queues the transfer; ``done`` is resolved by the job on an early failure, else by the io_uring reaper) for
        every key on the pool; ``on_finish`` as in :class:`_Gather`."""
        if self._closed:
            raise RuntimeError("PosixStore is closed")
        if not keys:
            return Task.completed(TaskResult(0))
        gather = _Gather(len(keys), what, on_finish)
        if self._uring is not None:
            with self._tasks_lock:
                self._tasks.add(gather.future)
            gather.future.add_done_callback(self._task_done)
        for i in range(len(keys)):
            if self._uring is None:
                gather.add(i, self._pool.submit(job, i))
            else:
                done: Future[bool] = Future()
                gather.add(i, done)
                self._pool.submit(_resolve_on_error, aio_job, i, done)
        return Task(gather.future)

    def _task_done(self, future: Future[TaskResult]) -> None:
        with self._tasks_lock:
            self._tasks.discard(future)

    def _make_shard_dirs(self, shard: str) -> None:
        """Create the two shard levels below an existing storage directory (never the storage directory itself:
        one that vanished stays a failure, ENOENT, instead of being re-created on the mount point)."""
        parent = os.path.dirname(shard)
        for d in (parent, shard):
            with contextlib.suppress(FileExistsError):
                os.mkdir(d, DIR_MODE)

    def _dump_prepare(
        self, key: bytes, payload: memoryview, codec: int = CODEC_RAW
    ) -> tuple[str, str, bytes, memoryview] | None:
        """``(path, temp path, header, payload)`` of ``key``'s block, or ``None`` when its file already exists."""
        path = self.block_path(key)
        if os.path.exists(path):
            return None
        shard, name = os.path.split(path)
        tmp = os.path.join(
            shard,
            f".{name[: -len(FILE_SUFFIX)]}.{os.getpid()}.{threading.get_ident()}.{secrets.token_hex(4)}{TMP_SUFFIX}",
        )
        header = HEADER.pack(
            MAGIC, FORMAT_VERSION, codec, self._ns_tag, payload.nbytes, key, xxhash.xxh3_64_intdigest(payload)
        )
        return path, tmp, header, payload

    def _dump_dirs_ready(self, key: bytes, shard: str) -> None:
        """Check that ``key``'s storage directory is still the one of start; create its shard directories."""
        root = self._dir_of(key)
        if os.stat(root).st_dev != self._dir_devs[root]:
            raise OSError(errno.ENODEV, f"storage directory {root} is not on its filesystem of start (unmounted?)")
        if not os.path.isdir(shard):
            self._make_shard_dirs(shard)

    def _dump_failed(self, key: bytes, path: str, tmp: str, fd: int, exc: OSError) -> bool:
        """A failed write, either engine: close ``fd`` (when >= 0), remove the temp file, log; returns False."""
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        self._faults.failed("write", exc, f"block {key.hex()} to {path}")
        return False

    def _dump_succeeded(self, nbytes: int) -> bool:
        self._faults.succeeded("write")
        self._account_write(nbytes)
        return True

    def _dump_one(self, key: bytes, payload: memoryview, codec: int = CODEC_RAW) -> bool:
        prepared = self._dump_prepare(key, payload, codec)
        if prepared is None:
            return True
        path, tmp, header, payload = prepared
        fd = -1
        try:
            self._dump_dirs_ready(key, os.path.dirname(path))
            if self._direct is None:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
                _write_all(fd, memoryview(header))
                _write_all(fd, payload)
            else:  # one aligned write of header + payload + zero padding, then the padding is cut off
                total = HEADER_NBYTES + payload.nbytes
                buf = self._direct.get(_round_up(total))
                buf[:HEADER_NBYTES] = header
                buf[HEADER_NBYTES:total] = payload
                buf[total:] = bytes(buf.nbytes - total)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, FILE_MODE)
                _write_all(fd, buf)
                if buf.nbytes != total:
                    os.ftruncate(fd, total)
            os.close(fd)
            fd = -1
            os.replace(tmp, path)
        except OSError as exc:
            return self._dump_failed(key, path, tmp, fd, exc)
        return self._dump_succeeded(HEADER_NBYTES + payload.nbytes)

    def _dump_start(self, key: bytes, payload: memoryview, done: Future[bool], codec: int = CODEC_RAW) -> None:
        """aio dump, on a pool thread: create the temp file and queue header + payload as one ``writev``; the
        reaper finishes in :meth:`_dump_complete`. With ``io_direct`` the temp file is opened with ``O_DIRECT`` and
        the ``writev`` moves one aligned buffer of the operation's own (header, payload, zeros up to whole
        ``DIRECT_ALIGN`` units), given back at completion; :meth:`_dump_complete` truncates the padding away."""
        assert self._uring is not None
        prepared = self._dump_prepare(key, payload, codec)
        if prepared is None:
            done.set_result(True)
            return
        path, tmp, header, payload = prepared
        pool = self._direct_pool
        fd = -1
        try:
            self._dump_dirs_ready(key, os.path.dirname(path))
            direct = os.O_DIRECT if pool is not None else 0
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | direct, FILE_MODE)
        except OSError as exc:
            done.set_result(self._dump_failed(key, path, tmp, fd, exc))
            return
        total = HEADER_NBYTES + payload.nbytes
        aligned: memoryview | None = None
        try:
            if pool is None:
                bufs = [memoryview(header), payload] if payload.nbytes else [memoryview(header)]
            else:
                aligned = pool.acquire(total)
                _fill_aligned(aligned, header, payload)
                bufs = [aligned]
            written = sum(b.nbytes for b in bufs)

            def complete(res: int) -> None:
                try:
                    ok = self._dump_complete(key, path, tmp, fd, total, res, written)
                finally:
                    if aligned is not None and pool is not None:
                        pool.release(aligned)
                done.set_result(ok)

            self._uring.submit(fd, bufs, 0, True, complete)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if aligned is not None and pool is not None:
                pool.release(aligned)
            raise

    def _dump_complete(
        self, key: bytes, path: str, tmp: str, fd: int, total: int, res: int, written: int | None = None
    ) -> bool:
        """aio dump, on the reaper: ``res`` is the ``writev`` result of ``written`` bytes (default ``total``, the
        file's size; with ``O_DIRECT``, ``total`` rounded up to whole ``DIRECT_ALIGN`` units, whose padding is then
        truncated away). A short write or an error fails the key."""
        submitted = total if written is None else written
        try:
            if res < 0:
                raise OSError(-res, os.strerror(-res))
            if res != submitted:
                raise OSError(errno.EIO, f"short write: {res} of {submitted} bytes")
            if submitted != total:
                os.ftruncate(fd, total)
            os.close(fd)
            fd = -1
            os.replace(tmp, path)
        except OSError as exc:
            return self._dump_failed(key, path, tmp, fd, exc)
        return self._dump_succeeded(total)

    def _load_one(self, key: bytes, row: torch.Tensor, tally: _DecodeTally, kvfold: bool = False) -> bool:
        """Read ``key``'s block file into ``row`` on this thread and validate it (a KVfold file is read whole and
        decoded, see :func:`_read_decoded`); ``kvfold``: the file is known to be KVfold (the aio engine's reaper found
        it from the header), so it is decoded straight away. Returns the key's success."""
        path = self.block_path(key)
        payload = row.numpy().data.cast("B")
        flags = os.O_RDONLY | (os.O_DIRECT if self._direct is not None else 0)
        reason: str | OSError | None
        stat: os.stat_result | None = None
        try:
            fd = os.open(path, flags)
            try:
                stat = os.fstat(fd)
                reason = _KVFOLD_FILE if kvfold else _read_validated(fd, stat.st_size, key, payload, self._direct)
                if reason == _KVFOLD_FILE:  # read it whole and decode it (the raw read above got the header only)
                    reason = tally.add(_read_decoded(fd, stat.st_size, key, row, self._direct))
                if reason is None:
                    _touch(fd, stat)
            finally:
                os.close(fd)
        except OSError as exc:
            reason = exc
        return self._load_outcome(key, path, reason, stat)

    def _load_shards(
        self, read: _ShardedRead, first: int, stop: int, shard_nbytes: int, progress: ShardProgress
    ) -> None:
        """Read shards ``[first, stop)`` of one key's block (with the header when ``first`` is 0); the key's last
        run validates the whole block and resolves ``read.future``. Never raises: a failure is recorded for the
        key."""
        got, error = 0, None
        error_or_bug: BaseException | None = None
        try:
            fd = read.open(os.O_RDONLY | (os.O_DIRECT if self._direct is not None else 0), self._direct)
            if fd is not None:
                piece = read.payload[first * shard_nbytes : stop * shard_nbytes]
                if first == 0:
                    got = _pread_range(fd, [read.header, piece], 0, self._direct)
                else:
                    got = _pread_range(fd, [piece], HEADER_NBYTES + first * shard_nbytes, self._direct)
        except OSError as exc:
            error = exc
            error_or_bug = exc
        except Exception as exc:  # a bug, not an I/O error: fail the key loudly (through its future)
            error_or_bug = exc
        finally:
            for shard in range(first, stop):
                progress.done(shard)
        if read.run_read(got, error_or_bug if error is None else error):
            self._finish_sharded(read)

    def _finish_sharded(self, read: _ShardedRead) -> None:
        """All shards of ``read`` are in: validate the block as :meth:`load` does and resolve its future."""
        read.close()
        if isinstance(read.error, BaseException) and not isinstance(read.error, OSError):
            read.future.set_exception(read.error)
            return
        reason: str | OSError | None = read.error
        if reason is None and read.decoded is not None:  # a KVfold file, read and decoded when opened
            reason = read.tally.add(read.decoded)
            if reason is None:
                assert read.stat is not None
                with contextlib.suppress(OSError):
                    os.utime(read.path, ns=(time.time_ns(), read.stat.st_mtime_ns))
        elif reason is None:
            assert read.stat is not None
            reason = _check_block(read.key, read.payload, read.stat.st_size, read.got, read.header)
            if reason == _KVFOLD_FILE:  # of the raw size: recognized only now, after its shards were reported
                reason = (
                    f"{FOREIGN}codec {CODEC_KVFOLD} (KVfold) file of the raw block's size met by a sharded load "
                    "after its shards were handed out; a whole-block load decodes it"
                )
            if reason is None:
                with contextlib.suppress(OSError):
                    os.utime(read.path, ns=(time.time_ns(), read.stat.st_mtime_ns))
        read.future.set_result(self._load_outcome(read.key, read.path, reason, read.stat))

    def _load_encoded_one(
        self, key: bytes, i: int, max_nbytes: int, consume: Callable[[int, EncodedBlock], str | None]
    ) -> bool:
        path = self.block_path(key)
        flags = os.O_RDONLY | (os.O_DIRECT if self._direct is not None else 0)
        reason: str | OSError | None
        stat: os.stat_result | None = None
        try:
            fd = os.open(path, flags)
            try:
                stat = os.fstat(fd)
                reason, block = _read_encoded(fd, stat.st_size, key, max_nbytes, self._direct)
                if block is not None:
                    reason = consume(i, block)
                    if reason is None:
                        _touch(fd, stat)
            finally:
                os.close(fd)
        except OSError as exc:
            reason = exc
        return self._load_outcome(key, path, reason, stat)

    def _load_start(self, key: bytes, row: torch.Tensor, done: Future[bool], tally: _DecodeTally) -> None:
        """aio load, on a pool thread: open the file and queue one ``readv`` of header + payload (header only when
        the size is wrong, to tell a foreign file from a damaged one); the reaper finishes in :meth:`_load_complete`.
        With ``io_direct`` the file is opened with ``O_DIRECT`` and read in whole ``DIRECT_ALIGN`` units into an
        aligned buffer of the operation's own, given back at completion once the payload is validated and copied out.
        A KVfold file (found by the reaper from the header) is read again whole and decoded on a pool thread
        (:meth:`_load_one`), not on the reaper.
        """
        assert self._uring is not None
        path = self.block_path(key)
        payload = row.numpy().data.cast("B")
        pool = self._direct_pool
        try:
            fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if pool is not None else 0))
        except OSError as exc:
            done.set_result(self._load_outcome(key, path, exc, None))
            return
        aligned: memoryview | None = None
        try:
            stat = os.fstat(fd)
            expected = HEADER_NBYTES + payload.nbytes
            if pool is None:
                header = memoryview(bytearray(HEADER_NBYTES))
                full = stat.st_size == expected and payload.nbytes > 0
                bufs = [header, payload] if full else [header]
            else:  # as _read_validated: the whole file when it has the expected size, else the header's unit
                aligned = pool.acquire(expected if stat.st_size == expected else HEADER_NBYTES)
                header = aligned[:HEADER_NBYTES]
                bufs = [aligned]

            def complete(res: int) -> None:
                try:
                    ok = self._load_complete(key, path, fd, stat, header, payload, res, aligned)
                finally:
                    if aligned is not None and pool is not None:
                        pool.release(aligned)
                if ok is None:  # a KVfold file: decode it on a pool thread (close waits for the task: pool open)

                    def decode(_i: int, d: Future[bool]) -> None:
                        d.set_result(self._load_one(key, row, tally, kvfold=True))

                    self._pool.submit(_resolve_on_error, decode, 0, done)
                else:
                    done.set_result(ok)

            self._uring.submit(fd, bufs, 0, False, complete)
        except OSError as exc:
            os.close(fd)
            if aligned is not None and pool is not None:
                pool.release(aligned)
            done.set_result(self._load_outcome(key, path, exc, None))
        except BaseException:
            os.close(fd)
            if aligned is not None and pool is not None:
                pool.release(aligned)
            raise

    def _load_complete(
        self,
        key: bytes,
        path: str,
        fd: int,
        stat: os.stat_result,
        header: memoryview,
        payload: memoryview,
        res: int,
        aligned: memoryview | None = None,
    ) -> bool | None:
        """aio load, on the reaper: ``res`` is the ``readv`` result (a short read is a file that shrank). With
        ``aligned`` (an ``O_DIRECT`` read into that buffer, ``header`` its first bytes) the payload is copied from it
        into ``payload`` once the header checks pass (see :func:`_check_block`). Returns the key's success, or
        ``None`` for a KVfold file (its header read): the caller has it decoded with :meth:`_load_one`."""
        reason: str | OSError | None
        try:
            if res < 0:
                raise OSError(-res, os.strerror(-res))
            reason = _check_block(key, payload, stat.st_size, res, header, aligned)
            if reason == _KVFOLD_FILE:
                return None
            if reason is None:
                _touch(fd, stat)
        except OSError as exc:
            reason = exc
        finally:
            os.close(fd)
        return self._load_outcome(key, path, reason, stat)

    def _log_decodes(self, tally: _DecodeTally, num_keys: int) -> None:
        """End of a load: with KVfold files met, one debug line (blocks decoded), and the first lossy one logged once
        at info level."""
        if not tally.met:
            return
        logger.debug(
            "posix store: load of %d blocks: %d KVfold blocks decoded (%d lossy int8), %d not decodable, "
            "%d -> %d bytes, %.1f ms reading and decoding them",
            num_keys,
            tally.decoded,
            tally.lossy,
            tally.met - tally.decoded,
            tally.stored_nbytes,
            tally.raw_nbytes,
            tally.seconds * 1e3,
        )
        if tally.lossy and not self._lossy_logged:
            self._lossy_logged = True
            logger.info(
                "posix store: loaded blocks stored lossy by a Compress stage (compress_mode: fixed_rate, int8); they "
                "decode to their lossy values"
            )

    def _load_outcome(self, key: bytes, path: str, reason: str | OSError | None, stat: os.stat_result | None) -> bool:
        """A load's end, either engine: ``reason`` is ``None`` (valid block), an ``OSError`` (missing file: debug;
        else a fault) or why the file is damaged or foreign (a damaged file is removed when still ``stat``)."""
        if isinstance(reason, FileNotFoundError):
            logger.debug("posix store: block %s not found at %s", key.hex(), path)
            return False
        if isinstance(reason, OSError):
            self._faults.failed("read", reason, f"block file {path}", "treating it as a miss")
            return False
        self._faults.succeeded("read")
        if reason is not None:
            kept = reason.startswith(FOREIGN)
            if not kept and stat is not None:
                _remove_if_unchanged(path, stat)
            logger.warning(
                "posix store: damaged block file %s: %s; treating as a miss%s",
                path,
                reason,
                " (file kept: another format, codec or block size)" if kept else " and removed it",
            )
            return False
        return True


class _ShardedRead:
    """One key of a :meth:`PosixStore.load_sharded`: its file (opened once, by its first run to start), where its
    shards go and what their reads found."""

    def __init__(self, key: bytes, path: str, row: torch.Tensor, num_runs: int, tally: _DecodeTally) -> None:
        self.key = key
        self.path = path
        self.row = row
        self.payload = row.numpy().data.cast("B")
        self.header = memoryview(bytearray(HEADER_NBYTES))
        self.stat: os.stat_result | None = None  # at open
        self.future: Future[bool] = Future()
        self.got = 0  # header and payload bytes read, over all runs
        self.error: BaseException | None = None  # the first failure (the open's, when it failed)
        self.decoded: _Decoded | None = None  # a KVfold file: read whole and decoded by open
        self.tally = tally
        self._fd = -1
        self._remaining = num_runs
        self._lock = threading.Lock()

    def open(self, flags: int, direct: _AlignedBuffers | None) -> int | None:
        """The block file's fd, opened (and ``fstat``-ed) by the first caller; ``None`` when the key has already
        failed or was decoded (later runs need not be read). A file of another size than the raw block's that is a
        KVfold file is read whole and decoded into the row by the first caller, under the lock (the key's other runs
        wait, so no shard of the row is reported before its decoded bytes are in). Raises the ``OSError`` of a
        failed open or read."""
        with self._lock:
            if self.error is not None or self.decoded is not None:
                return None
            if self._fd < 0:
                fd = os.open(self.path, flags)
                try:
                    self.stat = os.fstat(fd)
                    if self.stat.st_size != HEADER_NBYTES + self.payload.nbytes:
                        self.decoded = _read_decoded_if_kvfold(fd, self.stat.st_size, self.key, self.row, direct)
                except BaseException:
                    os.close(fd)
                    raise
                self._fd = fd
                if self.decoded is not None:
                    return None
            return self._fd

    def run_read(self, got: int, error: BaseException | None) -> bool:
        """Record one run's outcome; True for the key's last run (the caller then validates)."""
        with self._lock:
            self.got += got
            if error is not None and self.error is None:
                self.error = error
            self._remaining -= 1
            return self._remaining == 0

    def close(self) -> None:
        """Close the file (after the last run)."""
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


class _FaultLog:
    """Logs I/O failures once per kind: the first ``(operation, errno)`` failure as a warning, repeats at debug
    level; the first success of an operation after failures at info level, re-arming its warnings."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._warned: set[tuple[str, int]] = set()
        self._failures: dict[str, int] = {}

    def failed(self, op: str, exc: OSError, what: str, outcome: str = "not cached") -> None:
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
        if not self._failures.get(op):  # the common path: no lock
            return
        with self._lock:
            failures = self._failures.pop(op, 0)
            self._warned = {w for w in self._warned if w[0] != op}
        if failures:
            logger.info("posix store: %s works again after %d failed block %ss", op, failures, op)


# Reasons that may mean "another UCM version's block" or a caller's size mismatch rather than damage: such files are
# left in place.
FOREIGN = "foreign: "
# _check_block's reason for a KVfold file (codec 1): a plain load reads it whole and decodes it. Foreign-prefixed so
# that a caller not handling it keeps the file.
_KVFOLD_FILE = f"{FOREIGN}codec {CODEC_KVFOLD} (KVfold container)"


def _kvfold_max_nbytes(block_nbytes: int) -> int:
    """Most stored bytes read for a KVfold file of a ``block_nbytes``-byte block (as the Compress stage reads: a
    container is at most the raw size plus its headers, incompressible planes being stored raw); a larger file is
    foreign."""
    return 2 * block_nbytes + (1 << 16)


@dataclass(frozen=True)
class _Decoded:
    """What reading and decoding one KVfold file found: ``reason`` (``None``: the row holds the decoded block),
    ``stored_nbytes`` (the container's bytes, 0 when not read), ``raw_nbytes`` (the row's, when decoded), ``mode``
    (the container's, when decoded), and ``seconds`` spent reading and decoding."""

    reason: str | None
    stored_nbytes: int = 0
    raw_nbytes: int = 0
    mode: str | None = None
    seconds: float = 0.0


class _DecodeTally:
    """The KVfold files one load met (for its debug line). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.met = 0  # KVfold files whose whole read was attempted
        self.decoded = 0
        self.lossy = 0  # decoded from int8 (fixed_rate) containers
        self.stored_nbytes = 0
        self.raw_nbytes = 0
        self.seconds = 0.0

    def add(self, decoded: _Decoded) -> str | None:
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


def _read_decoded(fd: int, size: int, key: bytes, row: torch.Tensor, direct: _AlignedBuffers | None) -> _Decoded:
    """Read the whole block file ``fd`` of ``size`` bytes (from ``fstat``) into this thread's buffer, check it as
    :func:`_read_encoded` does (magic, version, key, exact size, checksum of the stored bytes; a payload over
    :func:`_kvfold_max_nbytes` is foreign) and decode it into ``row`` (contiguous CPU uint8 ``[block_nbytes]``, the
    expected block) by its codec.

    KVfold (the case this is for): :func:`ucm.store.kvfold.decode_block`, bit-exact for lossless containers, the
    lossy values for int8 (fixed-rate) ones. A container that this version does not know (container version, mode
    or dtype: another UCM) or that describes another block size is foreign (kept); one that fails to decode is
    damaged. A raw file (the file was replaced since its header was read) of the row's size is copied. Other codecs
    are foreign. ``row`` is unspecified unless the reason is ``None``.

    Raises:
        OSError: reading the file failed.
    """
    t0 = time.perf_counter()
    reason, block = _read_encoded(fd, size, key, _kvfold_max_nbytes(row.numel()), direct)
    if block is None:
        return _Decoded(reason, seconds=time.perf_counter() - t0)
    reason, mode = decode_into(block, row)
    raw_nbytes = row.numel() if reason is None else 0
    return _Decoded(reason, len(block.payload), raw_nbytes, mode, time.perf_counter() - t0)


def _read_decoded_if_kvfold(
    fd: int, size: int, key: bytes, row: torch.Tensor, direct: _AlignedBuffers | None
) -> _Decoded | None:
    """For a sharded load's file of another size than the raw block's: read its header; for a KVfold file, read
    and decode it whole (:func:`_read_decoded`), else ``None`` (the sharded reads go on and validation tells a
    foreign file from a damaged one, as for any file).

    Raises:
        OSError: reading the file failed.
    """
    header = memoryview(bytearray(HEADER_NBYTES))
    if _pread_range(fd, [header], 0, direct) < HEADER_NBYTES:
        return None
    magic, version, codec = HEADER.unpack(header)[:3]
    if (magic, version, codec) != (MAGIC, FORMAT_VERSION, CODEC_KVFOLD):
        return None
    return _read_decoded(fd, size, key, row, direct)


def decode_into(block: EncodedBlock, row: torch.Tensor) -> tuple[str | None, str | None]:
    """Decode a checked stored ``block`` into ``row`` (contiguous CPU uint8 ``[block_nbytes]``) by its codec: a
    raw payload of the row's size is copied, a KVfold container decoded (:func:`ucm.store.kvfold.decode_block`).

    Returns:
        ``(reason, mode)``: ``reason`` is ``None`` when ``row`` holds the block, else why not (starting with
        :data:`FOREIGN` for a codec, container or block size this version does not read: the file is to be kept;
        otherwise the container is damaged); ``mode`` is the container's (``"lossless"``, ``"int8"``) or ``"raw"``
        when decoded. ``row`` is unspecified unless ``reason`` is ``None``.
    """
    if block.codec == CODEC_RAW:
        if len(block.payload) != row.numel():
            return f"{FOREIGN}payload is {len(block.payload)} bytes, expected {row.numel()}", None
        row.numpy()[:] = memoryview(block.payload)
        return None, "raw"
    if block.codec != CODEC_KVFOLD:
        return f"{FOREIGN}codec {block.codec}, expected {CODEC_RAW} (raw) or {CODEC_KVFOLD} (KVfold)", None
    # Imported here: the codec pulls in its kernels (numba, triton), which a store of raw files never needs.
    from ucm.store.kvfold import decode_block, read_container_header

    try:
        head = read_container_header(block.payload)
        if not head.known:
            return (
                f"{FOREIGN}KVfold container version {head.version}, mode {head.mode_code}, dtype {head.dtype_code}: "
                "not one this version decodes",
                None,
            )
        if head.block_nbytes != row.numel():
            return f"{FOREIGN}KVfold container of a {head.block_nbytes}-byte block, expected {row.numel()}", None
        mode: str = decode_block(block.payload, row)
    except BlockCorruptedError as exc:
        return f"KVfold container does not decode: {exc}", None
    return None, mode


@dataclass(frozen=True)
class EncodedBlock:
    """A block file's payload as stored, handed over by :meth:`PosixStore.load_encoded` (checksum verified).

    Attributes:
        codec: the header's codec (``CODEC_RAW``, ``CODEC_KVFOLD``, ...).
        payload: the stored bytes: a view of the reading thread's buffer, valid only while it is handed over.
    """

    codec: int
    payload: memoryview


def _bytes_of(row: torch.Tensor) -> memoryview:
    """A flat ``B`` memoryview of a contiguous CPU uint8 row."""
    return row.numpy().data.cast("B")


def _read_encoded(
    fd: int, size: int, key: bytes, max_nbytes: int, direct: _AlignedBuffers | None
) -> tuple[str | None, EncodedBlock | None]:
    """Read and check a whole block file of ``size`` bytes (from ``fstat``) of any codec and payload size.

    Returns ``(None, block)`` when valid, else ``(reason, None)``; a reason starting with ``"foreign: "`` marks a
    file to keep (another format version, or larger than ``max_nbytes`` of payload: not a block this reader knows).
    The file is read into the calling thread's buffer (``direct``'s aligned one for ``O_DIRECT``, else
    :data:`_READ_BUFFERS`), and ``block.payload`` is a view of it: valid until this thread's next read through
    that buffer. A buffer per thread, reused, spares the allocation (and page faults) of one per block: on a
    2-vCPU machine these cost about as much as decoding the block.
    """
    if size < HEADER_NBYTES:
        return f"file is {size} bytes, shorter than the {HEADER_NBYTES}-byte header", None
    if size - HEADER_NBYTES > max_nbytes:
        return f"{FOREIGN}payload of {size - HEADER_NBYTES} bytes, more than the {max_nbytes} expected", None
    if direct is not None:
        buf = direct.get(_round_up(size))
        got = _pread_direct(fd, buf)
    else:
        buf = _READ_BUFFERS.get(size)
        got = _preadv_full(fd, [buf], 0)
    if got < size:
        return f"file shrank while read: {got} of {size} bytes", None
    magic, version, codec, _ns_tag, nbytes, file_key, checksum = HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        return f"bad magic {bytes(magic)!r}, expected {MAGIC!r}", None
    if version != FORMAT_VERSION:
        return f"{FOREIGN}format version {version}, expected {FORMAT_VERSION}", None
    if file_key != key:
        return f"file holds key {file_key.hex()}, expected {key.hex()}", None
    if nbytes != size - HEADER_NBYTES:
        return f"file is {size} bytes, expected {HEADER_NBYTES + nbytes}", None
    payload = buf[HEADER_NBYTES:size]
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        return "checksum mismatch", None
    return None, EncodedBlock(codec, payload)


def _dir_of(dirs: Sequence[str], key: bytes) -> str:
    return dirs[int.from_bytes(key[:8], "little") % len(dirs)]


def block_file_path(dirs: Sequence[str], key: bytes) -> str:
    """Path of ``key``'s block file (16-byte key) in a store over the ordered directories ``dirs`` (see the module
    docstring's placement rule), whether or not it exists."""
    h = key.hex()
    return os.path.join(_dir_of(dirs, key), h[0:2], h[2:4], h + FILE_SUFFIX)


def namespace_tag(digest: bytes) -> int:
    """The u32 namespace tag of a namespace ``digest`` (its first 4 bytes, little-endian; 0 is bumped to 1 so that
    0 keeps meaning "not set").

    Raises:
        ValueError: ``digest`` is shorter than 4 bytes.
    """
    if len(digest) < 4:
        raise ValueError(f"namespace digest must have at least 4 bytes, got {len(digest)}")
    return int.from_bytes(digest[:4], "little") or 1


def _remove_if_unchanged(path: str, stat: os.stat_result) -> None:
    """Remove the damaged file at ``path`` if it is still the file that was read (a writer may have replaced it
    with a good block meanwhile; the check narrows, but cannot close, that window: at worst a good block is lost,
    which is a miss, never wrong data). Errors are ignored: the block is a miss either way."""
    with contextlib.suppress(OSError):
        now = os.stat(path)
        if (now.st_dev, now.st_ino, now.st_size, now.st_mtime_ns) == (
            stat.st_dev,
            stat.st_ino,
            stat.st_size,
            stat.st_mtime_ns,
        ):
            os.unlink(path)


def _write_all(fd: int, data: memoryview) -> None:
    """Write all of ``data`` to ``fd``, looping over short writes."""
    off = 0
    while off < data.nbytes:
        n = os.write(fd, data[off:])
        if n <= 0:  # not expected from a regular file; avoid spinning forever
            raise OSError(errno.EIO, "write returned 0 bytes")
        off += n


def _preadv_full(fd: int, bufs: list[memoryview], offset: int) -> int:
    """Fill ``bufs`` in order from ``fd`` at ``offset`` with positional vectored reads (one ``preadv`` when the
    kernel returns everything, as for a regular file); stop at EOF. Return the number of bytes read."""
    views = [b for b in bufs if b.nbytes]
    total = 0
    while views:
        n = os.preadv(fd, views, offset + total)
        if n <= 0:
            break
        total += n
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
    return total


def _pread_range(fd: int, views: list[memoryview], offset: int, direct: _AlignedBuffers | None) -> int:
    """Fill the consecutive ``views`` from ``fd`` at ``offset`` (the file's bytes ``[offset, offset + total)``);
    return how many bytes were filled (fewer at EOF). With ``direct`` (``fd`` opened with ``O_DIRECT``) the whole
    ``DIRECT_ALIGN`` units covering the range are read into this thread's aligned buffer and copied out."""
    if direct is None:
        return _preadv_full(fd, views, offset)
    start = offset - offset % DIRECT_ALIGN
    total = sum(v.nbytes for v in views)
    buf = direct.get(_round_up(offset - start + total))
    done = 0
    while done < buf.nbytes:
        n = os.preadv(fd, [buf[done:]], start + done)
        if n <= 0:
            break
        done += n
        if done % DIRECT_ALIGN:  # a read ending off alignment is the end of the file
            break
    got = max(0, min(done - (offset - start), total))
    pos = offset - start
    left = got
    for v in views:
        n = min(v.nbytes, left)
        v[:n] = buf[pos : pos + n]
        pos += n
        left -= n
    return got


def _touch(fd: int, stat: os.stat_result) -> None:
    """A hit: refresh the block's recency (atime) for garbage collection (best effort)."""
    with contextlib.suppress(OSError):
        os.utime(fd, ns=(time.time_ns(), stat.st_mtime_ns))


def _read_validated(
    fd: int, size: int, key: bytes, payload: memoryview, direct: _AlignedBuffers | None = None
) -> str | None:
    """Read one block file of ``size`` bytes (from ``fstat``) into ``payload`` (a ``B``-format memoryview of the
    expected payload size) and check it with :func:`_check_block`; return ``None`` when valid, else the reason.

    When the file has the expected size, header and payload come in one ``preadv``; otherwise only the header is
    read, to tell a foreign file from a damaged one. Block files are never modified in place (written under a temp
    name, then renamed), so the size checked by ``fstat`` is the size read. With ``direct`` (``fd`` opened with
    ``O_DIRECT``), the file is read in whole ``DIRECT_ALIGN`` units into an aligned buffer, then the payload is
    copied into ``payload``.
    """
    expected = HEADER_NBYTES + payload.nbytes
    want = expected if size == expected else HEADER_NBYTES
    if direct is not None:
        buf = direct.get(_round_up(want))
        got = _pread_direct(fd, buf)
        return _check_block(key, payload, size, got, buf[:HEADER_NBYTES], buf)
    header = memoryview(bytearray(HEADER_NBYTES))
    got = _preadv_full(fd, [header, payload] if want == expected else [header], 0)
    return _check_block(key, payload, size, got, header)


def _check_block(
    key: bytes, payload: memoryview, size: int, got: int, header: memoryview, aligned: memoryview | None = None
) -> str | None:
    """Check a block file read by either engine; return ``None`` when valid, else the reason.

    The reader read ``got`` bytes of a ``size``-byte file: header and payload (into ``payload``, or into ``aligned``
    at offset ``HEADER_NBYTES`` for ``O_DIRECT`` reads: copied to ``payload`` once the header checks pass) when
    ``size`` is the expected one, else the header only. Fewer bytes than that means the file shrank. A reason
    starting with ``"foreign: "`` (another version, codec or block size) means the file is to be kept;
    ``_KVFOLD_FILE`` (which starts so too) means a KVfold file, to be read whole and decoded (:func:`_read_decoded`).
    """
    expected = HEADER_NBYTES + payload.nbytes
    want = expected if size == expected else HEADER_NBYTES
    if got < want:
        if want == expected:
            return f"file shrank while read: {got} of {expected} bytes"
        return f"file is {got} bytes, shorter than the {HEADER_NBYTES}-byte header"
    magic, version, codec, _ns_tag, nbytes, file_key, checksum = HEADER.unpack(header)
    if magic != MAGIC:
        return f"bad magic {bytes(magic)!r}, expected {MAGIC!r}"
    if version != FORMAT_VERSION:
        return f"{FOREIGN}format version {version}, expected {FORMAT_VERSION}"
    if codec == CODEC_KVFOLD:  # the caller reads it whole and decodes it (see _read_decoded)
        return _KVFOLD_FILE
    if codec != CODEC_RAW:
        return f"{FOREIGN}codec {codec}, expected {CODEC_RAW} (raw) or {CODEC_KVFOLD} (KVfold)"
    if nbytes != payload.nbytes:  # a caller's size mismatch must not destroy a block: keep the file
        return f"{FOREIGN}payload is {nbytes} bytes, expected {payload.nbytes}"
    if file_key != key:
        return f"file holds key {file_key.hex()}, expected {key.hex()}"
    if size != expected:
        return f"file is {size} bytes, expected {expected}"
    if aligned is not None:
        payload[:] = aligned[HEADER_NBYTES:expected]
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        return "checksum mismatch"
    return None


def _resolve_on_error(job: Callable[[int, Future[bool]], None], index: int, done: Future[bool]) -> None:
    """Run an aio job; an unexpected exception (a bug, not an I/O error) fails its key through ``done``."""
    try:
        job(index, done)
    except BaseException as exc:
        if not done.done():
            done.set_exception(exc)


def _round_up(n: int) -> int:
    return -(-n // DIRECT_ALIGN) * DIRECT_ALIGN


def _pread_direct(fd: int, buf: memoryview) -> int:
    """Read from offset 0 into the aligned ``buf`` (a multiple of ``DIRECT_ALIGN`` bytes) with ``O_DIRECT``
    semantics: every read starts at an aligned offset; a read ending off alignment is the end of the file."""
    off = 0
    while off < buf.nbytes:
        n = os.preadv(fd, [buf[off:]], off)
        if n <= 0:
            break
        off += n
        if off % DIRECT_ALIGN:
            break
    return off


class _AlignedBuffers:
    """Per-thread page-aligned buffers (anonymous ``mmap``s, grown on demand, reused; freed with the thread): for
    ``O_DIRECT`` I/O, and for whole-file reads of encoded blocks (:data:`_READ_BUFFERS`)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, nbytes: int) -> memoryview:
        """A ``DIRECT_ALIGN``-aligned writable buffer of ``nbytes`` bytes, owned by the calling thread."""
        mm: mmap.mmap | None = getattr(self._local, "mm", None)
        if mm is None or len(mm) < nbytes:  # the old map is freed with its last view
            mm = mmap.mmap(-1, _round_up(max(nbytes, 1)))
            self._local.mm = mm
            self._local.view = memoryview(mm)
        view: memoryview = self._local.view
        return view[:nbytes]


# Buffered whole-file reads of encoded blocks (_read_encoded): one buffer per thread that reads them (the pool
# threads of every store in the process), holding the largest file that thread read.
_READ_BUFFERS = _AlignedBuffers()


class _DirectBufferPool:
    """Page-aligned buffers for ``aio`` + ``O_DIRECT`` operations, owned per operation: a pool thread takes one
    with :meth:`acquire` before queuing the operation, the reaper gives it back with :meth:`release` at its
    completion (a per-thread buffer cannot do: the thread that fills it is not the one that finishes with it).

    At most ``max_bytes`` of buffers are held by operations at once: :meth:`acquire` waits beyond that, except when
    no buffer is held (so a block larger than the bound still moves, one at a time). Released buffers are kept for
    reuse (anonymous ``mmap``s, which are costly to map and fault in anew) as long as held plus kept stay within
    ``max_bytes``; a buffer of another size evicts kept ones (the old map is freed with its last view).

    Raises:
        ValueError: ``max_bytes`` < ``DIRECT_ALIGN``.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < DIRECT_ALIGN:
            raise ValueError(f"the O_DIRECT buffer bound must be >= {DIRECT_ALIGN} bytes, got {max_bytes}")
        self._max_bytes = max_bytes
        self._cond = threading.Condition()
        self._free: dict[int, list[memoryview]] = {}  # kept buffers by size (bytes, a multiple of DIRECT_ALIGN)
        self._free_bytes = 0
        self._held_bytes = 0

    @property
    def held_bytes(self) -> int:
        """Bytes of buffers acquired and not released yet."""
        with self._cond:
            return self._held_bytes

    def acquire(self, nbytes: int) -> memoryview:
        """A writable ``DIRECT_ALIGN``-aligned buffer of ``nbytes`` rounded up to ``DIRECT_ALIGN`` bytes (its
        content is unspecified); waits while held buffers would exceed the bound. Give it back with :meth:`release`.
        """
        size = _round_up(max(nbytes, 1))
        with self._cond:
            while self._held_bytes and self._held_bytes + size > self._max_bytes:
                self._cond.wait()
            self._held_bytes += size
            kept = self._free.get(size)
            if kept:
                self._free_bytes -= size
                return kept.pop()
            # Make room for a new map: drop kept buffers (largest sizes first) beyond the bound.
            for other in sorted(self._free, reverse=True):
                stack = self._free[other]
                while stack and self._held_bytes + self._free_bytes > self._max_bytes:
                    stack.pop()
                    self._free_bytes -= other
        return memoryview(mmap.mmap(-1, size))

    def release(self, buf: memoryview) -> None:
        """Give back a buffer from :meth:`acquire` (whole, as returned); no view of it may be used afterwards."""
        size = buf.nbytes
        with self._cond:
            self._held_bytes -= size
            if self._held_bytes + self._free_bytes + size <= self._max_bytes:
                self._free.setdefault(size, []).append(buf)
                self._free_bytes += size
            self._cond.notify_all()


def _fill_aligned(buf: memoryview, header: bytes, payload: memoryview) -> None:
    """Lay out a block file for one ``O_DIRECT`` write: ``header``, ``payload``, then zeros to the end of ``buf``."""
    total = HEADER_NBYTES + payload.nbytes
    buf[:HEADER_NBYTES] = header
    buf[HEADER_NBYTES:total] = payload
    buf[total:] = bytes(buf.nbytes - total)


def _check_direct_io(path: str) -> None:
    """Write and read one aligned unit with ``O_DIRECT`` in directory ``path``.

    Raises:
        ValueError: the filesystem refuses ``O_DIRECT`` (e.g. tmpfs: EINVAL), naming the directory and the error.
    """
    probe = os.path.join(path, f".odirect-probe.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}")
    buf = _AlignedBuffers().get(DIRECT_ALIGN)
    fd = -1
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, FILE_MODE)
        _write_all(fd, buf)
        os.preadv(fd, [buf], 0)
    except OSError as exc:
        raise ValueError(
            f"storage backend {path!r} refuses O_DIRECT I/O (io_direct: true): {exc.strerror or exc}; "
            "allowed on this filesystem: io_direct: false"
        ) from None
    finally:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(probe)
