"""scatter_blocks: canonical blocks -> vLLM paged KV (all layers), for a list of vLLM block ids.

The inverse of :mod:`ucm.kernels.gather_blocks`: writes ``blocks[i, l]`` (canonical
``[2, block_size, num_kv_heads, head_dim]``) into block ``block_ids[i]`` of ``kv_caches[l]`` in ``layout``.
Bit-exact (integer views). Block ids must be distinct (two sources for one destination block is a caller bug).

- :func:`scatter_blocks` - fast path (one strided ``index_copy_`` per layer and K/V half).
- :func:`scatter_blocks_reference` - the test oracle, looping over blocks and heads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ucm.kernels.layouts import (
    KVLayout,
    canonical_block_shape,
    check_block_ids,
    check_paged_caches,
    cpu_attn_kv_views,
    int_view,
)


def _check_blocks(
    blocks: torch.Tensor, kv_caches: Sequence[torch.Tensor], layout: KVLayout, block_ids: torch.Tensor
) -> tuple[torch.Tensor, tuple[int, int, int, int]]:
    shape = check_paged_caches(kv_caches, layout)
    num_blocks, block_size, num_kv_heads, head_dim = shape
    ids = check_block_ids(block_ids, num_blocks)
    if ids.numel() != torch.unique(ids).numel():
        raise ValueError(f"block_ids must be distinct for scatter, got {ids.tolist()}")
    want = (ids.numel(), *canonical_block_shape(len(kv_caches), block_size, num_kv_heads, head_dim))
    ref = kv_caches[0]
    if tuple(blocks.shape) != want or blocks.dtype != ref.dtype or blocks.device != ref.device:
        raise ValueError(
            f"blocks must be {want} {ref.dtype} on {ref.device}, "
            f"got {tuple(blocks.shape)} {blocks.dtype} on {blocks.device}"
        )
    return ids.to(ref.device), shape


def scatter_blocks(
    blocks: torch.Tensor,
    kv_caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    layout: KVLayout,
) -> None:
    """Write canonical ``blocks`` into blocks ``block_ids`` of every layer's paged KV (in place).

    Args:
        blocks: ``[n, num_layers, 2, block_size, num_kv_heads, head_dim]`` in the caches' dtype and device.
        kv_caches: one paged KV tensor per layer in ``layout`` (see :func:`ucm.kernels.gather_blocks`).
        block_ids: int32/int64 ``[n]`` distinct vLLM block ids.
        layout: the paged layout.

    Raises:
        ValueError / TypeError: bad shapes, dtypes, devices, layout, repeated or out-of-range block ids.
    """
    ids, _ = _check_blocks(blocks, kv_caches, layout, block_ids)
    if ids.numel() == 0:
        return
    src = int_view(blocks)
    for layer, cache in enumerate(kv_caches):
        c = int_view(cache)
        if layout == KVLayout.CPU_ATTN:
            k, v = cpu_attn_kv_views(c)  # [nb, H, D, bs], [nb, H, bs, D]
            k.index_copy_(0, ids, src[:, layer, 0].permute(0, 2, 3, 1))  # [n, bs, H, D] -> [n, H, D, bs]
            v.index_copy_(0, ids, src[:, layer, 1].permute(0, 2, 1, 3))  # -> [n, H, bs, D]
        else:  # FLASH_NHD: [2, nb, bs, H, D]
            c.index_copy_(1, ids, src[:, layer].transpose(0, 1))


def scatter_blocks_reference(
    blocks: torch.Tensor, kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, layout: KVLayout
) -> None:
    """Naive oracle for :func:`scatter_blocks` (same arguments and effect; slow, for tests)."""
    ids, (_, block_size, num_kv_heads, head_dim) = _check_blocks(blocks, kv_caches, layout, block_ids)
    src = int_view(blocks)
    for i, b in enumerate(ids.tolist()):
        for layer, cache in enumerate(kv_caches):
            c = int_view(cache)
            for h in range(num_kv_heads):
                if layout == KVLayout.CPU_ATTN:
                    flat = c[b, h].view(-1)
                    flat[: head_dim * block_size] = src[i, layer, 0, :, h, :].t().reshape(-1)
                    flat[head_dim * block_size :] = src[i, layer, 1, :, h, :].reshape(-1)
                else:
                    c[0, b, :, h, :] = src[i, layer, 0, :, h, :]
                    c[1, b, :, h, :] = src[i, layer, 1, :, h, :]
