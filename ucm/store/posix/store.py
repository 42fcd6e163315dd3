"""``Posix`` store stage (:class:`PosixStore`): one file per block under one or more directories.

The stage implements the store contract (:mod:`ucm.store.base`) and holds encoded payloads
(:class:`~ucm.store.base.EncodedStore`), so a ``Compress`` stage stacks over it. Its parts:

- :mod:`ucm.store.posix.format`: placement of a key's file, the file format (header, codecs), validation;
- I/O engines: :mod:`ucm.store.posix.psync` (positional syscalls on the pool threads) and
  :mod:`ucm.store.posix.uring` (``aio``: io_uring), with :mod:`ucm.store.posix.direct` (aligned buffers for
  ``O_DIRECT``) and :mod:`ucm.store.posix.sharded` (layerwise loads);
- :mod:`ucm.store.posix.files`: the steps both engines share around a block's write and read, and the fault log;
- :mod:`ucm.store.posix.scan`: listing and garbage collection.

A file is complete or absent (written to a temp name, then renamed), so ``lookup`` never sees a half-written block.
``load`` validates magic, version, codec, payload size, key, exact file size and checksum before reporting a block
as loaded; anything else is a failed key (a cache miss for the caller). A damaged file is removed, so the block is
recomputed and stored again instead of failing every later load; a file of another format version, codec, block
size or KVfold container version (another UCM version sharing the directory, or a caller's size mismatch) is left
in place.

Encoded blocks (the ``Compress`` stage): :meth:`PosixStore.dump_encoded` stores a payload of any size with the
codec the caller names in the header; :meth:`PosixStore.load_encoded` hands a file's codec and payload to the
caller's decoder, on the I/O thread that read it, after checking magic, version, key, exact size and checksum (the
checksum covers the stored, i.e. compressed, bytes). Encoded loads run on the pool threads with positional reads for
either engine, each thread reading into a buffer of its own that it reuses; encoded dumps use the configured engine.

A plain ``load``/``load_sharded`` (``Cache|Posix``, ``Posix``) also reads KVfold files, so a store filled by
``Cache|Compress|Posix`` stays readable after switching back to ``Cache|Posix``, and instances of both pipelines can
share a directory: such a file is read whole into the reading thread's buffer, checked as by ``load_encoded``, and
decoded into the row by :func:`ucm.store.codecs.decode_into` (bit-exact for lossless containers; a fixed-rate
container decodes to its lossy values, as the Compress stage reads it). Raw files keep the direct path (read
straight into the row). The codec module is imported on the first KVfold file met.

The storage directories must exist or be creatable at start, and be writable unless the store is opened with
``require_writable=False`` (a ``kv_consumer``: read-only directories are then only read). A storage directory that
disappears while serving (deleted, or unmounted: found on another filesystem than at start) is not re-created nor
written to: dumps to it fail with one warning per error kind (``ENOENT``, ``ENODEV``) and loads miss, until it is
back. Faults never raise out of ``load``/``dump``: an ``OSError`` (``ENOSPC``, ``EROFS``, ``EACCES``, ``EIO``,
``ENOENT``, ...) fails the key, which the caller treats as a miss (load) or as a block not cached (dump); see
:class:`~ucm.store.posix.files.FaultLog` for how they are logged.

Maintenance (a background thread ``ucm-posix-gc``, :class:`~ucm.store.posix.scan.Collector`): stale temp files are
removed at start; with ``capacity_bytes``, block files are garbage-collected least recently used first (serving a
block refreshes its recency); ``close`` runs a last collection. A block removed under a reader is a miss, never
wrong data.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from stat import S_ISREG
from typing import Any, Literal

import torch

from ucm.affinity import thread_pool
from ucm.logger import init_logger
from ucm.store.base import (
    EncodedBlock,
    EncodedStore,
    PayloadDecoder,
    Removal,
    RowCallback,
    ShardProgress,
    Task,
    TaskResult,
    UcmKVStoreBase,
    call_on_row,
    check_encoded_dump,
    check_encoded_load,
    check_keys,
    check_keys_and_buffer,
    check_removal,
    check_shards,
    report_whole,
)
from ucm.store.observe import Observation, Op, Recorder, current_requests
from ucm.store.posix import psync
from ucm.store.posix.direct import DIRECT_ALIGN, AlignedBuffers, DirectBufferPool
from ucm.store.posix.files import BlockFiles, DecodeTally, row_bytes
from ucm.store.posix.format import DIR_MODE, FILE_MODE, NAMESPACE_DIR, TMP_SUFFIX, namespace_tag
from ucm.store.posix.scan import (
    DEFAULT_GC_INTERVAL_S,
    DEFAULT_TMP_AGE_S,
    Collector,
    FileInfo,
    GcResult,
    delete_files,
    keys_of_paths,
    namespace_blocks,
    scan_store,
)
from ucm.store.posix.sharded import ShardedRead, load_shards
from ucm.store.posix.uring import AioEngine, Uring, resolve_on_error

logger = init_logger(__name__)

# aio + O_DIRECT: most bytes of aligned buffers held by operations in flight (16 blocks of 16 MiB; the io_uring's depth
# bounds small blocks first). psync + O_DIRECT holds one buffer per I/O thread instead.
AIO_DIRECT_BUFFER_BYTES = 256 << 20
# load_sharded: the least bytes one read of a key's shards covers (small layer shards are read several at a time).
SHARDED_READ_BYTES = 512 << 10


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


def _check_direct_io(path: str) -> None:
    """Write and read one aligned unit with ``O_DIRECT`` in directory ``path``.

    Raises:
        ValueError: the filesystem refuses ``O_DIRECT`` (e.g. tmpfs: EINVAL), naming the directory and the error.
    """
    probe = os.path.join(path, f".odirect-probe.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}")
    buf = AlignedBuffers().get(DIRECT_ALIGN)
    fd = -1
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, FILE_MODE)
        psync.write_all(fd, buf)
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
        # Called with the result just before it is set (an observation of the task; must not raise).
        self.on_result: Callable[[TaskResult], None] | None = None
        self._on_finish = on_finish
        self._on_row = on_row
        self._remaining = num_keys
        self._failed: set[int] = set()
        self._lock = threading.Lock()

    def add(self, index: int, future: Future[bool]) -> None:
        """Count ``future`` (resolving to the key's success) as the outcome of key ``index``."""
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
            result = TaskResult(self._num_keys, frozenset(self._failed))
            if self.on_result is not None:
                try:
                    self.on_result(result)
                except Exception:
                    logger.exception("posix store: unexpected error observing a %s", self._what)
            self.future.set_result(result)


class PosixStore(UcmKVStoreBase, EncodedStore):
    """Store stage keeping one file per block on POSIX directories (local SSD, NFS, 3FS...).

    Buffers follow the contract of :mod:`ucm.store.base`: CPU ``torch.uint8`` tensors
    ``[num_keys, block_nbytes]``, one row per key. Loads and dumps run on a thread pool, one file per job; with the
    ``aio`` engine the pool only opens files and queues their data transfer on an io_uring (see
    :mod:`ucm.store.posix.uring`), whose reaper thread validates, closes and renames. KVfold files (written by a
    ``Compress`` stage sharing the directories) are read too and decoded into their rows (see :meth:`load`). See the
    module docstring for fault handling and garbage collection, :mod:`ucm.store.posix.format` for the file format.

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
        lookup_timeout_s: most seconds one :meth:`lookup` waits for its ``stat`` calls, which run on a thread of
            their own (a hung mount blocks them without bound); past it the lookup is a miss (0), with one warning,
            and later lookups are misses at once until that ``stat`` returns (logged too). ``None``: the calls run
            on the caller's thread, unbounded.

    Raises:
        ValueError: ``storage_backends`` is empty or has an empty entry; a path exists but is not a directory,
            cannot be created, or is not writable; ``io_threads`` < 1; ``capacity_bytes`` <= 0; ``tmp_age_s`` or
            ``gc_interval_s`` <= 0; ``lookup_timeout_s`` neither ``None`` nor > 0; ``io_direct`` and a directory's
            filesystem refuses ``O_DIRECT``; an unknown ``io_engine``, or ``aio`` where io_uring is not usable (no
            silent fallback).
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
        lookup_timeout_s: float | None = None,
    ) -> None:
        if lookup_timeout_s is not None and not lookup_timeout_s > 0:
            raise ValueError(f"lookup_timeout_s must be > 0 (seconds) or None (unbounded), got {lookup_timeout_s}")
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
        direct: AlignedBuffers | None = None
        if io_direct:
            if not hasattr(os, "O_DIRECT"):
                raise ValueError("io_direct: true needs O_DIRECT, which this platform lacks; allowed: io_direct: false")
            for d in self._dirs:
                _check_direct_io(d)
            direct = AlignedBuffers()
        # Last of the checks that may refuse the start: nothing is left running when it raises.
        self._uring: Uring | None = Uring() if io_engine == "aio" else None
        # aio + O_DIRECT: aligned buffers owned per operation (filled on a pool thread, released on the reaper).
        self._direct_pool: DirectBufferPool | None = None
        if self._uring is not None and io_direct:
            self._direct_pool = DirectBufferPool(AIO_DIRECT_BUFFER_BYTES)
        self._capacity = capacity_bytes
        self._collector = Collector(
            [d for d in self._dirs if d not in self._read_only_dirs],
            ":".join(self._dirs),
            capacity_bytes,
            tmp_age_s,
            gc_interval_s,
        )
        self._files = BlockFiles(self._dirs, direct, self._collector.account_write)
        self._pool = thread_pool(io_threads, "ucm-posix")
        self._aio: AioEngine | None = None
        if self._uring is not None:
            self._aio = AioEngine(self._files, self._uring, self._direct_pool, self._pool)
        self._closed = False
        self._close_lock = threading.Lock()
        self._tasks: set[Future[TaskResult]] = set()  # aio: tasks not done yet, which close waits for
        self._tasks_lock = threading.Lock()
        self._lossy_logged = False
        self._lookup_timeout_s = lookup_timeout_s
        self._stat_pool = thread_pool(1, "ucm-posix-stat") if lookup_timeout_s is not None else None
        self._stalled_lookup: Future[int] | None = None  # a lookup past its bound, still blocked in stat
        self._lookup_lock = threading.Lock()
        if len(self._read_only_dirs) < len(self._dirs):  # nothing to clean up or collect where nothing is written
            self._collector.start()

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
        return self._files.path(key)

    def set_recorder(self, recorder: Recorder) -> None:
        """Record this stage's loads and dumps (tier ``storage``) and each block that fails to load
        (``load_failure``, with its cause) into ``recorder``."""
        self._recorder = recorder
        self._files.recorder = recorder
        self._collector.recorder = recorder

    def gauges(self) -> dict[str, float]:
        """``storage:used_bytes`` (block files in the writable directories at the last scan, plus this process's
        writes since), ``storage:capacity_bytes`` (with ``capacity_bytes``), ``storage:evicted_blocks_total`` and
        ``storage:evicted_bytes_total`` (removed by this process's garbage collection since start)."""
        return self._collector.gauges()

    def encoded_store(self) -> EncodedStore:
        """This stage stores encoded payloads itself (:meth:`dump_encoded`, :meth:`load_encoded`)."""
        return self

    # -- contract -------------------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` (16-byte ``bytes``) whose block file exists as a regular file (a FIFO, device,
        socket or directory at a block path is a miss, replaced by the next dump of that key; a path that cannot be
        ``stat``-ed is a miss too). Reads no block data and opens nothing. With ``lookup_timeout_s``, 0 when the
        ``stat`` calls do not return within it, or while an earlier lookup's are still blocked (see the class doc).

        Raises:
            TypeError / ValueError: a key is not 16 ``bytes``.
        """
        check_keys(keys)
        if self._stat_pool is None or self._lookup_timeout_s is None:
            return self._present(keys)
        with self._lookup_lock:
            stalled = self._stalled_lookup
            if stalled is not None:
                if not stalled.done():
                    return 0
                self._stalled_lookup = None
                logger.info("posix store: lookups answer again (a stat that had blocked has returned)")
            try:
                future = self._stat_pool.submit(self._present, list(keys))
            except RuntimeError:  # closed concurrently
                return 0
        try:
            return future.result(self._lookup_timeout_s)
        except TimeoutError:
            with self._lookup_lock:
                if self._stalled_lookup is None:
                    self._stalled_lookup = future
            logger.warning(
                "posix store: a lookup of %d blocks did not finish within load_timeout_ms (%.0f ms): the storage "
                "is not answering (a hung mount?); lookups are misses until it answers",
                len(keys),
                self._lookup_timeout_s * 1e3,
            )
            return 0

    def _present(self, keys: Sequence[bytes]) -> int:
        """Leading ``keys`` whose block file is a regular file (``stat`` on the calling thread)."""
        n = 0
        for key in keys:
            try:
                if not S_ISREG(os.stat(self.block_path(key)).st_mode):
                    break
            except OSError:
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
        decoded into its row with :func:`ucm.store.codecs.decode_into`: bit-exact for a lossless container; a
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
        tally = DecodeTally()
        return self._submit_all(
            keys,
            lambda i: psync.load_one(self._files, keys[i], dst[i], tally),
            lambda aio, i, done: aio.load_start(keys[i], dst[i], done, tally),
            "load",
            lambda: self._log_decodes(tally, len(keys)),
            nbytes_of=lambda _i: dst.shape[1],
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
        :meth:`~ucm.store.base.UcmKVStoreBase.load_sharded`. KVfold files: see :mod:`ucm.store.posix.sharded` (no
        shard of such a row is reported before its decoded bytes are in it).

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
        tally = DecodeTally()
        gather = _Gather(len(keys), "load", lambda: self._log_decodes(tally, len(keys)), on_row)
        self._observe(gather, "load", lambda _i: dst.shape[1], keys)
        per_read = max(1, -(-SHARDED_READ_BYTES // shard_nbytes))  # shards per read
        ranges = [(a, min(a + per_read, num_shards)) for a in range(0, num_shards, per_read)]
        reads = [ShardedRead(key, self.block_path(key), dst[i], len(ranges), tally) for i, key in enumerate(keys)]
        for i, read in enumerate(reads):
            gather.add(i, read.future)
        for first, stop in ranges:
            for read in reads:
                self._pool.submit(self._load_shards, read, first, stop, shard_nbytes, progress)
        return Task(gather.future, progress)

    def dump(self, keys: Sequence[bytes], src: torch.Tensor) -> Task:
        """Start writing the rows of ``src`` (uint8 ``[len(keys), block_nbytes]``) as the blocks of ``keys``.

        A key whose block file already exists is skipped and counted as stored (content is addressed by key); a
        FIFO, device, socket or empty directory at its path (not a block) is replaced. I/O errors never raise: the
        key is reported failed and one warning per errno kind is logged.

        Raises:
            TypeError / ValueError: bad keys or ``src`` (see :func:`~ucm.store.base.check_keys_and_buffer`).
            RuntimeError: the store is closed.
        """
        check_keys_and_buffer(keys, src, "src")
        return self._submit_all(
            keys,
            lambda i: psync.dump_one(self._files, keys[i], row_bytes(src[i])),
            lambda aio, i, done: aio.dump_start(keys[i], row_bytes(src[i]), done),
            "dump",
            nbytes_of=lambda _i: src.shape[1],
        )

    def dump_encoded(
        self, keys: Sequence[bytes], payloads: Sequence[bytes | bytearray | memoryview], codecs: Sequence[int]
    ) -> Task:
        """Start writing ``payloads[i]`` (any size, may differ per key) as the block of ``keys[i]``, recording
        ``codecs[i]`` (u16) in its header (see :meth:`~ucm.store.base.EncodedStore.dump_encoded`). Same semantics as
        :meth:`dump` otherwise (existing files are skipped and count as stored; errors fail the key). ``payloads``
        must stay unchanged until the task is done.

        Raises:
            TypeError / ValueError: bad keys; ``payloads`` or ``codecs`` not one per key; a codec outside u16.
            RuntimeError: the store is closed.
        """
        check_encoded_dump(keys, payloads, codecs)
        views = [memoryview(p).cast("B") for p in payloads]
        return self._submit_all(
            keys,
            lambda i: psync.dump_one(self._files, keys[i], views[i], codecs[i]),
            lambda aio, i, done: aio.dump_start(keys[i], views[i], done, codecs[i]),
            "dump",
            nbytes_of=lambda i: views[i].nbytes,
        )

    def load_encoded(
        self,
        keys: Sequence[bytes],
        max_nbytes: int,
        consume: PayloadDecoder,
    ) -> Task:
        """Start reading the blocks of ``keys`` whatever their codec, each handed to ``consume(i, block)`` on the I/O
        thread that read it, as soon as it is read and checked (magic, version, key, exact size, checksum of the
        stored bytes), so the caller decodes block ``i`` while later blocks are still being read (see
        :meth:`~ucm.store.base.EncodedStore.load_encoded` for ``consume``'s answers).

        ``block.payload`` is a view of the reading thread's buffer (reused for its next read: no allocation, no copy
        per block), valid only during the call. A reason starting with ``FOREIGN`` keeps the file; any other reason
        fails the key as damaged (warning; the file is removed). An exception from ``consume`` fails the key (logged
        as an error). A missing file, a file failing the checks or one whose payload is over ``max_nbytes`` bytes
        (foreign: kept) is never handed over. Reads use the pool threads with positional reads (``O_DIRECT`` with
        ``io_direct``) for either engine; each pool thread keeps one buffer of the largest file it read
        (``io_threads`` buffers in all).

        Raises:
            TypeError / ValueError: bad keys; ``max_nbytes`` < 1.
            RuntimeError: the store is closed.
        """
        check_encoded_load(keys, max_nbytes)

        sizes = [0] * len(keys)  # payload bytes of each block handed over and used

        def consume_sized(i: int, block: EncodedBlock) -> str | None:
            reason = consume(i, block)
            if reason is None:
                sizes[i] = len(block.payload)
            return reason

        def job(i: int) -> bool:
            return psync.load_encoded_one(self._files, keys[i], i, max_nbytes, consume_sized)

        def aio_job(_aio: AioEngine, i: int, done: Future[bool]) -> None:  # on the pool threads for either engine
            done.set_result(job(i))

        return self._submit_all(keys, job, aio_job, "load", nbytes_of=sizes.__getitem__)

    def set_namespace(self, tag: bytes, info: dict[str, Any]) -> None:
        """Tag the blocks dumped from now on with ``namespace_tag(tag)`` (header field) and describe the namespace
        in ``<dir>/namespaces/<tag as 8 hex digits>.json`` of every storage directory, for ``python -m ucm.store
        stats``/``clear --namespace``. A file that cannot be written is a warning, never an error.

        Raises:
            ValueError: ``tag`` is shorter than 4 bytes; TypeError: ``info`` is not JSON-serializable.
        """
        ns_tag = namespace_tag(tag)
        self._files.ns_tag = ns_tag
        text = json.dumps({"tag": f"{ns_tag:08x}", **info}, sort_keys=True, indent=1)
        for d in self._dirs:
            if d in self._read_only_dirs:
                continue
            path = os.path.join(d, NAMESPACE_DIR, f"{ns_tag:08x}.json")
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
        if self._stat_pool is not None:  # a stat blocked on a hung mount must not hold up the close
            self._stat_pool.shutdown(wait=False)
        if self._uring is not None:  # nothing in flight: stop the reaper, release the ring
            self._uring.close()
        self._collector.stop()

    def remove_stored(self, *, keys: Sequence[bytes] | None = None, namespace: bytes | None = None) -> Removal:
        """Delete block files: those of ``keys``, or every block file under the storage directories whose header
        carries ``namespace``'s tag (reads each block's header; files of other namespaces, untagged blocks, temp
        files and namespace files are kept). Safe while other processes use the directories: a block deleted under
        a reader is a miss for it, never wrong data. A read-only directory is not touched and is named in
        :attr:`Removal.errors`, as is each file that could not be deleted.

        Raises:
            TypeError / ValueError: bad arguments (see :func:`~ucm.store.base.check_removal`).
        """
        check_removal(keys, namespace)
        result = Removal()
        files: list[FileInfo] = []
        if keys is not None:
            for key in keys:
                path = self.block_path(key)
                try:
                    st = os.stat(path, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    result.errors.append(f"{path}: {exc.strerror or exc}")
                    continue
                files.append(FileInfo(path, st.st_size, st.st_mtime_ns, st.st_mtime_ns))
        else:
            writable = [d for d in self._dirs if d not in self._read_only_dirs]
            result.errors.extend(f"{d}: read-only storage directory, its blocks are kept" for d in self._read_only_dirs)
            try:
                assert namespace is not None  # check_removal: one of keys and namespace
                files = namespace_blocks(scan_store(writable), namespace_tag(namespace))
            except OSError as exc:
                result.errors.append(f"{exc.filename}: cannot list: {exc.strerror or exc}")
        deletion = delete_files(files)
        self._recorder.record_keys(False, "storage", keys_of_paths(deletion.paths))
        result.blocks, result.nbytes = deletion.files, deletion.bytes
        result.errors.extend(f"{path}: {reason}" for path, reason in deletion.errors)
        return result

    def collect_garbage(self) -> GcResult:
        """Scan the directories, remove stale temp files and, above the capacity, least recently used block files
        down to ``GC_LOW_WATERMARK * capacity_bytes``. Runs in the maintenance thread; callable directly.

        Raises:
            OSError: a storage directory cannot be listed.
        """
        return self._collector.collect()

    # -- internals ------------------------------------------------------------------------------------------

    def _submit_all(
        self,
        keys: Sequence[bytes],
        job: Callable[[int], bool],
        aio_job: Callable[[AioEngine, int, Future[bool]], None],
        what: Op,
        on_finish: Callable[[], None] | None = None,
        nbytes_of: Callable[[int], int] = lambda _i: 0,
    ) -> Task:
        """Run ``job(i)`` (psync: the whole transfer, returns success) or ``aio_job(engine, i, done)`` (aio: opens
        and queues the transfer; ``done`` is resolved by the job on an early failure, else by the io_uring reaper)
        for every key on the pool; ``on_finish`` as in :class:`_Gather`."""
        if self._closed:
            raise RuntimeError("PosixStore is closed")
        if not keys:
            return Task.completed(TaskResult(0))
        gather = _Gather(len(keys), what, on_finish)
        self._observe(gather, what, nbytes_of, keys)
        aio = self._aio
        if aio is not None:
            with self._tasks_lock:
                self._tasks.add(gather.future)
            gather.future.add_done_callback(self._task_done)
        for i in range(len(keys)):
            if aio is None:
                gather.add(i, self._pool.submit(job, i))
            else:
                done: Future[bool] = Future()
                gather.add(i, done)
                self._pool.submit(resolve_on_error, functools.partial(aio_job, aio), i, done)
        return Task(gather.future)

    def _task_done(self, future: Future[TaskResult]) -> None:
        with self._tasks_lock:
            self._tasks.discard(future)

    def _load_shards(
        self, read: ShardedRead, first: int, stop: int, shard_nbytes: int, progress: ShardProgress
    ) -> None:
        """One job of :meth:`load_sharded`, on an I/O thread: shards ``[first, stop)`` of one key (see
        :func:`~ucm.store.posix.sharded.load_shards`). Never raises."""
        load_shards(self._files, read, first, stop, shard_nbytes, progress)

    def _observe(self, gather: _Gather, op: Op, nbytes_of: Callable[[int], int], keys: Sequence[bytes]) -> None:
        """Record ``gather``'s task as one observation (tier ``storage``) when it finishes: its keys, those that
        succeeded, their bytes (``nbytes_of(i)``: key ``i``'s payload bytes), its time from now, the requests of the
        caller's context. A dump's stored ``keys`` are also recorded as held (:meth:`Recorder.record_keys`)."""
        recorder = self._recorder
        track_keys = op == "dump" and recorder.tracks_keys
        if not recorder.enabled and not track_keys:
            return
        t0 = time.perf_counter()
        requests = current_requests()

        def on_result(result: TaskResult) -> None:
            ok = [i for i in range(result.num_keys) if i not in result.failed]
            if track_keys:
                recorder.record_keys(True, "storage", [keys[i] for i in ok])
            if not recorder.enabled:
                return
            nbytes = sum(nbytes_of(i) for i in ok)
            seconds = time.perf_counter() - t0
            recorder.record(
                Observation(op, "storage", result.num_keys, len(ok), nbytes, seconds=seconds, requests=requests)
            )

        gather.on_result = on_result

    def _log_decodes(self, tally: DecodeTally, num_keys: int) -> None:
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
