"""The worker's host buffers: the dumps' staging arena (``ucm.integration.vllm.staging``) and loads in rounds of the
load buffer's size.

Without an engine: a real ``Cache|Posix`` store in a temporary directory (write-backs finish in the background, so
dumps are still in flight when later ones take buffers), real paged tensors; every block dumped through reused
rows of the arena, or loaded in rounds, is compared bit for bit with the paged KV it was
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
from ucm.integration.vllm.staging import StagingArena
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


def arena_rows(arena: StagingArena, rows: torch.Tensor) -> range:
    """The arena rows a run from ``take`` covers."""
    first = (rows.data_ptr() - arena.buffer.data_ptr()) // BLOCK_NBYTES
    return range(first, first + rows.shape[0])


def test_runs_are_taken_first_fit_and_merge_when_given_back() -> None:
    arena = StagingArena(8, BLOCK_SHAPE, torch.bfloat16)
    a, b, c = arena.take(3), arena.take(2), arena.take(3)
    assert a is not None and b is not None and c is not None
    assert [arena_rows(arena, r) for r in (a, b, c)] == [range(0, 3), range(3, 5), range(5, 8)]
    assert a.shape == (3, *BLOCK_SHAPE) and arena.blocks_in_use == 8
    assert arena.take(1) is None and arena.largest_free == 0
    arena.give(b)
    assert arena.take(3) is None and arena.largest_free == 2  # 2 rows free: no run of 3
    arena.give(a)  # merges with b's rows: one run of 5
    assert arena.largest_free == 5
    d = arena.take(4)
    assert d is not None and arena_rows(arena, d) == range(0, 4)  # the lowest rows free
    arena.give(c)  # merges with row 4: rows 4-7
    assert arena.largest_free == 4 and arena.blocks_in_use == 4
    arena.give(d)
    assert arena.largest_free == 8 and arena.blocks_in_use == 0 and arena.taken_runs == 4


def test_a_run_is_given_back_once_and_only_to_its_arena() -> None:
    arena = StagingArena(4, BLOCK_SHAPE, torch.bfloat16)
    run = arena.take(2)
    assert run is not None
    with pytest.raises(ValueError, match="not a run taken here"):
        arena.give(torch.empty((2, *BLOCK_SHAPE), dtype=torch.bfloat16))  # not the arena's memory
    with pytest.raises(ValueError, match="not a run taken here"):
        arena.give(run[1:])  # part of a run
    assert not arena.owns(torch.empty(1)) and arena.owns(run)
    arena.give(run)
    with pytest.raises(ValueError, match="not a run taken here"):
        arena.give(run)  # twice
    assert arena.largest_free == 4


def test_page_in_writes_every_row_and_an_empty_arena_hands_out_nothing() -> None:
    arena = StagingArena(3, BLOCK_SHAPE, torch.bfloat16)
    arena.page_in()
    assert bool((arena.buffer.view(torch.uint8) == 0).all())
    empty = StagingArena(0, BLOCK_SHAPE, torch.bfloat16)
    assert empty.take(1) is None and empty.largest_free == 0


@pytest.mark.parametrize(
    ("args", "match"), [((-1, BLOCK_SHAPE, torch.bfloat16), "num_blocks"), ((2, (), torch.bfloat16), "block_shape")]
)
def test_bad_arguments(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StagingArena(*args)


def test_take_needs_a_block() -> None:
    with pytest.raises(ValueError, match="got 0"):
        StagingArena(2, BLOCK_SHAPE, torch.bfloat16).take(0)


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
    arena = writer._dump_arena  # 16 rows: the 30 blocks went through reused rows, all given back
    assert arena is not None and arena.num_blocks == 16 and arena.taken_runs == len(sizes)
    assert arena.blocks_in_use == 0

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
    flight keep their rows of the staging arena (6 blocks here); a step whose blocks find no free run long enough
    dumps the first ones that fit and hands the rest back to the scheduler (``dropped_keys``), with one warning; a
    step that finds the arena full gathers nothing. Once the store catches up, dumps are taken whole again, and every
    block dumped is stored bit-exact."""
    below = DictStore()
    below.release.clear()
    store = CacheStore(below, capacity_bytes=1 << 24)
    caches = paged_caches(SPEC, NUM_BLOCKS, seed=11)
    worker = UCMWorker(
        SPEC, store, lambda _c: KVLayout.CPU_ATTN, layerwise=layerwise, load_buffer_blocks=8, dump_buffer_blocks=6
    )
    worker.register_kv_caches(caches)
    assert "dump staging arena of 6 blocks" in caplog.text
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

    first = step(0, 3)  # rows 0-2, held by the stalled write-back
    assert below.dump_started.wait(timeout=10)
    assert worker.take_worker_meta().dropped_keys == []  # type: ignore[union-attr]
    second = step(1, 2)  # rows 3-4
    third = step(2, 3)  # one row left: the first block dumped, the other two deferred
    meta = worker.take_worker_meta()
    assert meta is not None and meta.dropped_keys == third[1:]
    fourth = step(3, 2)  # the arena is full: nothing gathered
    meta = worker.take_worker_meta()
    assert meta is not None and meta.dropped_keys == fourth
    assert len(worker._pending_dumps) == 3
    # one warning per 30 s: the first deferral's
    assert (
        "a step had 3 blocks to dump, the dumps' staging arena 1 of its 6 blocks free in one run (2 dumps in "
        "flight hold 5)" in caplog.text
    )
    assert [(o.op, o.tier, o.blocks, o.requests) for o in seen] == [
        ("dump_deferred", "all", 2, ("r2",)),
        ("dump_deferred", "all", 2, ("r3",)),
    ]
    below.release.set()
    store.flush()
    again = step(4, 3)  # the store caught up: taken whole
    store.flush()
    worker.shutdown()
    assert worker._dump_arena is not None and worker._dump_arena.blocks_in_use == 0
    stored = first + second + third[:1] + again
    assert set(below.blocks) == set(stored)
    paged = [caches[name] for name in LAYERS]
    for i, keys in ((0, first), (1, second), (2, third[:1]), (4, again)):
        want = gather_blocks(paged, torch.arange(4 * i, 4 * i + len(keys)), KVLayout.CPU_ATTN, impl="reference")
        for j, key in enumerate(keys):
            assert torch.equal(below.blocks[key], want[j].reshape(-1).view(torch.uint8)), (i, j)
    store.close()


def test_a_durable_dump_is_never_deferred(tmp_path: Path) -> None:
    """A worker without a staging arena defers every dump, except a durable one (a PD prefill), which gets a buffer
    of its own and is in the store when the step ends."""
    store = PosixStore(str(tmp_path / "kv"))
    caches = paged_caches(SPEC, NUM_BLOCKS, seed=13)
    worker = UCMWorker(SPEC, store, lambda _c: KVLayout.CPU_ATTN, load_buffer_blocks=4, dump_buffer_blocks=0)
    worker.register_kv_caches(caches)
    plain = [bytes([1, j]) * 8 for j in range(2)]
    worker.wait_for_save(UCMConnectorMetadata(dumps=[BlockTransfer("p", plain, [0, 1])]))
    meta = worker.take_worker_meta()
    assert meta is not None and meta.dropped_keys == plain
    durable = [bytes([2, j]) * 8 for j in range(3)]
    worker.wait_for_save(UCMConnectorMetadata(dumps=[BlockTransfer("d", durable, [5, 6, 7], durable=True)]))
    assert store.lookup(durable) == 3 and store.lookup(plain) == 0  # stored before wait_for_save returned
    meta = worker.take_worker_meta()
    assert meta is not None and meta.dropped_keys == [] and meta.stored_keys == durable
    out = torch.empty((3, BLOCK_NBYTES), dtype=torch.uint8)
    assert store.load(durable, out).result().ok
    want = gather_blocks([caches[n] for n in LAYERS], torch.tensor([5, 6, 7]), KVLayout.CPU_ATTN, impl="reference")
    assert torch.equal(out, want.reshape(3, -1).view(torch.uint8))
    worker.shutdown()
