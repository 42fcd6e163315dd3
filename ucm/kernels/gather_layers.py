"""gather_layers: layerwise staging, paged KV -> one contiguous shard buffer per layer, for many blocks.

A layerwise dump moves one layer at a time, so its staging is layer-major: ``out[l]`` is a contiguous
``[n, *shard]`` buffer holding layer ``l``'s shard of every block in ``block_ids`` (shard = ``[2, block_size,
num_kv_heads, head_dim]``, MLA ``[block_size, latent_dim]``). ``gather_layers([cache], ids, layout)[0]`` stages one
layer; passing all layers stages them all in one launch. ``out[l, i]`` is bit-identical to
``gather_blocks(...)[i, l]``: the same kernels run with the staging strides swapped (``ucm.kernels._block_copy``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ucm.kernels._block_copy import Impl
from ucm.kernels.gather_blocks import gather_blocks_reference, gather_staged
from ucm.kernels.layouts import KVLayout


def gather_layers(
    kv_caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    layout: KVLayout,
    out: torch.Tensor | None = None,
    *,
    impl: Impl = "auto",
) -> torch.Tensor:
    """Copy blocks ``block_ids`` of each layer's paged KV into that layer's contiguous staging buffer.

    Args:
        kv_caches: one contiguous paged KV tensor per layer to stage (one or all), same shape/dtype/device, in
            ``layout`` (shapes as for :func:`ucm.kernels.gather_blocks`).
        block_ids: int32/int64 ``[n]`` vLLM block ids (repeats allowed).
        layout: the paged layout.
        out: optional contiguous ``[num_layers, n, *shard]`` tensor of the caches' dtype and device.
        impl: ``"auto"`` (Triton on CUDA, the CPU fast path on CPU, torch elsewhere), ``"triton"``, ``"cpu"`` or
            ``"torch"``.

    Returns:
        ``out`` (allocated if not given): ``[num_layers, n, *shard]``, KV dtype; ``out[l]`` is layer ``l``'s staging.

    Raises:
        TypeError: ``block_ids`` is not an int32/int64 tensor.
        ValueError: bad shapes, dtypes, devices, layout or ``impl``, or block ids out of ``[0, num_blocks)``.
    """
    return gather_staged(kv_caches, block_ids, layout, out, impl, layer_major=True)


def gather_layers_reference(
    kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, layout: KVLayout
) -> torch.Tensor:
    """Naive oracle for :func:`gather_layers`: the blockwise reference, transposed to layer-major."""
    return gather_blocks_reference(kv_caches, block_ids, layout).transpose(0, 1).contiguous()
