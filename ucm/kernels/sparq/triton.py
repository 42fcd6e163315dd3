"""The SparQ block log-sum-exp in Triton (``impl="triton"``, the default on CUDA; the interpreter on CPU tensors,
tests only): one program per (request, KV head, block), all query heads of the KV head at once, so a block is read
once and finished in one pass. The component count is a constexpr (one compilation per ``score_channels``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ucm.kernels.paged_keys import key_geometry, key_tiling
from ucm.kernels.utils import launchable, num_warps


@triton.jit
def sparq_lse_kernel(
    q_ptr,  # [R, HQ, C] float32 contiguous
    ch_ptr,  # [R, NUM_KV_HEADS, C] int64 contiguous
    k_ptr,  # paged keys, tiled: (b, h, t, c) at b*stride_kb + h*stride_kh + (t // TILE_T)*stride_ktt
    #         + (t % TILE_T)*stride_kt + (c // TILE_D)*stride_kdd + (c % TILE_D)*stride_kd
    table_ptr,  # [R, W] block ids
    lens_ptr,  # [R] tokens per request
    out_ptr,  # [R, HQ, W] float32
    stride_kb,
    stride_kh,
    stride_ktt,
    stride_kt,
    stride_kdd,
    stride_kd,
    stride_table,
    W,
    C: tl.constexpr,  # components per KV head: a constexpr, so the loop over them has a static bound
    HQ: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_T: tl.constexpr,  # tokens per token tile (block_size for plain keys)
    TILE_D: tl.constexpr,  # components per component group (head_dim for plain keys)
    BLOCK_G: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    w = tl.program_id(2).to(tl.int64)
    group: tl.constexpr = HQ // NUM_KV_HEADS
    count = tl.load(lens_ptr + r).to(tl.int64) - w * BLOCK_SIZE  # tokens of this block inside the request
    o_g = tl.arange(0, BLOCK_G).to(tl.int64)
    o_t = tl.arange(0, BLOCK_T).to(tl.int64)
    m_g = o_g < group
    m_t = (o_t < BLOCK_SIZE) & (o_t < count)
    b = tl.load(table_ptr + r * stride_table + w, mask=count > 0, other=0).to(tl.int64)
    heads = r * HQ + h * group + o_g  # [BG] rows of q and out
    p_t = k_ptr + b * stride_kb + h * stride_kh + (o_t // TILE_T) * stride_ktt + (o_t % TILE_T) * stride_kt  # [BT]
    s = tl.zeros((BLOCK_G, BLOCK_T), dtype=tl.float32)
    for i in range(C):
        c = tl.load(ch_ptr + (r * NUM_KV_HEADS + h) * C + i).to(tl.int64)
        o_c = (c // TILE_D) * stride_kdd + (c % TILE_D) * stride_kd
        k = tl.load(p_t + o_c, mask=m_t, other=0.0).to(tl.float32)  # [BT]: one key component
        qc = tl.load(q_ptr + heads * C + i, mask=m_g, other=0.0)  # [BG]
        s += qc[:, None] * k[None, :]
    s = tl.where(m_t[None, :], s, float("-inf"))
    m = tl.max(s, axis=1)  # [BG]; -inf for a block past the request
    m_safe = tl.where(m > float("-inf"), m, 0.0)
    lse = m_safe + tl.log(tl.sum(tl.exp(s - m_safe[:, None]), axis=1))  # log(0) = -inf past the request
    tl.store(out_ptr + heads * W + w, lse, mask=m_g)


def sparq_kernel_meta(
    num_heads: int, num_kv_heads: int, block_size: int, tile_tokens: int, tile_dims: int, num_channels: int
) -> dict[str, int]:
    """The constexprs of ``sparq_lse_kernel`` chosen from the shape, the keys' tiling (``TT``, ``TD`` of
    ``ucm.kernels.paged_keys.key_tiling``) and the components read per KV head (also used by the sm_90 compile
    test). The component count is a constexpr (one compilation per ``score_channels``): with a runtime bound, the
    Triton interpreter converts a 1-element array to an int, which numpy 2.5 refuses."""
    return {
        "C": num_channels,
        "HQ": num_heads,
        "NUM_KV_HEADS": num_kv_heads,
        "BLOCK_SIZE": block_size,
        "TILE_T": tile_tokens,
        "TILE_D": tile_dims,
        "BLOCK_G": triton.next_power_of_2(num_heads // num_kv_heads),
        "BLOCK_T": triton.next_power_of_2(block_size),
    }


def lse_triton(
    q: torch.Tensor,
    channels: torch.Tensor,
    keys: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Launch ``sparq_lse_kernel`` into ``out`` (float32 ``[R, num_heads, W]``, not empty)."""
    r, hq, c = q.shape
    _, h, bs, _ = key_geometry(keys)
    strides, tile_tokens, tile_dims = key_tiling(keys)
    w = block_table.shape[1]
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    launchable(sparq_lse_kernel, q.device)[(r, h, w)](
        q.contiguous(),
        channels.contiguous(),
        keys,
        block_table,
        seq_lens,
        out,
        *strides,
        block_table.stride(0),
        w,
        num_warps=num_warps(),
        **sparq_kernel_meta(hq, h, bs, tile_tokens, tile_dims, c),
    )
