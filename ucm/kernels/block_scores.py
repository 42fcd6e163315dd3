"""block_scores: Quest upper bounds of ``q . k`` per (request, query head, block), from per-block key bounds.

For request ``r``, query head ``j`` (KV head ``h = j // (num_heads / num_kv_heads)``, the grouped-query mapping) and
the ``w``-th block of its block table (``b = block_table[r, w]``, ``w < num_blocks[r]``)::

    ub[r, j, w] = sum_d max(q[r, j, d] * kmin[b, h, d], q[r, j, d] * kmax[b, h, d])

which is ``>= q . k`` for every key ``k`` of block ``b`` whose elements lie between ``kmin`` and ``kmax`` (Tang et al.,
2024, "Quest", section 3.2: the per-channel max of the two products bounds that channel's contribution).
Entries ``w >= num_blocks[r]`` are ``-inf``. ``kmin``/``kmax`` come from ``ucm.kernels.block_summaries``.

The sum over ``head_dim`` is an fp32 reduction whose order differs between implementations; results agree to fp32
rounding (tests use a tolerance), not bit for bit.

Implementations (``impl=``): ``"triton"`` (grid ``(requests, query heads, block chunks)``; the default on CUDA;
the interpreter on CPU tensors, tests only) and ``"torch"`` (gather + broadcast: the CPU path);
:func:`block_scores_reference` is the oracle (loops over requests and heads).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ucm.kernels._block_copy import _interpreted

IMPLS = ("auto", "triton", "torch")


def _check(
    q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, block_table: torch.Tensor, num_blocks: torch.Tensor
) -> None:
    if q.dim() != 3 or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q must be float16/bfloat16/float32 [R, num_heads, head_dim], got {q.dtype} {tuple(q.shape)}")
    r, hq, d = q.shape
    if kmin.dim() != 3 or kmin.shape != kmax.shape or kmin.dtype != torch.float32 or kmax.dtype != torch.float32:
        raise ValueError(
            f"kmin/kmax must be float32 [num_blocks, num_kv_heads, head_dim], got {kmin.dtype} {tuple(kmin.shape)} "
            f"and {kmax.dtype} {tuple(kmax.shape)}"
        )
    _, h, dk = kmin.shape
    if dk != d:
        raise ValueError(f"head_dim of q ({d}) and of the key bounds ({dk}) differ")
    if hq % h:
        raise ValueError(f"num_heads ({hq}) must be a multiple of num_kv_heads ({h})")
    if block_table.dim() != 2 or block_table.shape[0] != r or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"block_table must be int32/int64 [{r}, W], got {block_table.dtype} {tuple(block_table.shape)}"
        )
    if num_blocks.shape != (r,):
        raise ValueError(f"num_blocks must be [{r}], got {tuple(num_blocks.shape)}")
    if r and (int(num_blocks.min()) < 0 or int(num_blocks.max()) > block_table.shape[1]):
        raise ValueError(f"num_blocks must lie in [0, {block_table.shape[1]}] (the block table's width)")
    for name, t in (("kmin", kmin), ("kmax", kmax), ("block_table", block_table), ("num_blocks", num_blocks)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}: must be on one device")


def block_scores(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    block_table: torch.Tensor,
    num_blocks: torch.Tensor,
    *,
    impl: str = "auto",
) -> torch.Tensor:
    """Upper bounds of ``q . k`` per block: float32 ``[R, num_heads, W]`` (``-inf`` past each row's blocks).

    Args:
        q: ``[R, num_heads, head_dim]`` one query per request (decode), float16/bfloat16/float32, post-RoPE.
        kmin, kmax: float32 ``[num_blocks_total, num_kv_heads, head_dim]`` key bounds by vLLM block id.
        block_table: int32/int64 ``[R, W]`` vLLM block ids of each request, in token order.
        num_blocks: integer ``[R]``, blocks in use per row (``<= W``); entries past it are not read.
        impl: ``"auto"`` (Triton on CUDA, torch otherwise), ``"triton"`` or ``"torch"``.

    Raises:
        ValueError: bad shapes, dtypes or devices, or unknown ``impl``.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {list(IMPLS)}, got {impl!r}")
    _check(q, kmin, kmax, block_table, num_blocks)
    if impl == "auto":
        impl = "triton" if q.device.type == "cuda" else "torch"
    r, hq, _ = q.shape
    w = block_table.shape[1]
    if impl == "triton":
        out = torch.empty((r, hq, w), dtype=torch.float32, device=q.device)
        if out.numel():
            _scores_triton(q, kmin, kmax, block_table, num_blocks, out)
        return out
    return _scores_torch(q, kmin, kmax, block_table, num_blocks)


def block_scores_reference(
    q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, block_table: torch.Tensor, num_blocks: torch.Tensor
) -> torch.Tensor:
    """Test oracle: the same ``[R, num_heads, W]`` bounds, one request and head at a time."""
    r, hq, _ = q.shape
    group = hq // kmin.shape[1]
    out = torch.full((r, hq, block_table.shape[1]), float("-inf"), dtype=torch.float32)
    for i in range(r):
        n = int(num_blocks[i])
        ids = block_table[i, :n].long()
        for j in range(hq):
            qj = q[i, j].float()  # [D]
            lo, hi = kmin[ids, j // group], kmax[ids, j // group]  # [n, D]
            out[i, j, :n] = torch.maximum(qj * lo, qj * hi).sum(dim=-1)
    return out


def _scores_torch(
    q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, block_table: torch.Tensor, num_blocks: torch.Tensor
) -> torch.Tensor:
    # max(q*lo, q*hi) = q*(hi+lo)/2 + |q|*(hi-lo)/2 per channel, so the sum over channels is two batched matmuls
    # (the same bound up to fp32 rounding; 5-10x faster on CPU than the elementwise form at 64 blocks).
    r, hq, d = q.shape
    h = kmin.shape[1]
    w = block_table.shape[1]
    valid = torch.arange(w, device=q.device)[None, :] < num_blocks[:, None]  # [R, W]
    ids = torch.where(valid, block_table.long(), 0)
    lo, hi = kmin[ids], kmax[ids]  # [R, W, H, D]
    center = ((hi + lo) * 0.5).permute(0, 2, 3, 1)  # [R, H, D, W]
    radius = ((hi - lo) * 0.5).permute(0, 2, 3, 1)
    qf = q.float().view(r, h, hq // h, d)  # [R, H, G, D]
    ub = (torch.matmul(qf, center) + torch.matmul(qf.abs(), radius)).view(r, hq, w)  # [R, Hq, W]
    return ub.masked_fill(~valid[:, None, :], float("-inf"))


@triton.jit
def _block_scores_kernel(
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
    """The constexprs of ``_block_scores_kernel`` chosen from the shape (also used by the sm_90 compile test)."""
    block_d = triton.next_power_of_2(head_dim)
    return {"BLOCK_D": block_d, "BLOCK_W": max(16, 8192 // block_d)}  # ~8K fp32 of each bound per program


def _scores_triton(
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
    kernel = _interpreted(_block_scores_kernel) if q.device.type == "cpu" else _block_scores_kernel
    kernel[grid](
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
        num_warps=1 if os.environ.get("TRITON_INTERPRET") == "1" else 4,
        **meta,
    )
