"""gather_blocks: vLLM paged KV (all layers) -> canonical blocks, for a list of vLLM block ids.

Reads, for each block id in ``block_ids`` and each layer ``l``, that block's K and V out of ``kv_caches[l]`` (in
``layout``) and writes them to ``out[i, l]`` in canonical order ``[2, block_size, num_kv_heads, head_dim]``
(``ucm.kernels.layouts``). Pure data movement: bytes are copied through integer views, so the result is
bit-exact for every dtype (bf16, fp16, fp32, fp8 as bytes), NaN payloads and -0.0 included.

Two implementations with identical results:
- :func:`gather_blocks` - the fast path on CPU tensors (and any torch device): one strided copy per layer and
  K/V half, using advanced indexing over the block dimension.
- :func:`gather_blocks_reference` - the test oracle: loops over blocks and heads and spells out the memory layout.
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


def _alloc_or_check_out(out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if tuple(out.shape) != shape or out.dtype != like.dtype or out.device != like.device:
        raise ValueError(
            f"out must be {shape} {like.dtype} on {like.device}, got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    return out


def gather_blocks(
    kv_caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    layout: KVLayout,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Copy blocks ``block_ids`` of every layer's paged KV into canonical blocks.

    Args:
        kv_caches: one paged KV tensor per layer, all the same shape/dtype/device, in ``layout``
            (CPU_ATTN ``[num_blocks, num_kv_heads, block_size, 2*head_dim]``; FLASH_NHD
            ``[2, num_blocks, block_size, num_kv_heads, head_dim]``).
        block_ids: int32/int64 ``[n]`` vLLM block ids (repeats allowed).
        layout: the paged layout.
        out: optional contiguous ``[n, num_layers, 2, block_size, num_kv_heads, head_dim]`` tensor of the caches'
            dtype and device to write into.

    Returns:
        ``out`` (allocated if not given): ``[n, num_layers, 2, block_size, num_kv_heads, head_dim]``, KV dtype.

    Raises:
        ValueError / TypeError: bad shapes, dtypes, devices, layout, or block ids out of range.
    """
    num_blocks, block_size, num_kv_heads, head_dim = check_paged_caches(kv_caches, layout)
    ids = check_block_ids(block_ids, num_blocks).to(kv_caches[0].device)
    n, num_layers = ids.numel(), len(kv_caches)
    out = _alloc_or_check_out(
        out, (n, *canonical_block_shape(num_layers, block_size, num_kv_heads, head_dim)), kv_caches[0]
    )
    if n == 0:
        return out
    o = int_view(out)  # [n, L, 2, bs, H, D]
    for layer, cache in enumerate(kv_caches):
        c = int_view(cache)
        if layout == KVLayout.CPU_ATTN:
            k, v = cpu_attn_kv_views(c)  # [nb, H, D, bs], [nb, H, bs, D]
            o[:, layer, 0].copy_(k[ids].permute(0, 3, 1, 2))  # -> [n, bs, H, D]
            o[:, layer, 1].copy_(v[ids].permute(0, 2, 1, 3))
        else:  # FLASH_NHD: [2, nb, bs, H, D]
            o[:, layer].copy_(c[:, ids].transpose(0, 1))
    return out


def gather_blocks_reference(
    kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, layout: KVLayout
) -> torch.Tensor:
    """Naive oracle for :func:`gather_blocks` (same arguments and result; slow, for tests)."""
    num_blocks, block_size, num_kv_heads, head_dim = check_paged_caches(kv_caches, layout)
    ids = check_block_ids(block_ids, num_blocks).tolist()
    out = torch.empty(
        (len(ids), *canonical_block_shape(len(kv_caches), block_size, num_kv_heads, head_dim)),
        dtype=kv_caches[0].dtype,
        device=kv_caches[0].device,
    )
    o = int_view(out)
    for i, b in enumerate(ids):
        for layer, cache in enumerate(kv_caches):
            c = int_view(cache)
            for h in range(num_kv_heads):
                if layout == KVLayout.CPU_ATTN:
                    flat = c[b, h].reshape(-1)  # K^T [D, bs] then V [bs, D]
                    o[i, layer, 0, :, h, :] = flat[: head_dim * block_size].reshape(head_dim, block_size).t()
                    o[i, layer, 1, :, h, :] = flat[head_dim * block_size :].reshape(block_size, head_dim)
                else:
                    o[i, layer, 0, :, h, :] = c[0, b, :, h, :]
                    o[i, layer, 1, :, h, :] = c[1, b, :, h, :]
    return out
