"""block_summaries: per-block, per-KV-head element-wise min and max of the keys, read from vLLM's paged KV cache.

For each block id ``b = block_ids[i]`` and KV head ``h`` it writes::

    kmin[b, h, d] = min_{t < counts[i]} K[b, t, h, d]        kmax[b, h, d] = max_{t < counts[i]} K[b, t, h, d]

into summary tables ``kmin``/``kmax`` ``[num_blocks, num_kv_heads, head_dim]`` float32, indexed by vLLM block id (so
the tables live beside the paged cache and a block's summary is found from the block table). Tokens at or past
``counts[i]`` (the unfilled tail of a request's last block) are ignored. These are the block "key bounds" of Quest
(Tang et al., 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", section 3): with them,
``sum_d max(q_d * kmin_d, q_d * kmax_d)`` bounds ``q . k`` from above for every key of the block
(see ``ucm.kernels.block_scores``).

Min and max are exact in any precision (no rounding: every bf16/fp16 value is an fp32 value), so all
implementations agree bit for bit.

Keys are read in place from the paged cache, in either form of ``ucm.kernels.paged_keys`` (plain ``[num_blocks,
num_kv_heads, block_size, head_dim]``, or tiled for CPU_ATTN_AMX); every path addresses the tiled form.

Implementations (``impl=``): ``"triton"`` (one program per (block, head); the default on CUDA; the interpreter on
CPU tensors, tests only), ``"torch"`` (vectorized masked ``amin``/``amax``: the CPU path and the default elsewhere);
:func:`block_summaries_reference` is the test oracle (a loop over blocks).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ucm.kernels._block_copy import _interpreted
from ucm.kernels.paged_keys import block_keys, key_geometry, key_tiling

IMPLS = ("auto", "triton", "torch")


def _check(
    keys: torch.Tensor, block_ids: torch.Tensor, counts: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor
) -> None:
    nb, h, bs, d = key_geometry(keys)
    for name, t in (("kmin", kmin), ("kmax", kmax)):
        if tuple(t.shape) != (nb, h, d) or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous float32 [{nb}, {h}, {d}] table, got {tuple(t.shape)} {t.dtype}"
            )
        if t.device != keys.device:
            raise ValueError(f"{name} is on {t.device}, keys on {keys.device}: must be on one device")
    if block_ids.dim() != 1 or block_ids.dtype != torch.int64 or counts.shape != block_ids.shape:
        raise ValueError(
            f"block_ids must be int64 [n] and counts [n] of the same shape, got {block_ids.dtype} "
            f"{tuple(block_ids.shape)} and {tuple(counts.shape)}"
        )
    if block_ids.numel():
        lo, hi = int(block_ids.min()), int(block_ids.max())
        if lo < 0 or hi >= nb:
            raise ValueError(f"block_ids must lie in [0, {nb}), got values in [{lo}, {hi}]")
        cl, ch = int(counts.min()), int(counts.max())
        if cl < 1 or ch > bs:
            raise ValueError(f"counts must lie in [1, block_size={bs}], got values in [{cl}, {ch}]")


def block_summaries(
    keys: torch.Tensor,
    block_ids: torch.Tensor,
    counts: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    *,
    impl: str = "auto",
) -> None:
    """Write the key bounds of blocks ``block_ids`` (over their first ``counts`` tokens) into ``kmin``/``kmax``.

    Args:
        keys: paged keys (``ucm.kernels.paged_keys.paged_keys``), plain ``[num_blocks, num_kv_heads, block_size,
            head_dim]`` or tiled ``[num_blocks, num_kv_heads, block_size / TT, TT, head_dim / TD, TD]``, any
            strides, float16/bfloat16/float32.
        block_ids: int64 ``[n]`` vLLM block ids (distinct), same device.
        counts: integer ``[n]``, tokens filled in each block, in ``[1, block_size]``.
        kmin, kmax: float32 ``[num_blocks, num_kv_heads, head_dim]`` tables; rows ``block_ids`` are overwritten.
        impl: ``"auto"`` (Triton on CUDA, torch otherwise), ``"triton"`` or ``"torch"``.

    Raises:
        ValueError: bad shapes (keys neither plain nor tiled), dtypes, devices, out-of-range ids or counts, or
            unknown ``impl``.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {list(IMPLS)}, got {impl!r}")
    _check(keys, block_ids, counts, kmin, kmax)
    if block_ids.numel() == 0:
        return
    if impl == "auto":
        impl = "triton" if keys.device.type == "cuda" else "torch"
    if impl == "triton":
        _summaries_triton(keys, block_ids, counts, kmin, kmax)
    else:
        _summaries_torch(keys, block_ids, counts, kmin, kmax)


def block_summaries_reference(
    keys: torch.Tensor, block_ids: torch.Tensor, counts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Test oracle: ``(kmin, kmax)``, each float32 ``[n, num_kv_heads, head_dim]``, one block at a time (``keys``
    plain or tiled, as :func:`block_summaries`)."""
    outs_min, outs_max = [], []
    for b, c in zip(block_ids.tolist(), counts.tolist(), strict=True):
        k = block_keys(keys, [b])[0, :, :c].float()  # [H, c, D]
        outs_min.append(k.amin(dim=1))
        outs_max.append(k.amax(dim=1))
    _, h, _, d = key_geometry(keys)
    if not outs_min:
        empty = torch.empty((0, h, d), dtype=torch.float32)
        return empty, empty.clone()
    return torch.stack(outs_min), torch.stack(outs_max)


def _summaries_torch(
    keys: torch.Tensor, block_ids: torch.Tensor, counts: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor
) -> None:
    k = block_keys(keys, block_ids).float()  # [n, H, bs, D]
    bs = k.shape[2]
    filled = (torch.arange(bs, device=k.device)[None, :] < counts.to(k.device)[:, None])[:, None, :, None]
    kmin.index_copy_(0, block_ids, torch.where(filled, k, float("inf")).amin(dim=2))
    kmax.index_copy_(0, block_ids, torch.where(filled, k, float("-inf")).amax(dim=2))


@triton.jit
def _block_summaries_kernel(
    k_ptr,  # paged keys, tiled: element (b, h, t, d) at b*stride_b + h*stride_h + (t // TILE_T)*stride_tile_t
    #         + (t % TILE_T)*stride_t + (d // TILE_D)*stride_tile_d + (d % TILE_D)*stride_d
    ids_ptr,  # [n] int64 block ids
    counts_ptr,  # [n] int64 tokens filled per block
    kmin_ptr,  # [num_blocks, H, D] float32
    kmax_ptr,  # [num_blocks, H, D] float32
    stride_b,
    stride_h,
    stride_tile_t,
    stride_t,
    stride_tile_d,
    stride_d,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_T: tl.constexpr,  # tokens per token tile (block_size for plain keys)
    TILE_D: tl.constexpr,  # components per component group (head_dim for plain keys)
    BLOCK_T: tl.constexpr,  # next power of two >= BLOCK_SIZE
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM
):
    i = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.load(ids_ptr + i).to(tl.int64)
    count = tl.load(counts_ptr + i)
    o_t = tl.arange(0, BLOCK_T).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D).to(tl.int64)
    m_d = o_d < HEAD_DIM
    m_td = ((o_t < count) & (o_t < BLOCK_SIZE))[:, None] & m_d[None, :]  # [BT, BD]
    o_kt = (o_t // TILE_T) * stride_tile_t + (o_t % TILE_T) * stride_t  # [BT] token offsets
    o_kd = (o_d // TILE_D) * stride_tile_d + (o_d % TILE_D) * stride_d  # [BD] component offsets
    p_k = k_ptr + b * stride_b + h * stride_h + o_kt[:, None] + o_kd[None, :]
    b_k = tl.load(p_k, mask=m_td, other=0.0).to(tl.float32)  # [BT, BD]
    b_min = tl.min(tl.where(m_td, b_k, float("inf")), axis=0)  # [BD]
    b_max = tl.max(tl.where(m_td, b_k, float("-inf")), axis=0)
    o_out = (b * NUM_HEADS + h) * HEAD_DIM + o_d
    tl.store(kmin_ptr + o_out, b_min, mask=m_d)
    tl.store(kmax_ptr + o_out, b_max, mask=m_d)


def summaries_kernel_meta(block_size: int, head_dim: int, tile_tokens: int, tile_dims: int) -> dict[str, int]:
    """The constexprs of ``_block_summaries_kernel`` derived from the shape and the keys' tiling (``TT``, ``TD`` of
    ``ucm.kernels.paged_keys.key_tiling``; also used by the sm_90 compile test)."""
    return {
        "BLOCK_T": triton.next_power_of_2(block_size),
        "BLOCK_D": triton.next_power_of_2(head_dim),
        "TILE_T": tile_tokens,
        "TILE_D": tile_dims,
    }


def _summaries_triton(
    keys: torch.Tensor, block_ids: torch.Tensor, counts: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor
) -> None:
    _, h, bs, d = key_geometry(keys)
    strides, tile_tokens, tile_dims = key_tiling(keys)
    grid = (block_ids.numel(), h)
    kernel = _interpreted(_block_summaries_kernel) if keys.device.type == "cpu" else _block_summaries_kernel
    kernel[grid](
        keys,
        block_ids,
        counts.to(torch.int64),
        kmin,
        kmax,
        *strides,
        NUM_HEADS=h,
        HEAD_DIM=d,
        BLOCK_SIZE=bs,
        num_warps=1 if os.environ.get("TRITON_INTERPRET") == "1" else 4,
        **summaries_kernel_meta(bs, d, tile_tokens, tile_dims),
    )
