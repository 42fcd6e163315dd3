"""Sharded (layerwise) loads of the Posix store: each key's file opened once and read in runs of shards.

A sharded load (:meth:`~ucm.store.base.UcmKVStoreBase.load_sharded`) fills rows made of ``num_shards`` equal byte
ranges (one per layer). The store cuts each row into runs of consecutive shards and queues one job per (run, key):
all keys' first run before any key's second, and so on. A job (:func:`load_shards`) reads its run with one
positional read on an I/O thread (the header with the first run), with either ``posix_io_engine`` (through an
aligned buffer with ``io_direct``), and reports its shards to the load's :class:`~ucm.store.base.ShardProgress`
whether they were read or failed. The key's last run validates the whole block as a plain load does (header, key,
exact size, checksum of the whole payload: :func:`~ucm.store.posix.format.check_block`) and settles the key
(:func:`finish_sharded`).

KVfold files: the run that opens a file whose size is not the raw block's reads its header; for a KVfold file it
reads the whole file and decodes it into the row (:func:`read_decoded_if_kvfold`), holding the key's other runs
until it is done (they then read nothing), so none of the row's shards is reported before the decoded bytes are in
it. A KVfold file of exactly the raw file's size (possible in principle for a barely compressible lossless block)
is only recognized from the header read with shard 0, after other shards of the row may have been reported with
the file's compressed bytes: such a row is reported failed (a miss; the file is kept and a plain load decodes it),
never as loaded.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from concurrent.futures import Future

import torch

from ucm.store.base import FOREIGN, ShardProgress
from ucm.store.codecs import CODEC_KVFOLD
from ucm.store.posix.direct import AlignedBuffers
from ucm.store.posix.files import BlockFiles, Decoded, DecodeTally, open_block_file, row_bytes
from ucm.store.posix.format import (
    FORMAT_VERSION,
    HEADER,
    HEADER_NBYTES,
    KVFOLD_FILE,
    MAGIC,
    check_block,
    not_regular,
)
from ucm.store.posix.psync import pread_range, read_decoded


def read_decoded_if_kvfold(
    fd: int, size: int, key: bytes, row: torch.Tensor, direct: AlignedBuffers | None
) -> Decoded | None:
    """For a sharded load's file of another size than the raw block's: read its header; for a KVfold file, read
    and decode it whole into ``row`` (:func:`~ucm.store.posix.psync.read_decoded`), else ``None`` (the sharded
    reads go on and validation tells a foreign file from a damaged one, as for any file).

    Raises:
        OSError: reading the file failed.
    """
    header = memoryview(bytearray(HEADER_NBYTES))
    if pread_range(fd, [header], 0, direct) < HEADER_NBYTES:
        return None
    magic, version, codec = HEADER.unpack(header)[:3]
    if (magic, version, codec) != (MAGIC, FORMAT_VERSION, CODEC_KVFOLD):
        return None
    return read_decoded(fd, size, key, row, direct)


class ShardedRead:
    """One key of a sharded load: its file (opened once, by its first run to start), where its shards go (``row``:
    contiguous CPU ``torch.uint8`` ``[block_nbytes]``) and what their reads found.

    Args:
        key: the block key (16 bytes); path: its block file.
        num_runs: how many runs (jobs) read this key; the last one to finish validates it.
        tally: the load's count of KVfold files decoded.
    """

    def __init__(self, key: bytes, path: str, row: torch.Tensor, num_runs: int, tally: DecodeTally) -> None:
        self.key = key
        self.path = path
        self.row = row
        self.payload = row_bytes(row)
        self.header = memoryview(bytearray(HEADER_NBYTES))
        self.stat: os.stat_result | None = None  # at open
        self.future: Future[bool] = Future()
        self.got = 0  # header and payload bytes read, over all runs
        self.error: BaseException | None = None  # the first failure (the open's, when it failed)
        self.decoded: Decoded | None = None  # a KVfold file: read whole and decoded by open
        self.irregular: str | None = None  # not a regular file (a FIFO...): why; never read
        self.tally = tally
        self._fd = -1
        self._remaining = num_runs
        self._lock = threading.Lock()

    def open(self, flags: int, direct: AlignedBuffers | None) -> int | None:
        """The block file's fd, opened with ``flags`` (and ``fstat``-ed) by the first caller; ``None`` when the key
        has already failed or was decoded (later runs need not be read), or is not a regular file
        (:func:`~ucm.store.posix.files.open_block_file`: never blocks; :attr:`irregular` says what it is). A file of
        another size than the raw block's that is a KVfold file is read whole and decoded into the row by the first
        caller, under the lock (the key's other runs wait, so no shard of the row is reported before its decoded
        bytes are in).

        Raises:
            OSError: the open or a read failed.
        """
        with self._lock:
            if self.error is not None or self.decoded is not None or self.irregular is not None:
                return None
            if self._fd < 0:
                fd, self.stat = open_block_file(self.path, flags)
                if fd < 0:
                    self.irregular = not_regular(self.stat.st_mode)
                    return None
                try:
                    if self.stat.st_size != HEADER_NBYTES + self.payload.nbytes:
                        self.decoded = read_decoded_if_kvfold(fd, self.stat.st_size, self.key, self.row, direct)
                except BaseException:
                    os.close(fd)
                    raise
                self._fd = fd
                if self.decoded is not None:
                    return None
            return self._fd

    def run_read(self, got: int, error: BaseException | None) -> bool:
        """Record one run's outcome (``got`` bytes read); True for the key's last run (the caller then validates)."""
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


def load_shards(
    files: BlockFiles, read: ShardedRead, first: int, stop: int, shard_nbytes: int, progress: ShardProgress
) -> None:
    """Read shards ``[first, stop)`` (``shard_nbytes`` bytes each) of one key's block (with the header when
    ``first`` is 0) and report them to ``progress``; the key's last run validates the whole block and resolves
    ``read.future`` (:func:`finish_sharded`). Never raises: a failure is recorded for the key."""
    got, error = 0, None
    error_or_bug: BaseException | None = None
    try:
        fd = read.open(files.read_flags(), files.direct)
        if fd is not None:
            piece = read.payload[first * shard_nbytes : stop * shard_nbytes]
            if first == 0:
                got = pread_range(fd, [read.header, piece], 0, files.direct)
            else:
                got = pread_range(fd, [piece], HEADER_NBYTES + first * shard_nbytes, files.direct)
    except OSError as exc:
        error = exc
        error_or_bug = exc
    except Exception as exc:  # a bug, not an I/O error: fail the key loudly (through its future)
        error_or_bug = exc
    finally:
        for shard in range(first, stop):
            progress.done(shard)
    if read.run_read(got, error_or_bug if error is None else error):
        finish_sharded(files, read)


def finish_sharded(files: BlockFiles, read: ShardedRead) -> None:
    """All shards of ``read`` are in: validate the block as a plain load does and resolve its future (a bug met by
    a run: the future's exception)."""
    read.close()
    if isinstance(read.error, BaseException) and not isinstance(read.error, OSError):
        read.future.set_exception(read.error)
        return
    reason: str | OSError | None = read.error
    if reason is None and read.irregular is not None:  # not a regular file: never read, damaged
        reason = read.irregular
    elif reason is None and read.decoded is not None:  # a KVfold file, read and decoded when opened
        reason = read.tally.add(read.decoded)
        if reason is None:
            assert read.stat is not None
            with contextlib.suppress(OSError):
                os.utime(read.path, ns=(time.time_ns(), read.stat.st_mtime_ns))
    elif reason is None:
        assert read.stat is not None
        reason = check_block(read.key, read.payload, read.stat.st_size, read.got, read.header)
        if reason == KVFOLD_FILE:  # of the raw size: recognized only now, after its shards were reported
            reason = (
                f"{FOREIGN}codec {CODEC_KVFOLD} (KVfold) file of the raw block's size met by a sharded load "
                "after its shards were handed out; a whole-block load decodes it"
            )
        if reason is None:
            with contextlib.suppress(OSError):
                os.utime(read.path, ns=(time.time_ns(), read.stat.st_mtime_ns))
    read.future.set_result(files.read_outcome(read.key, read.path, reason, read.stat))
