"""Cache reset (vLLM's ``reset_prefix_cache`` with ``reset_connector``) without an engine: the scheduler side on its
own and inside vLLM's ``Scheduler``, and the worker side with real paged tensors; real block files throughout.

What a reset must do: the scheduler forgets the keys the workers reported and, with ``reset_clears_storage``,
deletes this model's block files at once; the workers empty their DRAM tier at the start of the next step, before
that step's loads. A reset racing with loads and dumps may cost misses, never wrong KV. The same through a real
``vllm serve`` and its HTTP endpoint: ``tests/e2e/test_reset.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import ucm_extra_config
from tests.integration.helpers import (
    BLOCK_SIZE,
    NAMESPACE,
    SPEC,
    CoreLoop,
    LogRecords,
    keys_of,
    kv_blocks,
    make_request,
    new_step,
    payload,
    tokens,
)
from ucm.config import UcmConfig, config_from_extra_config
from ucm.integration.vllm.engine_info import KVSpec
from ucm.integration.vllm.metadata import BlockTransfer, UCMConnectorMetadata
from ucm.integration.vllm.scheduler import UCMScheduler
from ucm.integration.vllm.worker import UCMWorker
from ucm.kernels.layouts import KVLayout
from ucm.store.base import Removal, UcmKVStoreBase
from ucm.store.cache import CacheStore
from ucm.store.pipeline import build_store
from ucm.store.posix import PosixStore

BLOCK_IDS = [7, 3, 12, 5]
OTHER_NAMESPACE = bytes(range(16))


def _config(store_dir: Path, clears_storage: bool = False) -> UcmConfig:
    extra = ucm_extra_config(store_dir)
    if clears_storage:
        extra["reset_clears_storage"] = True
    return config_from_extra_config(extra)


def _block_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.ucmb") if not p.name.startswith("."))


def _fill_tagged(config: UcmConfig, keys: list[bytes], namespace: bytes = NAMESPACE) -> None:
    """Blocks written by another store instance (another process) under ``namespace``'s tag, as a worker does."""
    writer = build_store(config.store)
    try:
        writer.set_namespace(namespace, {"model": "scheduler-test"})
        assert writer.wait(writer.dump(keys, payload(len(keys)))).ok
    finally:
        writer.close()


@pytest.fixture
def log() -> Iterator[LogRecords]:
    """The scheduler and worker modules' log records (UCM's loggers do not propagate to pytest's)."""
    loggers = [logging.getLogger(f"ucm.integration.vllm.{m}") for m in ("scheduler", "worker")]
    handler = LogRecords()
    for logger in loggers:
        logger.addHandler(handler)
    yield handler
    for logger in loggers:
        logger.removeHandler(handler)


@pytest.fixture
def stores() -> Iterator[list[UcmKVStoreBase]]:
    built: list[UcmKVStoreBase] = []
    yield built
    for s in built:
        s.close()


def _scheduler(config: UcmConfig, stores: list[UcmKVStoreBase]) -> UCMScheduler:
    stores.append(build_store(config.store))
    return UCMScheduler(config, SPEC, NAMESPACE, stores[-1], load=True, dump=True)


# ------------------------------------------------------------------------------- UCMScheduler on its own
def test_reset_forgets_the_keys_the_workers_reported(tmp_path, stores, log):
    config = _config(tmp_path / "store")
    sched = _scheduler(config, stores)
    ids = tokens(3 * BLOCK_SIZE + 1)
    sched.add_stored_keys(keys_of(ids))  # in the workers' DRAM tier only: no file
    assert sched.get_num_new_matched_tokens(make_request("a", ids), 0) == (48, False)
    assert sched.reset() is True
    assert sched.get_num_new_matched_tokens(make_request("b", ids), 0) == (0, False)
    assert log.messages(logging.INFO)[-2] == (
        "cache reset: forgot 3 blocks the workers stored, dropped 0 from this process's DRAM tier; the workers "
        "empty theirs at the next step; storage kept (reset_clears_storage: false)"
    )
    request = make_request("c", ids)
    sched.get_num_new_matched_tokens(request, 0)
    sched.update_state_after_alloc(request, kv_blocks(BLOCK_IDS), 0)
    meta = sched.build_connector_meta(new_step(request, BLOCK_IDS, 0, len(ids)))
    assert (meta.reset_epoch, meta.clear_storage) == (1, False)  # the workers hear of it with the next step
    assert sched.build_connector_meta(new_step(make_request("d", ids), [], 0, 0)).reset_epoch == 1


def test_keys_stored_before_the_reset_are_not_recorded_after_it(tmp_path, stores):
    """A worker report that left before the reset reached the workers (asynchronous scheduling, pipelined steps)
    names blocks the workers drop: ignored."""
    sched = _scheduler(_config(tmp_path / "store"), stores)
    ids = tokens(2 * BLOCK_SIZE + 1)
    sched.reset()
    sched.add_stored_keys(keys_of(ids), reset_epoch=0)
    assert sched.get_num_new_matched_tokens(make_request("a", ids), 0) == (0, False)
    sched.add_stored_keys(keys_of(ids), reset_epoch=1)
    assert sched.get_num_new_matched_tokens(make_request("b", ids), 0) == (32, False)


def test_default_reset_keeps_storage(tmp_path, stores):
    config = _config(tmp_path / "store")
    ids = tokens(3 * BLOCK_SIZE + 1)
    _fill_tagged(config, keys_of(ids))
    sched = _scheduler(config, stores)
    assert sched.reset() is True
    assert len(_block_files(tmp_path / "store")) == 3
    assert sched.get_num_new_matched_tokens(make_request("a", ids), 0) == (48, False)  # served from storage


def test_reset_clears_this_models_storage(tmp_path, stores, log):
    config = _config(tmp_path / "store", clears_storage=True)
    ids, others = tokens(3 * BLOCK_SIZE + 1), tokens(2 * BLOCK_SIZE, start=5000)
    _fill_tagged(config, keys_of(ids))
    _fill_tagged(config, keys_of(others), namespace=OTHER_NAMESPACE)  # another model sharing the directory
    sched = _scheduler(config, stores)
    assert sched.get_num_new_matched_tokens(make_request("a", ids), 0) == (48, False)
    assert sched.reset() is True
    assert len(_block_files(tmp_path / "store")) == 2  # the other model's
    reset_line = log.messages(logging.INFO)[-1]
    assert "removed 3 block files (0.0 MiB) of this model from storage (reset_clears_storage: true)" in reset_line
    # A write-back that lands after the clear (a dump the workers had in flight) is not offered before the workers
    # were told: they delete it at the start of the next step.
    _fill_tagged(config, keys_of(ids)[:1])
    assert sched.get_num_new_matched_tokens(make_request("b", ids), 0) == (0, False)
    meta = sched.build_connector_meta(new_step(make_request("b", ids), [], 0, 0))
    assert (meta.reset_epoch, meta.clear_storage) == (1, True)
    assert sched.get_num_new_matched_tokens(make_request("c", ids), 0) == (16, False)  # live lookups again


def test_reset_that_cannot_delete_every_file_reports_failure(tmp_path, stores, log, monkeypatch):
    config = _config(tmp_path / "store", clears_storage=True)
    sched = _scheduler(config, stores)
    denied = Removal(blocks=2, nbytes=100, errors=["/kv/ab/cd.ucmb: Permission denied", "/kv/ef.ucmb: x"])
    monkeypatch.setattr(stores[-1], "remove_stored", lambda **_kw: denied)
    assert sched.reset() is False  # vLLM answers {"success": false}
    assert log.messages(logging.WARNING) == [
        "cache reset: 2 block files or directories could not be cleared, e.g. /kv/ab/cd.ucmb: Permission denied"
    ]


# ------------------------------------------------------------------------------ inside vLLM's own Scheduler
@pytest.mark.parametrize("clears_storage", [False, True], ids=["keeps-storage", "clears-storage"])
def test_vllm_reset_prefix_cache_resets_ucm(tiny_model: Path, tmp_path: Path, clears_storage: bool) -> None:
    """vLLM's ``Scheduler.reset_prefix_cache(reset_connector=True)`` (what ``POST
    /reset_prefix_cache?reset_external=true`` runs in the engine core) calls UCM's reset; the next step's metadata
    carries it to the workers."""
    extra: dict[str, Any] = ucm_extra_config(tmp_path / "store")
    extra["reset_clears_storage"] = clears_storage
    config = config_from_extra_config(extra)
    core = CoreLoop(tiny_model, config, extra)
    try:
        # The worker's files carry the engine's namespace, as UCMWorker's do.
        core.worker.store.set_namespace(core.namespace, {"model": "tiny"})
        ids = tokens(3 * BLOCK_SIZE + 5)
        core.add("a", ids, max_tokens=1)
        _, meta, _ = core.step()  # misses, dumps 3 blocks; the helper worker writes them back to files
        assert [len(t.keys) for t in meta.dumps] == [3] and meta.reset_epoch == 0
        core.worker.store.flush()
        assert len(_block_files(tmp_path / "store")) == 3
        assert core.scheduler.reset_prefix_cache(reset_connector=True) is True
        assert len(_block_files(tmp_path / "store")) == (0 if clears_storage else 3)
        core.add("b", ids, max_tokens=1)
        _, meta, _ = core.step()
        assert (meta.reset_epoch, meta.clear_storage) == (1, clears_storage)
        loaded = sum(len(t.keys) for t in meta.loads)
        assert loaded == (0 if clears_storage else 3)  # vLLM's prefix cache was reset too: only UCM can serve
    finally:
        core.close()


# --------------------------------------------------------------------------------------------- UCMWorker
LAYERS = ("l0", "l1")
WORKER_SPEC = KVSpec(LAYERS, 16, 2, 8, torch.bfloat16)
KEYS = [bytes([i + 1]) * 16 for i in range(3)]
SOURCE_IDS, TARGET_IDS = [1, 4, 6], [7, 0, 3]


def _caches(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(8, 2, 16, 16, generator=g).bfloat16() for n in LAYERS}  # CPU_ATTN [blocks, heads, bs, 2d]


def _worker(store: UcmKVStoreBase, caches: dict[str, torch.Tensor]) -> UCMWorker:
    worker = UCMWorker(WORKER_SPEC, store, lambda _c: KVLayout.CPU_ATTN, load_buffer_blocks=4)
    worker.register_kv_caches(caches)
    return worker


def test_worker_empties_its_dram_tier_before_the_steps_loads(tmp_path: Path, log) -> None:
    """The blocks a worker dumped are in its DRAM tier; their files vanish (another instance cleared the storage):
    without a reset the step's load is a DRAM hit, with one it misses (vLLM recomputes), never stale KV."""
    store = CacheStore(PosixStore(str(tmp_path / "kv")), capacity_bytes=1 << 24)
    caches = _caches(seed=1)
    worker = _worker(store, caches)
    try:
        worker.wait_for_save(UCMConnectorMetadata(dumps=[BlockTransfer("r0", KEYS, SOURCE_IDS)]))
        store.flush()
        for path in _block_files(tmp_path / "kv"):
            path.unlink()
        load = [BlockTransfer("r1", KEYS, TARGET_IDS)]
        worker.reset(UCMConnectorMetadata(loads=load))  # epoch 0: nothing to do
        worker.start_load_kv(UCMConnectorMetadata(loads=load))
        assert worker.get_block_ids_with_load_errors() == set()  # served by DRAM
        worker.reset(UCMConnectorMetadata(loads=load, reset_epoch=1))
        assert store.cached_keys() == []
        worker.start_load_kv(UCMConnectorMetadata(loads=load, reset_epoch=1))
        assert worker.get_block_ids_with_load_errors() == set(TARGET_IDS)
        assert log.messages(logging.INFO)[-1] == "cache reset: dropped 3 blocks from the DRAM tier"
        reported = worker.take_worker_meta()
        assert reported is not None and reported.reset_epoch == 1 and reported.failed_keys == KEYS
    finally:
        worker.shutdown()
        store.close()


def test_worker_deletes_what_its_last_dumps_wrote_when_storage_is_cleared(tmp_path: Path, log) -> None:
    store = CacheStore(PosixStore(str(tmp_path / "kv")), capacity_bytes=1 << 24)
    worker = _worker(store, _caches(seed=2))
    try:
        worker.wait_for_save(UCMConnectorMetadata(dumps=[BlockTransfer("r0", KEYS, SOURCE_IDS)]))
        worker.reset(UCMConnectorMetadata(reset_epoch=1, clear_storage=True))  # its write-back may land late
        assert _block_files(tmp_path / "kv") == [] and store.cached_keys() == []
        assert log.messages(logging.INFO)[-1] == (
            "cache reset: dropped 3 blocks from the DRAM tier; removed 3 block files written back since the storage "
            "was cleared"
        )
        worker.wait_for_save(UCMConnectorMetadata(dumps=[BlockTransfer("r1", KEYS, SOURCE_IDS)]))
        store.flush()
        assert len(_block_files(tmp_path / "kv")) == 3  # dumps after the reset are stored as usual
        reported = worker.take_worker_meta()
        assert reported is not None and reported.stored_keys == KEYS and reported.reset_epoch == 1
    finally:
        worker.shutdown()
        store.close()
