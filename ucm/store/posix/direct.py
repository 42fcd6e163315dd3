"""Page-aligned buffers for the Posix store's ``O_DIRECT`` I/O (``io_direct: true``) and whole-file reads.

``O_DIRECT`` moves data between the disk and the buffer without the page cache, and needs buffers, file offsets and
lengths in whole ``DIRECT_ALIGN`` units (4 KiB: covers 512 B and 4 KiB sectors). Block files keep their exact size
(a write pads the last unit with zeros, then truncates the padding away), so a read of the last unit ends short: a
read ending off alignment is the end of the file.

Two kinds of buffers, both anonymous ``mmap``s (page-aligned, and costly to map and fault in anew, so reused):

- :class:`AlignedBuffers`: one per thread, grown on demand; for the ``psync`` engine (the thread that fills it is
  the one that uses it) and for buffered whole-file reads (:data:`READ_BUFFERS`);
- :class:`DirectBufferPool`: buffers owned per operation, for ``aio`` + ``O_DIRECT`` (a pool thread fills the
  buffer, the io_uring reaper thread finishes with it), bounded in bytes.
"""

from __future__ import annotations

import mmap
import os
import threading

DIRECT_ALIGN = 4096  # O_DIRECT: buffers, offsets and lengths in multiples of this (covers 512 B and 4 KiB sectors)


def round_up(n: int) -> int:
    """``n`` bytes rounded up to whole ``DIRECT_ALIGN`` units."""
    return -(-n // DIRECT_ALIGN) * DIRECT_ALIGN


def pread_direct(fd: int, buf: memoryview) -> int:
    """Read from offset 0 of ``fd`` into the aligned ``buf`` (a multiple of ``DIRECT_ALIGN`` bytes) with
    ``O_DIRECT`` semantics: every read starts at an aligned offset; a read ending off alignment is the end of the
    file. Returns the bytes read.

    Raises:
        OSError: a read failed.
    """
    off = 0
    while off < buf.nbytes:
        n = os.preadv(fd, [buf[off:]], off)
        if n <= 0:
            break
        off += n
        if off % DIRECT_ALIGN:
            break
    return off


def fill_aligned(buf: memoryview, header: bytes, payload: memoryview) -> None:
    """Lay out a block file for one ``O_DIRECT`` write: ``header``, ``payload``, then zeros to the end of ``buf``
    (at least ``len(header) + payload.nbytes`` bytes)."""
    start = len(header)
    total = start + payload.nbytes
    buf[:start] = header
    buf[start:total] = payload
    buf[total:] = bytes(buf.nbytes - total)


class AlignedBuffers:
    """Per-thread page-aligned buffers (anonymous ``mmap``s, grown on demand, reused; freed with the thread): for
    ``O_DIRECT`` I/O, and for whole-file reads of encoded blocks (:data:`READ_BUFFERS`)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, nbytes: int) -> memoryview:
        """A ``DIRECT_ALIGN``-aligned writable buffer of ``nbytes`` bytes, owned by the calling thread (the same
        memory as this thread's previous one when that was large enough: its content is unspecified)."""
        mm: mmap.mmap | None = getattr(self._local, "mm", None)
        if mm is None or len(mm) < nbytes:  # the old map is freed with its last view
            mm = mmap.mmap(-1, round_up(max(nbytes, 1)))
            self._local.mm = mm
            self._local.view = memoryview(mm)
        view: memoryview = self._local.view
        return view[:nbytes]


# Buffered whole-file reads of encoded blocks: one buffer per thread that reads them (the pool threads of every store
# in the process), holding the largest file that thread read.
READ_BUFFERS = AlignedBuffers()


class DirectBufferPool:
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
        size = round_up(max(nbytes, 1))
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
