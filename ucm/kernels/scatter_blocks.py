"""scatter_blocks: canonical blocks -> vLLM paged KV (all layers), for a list of vLLM block ids.

The inverse of :mod:`ucm.kernels.gather_blocks`: writes ``blocks[i, l]`` (canonical shard
``[2, block_size, num_kv_heads, head_dim]``, MLA ``[block_size, latent_dim]``) into block ``block_ids[i]`` of
``kv_caches[l]`` in ``layout``. Bit-exact (integer views). Block ids must be distinct (two sources for one
destination block is a caller bug, and the parallel implementations would race).

Implementations (``impl=``) as for ``gather_blocks``: ``"triton"`` (CUDA default; interpreter on CPU tensors),
``"cpu"`` (memmove / numba, CPU default), ``"torch"`` (any device); :func:`scatter_blocks_reference` is the test oracle.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ucm.kernels._block_copy import Impl, copy_blocks, resolve_impl
from ucm.kernels.layouts import (
    KVLayout,
    amx_offsets,
    canonical_shard_shape,
    check_block_ids,
    check_paged_caches,
    int_view,
)


def check_scatter(
    staging: torch.Tensor,
    kv_caches: Sequence[torch.Tensor],
    layout: KVLayout,
    block_ids: torch.Tensor,
    layer_major: bool,
    name: str,
) -> tuple[torch.Tensor, tuple[int, int, int, int]]:
    """Validate a scatter; return the ids (int64, on the caches' device) and the paged shape.

    ``staging`` must be ``[n, num_layers, *shard]`` (``layer_major``: ``[num_layers, n, *shard]``) in the caches'
    dtype and device with contiguous shard dims.

    Raises:
        TypeError: ``block_ids`` is not an int32/int64 tensor.
        ValueError: bad shapes, dtypes, devices or layout; block ids out of range or repeated.
    """
    shape = check_paged_caches(kv_caches, layout)
    num_blocks, block_size, num_kv_heads, head_dim = shape
    ids = check_block_ids(block_ids, num_blocks)
    if ids.numel() != torch.unique(ids).numel():
        raise ValueError(f"block_ids must be distinct for scatter, got {ids.tolist()}")
    shard = canonical_shard_shape(block_size, num_kv_heads, head_dim, layout)
    lead = (len(kv_caches), ids.numel()) if layer_major else (ids.numel(), len(kv_caches))
    want = (*lead, *shard)
    ref = kv_caches[0]
    if tuple(staging.shape) != want or staging.dtype != ref.dtype or staging.device != ref.device:
        raise ValueError(
            f"{name} must be {want} {ref.dtype} on {ref.device}, "
            f"got {tuple(staging.shape)} {staging.dtype} on {staging.device}"
        )
    return ids.to(ref.device), shape


def shard_contiguous(t: torch.Tensor) -> bool:
    """The dims after the first two are C-contiguous (first two strides are free)."""
    return t[0, 0].is_contiguous() if t.shape[0] and t.shape[1] else True


def scatter_blocks(
    blocks: torch.Tensor,
    kv_caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    layout: KVLayout,
    *,
    impl: Impl = "auto",
) -> None:
    """Write canonical ``blocks`` into blocks ``block_ids`` of every layer's paged KV (in place).

    Args:
        blocks: ``[n, num_layers, *shard]`` in the caches' dtype and device, shard ``[2, block_size, num_kv_heads,
            head_dim]`` (MLA ``[block_size, latent_dim]``); may be a strided view (copied when its shard dims are
            not contiguous).
        kv_caches: one contiguous paged KV tensor per layer in ``layout`` (see :func:`ucm.kernels.gather_blocks`).
        block_ids: int32/int64 ``[n]`` distinct vLLM block ids.
        layout: the paged layout.
        impl: ``"auto"`` (Triton on CUDA, the CPU fast path on CPU, torch elsewhere), ``"triton"``, ``"cpu"`` or
            ``"torch"``.

    Raises:
        TypeError: ``block_ids`` is not an int32/int64 tensor.
        ValueError: bad shapes, dtypes, devices, layout or ``impl``; repeated or out-of-range block ids. Nothing
            is written when an error is raised.
    """
    scatter_staged(blocks, kv_caches, block_ids, layout, impl, layer_major=False, name="blocks")


def scatter_staged(
    staging: torch.Tensor,
    kv_caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    layout: KVLayout,
    impl: str,
    layer_major: bool,
    name: str,
) -> None:
    """The body of :func:`scatter_blocks` (``layer_major=False``: ``staging`` is ``[n, num_layers, *shard]``) and
    of ``scatter_layers`` (``layer_major=True``: ``[num_layers, n, *shard]``): validate, then copy.

    Raises:
        TypeError / ValueError: as :func:`scatter_blocks` (``name`` names ``staging`` in messages).
    """
    ids, _ = check_scatter(staging, kv_caches, layout, block_ids, layer_major=layer_major, name=name)
    which = resolve_impl(impl, kv_caches[0].device)
    src = staging if shard_contiguous(staging) else staging.contiguous()
    copy_blocks(kv_caches, ids, layout, src.transpose(0, 1) if layer_major else src, gather=False, impl=which)


def scatter_blocks_reference(
    blocks: torch.Tensor, kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, layout: KVLayout
) -> None:
    """Naive oracle for :func:`scatter_blocks` (same arguments and effect; slow, for tests)."""
    ids, (_, block_size, num_kv_heads, head_dim) = check_scatter(
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
