"""gather_blocks: vLLM paged KV (all layers) -> canonical blocks, for a list of vLLM block ids.

Reads, for each block id in ``block_ids`` and each layer ``l``, that block's shard out of ``kv_caches[l]`` (in
``layout``) and writes it to ``out[i, l]`` in canonical order ``[2, block_size, num_kv_heads, head_dim]`` (MLA
``[block_size, latent_dim]``; see ``ucm.kernels.layouts``). Pure data movement: bytes are copied through integer
views, so the result is bit-exact for every dtype (bf16, fp16, fp32, fp8 as bytes), NaN payloads and -0.0 included.

Implementations, all with identical results (``impl=``):
- ``"triton"``: one launch of ``ucm.kernels._block_copy._block_copy_kernel`` for all layers; the default on CUDA.
  On CPU tensors it runs in the Triton interpreter (tests only: slow).
- ``"cpu"``: the CPU fast path (a ``memmove`` per contiguous run; numba vector-tile transposes for CPU_ATTN and
  CPU_ATTN_AMX); the default on CPU.
- ``"torch"``: strided torch copies, any device; the default on devices other than CPU and CUDA.
- :func:`gather_blocks_reference`: the test oracle, looping over blocks, layers and heads.
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


def alloc_or_check_out(out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """``out`` after checking it is a ``shape`` tensor of ``like``'s dtype and device whose shard dims (all but the
    two leading ones) are contiguous, or a new contiguous one. The two leading dims may have any strides: e.g.
    ``staging[:, l : l + 1]`` of a block-major buffer, to gather one layer into it.

    Raises:
        ValueError: ``out`` has another shape, dtype or device, or its shard dims are not contiguous.
    """
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if tuple(out.shape) != shape or out.dtype != like.dtype or out.device != like.device:
        raise ValueError(
            f"out must be {shape} {like.dtype} on {like.device}, got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    if out.numel() and not out[0, 0].is_contiguous():
        raise ValueError(f"out's shard dims must be contiguous, got strides {tuple(out.stride())}")
    return out


def gather_blocks(
    kv_caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    layout: KVLayout,
    out: torch.Tensor | None = None,
    *,
    impl: Impl = "auto",
) -> torch.Tensor:
    """Copy blocks ``block_ids`` of every layer's paged KV into canonical blocks.

    Args:
        kv_caches: one contiguous paged KV tensor per layer, all the same shape/dtype/device, in ``layout``
            (CPU_ATTN and CPU_ATTN_AMX ``[num_blocks, num_kv_heads, block_size, 2*head_dim]``; FLASH_NHD
            ``[2, num_blocks, block_size, num_kv_heads, head_dim]``; MLA ``[num_blocks, block_size, latent_dim]``).
            Any dtype (bf16, fp16, fp32, fp8, ...): elements are moved as same-width integers.
        block_ids: int32/int64 ``[n]`` vLLM block ids, on any device (repeats allowed: the block is copied again).
        layout: the paged layout.
        out: optional ``[n, num_layers, *shard]`` tensor of the caches' dtype and device, where shard is
            ``[2, block_size, num_kv_heads, head_dim]`` (MLA ``[block_size, latent_dim]``); the shard dims must be
            contiguous, the leading two may be strided (``staging[:, l : l + 1]`` gathers layer ``l`` of a
            ``[n, num_layers, *shard]`` staging buffer from ``kv_caches=[cache_l]``).
        impl: ``"auto"`` (Triton on CUDA, the CPU fast path on CPU, torch elsewhere), ``"triton"``, ``"cpu"`` or
            ``"torch"``.

    Returns:
        ``out`` (allocated if not given): ``[n, num_layers, *shard]``, KV dtype; the bytes of canonical blocks.

    Raises:
        TypeError: ``block_ids`` is not an int32/int64 tensor.
        ValueError: bad shapes, dtypes, devices, layout or ``impl``, or block ids out of ``[0, num_blocks)``.
    """
    return gather_staged(kv_caches, block_ids, layout, out, impl, layer_major=False)


def warm_up(kv_caches: Sequence[torch.Tensor], layout: KVLayout, *, impl: Impl = "auto") -> None:
    """Compile, or load from the on-disk cache, the kernels that gathers and scatters on ``kv_caches`` run, by
    gathering block 0 of every layer into a scratch buffer (``kv_caches`` is not written).

    The CPU path's numba kernels take 0.7-1.2 s on their first call in a process (importing numba, loading or
    compiling the kernel); call this at start so that cost does not land on the first request's TTFT.

    Raises:
        ValueError: as :func:`gather_blocks` (bad shapes, dtypes, devices, layout or ``impl``).
    """
    if kv_caches:
        gather_blocks(kv_caches, torch.zeros(1, dtype=torch.int64, device=kv_caches[0].device), layout, impl=impl)


def gather_staged(
    kv_caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    layout: KVLayout,
    out: torch.Tensor | None,
    impl: str,
    layer_major: bool,
) -> torch.Tensor:
    """The body of :func:`gather_blocks` (``layer_major=False``: ``out`` is ``[n, num_layers, *shard]``) and of
    ``gather_layers`` (``layer_major=True``: ``[num_layers, n, *shard]``): validate, allocate, copy.

    Raises:
        TypeError / ValueError: as :func:`gather_blocks`.
    """
    num_blocks, block_size, num_kv_heads, head_dim = check_paged_caches(kv_caches, layout)
    device = kv_caches[0].device
    which = resolve_impl(impl, device)
    ids = check_block_ids(block_ids, num_blocks).to(device)
    shard = canonical_shard_shape(block_size, num_kv_heads, head_dim, layout)
    lead = (len(kv_caches), ids.numel()) if layer_major else (ids.numel(), len(kv_caches))
    out = alloc_or_check_out(out, (*lead, *shard), kv_caches[0])
    copy_blocks(kv_caches, ids, layout, out.transpose(0, 1) if layer_major else out, gather=True, impl=which)
    return out


def gather_blocks_reference(
    kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, layout: KVLayout
) -> torch.Tensor:
    """Naive oracle for :func:`gather_blocks` (same arguments and result; slow, for tests)."""
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
