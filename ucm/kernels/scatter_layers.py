"""scatter_layers: layerwise staging, one contiguous shard buffer per layer -> paged KV, for many blocks.

The inverse of :mod:`ucm.kernels.gather_layers`: ``shards[l, i]`` (canonical shard ``[2, block_size,
num_kv_heads, head_dim]``, MLA ``[block_size, latent_dim]``) is written into block ``block_ids[i]`` of
``kv_caches[l]``. A layerwise load calls it with one layer (``shards[None]``, ``[cache]``) just before that layer's
attention, or with all layers in one launch. Block ids must be distinct.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ucm.kernels._block_copy import Impl
from ucm.kernels.layouts import KVLayout
from ucm.kernels.scatter_blocks import check_scatter, scatter_blocks_reference, scatter_staged


def scatter_layers(
    shards: torch.Tensor,
    kv_caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    layout: KVLayout,
    *,
    impl: Impl = "auto",
) -> None:
    """Write each layer's staged shards into blocks ``block_ids`` of that layer's paged KV (in place).

    Args:
        shards: ``[num_layers, n, *shard]`` in the caches' dtype and device (copied first if its shard dims are
            not contiguous).
        kv_caches: one contiguous paged KV tensor per layer in ``layout``, ``len(kv_caches) == num_layers``.
        block_ids: int32/int64 ``[n]`` distinct vLLM block ids.
        layout: the paged layout.
        impl: ``"auto"`` (Triton on CUDA, the CPU fast path on CPU, torch elsewhere), ``"triton"``, ``"cpu"`` or
            ``"torch"``.

    Raises:
        TypeError: ``block_ids`` is not an int32/int64 tensor.
        ValueError: bad shapes, dtypes, devices, layout or ``impl``; repeated or out-of-range block ids. Nothing
            is written when an error is raised.
    """
    scatter_staged(shards, kv_caches, block_ids, layout, impl, layer_major=True, name="shards")


def scatter_layers_reference(
    shards: torch.Tensor, kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, layout: KVLayout
) -> None:
    """Naive oracle for :func:`scatter_layers`: the blockwise reference on the block-major transpose."""
    check_scatter(shards, kv_caches, layout, block_ids, layer_major=True, name="shards")
    scatter_blocks_reference(shards.transpose(0, 1), kv_caches, block_ids, layout)
