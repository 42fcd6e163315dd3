"""KV cache layouts UCM moves data between, the canonical block, and the checks every op runs on paged caches, block
ids and staging buffers (shared by all kernel packages).

Canonical block (what a store holds, independent of the attention backend)::

    block[num_layers, 2, block_size, num_kv_heads, head_dim]      # [layer][K=0 | V=1][token][head][dim]
    block[num_layers, block_size, latent_dim]                     # MLA: one latent per token, no K/V split

in the model's KV dtype, C-contiguous; as bytes, one row of ``block_nbytes`` in a ``uint8`` staging tensor. One
layer's part of it (``[2, block_size, num_kv_heads, head_dim]``, MLA ``[block_size, latent_dim]``) is a *shard*:
the unit a layerwise load or dump moves.

vLLM layouts (one tensor per attention layer):

- ``KVLayout.CPU_ATTN``: vLLM's CPU backend (``CPU_ATTN``, kernel variants ``vec`` and ``vec16``). Shape
  ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``, but that shape is only storage: for each
  (block, kv head) memory holds K transposed ``[head_dim, block_size]`` then V ``[block_size, head_dim]``.
  Verified against ``torch.ops._C.cpu_attn_reshape_and_cache`` (vLLM 0.32).
- ``KVLayout.CPU_ATTN_AMX``: the same backend's ``amx`` kernel variant (bf16 models on CPUs with AMX tiles). Same
  tensor shape and the same per-(block, kv head) split into a K region of ``block_size * head_dim`` elements then
  a V region; inside each region the elements sit in the VNNI tiles AMX reads, two bf16 values per 32-bit word
  (:func:`amx_offsets`)::

      K[t, d] at (t // 16) * (16 * head_dim) + (d // 2) * 32 + (t % 16) * 2 + d % 2      (K region)
      V[t, d] at (d // 16) * (16 * block_size) + (t // 2) * 32 + (d % 16) * 2 + t % 2    (V region)

  i.e. K is 16-token tiles of ``[head_dim / 2, 16 tokens, 2 dims]`` and V is 16-dim tiles of ``[block_size / 2,
  16 dims, 2 tokens]``. Verified bit for bit against vLLM 0.32's own writes (``cpu_attn_reshape_and_cache(...,
  "amx")``, captured on an AMX Xeon). 2-byte dtypes only, ``block_size`` and ``head_dim`` multiples of 32 (vLLM
  picks ``amx`` only for bf16 with ``block_size % 32 == 0``; a ``head_dim`` not a multiple of 32 gets ``vec16``).
- ``KVLayout.FLASH_NHD``: FlashAttention and Triton backends, ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
- ``KVLayout.MLA``: multi-head latent attention (DeepSeek-style), ``[num_blocks, block_size, latent_dim]``. For MLA,
  ``num_kv_heads`` is 1 and ``head_dim`` means ``latent_dim`` in the helpers below.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch


class KVLayout(str, enum.Enum):
    """Memory layout of vLLM's paged KV cache, per attention layer."""

    CPU_ATTN = "cpu_attn"
    CPU_ATTN_AMX = "cpu_attn_amx"
    FLASH_NHD = "flash_nhd"
    MLA = "mla"


# The layouts of vLLM's CPU backend: one tensor shape, ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``.
CPU_LAYOUTS = (KVLayout.CPU_ATTN, KVLayout.CPU_ATTN_AMX)
AMX_TILE = 16  # CPU_ATTN_AMX: tokens per K tile, dims per V tile
AMX_PACK = 2  # CPU_ATTN_AMX: bf16 values per 32-bit VNNI word (K: 2 dims of one token; V: 2 tokens of one dim)
AMX_MULTIPLE = 32  # CPU_ATTN_AMX: block_size and head_dim must be multiples of this

# Copies run on same-width integer views so they are bit-exact (NaN payloads, -0.0) and work for fp8 too.
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def int_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as the signed/unsigned integer dtype of the same width (no copy).

    Raises:
        TypeError: ``t``'s element size has no integer dtype (e.g. complex128).
    """
    size = t.element_size()
    if size not in _INT_VIEW:
        raise TypeError(f"no integer view for element size {size} bytes (dtype {t.dtype})")
    return t.view(_INT_VIEW[size])


def paged_shape(layout: KVLayout, cache: torch.Tensor) -> tuple[int, int, int, int]:
    """``(num_blocks, block_size, num_kv_heads, head_dim)`` of one layer's paged KV tensor
    (MLA: ``(num_blocks, block_size, 1, latent_dim)``).

    Raises:
        ValueError: ``cache`` does not have the rank/shape of ``layout``, or is not contiguous.
    """
    if not cache.is_contiguous():
        raise ValueError(f"paged KV tensor must be contiguous (layout {layout.value}, shape {tuple(cache.shape)})")
    if layout in CPU_LAYOUTS:
        if cache.dim() != 4 or cache.shape[3] % 2:
            raise ValueError(
                f"{layout.name} KV must be [num_blocks, num_kv_heads, block_size, 2*head_dim], got {tuple(cache.shape)}"
            )
        nb, h, bs, two_d = cache.shape
        if layout == KVLayout.CPU_ATTN_AMX:
            check_amx_geometry(cache.element_size(), bs, two_d // 2)
        return nb, bs, h, two_d // 2
    if layout == KVLayout.FLASH_NHD:
        if cache.dim() != 5 or cache.shape[0] != 2:
            raise ValueError(
                f"FLASH_NHD KV must be [2, num_blocks, block_size, num_kv_heads, head_dim], got {tuple(cache.shape)}"
            )
        _, nb, bs, h, d = cache.shape
        return nb, bs, h, d
    if layout == KVLayout.MLA:
        if cache.dim() != 3:
            raise ValueError(f"MLA KV must be [num_blocks, block_size, latent_dim], got {tuple(cache.shape)}")
        nb, bs, d = cache.shape
        return nb, bs, 1, d
    raise ValueError(f"unknown KV layout {layout!r}; allowed: {[m.value for m in KVLayout]}")


def paged_dims(cache: torch.Tensor, layout: KVLayout) -> tuple[int, int, int, int]:
    """:func:`paged_shape` of a tensor already validated, without the checks (the kernels' hot path)."""
    if layout in CPU_LAYOUTS:
        nb, h, bs, two_d = cache.shape
        return nb, bs, h, two_d // 2
    if layout == KVLayout.FLASH_NHD:
        _, nb, bs, h, d = cache.shape
        return nb, bs, h, d
    nb, bs, d = cache.shape
    return nb, bs, 1, d


def check_paged_caches(kv_caches: Sequence[torch.Tensor], layout: KVLayout) -> tuple[int, int, int, int]:
    """Validate that all layers share one dtype, device and shape; return ``paged_shape`` of the first.

    Raises:
        ValueError: no layers, or layers differ in shape, dtype or device.
    """
    if len(kv_caches) == 0:
        raise ValueError("kv_caches is empty: need one paged KV tensor per layer")
    first = kv_caches[0]
    shape = paged_shape(layout, first)
    for i, c in enumerate(kv_caches):
        if c.shape != first.shape or c.dtype != first.dtype or c.device != first.device:
            raise ValueError(
                f"layer {i} KV is {tuple(c.shape)} {c.dtype} on {c.device}; layer 0 is "
                f"{tuple(first.shape)} {first.dtype} on {first.device}: all layers must match"
            )
        paged_shape(layout, c)
    return shape


def check_amx_geometry(element_size: int, block_size: int, head_dim: int) -> None:
    """Check that a CPU_ATTN_AMX cache can have this element size and shape.

    Raises:
        ValueError: not 2-byte elements, or ``block_size`` / ``head_dim`` not a multiple of ``AMX_MULTIPLE``.
    """
    if element_size != 2:
        raise ValueError(
            f"CPU_ATTN_AMX packs two 16-bit values per 32-bit word: element size must be 2 bytes (bf16), got "
            f"{element_size}"
        )
    if block_size % AMX_MULTIPLE or head_dim % AMX_MULTIPLE:
        raise ValueError(
            f"CPU_ATTN_AMX needs block_size and head_dim multiples of {AMX_MULTIPLE}, got block_size={block_size}, "
            f"head_dim={head_dim}"
        )


def amx_offsets(block_size: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where CPU_ATTN_AMX puts each token's K and V inside one (block, kv head): int64 ``[block_size, head_dim]``
    element offsets of ``K[t, d]`` within the K region and of ``V[t, d]`` within the V region (the formulas in the
    module doc; the K region is the first ``block_size * head_dim`` elements of the (block, head), V the next)."""
    t = torch.arange(block_size, dtype=torch.int64)[:, None]
    d = torch.arange(head_dim, dtype=torch.int64)[None, :]
    n, p = AMX_TILE, AMX_PACK
    k = (t // n) * (n * head_dim) + (d // p) * (n * p) + (t % n) * p + d % p
    v = (d // n) * (n * block_size) + (t // p) * (n * p) + (d % n) * p + t % p
    return k, v


def cpu_attn_kv_views(cache: torch.Tensor, layout: KVLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one CPU layer tensor ``[num_blocks, num_kv_heads, block_size, 2*head_dim]`` (CPU_ATTN or
    CPU_ATTN_AMX) as views of its memory (no copy) whose dims, read in order, are canonical ``[num_blocks,
    block_size, num_kv_heads, head_dim]``, with ``block_size`` and ``head_dim`` split where the layout tiles them:

    - CPU_ATTN: ``k`` and ``v`` are ``[num_blocks, block_size, num_kv_heads, head_dim]`` (``k`` strided: K is stored
      transposed);
    - CPU_ATTN_AMX: ``k`` is ``[num_blocks, block_size / 16, 16, num_kv_heads, head_dim / 2, 2]`` and ``v`` is
      ``[num_blocks, block_size / 2, 2, num_kv_heads, head_dim / 16, 16]``.

    So ``canonical_part.view(n, *k.shape[1:])`` (a ``[n, block_size, num_kv_heads, head_dim]`` K or V part with
    contiguous dims) lines up element for element with ``k[block_ids]``.

    Raises:
        ValueError: ``layout`` is not a CPU layout, or ``cache`` does not fit it.
    """
    if layout not in CPU_LAYOUTS:
        raise ValueError(f"layout must be one of {[lay.value for lay in CPU_LAYOUTS]}, got {layout!r}")
    paged_shape(layout, cache)
    num_blocks, num_kv_heads, block_size, two_d = cache.shape
    head_dim = two_d // 2
    halves = cache.view(num_blocks, num_kv_heads, 2, block_size * head_dim)
    k, v = halves[:, :, 0], halves[:, :, 1]  # [nb, H, bs * D] regions
    if layout == KVLayout.CPU_ATTN:
        k = k.unflatten(-1, (head_dim, block_size)).permute(0, 3, 1, 2)  # K^T [nb, H, D, bs] -> [nb, bs, H, D]
        v = v.unflatten(-1, (block_size, head_dim)).transpose(1, 2)  # [nb, H, bs, D] -> [nb, bs, H, D]
        return k, v
    n, p = AMX_TILE, AMX_PACK
    # K region [bs/16, D/2, 16, 2] (token tile, dim pair, token, dim) -> [bs/16, 16, H, D/2, 2]
    k = k.unflatten(-1, (block_size // n, head_dim // p, n, p)).permute(0, 2, 4, 1, 3, 5)
    # V region [D/16, bs/2, 16, 2] (dim tile, token pair, dim, token) -> [bs/2, 2, H, D/16, 16]
    v = v.unflatten(-1, (head_dim // n, block_size // p, n, p)).permute(0, 3, 5, 1, 2, 4)
    return k, v


def canonical_shard_shape(
    block_size: int, num_kv_heads: int, head_dim: int, layout: KVLayout | None = None
) -> tuple[int, ...]:
    """Shape of one layer's shard of a canonical block: ``(2, block_size, num_kv_heads, head_dim)``; for
    ``layout=KVLayout.MLA`` ``(block_size, head_dim)`` (``head_dim`` = latent_dim).

    Raises:
        ValueError: MLA with ``num_kv_heads != 1``.
    """
    if layout == KVLayout.MLA:
        if num_kv_heads != 1:
            raise ValueError(f"MLA has one latent per token: num_kv_heads must be 1, got {num_kv_heads}")
        return (block_size, head_dim)
    return (2, block_size, num_kv_heads, head_dim)


def canonical_block_shape(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, layout: KVLayout | None = None
) -> tuple[int, ...]:
    """Shape of one canonical block: ``(num_layers, 2, block_size, num_kv_heads, head_dim)``; for
    ``layout=KVLayout.MLA`` ``(num_layers, block_size, head_dim)`` (``head_dim`` = latent_dim).

    Raises:
        ValueError: MLA with ``num_kv_heads != 1``.
    """
    return (num_layers, *canonical_shard_shape(block_size, num_kv_heads, head_dim, layout))


def check_block_ids(block_ids: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """Validate vLLM block ids: 1-D integer tensor, each in ``[0, num_blocks)``; returned as int64 on CPU.

    Repeated ids are allowed for gather (the same block is copied twice) and rejected by scatter.

    Raises:
        TypeError: not an integer tensor.
        ValueError: not 1-D, or an id outside ``[0, num_blocks)``.
    """
    if not isinstance(block_ids, torch.Tensor) or block_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"block_ids must be an int32/int64 tensor, got {getattr(block_ids, 'dtype', type(block_ids))}")
    if block_ids.dim() != 1:
        raise ValueError(f"block_ids must be 1-D, got shape {tuple(block_ids.shape)}")
    ids = block_ids.to(torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(f"block_ids must be in [0, {num_blocks}), got min {int(ids.min())} max {int(ids.max())}")
    return ids


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


def check_staging(
    staging: torch.Tensor,
    kv_caches: Sequence[torch.Tensor],
    layout: KVLayout,
    block_ids: torch.Tensor,
    layer_major: bool,
    name: str,
) -> tuple[torch.Tensor, tuple[int, int, int, int]]:
    """Validate a scatter of ``staging`` into blocks ``block_ids`` of ``kv_caches``; return the ids (int64, on the
    caches' device) and the paged shape.

    ``staging`` must be ``[n, num_layers, *shard]`` (``layer_major``: ``[num_layers, n, *shard]``) in the caches'
    dtype and device with contiguous shard dims (``name`` names it in messages).

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


def check_block_list(
    blocks: Sequence[torch.Tensor],
    kv_caches: Sequence[torch.Tensor],
    layout: KVLayout,
    block_ids: torch.Tensor,
    name: str,
) -> tuple[torch.Tensor, tuple[int, int, int, int]]:
    """Validate a scatter of separate canonical ``blocks`` (each ``[num_layers, *shard]``, contiguous, in the caches'
    dtype and device; ``len(blocks) == block_ids.numel()``) into blocks ``block_ids`` of ``kv_caches``; return the
    ids (int64, on the caches' device) and the paged shape (``name`` names the blocks in messages).

    Raises:
        TypeError: ``block_ids`` is not an int32/int64 tensor.
        ValueError: bad shapes, dtypes, devices, layout or contiguity; a count other than the ids'; block ids out of
            range or repeated.
    """
    shape = check_paged_caches(kv_caches, layout)
    num_blocks, block_size, num_kv_heads, head_dim = shape
    ids = check_block_ids(block_ids, num_blocks)
    if ids.numel() != torch.unique(ids).numel():
        raise ValueError(f"block_ids must be distinct for scatter, got {ids.tolist()}")
    if len(blocks) != ids.numel():
        raise ValueError(f"{name}: {len(blocks)} blocks for {ids.numel()} block ids")
    want = (len(kv_caches), *canonical_shard_shape(block_size, num_kv_heads, head_dim, layout))
    ref = kv_caches[0]
    for i, b in enumerate(blocks):
        if tuple(b.shape) != want or b.dtype != ref.dtype or b.device != ref.device or not b.is_contiguous():
            raise ValueError(
                f"{name}[{i}] must be a contiguous {want} {ref.dtype} on {ref.device}, got {tuple(b.shape)} "
                f"{b.dtype} on {b.device}{'' if b.is_contiguous() else ' (not contiguous)'}"
            )
    return ids.to(ref.device), shape


def shard_contiguous(t: torch.Tensor) -> bool:
    """The dims after the first two are C-contiguous (first two strides are free)."""
    return t[0, 0].is_contiguous() if t.shape[0] and t.shape[1] else True
