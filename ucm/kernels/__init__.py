"""Kernels on vLLM's paged KV cache and UCM's canonical blocks: plain torch tensors in and out, no vLLM import.

One package per op family, laid out as flash-linear-attention's ``fla/ops/<op>/``: ``ops`` (the public ops:
validation, then dispatch by ``impl``), ``naive`` (the references, the test oracles), ``triton``, ``cpu`` (with
``cpu_numba``, its numba kernels, imported on the first CPU call) and ``torch``:

- ``block_copy``: ``gather_blocks`` (paged -> canonical, block-major ``[n, num_layers, *shard]``),
  ``scatter_blocks`` (canonical -> paged), and the layerwise staging pair ``gather_layers`` / ``scatter_layers``
  (layer-major ``[num_layers, n, *shard]``: one contiguous buffer per layer); ``warm_up`` loads their kernels at
  start. Exported here: what the connector and users call.
- ``kvfold``: the KVfold codec's bf16 planes and int8 groups (``ucm.store.kvfold``).
- ``sparq`` and ``key_bounds``: GSA's block scoring (``ucm.sparse.gsa``): SparQ's query step and per-block
  log-sum-exp; Quest's per-block key bounds and the upper bounds of ``q . k`` they give.
- ``rerope``: ReRoPE attention over paged KV (``ucm.integration.vllm.sparse_backend``).
- ``blend``: CacheBlend's RoPE delta, KV deviation and choice of tokens to recompute
  (``ucm.integration.vllm.blend``).

Shared modules: ``layouts`` (the paged layouts, the canonical block, the checks on caches, block ids and staging
buffers), ``paged_keys`` (one layer's keys as a view of the paged cache), ``utils`` (the ``impl`` vocabulary, the
Triton interpreter). Every op takes ``impl`` in ``("auto", "triton", "cpu", "torch", "reference")``
(``ucm.kernels.utils``).
"""

from ucm.kernels.block_copy.naive import (
    gather_blocks_reference,
    gather_layers_reference,
    scatter_blocks_reference,
    scatter_layers_reference,
)
from ucm.kernels.block_copy.ops import gather_blocks, gather_layers, scatter_blocks, scatter_layers, warm_up
from ucm.kernels.layouts import KVLayout, canonical_block_shape, canonical_shard_shape
from ucm.kernels.utils import IMPLS, Impl

__all__ = [
    "IMPLS",
    "Impl",
    "KVLayout",
    "canonical_block_shape",
    "canonical_shard_shape",
    "gather_blocks",
    "gather_blocks_reference",
    "gather_layers",
    "gather_layers_reference",
    "scatter_blocks",
    "scatter_blocks_reference",
    "scatter_layers",
    "scatter_layers_reference",
    "warm_up",
]
