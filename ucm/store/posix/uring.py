"""The ``aio`` I/O engine of the Posix store: block data moves through one io_uring (the ``liburing`` binding).

:class:`Uring` is the ring: any thread submits vectored positional reads and writes (``readv``/``writev`` on an
open fd); one reaper thread (``ucm-posix-uring``) takes the completions and calls each operation's callback with
the result (bytes moved, or ``-errno``). It knows nothing about blocks. :class:`AioEngine` moves block files
through it: a pool thread opens the file (the temp file of a write) and queues its data; the reaper validates,
closes and publishes (renames) it. Whole-file reads of encoded blocks and of KVfold files stay on the pool threads
(:mod:`ucm.store.posix.psync`).

Two details of the binding shape this module:
- ``io_uring_wait_cqe`` keeps the GIL while it blocks, so the reaper waits with ``poll`` on the ring's fd (which
  releases it) and then takes ready completions with ``io_uring_peek_cqe``, one at a time (the binding's ``cqe[i]``
  does not wrap around the completion ring).
- Submissions set ``IOSQE_ASYNC``: the kernel hands every operation to its io-wq workers instead of trying it inline
  in ``io_uring_submit``, which would copy a page-cached block while the submitting thread holds the GIL.

Up to ``depth`` operations are in flight; a submitter waits for a free slot beyond that. Buffers and ``Iovec``s stay
referenced until their completion. The kernel cancels (``ECANCELED``) a request whose submitting thread exits before
it completes: submitters must outlive their operations (the Posix stage's pool threads do: its ``close`` waits for
every task before stopping them).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ucm.affinity import daemon_thread
from ucm.logger import init_logger
from ucm.store.codecs import CODEC_RAW
from ucm.store.posix.direct import DirectBufferPool, fill_aligned
from ucm.store.posix.files import BlockFiles, DecodeTally, open_block_file, row_bytes
from ucm.store.posix.format import FILE_MODE, HEADER_NBYTES, KVFOLD_FILE, check_block, not_regular
from ucm.store.posix.psync import load_one, touch

logger = init_logger(__name__)

DEFAULT_DEPTH = 128  # operations in flight (submission queue entries; the completion queue has twice as many)
_WAKEUP = 0  # user_data of the no-op that wakes the reaper at close; operations count from 1
_RETRY_SUBMIT = (errno.EINTR, errno.EAGAIN, errno.EBUSY)


# The binding's calls that Uring makes, on a temp file: run in a child process by _binding_crash.
_PROBE = """
import os, tempfile, liburing
ring = liburing.Ring()
try:
    liburing.io_uring_queue_init(4, ring)
except OSError:
    raise SystemExit(0)  # io_uring refused: Uring reports it in the parent
with tempfile.TemporaryFile() as f:
    os.write(f.fileno(), bytes(4096))
    buf = bytearray(4096)
    iov = liburing.Iovec([memoryview(buf)])
    sqe = liburing.io_uring_get_sqe(ring)
    liburing.io_uring_prep_readv(sqe, f.fileno(), iov, 0)
    liburing.io_uring_sqe_set_data64(sqe, 1)
    liburing.io_uring_sqe_set_flags(sqe, liburing.IOSQE_ASYNC)
    liburing.io_uring_submit(ring)
    cqe = liburing.Cqe()
    while liburing.io_uring_cq_ready(ring) == 0:
        pass
    liburing.io_uring_peek_cqe(ring, cqe)
    liburing.io_uring_cqe_seen(ring, cqe[0])
liburing.io_uring_queue_exit(ring)
"""


@functools.cache
def _binding_crash() -> str | None:
    """Why the ``liburing`` binding kills a process on this machine (``None`` when it does not): its calls are run
    once per process in a child. Needed because a native crash cannot be caught: the liburing 2026.3.30 wheel holds
    AVX-512 instructions (``zmm`` registers, ``objdump -d``), and on an x86-64 CPU without AVX-512 its first call
    dies of SIGILL, which in the serving process would take vLLM down with it."""
    try:
        run = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"a test of the binding in a child process did not finish ({exc})"
    if run.returncode >= 0:
        return None  # ran, or failed with a Python error that the in-process import or set-up reports
    try:
        name = signal.Signals(-run.returncode).name
    except ValueError:
        name = f"signal {-run.returncode}"
    hint = " (an instruction this CPU lacks: the wheel needs AVX-512)" if name == "SIGILL" else ""
    return f"the liburing binding kills a process on this machine with {name}{hint}"


def _import_liburing() -> Any:
    try:
        import liburing
    except ImportError as exc:
        raise ValueError(
            f"posix_io_engine: aio needs the 'liburing' package, which cannot be imported ({exc}); allowed: psync"
        ) from None
    crash = _binding_crash()
    if crash is not None:
        raise ValueError(f"posix_io_engine: aio is not usable: {crash}; allowed: psync")
    return liburing


def aio_unusable_reason() -> str | None:
    """Why ``posix_io_engine: aio`` cannot start on this machine (the ``ValueError`` message :class:`Uring` would
    raise), or ``None`` when an io_uring can be set up. Sets one up and closes it (plus, once per process, a child
    process testing the binding)."""
    try:
        Uring(depth=1).close()
    except ValueError as exc:
        return str(exc)
    return None


class Uring:
    """An io_uring of ``depth`` entries and its reaper thread.

    Raises:
        ValueError: ``liburing`` cannot be imported, crashes a process on this CPU (tested once per process in a
            child), or the kernel refuses io_uring (``io_uring_queue_init`` fails: ``kernel.io_uring_disabled``, a
            seccomp filter, an old kernel), naming ``posix_io_engine``, the reason and the allowed engine.
    """

    def __init__(self, depth: int = DEFAULT_DEPTH) -> None:
        if depth < 1:
            raise ValueError(f"io_uring depth must be >= 1, got {depth}")
        self._lib = lib = _import_liburing()
        self._ring = lib.Ring()
        try:
            lib.io_uring_queue_init(depth, self._ring)
        except OSError as exc:
            raise ValueError(
                f"posix_io_engine: aio cannot set up an io_uring on this system (io_uring_queue_init: "
                f"{exc.strerror or exc}; io_uring may be disabled by kernel.io_uring_disabled or a seccomp filter); "
                "allowed: psync"
            ) from None
        self._slots = threading.BoundedSemaphore(depth)
        self._lock = threading.Lock()  # the submission queue and the table of operations in flight
        self._ops: dict[int, tuple[Any, list[memoryview], Callable[[int], None]]] = {}
        self._next_id = 1
        self._closing = False
        self._reaper = daemon_thread(self._reap, "ucm-posix-uring")
        self._reaper.start()

    def submit(self, fd: int, bufs: list[memoryview], offset: int, write: bool, on_done: Callable[[int], None]) -> None:
        """Queue a ``writev`` (``write``) or ``readv`` of ``bufs`` on ``fd`` at ``offset``; ``on_done(res)`` runs on
        the reaper thread with the bytes moved or ``-errno``. Waits while ``depth`` operations are in flight.

        Raises:
            RuntimeError: the engine is closed (``on_done`` is then never called).
        """
        lib = self._lib
        iov = lib.Iovec(bufs)
        self._slots.acquire()
        with self._lock:
            if self._closing:
                self._slots.release()
                raise RuntimeError("io_uring engine is closed")
            op_id = self._next_id
            self._next_id += 1
            self._ops[op_id] = (iov, bufs, on_done)
            sqe = self._get_sqe()
            if write:
                lib.io_uring_prep_writev(sqe, fd, iov, offset)
            else:
                lib.io_uring_prep_readv(sqe, fd, iov, offset)
            lib.io_uring_sqe_set_data64(sqe, op_id)
            lib.io_uring_sqe_set_flags(sqe, lib.IOSQE_ASYNC)
            self._submit_locked()

    def close(self) -> None:
        """Wait for the operations in flight (their callbacks run), stop the reaper and release the ring.
        Submissions must have stopped. Idempotent."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            sqe = self._get_sqe()
            self._lib.io_uring_prep_nop(sqe)
            self._lib.io_uring_sqe_set_data64(sqe, _WAKEUP)
            self._submit_locked()
        self._reaper.join()
        self._lib.io_uring_queue_exit(self._ring)

    # -- internals (``_locked``/``_get_sqe``: with ``self._lock`` held) -------------------------------------------

    def _get_sqe(self) -> Any:
        sqe = self._lib.io_uring_get_sqe(self._ring)
        while sqe is None:  # the submission queue is full of queued entries: hand them to the kernel, retry
            self._submit_locked()
            sqe = self._lib.io_uring_get_sqe(self._ring)
        return sqe

    def _submit_locked(self) -> None:
        for attempt in range(100):
            try:
                self._lib.io_uring_submit(self._ring)
                return
            except OSError as exc:
                if exc.errno not in _RETRY_SUBMIT:
                    # The entries stay queued and go with the next submission (at the latest close's no-op).
                    logger.error("posix store: io_uring_submit failed: %s; retrying with the next submission", exc)
                    return
                time.sleep(0.001 * (attempt + 1))
        logger.error("posix store: io_uring_submit keeps failing (EAGAIN); retrying with the next submission")

    def _reap(self) -> None:
        lib = self._lib
        poller = select.poll()
        poller.register(self._ring.ring_fd, select.POLLIN)
        cqe = lib.Cqe()
        while True:
            if lib.io_uring_cq_ready(self._ring) == 0:
                with self._lock:
                    if self._closing and not self._ops:
                        return
                poller.poll()  # releases the GIL; the ring's fd is readable while completions wait
                continue
            lib.io_uring_peek_cqe(self._ring, cqe)
            entry = cqe[0]
            op_id = entry.user_data
            try:
                res = entry.res or 0
            except OSError as exc:  # the binding raises for a negative result
                res = -(exc.errno or errno.EIO)
            lib.io_uring_cqe_seen(self._ring, entry)
            if op_id == _WAKEUP:
                continue
            with self._lock:
                op = self._ops.pop(op_id)
            self._slots.release()
            try:
                op[2](res)
            except Exception:  # a bug in a callback must not stop the reaper: the other operations still complete
                logger.exception("posix store: io_uring completion handler failed")


def resolve_on_error(job: Callable[[int, Future[bool]], None], index: int, done: Future[bool]) -> None:
    """Run an aio job ``job(index, done)``; an unexpected exception (a bug, not an I/O error) fails its key through
    ``done`` instead of leaving it unresolved."""
    try:
        job(index, done)
    except BaseException as exc:
        if not done.done():
            done.set_exception(exc)


class AioEngine:
    """Block files moved through an io_uring: a pool thread opens the file and queues its data (:meth:`dump_start`,
    :meth:`load_start`); the reaper finishes the key (:meth:`dump_complete`, :meth:`load_complete`) and resolves its
    ``done`` future with the key's success.

    Args:
        files: the store's block files (placement, write and read steps shared with the ``psync`` engine).
        uring: the ring (owned by the store, which closes it once no operation is in flight).
        buffers: with ``io_direct``, the aligned buffers owned per operation (``O_DIRECT``); else ``None``.
        pool: the store's I/O threads (a KVfold file found by the reaper is decoded there, not on the reaper).
    """

    def __init__(
        self, files: BlockFiles, uring: Uring, buffers: DirectBufferPool | None, pool: ThreadPoolExecutor
    ) -> None:
        self.files = files
        self.uring = uring
        self.buffers = buffers
        self._pool = pool

    def dump_start(self, key: bytes, payload: memoryview, done: Future[bool], codec: int = CODEC_RAW) -> None:
        """aio dump, on a pool thread: create the temp file and queue header + payload (``B``-format, stored with
        codec ``codec``) as one ``writev``; the reaper finishes in :meth:`dump_complete`. With ``io_direct`` the
        temp file is opened with ``O_DIRECT`` and the ``writev`` moves one aligned buffer of the operation's own
        (header, payload, zeros up to whole ``DIRECT_ALIGN`` units), given back at completion;
        :meth:`dump_complete` truncates the padding away.

        Raises:
            RuntimeError: the ring is closed (the temp file is removed first).
        """
        prepared = self.files.prepare_write(key, payload, codec)
        if prepared is None:
            done.set_result(True)
            return
        path, tmp, header, payload = prepared
        pool = self.buffers
        fd = -1
        try:
            self.files.make_dirs(key, os.path.dirname(path))
            direct = os.O_DIRECT if pool is not None else 0
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | direct, FILE_MODE)
        except OSError as exc:
            done.set_result(self.files.write_failed(key, path, tmp, fd, exc))
            return
        total = HEADER_NBYTES + payload.nbytes
        aligned: memoryview | None = None
        try:
            if pool is None:
                bufs = [memoryview(header), payload] if payload.nbytes else [memoryview(header)]
            else:
                aligned = pool.acquire(total)
                fill_aligned(aligned, header, payload)
                bufs = [aligned]
            written = sum(b.nbytes for b in bufs)

            def complete(res: int) -> None:
                try:
                    ok = self.dump_complete(key, path, tmp, fd, total, res, written)
                finally:
                    if aligned is not None and pool is not None:
                        pool.release(aligned)
                done.set_result(ok)

            self.uring.submit(fd, bufs, 0, True, complete)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if aligned is not None and pool is not None:
                pool.release(aligned)
            raise

    def dump_complete(
        self, key: bytes, path: str, tmp: str, fd: int, total: int, res: int, written: int | None = None
    ) -> bool:
        """aio dump, on the reaper: ``res`` is the ``writev`` result of ``written`` bytes (default ``total``, the
        file's size; with ``O_DIRECT``, ``total`` rounded up to whole ``DIRECT_ALIGN`` units, whose padding is then
        truncated away). A short write or an error fails the key. Returns the key's success."""
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
            return self.files.write_failed(key, path, tmp, fd, exc)
        return self.files.written(total)

    def load_start(self, key: bytes, row: torch.Tensor, done: Future[bool], tally: DecodeTally) -> None:
        """aio load into ``row`` (contiguous CPU ``torch.uint8`` ``[block_nbytes]``), on a pool thread: open the file
        and queue one ``readv`` of header + payload (header only when the size is wrong, to tell a foreign file from
        a damaged one); the reaper finishes in :meth:`load_complete`. With ``io_direct`` the file is opened with
        ``O_DIRECT`` and read in whole ``DIRECT_ALIGN`` units into an aligned buffer of the operation's own, given
        back at completion once the payload is validated and copied out. A KVfold file (found by the reaper from the
        header) is read again whole and decoded on a pool thread
        (:func:`~ucm.store.posix.psync.load_one`, counted in ``tally``), not on the reaper.

        Raises:
            RuntimeError: the ring is closed.
        """
        path = self.files.path(key)
        payload = row_bytes(row)
        pool = self.buffers
        try:  # never blocks on a FIFO or device in place of the file; one that is not a regular file is damaged
            fd, stat = open_block_file(path, os.O_RDONLY | (os.O_DIRECT if pool is not None else 0))
        except OSError as exc:
            done.set_result(self.files.read_outcome(key, path, exc, None))
            return
        if fd < 0:
            done.set_result(self.files.read_outcome(key, path, not_regular(stat.st_mode), stat))
            return
        aligned: memoryview | None = None
        try:
            expected = HEADER_NBYTES + payload.nbytes
            if pool is None:
                header = memoryview(bytearray(HEADER_NBYTES))
                full = stat.st_size == expected and payload.nbytes > 0
                bufs = [header, payload] if full else [header]
            else:  # as read_validated: the whole file when it has the expected size, else the header's unit
                aligned = pool.acquire(expected if stat.st_size == expected else HEADER_NBYTES)
                header = aligned[:HEADER_NBYTES]
                bufs = [aligned]

            def complete(res: int) -> None:
                try:
                    ok = self.load_complete(key, path, fd, stat, header, payload, res, aligned)
                finally:
                    if aligned is not None and pool is not None:
                        pool.release(aligned)
                if ok is None:  # a KVfold file: decode it on a pool thread (close waits for the task: pool open)

                    def decode(_i: int, d: Future[bool]) -> None:
                        d.set_result(load_one(self.files, key, row, tally, kvfold=True))

                    self._pool.submit(resolve_on_error, decode, 0, done)
                else:
                    done.set_result(ok)

            self.uring.submit(fd, bufs, 0, False, complete)
        except OSError as exc:
            os.close(fd)
            if aligned is not None and pool is not None:
                pool.release(aligned)
            done.set_result(self.files.read_outcome(key, path, exc, None))
        except BaseException:
            os.close(fd)
            if aligned is not None and pool is not None:
                pool.release(aligned)
            raise

    def load_complete(
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
        into ``payload`` once the header checks pass (see :func:`~ucm.store.posix.format.check_block`). Returns the
        key's success, or ``None`` for a KVfold file (its header read): the caller has it decoded on a pool
        thread."""
        reason: str | OSError | None
        try:
            if res < 0:
                raise OSError(-res, os.strerror(-res))
            reason = check_block(key, payload, stat.st_size, res, header, aligned)
            if reason == KVFOLD_FILE:
                return None
            if reason is None:
                touch(fd, stat)
        except OSError as exc:
            reason = exc
        finally:
            os.close(fd)
        return self.files.read_outcome(key, path, reason, stat)
