"""The scheduler side of UCMConnector step by step, without an engine: no model, no worker process, no tensors.

Two levels, both with a real store (``Cache|Posix`` on a temporary directory: real block files) and real vLLM
objects (``vllm.v1.request.Request`` built from token ids, ``KVCacheBlocks`` of ``KVCacheBlock``, ``SchedulerOutput``
with ``NewRequestData`` / ``CachedRequestData``):

- :class:`~ucm.integration.vllm.scheduler.UCMScheduler` on its own, each step's input written out by hand as vLLM
  builds it (``vllm/v1/core/sched/scheduler.py``: ``get_num_new_matched_tokens`` with the block-aligned local hit,
  ``update_state_after_alloc`` with all the request's blocks, then ``build_connector_meta`` once per step);
- ``UCMConnector`` inside vLLM's own ``Scheduler`` (what the engine core runs), the way vLLM's connector unit tests
  drive it: ``schedule()``, a model runner output with one sampled token per request that finished its prefill, and
  ``update_from_output()``. Block ids, chunking, prefix-cache hits and preemption are vLLM's own decisions here.
  The worker side is replaced by ``helpers.Worker``, which does what the scheduler sees of ``UCMWorker``: loads and
  dumps the planned keys in its own store instance (another process's, in an engine) and reports the keys it stored
  and the blocks and keys that failed to load (``UCMWorker`` itself, with tensors, is tested in
  ``test_layerwise_worker.py`` and through the engine).

Tensor parallelism, LoRA adapters and multimodal inputs are covered on the first level only: inside vLLM's
``Scheduler`` they would need several ranks, a LoRA config or a multimodal model. What only the engine shows (the KV
that a load puts into vLLM's paged cache, outputs equal to a recompute, vLLM's process layout) stays in
``test_connector.py``, ``test_layerwise.py`` and ``tests/pd/``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.engine import EngineCoreOutput

from tests.helpers import ucm_extra_config
from tests.integration.helpers import (
    BLOCK_SIZE,
    NAMESPACE,
    SPEC,
    CoreLoop,
    LogRecords,
    block_ids_of,
    cached_step,
    fill_store,
    keys_of,
    kv_blocks,
    make_request,
    new_step,
    tokens,
    transfers,
)
from ucm.config import UcmConfig, config_from_extra_config
from ucm.hashing import rank_keys
from ucm.integration.vllm.metadata import UCMConnectorMetadata
from ucm.integration.vllm.scheduler import DO_REMOTE_DECODE, PREFILL_BLOCKS, UCMScheduler
from ucm.store.base import UcmKVStoreBase
from ucm.store.pipeline import build_store
from ucm.testing.engine import HIT_RE

# vLLM block ids as its allocator hands them out after some traffic: not in order, not contiguous.
BLOCK_IDS = [7, 3, 12, 5, 9, 14, 2]


@pytest.fixture
def config(tmp_path: Path) -> UcmConfig:
    return config_from_extra_config(ucm_extra_config(tmp_path / "store"))


@pytest.fixture
def store(config: UcmConfig) -> Iterator[UcmKVStoreBase]:
    """The scheduler's own store instance (lookups only)."""
    s = build_store(config.store)
    yield s
    s.close()


def scheduler(
    config: UcmConfig, store: UcmKVStoreBase, *, load: bool = True, dump: bool = True, tp_size: int = 1
) -> UCMScheduler:
    return UCMScheduler(config, SPEC, NAMESPACE, store, load=load, dump=dump, tp_size=tp_size)


@pytest.fixture
def log() -> Iterator[LogRecords]:
    """The scheduler module's log records, debug included."""
    logger = logging.getLogger("ucm.integration.vllm.scheduler")
    handler, level = LogRecords(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


# ------------------------------------------------------------------------------- UCMScheduler on its own
@pytest.mark.parametrize(
    ("stored_blocks", "want_blocks"),
    [([0, 1, 2, 3], 4), ([0, 1, 2], 3), ([0, 1, 3], 2), ([1, 2, 3], 0), ([], 0)],
    ids=["all", "first-3", "gap-after-2", "no-first", "none"],
)
def test_lookup_counts_leading_stored_full_blocks(config, store, log, stored_blocks, want_blocks):
    """A prompt of 4 full blocks and 9 more tokens: the store's blocks count up to the first missing one (a block's
    key names its whole prefix), and the trailing partial block never counts (it has no key)."""
    ids = tokens(4 * BLOCK_SIZE + 9)
    keys = keys_of(ids)
    assert len(keys) == 4
    fill_store(config, [keys[i] for i in stored_blocks])
    sched = scheduler(config, store)
    num_external, load_async = sched.get_num_new_matched_tokens(make_request("r", ids), 0)
    assert (num_external, load_async) == (want_blocks * BLOCK_SIZE, False)  # loads are synchronous
    assert log.messages(logging.INFO) == [
        f"request_id: r, total_blocks_num: 4, hit hbm: 0, hit external: {want_blocks}"
    ]


def test_shared_prefix_of_a_longer_prompt_hits(config, store):
    """A prompt that extends a stored one hits the stored prompt's full blocks (not only whole-prompt repeats)."""
    first = tokens(3 * BLOCK_SIZE + 5)
    fill_store(config, keys_of(first))
    longer = first + tokens(40, start=5000)
    assert keys_of(longer)[:3] == keys_of(first)
    sched = scheduler(config, store)
    assert sched.get_num_new_matched_tokens(make_request("r", longer), 0) == (3 * BLOCK_SIZE, False)


@pytest.mark.parametrize(
    ("hbm_blocks", "want_external", "want_loaded"),
    [(0, 4 * BLOCK_SIZE - 1, 4), (2, 2 * BLOCK_SIZE - 1, 2)],
    ids=["store-only", "hbm-2"],
)
def test_full_prompt_hit_leaves_one_token_to_compute(config, store, hbm_blocks, want_external, want_loaded):
    """Every block of a 4-block prompt stored: the store supplies all but the prompt's last token (vLLM needs one
    token to compute logits), beyond what vLLM's own prefix cache holds; the last block is still loaded whole."""
    ids = tokens(4 * BLOCK_SIZE)
    keys = keys_of(ids)
    fill_store(config, keys)
    sched = scheduler(config, store)
    request = make_request("r", ids)
    hbm = hbm_blocks * BLOCK_SIZE
    num_external, _ = sched.get_num_new_matched_tokens(request, hbm)
    assert num_external == want_external
    block_ids = BLOCK_IDS[:4]
    sched.update_state_after_alloc(request, kv_blocks(block_ids), num_external)
    meta = sched.build_connector_meta(new_step(request, block_ids, hbm + num_external, 64 - hbm - num_external))
    assert transfers(meta.loads) == [("r", keys[hbm_blocks:], block_ids[hbm_blocks:], False)]
    assert len(meta.loads[0].keys) == want_loaded
    assert meta.dumps == []  # nothing the store lacks


def test_partial_last_block_is_computed_not_shortened(config, store):
    """All 4 full blocks stored, 9 tokens after them: the 4 blocks load in full (no token is held back: the partial
    block is computed anyway)."""
    ids = tokens(4 * BLOCK_SIZE + 9)
    fill_store(config, keys_of(ids))
    assert scheduler(config, store).get_num_new_matched_tokens(make_request("r", ids), 0) == (64, False)


def test_request_log_line_once_and_keys_at_debug(config, store, log):
    """One info line per request, in the format the engine tests and benchmarks parse (``ucm.testing.engine``),
    however often vLLM asks; at debug level the request's keys (rank 0's, hex) follow."""
    ids = tokens(5 * BLOCK_SIZE + 3)
    keys = keys_of(ids)
    fill_store(config, keys[:3])
    sched = scheduler(config, store)
    request = make_request("req-7", ids)
    assert sched.get_num_new_matched_tokens(request, BLOCK_SIZE) == (2 * BLOCK_SIZE, False)
    sched.get_num_new_matched_tokens(request, 0)  # not scheduled last step: asked again
    (line,) = log.messages(logging.INFO)
    assert HIT_RE.findall(line) == [("req-7", "5", "1", "2")]
    assert log.messages(logging.DEBUG) == ["request_id: req-7, block keys: " + " ".join(k.hex() for k in keys)]


def test_asked_again_looks_up_again(config, store):
    """A request that was not scheduled (no room) is asked about again: blocks stored meanwhile count."""
    ids = tokens(3 * BLOCK_SIZE)
    sched = scheduler(config, store)
    request = make_request("r", ids)
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    fill_store(config, keys_of(ids)[:2])
    assert sched.get_num_new_matched_tokens(request, 0) == (2 * BLOCK_SIZE, False)


def test_step_metadata_pairs_keys_with_vllm_block_ids(config, store):
    """One request, blocks 0-1 of 4 stored, 5 vLLM blocks (the last one partial): the first step loads keys 0-1 into
    the request's first two vLLM blocks and dumps keys 2-3 from the next two, which the step fills; decode steps
    move nothing (generated tokens are not stored), even when one fills a block."""
    ids = tokens(4 * BLOCK_SIZE + 10)
    keys = keys_of(ids)
    fill_store(config, keys[:2])
    sched = scheduler(config, store)
    request = make_request("r", ids)
    num_external, _ = sched.get_num_new_matched_tokens(request, 0)
    assert num_external == 32
    block_ids = BLOCK_IDS[:5]
    sched.update_state_after_alloc(request, kv_blocks(block_ids), num_external)
    meta = sched.build_connector_meta(new_step(request, block_ids, 32, len(ids) - 32))
    assert isinstance(meta, UCMConnectorMetadata)
    assert transfers(meta.loads) == [("r", keys[:2], [7, 3], False)]
    assert transfers(meta.dumps) == [("r", keys[2:4], [12, 5], False)]
    # Decode: token 75 is computed, then 76..79 fill block 4 (a block of generated tokens: never dumped).
    for computed in range(len(ids), 5 * BLOCK_SIZE):
        meta = sched.build_connector_meta(cached_step("r", computed, 1))
        assert (meta.loads, meta.dumps) == ([], [])
    meta = sched.build_connector_meta(cached_step("r", 5 * BLOCK_SIZE, 1, new_block_ids=[BLOCK_IDS[5]]))
    assert (meta.loads, meta.dumps) == ([], [])
    assert sched.request_finished("r") is None


def test_chunked_prefill_dumps_blocks_as_they_fill(config, store):
    """A 100-token prompt computed in chunks of 40 tokens: each step dumps the prompt blocks that became full, with
    the block ids vLLM added that step (a running request's ``new_block_ids``)."""
    ids = tokens(100)
    keys = keys_of(ids)  # 6 full blocks
    sched = scheduler(config, store)
    request = make_request("r", ids)
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    sched.update_state_after_alloc(request, kv_blocks(BLOCK_IDS[:3]), 0)
    steps = [
        new_step(request, BLOCK_IDS[:3], 0, 40),  # tokens 0-39: blocks 0, 1 full
        cached_step("r", 40, 40, new_block_ids=BLOCK_IDS[3:5]),  # 40-79: blocks 2, 3, 4 full
        cached_step("r", 80, 20, new_block_ids=BLOCK_IDS[5:7]),  # 80-99: block 5 full, block 6 partial
    ]
    dumps = [transfers(sched.build_connector_meta(s).dumps) for s in steps]
    assert dumps == [
        [("r", keys[0:2], BLOCK_IDS[0:2], False)],
        [("r", keys[2:5], BLOCK_IDS[2:5], False)],
        [("r", keys[5:6], BLOCK_IDS[5:6], False)],
    ]


def test_vllm_prefix_hit_without_store_blocks_is_dumped(config, store):
    """Blocks vLLM's prefix cache holds but the store lacks (stored by no one, or removed since) are dumped from
    vLLM's blocks in the first step, so that the store heals; nothing is loaded."""
    ids = tokens(3 * BLOCK_SIZE + 4)
    keys = keys_of(ids)
    sched = scheduler(config, store)
    request = make_request("r", ids)
    assert sched.get_num_new_matched_tokens(request, 2 * BLOCK_SIZE) == (0, False)
    sched.update_state_after_alloc(request, kv_blocks(BLOCK_IDS[:4]), 0)
    meta = sched.build_connector_meta(new_step(request, BLOCK_IDS[:4], 32, len(ids) - 32))
    assert meta.loads == []
    assert transfers(meta.dumps) == [("r", keys[:3], BLOCK_IDS[:3], False)]


@pytest.mark.parametrize("resumed_as", ["cached", "new"])
def test_preempted_request_resumes_with_its_new_blocks(config, store, resumed_as):
    """Preempted after its first chunk (blocks 0-1 dumped), a request is asked about again when vLLM reschedules it
    (its blocks freed and evicted: no prefix hit). The store now holds blocks 0-1: they are loaded into the new vLLM
    blocks; only blocks 2-3 are dumped, once computed. vLLM's V1 model runner sends a resumed request among the
    cached ones with all its block ids (``resumed_req_ids``); the V2 runner sends it as a new request."""
    ids = tokens(4 * BLOCK_SIZE + 1)
    keys = keys_of(ids)
    sched = scheduler(config, store)
    request = make_request("r", ids)
    sched.get_num_new_matched_tokens(request, 0)
    sched.update_state_after_alloc(request, kv_blocks(BLOCK_IDS[:2]), 0)
    meta = sched.build_connector_meta(new_step(request, BLOCK_IDS[:2], 0, 32))
    assert transfers(meta.dumps) == [("r", keys[:2], BLOCK_IDS[:2], False)]
    fill_store(config, keys[:2])  # what the workers did with that dump

    # Preempted; rescheduled with 5 fresh blocks.
    assert sched.get_num_new_matched_tokens(request, 0) == (2 * BLOCK_SIZE, False)
    fresh = [20, 21, 22, 23, 24]
    sched.update_state_after_alloc(request, kv_blocks(fresh), 2 * BLOCK_SIZE)
    if resumed_as == "cached":
        step = cached_step("r", 32, len(ids) - 32, new_block_ids=fresh, resumed=True)
    else:
        step = new_step(request, fresh, 32, len(ids) - 32)
    meta = sched.build_connector_meta(step)
    assert transfers(meta.loads) == [("r", keys[:2], [20, 21], False)]
    assert transfers(meta.dumps) == [("r", keys[2:4], [22, 23], False)]


def test_failed_loads_are_forgotten_and_dumped_again_once_recomputed(config, store):
    """The workers report keys that failed to load (a damaged or vanished file): vLLM recomputes from the first
    failed block (``kv_load_failure_policy: recompute``), and the scheduler dumps the recomputed blocks again and no
    longer counts those keys among the workers' stored ones."""
    ids = tokens(4 * BLOCK_SIZE + 2)
    keys = keys_of(ids)
    fill_store(config, keys)
    sched = scheduler(config, store)
    request = make_request("r", ids)
    assert sched.get_num_new_matched_tokens(request, 0) == (64, False)
    sched.update_state_after_alloc(request, kv_blocks(BLOCK_IDS[:5]), 64)
    meta = sched.build_connector_meta(new_step(request, BLOCK_IDS[:5], 64, 2))
    assert transfers(meta.loads) == [("r", keys, BLOCK_IDS[:4], False)]
    assert meta.dumps == []

    sched.forget_failed_keys([keys[1], keys[3]])  # from UCMWorkerMetadata.failed_keys
    # vLLM rewinds the request to its first failed block (block 1) and recomputes from there.
    meta = sched.build_connector_meta(cached_step("r", BLOCK_SIZE, len(ids) - BLOCK_SIZE))
    assert meta.loads == []
    assert transfers(meta.dumps) == [("r", keys[1:4], BLOCK_IDS[1:4], False)]


def test_dropped_dumps_are_planned_again(config, store):
    """The workers dropped a step's dumps (computed in a step with a failed load): the scheduler plans them again at
    the request's next step; a request without a dropped key keeps its plan; a dropped key of a finished request is
    ignored."""
    ids = tokens(4 * BLOCK_SIZE + 2)
    keys = keys_of(ids)
    sched = scheduler(config, store)
    request = make_request("r", ids)
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    sched.update_state_after_alloc(request, kv_blocks(BLOCK_IDS[:5]), 0)
    meta = sched.build_connector_meta(new_step(request, BLOCK_IDS[:5], 0, 3 * BLOCK_SIZE))
    assert transfers(meta.dumps) == [("r", keys[:3], BLOCK_IDS[:3], False)]

    sched.redo_dumps([keys[1], keys[2], b"\x00" * 16])  # from UCMWorkerMetadata.dropped_keys
    meta = sched.build_connector_meta(cached_step("r", 3 * BLOCK_SIZE, BLOCK_SIZE + 2))
    assert transfers(meta.dumps) == [("r", keys[1:4], BLOCK_IDS[1:4], False)]
    sched.redo_dumps([])
    meta = sched.build_connector_meta(cached_step("r", len(ids), 1))
    assert meta.dumps == []


def test_keys_the_workers_stored_count_until_they_fail(config, store):
    """The workers' DRAM tier is in another process: the keys they report stored count as hits with an empty store
    directory, until a load of one of them fails."""
    ids = tokens(3 * BLOCK_SIZE)
    keys = keys_of(ids)
    sched = scheduler(config, store)
    sched.add_stored_keys(keys)  # from UCMWorkerMetadata.stored_keys
    assert not any(Path(config.store.storage_dirs[0]).rglob("*.ucmb"))
    assert sched.get_num_new_matched_tokens(make_request("a", ids), 0) == (47, False)
    sched.forget_failed_keys(keys[2:])
    assert sched.get_num_new_matched_tokens(make_request("b", ids), 0) == (32, False)


def test_workers_stored_keys_are_bounded_oldest_first(tmp_path):
    """The record of the workers' stored keys keeps the most recent ones (older ones have been written back to
    storage by then): at least 4096 keys, or twice the DRAM tier's blocks."""
    extra = ucm_extra_config(tmp_path / "store")
    extra["ucm_connectors"][0]["ucm_connector_config"]["cache_buffer_capacity_gb"] = 0.001  # 524 blocks
    config = config_from_extra_config(extra)
    store = build_store(config.store)
    try:
        sched = scheduler(config, store)
        capacity = max(4096, 2 * config.store.cache_buffer_capacity_bytes // SPEC.block_nbytes)
        ids = tokens(BLOCK_SIZE)
        first = keys_of(ids)[0]
        sched.add_stored_keys([first])
        sched.add_stored_keys([i.to_bytes(16, "little") for i in range(capacity - 1)])
        assert sched.get_num_new_matched_tokens(make_request("a", ids), 0) == (15, False)
        sched.add_stored_keys([first])  # stored again: most recent again
        sched.add_stored_keys([(i + capacity).to_bytes(16, "little") for i in range(capacity - 1)])
        assert sched.get_num_new_matched_tokens(make_request("b", ids), 0) == (15, False)
        sched.add_stored_keys([b"\xff" * 16])
        assert sched.get_num_new_matched_tokens(make_request("c", ids), 0) == (0, False)
    finally:
        store.close()


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tensor_parallel_looks_up_rank_0_keys(config, store, log, tp_size):
    """With tensor parallelism each rank stores its shard under ``rank_keys(keys, rank, tp_size)``; the scheduler
    looks up rank 0's (the ranks dump the same blocks in the same step). Metadata carries the rank-independent keys
    (each worker derives its own), and the workers' reports, rank-independent too, are recorded as rank 0's."""
    ids = tokens(3 * BLOCK_SIZE + 1)
    keys = keys_of(ids)
    sched = scheduler(config, store, tp_size=tp_size)
    fill_store(config, keys)  # rank-less keys: what a tp_size 1 instance stores
    fill_store(config, rank_keys(keys, 1, tp_size))
    assert sched.get_num_new_matched_tokens(make_request("a", ids), 0) == (0, False)
    fill_store(config, rank_keys(keys, 0, tp_size)[:2])
    request = make_request("b", ids)
    assert sched.get_num_new_matched_tokens(request, 0) == (32, False)
    assert log.messages(logging.DEBUG)[-1] == "request_id: b, block keys: " + " ".join(
        k.hex() for k in rank_keys(keys, 0, tp_size)
    )
    sched.update_state_after_alloc(request, kv_blocks(BLOCK_IDS[:4]), 32)
    meta = sched.build_connector_meta(new_step(request, BLOCK_IDS[:4], 32, len(ids) - 32))
    assert transfers(meta.loads) == [("b", keys[:2], BLOCK_IDS[:2], False)]
    assert transfers(meta.dumps) == [("b", keys[2:3], BLOCK_IDS[2:3], False)]
    sched.add_stored_keys(keys[2:])
    assert sched.get_num_new_matched_tokens(make_request("c", ids), 0) == (48, False)


@pytest.mark.parametrize(
    ("other", "shared_blocks"),
    [
        ({"salt": "tenant-b"}, 0),
        ({"lora": "adapter-a"}, 0),
        ({"mm": [("image-1", 20, 8)]}, 1),  # placeholder in block 1: block 0's key unchanged
        ({"mm": [("image-1", 40, 30)]}, 2),  # blocks 2-4
    ],
    ids=["cache_salt", "lora", "image-in-block-1", "image-in-blocks-2-4"],
)
def test_cache_salt_lora_and_multimodal_inputs_change_keys(config, store, other, shared_blocks):
    """The same token ids under another ``cache_salt`` or LoRA adapter are other keys (no hit on each other's
    blocks); a multimodal input changes the key of every block it overlaps and, through the chain, every later one."""
    ids = tokens(5 * BLOCK_SIZE)
    plain = keys_of(ids)
    fill_store(config, plain)
    mm = [
        MultiModalFeatureSpec(None, "image", ident, PlaceholderRange(offset=offset, length=length))
        for ident, offset, length in other.get("mm", [])
    ]
    request = make_request("r", ids, salt=other.get("salt"), lora=other.get("lora"), mm=mm or None)
    sched = scheduler(config, store)
    num_external, _ = sched.get_num_new_matched_tokens(request, 0)
    assert num_external == shared_blocks * BLOCK_SIZE
    sched.update_state_after_alloc(request, kv_blocks(BLOCK_IDS[:5]), num_external)
    meta = sched.build_connector_meta(new_step(request, BLOCK_IDS[:5], num_external, len(ids) - num_external))
    (dump,) = meta.dumps
    assert dump.keys[0] != plain[shared_blocks] and len(dump.keys) == 5 - shared_blocks
    if "salt" in other or "lora" in other:
        assert dump.keys == keys_of(ids, other.get("salt"), other.get("lora"))


def test_multimodal_identifier_is_part_of_the_key(config, store):
    """Two images at the same place with other identifiers (other content): other keys from their first block."""
    ids = tokens(3 * BLOCK_SIZE)
    sched = scheduler(config, store)
    dumped = []
    for req_id, ident in (("a", "image-1"), ("b", "image-2")):
        mm = [MultiModalFeatureSpec(None, "image", ident, PlaceholderRange(offset=20, length=8))]
        request = make_request(req_id, ids, mm=mm)
        sched.get_num_new_matched_tokens(request, 0)
        sched.update_state_after_alloc(request, kv_blocks(BLOCK_IDS[:3]), 0)
        (dump,) = sched.build_connector_meta(new_step(request, BLOCK_IDS[:3], 0, len(ids))).dumps
        dumped.append(dump.keys)
    assert dumped[0][0] == dumped[1][0] and dumped[0][1] != dumped[1][1]


def test_prompt_embeddings_have_no_keys(config, store, log):
    """A prompt given as embeddings has no token ids to key on: no lookup, nothing to load or dump."""
    request = make_request("r", None, prompt_embeds=torch.zeros(3 * BLOCK_SIZE, 8))
    sched = scheduler(config, store)
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    sched.update_state_after_alloc(request, kv_blocks(BLOCK_IDS[:3]), 0)
    meta = sched.build_connector_meta(new_step(request, BLOCK_IDS[:3], 0, 3 * BLOCK_SIZE))
    assert (meta.loads, meta.dumps) == ([], [])
    assert log.messages(logging.INFO) == ["request_id: r, total_blocks_num: 0, hit hbm: 0, hit external: 0"]


# ----------------------------------------------------------------------------- prefill/decode disaggregation
def test_producer_dumps_durably_and_reports_its_prefill_blocks(config, store):
    """``kv_producer`` (a prefill instance) loads nothing, even from a full store. A request sent with
    ``do_remote_decode`` has its dumps made durable (its response must not leave before the blocks are in storage)
    and its ``kv_transfer_params`` answer names the full prompt blocks now in the store; another request's dumps
    are not durable and it answers nothing."""
    ids = tokens(4 * BLOCK_SIZE + 3)
    keys = keys_of(ids)
    fill_store(config, keys[:2])
    sched = scheduler(config, store, load=False, dump=True)
    remote = make_request("p", ids, params={DO_REMOTE_DECODE: True})
    local = make_request("q", tokens(2 * BLOCK_SIZE, start=7000))
    for request, blocks in ((remote, BLOCK_IDS[:5]), (local, BLOCK_IDS[5:7])):
        assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
        sched.update_state_after_alloc(request, kv_blocks(blocks), 0)
    meta = sched.build_connector_meta(new_step(remote, BLOCK_IDS[:5], 0, len(ids)))
    assert meta.loads == []
    # Blocks 0-1 are in the store already: only 2-3 are written.
    assert transfers(meta.dumps) == [("p", keys[2:4], BLOCK_IDS[2:4], True)]
    meta = sched.build_connector_meta(new_step(local, BLOCK_IDS[5:7], 0, 2 * BLOCK_SIZE))
    assert [t.durable for t in meta.dumps] == [False]
    assert sched.request_finished("p") == {PREFILL_BLOCKS: 4}
    assert sched.request_finished("q") is None
    assert sched.request_finished("p") is None  # forgotten


def test_prefill_ended_early_answers_the_blocks_stored_so_far(config, store):
    """A prefill request that ends before its prompt is computed (aborted between chunks) answers only the blocks
    dumped by then."""
    ids = tokens(4 * BLOCK_SIZE + 3)
    sched = scheduler(config, store, load=False, dump=True)
    request = make_request("p", ids, params={DO_REMOTE_DECODE: True})
    sched.get_num_new_matched_tokens(request, 0)
    sched.update_state_after_alloc(request, kv_blocks(BLOCK_IDS[:3]), 0)
    meta = sched.build_connector_meta(new_step(request, BLOCK_IDS[:3], 0, 40))
    assert transfers(meta.dumps) == [("p", keys_of(ids)[:2], BLOCK_IDS[:2], True)]
    assert sched.request_finished("p") == {PREFILL_BLOCKS: 2}


def test_consumer_loads_and_never_dumps(config, store, log):
    """``kv_consumer`` (a decode instance) loads what the prefill instance stored and dumps nothing, not even the
    blocks it had to compute; it answers no ``kv_transfer_params``."""
    ids = tokens(4 * BLOCK_SIZE + 3)
    keys = keys_of(ids)
    fill_store(config, keys[:3])
    sched = scheduler(config, store, load=True, dump=False)
    request = make_request("d", ids, params={PREFILL_BLOCKS: 3})
    assert sched.get_num_new_matched_tokens(request, 0) == (48, False)
    sched.update_state_after_alloc(request, kv_blocks(BLOCK_IDS[:5]), 48)
    meta = sched.build_connector_meta(new_step(request, BLOCK_IDS[:5], 48, len(ids) - 48))
    assert transfers(meta.loads) == [("d", keys[:3], BLOCK_IDS[:3], False)]
    assert meta.dumps == []
    assert sched.request_finished("d") is None
    assert log.messages(logging.WARNING) == []


def test_consumer_warns_when_the_store_lacks_prefill_blocks(config, store, log):
    """The prefill instance said it stored 4 blocks, this instance's store has the first 1 (another directory?):
    a warning naming both numbers, and the request is served by recomputing the rest."""
    ids = tokens(4 * BLOCK_SIZE + 3)
    fill_store(config, keys_of(ids)[:1])
    sched = scheduler(config, store, load=True, dump=False)
    request = make_request("d", ids, params={PREFILL_BLOCKS: 4})
    assert sched.get_num_new_matched_tokens(request, 0) == (16, False)
    (warning,) = log.messages(logging.WARNING)
    assert "the prefill instance stored 4 blocks, the store has the first 1; recomputing the rest" in warning


def test_kv_both_with_remote_decode_is_a_prefill_too(config, store):
    """A ``kv_both`` instance can serve as the prefill instance: durable dumps and the answer, as a producer."""
    ids = tokens(2 * BLOCK_SIZE + 1)
    sched = scheduler(config, store)
    request = make_request("p", ids, params={DO_REMOTE_DECODE: True})
    sched.get_num_new_matched_tokens(request, 0)
    sched.update_state_after_alloc(request, kv_blocks(BLOCK_IDS[:3]), 0)
    meta = sched.build_connector_meta(new_step(request, BLOCK_IDS[:3], 0, len(ids)))
    assert [t.durable for t in meta.dumps] == [True]
    assert sched.request_finished("p") == {PREFILL_BLOCKS: 2}


# ------------------------------------------------------------------------------ inside vLLM's own Scheduler
@pytest.fixture
def loops(tiny_model: Path, tmp_path: Path) -> Iterator[Any]:
    """Builds :class:`CoreLoop` s on one store directory (the ``config`` fixture's), closes them at the end."""
    built: list[CoreLoop] = []
    extra = ucm_extra_config(tmp_path / "store")

    def make(**kwargs: Any) -> CoreLoop:
        built.append(CoreLoop(tiny_model, config_from_extra_config(extra), extra, **kwargs))
        return built[-1]

    yield make
    for loop in built:
        loop.close()


def test_vllm_scheduler_loads_the_stored_prefix_and_dumps_the_rest(loops, config):
    """vLLM's scheduler with an empty prefix cache: the store's 2 blocks are loaded into the first 2 of the
    request's vLLM blocks in its first step, blocks 2-3 are dumped in the same step, decode moves nothing. The same
    prompt again is a hit of vLLM's own prefix cache: nothing is loaded or dumped. UCM set vLLM's
    ``kv_load_failure_policy`` to ``recompute``."""
    core = loops()
    assert core.scheduler.recompute_kv_load_failures
    ids = tokens(4 * BLOCK_SIZE + 5)
    keys = core.keys(ids)
    fill_store(config, keys[:2])
    core.add("a", ids, max_tokens=3)
    out, meta, _ = core.step()
    assert out.num_scheduled_tokens == {"a": len(ids) - 32}
    blocks = block_ids_of(out, "a")
    assert len(blocks) == 5
    assert transfers(meta.loads) == [("a", keys[:2], blocks[:2], False)]
    assert transfers(meta.dumps) == [("a", keys[2:4], blocks[2:4], False)]
    finished: list[EngineCoreOutput] = []
    while core.scheduler.requests:
        _, meta, outputs = core.step()
        assert (meta.loads, meta.dumps) == ([], [])
        finished += [o for o in outputs if o.finished]
    assert [(o.request_id, o.kv_transfer_params) for o in finished] == [("a", None)]

    core.add("b", ids)
    out, meta, _ = core.step()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 64  # vLLM's prefix cache
    assert (meta.loads, meta.dumps) == ([], [])


def test_vllm_scheduler_chunked_prefill_dumps_each_block_once(loops):
    """A 100-token prompt under a 40-token step budget: vLLM computes it in 3 chunks, adding blocks as it goes;
    each full prompt block is dumped in the step that fills it, from the block vLLM put it in."""
    core = loops(max_num_batched_tokens=40)
    ids = tokens(100)
    keys = core.keys(ids)
    core.add("a", ids)
    out, meta, _ = core.step()
    blocks = block_ids_of(out, "a")
    dumps = [transfers(meta.dumps)]
    for _ in range(2):
        out, meta, _ = core.step()
        (new_ids,) = out.scheduled_cached_reqs.new_block_ids
        assert new_ids is not None
        blocks += new_ids[0]
        dumps.append(transfers(meta.dumps))
    assert len(blocks) == 7
    assert dumps == [
        [("a", keys[0:2], blocks[0:2], False)],
        [("a", keys[2:5], blocks[2:5], False)],
        [("a", keys[5:6], blocks[5:6], False)],
    ]


def test_vllm_scheduler_preempted_request_resumes_from_the_store(loops):
    """Two 4-block prompts fill a KV cache of 8 usable blocks; the first decode step needs a ninth, so vLLM preempts
    the second request and reuses its last block. When the second resumes, vLLM's prefix cache still has its
    first 3 blocks and the store (which its first step dumped) supplies the fourth, loaded into the block vLLM
    gives it; nothing is dumped again."""
    core = loops(num_blocks=9)  # block 0 is vLLM's null block
    ids_a, ids_b = tokens(64), tokens(64, start=5000)
    keys_b = core.keys(ids_b)
    core.add("a", ids_a, max_tokens=3)
    core.add("b", ids_b, max_tokens=3)
    out, meta, _ = core.step()
    assert [t.req_id for t in meta.dumps] == ["a", "b"]
    out, meta, _ = core.step()
    assert out.preempted_req_ids == {"b"}
    resumed = None
    for _ in range(4):
        out, meta, _ = core.step()
        if "b" in out.scheduled_cached_reqs.resumed_req_ids:
            resumed = (out, meta)
            break
        assert (meta.loads, meta.dumps) == ([], [])
    assert resumed is not None, "b never resumed"
    out, meta = resumed
    blocks = block_ids_of(out, "b")
    assert out.scheduled_cached_reqs.num_computed_tokens == [63]  # 3 blocks from vLLM, 15 tokens from the store
    assert transfers(meta.loads) == [("b", keys_b[3:4], blocks[3:4], False)]
    assert meta.dumps == []


def test_vllm_scheduler_recomputes_failed_loads_and_the_store_heals(loops, config):
    """Blocks 1 and 3 of a stored prompt are damaged on disk: the lookup finds all 4, the workers' loads of 1 and 3
    fail (and the store removes the files), vLLM rewinds the request to block 1 and recomputes; the recomputed
    blocks 1-3 are dumped again, so that another instance loads all 4."""
    core = loops()
    ids = tokens(4 * BLOCK_SIZE + 5)
    keys = core.keys(ids)
    fill_store(config, keys)
    for key in (keys[1], keys[3]):
        (path,) = Path(config.store.storage_dirs[0]).rglob(f"{key.hex()}.ucmb")
        data = bytearray(path.read_bytes())
        data[-10] ^= 0x01
        path.write_bytes(bytes(data))
    core.add("a", ids)
    out, meta, _ = core.step()
    blocks = block_ids_of(out, "a")
    assert transfers(meta.loads) == [("a", keys, blocks[:4], False)]
    assert core.scheduler.requests["a"].num_computed_tokens == BLOCK_SIZE  # rewound to the first failed block
    out, meta, _ = core.step()
    assert out.num_scheduled_tokens == {"a": len(ids) - BLOCK_SIZE}
    assert transfers(meta.dumps) == [("a", keys[1:4], blocks[1:4], False)]

    other = build_store(config.store)
    try:
        rows = torch.empty(4, SPEC.block_nbytes, dtype=torch.uint8)
        assert other.lookup(keys) == 4 and other.wait(other.load(keys, rows)).ok
    finally:
        other.close()


def test_vllm_scheduler_prefill_and_decode_instances(loops):
    """Disaggregation through one store directory: the ``kv_producer`` instance loads nothing, makes the dumps of a
    ``do_remote_decode`` request durable and answers ``{"ucm_prefill_blocks": 4}`` in its output's
    ``kv_transfer_params``; the ``kv_consumer`` instance, given that answer, loads the 4 blocks and dumps nothing,
    not even the blocks of a longer prompt that it computes itself."""
    producer = loops(kv_role="kv_producer")
    ids = tokens(4 * BLOCK_SIZE + 6)
    keys = producer.keys(ids)
    producer.add("p", ids, max_tokens=1, params={DO_REMOTE_DECODE: True})
    out, meta, outputs = producer.step()
    assert meta.loads == []
    assert transfers(meta.dumps) == [("p", keys, block_ids_of(out, "p")[:4], True)]
    (answer,) = outputs
    assert answer.finished and answer.kv_transfer_params == {PREFILL_BLOCKS: 4}

    consumer = loops(kv_role="kv_consumer")
    assert consumer.keys(ids) == keys
    longer = ids + tokens(2 * BLOCK_SIZE, start=9000)
    consumer.add("d", longer, params=answer.kv_transfer_params)
    out, meta, _ = consumer.step()
    assert out.num_scheduled_tokens == {"d": len(longer) - 64}
    assert transfers(meta.loads) == [("d", keys, block_ids_of(out, "d")[:4], False)]
    assert meta.dumps == []
    while consumer.scheduler.requests:
        _, meta, _ = consumer.step()
        assert meta.dumps == []


# ------------------------------------------------------------------------------- CacheBlend's runs
END = 7  # the chunk-end token id of these tests (tokens() gives ids from 1000 up)


def blend_config(tmp_path: Path) -> UcmConfig:
    return config_from_extra_config(
        {**ucm_extra_config(tmp_path / "store"), "ucm_sparse_config": {"Blend": {"chunk_end_token_id": END}}}
    )


def test_blend_offers_the_chunks_past_the_stored_prefix_and_dumps_nothing(tmp_path, log):
    """Chunks of 2.5 blocks each, the first stored as a prefix: the scheduler offers every token but the last (not
    only the stored prefix: the chunks, then the question but its last token, which vLLM computes), sends the run
    with the chunks and the blocks to fill, loads the stored prefix as usual, and plans no dump for the request (its
    KV past the prefix is approximate)."""
    cfg = blend_config(tmp_path)
    chunk = 2 * BLOCK_SIZE + BLOCK_SIZE // 2
    a, b, c = ([*tokens(chunk - 1, start), END] for start in (1000, 3000, 5000))
    question = tokens(9, 7000)
    ids = a + b + c + question
    fill_store(cfg, keys_of(a)[:2])
    st = build_store(cfg.store)
    try:
        sched = UCMScheduler(cfg, SPEC, NAMESPACE, st, load=True, dump=True)
        request = make_request("r", ids)
        num_external, _ = sched.get_num_new_matched_tokens(request, 0)
        assert num_external == len(ids) - 1  # through the question but its last token
        block_ids = list(range(20, 20 + -(-len(ids) // BLOCK_SIZE)))
        sched.update_state_after_alloc(request, kv_blocks(block_ids), num_external)
        meta = sched.build_connector_meta(new_step(request, block_ids, num_external, len(ids) - num_external))
    finally:
        st.close()
    assert transfers(meta.loads) == [("r", keys_of(a)[:2], block_ids[:2], False)]
    (run,) = meta.blends
    end = len(ids) - 1
    assert (run.start, run.end) == (2 * BLOCK_SIZE, end)
    assert run.spans == [(0, chunk), (chunk, 2 * chunk), (2 * chunk, 3 * chunk)]
    assert run.token_ids == ids[:end] and run.block_ids == block_ids[: -(-end // BLOCK_SIZE)]
    assert meta.dumps == []
    assert log.messages(logging.INFO)[-1].endswith(f"hit external: 2, blend: tokens {2 * BLOCK_SIZE}-{end}")


def test_blend_skips_a_prompt_whose_chunks_are_all_in_the_stored_prefix(tmp_path):
    """One chunk of two whole blocks, stored, then a question: no chunk token past the prefix, so no run (the
    question is vLLM's to compute, as in any prefix hit); the stored prefix is offered as usual."""
    cfg = blend_config(tmp_path)
    a = [*tokens(2 * BLOCK_SIZE - 1, 1000), END]
    ids = a + tokens(9, 7000)
    fill_store(cfg, keys_of(a)[:2])
    st = build_store(cfg.store)
    try:
        sched = UCMScheduler(cfg, SPEC, NAMESPACE, st, load=True, dump=True)
        request = make_request("r", ids)
        assert sched.get_num_new_matched_tokens(request, 0) == (2 * BLOCK_SIZE, False)
        block_ids = list(range(20, 20 + -(-len(ids) // BLOCK_SIZE)))
        sched.update_state_after_alloc(request, kv_blocks(block_ids), 2 * BLOCK_SIZE)
        meta = sched.build_connector_meta(new_step(request, block_ids, 2 * BLOCK_SIZE, len(ids) - 2 * BLOCK_SIZE))
    finally:
        st.close()
    assert meta.blends == [] and transfers(meta.loads) == [("r", keys_of(a)[:2], block_ids[:2], False)]


@pytest.mark.parametrize(
    ("ids", "want"),
    [(tokens(3 * BLOCK_SIZE), 0), ([*tokens(BLOCK_SIZE - 1), END], BLOCK_SIZE - 1)],
    ids=["no-chunk-end", "prompt-ends-with-chunk-end"],
)
def test_blend_needs_a_chunk_end_and_leaves_the_last_token(tmp_path, ids, want):
    """No chunk-end token: an ordinary request (nothing offered on an empty store). A prompt ending with one: the
    run stops one token short (vLLM computes the last token, whose logits it samples)."""
    cfg = blend_config(tmp_path)
    st = build_store(cfg.store)
    try:
        sched = UCMScheduler(cfg, SPEC, NAMESPACE, st, load=True, dump=True)
        assert sched.get_num_new_matched_tokens(make_request("r", ids), 0) == (want, False)
    finally:
        st.close()
