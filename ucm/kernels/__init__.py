"""Data-movement kernels between vLLM's paged KV cache and UCM's canonical blocks.

One module per op, each with a dispatcher (Triton on CUDA, numba CPU fast path on CPU, torch elsewhere) and a
naive reference beside it: ``gather_blocks`` (paged -> canonical, block-major ``[n, num_layers, *shard]``),
``scatter_blocks`` (canonical -> paged), and the layerwise staging pair ``gather_layers`` / ``scatter_layers``
(layer-major ``[num_layers, n, *shard]``: one contiguous buffer per layer). The kernels they share live in
``ucm.kernels._block_copy``. Layouts and the canonical block are described in ``ucm.kernels.layouts``. Plain torch
tensors only; no vLLM import; numba is imported on the first CPU call (``warm_up`` makes that call at start).
"""

from ucm.kernels.gather_blocks import gather_blocks, gather_blocks_reference, warm_up
from ucm.kernels.gather_layers import gather_layers, gather_layers_reference
from ucm.kernels.layouts import KVLayout, canonical_block_shape, canonical_shard_shape
from ucm.kernels.scatter_blocks import scatter_blocks, scatter_blocks_reference
from ucm.kernels.scatter_layers import scatter_layers, scatter_layers_reference

__all__ = [
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
