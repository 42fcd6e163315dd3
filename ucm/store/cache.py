"""``Cache`` store stage: a DRAM cache of blocks over an optional stage below (write-back, read-through).

Memory: cached blocks live in *slots*, 1-D CPU ``torch.uint8`` tensors of one block's size, kept in LRU order. Slots
are allocated as blocks arrive (lazily, up to the capacity) and reused once their block is evicted, so the cache's
memory is touched (page-faulted) once and then only copied into: writing fresh memory is many times slower than
writing memory already touched (figures: "Store bandwidth" in ``benchmarks/RESULTS.md``). Free slots are kept per
block size; a block of another size gets room by dropping free slots of other sizes, then by evicting. At start,
:meth:`CacheStore.prepare` allocates and writes free slots of the connector's block size up front, on a background
thread: ``prefault_bytes`` of them (config ``cache_prefault_gb``), and at least one request's blocks (``max_model_len``
tokens), so the first blocks cached after a start (the first request's dump, a restart's storage hits) are copied
into touched memory. While the cache still has room for new slots, that thread then keeps one request's blocks of
free written slots ready, replacing each slot taken, so the blocks cached later are copied into touched memory too.
The cache holds at most ``capacity_bytes`` bytes of slots: cached blocks, free slots and slots being filled all count
(Python object overhead is not counted); :attr:`CacheStore.used_bytes` counts the cached blocks alone.

Eviction: least recently used first (``dump`` and ``load`` of a key make it most recent; ``lookup`` does not),
and never a *pinned* block. A block is pinned while a load copies out of it and while its write-back to the
stage below is in flight, so a block is always found in at least one tier once its dump has been accepted. A
block that cannot fit (larger than the capacity, or only pinned blocks left to evict) is not cached; a dump
still writes it to the stage below, and a load reads it from the stage below straight into ``dst``.

Lending: :meth:`CacheStore.lend` hands out the DRAM hits' slots themselves (pinned until the lease is released), so
the connector scatters a DRAM hit straight from its slot into the paged KV, with no copy into a load buffer.

Copies: one per block and direction. ``dump`` copies each new row of ``src`` into its slot (rows already cached
are not copied) and writes back straight from ``src``; a miss of ``load`` is read from the stage below into the
slot that becomes its cache entry (promotion copies nothing), then copied into ``dst``; a miss of ``load_sharded``
(a layerwise load) is read shard by shard straight into ``dst`` and, once validated, copied into its slot. Copies run
as one ``memcpy`` on the thread doing them (see :func:`_copy_row`).

Timing:
- ``dump`` copies the new rows of ``src`` into DRAM before returning, then writes the rows not yet stored below
  to the stage below on one background thread, from ``src``; its task completes when that write-back is done (at
  once without a stage below), so ``src`` must stay unchanged until the task is done, as the contract says.
- ``load`` copies DRAM hits into ``dst`` before returning and starts loads of the misses from the stage below; its
  task completes when those rows are in ``dst``. Blocks loaded from below are then inserted into the cache
  (read-through promotion), within the capacity.
- ``load_sharded`` promotes each miss as soon as the stage below has validated it (on that stage's I/O thread,
  while the other rows are still being read), and completes once every row is in ``dst`` and promoted, sooner than
  with the copies all made after the last row (figures: "Store bandwidth" in ``benchmarks/RESULTS.md``).

Encoded payloads (a stage above that encodes blocks, like ``Compress``) are passed through to the stage below, not
cached: :meth:`CacheStore.encoded_store` answers with the stage below's (``None`` without one, or over one that
keeps canonical blocks only). The slots hold canonical blocks, whose size the caller of a load knows; an encoded
payload's size is known only once it is read, and a DRAM hit would still need a decode. No supported pipeline puts
``Compress`` over ``Cache``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ucm.affinity import daemon_thread, thread_pool
from ucm.logger import init_logger
from ucm.store.base import (
    EncodedStore,
    Lease,
    Removal,
    RowCallback,
    ShardProgress,
    Task,
    TaskResult,
    UcmKVStoreBase,
    call_on_row,
    check_keys,
    check_keys_and_buffer,
    check_shards,
    row_runs,
    tiered_lookup,
)
from ucm.store.observe import Observation, Op, Recorder, current_requests

logger = init_logger(__name__)

# How often the prefault thread checks, between slots taken, whether its store was dropped without close() (s).
_REFILL_POLL_S = 1.0


def _copy_row(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[:] = src`` for two 1-D uint8 CPU tensors of the same size, as one ``memcpy`` on this thread.

    Not ``Tensor.copy_``: that splits a large copy over torch's intra-op threads, and on a host whose other cores
    are busy (vLLM's, or another process's) the split copy waits for them, many times slower than one ``memcpy``
    (figures: "Store bandwidth" in ``benchmarks/RESULTS.md``). numpy releases the GIL while it copies, and writes
    into inference tensors (vLLM's buffers) from any thread.
    """
    np.copyto(dst.numpy(), src.numpy())


@dataclass
class _Entry:
    data: torch.Tensor  # [block_nbytes] uint8, CPU: the slot holding the block, owned by the cache
    pins: int = 0  # > 0: in use (being copied out, or being written back); never evicted
    stored_below: bool = False  # the stage below holds the block (written back or promoted from it)
    writing: bool = False  # a write-back of this block is in flight


@dataclass
class _Read:
    """One load from the stage below, started by :meth:`CacheStore.load` for some of its misses."""

    task: Task | None  # None: the stage below refused to start it (every index failed)
    indices: list[int]  # rows of the caller's dst
    slot: torch.Tensor | None = None  # a single miss read into this slot (then copied to dst); None: read into dst
    generation: int = 0  # the cache's generation when the read started: promoted only if still current


class CacheStore(UcmKVStoreBase):
    """DRAM cache stage (LRU, bounded in bytes) with write-back to and read-through from ``inner``.

    Buffers follow the contract of :mod:`ucm.store.base`: CPU ``torch.uint8`` tensors
    ``[num_keys, block_nbytes]``, one row per key. All methods are thread-safe.

    Args:
        inner: the stage below (e.g. a :class:`~ucm.store.posix.PosixStore`), or ``None`` for a DRAM-only
            store. The cache owns it: :meth:`close` closes it.
        capacity_bytes: the most bytes of slots (cached blocks, free and in-flight slots) the cache holds (> 0).
        prefault_bytes: bytes of free slots :meth:`prepare` allocates and writes up front (0: only the one request's
            blocks :meth:`prepare` is told of; at most ``capacity_bytes``).

    Raises:
        ValueError: ``capacity_bytes`` <= 0, or ``prefault_bytes`` outside ``[0, capacity_bytes]``.
    """

    def __init__(self, inner: UcmKVStoreBase | None, capacity_bytes: int, prefault_bytes: int = 0) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        if not 0 <= prefault_bytes <= capacity_bytes:
            raise ValueError(f"prefault_bytes must lie in [0, capacity_bytes = {capacity_bytes}], got {prefault_bytes}")
        self._inner = inner
        self._capacity = int(capacity_bytes)
        self._prefault_bytes = int(prefault_bytes)
        self._prefault_thread: threading.Thread | None = None
        self._reserve_nbytes = 0  # block size of the free written slots the prefault thread keeps ready (0: none)
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # LRU first, MRU last
        self._used = 0  # bytes of the cached blocks' slots
        self._slot_bytes = 0  # bytes of every slot allocated: cached, free, or being filled; <= capacity
        self._free: dict[int, list[torch.Tensor]] = {}  # block nbytes -> free slots of that size
        self._lock = threading.Lock()
        self._slot_taken = threading.Condition(self._lock)  # wakes the prefault thread to refill the reserve
        # Bumped by drop_cached: a block read from below, or copied in by a dump, under an older generation is not
        # cached (it was in flight when the DRAM tier was emptied).
        self._generation = 0
        self._evicted_blocks = 0  # blocks evicted to make room, since start
        self._evicted_bytes = 0
        self._pending: dict[Future[TaskResult], int] = {}  # write-backs in flight: their number of blocks
        self._closed = False
        # One writer thread: write-backs reach the stage below in dump order. Loads from below wait on their
        # own thread so that they never queue behind write-backs.
        self._writer = thread_pool(1, "ucm-cache-wb") if inner is not None else None
        self._loader = thread_pool(1, "ucm-cache-rd") if inner is not None else None

    # -- introspection ------------------------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        """Capacity in bytes of slots."""
        return self._capacity

    @property
    def used_bytes(self) -> int:
        """Bytes of block data currently cached (always <= ``slot_bytes`` <= ``capacity_bytes``)."""
        with self._lock:
            return self._used

    @property
    def slot_bytes(self) -> int:
        """Bytes of DRAM the cache holds in slots: cached blocks, free slots, slots being filled (<= capacity)."""
        with self._lock:
            return self._slot_bytes

    def usage(self) -> tuple[int, int]:
        """``(used_bytes, slot_bytes)`` read together: each property alone may change between two reads while other
        threads load and dump."""
        with self._lock:
            return self._used, self._slot_bytes

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
        """Copy the new rows of ``src`` (uint8 ``[len(keys), nbytes]``) into DRAM, then write them back below.

        Keys already cached are only touched (made most recently used), not copied. The task completes when the
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
        t0 = time.perf_counter()
        nbytes = src.shape[1]
        cached: set[int] = set()
        # (index, entry or None) of the rows written back from src; entry None: the row is not cached
        write_back: list[tuple[int, _Entry | None]] = []
        new: list[int] = []  # rows to cache, if they fit
        fills: list[tuple[int, torch.Tensor]] = []  # (index, slot) of the rows to copy into DRAM
        with self._lock:
            generation = self._generation
            for i, key in enumerate(keys):
                entry = self._entries.get(key)
                if entry is not None and entry.data.numel() == nbytes:
                    self._entries.move_to_end(key)
                    cached.add(i)
                    self._schedule_write_back(i, entry, write_back)
                    continue
                if entry is not None:  # same key, other size: the new block replaces it if it can
                    if entry.pins:
                        write_back.append((i, None))
                        continue
                    self._remove(key)
                new.append(i)
            for i, slot in zip(new, self._take_slots(nbytes, len(new), steal=self._inner is None), strict=True):
                if slot is None:
                    write_back.append((i, None))
                else:
                    fills.append((i, slot))
        try:
            for i, slot in fills:  # the one copy of a new row, outside the lock
                _copy_row(slot, src[i])
        except BaseException:
            with self._lock:
                for _, slot in fills:
                    self._release_slot(slot)
                self._unpin_write_back(write_back)
            raise
        copied = 0  # new rows copied into DRAM and kept
        inserted: list[bytes] = []  # their keys
        if fills:
            with self._lock:
                for i, slot in fills:
                    if generation != self._generation:  # the DRAM tier was emptied meanwhile: write back only
                        self._release_slot(slot)
                        write_back.append((i, None))
                        continue
                    entry = self._entries.get(keys[i])
                    if entry is not None and entry.data.numel() == nbytes:  # cached meanwhile (a duplicate key)
                        self._release_slot(slot)
                        cached.add(i)
                        self._schedule_write_back(i, entry, write_back)
                        continue
                    if entry is not None:
                        if entry.pins:
                            self._release_slot(slot)
                            write_back.append((i, None))
                            continue
                        self._remove(keys[i])
                    entry = _Entry(slot)
                    self._entries[keys[i]] = entry
                    self._used += nbytes
                    cached.add(i)
                    copied += 1
                    inserted.append(keys[i])
                    self._schedule_write_back(i, entry, write_back)
                self._recorder.record_keys(True, "dram", inserted)
        self._record("dump", len(keys), copied, copied * nbytes, time.perf_counter() - t0)
        if self._inner is None or not write_back:
            failed = frozenset(i for i in range(len(keys)) if i not in cached)
            return Task.completed(TaskResult(len(keys), failed))
        write_back.sort(key=lambda item: item[0])
        assert self._writer is not None
        try:
            # In the caller's context: the stage below's observations name the caller's requests.
            run = contextvars.copy_context().run
            future = self._writer.submit(run, self._write_back, list(keys), cached, write_back, src)
        except RuntimeError:  # closed concurrently: drop the pins taken above
            with self._lock:
                self._unpin_write_back(write_back)
            raise RuntimeError("CacheStore is closed") from None
        with self._lock:
            self._pending[future] = len(write_back)
        future.add_done_callback(self._forget_pending)
        return Task(future)

    def load(self, keys: Sequence[bytes], dst: torch.Tensor) -> Task:
        """Read the blocks of ``keys`` into the rows of ``dst`` (uint8 ``[len(keys), block_nbytes]``).

        DRAM hits are copied before this returns. Each miss is read from the stage below into a free slot, copied
        into ``dst`` and then kept as a cache entry; misses that get no slot (too big, or only pinned blocks to
        evict) are read straight into ``dst`` and not cached. ``TaskResult.failed`` holds the indices that no tier
        produced (their rows are unspecified).

        Raises:
            TypeError / ValueError: bad keys or ``dst`` (see :func:`~ucm.store.base.check_keys_and_buffer`).
            RuntimeError: the store is closed.
        """
        check_keys_and_buffer(keys, dst, "dst")
        self._check_open()
        if not keys:
            return Task.completed(TaskResult(0))
        nbytes = dst.shape[1]
        t0 = time.perf_counter()
        misses = self._copy_hits(keys, dst)
        hits = len(keys) - len(misses)
        self._record("load", len(keys), hits, hits * nbytes, time.perf_counter() - t0)
        if not misses:
            return Task.completed(TaskResult(len(keys)))
        if self._inner is None:
            return Task.completed(TaskResult(len(keys), frozenset(misses)))
        with self._lock:  # after the hits were touched, as the misses are promoted after them
            slots = self._take_slots(nbytes, len(misses), steal=True)
            generation = self._generation
        reads = self._start_reads(keys, dst, misses, slots, generation)
        assert self._loader is not None
        result: Future[TaskResult] = Future()
        try:
            self._loader.submit(self._finish_load_safely, list(keys), dst, reads, result)
        except RuntimeError:  # closed concurrently: wait for the reads here, so that no slot is reused under one
            self._finish_load_safely(list(keys), dst, reads, result)
        return Task(result)

    def lend(self, keys: Sequence[bytes], block_nbytes: int) -> Lease:
        """Lend the DRAM hits among ``keys`` (blocks of ``block_nbytes`` bytes): each lent slot is pinned (never
        evicted, nor reused after :meth:`drop_cached`) until the lease is released, and made most recently used;
        the lent blocks are recorded as a load's DRAM hits. Keys not cached, or cached at another size, are not lent.

        Raises:
            TypeError / ValueError: a key is not 16 ``bytes``, or ``block_nbytes`` < 1.
            RuntimeError: the store is closed.
        """
        check_keys(keys)
        if block_nbytes < 1:
            raise ValueError(f"block_nbytes must be >= 1, got {block_nbytes}")
        self._check_open()
        t0 = time.perf_counter()
        hits = self._pin_hits(keys, block_nbytes)
        rows: list[torch.Tensor | None] = [None] * len(keys)
        for i, entry in hits:
            rows[i] = entry.data
        if not hits:
            return Lease(rows)
        self._record("load", len(hits), len(hits), len(hits) * block_nbytes, time.perf_counter() - t0)
        return Lease(rows, functools.partial(self._unpin, hits))

    def load_sharded(
        self,
        keys: Sequence[bytes],
        dst: torch.Tensor,
        num_shards: int,
        progress: ShardProgress | None = None,
        on_row: RowCallback | None = None,
    ) -> Task:
        """A sharded load (see :meth:`~ucm.store.base.UcmKVStoreBase.load_sharded`): DRAM hits are copied whole
        before this returns (all their shards ready, ``on_row`` called for them); the misses are read from the stage
        below straight into ``dst`` with its own ``load_sharded``, one call per run of consecutive rows, reporting
        into the same progress, so each shard reaches the caller as soon as the stage below has it.

        Read-through promotion happens row by row: as soon as the stage below has validated a row (its ``on_row``
        hook, on the thread that validated it), the row is copied from ``dst`` into a slot and cached (within the
        capacity), then this call's ``on_row`` is called for it; so the copies run while the stage below still
        reads the other rows (and while a layerwise caller computes its first layers), not all after the last row.
        The task completes once every row is settled and promoted: the caller may reuse ``dst`` as soon as it is
        done.

        Raises:
            TypeError / ValueError: bad keys or ``dst``, or ``num_shards`` not dividing the row size.
            RuntimeError: the store is closed.
        """
        check_keys_and_buffer(keys, dst, "dst")
        check_shards(dst, num_shards)
        self._check_open()
        if progress is None:
            progress = ShardProgress(num_shards, len(keys))
        with self._lock:
            generation = self._generation
        t0 = time.perf_counter()
        misses = self._copy_hits(keys, dst)
        hits = len(keys) - len(misses)
        self._record("load", len(keys), hits, hits * dst.shape[1], time.perf_counter() - t0)
        progress.done_all(len(keys) - len(misses))
        missed = set(misses)
        for i in range(len(keys)):
            if i not in missed:
                call_on_row(on_row, i, True)
        if not misses or self._inner is None:
            progress.done_all(len(misses))
            for i in misses:
                call_on_row(on_row, i, False)
            return Task.completed(TaskResult(len(keys), frozenset(misses)), progress)
        reads: list[_Read] = []
        for a, b in row_runs(misses):
            promote = functools.partial(self._promote_row, keys, dst, a, on_row, generation)
            try:
                task: Task | None = self._inner.load_sharded(keys[a:b], dst[a:b], num_shards, progress, promote)
            except Exception:
                logger.exception("cache store: load of %d blocks from the stage below failed to start", b - a)
                progress.done_all(b - a)
                for i in range(a, b):
                    call_on_row(on_row, i, False)
                task = None
            reads.append(_Read(task, list(range(a, b))))
        assert self._loader is not None
        result: Future[TaskResult] = Future()
        try:
            self._loader.submit(self._finish_sharded_safely, len(keys), reads, result)
        except RuntimeError:  # closed concurrently
            self._finish_sharded_safely(len(keys), reads, result)
        return Task(result, progress)

    def prepare(self, block_nbytes: int, request_blocks: int = 0) -> None:
        """Pass both down, and start filling free slots of ``block_nbytes`` in the background (once per store; see
        the module doc): ``prefault_bytes`` of them, and at least ``request_blocks`` (one request's blocks, within
        the capacity), so that the first request after a start, a cold one's dump or a hit's promotion, copies into
        memory already paged in. The thread logs ``Cache stage: prefaulted N slots ...`` once that is done, then
        keeps ``request_blocks`` free written slots ready while the cache has room for new slots: a slot taken from
        them is replaced in the background, so later requests' dumps do not write fresh pages either. It runs at
        the lowest CPU priority (nice 19) where the platform allows and stops at :meth:`close`.

        Raises:
            ValueError: ``block_nbytes`` < 1 or ``request_blocks`` < 0.
        """
        if block_nbytes < 1:
            raise ValueError(f"block_nbytes must be >= 1, got {block_nbytes}")
        if request_blocks < 0:
            raise ValueError(f"request_blocks must be >= 0, got {request_blocks}")
        if self._inner is not None:
            self._inner.prepare(block_nbytes, request_blocks)
        reserve = min(request_blocks, self._capacity // block_nbytes)
        target = max(self._prefault_bytes, reserve * block_nbytes)
        with self._lock:
            if self._closed or target < block_nbytes or self._prefault_thread is not None:
                return
            self._reserve_nbytes = block_nbytes if reserve else 0
            # The thread holds the store weakly: a store dropped without close() is still collected (its threads end).
            prefault = functools.partial(CacheStore._prefault, weakref.ref(self), block_nbytes, target, reserve)
            self._prefault_thread = daemon_thread(prefault, "ucm-cache-prefault")
            self._prefault_thread.start()  # under the lock: close() never sees a thread it cannot join

    @staticmethod
    def _prefault(ref: weakref.ref[CacheStore], nbytes: int, target: int, reserve: int) -> None:
        """The prefault thread of the store ``ref``: allocate, write and free ``target // nbytes`` slots of ``nbytes``
        (fewer when the cache fills); then, until :meth:`close` (or the store is collected), keep ``reserve`` of them
        ready (see :meth:`prepare`), refilled each time a slot is taken."""
        with contextlib.suppress(OSError, AttributeError):  # per-thread nice: Linux; elsewhere full priority
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        t0 = time.perf_counter()
        count = 0
        store = ref()
        while store is not None and (count + 1) * nbytes <= target:
            with store._lock:
                if store._closed or store._slot_bytes + nbytes > store._capacity:
                    break
                store._slot_bytes += nbytes  # counted while being written, like a slot being filled
            store._add_written_slot(nbytes)
            count += 1
        logger.info(
            "Cache stage: prefaulted %d slots of %d bytes (%.2f GiB) in %.0f ms",
            count,
            nbytes,
            count * nbytes / 2**30,
            (time.perf_counter() - t0) * 1e3,
        )
        del store  # from here on, held only while refilling
        while reserve:
            store = ref()
            if store is None:
                return
            with store._lock:
                if store._closed:
                    return
                if not store._reserve_short(nbytes, reserve):
                    slot_taken = store._slot_taken
                    del store
                    slot_taken.wait(_REFILL_POLL_S)  # woken by a slot taken, or to see whether the store is gone
                    continue
                store._slot_bytes += nbytes
            store._add_written_slot(nbytes)
            del store

    def _reserve_short(self, nbytes: int, reserve: int) -> bool:
        """Whether fewer than ``reserve`` free slots of ``nbytes`` are ready and a new one fits. Caller holds the
        lock."""
        return len(self._free.get(nbytes, ())) < reserve and self._slot_bytes + nbytes <= self._capacity

    def _add_written_slot(self, nbytes: int) -> None:
        """Allocate a slot of ``nbytes`` (already counted in ``_slot_bytes``), write every page of it and make it
        free."""
        slot = torch.empty(nbytes, dtype=torch.uint8)
        slot.fill_(0)  # writes every page: the page faults happen here, not on a load's or dump's critical path
        with self._lock:
            self._release_slot(slot)

    def encoded_store(self) -> EncodedStore | None:
        """The stage below's encoded payloads, passed through uncached (see the module docstring); ``None`` without
        a stage below or over one that keeps canonical blocks only."""
        return self._inner.encoded_store() if self._inner is not None else None

    def set_recorder(self, recorder: Recorder) -> None:
        """Record this stage's loads (DRAM hits) and dumps (blocks copied into DRAM), tier ``dram``, and pass
        ``recorder`` down."""
        self._recorder = recorder
        if self._inner is not None:
            self._inner.set_recorder(recorder)

    def gauges(self) -> dict[str, float]:
        """``dram:used_bytes`` (cached blocks), ``dram:capacity_bytes``, ``dram:evicted_blocks_total`` and
        ``dram:evicted_bytes_total`` (evicted to make room since start), ``dram:write_back_pending_blocks`` (dumped
        blocks not yet written to the stage below), and the stage below's."""
        with self._lock:
            own = {
                "dram:used_bytes": float(self._used),
                "dram:capacity_bytes": float(self._capacity),
                "dram:evicted_blocks_total": float(self._evicted_blocks),
                "dram:evicted_bytes_total": float(self._evicted_bytes),
                "dram:write_back_pending_blocks": float(sum(self._pending.values())),
            }
        return {**(self._inner.gauges() if self._inner is not None else {}), **own}

    def _record(self, op: Op, blocks: int, ok: int, nbytes: int, seconds: float) -> None:
        """Record a load (``ok``: DRAM hits) or dump (``ok``: blocks copied into DRAM) of ``blocks`` blocks."""
        if self._recorder.enabled:
            self._recorder.record(
                Observation(op, "dram", blocks, ok, nbytes, seconds=seconds, requests=current_requests())
            )

    def set_namespace(self, tag: bytes, info: dict[str, Any]) -> None:
        """Pass the model namespace down to the stage below (the DRAM tier keeps nothing per namespace)."""
        if self._inner is not None:
            self._inner.set_namespace(tag, info)

    def drop_cached(self) -> int:
        """Empty the DRAM tier; return the number of blocks dropped (the stage below keeps what it stores).

        The slots of the dropped blocks become free slots (the cache's memory stays allocated, for the blocks to
        come). A block pinned at that moment (being copied out by a load, or written back) is dropped too, but its
        slot is not reused: the copy or write-back finishes from it, and the slot is freed when that ends, so for
        that time the cache may hold up to those blocks' bytes above its capacity. Loads and dumps running
        meanwhile stay correct: a block they read from the stage below or copy in before this call returns is not
        cached after it (the cache's generation changed), and write-backs still reach the stage below.
        """
        with self._lock:
            self._generation += 1
            dropped, self._entries = self._entries, OrderedDict()
            for entry in dropped.values():
                nbytes = entry.data.numel()
                self._used -= nbytes
                if entry.pins:  # in use: the slot leaves the cache's accounting, freed by its last user
                    self._slot_bytes -= nbytes
                else:
                    self._release_slot(entry.data)
        if dropped:
            logger.debug("cache store: dropped %d cached blocks", len(dropped))
            if self._recorder.tracks_keys:
                self._recorder.record_keys(False, "dram", list(dropped))
        return len(dropped) + (self._inner.drop_cached() if self._inner is not None else 0)

    def remove_stored(self, *, keys: Sequence[bytes] | None = None, namespace: bytes | None = None) -> Removal:
        """Passed down to the stage below (see :meth:`~ucm.store.base.UcmKVStoreBase.remove_stored`); the DRAM tier
        is emptied by :meth:`drop_cached`.

        Raises:
            TypeError / ValueError: bad arguments (see :func:`~ucm.store.base.check_removal`).
        """
        if self._inner is None:
            return super().remove_stored(keys=keys, namespace=namespace)
        return self._inner.remove_stored(keys=keys, namespace=namespace)

    def flush(self) -> None:
        """Block until every write-back and read-through promotion started so far has finished."""
        with self._lock:
            pending = list(self._pending)
        for future in pending:
            future.exception()  # waits; a failed write-back is already reported in its task
        if self._loader is not None and not self._closed:
            # One loader thread, FIFO: earlier promotions are done. RuntimeError: the interpreter is exiting (vLLM's
            # engine shut down from an atexit hook); its thread pools run their queued work to the end.
            with contextlib.suppress(RuntimeError):
                self._loader.submit(lambda: None).result()

    def close(self) -> None:
        """Flush, stop the background threads and close the stage below. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._slot_taken.notify_all()
        self.flush()
        if self._prefault_thread is not None:
            self._prefault_thread.join()  # stops after the slot it is writing
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
            self._pending.pop(future, None)

    def _schedule_write_back(self, i: int, entry: _Entry, write_back: list[tuple[int, _Entry | None]]) -> None:
        """Add row ``i`` to ``write_back`` (pinning ``entry``) unless its block is stored below or being written.

        Caller holds the lock.
        """
        if self._inner is not None and not entry.stored_below and not entry.writing:
            entry.writing = True
            entry.pins += 1
            write_back.append((i, entry))

    def _unpin_write_back(self, write_back: list[tuple[int, _Entry | None]]) -> None:
        """Undo :meth:`_schedule_write_back` for a write-back that will not run. Caller holds the lock."""
        for _, entry in write_back:
            if entry is not None:
                entry.pins -= 1
                entry.writing = False

    def _remove(self, key: bytes) -> None:
        """Drop ``key``'s entry (unpinned); its slot becomes free. Caller holds the lock."""
        entry = self._entries.pop(key)
        self._used -= entry.data.numel()
        self._release_slot(entry.data)
        self._recorder.record_keys(False, "dram", (key,))

    def _promote_slot(self, key: bytes, slot: torch.Tensor, generation: int) -> None:
        """Make ``slot`` (filled with ``key``'s block, read from the stage below by a read started in
        ``generation``) ``key``'s entry, stored below; release it instead when the key is cached already, the store
        is closed or :meth:`drop_cached` ran since the read started. Caller holds the lock."""
        if not self._closed and key not in self._entries and generation == self._generation:
            self._entries[key] = _Entry(slot, stored_below=True)
            self._used += slot.numel()
            self._recorder.record_keys(True, "dram", (key,))
        else:
            self._release_slot(slot)

    def _release_slot(self, slot: torch.Tensor) -> None:
        """Return ``slot`` (no longer an entry's, not being filled) to the free slots. Caller holds the lock."""
        self._free.setdefault(slot.numel(), []).append(slot)

    def _take_slot(self, nbytes: int) -> torch.Tensor | None:
        """A slot of ``nbytes`` bytes to fill, or ``None`` when it cannot fit. Caller holds the lock.

        In order: a free slot of that size; a new slot, if the capacity allows; else room made by dropping free
        slots of other sizes, then by evicting least recently used unpinned blocks until an evicted block's slot has
        the right size (it is reused) or enough bytes are given back for a new slot. When even evicting every
        unpinned block would not make room, nothing is dropped or evicted. The slot is not an entry yet: the caller
        fills it, then inserts it or releases it.
        """
        if nbytes > self._capacity:
            return None
        free = self._free.get(nbytes)
        if free:
            if nbytes == self._reserve_nbytes:
                self._slot_taken.notify()
            return free.pop()
        need = self._slot_bytes + nbytes - self._capacity
        if need > 0:
            drop_free: list[int] = []  # sizes of free slots to give back (none of size nbytes: there are none)
            for size, slots in self._free.items():
                for _ in slots:
                    if need <= 0:
                        break
                    drop_free.append(size)
                    need -= size
            victims: list[bytes] = []
            reuse = False
            if need > 0:
                for key, entry in self._entries.items():
                    if entry.pins:
                        continue
                    victims.append(key)
                    if entry.data.numel() == nbytes:
                        reuse = True
                        break
                    need -= entry.data.numel()
                    if need <= 0:
                        break
                if need > 0 and not reuse:
                    return None  # evicting every unpinned block would not make room: evict nothing
            for size in drop_free:
                self._free[size].pop()
                self._slot_bytes -= size
            self._evicted_blocks += len(victims)
            self._recorder.record_keys(False, "dram", victims)
            for key in victims:
                entry = self._entries.pop(key)
                self._evicted_bytes += entry.data.numel()
                self._used -= entry.data.numel()
                if reuse and key == victims[-1]:
                    return entry.data
                self._slot_bytes -= entry.data.numel()
        self._slot_bytes += nbytes
        # Untouched until filled: pages fault in once, on first use. (The reserve was empty: it is refilled with
        # the room left.)
        return torch.empty(nbytes, dtype=torch.uint8)

    def _take_slots(self, nbytes: int, n: int, steal: bool) -> list[torch.Tensor | None]:
        """Slots of ``nbytes`` bytes for ``n`` blocks of one call, in order (see :meth:`_take_slot`).

        With ``steal``, when no more room can be made, a block takes the slot of the call's earliest block that has
        one, as if the blocks were inserted one by one, each evicting the least recently used: of a call larger
        than the cache, the last blocks are cached. Without it (a dump's blocks are pinned by their write-back once
        inserted), the first blocks keep their slots. ``None`` for a block left without a slot. Caller holds the
        lock.
        """
        slots: list[torch.Tensor | None] = []
        oldest = 0
        for _ in range(n):
            slot = self._take_slot(nbytes)
            if slot is None and steal:
                while oldest < len(slots) and slots[oldest] is None:
                    oldest += 1
                if oldest < len(slots):
                    slot, slots[oldest] = slots[oldest], None
            slots.append(slot)
        return slots

    def _write_back(
        self,
        keys: list[bytes],
        cached: set[int],
        write_back: list[tuple[int, _Entry | None]],
        src: torch.Tensor,
    ) -> TaskResult:
        """Write rows ``write_back`` of ``src`` to the stage below, one ``dump`` per run of consecutive rows.

        The rows come straight from ``src``: this runs within the dump's task, and the caller keeps ``src``
        unchanged until that task is done.
        """
        assert self._inner is not None
        rows = [i for i, _ in write_back]
        inner_failed: set[int] = set()
        try:
            # Every started dump is waited for, even when another fails: the caller may reuse src once this returns.
            tasks: list[tuple[int, int, Task]] = []
            for a, b in row_runs(rows):
                try:
                    tasks.append((a, b, self._inner.dump(keys[a:b], src[a:b])))
                except Exception:
                    logger.exception("cache store: write-back of %d blocks failed to start", b - a)
                    inner_failed.update(range(a, b))
            for a, b, task in tasks:
                try:
                    inner_failed.update(a + j for j in self._inner.wait(task).failed)
                except Exception:
                    logger.exception("cache store: write-back of %d blocks failed", b - a)
                    inner_failed.update(range(a, b))
        finally:
            with self._lock:
                for i, entry in write_back:
                    if entry is not None:
                        entry.pins -= 1
                        entry.writing = False
                        entry.stored_below = i not in inner_failed
        if inner_failed:
            logger.debug("cache store: stage below did not store %d of %d blocks", len(inner_failed), len(write_back))
        failed = frozenset(i for i in inner_failed if i not in cached)
        return TaskResult(len(keys), failed)

    def _copy_hits(self, keys: Sequence[bytes], dst: torch.Tensor) -> list[int]:
        """Copy the cached blocks of ``keys`` into their rows of ``dst`` (pinned meanwhile; each becomes most
        recently used); return the indices of the misses."""
        hits = self._pin_hits(keys, dst.shape[1])
        try:
            for i, entry in hits:
                _copy_row(dst[i], entry.data)
        finally:
            self._unpin(hits)
        hit = {i for i, _ in hits}
        return [i for i in range(len(keys)) if i not in hit]

    def _pin_hits(self, keys: Sequence[bytes], nbytes: int) -> list[tuple[int, _Entry]]:
        """``(index, entry)`` of the keys cached as blocks of ``nbytes`` bytes, each pinned and made most recently
        used (undo with :meth:`_unpin`)."""
        hits: list[tuple[int, _Entry]] = []
        with self._lock:
            for i, key in enumerate(keys):
                entry = self._entries.get(key)
                if entry is not None and entry.data.numel() == nbytes:
                    entry.pins += 1
                    self._entries.move_to_end(key)
                    hits.append((i, entry))
        return hits

    def _unpin(self, hits: list[tuple[int, _Entry]]) -> None:
        """Release the pins :meth:`_pin_hits` took."""
        with self._lock:
            for _, entry in hits:
                entry.pins -= 1

    def _promote_row(
        self,
        keys: Sequence[bytes],
        dst: torch.Tensor,
        offset: int,
        on_row: RowCallback | None,
        generation: int,
        j: int,
        ok: bool,
    ) -> None:
        """The stage below's ``on_row`` hook of a sharded load started in ``generation``: cache row ``offset + j`` of
        ``dst`` if it loaded (copied into a slot, within the capacity), then call the caller's ``on_row``. Never
        raises."""
        i = offset + j
        if ok:
            try:
                self._insert_copy(keys[i], dst[i], generation)
            except Exception:
                logger.exception("cache store: caching a block loaded from the stage below failed")
        call_on_row(on_row, i, ok)

    def _insert_copy(self, key: bytes, row: torch.Tensor, generation: int) -> None:
        """Cache a copy of ``row`` (a block just validated by the stage below, read in ``generation``) as ``key``'s
        entry, stored below; nothing when the key is cached already, the store is closed, :meth:`drop_cached` ran
        since the read started or no slot can be had."""
        with self._lock:
            if self._closed or key in self._entries or generation != self._generation:
                return
            slot = self._take_slot(row.numel())
        if slot is None:
            return
        try:
            with torch.inference_mode():  # row may be a view of an inference tensor (vLLM's)
                _copy_row(slot, row)
        except BaseException:
            with self._lock:
                self._release_slot(slot)
            raise
        with self._lock:
            self._promote_slot(key, slot, generation)

    def _finish_sharded_safely(self, num_keys: int, reads: list[_Read], result: Future[TaskResult]) -> None:
        """Complete a sharded load: wait for the stage below (whose rows were promoted by :meth:`_promote_row`
        before its tasks completed), then resolve ``result``; if anything raises first, fail the missed keys (never
        hang)."""
        try:
            failed: set[int] = set()
            for read in reads:
                if read.task is None:
                    failed.update(read.indices)
                    continue
                try:
                    bad = self._inner.wait(read.task).failed  # type: ignore[union-attr]
                except Exception:
                    logger.exception("cache store: load of %d blocks from the stage below failed", len(read.indices))
                    bad = frozenset(range(len(read.indices)))
                failed.update(read.indices[j] for j in bad)
            result.set_result(TaskResult(num_keys, frozenset(failed)))
        except Exception:
            logger.exception("cache store: finishing a sharded load of %d blocks failed", num_keys)
            if not result.done():
                result.set_result(TaskResult(num_keys, frozenset(i for read in reads for i in read.indices)))

    def _start_reads(
        self,
        keys: Sequence[bytes],
        dst: torch.Tensor,
        misses: list[int],
        slots: list[torch.Tensor | None],
        generation: int,
    ) -> list[_Read]:
        """Start the loads of ``misses`` from the stage below: the misses with a slot into their slots (one
        :meth:`~ucm.store.base.UcmKVStoreBase.load_rows` call), the others into ``dst``, one load per run of
        consecutive rows. A load the stage below refuses to start fails its rows."""
        assert self._inner is not None
        reads: list[_Read] = []
        for i, slot in zip(misses, slots, strict=True):
            if slot is not None:
                reads.append(_Read(None, [i], slot, generation))
        if reads:
            try:
                tasks = self._inner.load_rows(
                    [keys[read.indices[0]] for read in reads],
                    [read.slot.view(1, -1) for read in reads if read.slot is not None],
                )
                for read, task in zip(reads, tasks, strict=True):
                    read.task = task
            except Exception:
                logger.exception("cache store: load of %d blocks from the stage below failed to start", len(reads))
        runs = [_Read(None, list(range(a, b)), generation=generation)
                for a, b in row_runs([i for i, slot in zip(misses, slots, strict=True) if slot is None])]  # fmt: skip
        for read in runs:
            a, b = read.indices[0], read.indices[-1] + 1
            try:
                read.task = self._inner.load(keys[a:b], dst[a:b])
            except Exception:
                logger.exception("cache store: load of %d blocks from the stage below failed to start", b - a)
        return reads + runs

    def _finish_load_safely(
        self, keys: list[bytes], dst: torch.Tensor, reads: list[_Read], result: Future[TaskResult]
    ) -> None:
        """Run :meth:`_finish_load`; if it raises before resolving the result, fail the missed keys (never hang).

        Whatever happens, every slot is inserted as an entry or released once its read is over.
        """
        try:
            # The caller's dst may be an inference tensor (vLLM runs the model under torch.inference_mode);
            # in-place writes to it from this thread must be in inference mode too.
            with torch.inference_mode():
                self._finish_load(keys, dst, reads, result)
        except Exception:
            misses = [i for read in reads for i in read.indices]
            logger.exception("cache store: finishing a load of %d blocks failed", len(misses))
            if not result.done():
                result.set_result(TaskResult(len(keys), frozenset(misses)))
            for read in reads:  # a slot is reused only once the stage below has stopped writing into it
                if read.slot is not None and read.task is not None:
                    with contextlib.suppress(Exception):
                        read.task.result()
            with self._lock:
                for read in reads:
                    if read.slot is not None:
                        self._release_slot(read.slot)
                        read.slot = None

    def _finish_load(
        self, keys: list[bytes], dst: torch.Tensor, reads: list[_Read], result: Future[TaskResult]
    ) -> None:
        """Complete a load whose misses went to the stage below: fill ``dst``, resolve ``result``, then promote.

        Promotion inserts the slots that the misses were read into as entries (they are already counted in the
        capacity, so nothing is evicted and nothing copied), after ``result`` is resolved.
        """
        assert self._inner is not None
        failed: set[int] = set()
        loaded: list[bool] = []
        for read in reads:
            ok = False
            if read.task is None:
                failed.update(read.indices)
            else:
                try:
                    bad = self._inner.wait(read.task).failed
                    failed.update(read.indices[j] for j in bad)
                    ok = not bad
                except Exception:
                    logger.exception("cache store: load of %d blocks from the stage below failed", len(read.indices))
                    failed.update(read.indices)
            loaded.append(ok)
            if ok and read.slot is not None:
                _copy_row(dst[read.indices[0]], read.slot)
        result.set_result(TaskResult(len(keys), frozenset(failed)))
        with self._lock:
            for read, ok in zip(reads, loaded, strict=True):
                if read.slot is None:
                    continue
                slot, read.slot = read.slot, None
                key = keys[read.indices[0]]
                if ok:
                    self._promote_slot(key, slot, read.generation)
                else:
                    self._release_slot(slot)
