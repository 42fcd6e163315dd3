"""Worker side of UCMConnector: moves KV between vLLM's paged cache and the store (blockwise).

Per step: ``start_load_kv`` loads every block the scheduler planned, all layers at once, and scatters them into the
paged KV before the forward pass; ``wait_for_save`` gathers the blocks that became full during the pass into a
staging buffer and hands it to the store, whose writes finish in the background (the gather is the only part the
step waits for, so vLLM may reuse the blocks as soon as it returns).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from ucm.hashing import rank_keys
from ucm.integration.vllm.engine_info import KVSpec
from ucm.integration.vllm.metadata import BlockTransfer, UCMConnectorMetadata, UCMWorkerMetadata
from ucm.kernels import KVLayout, canonical_block_shape, gather_blocks, scatter_blocks
from ucm.logger import init_logger
from ucm.store.base import Task, UcmKVStoreBase

if TYPE_CHECKING:
    from collections.abc import Callable

logger = init_logger(__name__)


class UCMWorker:
    """Loads and dumps canonical blocks for one worker (one TP rank).

    Args:
        spec: the engine's KV spec (layer order, block_size, heads, dtype).
        store: the store pipeline.
        layout_fn: detects the paged layout from one layer's KV tensor (``engine_info.detect_layout``).
        tp_rank / tp_size: tensor-parallel rank and size.
    """

    def __init__(
        self,
        spec: KVSpec,
        store: UcmKVStoreBase,
        layout_fn: Callable[[torch.Tensor], KVLayout],
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        self._spec = spec
        self._store = store
        self._layout_fn = layout_fn
        self._tp_rank, self._tp_size = tp_rank, tp_size
        self._kv_caches: list[torch.Tensor] = []
        self._layout: KVLayout | None = None
        self._load_errors: set[int] = set()
        self._pending_dumps: list[tuple[Task, torch.Tensor, int]] = []
        self._stored_keys: list[bytes] = []
        self._failed_keys: list[bytes] = []
        self._load_buffer: torch.Tensor | None = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take vLLM's per-layer paged KV tensors, ordered as the KV spec's layers.

        Raises:
            ValueError: a layer of the KV spec has no tensor.
            UnsupportedEngineError: the layout is not one UCM handles.
        """
        missing = [name for name in self._spec.layer_names if name not in kv_caches]
        if missing:
            raise ValueError(f"kv_caches lacks layers {missing[:4]}... of the KV spec")
        self._kv_caches = [kv_caches[name] for name in self._spec.layer_names]
        self._layout = self._layout_fn(self._kv_caches[0])
        logger.info(
            "registered %d KV layers, layout %s, block %d tokens, %.2f MiB per block",
            len(self._kv_caches),
            self._layout.value,
            self._spec.block_size,
            self._spec.block_nbytes / 2**20,
        )

    def _staging(self, n: int) -> torch.Tensor:
        """A new ``[n, num_layers, 2, block_size, num_kv_heads, head_dim]`` CPU buffer (dumps: owned by the store
        until its task is done)."""
        s = self._spec
        shape = (n, *canonical_block_shape(len(self._kv_caches), s.block_size, s.num_kv_heads, s.head_dim))
        return torch.empty(shape, dtype=s.dtype, device="cpu")

    def _load_staging(self, n: int) -> torch.Tensor:
        """The first ``n`` blocks of a load buffer kept across steps (loads are synchronous, so it is free again
        when ``start_load_kv`` returns); reusing it spares the page faults of a fresh allocation per load."""
        if self._load_buffer is None or self._load_buffer.shape[0] < n:
            self._load_buffer = self._staging(max(n, 16))
        return self._load_buffer[:n]

    @staticmethod
    def _flatten(transfers: list[BlockTransfer]) -> tuple[list[bytes], list[int]]:
        keys: list[bytes] = []
        block_ids: list[int] = []
        for t in transfers:
            keys.extend(t.keys)
            block_ids.extend(t.block_ids)
        return keys, block_ids

    def start_load_kv(self, meta: UCMConnectorMetadata) -> None:
        """Load the step's planned blocks and scatter them into the paged KV (synchronous, all layers).

        Blocks the store cannot produce are recorded for :meth:`get_block_ids_with_load_errors` (vLLM recomputes
        them) and are not written to the paged KV.
        """
        if not meta.loads or self._layout is None:
            return
        keys, block_ids = self._flatten(meta.loads)
        t0 = time.perf_counter()
        staging = self._load_staging(len(keys))
        rows = staging.view(torch.uint8).view(len(keys), -1)
        result = self._store.wait(self._store.load(rank_keys(keys, self._tp_rank, self._tp_size), rows))
        t1 = time.perf_counter()
        ok = [i for i in range(len(keys)) if i not in result.failed]
        if result.failed:
            failed_ids = {block_ids[i] for i in result.failed}
            self._load_errors |= failed_ids
            self._failed_keys.extend(keys[i] for i in sorted(result.failed))
            logger.warning("%d of %d blocks failed to load; vLLM recomputes them", len(failed_ids), len(keys))
        if not ok:
            return
        device = self._kv_caches[0].device
        src = staging if len(ok) == len(keys) else staging[ok]
        ids = torch.tensor([block_ids[i] for i in ok], dtype=torch.int64)
        scatter_blocks(src.to(device, non_blocking=True), self._kv_caches, ids.to(device), self._layout)
        logger.debug(
            "loaded %d blocks into vLLM block ids %s: store %.1f ms, scatter %.1f ms",
            len(ok),
            [block_ids[i] for i in ok],
            (t1 - t0) * 1e3,
            (time.perf_counter() - t1) * 1e3,
        )

    def wait_for_save(self, meta: UCMConnectorMetadata) -> None:
        """Gather the step's newly full blocks and start their dump; return once the gather is done.

        The gather copies the blocks out of vLLM's paged KV into a fresh staging buffer, so vLLM may reuse those
        blocks as soon as this returns; the store writes the staging buffer in the background (kept alive until its
        task is done, reaped on later steps and at :meth:`shutdown`). Exception: when a dump is ``durable`` (a
        prefill whose KV another instance will load), this also waits until the store's task is done, i.e. the
        blocks are written through every stage (renamed into place in the Posix directory), so the request's
        response cannot reach the proxy before its KV is visible to other instances."""
        self._reap_dumps(block=False)
        if not meta.dumps or self._layout is None:
            return
        keys, block_ids = self._flatten(meta.dumps)
        device = self._kv_caches[0].device
        ids = torch.tensor(block_ids, dtype=torch.int64, device=device)
        if device.type == "cpu":
            staging = gather_blocks(self._kv_caches, ids, self._layout, out=self._staging(len(keys)))
        else:
            staging = gather_blocks(self._kv_caches, ids, self._layout).to("cpu")
        rows = staging.view(torch.uint8).view(len(keys), -1)
        ranked = rank_keys(keys, self._tp_rank, self._tp_size)
        logger.debug("dumping %d blocks: vLLM block ids %s", len(keys), block_ids)
        task = self._store.dump(ranked, rows)
        if any(t.durable for t in meta.dumps):
            # A prefill for another instance: its response must not leave before the blocks are in storage.
            t_wait = time.perf_counter()
            result = self._store.wait(task)
            self._store.flush()  # also blocks of this dump that an earlier, still running write-back is writing
            if result.failed:
                logger.warning("%d of %d blocks were not stored", len(result.failed), len(keys))
            logger.debug("durable dump of %d blocks: waited %.1f ms", len(keys), (time.perf_counter() - t_wait) * 1e3)
        else:
            # Keep the staging buffer alive until the store has finished with it.
            self._pending_dumps.append((task, rows, len(keys)))
        # Blocks the store can already serve (e.g. copied into the DRAM tier), reported to the scheduler.
        start = 0
        for t in meta.dumps:
            n = len(t.keys)
            self._stored_keys.extend(t.keys[: self._store.lookup(ranked[start : start + n])])
            start += n

    def _reap_dumps(self, block: bool) -> None:
        still: list[tuple[Task, torch.Tensor, int]] = []
        for task, rows, n in self._pending_dumps:
            if block or task.done():
                result = task.result()
                if result.failed:
                    logger.warning("%d of %d blocks were not stored", len(result.failed), n)
            else:
                still.append((task, rows, n))
        self._pending_dumps = still

    def take_worker_meta(self) -> UCMWorkerMetadata | None:
        """Keys stored and keys that failed to load since the last call, for the scheduler (``None``: none)."""
        if not self._stored_keys and not self._failed_keys:
            return None
        meta = UCMWorkerMetadata(self._stored_keys, self._failed_keys)
        self._stored_keys, self._failed_keys = [], []
        return meta

    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM block ids whose load failed since the last call (reported once)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        """Wait for in-flight dumps."""
        self._reap_dumps(block=True)
