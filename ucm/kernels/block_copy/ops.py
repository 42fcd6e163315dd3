"""The block-copy ops: validation, then dispatch by ``impl``.

- :func:`gather_blocks`: vLLM paged KV (all layers) -> canonical blocks ``[n, num_layers, *shard]`` (block-major).
- :func:`scatter_blocks`: canonical blocks -> paged KV (the inverse; block ids distinct).
- :func:`gather_layers` / :func:`scatter_layers`: the same copies with layer-major staging ``[num_layers, n,
  *shard]``, one contiguous buffer per layer (a layerwise dump or load moves one layer at a time).
- :func:`warm_up`: loads or compiles the kernels at start.

``shard`` is ``[2, block_size, num_kv_heads, head_dim]`` (MLA ``[block_size, latent_dim]``; see
``ucm.kernels.layouts``). Pure data movement: bytes are copied through integer views, so every implementation is
bit-exact for every dtype (bf16, fp16, fp32, fp8 as bytes), NaN payloads and -0.0 included. Gather and scatter are
one address map walked in opposite directions, so each implementation exists once, with a ``gather`` flag, and
layer-major staging is the block-major code on the transposed view.

Implementations (``impl=``, the vocabulary of ``ucm.kernels.utils``):

- ``"triton"``: one launch for all layers (``block_copy.triton``); the default on CUDA. On CPU tensors it runs in
  the Triton interpreter (tests only: slow).
- ``"cpu"``: the CPU fast path (``block_copy.cpu``: a ``memmove`` per contiguous run for FLASH_NHD and MLA; numba
  vector-tile transposes for CPU_ATTN and CPU_ATTN_AMX, ``block_copy.cpu_numba``); the default on CPU.
- ``"torch"``: strided torch copies (``block_copy.torch``), any device; the default on other devices.
- ``"reference"``: the naive loops of ``block_copy.naive`` (the test oracles).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ucm.kernels.block_copy.cpu import copy_cpu
from ucm.kernels.block_copy.naive import gather_blocks_reference, scatter_blocks_reference
from ucm.kernels.block_copy.torch import copy_torch
from ucm.kernels.block_copy.triton import copy_triton
from ucm.kernels.layouts import (
    KVLayout,
    alloc_or_check_out,
    canonical_shard_shape,
    check_block_ids,
    check_block_list,
    check_paged_caches,
    check_staging,
    int_view,
    shard_contiguous,
)
from ucm.kernels.utils import Impl, resolve_impl


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
        impl: ``"auto"`` (Triton on CUDA, the CPU fast path on CPU, torch elsewhere), ``"triton"``, ``"cpu"``,
            ``"torch"`` or ``"reference"`` (see the module doc).

    Returns:
        ``out`` (allocated if not given): ``[n, num_layers, *shard]``, KV dtype; the bytes of canonical blocks.

    Raises:
        TypeError: ``block_ids`` is not an int32/int64 tensor.
        ValueError: bad shapes, dtypes, devices, layout or ``impl``, or block ids out of ``[0, num_blocks)``.
    """
    return _gather(kv_caches, block_ids, layout, out, impl, layer_major=False)


def gather_layers(
    kv_caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    layout: KVLayout,
    out: torch.Tensor | None = None,
    *,
    impl: Impl = "auto",
) -> torch.Tensor:
    """Copy blocks ``block_ids`` of each layer's paged KV into that layer's contiguous staging buffer.

    ``gather_layers([cache], ids, layout)[0]`` stages one layer; passing all layers stages them all in one launch.
    ``out[l, i]`` is bit-identical to ``gather_blocks(...)[i, l]``.

    Args:
        kv_caches: one contiguous paged KV tensor per layer to stage (one or all), same shape/dtype/device, in
            ``layout`` (shapes as for :func:`gather_blocks`).
        block_ids: int32/int64 ``[n]`` vLLM block ids (repeats allowed).
        layout: the paged layout.
        out: optional contiguous ``[num_layers, n, *shard]`` tensor of the caches' dtype and device.
        impl: as for :func:`gather_blocks`.

    Returns:
        ``out`` (allocated if not given): ``[num_layers, n, *shard]``, KV dtype; ``out[l]`` is layer ``l``'s staging.

    Raises:
        TypeError: ``block_ids`` is not an int32/int64 tensor.
        ValueError: bad shapes, dtypes, devices, layout or ``impl``, or block ids out of ``[0, num_blocks)``.
    """
    return _gather(kv_caches, block_ids, layout, out, impl, layer_major=True)


def scatter_blocks(
    blocks: torch.Tensor | Sequence[torch.Tensor],
    kv_caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    layout: KVLayout,
    *,
    impl: Impl = "auto",
) -> None:
    """Write canonical ``blocks`` into blocks ``block_ids`` of every layer's paged KV (in place).

    Block ids must be distinct (two sources for one destination block is a caller bug, and the parallel
    implementations would race).

    Args:
        blocks: ``[n, num_layers, *shard]`` in the caches' dtype and device, shard ``[2, block_size, num_kv_heads,
            head_dim]`` (MLA ``[block_size, latent_dim]``); may be a strided view (copied when its shard dims are
            not contiguous). Or a sequence of ``n`` contiguous ``[num_layers, *shard]`` blocks, each anywhere in
            memory (the DRAM tier's slots): the CPU path reads each where it lies, in one call; the other
            implementations stack them into one tensor first.
        kv_caches: one contiguous paged KV tensor per layer in ``layout`` (see :func:`gather_blocks`).
        block_ids: int32/int64 ``[n]`` distinct vLLM block ids.
        layout: the paged layout.
        impl: as for :func:`gather_blocks`.

    Raises:
        TypeError: ``block_ids`` is not an int32/int64 tensor.
        ValueError: bad shapes, dtypes, devices, layout or ``impl``; repeated or out-of-range block ids. Nothing
            is written when an error is raised.
    """
    _scatter(blocks, kv_caches, block_ids, layout, impl, layer_major=False, name="blocks")


def scatter_layers(
    shards: torch.Tensor,
    kv_caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    layout: KVLayout,
    *,
    impl: Impl = "auto",
) -> None:
    """Write each layer's staged shards into blocks ``block_ids`` of that layer's paged KV (in place).

    ``shards[l, i]`` goes into block ``block_ids[i]`` of ``kv_caches[l]``. A layerwise load calls it with one layer
    (``shards[None]``, ``[cache]``) just before that layer's attention, or with all layers in one launch.

    Args:
        shards: ``[num_layers, n, *shard]`` in the caches' dtype and device (copied first if its shard dims are
            not contiguous).
        kv_caches: one contiguous paged KV tensor per layer in ``layout``, ``len(kv_caches) == num_layers``.
        block_ids, layout, impl: as for :func:`scatter_blocks`.

    Raises:
        TypeError / ValueError: as :func:`scatter_blocks`; nothing is written when an error is raised.
    """
    _scatter(shards, kv_caches, block_ids, layout, impl, layer_major=True, name="shards")


def warm_up(kv_caches: Sequence[torch.Tensor], layout: KVLayout, *, impl: Impl = "auto") -> None:
    """Compile, or load from the on-disk cache, the kernels that gathers and scatters on ``kv_caches`` run, by
    gathering block 0 of every layer into a scratch buffer (``kv_caches`` is not written).

    The CPU path's first call in a process imports numba and loads or compiles its kernel; call this at start so
    that cost does not land on the first request's TTFT.

    Raises:
        ValueError: as :func:`gather_blocks` (bad shapes, dtypes, devices, layout or ``impl``).
    """
    if kv_caches:
        gather_blocks(kv_caches, torch.zeros(1, dtype=torch.int64, device=kv_caches[0].device), layout, impl=impl)


def _gather(
    kv_caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    layout: KVLayout,
    out: torch.Tensor | None,
    impl: str,
    layer_major: bool,
) -> torch.Tensor:
    """The body of :func:`gather_blocks` (``layer_major=False``: ``out`` is ``[n, num_layers, *shard]``) and of
    :func:`gather_layers` (``layer_major=True``: ``[num_layers, n, *shard]``): validate, allocate, copy."""
    num_blocks, block_size, num_kv_heads, head_dim = check_paged_caches(kv_caches, layout)
    device = kv_caches[0].device
    which = resolve_impl(impl, device, op="gather_layers" if layer_major else "gather_blocks")
    ids = check_block_ids(block_ids, num_blocks).to(device)
    shard = canonical_shard_shape(block_size, num_kv_heads, head_dim, layout)
    lead = (len(kv_caches), ids.numel()) if layer_major else (ids.numel(), len(kv_caches))
    out = alloc_or_check_out(out, (*lead, *shard), kv_caches[0])
    staging = out.transpose(0, 1) if layer_major else out
    if which == "reference":
        int_view(staging).copy_(int_view(gather_blocks_reference(kv_caches, ids, layout)))
    else:
        copy_blocks(kv_caches, ids, layout, staging, gather=True, impl=which)
    return out


def _scatter(
    staging: torch.Tensor | Sequence[torch.Tensor],
    kv_caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    layout: KVLayout,
    impl: str,
    layer_major: bool,
    name: str,
) -> None:
    """The body of :func:`scatter_blocks` (``layer_major=False``: ``staging`` is ``[n, num_layers, *shard]``) and
    of :func:`scatter_layers` (``layer_major=True``: ``[num_layers, n, *shard]``): validate, then copy. A sequence
    of blocks (block-major only) goes to the CPU path as it is, to the others stacked."""
    if not isinstance(staging, torch.Tensor):
        blocks = list(staging)
        ids, _ = check_block_list(blocks, kv_caches, layout, block_ids, name)
        which = resolve_impl(impl, kv_caches[0].device, op="scatter_blocks")
        if not blocks:
            return
        if which == "cpu":
            copy_blocks(kv_caches, ids, layout, blocks, gather=False, impl=which)
            return
        staging = torch.stack(blocks)
    ids, _ = check_staging(staging, kv_caches, layout, block_ids, layer_major=layer_major, name=name)
    which = resolve_impl(impl, kv_caches[0].device, op="scatter_layers" if layer_major else "scatter_blocks")
    src = staging if shard_contiguous(staging) else staging.contiguous()
    src = src.transpose(0, 1) if layer_major else src
    if which == "reference":
        scatter_blocks_reference(src, kv_caches, ids, layout)
    else:
        copy_blocks(kv_caches, ids, layout, src, gather=False, impl=which)


def copy_blocks(
    kv_caches: Sequence[torch.Tensor],
    ids: torch.Tensor,
    layout: KVLayout,
    staging: torch.Tensor | Sequence[torch.Tensor],
    gather: bool,
    impl: str,
) -> None:
    """Move every layer's shard of blocks ``ids`` between ``kv_caches`` and ``staging`` (already validated): the
    call every implementation module's ``copy_*`` takes.

    Args:
        kv_caches: per-layer paged KV tensors (contiguous, same shape/dtype/device).
        ids: int64 ``[n]`` block ids on the caches' device, in range (distinct when scattering).
        layout: the paged layout.
        staging: ``[n, num_layers, *shard]`` view, same dtype and device, shard dims contiguous; for ``impl="cpu"``
            also a sequence of ``n`` contiguous ``[num_layers, *shard]`` blocks.
        gather: True: paged -> staging; False: staging -> paged.
        impl: a resolved implementation (``triton``, ``cpu`` or ``torch``).
    """
    if ids.numel() == 0:
        return
    if impl == "cpu":
        copy_cpu(kv_caches, ids, layout, staging, gather)
        return
    if not isinstance(staging, torch.Tensor):
        raise ValueError(f"a sequence of staging blocks needs impl='cpu', got {impl!r}")
    if impl == "triton":
        copy_triton(kv_caches, ids, layout, staging, gather)
    else:
        copy_torch(kv_caches, ids, layout, staging, gather)
