"""``Cache`` store stage: a DRAM cache of blocks over an optional stage below (write-back, read-through).

Each cached block is its own 1-D CPU ``torch.uint8`` tensor of ``block_nbytes`` bytes, kept in LRU order. The
cache holds at most ``capacity_bytes`` bytes of block data (sum of the cached blocks' sizes; Python object
overhead is not counted).

Eviction: least recently used first (``dump`` and ``load`` of a key make it most recent; ``lookup`` does not),
and never a *pinned* block. A block is pinned while a load copies out of it and while its write-back to the
stage below is in flight, so a block is always found in at least one tier once its dump has been accepted. A
block that cannot fit (larger than the capacity, or only pinned blocks left to evict) is not cached; a dump
still writes it to the stage below.

Timing:
- ``dump`` copies ``src`` into DRAM before returning, then writes the new blocks to the stage below on one
  background thread; its task completes when that write-back is done (at once without a stage below). ``src``
  rows of blocks that could not be cached are read by the background thread, so ``src`` must stay unchanged
  until the task is done, as the contract says.
- ``load`` copies DRAM hits into ``dst`` before returning and starts one batched load of the misses from the
  stage below; its task completes when those rows are in ``dst``. Blocks loaded from below are inserted into
  the cache (read-through promotion), within the capacity.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ucm.logger import init_logger
from ucm.store.base import Task, TaskResult, UcmKVStoreBase, check_keys, check_keys_and_buffer, tiered_lookup

logger = init_logger(__name__)


@dataclass
class _Entry:
    data: torch.Tensor  # [block_nbytes] uint8, CPU, owned by the cache
    pins: int = 0  # > 0: in use (being copied out, or being written back); never evicted
    stored_below: bool = False  # the stage below holds the block (written back or promoted from it)
    writing: bool = False  # a write-back of this block is in flight


class CacheStore(UcmKVStoreBase):
    """DRAM cache stage (LRU, bounded in bytes) with write-back to and read-through from ``inner``.

    Buffers follow the contract of :mod:`ucm.store.base`: CPU ``torch.uint8`` tensors
    ``[num_keys, block_nbytes]``, one row per key. All methods are thread-safe.

    Args:
        inner: the stage below (e.g. a :class:`~ucm.store.posix.PosixStore`), or ``None`` for a DRAM-only
            store. The cache owns it: :meth:`close` closes it.
        capacity_bytes: the most bytes of block data the cache holds (> 0).

    Raises:
        ValueError: ``capacity_bytes`` <= 0.
    """

    def __init__(self, inner: UcmKVStoreBase | None, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self._inner = inner
        self._capacity = int(capacity_bytes)
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # LRU first, MRU last
        self._used = 0
        self._lock = threading.Lock()
        self._pending: set[Future[TaskResult]] = set()
        self._closed = False
        # One writer thread: write-backs reach the stage below in dump order. Loads from below wait on their
        # own thread so that they never queue behind write-backs.
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="ucm-cache-wb") if inner is not None else None
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="ucm-cache-rd") if inner is not None else None

    # -- introspection ------------------------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        """Capacity in bytes of block data."""
        return self._capacity

    @property
    def used_bytes(self) -> int:
        """Bytes of block data currently cached (always <= ``capacity_bytes``)."""
        with self._lock:
            return self._used

    def cached_keys(self) -> list[bytes]:
        """Keys held in DRAM, least recently used first."""
        with self._lock:
            return list(self._entries)

    # -- contract -----------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` (16-byte ``bytes``) present in DRAM or in the stage below.

        Reads no block data and does not change the LRU order.

        Raises:
            TypeError / ValueError: a key is not 16 ``bytes``.
        """
        check_keys(keys)

        def cached(key: bytes) -> bool:
            with self._lock:
                return key in self._entries

        return tiered_lookup(keys, cached, self._inner)

    def dump(self, keys: Sequence[bytes], src: torch.Tensor) -> Task:
        """Copy the rows of ``src`` (uint8 ``[len(keys), nbytes]``) into DRAM, then write them back below.

        Keys already cached are only touched (made most recently used). The task completes when the
        write-back is done; ``TaskResult.failed`` holds the indices that neither the cache holds nor the stage
        below stored.

        Raises:
            TypeError / ValueError: bad keys or ``src`` (see :func:`~ucm.store.base.check_keys_and_buffer`).
            RuntimeError: the store is closed.
        """
        check_keys_and_buffer(keys, src, "src")
        self._check_open()
        if not keys:
            return Task.completed(TaskResult(0))
        nbytes = src.shape[1]
        with self._lock:
            new = [i for i, key in enumerate(keys) if key not in self._entries]
        copies = {i: src[i].clone() for i in new}  # copy outside the lock
        cached: set[int] = set()
        # (index, key, entry or None); entry None: not cached, written back from src
        write_back: list[tuple[int, bytes, _Entry | None]] = []
        with self._lock:
            for i, key in enumerate(keys):
                entry = self._entries.get(key)
                if entry is not None and entry.data.numel() == nbytes:
                    self._entries.move_to_end(key)
                    cached.add(i)
                    if not entry.stored_below and not entry.writing and self._inner is not None:
                        entry.writing = True
                        entry.pins += 1
                        write_back.append((i, key, entry))
                    continue
                if entry is not None:  # same key, other size: the new block replaces it if it can
                    if entry.pins:
                        write_back.append((i, key, None))
                        continue
                    self._remove(key)
                data = copies[i] if i in copies else src[i].clone()
                entry = self._insert(key, data)
                if entry is not None:
                    cached.add(i)
                if self._inner is not None:
                    if entry is not None:
                        entry.writing = True
                        entry.pins += 1
                    write_back.append((i, key, entry))
        if self._inner is None or not write_back:
            failed = frozenset(i for i in range(len(keys)) if i not in cached)
            return Task.completed(TaskResult(len(keys), failed))
        assert self._writer is not None
        try:
            future = self._writer.submit(self._write_back, len(keys), cached, write_back, src)
        except RuntimeError:  # closed concurrently: drop the pins taken above
            with self._lock:
                for _, _, entry in write_back:
                    if entry is not None:
                        entry.pins -= 1
                        entry.writing = False
            raise RuntimeError("CacheStore is closed") from None
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._forget_pending)
        return Task(future)

    def load(self, keys: Sequence[bytes], dst: torch.Tensor) -> Task:
        """Read the blocks of ``keys`` into the rows of ``dst`` (uint8 ``[len(keys), block_nbytes]``).

        DRAM hits are copied before this returns; misses are loaded from the stage below in one batch and
        promoted into the cache. ``TaskResult.failed`` holds the indices that no tier produced (their rows are
        unspecified).

        Raises:
            TypeError / ValueError: bad keys or ``dst`` (see :func:`~ucm.store.base.check_keys_and_buffer`).
            RuntimeError: the store is closed.
        """
        check_keys_and_buffer(keys, dst, "dst")
        self._check_open()
        if not keys:
            return Task.completed(TaskResult(0))
        nbytes = dst.shape[1]
        hits: list[tuple[int, _Entry]] = []
        misses: list[int] = []
        with self._lock:
            for i, key in enumerate(keys):
                entry = self._entries.get(key)
                if entry is not None and entry.data.numel() == nbytes:
                    entry.pins += 1
                    self._entries.move_to_end(key)
                    hits.append((i, entry))
                else:
                    misses.append(i)
        try:
            for i, entry in hits:
                dst[i].copy_(entry.data)
        finally:
            with self._lock:
                for _, entry in hits:
                    entry.pins -= 1
        if not misses:
            return Task.completed(TaskResult(len(keys)))
        if self._inner is None:
            return Task.completed(TaskResult(len(keys), frozenset(misses)))
        miss_keys = [keys[i] for i in misses]
        # Misses are read into a staging tensor this stage owns: rows are copied to dst, the result is resolved, and
        # only then are they promoted into DRAM (the caller may reuse dst as soon as the task is done).
        staging = torch.empty((len(misses), nbytes), dtype=torch.uint8)
        inner_task = self._inner.load(miss_keys, staging)
        assert self._loader is not None
        result: Future[TaskResult] = Future()
        self._loader.submit(self._finish_load_safely, len(keys), misses, miss_keys, staging, dst, inner_task, result)
        return Task(result)

    def flush(self) -> None:
        """Block until every write-back and read-through promotion started so far has finished."""
        with self._lock:
            pending = list(self._pending)
        for future in pending:
            future.exception()  # waits; a failed write-back is already reported in its task
        if self._loader is not None and not self._closed:
            self._loader.submit(lambda: None).result()  # one loader thread, FIFO: earlier promotions are done

    def close(self) -> None:
        """Flush, stop the background threads and close the stage below. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.flush()
        if self._writer is not None:
            self._writer.shutdown(wait=True)
        if self._loader is not None:
            self._loader.shutdown(wait=True)
        if self._inner is not None:
            self._inner.close()

    # -- internals ----------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("CacheStore is closed")

    def _forget_pending(self, future: Future[TaskResult]) -> None:
        with self._lock:
            self._pending.discard(future)

    def _remove(self, key: bytes) -> None:
        entry = self._entries.pop(key)
        self._used -= entry.data.numel()

    def _insert(self, key: bytes, data: torch.Tensor) -> _Entry | None:
        """Insert ``data`` (1-D uint8) under ``key``, evicting LRU unpinned blocks; ``None`` if it cannot fit.

        Caller holds the lock and has checked that ``key`` is not cached.
        """
        nbytes = data.numel()
        if nbytes > self._capacity:
            return None
        need = self._used + nbytes - self._capacity
        if need > 0:
            victims: list[bytes] = []
            for k, e in self._entries.items():
                if need <= 0:
                    break
                if e.pins == 0:
                    victims.append(k)
                    need -= e.data.numel()
            if need > 0:
                return None  # evicting every unpinned block would not make room: evict nothing
            for k in victims:
                self._remove(k)
        entry = _Entry(data)
        self._entries[key] = entry
        self._used += nbytes
        return entry

    def _write_back(
        self,
        num_keys: int,
        cached: set[int],
        write_back: list[tuple[int, bytes, _Entry | None]],
        src: torch.Tensor,
    ) -> TaskResult:
        assert self._inner is not None
        wb_keys = [key for _, key, _ in write_back]
        inner_failed: set[int] = set(range(len(write_back)))
        try:
            batch = torch.stack([e.data if e is not None else src[i] for i, _, e in write_back])
            result = self._inner.wait(self._inner.dump(wb_keys, batch))
            inner_failed = set(result.failed)
        except Exception:
            logger.exception("cache store: write-back of %d blocks failed", len(write_back))
        finally:
            with self._lock:
                for j, (_, _, entry) in enumerate(write_back):
                    if entry is not None:
                        entry.pins -= 1
                        entry.writing = False
                        entry.stored_below = j not in inner_failed
        if inner_failed:
            logger.debug("cache store: stage below did not store %d of %d blocks", len(inner_failed), len(write_back))
        failed = frozenset(write_back[j][0] for j in inner_failed if write_back[j][0] not in cached)
        return TaskResult(num_keys, failed)

    def _finish_load_safely(self, num_keys: int, misses: list[int], *args: object) -> None:
        """Run :meth:`_finish_load`; if it raises before resolving the result, fail the missed keys (never hang)."""
        result = args[-1]
        assert isinstance(result, Future)
        try:
            # The caller's dst may be an inference tensor (vLLM runs the model under torch.inference_mode);
            # in-place writes to it from this thread must be in inference mode too.
            with torch.inference_mode():
                self._finish_load(num_keys, misses, *args)  # type: ignore[arg-type]
        except Exception:
            logger.exception("cache store: finishing a load of %d blocks failed", len(misses))
            if not result.done():
                result.set_result(TaskResult(num_keys, frozenset(misses)))

    def _finish_load(
        self,
        num_keys: int,
        misses: list[int],
        miss_keys: list[bytes],
        staging: torch.Tensor,
        dst: torch.Tensor,
        inner_task: Task,
        result: Future[TaskResult],
    ) -> None:
        """Complete a load whose misses went to the stage below: fill ``dst``, resolve ``result``, then promote.

        The promotion into DRAM happens after ``result`` is resolved, so it is not on the caller's critical path.
        """
        assert self._inner is not None
        try:
            inner_result = self._inner.wait(inner_task)
        except Exception:
            logger.exception("cache store: load of %d blocks from the stage below failed", len(misses))
            result.set_result(TaskResult(num_keys, frozenset(misses)))
            return
        loaded = [j for j in range(len(misses)) if j not in inner_result.failed]
        for j in loaded:
            dst[misses[j]].copy_(staging[j])
        result.set_result(TaskResult(num_keys, frozenset(misses[j] for j in inner_result.failed)))
        if staging.shape[1] > self._capacity:
            return
        for j in loaded:
            with self._lock:
                if not self._closed and miss_keys[j] not in self._entries:
                    # A copy, not a view of staging: a view would keep the whole staging tensor alive while any
                    # of its rows is cached, and DRAM use would exceed what the capacity accounting counts.
                    entry = self._insert(miss_keys[j], staging[j].clone())
                    if entry is not None:
                        entry.stored_below = True
