"""The key-bounds kernels in Triton (``impl="triton"``, the default on CUDA; the interpreter on CPU tensors, tests
only): ``block_summaries_kernel``, one program per (block, KV head); ``block_scores_kernel``, grid ``(requests,
query heads, block chunks)``. Formulas in ``ucm.kernels.key_bounds.ops``; one config each, chosen from the shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ucm.kernels.paged_keys import key_geometry, key_tiling
from ucm.kernels.utils import launchable, num_warps


@triton.jit
def block_summaries_kernel(
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
    """The constexprs of ``block_summaries_kernel`` derived from the shape and the keys' tiling (``TT``, ``TD`` of
    ``ucm.kernels.paged_keys.key_tiling``; also used by the sm_90 compile test)."""
    return {
        "BLOCK_T": triton.next_power_of_2(block_size),
        "BLOCK_D": triton.next_power_of_2(head_dim),
        "TILE_T": tile_tokens,
        "TILE_D": tile_dims,
    }


def summaries_triton(
    keys: torch.Tensor, block_ids: torch.Tensor, counts: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor
) -> None:
    _, h, bs, d = key_geometry(keys)
    strides, tile_tokens, tile_dims = key_tiling(keys)
    grid = (block_ids.numel(), h)
    launchable(block_summaries_kernel, keys.device)[grid](
        keys,
        block_ids,
        counts.to(torch.int64),
        kmin,
        kmax,
        *strides,
        NUM_HEADS=h,
        HEAD_DIM=d,
        BLOCK_SIZE=bs,
        num_warps=num_warps(),
        **summaries_kernel_meta(bs, d, tile_tokens, tile_dims),
    )


@triton.jit
def block_scores_kernel(
    q_ptr,  # [R, HQ, D] contiguous
    kmin_ptr,  # [num_blocks, H, D] float32 contiguous
    kmax_ptr,
    table_ptr,  # [R, W] block ids
    nblocks_ptr,  # [R] blocks in use per row
    out_ptr,  # [R, HQ, W] float32
    stride_table,
    W,
    HQ: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64)
    c = tl.program_id(2).to(tl.int64)
    h = j // (HQ // NUM_KV_HEADS)
    n = tl.load(nblocks_ptr + r).to(tl.int64)
    o_w = c * BLOCK_W + tl.arange(0, BLOCK_W).to(tl.int64)  # [BW]
    o_d = tl.arange(0, BLOCK_D).to(tl.int64)  # [BD]
    m_d = o_d < HEAD_DIM
    m_w = o_w < n
    b_q = tl.load(q_ptr + (r * HQ + j) * HEAD_DIM + o_d, mask=m_d, other=0.0).to(tl.float32)  # [BD]
    b_ids = tl.load(table_ptr + r * stride_table + o_w, mask=m_w, other=0).to(tl.int64)  # [BW]
    o_k = (b_ids * NUM_KV_HEADS + h)[:, None] * HEAD_DIM + o_d[None, :]  # [BW, BD]
    m_k = m_w[:, None] & m_d[None, :]
    b_lo = tl.load(kmin_ptr + o_k, mask=m_k, other=0.0)
    b_hi = tl.load(kmax_ptr + o_k, mask=m_k, other=0.0)
    b_ub = tl.sum(tl.maximum(b_q[None, :] * b_lo, b_q[None, :] * b_hi), axis=1)  # [BW]
    b_ub = tl.where(m_w, b_ub, float("-inf"))
    tl.store(out_ptr + (r * HQ + j) * W + o_w, b_ub, mask=o_w < W)


def scores_kernel_meta(head_dim: int) -> dict[str, int]:
    """The constexprs of ``block_scores_kernel`` chosen from the shape (also used by the sm_90 compile test)."""
    block_d = triton.next_power_of_2(head_dim)
    return {"BLOCK_D": block_d, "BLOCK_W": max(16, 8192 // block_d)}  # ~8K fp32 of each bound per program


def scores_triton(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    block_table: torch.Tensor,
    num_blocks: torch.Tensor,
    out: torch.Tensor,
) -> None:
    r, hq, d = q.shape
    w = block_table.shape[1]
    meta = scores_kernel_meta(d)
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    grid = (r, hq, triton.cdiv(w, meta["BLOCK_W"]))
    launchable(block_scores_kernel, q.device)[grid](
        q.contiguous(),
        kmin.contiguous(),
        kmax.contiguous(),
        block_table,
        num_blocks,
        out,
        block_table.stride(0),
        w,
        HQ=hq,
        NUM_KV_HEADS=kmin.shape[1],
        HEAD_DIM=d,
        num_warps=num_warps(),
        **meta,
    )
