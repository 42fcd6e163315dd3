"""CacheStore: LRU and capacity in bytes, pinning, write-back to and read-through from the stage below."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

import ucm.store.cache as cache_module
from tests.store.blocks import make_blocks, make_keys, poisoned
from tests.store.helpers import Closer, DictStore
from ucm.store.base import Task, TaskResult, check_keys_and_buffer
from ucm.store.cache import CacheStore
from ucm.store.observe import Observation, Recorder
from ucm.store.posix import PosixStore

NBYTES = 100  # block size in these tests; capacities below are multiples of it plus slack


def test_capacity_must_be_positive() -> None:
    for bad in (0, -1):
        with pytest.raises(ValueError, match="capacity_bytes"):
            CacheStore(None, bad)


def test_dram_only_round_trip_and_lru_order(close_after: Closer) -> None:
    cache = close_after(CacheStore(None, 3 * NBYTES + 50))
    keys = make_keys(4, seed=1)
    src = make_blocks(4, NBYTES, seed=2)
    assert cache.wait(cache.dump(keys[:3], src[:3])).ok
    assert cache.cached_keys() == keys[:3]
    # Loading key 0 makes it most recently used; the next insert evicts key 1, the least recently used.
    dst = poisoned(1, NBYTES)
    assert cache.wait(cache.load(keys[:1], dst)).ok
    assert torch.equal(dst[0], src[0])
    assert cache.cached_keys() == [keys[1], keys[2], keys[0]]
    assert cache.wait(cache.dump(keys[3:], src[3:])).ok
    assert cache.cached_keys() == [keys[2], keys[0], keys[3]]
    assert cache.used_bytes == 3 * NBYTES
    # lookup does not touch the LRU order; dump of a cached key does.
    assert cache.lookup([keys[2]]) == 1
    assert cache.cached_keys() == [keys[2], keys[0], keys[3]]
    assert cache.wait(cache.dump(keys[2:3], src[2:3])).ok
    assert cache.cached_keys() == [keys[0], keys[3], keys[2]]
    dst = poisoned(4, NBYTES)
    result = cache.wait(cache.load(keys, dst))
    assert result.failed == {1}
    for i in (0, 2, 3):
        assert torch.equal(dst[i], src[i])


def test_capacity_respected_in_bytes(close_after: Closer) -> None:
    cache = close_after(CacheStore(None, 3 * NBYTES + 99))
    keys = make_keys(10, seed=3)
    src = make_blocks(10, NBYTES, seed=4)
    cache.wait(cache.dump(keys, src))
    assert cache.used_bytes == 3 * NBYTES <= cache.capacity_bytes
    assert cache.cached_keys() == keys[7:]
    # Blocks of another size share the same byte budget.
    big_keys = make_keys(2, seed=5)
    assert cache.wait(cache.dump(big_keys[:1], make_blocks(1, 2 * NBYTES, seed=6))).ok
    assert cache.used_bytes == 3 * NBYTES
    assert cache.cached_keys() == [keys[9], big_keys[0]]


def test_dram_only_too_big_block_fails(close_after: Closer) -> None:
    cache = close_after(CacheStore(None, NBYTES - 1))
    keys = make_keys(2, seed=7)
    assert cache.wait(cache.dump(keys, make_blocks(2, NBYTES, seed=8))).failed == {0, 1}
    assert cache.used_bytes == 0 and cache.lookup(keys) == 0


def test_pinned_blocks_are_not_evicted(close_after: Closer) -> None:
    inner = DictStore()
    inner.release.clear()  # hold the write-back in flight: its blocks stay pinned
    cache = close_after(CacheStore(inner, 2 * NBYTES))
    keys = make_keys(4, seed=9)
    src = make_blocks(4, NBYTES, seed=10)
    first = cache.dump(keys[:2], src[:2])
    assert inner.dump_started.wait(timeout=10)
    assert not cache.check(first)
    # The cache is full of pinned blocks: key 2 is not cached (nothing evicted) but still goes below.
    second = cache.dump(keys[2:3], src[2:3])
    assert cache.cached_keys() == keys[:2]
    assert cache.lookup(keys[:2]) == 2  # visible from DRAM while the write-back is in flight
    inner.release.set()
    assert cache.wait(first).ok and cache.wait(second).ok
    cache.flush()
    assert set(inner.blocks) == set(keys[:3])
    # Unpinned now: the next insert evicts the least recently used.
    assert cache.wait(cache.dump(keys[3:], src[3:])).ok
    assert cache.cached_keys() == [keys[1], keys[3]]
    dst = poisoned(4, NBYTES)
    assert cache.wait(cache.load(keys, dst)).ok
    assert torch.equal(dst, src)
    cache.close()
    assert inner.closed


def test_lent_blocks_are_the_cached_bytes_and_stay_until_released(close_after: Closer) -> None:
    """``lend``: DRAM hits lent as the slots themselves (misses and other sizes not lent), recorded as DRAM load
    hits, made most recently used, never evicted nor reused while lent (not even after ``drop_cached``), evictable
    once released."""
    cache = close_after(CacheStore(None, 3 * NBYTES + 50))
    keys = make_keys(5, seed=41)
    src = make_blocks(5, NBYTES, seed=42)
    assert cache.wait(cache.dump(keys[:3], src[:3])).ok
    seen: list[Observation] = []
    recorder = Recorder()
    recorder.add_sink(seen.append)
    cache.set_recorder(recorder)
    lease = cache.lend([keys[3], keys[0], keys[1]], NBYTES)
    assert lease.rows[0] is None and lease.lent == 2
    assert torch.equal(lease.rows[1], src[0]) and torch.equal(lease.rows[2], src[1])
    assert [(o.op, o.tier, o.blocks, o.ok, o.nbytes) for o in seen] == [("load", "dram", 2, 2, 2 * NBYTES)]
    assert cache.cached_keys() == [keys[2], keys[0], keys[1]]  # lent: most recently used
    assert cache.lend(keys[:1], NBYTES + 1).lent == 0  # cached at another size: not lent
    # Full: each new block evicts the one block not lent, never key 0 or 1, though least recently used.
    assert cache.wait(cache.dump(keys[3:4], src[3:4])).ok
    assert cache.cached_keys() == [keys[0], keys[1], keys[3]]
    assert cache.wait(cache.dump(keys[4:5], src[4:5])).ok
    assert cache.cached_keys() == [keys[0], keys[1], keys[4]]
    # Emptied while lent: the lent slots are not handed to the next blocks, and keep their bytes.
    slots = [lease.rows[1], lease.rows[2]]
    cache.drop_cached()
    assert cache.wait(cache.dump(keys[2:5], make_blocks(3, NBYTES, seed=43))).ok
    assert torch.equal(slots[0], src[0]) and torch.equal(slots[1], src[1])
    lease.release()
    lease.release()  # idempotent
    assert cache.wait(cache.dump(keys[:2], src[:2])).ok  # room made by evicting
    with cache.lend(keys[:2], NBYTES) as again:
        assert again.lent == 2
    with pytest.raises(ValueError, match="block_nbytes must be >= 1, got 0"):
        cache.lend(keys[:1], 0)
    with pytest.raises(ValueError):
        cache.lend([b"short"], NBYTES)


def test_stages_without_a_dram_tier_lend_nothing(tmp_path: Path, close_after: Closer) -> None:
    store = close_after(PosixStore(str(tmp_path / "kv")))
    keys = make_keys(2, seed=44)
    assert store.wait(store.dump(keys, make_blocks(2, NBYTES, seed=45))).ok
    with store.lend(keys, NBYTES) as lease:
        assert lease.rows == [None, None] and lease.lent == 0


def test_write_back_reaches_posix(tmp_path: Path, close_after: Closer) -> None:
    dirs = f"{tmp_path / 'a'}:{tmp_path / 'b'}"
    cache = close_after(CacheStore(PosixStore(dirs), 8 * NBYTES))
    keys = make_keys(20, seed=11)
    src = make_blocks(20, NBYTES, seed=12)
    task = cache.dump(keys, src)
    cache.flush()
    assert cache.check(task) and cache.wait(task).ok
    fresh = close_after(PosixStore(dirs))
    dst = poisoned(20, NBYTES)
    assert fresh.wait(fresh.load(keys, dst)).ok
    assert torch.equal(dst, src)
    fresh.close()
    cache.close()
    cache.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        cache.dump(keys, src)


def test_read_through_promotion(tmp_path: Path, close_after: Closer) -> None:
    kv = str(tmp_path / "kv")
    keys = make_keys(6, seed=13)
    src = make_blocks(6, NBYTES, seed=14)
    writer = close_after(PosixStore(kv))
    assert writer.wait(writer.dump(keys, src)).ok
    writer.close()

    cache = close_after(CacheStore(PosixStore(kv), 4 * NBYTES))
    assert cache.cached_keys() == []
    assert cache.lookup(keys) == 6
    dst = poisoned(1, NBYTES)
    assert cache.wait(cache.load(keys[:1], dst)).ok  # all missed DRAM: loaded from storage
    assert torch.equal(dst[0], src[0])
    cache.flush()  # promotion into DRAM finishes after the load's result
    assert cache.cached_keys() == keys[:1]
    # Key 0 now comes from DRAM, the others from storage into a staging buffer, then into the right rows.
    dst = poisoned(6, NBYTES)
    assert cache.wait(cache.load(keys, dst)).ok
    assert torch.equal(dst, src)
    cache.flush()
    assert cache.cached_keys() == keys[2:6]  # promoted within capacity, LRU-evicting the oldest
    # The promoted blocks are served from DRAM even once storage loses them.
    for path in (tmp_path / "kv").rglob("*.ucmb"):
        path.unlink()
    dst = poisoned(6, NBYTES)
    result = cache.wait(cache.load(keys, dst))
    assert result.failed == {0, 1}
    assert torch.equal(dst[2:], src[2:])


def test_load_mixed_tiers_and_missing(close_after: Closer) -> None:
    inner = DictStore()
    cache = close_after(CacheStore(inner, 10 * NBYTES))
    keys = make_keys(6, seed=15)
    src = make_blocks(6, NBYTES, seed=16)
    assert cache.wait(cache.dump(keys[:2], src[:2])).ok  # DRAM and below
    inner.blocks[keys[3]] = src[3].clone()  # below only
    inner.blocks[keys[5]] = src[5].clone()
    del inner.blocks[keys[1]]  # DRAM only
    dst = poisoned(6, NBYTES)
    result = cache.wait(cache.load(keys, dst))
    assert result.failed == {2, 4}
    for i in (0, 1, 3, 5):
        assert torch.equal(dst[i], src[i])
    assert torch.equal(dst[2], poisoned(1, NBYTES)[0]) and torch.equal(dst[4], poisoned(1, NBYTES)[0])


def test_lookup_across_tiers(close_after: Closer) -> None:
    inner = DictStore()
    cache = close_after(CacheStore(inner, 10 * NBYTES))
    keys = make_keys(6, seed=17)
    src = make_blocks(6, NBYTES, seed=18)
    assert cache.wait(cache.dump([keys[0], keys[1], keys[4]], src[[0, 1, 4]])).ok
    cache.flush()
    for k in (keys[0], keys[1], keys[4]):
        del inner.blocks[k]  # those three in DRAM only
    inner.blocks[keys[2]] = src[2].clone()  # those two below only
    inner.blocks[keys[3]] = src[3].clone()
    assert cache.lookup(keys) == 5  # DRAM, DRAM, below, below, DRAM, missing
    del inner.blocks[keys[3]]
    assert cache.lookup(keys) == 3
    assert cache.lookup(keys[5:]) == 0
    assert cache.lookup([]) == 0


def test_too_big_block_goes_to_inner_only(tmp_path: Path, close_after: Closer) -> None:
    kv = str(tmp_path / "kv")
    cache = close_after(CacheStore(PosixStore(kv), NBYTES // 2))
    keys = make_keys(3, seed=19)
    src = make_blocks(3, NBYTES, seed=20)
    assert cache.wait(cache.dump(keys, src)).ok
    assert cache.cached_keys() == [] and cache.used_bytes == 0
    posix = close_after(PosixStore(kv))
    assert posix.lookup(keys) == 3
    posix.close()
    dst = poisoned(3, NBYTES)
    assert cache.wait(cache.load(keys, dst)).ok  # from storage, not promoted (too big)
    assert torch.equal(dst, src)
    assert cache.cached_keys() == []


def test_failed_write_back_of_uncached_block_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, close_after: Closer
) -> None:
    regular = tmp_path / "regular_file"
    regular.write_bytes(b"x")
    posix = close_after(PosixStore(str(tmp_path / "kv")))
    monkeypatch.setattr(posix._files, "dirs", [str(regular / "kv")])  # every write fails (ENOTDIR)
    cache = close_after(CacheStore(posix, 2 * NBYTES))
    keys = make_keys(3, seed=21)
    # Keys 0 and 1 fit in DRAM (held, so not failed); key 2 fits nowhere.
    result = cache.wait(cache.dump(keys, make_blocks(3, NBYTES, seed=22)))
    assert result.failed == {2}
    assert cache.lookup(keys) == 2


def test_failed_write_back_is_retried_on_next_dump(close_after: Closer) -> None:
    inner = DictStore()

    def failing_dump(keys: Sequence[bytes], src: torch.Tensor) -> Task:
        return Task.completed(TaskResult(len(keys), frozenset(range(len(keys)))))

    cache = close_after(CacheStore(inner, 4 * NBYTES))
    keys = make_keys(2, seed=23)
    src = make_blocks(2, NBYTES, seed=24)
    inner.dump = failing_dump  # type: ignore[method-assign]
    assert cache.wait(cache.dump(keys, src)).ok  # held in DRAM
    del inner.dump  # back to the class's dump
    assert cache.wait(cache.dump(keys, src)).ok
    assert set(inner.blocks) == set(keys)
    inner.dumped.clear()
    assert cache.wait(cache.dump(keys, src)).ok
    assert inner.dumped == []  # already below: no third write


def test_concurrent_dumps_and_loads(close_after: Closer) -> None:
    inner = DictStore()
    cache = close_after(CacheStore(inner, 16 * NBYTES))
    keys = make_keys(64, seed=25)
    src = make_blocks(64, NBYTES, seed=26)
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(150):
            idx = rng.sample(range(64), 5)
            if rng.random() < 0.5:
                if not cache.wait(cache.dump([keys[i] for i in idx], src[idx])).ok:
                    errors.append("dump failed")
            else:
                dst = poisoned(5, NBYTES)
                result = cache.wait(cache.load([keys[i] for i in idx], dst))
                for j, i in enumerate(idx):
                    if j not in result.failed and not torch.equal(dst[j], src[i]):
                        errors.append(f"wrong bytes for key {i}")
            if cache.used_bytes > cache.capacity_bytes:
                errors.append("over capacity")

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    cache.flush()
    assert errors == []
    dst = poisoned(64, NBYTES)
    assert cache.wait(cache.load(keys, dst)).failed == {i for i in range(64) if keys[i] not in inner.blocks}


def test_load_into_inference_tensor_from_both_tiers(tmp_path: Path, close_after: Closer) -> None:
    """vLLM runs the model under torch.inference_mode, so the worker's dst is an inference tensor; the part of a
    load that finishes on the cache's own thread must still be able to write into it."""
    keys = make_keys(3, seed=21)
    src = make_blocks(3, NBYTES, seed=22)
    writer = close_after(PosixStore(str(tmp_path / "kv")))
    assert writer.wait(writer.dump(keys, src)).ok
    writer.close()
    cache = close_after(CacheStore(PosixStore(str(tmp_path / "kv")), 8 * NBYTES))
    with torch.inference_mode():
        assert cache.wait(cache.load(keys[:1], poisoned(1, NBYTES))).ok  # promotes key 0 into DRAM
        cache.flush()
        dst = poisoned(3, NBYTES)
        result = cache.wait(cache.load(keys, dst))  # key 0 from DRAM, keys 1-2 from files via the loader thread
    assert result.ok
    assert torch.equal(dst, src)


# -- block slots: reuse, capacity counted in slots, mixed sizes, no slot reused under a reader -------------------


class SlowLoadStore(DictStore):
    """DictStore whose loads finish on a thread once ``load_release`` is set; records the buffers it loads into."""

    def __init__(self) -> None:
        super().__init__()
        self.load_release = threading.Event()
        self.load_release.set()
        self.load_started = threading.Event()
        self.load_buffers: list[int] = []  # data_ptr of every buffer handed to load
        self.dump_buffers: list[int] = []  # data_ptr of every buffer handed to dump

    def load(self, keys: Sequence[bytes], dst: torch.Tensor) -> Task:
        check_keys_and_buffer(keys, dst, "dst")
        self.load_buffers.append(dst.data_ptr())
        future: Future[TaskResult] = Future()

        def finish() -> None:
            self.load_started.set()
            assert self.load_release.wait(timeout=10), "test did not release the blocked load"
            future.set_result(super(SlowLoadStore, self).load(keys, dst).result())

        threading.Thread(target=finish).start()
        return Task(future)

    def dump(self, keys: Sequence[bytes], src: torch.Tensor) -> Task:
        self.dump_buffers.append(src.data_ptr())
        return super().dump(keys, src)


def slot_ptrs(cache: CacheStore) -> set[int]:
    """Addresses of the slots holding the cached blocks."""
    return {cache._entries[key].data.data_ptr() for key in cache.cached_keys()}


def test_slots_are_reused_after_eviction_and_keep_bytes(close_after: Closer) -> None:
    cache = close_after(CacheStore(None, 3 * NBYTES + 50))
    keys = make_keys(30, seed=40)
    src = make_blocks(30, NBYTES, seed=41)
    assert cache.wait(cache.dump(keys[:3], src[:3])).ok
    first = slot_ptrs(cache)
    assert len(first) == 3 and cache.slot_bytes == 3 * NBYTES
    for start in range(3, 30, 3):  # every batch evicts the previous one and refills its slots
        assert cache.wait(cache.dump(keys[start : start + 3], src[start : start + 3])).ok
        assert slot_ptrs(cache) == first
        assert cache.slot_bytes == cache.used_bytes == 3 * NBYTES
        dst = poisoned(3, NBYTES)
        assert cache.wait(cache.load(keys[start : start + 3], dst)).ok
        assert torch.equal(dst, src[start : start + 3])
    assert cache.lookup(keys[:27]) == 0


def test_dump_writes_back_from_src_rows_without_copying(close_after: Closer) -> None:
    inner = SlowLoadStore()
    cache = close_after(CacheStore(inner, 10 * NBYTES))
    keys = make_keys(6, seed=42)
    src = make_blocks(6, NBYTES, seed=43)
    assert cache.wait(cache.dump(keys[1:2] + keys[4:5], src[[1, 4]])).ok
    inner.dump_buffers.clear()
    # Keys 1 and 4 are cached and stored below: rows 0, 2-3 and 5 go below as runs of src, no staging copy.
    assert cache.wait(cache.dump(keys, src)).ok
    assert inner.dump_buffers == [src[0].data_ptr(), src[2].data_ptr(), src[5].data_ptr()]
    assert inner.dumped[-4:] == [keys[0], keys[2], keys[3], keys[5]]
    for i, key in enumerate(keys):
        assert torch.equal(inner.blocks[key], src[i])
    src.fill_(0)  # the caller may reuse src once the task is done: the cache holds its own copy
    dst = poisoned(6, NBYTES)
    assert cache.wait(cache.load(keys, dst)).ok
    assert torch.equal(dst, make_blocks(6, NBYTES, seed=43))


def test_promotion_keeps_the_slot_the_miss_was_read_into(close_after: Closer) -> None:
    inner = SlowLoadStore()
    keys = make_keys(4, seed=44)
    src = make_blocks(4, NBYTES, seed=45)
    for i, key in enumerate(keys):
        inner.blocks[key] = src[i].clone()
    cache = close_after(CacheStore(inner, 4 * NBYTES))
    dst = poisoned(4, NBYTES)
    assert cache.wait(cache.load(keys, dst)).ok
    assert torch.equal(dst, src)
    cache.flush()
    assert cache.cached_keys() == keys
    assert slot_ptrs(cache) == set(inner.load_buffers)  # read straight into the slots that became the entries
    assert cache.used_bytes == cache.slot_bytes == 4 * NBYTES
    inner.blocks.clear()
    dst = poisoned(4, NBYTES)
    assert cache.wait(cache.load(keys, dst)).ok  # from DRAM alone
    assert torch.equal(dst, src)


def test_slot_being_read_into_is_never_handed_out(close_after: Closer) -> None:
    inner = SlowLoadStore()
    cache = close_after(CacheStore(inner, 2 * NBYTES))
    keys = make_keys(6, seed=46)
    src = make_blocks(6, NBYTES, seed=47)
    inner.blocks[keys[0]] = src[0].clone()
    inner.load_release.clear()
    task = cache.load(keys[:1], poisoned(1, NBYTES))  # key 0 is being read into a slot
    assert inner.load_started.wait(timeout=10)
    # The other slot is the only one left: dumps cycle through it and never take the slot being read into.
    for i in range(1, 6):
        assert cache.wait(cache.dump(keys[i : i + 1], src[i : i + 1])).ok
        assert cache.slot_bytes <= cache.capacity_bytes
    assert cache.cached_keys() == [keys[5]]
    inner.load_release.set()
    assert cache.wait(task).ok
    cache.flush()
    assert cache.cached_keys() == [keys[5], keys[0]]
    dst = poisoned(2, NBYTES)
    inner.blocks.clear()
    assert cache.wait(cache.load([keys[0], keys[5]], dst)).ok
    assert torch.equal(dst, src[[0, 5]])


def test_block_being_copied_out_is_not_evicted(monkeypatch: pytest.MonkeyPatch, close_after: Closer) -> None:
    cache = close_after(CacheStore(None, 2 * NBYTES))
    keys = make_keys(4, seed=48)
    src = make_blocks(4, NBYTES, seed=49)
    assert cache.wait(cache.dump(keys[:2], src[:2])).ok
    copying, release = threading.Event(), threading.Event()
    real_copy = cache_module._copy_row

    def slow_copy(dst: torch.Tensor, src_row: torch.Tensor) -> None:
        if threading.current_thread().name == "reader":
            copying.set()
            assert release.wait(timeout=10)
        real_copy(dst, src_row)

    monkeypatch.setattr(cache_module, "_copy_row", slow_copy)
    dst = poisoned(1, NBYTES)
    reader = threading.Thread(target=lambda: cache.wait(cache.load(keys[:1], dst)), name="reader")
    reader.start()
    assert copying.wait(timeout=10)
    # Key 0 is pinned by the copy: two new blocks evict key 1, and the later one takes the slot of the earlier.
    try:
        result = cache.wait(cache.dump(keys[2:], src[2:]))
        assert result.failed == {0}
        assert cache.cached_keys() == [keys[0], keys[3]]
    finally:
        release.set()
    reader.join(timeout=10)
    assert torch.equal(dst[0], src[0])


MIXED_SIZES = [NBYTES, 2 * NBYTES + 7, 3 * NBYTES - 1]


def test_mixed_block_sizes_share_the_capacity_in_slots(close_after: Closer) -> None:
    cache = close_after(CacheStore(None, 7 * NBYTES))
    rng = random.Random(50)
    keys = make_keys(60, seed=51)
    size_of = {key: MIXED_SIZES[i % 3] for i, key in enumerate(keys)}
    blocks = {key: make_blocks(1, size_of[key], seed=100 + i) for i, key in enumerate(keys)}
    for _ in range(300):
        key = rng.choice(keys)
        if rng.random() < 0.6:
            assert cache.wait(cache.dump([key], blocks[key])).ok  # every size fits once the rest is evicted
        else:
            dst = poisoned(1, size_of[key])
            if cache.wait(cache.load([key], dst)).ok:
                assert torch.equal(dst, blocks[key])
        assert cache.used_bytes <= cache.slot_bytes <= cache.capacity_bytes
        assert cache.used_bytes == sum(size_of[k] for k in cache.cached_keys())
    for key in cache.cached_keys():
        dst = poisoned(1, size_of[key])
        assert cache.wait(cache.load([key], dst)).ok and torch.equal(dst, blocks[key])


def test_other_size_gets_room_from_free_slots_then_lru(close_after: Closer) -> None:
    cache = close_after(CacheStore(None, 4 * NBYTES))
    keys = make_keys(6, seed=52)
    small = make_blocks(4, NBYTES, seed=53)
    assert cache.wait(cache.dump(keys[:4], small)).ok
    big = make_blocks(1, 2 * NBYTES, seed=54)
    assert cache.wait(cache.dump(keys[4:5], big)).ok  # evicts the two least recently used small blocks
    assert cache.cached_keys() == [keys[2], keys[3], keys[4]]
    assert cache.slot_bytes == cache.used_bytes == 4 * NBYTES
    # The same key again with another size replaces its block: its freed slot is dropped to make room.
    again = make_blocks(1, 3 * NBYTES, seed=55)
    assert cache.wait(cache.dump(keys[4:5], again)).ok
    assert cache.cached_keys() == [keys[3], keys[4]]
    assert cache.slot_bytes == cache.used_bytes == 4 * NBYTES
    dst = poisoned(1, 3 * NBYTES)
    assert cache.wait(cache.load(keys[4:5], dst)).ok and torch.equal(dst, again)
    dst = poisoned(1, NBYTES)
    assert cache.wait(cache.load(keys[3:4], dst)).ok and torch.equal(dst[0], small[3])


@pytest.mark.parametrize("sizes", [[NBYTES], MIXED_SIZES], ids=["one_size", "mixed_sizes"])
def test_concurrent_loads_and_dumps_over_posix_are_bit_exact(
    tmp_path: Path, sizes: list[int], close_after: Closer
) -> None:
    """Several threads dump and load through a cache far smaller than the blocks, so slots are evicted, reused and
    promoted into all the time; every loaded row must be the dumped bytes."""
    cache = close_after(CacheStore(PosixStore(str(tmp_path / "kv"), io_threads=3), 6 * NBYTES))
    keys = make_keys(40, seed=56)
    size_of = {key: sizes[i % len(sizes)] for i, key in enumerate(keys)}
    blocks = {key: make_blocks(1, size_of[key], seed=200 + i)[0] for i, key in enumerate(keys)}
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(60):
            nbytes = rng.choice(sizes)
            chosen = rng.sample([k for k in keys if size_of[k] == nbytes], 4)
            if rng.random() < 0.4:
                src = torch.stack([blocks[k] for k in chosen])
                if not cache.wait(cache.dump(chosen, src)).ok:
                    errors.append("dump failed")
            else:
                dst = poisoned(4, nbytes)
                result = cache.wait(cache.load(chosen, dst))
                for j, key in enumerate(chosen):
                    if j not in result.failed and not torch.equal(dst[j], blocks[key]):
                        errors.append(f"wrong bytes for key {keys.index(key)}")
            used, slots = cache.usage()  # one snapshot: other threads change them between two reads
            if not used <= slots <= cache.capacity_bytes:
                errors.append(f"over capacity: used {used}, slots {slots}, capacity {cache.capacity_bytes}")

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    cache.flush()
    assert errors == []
    stored = [k for k in keys if cache.lookup([k]) == 1]
    for key in stored:
        dst = poisoned(1, size_of[key])
        assert cache.wait(cache.load([key], dst)).ok and torch.equal(dst[0], blocks[key])


class PreparedStore(DictStore):
    """A stage below that records :meth:`prepare` calls."""

    def __init__(self) -> None:
        super().__init__()
        self.prepared: list[tuple[int, int]] = []

    def prepare(self, block_nbytes: int, request_blocks: int = 0) -> None:
        self.prepared.append((block_nbytes, request_blocks))


def free_ptrs(cache: CacheStore, nbytes: int) -> set[int]:
    return {slot.data_ptr() for slot in cache._free.get(nbytes, [])}


def test_prefault_fills_free_slots_that_blocks_then_use(close_after: Closer) -> None:
    inner = PreparedStore()
    cache = close_after(CacheStore(inner, 10 * NBYTES + 50, prefault_bytes=4 * NBYTES + 99))
    assert cache.slot_bytes == 0  # nothing allocated before prepare: the block size is not known yet
    cache.prepare(NBYTES)
    assert inner.prepared == [(NBYTES, 0)]  # passed down
    assert cache._prefault_thread is not None
    cache._prefault_thread.join(timeout=10)
    prefaulted = free_ptrs(cache, NBYTES)
    assert len(prefaulted) == 4 and cache.usage() == (0, 4 * NBYTES)
    assert all(not bool(slot.any()) for slot in cache._free[NBYTES])  # written (zeros): every page touched
    cache.prepare(NBYTES)  # once per store
    cache._prefault_thread.join(timeout=10)
    assert cache.slot_bytes == 4 * NBYTES
    # Dumps and read-through promotions take the prefaulted slots before allocating new ones.
    keys = make_keys(6, seed=90)
    src = make_blocks(6, NBYTES, seed=91)
    assert cache.wait(cache.dump(keys[:3], src[:3])).ok
    inner.blocks[keys[3]] = src[3].clone()
    dst = poisoned(1, NBYTES)
    assert cache.wait(cache.load(keys[3:4], dst)).ok and torch.equal(dst[0], src[3])
    cache.flush()
    assert slot_ptrs(cache) == prefaulted and cache.usage() == (4 * NBYTES, 4 * NBYTES)
    assert cache.wait(cache.dump(keys[4:], src[4:])).ok  # past the prefaulted slots: new ones
    assert cache.usage() == (6 * NBYTES, 6 * NBYTES)
    dst = poisoned(6, NBYTES)
    assert cache.wait(cache.load(keys, dst)).ok and torch.equal(dst, src)


def test_prefault_stays_within_capacity_and_stops_at_close(close_after: Closer) -> None:
    cache = close_after(CacheStore(None, 5 * NBYTES, prefault_bytes=5 * NBYTES))
    keys = make_keys(3, seed=92)
    assert cache.wait(cache.dump(keys, make_blocks(3, NBYTES, seed=93))).ok
    cache.prepare(NBYTES)
    cache._prefault_thread.join(timeout=10)
    assert cache.usage() == (3 * NBYTES, 5 * NBYTES)  # only room for 2 more: no block was evicted for them
    assert cache.cached_keys() == keys
    cache.close()
    # close stops a prefault in progress and joins its thread; prepare after close starts none
    big = 1 << 20
    cache = close_after(CacheStore(None, 1024 * big, prefault_bytes=1024 * big))
    cache.prepare(big)
    cache.close()
    assert cache._prefault_thread is not None and not cache._prefault_thread.is_alive()
    assert cache.slot_bytes < 1024 * big
    closed = close_after(CacheStore(None, 4 * NBYTES, prefault_bytes=4 * NBYTES))
    closed.close()
    closed.prepare(NBYTES)
    assert closed._prefault_thread is None and closed.slot_bytes == 0


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def test_prefault_keeps_one_request_of_written_slots_ready(close_after: Closer) -> None:
    """``request_blocks`` alone pages in that many slots (within the capacity), and the prefault thread replaces
    each one taken while the cache has room for new slots; ``prefault_bytes`` wins when larger."""
    inner = PreparedStore()
    cache = close_after(CacheStore(inner, 10 * NBYTES, prefault_bytes=0))
    cache.prepare(NBYTES, request_blocks=3)
    assert inner.prepared == [(NBYTES, 3)]
    wait_until(lambda: len(free_ptrs(cache, NBYTES)) == 3)
    assert cache.usage() == (0, 3 * NBYTES)
    # The first dump after start fills those slots, not fresh ones; then 3 written slots are ready again.
    prefaulted = free_ptrs(cache, NBYTES)
    keys = make_keys(8, seed=94)
    src = make_blocks(8, NBYTES, seed=95)
    assert cache.wait(cache.dump(keys[:3], src[:3])).ok
    assert slot_ptrs(cache) == prefaulted
    wait_until(lambda: len(free_ptrs(cache, NBYTES)) == 3)
    assert cache.usage() == (3 * NBYTES, 6 * NBYTES)
    assert all(not bool(slot.any()) for slot in cache._free[NBYTES])  # written: every page touched
    # Near the capacity, the reserve is refilled only with the room left; eviction reuses slots past it.
    assert cache.wait(cache.dump(keys[3:8], src[3:8])).ok
    # The prefault thread adds a slot's bytes before the slot reaches the free list: wait for both.
    wait_until(lambda: cache.slot_bytes == 10 * NBYTES and len(free_ptrs(cache, NBYTES)) == 2)
    assert cache.usage() == (8 * NBYTES, 10 * NBYTES)
    dst = poisoned(8, NBYTES)
    assert cache.wait(cache.load(keys, dst)).ok and torch.equal(dst, src)
    thread = cache._prefault_thread
    assert thread is not None and thread.is_alive()  # waiting for a slot to be taken
    cache.close()
    assert not thread.is_alive()  # close wakes it and joins it
    capped = close_after(CacheStore(None, 2 * NBYTES + 7))
    capped.prepare(NBYTES, request_blocks=5)
    wait_until(lambda: capped.slot_bytes == 2 * NBYTES)  # a request larger than the cache: as many as fit
    assert capped.usage() == (0, 2 * NBYTES)
    larger = close_after(CacheStore(None, 10 * NBYTES, prefault_bytes=4 * NBYTES))
    larger.prepare(NBYTES, request_blocks=2)
    wait_until(lambda: len(free_ptrs(larger, NBYTES)) == 4)
    assert larger.usage() == (0, 4 * NBYTES)
    none = close_after(CacheStore(None, 10 * NBYTES))
    none.prepare(NBYTES)  # neither: nothing to do
    assert none._prefault_thread is None
    with pytest.raises(ValueError, match="request_blocks must be >= 0, got -1"):
        none.prepare(NBYTES, request_blocks=-1)


def test_prefault_thread_does_not_keep_a_dropped_store_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    """A store dropped without close() is collected and its prefault thread ends (it holds the store weakly)."""
    monkeypatch.setattr(cache_module, "_REFILL_POLL_S", 0.01)
    cache = CacheStore(None, 10 * NBYTES)
    cache.prepare(NBYTES, request_blocks=2)
    deadline = time.monotonic() + 10
    while len(free_ptrs(cache, NBYTES)) < 2:  # no lambda: a closure would keep the store alive
        assert time.monotonic() < deadline
        time.sleep(0.005)
    thread = cache._prefault_thread
    assert thread is not None and thread.is_alive()
    del cache
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_prefault_arguments_are_checked(close_after: Closer) -> None:
    for bad in (-1, 3 * NBYTES + 1):
        with pytest.raises(ValueError, match=r"prefault_bytes must lie in \[0, capacity_bytes = 300\]"):
            CacheStore(None, 3 * NBYTES, prefault_bytes=bad)
    cache = close_after(CacheStore(None, 3 * NBYTES, prefault_bytes=3 * NBYTES))
    with pytest.raises(ValueError, match="block_nbytes must be >= 1, got 0"):
        cache.prepare(0)
    cache.prepare(4 * NBYTES)  # a block larger than the prefault: nothing to do
    assert cache._prefault_thread is None


def test_prepare_reaches_every_stage_of_a_pipeline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, close_after: Closer
) -> None:
    from ucm.config import UcmPipelineStoreConfig
    from ucm.store.pipeline import build_store

    seen: list[tuple[int, int]] = []
    monkeypatch.setattr(PosixStore, "prepare", lambda self, *args: seen.append(args), raising=False)
    for pipeline in ("Cache|Posix", "Cache|Compress|Posix"):
        store = close_after(
            build_store(UcmPipelineStoreConfig(store_pipeline=pipeline, storage_backends=str(tmp_path)))
        )
        store.prepare(3 * NBYTES, 2)
        store.close()
    assert seen == [(3 * NBYTES, 2), (3 * NBYTES, 2)]


class RowsCountingStore(DictStore):
    """A stage below that counts its load_rows calls (the default: one load per key)."""

    def __init__(self) -> None:
        super().__init__()
        self.load_rows_calls: list[int] = []

    def load_rows(self, keys: Sequence[bytes], rows: Sequence[torch.Tensor]) -> list[Task]:
        self.load_rows_calls.append(len(keys))
        return super().load_rows(keys, rows)


def test_misses_read_from_below_in_one_load_rows_call(close_after: Closer) -> None:
    """A load's misses that get slots are asked of the stage below in one load_rows call (a stage such as Mooncake
    answers it with one batch); each row's task stands alone: a block missing below fails only its row."""
    below = RowsCountingStore()
    keys, blocks = make_keys(4, seed=41), make_blocks(4, NBYTES, seed=41)
    for key, block in zip(keys[:3], blocks[:3], strict=True):
        below.blocks[key] = block.clone()
    store = close_after(CacheStore(below, 16 * NBYTES))
    dst = poisoned(4, NBYTES)
    result = store.load(keys, dst).result(10)
    assert result.failed == {3}
    assert torch.equal(dst[:3], blocks[:3])
    assert below.load_rows_calls == [4]
    assert store.lookup(keys[:3]) == 3  # promoted from their slots


def test_default_load_rows_checks_its_arguments_and_fails_per_row(tmp_path: Path, close_after: Closer) -> None:
    posix = close_after(PosixStore([str(tmp_path)]))
    keys, blocks = make_keys(3, seed=42), make_blocks(3, NBYTES, seed=42)
    assert posix.dump(keys[:2], blocks[:2]).result(10).ok
    rows = [poisoned(1, NBYTES) for _ in keys]
    tasks = posix.load_rows(keys, rows)
    assert [t.result(10).failed for t in tasks] == [frozenset(), frozenset(), frozenset({0})]
    assert torch.equal(rows[0][0], blocks[0]) and torch.equal(rows[1][0], blocks[1])
    with pytest.raises(ValueError, match="load_rows: 2 rows for 3 keys; give one row per key"):
        posix.load_rows(keys, rows[:2])
