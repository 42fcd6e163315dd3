"""The connector's worker in layerwise mode, without an engine: real Posix stores on temp dirs, real paged tensors.

Shows what the engine tests cannot see from outside: ``start_load_kv`` returns before the data is in,
``wait_for_layer_load`` writes a layer only once its shard has arrived (later layers are held back by holding the
store's reads, as a slow disk would), a damaged block is reported after its layers were scattered, and a layerwise
dump writes the same files as a blockwise one, also when vLLM skips ``save_kv_layer`` for a layer. Also the load
staging buffer both modes share: paged in at registration, grown by a larger load.
"""

from __future__ import annotations

import resource
import threading
from pathlib import Path

import pytest
import torch

from tests.integration.helpers import paged_caches
from ucm.integration.vllm.engine_info import KVSpec
from ucm.integration.vllm.metadata import BlockTransfer, UCMConnectorMetadata
from ucm.integration.vllm.worker import LOAD_BUFFER_MAX_BYTES, UCMWorker, load_buffer_blocks
from ucm.kernels.layouts import KVLayout
from ucm.store.posix import PosixStore
from ucm.store.posix import store as posix_module

LAYERS = ("l0", "l1", "l2", "l3")
BLOCK_SIZE, HEADS, DIM, NUM_BLOCKS = 32, 2, 16, 8
KEYS = [bytes([i]) * 16 for i in range(3)]
SOURCE_IDS, TARGET_IDS = [1, 4, 6], [7, 0, 3]


def _caches(seed: int | None) -> dict[str, torch.Tensor]:
    return paged_caches(SPEC, NUM_BLOCKS, seed)


SPEC = KVSpec(LAYERS, BLOCK_SIZE, HEADS, DIM, torch.bfloat16)


def _worker(
    store: PosixStore, caches: dict[str, torch.Tensor], layerwise: bool, load_buffer_blocks: int = 16
) -> UCMWorker:
    worker = UCMWorker(
        SPEC, store, lambda _c: KVLayout.CPU_ATTN, layerwise=layerwise, load_buffer_blocks=load_buffer_blocks
    )
    worker.register_kv_caches(caches)
    return worker


def _written(caches: dict[str, torch.Tensor], layer: str, ids: list[int], source: dict[str, torch.Tensor]) -> bool:
    return torch.equal(caches[layer][ids].view(torch.int16), source[layer][SOURCE_IDS].view(torch.int16))


@pytest.fixture
def filled(tmp_path: Path) -> tuple[PosixStore, dict[str, torch.Tensor]]:
    """A store holding the 3 source blocks, dumped blockwise."""
    store = PosixStore(str(tmp_path / "kv"))
    source = _caches(seed=1)
    writer = _worker(store, source, layerwise=False)
    writer.wait_for_save(UCMConnectorMetadata(dumps=[BlockTransfer("r0", KEYS, SOURCE_IDS)]))
    writer.shutdown()
    yield store, source
    store.close()


def test_each_layer_is_written_only_once_its_shard_has_arrived(filled, monkeypatch) -> None:
    store, source = filled
    monkeypatch.setattr(posix_module, "SHARDED_READ_BYTES", 1)  # one read per (layer, block)
    gate = threading.Event()
    real = store._load_shards

    def held(read, first, stop, shard_nbytes, progress):  # type: ignore[no-untyped-def]
        if first >= 1:
            gate.wait(30)
        return real(read, first, stop, shard_nbytes, progress)

    monkeypatch.setattr(store, "_load_shards", held)
    caches = _caches(seed=None)
    worker = _worker(store, caches, layerwise=True)
    meta = UCMConnectorMetadata(loads=[BlockTransfer("r1", KEYS, TARGET_IDS)])
    worker.start_load_kv(meta)  # returns with layers 1.. still being read
    worker.wait_for_layer_load("l0")
    assert _written(caches, "l0", TARGET_IDS, source)
    assert all(bool(caches[n][TARGET_IDS].isnan().all()) for n in LAYERS[1:])  # not arrived, not written
    gate.set()
    worker.wait_for_layer_load("l2")
    assert all(_written(caches, n, TARGET_IDS, source) for n in LAYERS[:3])
    worker.wait_for_save(meta)  # the step's end: layers vLLM did not ask for are written, blocks validated
    assert all(_written(caches, n, TARGET_IDS, source) for n in LAYERS)
    assert worker.get_block_ids_with_load_errors() == set()
    worker.shutdown()


def test_damaged_block_is_reported_after_its_layers_were_scattered(filled) -> None:
    store, _ = filled
    path = Path(store.block_path(KEYS[1]))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # last layer's last byte: only the whole-block checksum sees it
    path.write_bytes(bytes(data))
    caches = _caches(seed=None)
    worker = _worker(store, caches, layerwise=True)
    meta = UCMConnectorMetadata(loads=[BlockTransfer("r1", KEYS, TARGET_IDS)])
    worker.start_load_kv(meta)
    for n in LAYERS:
        worker.wait_for_layer_load(n)
    worker.wait_for_save(meta)
    assert worker.get_block_ids_with_load_errors() == {TARGET_IDS[1]}  # vLLM recomputes block 0 (key 1)
    assert worker.get_block_ids_with_load_errors() == set()  # reported once
    worker_meta = worker.take_worker_meta()
    assert worker_meta is not None and worker_meta.failed_keys == [KEYS[1]]  # the scheduler dumps it again
    worker.shutdown()


@pytest.mark.parametrize("skipped", [None, "l3"], ids=["every_layer", "save_kv_layer_skipped_for_l3"])
def test_layerwise_dump_writes_the_blockwise_files(filled, tmp_path, skipped) -> None:
    blockwise, source = filled
    store = PosixStore(str(tmp_path / "layerwise"))
    worker = _worker(store, source, layerwise=True)
    meta = UCMConnectorMetadata(dumps=[BlockTransfer("r0", KEYS, SOURCE_IDS)])
    for n in LAYERS:
        if n != skipped:
            worker.save_kv_layer(n, meta)
    worker.wait_for_save(meta)
    worker.shutdown()
    for key in KEYS:
        assert Path(store.block_path(key)).read_bytes() == Path(blockwise.block_path(key)).read_bytes()
    store.close()


def test_load_buffer_is_paged_in_at_registration(tmp_path) -> None:
    """Writing the whole load buffer after registration (what a storage hit's copies do) takes no page faults."""
    blocks = -(-(64 << 20) // SPEC.block_nbytes)  # 64 MiB: 16K pages of 4 KiB if they fault in
    store = PosixStore(str(tmp_path / "kv"))
    worker = _worker(store, _caches(seed=0), layerwise=False, load_buffer_blocks=blocks)
    buffer = worker._load_buffer
    assert buffer is not None and buffer.shape[0] == blocks
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    buffer.view(torch.uint8).numpy().fill(1)  # one thread: numpy, not torch's intra-op threads
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
    assert faults < 100, f"{faults} page faults writing the {buffer.nbytes >> 20} MiB load buffer"
    worker.shutdown()
    store.close()


@pytest.mark.parametrize("layerwise", [False, True], ids=["blockwise", "layerwise"])
@pytest.mark.parametrize("buffer_blocks", [1, 4], ids=["load_grows_buffer", "load_fits_buffer"])
def test_loads_use_or_grow_the_load_buffer(filled, layerwise, buffer_blocks) -> None:
    store, source = filled
    caches = _caches(seed=None)
    worker = _worker(store, caches, layerwise=layerwise, load_buffer_blocks=buffer_blocks)
    paged_in = worker._load_buffer
    assert paged_in is not None and paged_in.shape[0] == buffer_blocks
    meta = UCMConnectorMetadata(loads=[BlockTransfer("r1", KEYS, TARGET_IDS)])
    worker.start_load_kv(meta)
    for n in LAYERS:
        worker.wait_for_layer_load(n)
    worker.wait_for_save(meta)
    assert all(_written(caches, n, TARGET_IDS, source) for n in LAYERS)
    # Reused when the load fits; otherwise blockwise loads in rounds of its size, layerwise grows it.
    reused = buffer_blocks >= len(KEYS) or not layerwise
    assert (worker._load_buffer.data_ptr() == paged_in.data_ptr()) == reused
    assert worker._load_buffer.shape[0] == (buffer_blocks if reused else len(KEYS))
    worker.shutdown()


def test_load_buffer_blocks_one_request_capped_at_1_gib() -> None:
    assert load_buffer_blocks(4096, SPEC) == 4096 // BLOCK_SIZE
    assert load_buffer_blocks(4097, SPEC) == 4096 // BLOCK_SIZE + 1  # a partial block needs a whole one
    big = KVSpec(tuple(f"l{i}" for i in range(32)), 128, 8, 128, torch.bfloat16)  # Llama-8B: 16 MiB blocks
    assert load_buffer_blocks(131072, big) == LOAD_BUFFER_MAX_BYTES // big.block_nbytes == 64
    huge = KVSpec(LAYERS, 1 << 16, 64, 128, torch.float32)  # one block above the cap
    assert huge.block_nbytes > LOAD_BUFFER_MAX_BYTES and load_buffer_blocks(1 << 16, huge) == 1


def test_load_buffer_blocks_below_one_is_refused(tmp_path) -> None:
    store = PosixStore(str(tmp_path / "kv"))
    with pytest.raises(ValueError, match="load_buffer_blocks must be >= 1, got 0"):
        UCMWorker(SPEC, store, lambda _c: KVLayout.CPU_ATTN, load_buffer_blocks=0)
    store.close()
