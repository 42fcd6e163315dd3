"""Key bounds (Quest): per-block key summaries and the upper bounds of ``q . k`` they give, for GSA's ``key_bounds``
scoring (``ucm.sparse.gsa``): validation, then dispatch by ``impl``.

:func:`block_summaries` writes, for each block id ``b = block_ids[i]`` and KV head ``h``::

    kmin[b, h, d] = min_{t < counts[i]} K[b, t, h, d]        kmax[b, h, d] = max_{t < counts[i]} K[b, t, h, d]

into summary tables ``kmin``/``kmax`` ``[num_blocks, num_kv_heads, head_dim]`` float32, indexed by vLLM block id (so
the tables live beside the paged cache and a block's summary is found from the block table). Tokens at or past
``counts[i]`` (the unfilled tail of a request's last block) are ignored. These are the block "key bounds" of Quest
(Tang et al., 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", section 3). Min and max
are exact in any precision (no rounding: every bf16/fp16 value is an fp32 value), so all implementations agree bit
for bit. Keys are read in place from the paged cache, in either form of ``ucm.kernels.paged_keys`` (plain
``[num_blocks, num_kv_heads, block_size, head_dim]``, or tiled for CPU_ATTN_AMX); every path addresses the tiled form.

:func:`block_scores` gives, for request ``r``, query head ``j`` (KV head ``h = j // (num_heads / num_kv_heads)``, the
grouped-query mapping) and the ``w``-th block of its block table (``b = block_table[r, w]``, ``w < num_blocks[r]``)::

    ub[r, j, w] = sum_d max(q[r, j, d] * kmin[b, h, d], q[r, j, d] * kmax[b, h, d])

which is ``>= q . k`` for every key ``k`` of block ``b`` whose elements lie between ``kmin`` and ``kmax`` (Quest,
section 3.2: the per-channel max of the two products bounds that channel's contribution). Entries ``w >=
num_blocks[r]`` are ``-inf``. The sum over ``head_dim`` is an fp32 reduction whose order differs between
implementations; results agree to fp32 rounding (tests use a tolerance), not bit for bit.

Implementations (``impl=``, the vocabulary of ``ucm.kernels.utils``):

- ``"triton"``: ``key_bounds.triton``; the default on CUDA; the interpreter on CPU tensors (tests only).
- ``"cpu"`` and ``"torch"``: the torch code of ``key_bounds.torch`` (vectorized masked ``amin``/``amax``; gather and
  two batched matmuls): no faster CPU code exists, so ``"cpu"`` (the default on CPU) runs it too.
- ``"reference"``: the loops of ``key_bounds.naive`` (the test oracles).
"""

from __future__ import annotations

import torch

from ucm.kernels.key_bounds.naive import block_scores_reference, block_summaries_reference
from ucm.kernels.key_bounds.torch import scores_torch, summaries_torch
from ucm.kernels.key_bounds.triton import scores_triton, summaries_triton
from ucm.kernels.paged_keys import key_geometry
from ucm.kernels.utils import Impl, resolve_impl


def block_summaries(
    keys: torch.Tensor,
    block_ids: torch.Tensor,
    counts: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    *,
    impl: Impl = "auto",
) -> None:
    """Write the key bounds of blocks ``block_ids`` (over their first ``counts`` tokens) into ``kmin``/``kmax``.

    Args:
        keys: paged keys (``ucm.kernels.paged_keys.paged_keys``), plain ``[num_blocks, num_kv_heads, block_size,
            head_dim]`` or tiled ``[num_blocks, num_kv_heads, block_size / TT, TT, head_dim / TD, TD]``, any
            strides, float16/bfloat16/float32.
        block_ids: int64 ``[n]`` vLLM block ids (distinct), same device.
        counts: integer ``[n]``, tokens filled in each block, in ``[1, block_size]``.
        kmin, kmax: float32 ``[num_blocks, num_kv_heads, head_dim]`` tables; rows ``block_ids`` are overwritten.
        impl: ``"auto"`` (Triton on CUDA, torch code otherwise), ``"triton"``, ``"cpu"``, ``"torch"`` or
            ``"reference"`` (see the module doc).

    Raises:
        ValueError: bad shapes (keys neither plain nor tiled), dtypes, devices, out-of-range ids or counts, or
            unknown ``impl``.
    """
    which = resolve_impl(impl, keys.device, op="block_summaries")
    _check_summaries(keys, block_ids, counts, kmin, kmax)
    if block_ids.numel() == 0:
        return
    if which == "triton":
        summaries_triton(keys, block_ids, counts, kmin, kmax)
    elif which == "reference":
        lo, hi = block_summaries_reference(keys, block_ids, counts)
        kmin.index_copy_(0, block_ids, lo.to(kmin.device))
        kmax.index_copy_(0, block_ids, hi.to(kmax.device))
    else:  # "cpu" and "torch": the torch code
        summaries_torch(keys, block_ids, counts, kmin, kmax)


def block_scores(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    block_table: torch.Tensor,
    num_blocks: torch.Tensor,
    *,
    impl: Impl = "auto",
) -> torch.Tensor:
    """Upper bounds of ``q . k`` per block: float32 ``[R, num_heads, W]`` (``-inf`` past each row's blocks).

    Args:
        q: ``[R, num_heads, head_dim]`` one query per request (decode), float16/bfloat16/float32, post-RoPE.
        kmin, kmax: float32 ``[num_blocks_total, num_kv_heads, head_dim]`` key bounds by vLLM block id.
        block_table: int32/int64 ``[R, W]`` vLLM block ids of each request, in token order.
        num_blocks: integer ``[R]``, blocks in use per row (``<= W``); entries past it are not read.
        impl: ``"auto"`` (Triton on CUDA, torch code otherwise), ``"triton"``, ``"cpu"``, ``"torch"`` or
            ``"reference"`` (see the module doc).

    Raises:
        ValueError: bad shapes, dtypes or devices, or unknown ``impl``.
    """
    which = resolve_impl(impl, q.device, op="block_scores")
    _check_scores(q, kmin, kmax, block_table, num_blocks)
    r, hq, _ = q.shape
    w = block_table.shape[1]
    if which == "triton":
        out = torch.empty((r, hq, w), dtype=torch.float32, device=q.device)
        if out.numel():
            scores_triton(q, kmin, kmax, block_table, num_blocks, out)
        return out
    if which == "reference":
        return block_scores_reference(q, kmin, kmax, block_table, num_blocks).to(q.device)
    return scores_torch(q, kmin, kmax, block_table, num_blocks)  # "cpu" and "torch": the torch code


def _check_summaries(
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


def _check_scores(
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
