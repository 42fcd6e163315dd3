"""The connector's worker marks GSA summaries of the blocks it loads from the store stale, so a block reused for
other contents never keeps the summary of its previous contents (no engine: a real Posix store on a temp dir)."""

from __future__ import annotations

from pathlib import Path

import torch

from ucm.config import GSAConfig, UcmPipelineStoreConfig
from ucm.integration.vllm.engine_info import KVSpec
from ucm.integration.vllm.metadata import BlockTransfer, UCMConnectorMetadata
from ucm.integration.vllm.worker import UCMWorker
from ucm.kernels.layouts import KVLayout
from ucm.kernels.paged_keys import paged_keys
from ucm.sparse import GSA
from ucm.store.pipeline import release_shared_store, shared_store

BLOCK_SIZE, HEADS, DIM, NUM_BLOCKS = 32, 2, 16, 8


def test_loaded_blocks_get_fresh_summaries(tmp_path: Path) -> None:
    spec = KVSpec(("l0", "l1"), BLOCK_SIZE, HEADS, DIM, torch.bfloat16)
    config = UcmPipelineStoreConfig(store_pipeline="Posix", storage_backends=str(tmp_path))
    store = shared_store(config)
    try:
        g = torch.Generator().manual_seed(0)
        caches = {
            n: torch.randn((NUM_BLOCKS, HEADS, BLOCK_SIZE, 2 * DIM), generator=g).bfloat16() for n in spec.layer_names
        }
        worker = UCMWorker(spec, store, lambda _cache: KVLayout.CPU_ATTN)
        worker.register_kv_caches(caches)
        key = bytes(range(16))
        worker.wait_for_save(UCMConnectorMetadata(dumps=[BlockTransfer("r0", [key], [2])]))  # block 2 -> store
        worker.shutdown()  # waits for the dump

        method = GSA(GSAConfig(block_scoring="key_bounds"))
        layer0 = paged_keys(caches["l0"], KVLayout.CPU_ATTN)
        table = method.new_summaries(NUM_BLOCKS, HEADS, DIM, torch.device("cpu"))
        five, full = torch.tensor([5]), torch.tensor([BLOCK_SIZE])
        assert table.refresh(layer0, five, full) == 1  # block 5's summary, of its current contents
        old_max = table.kmax[5].clone()

        loader = UCMWorker(spec, store, lambda _cache: KVLayout.CPU_ATTN)
        loader.register_kv_caches(caches)
        loader.start_load_kv(UCMConnectorMetadata(loads=[BlockTransfer("r1", [key], [5])]))  # store -> block 5
        assert torch.equal(caches["l0"][5], caches["l0"][2])  # the load happened
        assert int(table.fill[5]) == -1  # and made the summary stale
        assert table.refresh(layer0, five, full) == 1
        assert torch.equal(table.kmax[5], layer0[2].float().amax(dim=1))
        assert not torch.equal(table.kmax[5], old_max)
        loader.shutdown()
    finally:
        release_shared_store(config)
