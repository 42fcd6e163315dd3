"""Naive references of the block-copy ops (``impl="reference"``; the test oracles): loops over blocks, layers and
heads, each element placed where ``ucm.kernels.layouts`` says it lives. Same arguments and results as the ops of
``ucm.kernels.block_copy.ops``; slow, for tests and small inputs."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ucm.kernels.layouts import (
    KVLayout,
    amx_offsets,
    canonical_shard_shape,
    check_block_ids,
    check_paged_caches,
    check_staging,
    int_view,
)


def gather_blocks_reference(
    kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, layout: KVLayout
) -> torch.Tensor:
    """Naive oracle for :func:`ucm.kernels.gather_blocks` (same arguments and result; slow, for tests)."""
    num_blocks, block_size, num_kv_heads, head_dim = check_paged_caches(kv_caches, layout)
    ids = check_block_ids(block_ids, num_blocks).tolist()
    out = torch.empty(
        (len(ids), len(kv_caches), *canonical_shard_shape(block_size, num_kv_heads, head_dim, layout)),
        dtype=kv_caches[0].dtype,
        device=kv_caches[0].device,
    )
    o = int_view(out)
    k_off, v_off = amx_offsets(block_size, head_dim)  # used by CPU_ATTN_AMX
    for i, b in enumerate(ids):
        for layer, cache in enumerate(kv_caches):
            c = int_view(cache)
            if layout == KVLayout.MLA:
                o[i, layer] = c[b]
                continue
            for h in range(num_kv_heads):
                if layout == KVLayout.CPU_ATTN:
                    flat = c[b, h].reshape(-1)  # K^T [D, bs] then V [bs, D]
                    o[i, layer, 0, :, h, :] = flat[: head_dim * block_size].reshape(head_dim, block_size).t()
                    o[i, layer, 1, :, h, :] = flat[head_dim * block_size :].reshape(block_size, head_dim)
                elif layout == KVLayout.CPU_ATTN_AMX:
                    flat = c[b, h].reshape(-1)  # K region then V region, elements where amx_offsets says
                    o[i, layer, 0, :, h, :] = flat[k_off]
                    o[i, layer, 1, :, h, :] = flat[head_dim * block_size + v_off]
                else:
                    o[i, layer, 0, :, h, :] = c[0, b, :, h, :]
                    o[i, layer, 1, :, h, :] = c[1, b, :, h, :]
    return out


def gather_layers_reference(
    kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, layout: KVLayout
) -> torch.Tensor:
    """Naive oracle for :func:`ucm.kernels.gather_layers`: the blockwise reference, transposed to layer-major."""
    return gather_blocks_reference(kv_caches, block_ids, layout).transpose(0, 1).contiguous()


def scatter_blocks_reference(
    blocks: torch.Tensor, kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, layout: KVLayout
) -> None:
    """Naive oracle for :func:`ucm.kernels.scatter_blocks` (same arguments and effect; slow, for tests)."""
    ids, (_, block_size, num_kv_heads, head_dim) = check_staging(
        blocks, kv_caches, layout, block_ids, layer_major=False, name="blocks"
    )
    src = int_view(blocks)
    k_off, v_off = amx_offsets(block_size, head_dim)  # used by CPU_ATTN_AMX
    for i, b in enumerate(ids.tolist()):
        for layer, cache in enumerate(kv_caches):
            c = int_view(cache)
            if layout == KVLayout.MLA:
                c[b] = src[i, layer]
                continue
            for h in range(num_kv_heads):
                if layout == KVLayout.CPU_ATTN:
                    flat = c[b, h].view(-1)
                    flat[: head_dim * block_size] = src[i, layer, 0, :, h, :].t().reshape(-1)
                    flat[head_dim * block_size :] = src[i, layer, 1, :, h, :].reshape(-1)
                elif layout == KVLayout.CPU_ATTN_AMX:
                    flat = c[b, h].view(-1)  # K region then V region, elements where amx_offsets says
                    flat[k_off] = src[i, layer, 0, :, h, :]
                    flat[head_dim * block_size + v_off] = src[i, layer, 1, :, h, :]
                else:
                    c[0, b, :, h, :] = src[i, layer, 0, :, h, :]
                    c[1, b, :, h, :] = src[i, layer, 1, :, h, :]


def scatter_layers_reference(
    shards: torch.Tensor, kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, layout: KVLayout
) -> None:
    """Naive oracle for :func:`ucm.kernels.scatter_layers`: the blockwise reference on the block-major transpose."""
    check_staging(shards, kv_caches, layout, block_ids, layer_major=True, name="shards")
    scatter_blocks_reference(shards.transpose(0, 1), kv_caches, block_ids, layout)
