"""Data-movement kernels between vLLM's paged KV cache and UCM's canonical blocks.

One module per op, each with its fast implementation and a naive reference beside it:
``gather_blocks`` (paged -> canonical) and ``scatter_blocks`` (canonical -> paged). Layouts and the canonical
block are described in ``ucm.kernels.layouts``. Plain torch tensors only; no vLLM import.
"""

from ucm.kernels.gather_blocks import gather_blocks, gather_blocks_reference
from ucm.kernels.layouts import KVLayout, canonical_block_shape
from ucm.kernels.scatter_blocks import scatter_blocks, scatter_blocks_reference

__all__ = [
    "KVLayout",
    "canonical_block_shape",
    "gather_blocks",
    "gather_blocks_reference",
    "scatter_blocks",
    "scatter_blocks_reference",
]
