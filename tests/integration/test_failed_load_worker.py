"""The worker drops the dumps computed in a step with a failed load, and in the step after it, and reports them.

Without an engine: a real Posix store in a temporary directory, one of whose block files is damaged, real paged
tensors. Also the tensor-parallel agreement (``any_rank_of``) over a real two-process gloo group. The engine-level
test (the wrong KV this prevents, and its redo) is ``tests/faults/test_failed_load_dumps.py``.
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch

from tests.integration.helpers import paged_caches
from ucm.integration.vllm.engine_info import KVSpec
from ucm.integration.vllm.metadata import BlockTransfer, UCMConnectorMetadata
from ucm.integration.vllm.worker import UCMWorker, any_rank_of
from ucm.kernels.layouts import KVLayout
from ucm.store.posix import HEADER_NBYTES, PosixStore, block_file_path

LAYERS = ("l0", "l1")
BLOCK_SIZE, HEADS, DIM, NUM_BLOCKS = 16, 2, 8, 12
SPEC = KVSpec(LAYERS, BLOCK_SIZE, HEADS, DIM, torch.bfloat16)
STORED = [bytes([i + 1]) * 16 for i in range(2)]  # in the store; the second one damaged
NEW = [bytes([i + 10]) * 16 for i in range(6)]  # dumped by the steps, two per step


def _worker(store: PosixStore, any_rank=None, layerwise: bool = False) -> UCMWorker:
    worker = UCMWorker(
        SPEC, store, lambda _c: KVLayout.CPU_ATTN, layerwise=layerwise, load_buffer_blocks=4, any_rank=any_rank
    )
    worker.register_kv_caches(paged_caches(SPEC, NUM_BLOCKS, seed=1))
    return worker


@pytest.fixture
def store(tmp_path: Path) -> PosixStore:
    """A Posix store holding ``STORED`` (written by a worker's dump), the second block file's payload damaged."""
    store = PosixStore(str(tmp_path))
    writer = _worker(store)
    writer.wait_for_save(UCMConnectorMetadata(dumps=[BlockTransfer("fill", STORED, [0, 1])]))
    writer.shutdown()
    store.flush()
    path = Path(block_file_path([str(tmp_path)], STORED[1]))
    data = bytearray(path.read_bytes())
    data[HEADER_NBYTES + 100] ^= 0x40
    path.write_bytes(bytes(data))
    return store


def _step(worker: UCMWorker, loads: list[BlockTransfer], dumps: list[BlockTransfer]) -> None:
    """One step as vLLM drives it (layerwise: each layer's load wait and dump gather around its attention)."""
    meta = UCMConnectorMetadata(loads=loads, dumps=dumps)
    worker.start_load_kv(meta)
    for layer in LAYERS:
        worker.wait_for_layer_load(layer)
        worker.save_kv_layer(layer, meta)
    worker.wait_for_save(meta)


@pytest.mark.parametrize("layerwise", [False, True], ids=["blockwise", "layerwise"])
def test_a_failed_load_drops_its_step_and_the_next_then_dumps_again(store: PosixStore, layerwise: bool) -> None:
    worker = _worker(store, layerwise=layerwise)
    _step(worker, [BlockTransfer("r", STORED, [2, 3])], [BlockTransfer("r", NEW[0:2], [4, 5])])
    assert worker.get_block_ids_with_load_errors() == {3}
    _step(worker, [], [BlockTransfer("x", NEW[2:4], [6, 7])])  # the step after: planned before vLLM knew
    _step(worker, [], [BlockTransfer("x", NEW[4:6], [8, 9])])
    worker.shutdown()
    store.flush()
    meta = worker.take_worker_meta()
    assert meta is not None
    assert meta.failed_keys == [STORED[1]]
    assert meta.dropped_keys == NEW[0:4]
    assert store.lookup(NEW[0:4]) == 0 and store.lookup(NEW[4:6]) == 2


def test_a_clean_load_drops_nothing(store: PosixStore) -> None:
    worker = _worker(store)
    _step(worker, [BlockTransfer("r", STORED[:1], [2])], [BlockTransfer("r", NEW[0:2], [4, 5])])
    worker.shutdown()
    store.flush()
    meta = worker.take_worker_meta()  # stored keys may be reported, if the writes were quick
    assert meta is None or (meta.failed_keys == [] and meta.dropped_keys == [])
    assert store.lookup(NEW[0:2]) == 2


def test_a_failure_on_another_rank_drops_this_ranks_dumps(store: PosixStore) -> None:
    asked: list[bool] = []

    def other_rank_failed(flag: bool) -> bool:
        asked.append(flag)
        return True

    worker = _worker(store, any_rank=other_rank_failed)
    _step(worker, [BlockTransfer("r", STORED[:1], [2])], [BlockTransfer("r", NEW[0:2], [4, 5])])
    _step(worker, [], [BlockTransfer("x", NEW[2:4], [6, 7])])  # no load: no collective
    worker.shutdown()
    store.flush()
    meta = worker.take_worker_meta()
    assert asked == [False]  # asked once, in the step with a load, with this rank's own (clean) outcome
    assert meta is not None and meta.dropped_keys == NEW[0:4] and meta.failed_keys == []
    assert store.lookup(NEW[0:4]) == 0


def _rank(rank: int, init: str, flags: list[bool], out: mp.Queue) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    any_rank = any_rank_of(dist.group.WORLD)
    out.put((rank, [any_rank(f) for f in flags]))
    dist.destroy_process_group()


def test_any_rank_of_a_real_gloo_group(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    init = f"file://{tmp_path / 'rendezvous'}"
    flags = {0: [False, True, False, False], 1: [False, False, True, False]}
    procs = [ctx.Process(target=_rank, args=(r, init, flags[r], out)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert results == {0: [False, True, True, False], 1: [False, True, True, False]}
