"""The ``psync`` I/O engine of the Posix store: one block file per job, moved by syscalls on the pool thread that
runs the job (``write`` into a fresh temp file; positional ``preadv`` reads at explicit offsets).

Also what the ``aio`` engine leaves to the pool threads: whole-file reads of encoded blocks (``load_encoded``) and of
KVfold files met by a plain load, read into the reading thread's buffer and decoded right there
(:func:`ucm.store.codecs.decode_into`). Layer runs of a sharded load use :func:`pread_range`.

With ``io_direct``, files are opened with ``O_DIRECT`` and the data moves through the thread's aligned buffer
(:mod:`ucm.store.posix.direct`), in whole ``DIRECT_ALIGN`` units: a write pads the file's last unit with zeros and
then truncates it to its exact size; a read copies the bytes it needs out of the aligned buffer.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Callable

import torch

from ucm.store.base import FOREIGN, EncodedBlock, PayloadDecoder
from ucm.store.codecs import CODEC_RAW, decode_into, max_encoded_nbytes
from ucm.store.posix.direct import (
    DIRECT_ALIGN,
    READ_BUFFERS,
    AlignedBuffers,
    fill_aligned,
    pread_direct,
    round_up,
)
from ucm.store.posix.files import BlockFiles, Decoded, DecodeTally, open_block_file, row_bytes
from ucm.store.posix.format import (
    FILE_MODE,
    HEADER,
    HEADER_NBYTES,
    KVFOLD_FILE,
    check_block,
    check_encoded,
    not_regular,
)


def write_all(fd: int, data: memoryview) -> None:
    """Write all of ``data`` to ``fd``, looping over short writes.

    Raises:
        OSError: a write failed, or returned 0 bytes (``EIO``).
    """
    off = 0
    while off < data.nbytes:
        n = os.write(fd, data[off:])
        if n <= 0:  # not expected from a regular file; avoid spinning forever
            raise OSError(errno.EIO, "write returned 0 bytes")
        off += n


def preadv_full(fd: int, bufs: list[memoryview], offset: int) -> int:
    """Fill ``bufs`` in order from ``fd`` at ``offset`` (bytes) with positional vectored reads (one ``preadv`` when
    the kernel returns everything, as for a regular file); stop at EOF. Return the number of bytes read.

    Raises:
        OSError: a read failed.
    """
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


def pread_range(fd: int, views: list[memoryview], offset: int, direct: AlignedBuffers | None) -> int:
    """Fill the consecutive ``views`` from ``fd`` at ``offset`` (the file's bytes ``[offset, offset + total)``);
    return how many bytes were filled (fewer at EOF). With ``direct`` (``fd`` opened with ``O_DIRECT``) the whole
    ``DIRECT_ALIGN`` units covering the range are read into this thread's aligned buffer and copied out.

    Raises:
        OSError: a read failed.
    """
    if direct is None:
        return preadv_full(fd, views, offset)
    start = offset - offset % DIRECT_ALIGN
    total = sum(v.nbytes for v in views)
    buf = direct.get(round_up(offset - start + total))
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


def touch(fd: int, stat: os.stat_result) -> None:
    """A hit: refresh the block's recency (atime, keeping ``stat``'s mtime) for garbage collection (best effort)."""
    with contextlib.suppress(OSError):
        os.utime(fd, ns=(time.time_ns(), stat.st_mtime_ns))


def read_validated(
    fd: int, size: int, key: bytes, payload: memoryview, direct: AlignedBuffers | None = None
) -> str | None:
    """Read one raw block file of ``size`` bytes (from ``fstat``) into ``payload`` (a ``B``-format memoryview of
    the expected payload size) and check it with :func:`~ucm.store.posix.format.check_block`; return ``None`` when
    valid, else the reason (starting with ``FOREIGN``: a file to keep).

    When the file has the expected size, header and payload come in one ``preadv``; otherwise only the header is
    read, to tell a foreign file from a damaged one. Block files are never modified in place (written under a temp
    name, then renamed), so the size checked by ``fstat`` is the size read. With ``direct`` (``fd`` opened with
    ``O_DIRECT``), the file is read in whole ``DIRECT_ALIGN`` units into an aligned buffer, then the payload is
    copied into ``payload``.

    Raises:
        OSError: reading the file failed.
    """
    expected = HEADER_NBYTES + payload.nbytes
    want = expected if size == expected else HEADER_NBYTES
    if direct is not None:
        buf = direct.get(round_up(want))
        got = pread_direct(fd, buf)
        return check_block(key, payload, size, got, buf[:HEADER_NBYTES], buf)
    header = memoryview(bytearray(HEADER_NBYTES))
    got = preadv_full(fd, [header, payload] if want == expected else [header], 0)
    return check_block(key, payload, size, got, header)


def read_encoded(
    fd: int, size: int, key: bytes, max_nbytes: int, direct: AlignedBuffers | None
) -> tuple[str | None, EncodedBlock | None]:
    """Read and check a whole block file of ``size`` bytes (from ``fstat``) of any codec and payload size (magic,
    version, key, exact size, checksum of the stored bytes: :func:`~ucm.store.posix.format.check_encoded`).

    Returns ``(None, block)`` when valid, else ``(reason, None)``; a reason starting with ``FOREIGN`` marks a file
    to keep (another format version, or larger than ``max_nbytes`` of payload: not a block this reader knows). The
    file is read into the calling thread's buffer (``direct``'s aligned one for ``O_DIRECT``, else
    :data:`~ucm.store.posix.direct.READ_BUFFERS`), and ``block.payload`` is a view of it: valid until this thread's
    next read through that buffer. A buffer per thread, reused, spares the allocation (and page faults) of one per
    block.

    Raises:
        OSError: reading the file failed.
    """
    if size < HEADER_NBYTES:
        return f"file is {size} bytes, shorter than the {HEADER_NBYTES}-byte header", None
    if size - HEADER_NBYTES > max_nbytes:
        return f"{FOREIGN}payload of {size - HEADER_NBYTES} bytes, more than the {max_nbytes} expected", None
    if direct is not None:
        buf = direct.get(round_up(size))
        got = pread_direct(fd, buf)
    else:
        buf = READ_BUFFERS.get(size)
        got = preadv_full(fd, [buf], 0)
    reason = check_encoded(buf, size, got, key)
    if reason is not None:
        return reason, None
    codec = HEADER.unpack_from(buf, 0)[2]
    return None, EncodedBlock(codec, buf[HEADER_NBYTES:size])


def read_decoded(fd: int, size: int, key: bytes, row: torch.Tensor, direct: AlignedBuffers | None) -> Decoded:
    """Read the whole block file ``fd`` of ``size`` bytes (from ``fstat``) into this thread's buffer, check it as
    :func:`read_encoded` does (a payload over :func:`~ucm.store.codecs.max_encoded_nbytes` is foreign) and decode it
    into ``row`` (contiguous CPU ``torch.uint8`` ``[block_nbytes]``, the expected block) by its codec with
    :func:`~ucm.store.codecs.decode_into`.

    KVfold (the case this is for): bit-exact for lossless containers, the lossy values for int8 (fixed-rate) ones. A
    container that this version does not know (container version, mode or dtype: another UCM) or that describes
    another block size is foreign (kept); one that fails to decode is damaged. A raw file (the file was replaced
    since its header was read) of the row's size is copied. Other codecs are foreign. ``row`` is unspecified unless
    the reason is ``None``.

    Raises:
        OSError: reading the file failed.
    """
    t0 = time.perf_counter()
    reason, block = read_encoded(fd, size, key, max_encoded_nbytes(row.numel()), direct)
    if block is None:
        return Decoded(reason, seconds=time.perf_counter() - t0)
    reason, mode = decode_into(block, row)
    raw_nbytes = row.numel() if reason is None else 0
    return Decoded(reason, len(block.payload), raw_nbytes, mode, time.perf_counter() - t0)


def dump_one(files: BlockFiles, key: bytes, payload: memoryview, codec: int = CODEC_RAW) -> bool:
    """Write ``payload`` (``B``-format) as ``key``'s block file with codec ``codec``, on this thread: a temp file,
    then renamed into place. Returns the key's success (an existing file counts as stored; an I/O error fails it)."""
    prepared = files.prepare_write(key, payload, codec)
    if prepared is None:
        return True
    path, tmp, header, payload = prepared
    fd = -1
    try:
        files.make_dirs(key, os.path.dirname(path))
        if files.direct is None:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
            write_all(fd, memoryview(header))
            write_all(fd, payload)
        else:  # one aligned write of header + payload + zero padding, then the padding is cut off
            total = HEADER_NBYTES + payload.nbytes
            buf = files.direct.get(round_up(total))
            fill_aligned(buf, header, payload)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, FILE_MODE)
            write_all(fd, buf)
            if buf.nbytes != total:
                os.ftruncate(fd, total)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
    except OSError as exc:
        return files.write_failed(key, path, tmp, fd, exc)
    return files.written(HEADER_NBYTES + payload.nbytes)


def load_one(files: BlockFiles, key: bytes, row: torch.Tensor, tally: DecodeTally, kvfold: bool = False) -> bool:
    """Read ``key``'s block file into ``row`` (contiguous CPU ``torch.uint8`` ``[block_nbytes]``) on this thread and
    validate it (a KVfold file is read whole and decoded, see :func:`read_decoded`, and counted in ``tally``);
    ``kvfold``: the file is known to be KVfold (the aio engine's reaper found it from the header), so it is decoded
    straight away. Returns the key's success."""
    payload = row_bytes(row)

    def read(fd: int, stat: os.stat_result) -> str | None:
        reason = KVFOLD_FILE if kvfold else read_validated(fd, stat.st_size, key, payload, files.direct)
        if reason == KVFOLD_FILE:  # read it whole and decode it (the raw read above got the header only)
            reason = tally.add(read_decoded(fd, stat.st_size, key, row, files.direct))
        return reason

    return _read_block_file(files, key, read)


def load_encoded_one(files: BlockFiles, key: bytes, i: int, max_nbytes: int, consume: PayloadDecoder) -> bool:
    """Read ``key``'s block file whole (any codec, payload at most ``max_nbytes`` bytes) on this thread and hand it
    to ``consume(i, block)`` once checked (see :meth:`~ucm.store.base.EncodedStore.load_encoded`). Returns the key's
    success."""

    def read(fd: int, stat: os.stat_result) -> str | None:
        reason, block = read_encoded(fd, stat.st_size, key, max_nbytes, files.direct)
        return consume(i, block) if block is not None else reason

    return _read_block_file(files, key, read)


def _read_block_file(files: BlockFiles, key: bytes, read: Callable[[int, os.stat_result], str | None]) -> bool:
    """Open ``key``'s block file (:func:`~ucm.store.posix.files.open_block_file`: never blocking on a FIFO or
    device; one that is not a regular file is damaged and never read), ``read(fd, stat)`` it (``None``: a valid
    block, else why not), refresh its recency on a hit, close it; returns the key's success
    (:meth:`~ucm.store.posix.files.BlockFiles.read_outcome`)."""
    path = files.path(key)
    reason: str | OSError | None
    stat: os.stat_result | None = None
    try:
        fd, stat = open_block_file(path, files.read_flags())
        if fd < 0:
            reason = not_regular(stat.st_mode)
        else:
            try:
                reason = read(fd, stat)
                if reason is None:
                    touch(fd, stat)
            finally:
                os.close(fd)
    except OSError as exc:
        reason = exc
    return files.read_outcome(key, path, reason, stat)
