"""The worker's host buffers: the dump buffers' pool (``ucm.integration.vllm.staging``) and loads in rounds of the
load buffer's size.

Without an engine: a real ``Cache|Posix`` store in a temporary directory (write-backs finish in the background, so
dumps are still in flight when later ones take buffers), real paged tensors; every block dumped through a reused
buffer, or loaded in rounds, is compared bit for bit with the paged KV it was
gathered from. Rounds past the load deadline: ``test_load_deadline_worker.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration.helpers import paged_caches
from tests.store.helpers import DictStore
from ucm.integration.vllm.engine_info import KVSpec
from ucm.integration.vllm.metadata import BlockTransfer, UCMConnectorMetadata
from ucm.integration.vllm.staging import StagingPool
from ucm.integration.vllm.worker import UCMWorker
from ucm.kernels import gather_blocks
from ucm.kernels.layouts import KVLayout
from ucm.store.cache import CacheStore
from ucm.store.observe import Observation, Recorder
from ucm.store.posix import HEADER_NBYTES, PosixStore, block_file_path

LAYERS = ("l0", "l1", "l2")
SPEC = KVSpec(LAYERS, 16, 2, 8, torch.bfloat16)
NUM_BLOCKS = 40
BLOCK_SHAPE = (3, 2, 16, 2, 8)
BLOCK_NBYTES = 3 * 2 * 16 * 2 * 8 * 2


@pytest.mark.parametrize(("n", "cap"), [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (100, 128)])
def test_capacity_is_the_next_power_of_two(n: int, cap: int) -> None:
    assert StagingPool.capacity(n) == cap
    assert StagingPool(BLOCK_SHAPE, torch.bfloat16, 0).take(n).shape == (cap, *BLOCK_SHAPE)


def test_a_buffer_given_back_serves_the_next_take_of_its_size() -> None:
    pool = StagingPool(BLOCK_SHAPE, torch.bfloat16, 1 << 20)
    a, b = pool.take(3), pool.take(3)
    assert a.data_ptr() != b.data_ptr()
    pool.give(a)
    assert pool.idle_bytes == 4 * BLOCK_NBYTES
    assert pool.take(5).data_ptr() != a.data_ptr()  # too small for 5 blocks: a new buffer
    assert pool.take(4).data_ptr() == a.data_ptr()
    assert pool.idle_bytes == 0
    assert (pool.taken, pool.reused) == (4, 1)


def test_take_picks_the_smallest_idle_buffer_large_enough() -> None:
    pool = StagingPool(BLOCK_SHAPE, torch.bfloat16, 1 << 20)
    big, small, tiny = pool.take(16), pool.take(4), pool.take(1)
    for buffer in (big, small, tiny):
        pool.give(buffer)
    assert pool.take(3).data_ptr() == small.data_ptr()
    assert pool.take(2).data_ptr() == big.data_ptr()  # the only one left with 2 blocks
    assert pool.take(1).data_ptr() == tiny.data_ptr()
    assert pool.idle_bytes == 0 and pool.reused == 3


def test_idle_bytes_are_bounded_the_oldest_freed_first() -> None:
    pool = StagingPool(BLOCK_SHAPE, torch.bfloat16, 6 * BLOCK_NBYTES)
    old, new, one, big = pool.take(4), pool.take(2), pool.take(1), pool.take(8)
    pool.give(old)
    pool.give(new)
    assert pool.idle_bytes == 6 * BLOCK_NBYTES
    pool.give(one)  # 7 blocks idle: the 4-block buffer, given back first, is freed
    assert pool.idle_bytes == 3 * BLOCK_NBYTES
    assert pool.take(2).data_ptr() == new.data_ptr()
    pool.give(big)  # larger than the bound: freed at once, with everything else
    assert pool.idle_bytes == 0


@pytest.mark.parametrize(
    ("args", "match"), [((BLOCK_SHAPE, torch.bfloat16, -1), "max_idle_bytes"), (((), torch.bfloat16, 0), "block_shape")]
)
def test_bad_arguments(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StagingPool(*args)


def test_take_needs_a_block() -> None:
    with pytest.raises(ValueError, match="got 0"):
        StagingPool(BLOCK_SHAPE, torch.bfloat16, 0).take(0)


@pytest.mark.parametrize("layerwise", [False, True], ids=["blockwise", "layerwise"])
def test_dumps_through_reused_buffers_store_the_right_kv(tmp_path: Path, layerwise: bool) -> None:
    store = CacheStore(PosixStore(str(tmp_path / "kv")), capacity_bytes=1 << 24)
    caches = paged_caches(SPEC, NUM_BLOCKS, seed=3)
    writer = UCMWorker(SPEC, store, lambda _c: KVLayout.CPU_ATTN, layerwise=layerwise, load_buffer_blocks=8)
    writer.register_kv_caches(caches)
    sizes = [1, 3, 2, 4, 1, 3, 4, 2, 1, 4, 3, 2]  # 30 blocks in steps of varying size; some in flight at once
    dumped: list[tuple[bytes, int]] = []
    block = 0
    for step, n in enumerate(sizes):
        keys = [bytes([step, i]) * 8 for i in range(n)]
        ids = list(range(block, block + n))
        block += n
        meta = UCMConnectorMetadata(dumps=[BlockTransfer(f"r{step}", keys, ids)])
        for layer in LAYERS:
            writer.save_kv_layer(layer, meta)
        writer.wait_for_save(meta)
        dumped.extend(zip(keys, ids, strict=True))
        if step % 2:
            store.flush()  # these dumps are done: the next step's reap gives their buffers back
    writer.shutdown()
    store.flush()
    pool = writer._dump_pool
    assert pool is not None and pool.taken == len(sizes) and 0 < pool.reused < len(sizes)

    reader_caches = paged_caches(SPEC, NUM_BLOCKS, seed=None)  # NaN: a block not loaded shows
    reader = UCMWorker(SPEC, PosixStore(str(tmp_path / "kv")), lambda _c: KVLayout.CPU_ATTN, load_buffer_blocks=8)
    reader.register_kv_caches(reader_caches)
    keys = [k for k, _ in dumped]
    ids = [i for _, i in dumped]
    reader.start_load_kv(UCMConnectorMetadata(loads=[BlockTransfer("load", keys, ids)]))
    assert reader.get_block_ids_with_load_errors() == set()
    for name in LAYERS:
        assert torch.equal(reader_caches[name][ids], caches[name][ids]), name
    reader.shutdown()


def test_a_load_larger_than_the_buffer_runs_in_rounds(tmp_path: Path) -> None:
    store = PosixStore(str(tmp_path / "kv"))
    caches = paged_caches(SPEC, NUM_BLOCKS, seed=5)
    writer = UCMWorker(SPEC, store, lambda _c: KVLayout.CPU_ATTN, load_buffer_blocks=8)
    writer.register_kv_caches(caches)
    keys = [bytes([i + 1]) * 16 for i in range(7)]
    source = [3, 9, 1, 20, 14, 7, 30]
    writer.wait_for_save(UCMConnectorMetadata(dumps=[BlockTransfer("w", keys, source)]))
    writer.shutdown()
    store.flush()
    path = Path(block_file_path([str(tmp_path / "kv")], keys[5]))  # a block of the third round is damaged
    data = bytearray(path.read_bytes())
    data[HEADER_NBYTES + 7] ^= 0x01
    path.write_bytes(bytes(data))

    reader_caches = paged_caches(SPEC, NUM_BLOCKS, seed=None)
    reader = UCMWorker(SPEC, store, lambda _c: KVLayout.CPU_ATTN, load_buffer_blocks=2)
    reader.register_kv_caches(reader_caches)
    target = [0, 1, 2, 4, 5, 6, 8]
    reader.start_load_kv(UCMConnectorMetadata(loads=[BlockTransfer("r", keys, target)]))  # rounds of 2, 2, 2, 1
    assert reader.get_block_ids_with_load_errors() == {target[5]}
    good = [i for i in range(7) if i != 5]
    for name in LAYERS:
        assert torch.equal(reader_caches[name][[target[i] for i in good]], caches[name][[source[i] for i in good]])
        assert bool(reader_caches[name][target[5]].isnan().all())
    assert reader._load_buffer is not None and reader._load_buffer.shape[0] == 2  # reused, not grown
    reader.shutdown()


def test_dram_hits_are_scattered_from_their_slots(tmp_path: Path) -> None:
    """A load mixing DRAM hits, storage hits and a damaged block: the DRAM hits are lent by the Cache stage and
    scattered from their slots (the load buffer holds only the blocks read from storage), the damaged block fails
    alone, every other block matches the KV it was gathered from, and no slot stays pinned afterwards."""
    store = CacheStore(PosixStore(str(tmp_path / "kv")), capacity_bytes=1 << 24)
    caches = paged_caches(SPEC, NUM_BLOCKS, seed=7)
    writer = UCMWorker(SPEC, store, lambda _c: KVLayout.CPU_ATTN, load_buffer_blocks=8)
    writer.register_kv_caches(caches)
    keys = [bytes([i + 1]) * 16 for i in range(6)]
    source = [4, 11, 2, 25, 17, 8]
    writer.wait_for_save(UCMConnectorMetadata(dumps=[BlockTransfer("w", keys, source)]))
    writer.shutdown()
    store.flush()
    store.drop_cached()  # every block in storage only; then keys 0, 2, 4 back into DRAM by a load
    scratch = torch.empty((3, BLOCK_NBYTES), dtype=torch.uint8)
    assert store.load([keys[0], keys[2], keys[4]], scratch).result().ok
    path = Path(block_file_path([str(tmp_path / "kv")], keys[3]))  # a storage-only block is damaged
    data = bytearray(path.read_bytes())
    data[HEADER_NBYTES + 5] ^= 0x01
    path.write_bytes(bytes(data))

    reader_caches = paged_caches(SPEC, NUM_BLOCKS, seed=None)  # NaN: a block not loaded shows
    reader = UCMWorker(SPEC, store, lambda _c: KVLayout.CPU_ATTN, load_buffer_blocks=8)
    reader.register_kv_caches(reader_caches)  # its load buffer starts zeroed
    target = [30, 1, 12, 5, 22, 9]
    reader.start_load_kv(UCMConnectorMetadata(loads=[BlockTransfer("r", keys, target)]))
    assert reader.get_block_ids_with_load_errors() == {target[3]}
    good = [0, 1, 2, 4, 5]
    for name in LAYERS:
        assert torch.equal(reader_caches[name][[target[i] for i in good]], caches[name][[source[i] for i in good]])
        assert bool(reader_caches[name][target[3]].isnan().all())
    buffer = reader._load_buffer
    assert buffer is not None
    # The storage reads (keys 1, 3, 5) took the buffer's first three rows; the three DRAM hits none.
    assert bool((buffer[3:].view(torch.uint8) == 0).all())
    assert torch.equal(buffer[0].view(torch.uint8).flatten(), store_block(store, keys[1]))
    assert all(entry.pins == 0 for entry in store._entries.values())
    reader.shutdown()
    store.close()


def store_block(store: CacheStore, key: bytes) -> torch.Tensor:
    """Key ``key``'s block as the store loads it (uint8 ``[BLOCK_NBYTES]``)."""
    out = torch.empty((1, BLOCK_NBYTES), dtype=torch.uint8)
    assert store.load([key], out).result().ok
    return out[0]


@pytest.mark.parametrize("layerwise", [False, True], ids=["blockwise", "layerwise"])
def test_dumps_in_flight_are_bounded_and_the_rest_deferred(layerwise: bool, caplog: pytest.LogCaptureFixture) -> None:
    """While the store holds its write-backs (a DictStore below the Cache stage, released by the test), dumps in
    flight keep their staging buffers; a step whose dump would go past ``max_inflight_dump_bytes`` gathers nothing
    and hands its keys back to the scheduler (``dropped_keys``), with one warning. Once the store catches up, the
    next step's dump is taken again, and every dump taken is stored bit-exact."""
    below = DictStore()
    below.release.clear()
    store = CacheStore(below, capacity_bytes=1 << 24)
    caches = paged_caches(SPEC, NUM_BLOCKS, seed=11)
    worker = UCMWorker(
        SPEC, store, lambda _c: KVLayout.CPU_ATTN, layerwise=layerwise, load_buffer_blocks=8,
        max_inflight_dump_bytes=6 * BLOCK_NBYTES,
    )  # fmt: skip
    worker.register_kv_caches(caches)
    assert "dumps in flight up to" in caplog.text
    seen: list[Observation] = []
    worker.recorder = Recorder()
    worker.recorder.add_sink(seen.append)

    def step(i: int, n: int) -> list[bytes]:
        keys = [bytes([i, j]) * 8 for j in range(n)]
        meta = UCMConnectorMetadata(dumps=[BlockTransfer(f"r{i}", keys, list(range(4 * i, 4 * i + n)))])
        for layer in LAYERS:
            worker.save_kv_layer(layer, meta)
        worker.wait_for_save(meta)
        return keys

    first = step(0, 3)  # a 4-block buffer, held by the stalled write-back
    assert below.dump_started.wait(timeout=10)
    assert worker.take_worker_meta().dropped_keys == []  # type: ignore[union-attr]
    second = step(1, 2)  # 4 + 2 blocks: within the bound
    third = step(2, 3)  # 4 + 2 + 4 > 6: deferred, nothing gathered
    meta = worker.take_worker_meta()
    assert meta is not None and meta.dropped_keys == third
    assert len(worker._pending_dumps) == 2
    assert "the store is behind: 2 dumps in flight" in caplog.text
    assert [(o.op, o.tier, o.blocks, o.requests) for o in seen] == [("dump_deferred", "all", 3, ("r2",))]
    below.release.set()
    store.flush()
    again = step(3, 3)  # the store caught up: taken
    store.flush()
    worker.shutdown()
    stored = first + second + again
    assert set(below.blocks) == set(stored) and not set(third) & set(below.blocks)
    paged = [caches[name] for name in LAYERS]
    for i, keys in ((0, first), (1, second), (3, again)):
        want = gather_blocks(paged, torch.arange(4 * i, 4 * i + len(keys)), KVLayout.CPU_ATTN, impl="reference")
        for j, key in enumerate(keys):
            assert torch.equal(below.blocks[key], want[j].reshape(-1).view(torch.uint8)), (i, j)
    store.close()
