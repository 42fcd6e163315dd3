"""The key-bounds kernels in torch (``impl="torch"``, any device; also what ``impl="cpu"`` runs: no faster CPU code
exists). Formulas in ``ucm.kernels.key_bounds.ops``; inputs as the ops validated them."""

from __future__ import annotations

import torch

from ucm.kernels.paged_keys import block_keys


def summaries_torch(
    keys: torch.Tensor, block_ids: torch.Tensor, counts: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor
) -> None:
    """Vectorized masked ``amin`` / ``amax`` over the blocks' tokens, written into rows ``block_ids`` of the tables."""
    k = block_keys(keys, block_ids).float()  # [n, H, bs, D]
    bs = k.shape[2]
    filled = (torch.arange(bs, device=k.device)[None, :] < counts.to(k.device)[:, None])[:, None, :, None]
    kmin.index_copy_(0, block_ids, torch.where(filled, k, float("inf")).amin(dim=2))
    kmax.index_copy_(0, block_ids, torch.where(filled, k, float("-inf")).amax(dim=2))


def scores_torch(
    q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, block_table: torch.Tensor, num_blocks: torch.Tensor
) -> torch.Tensor:
    """Gather the blocks' bounds and take the bound per channel as two batched matmuls (below)."""
    # max(q*lo, q*hi) = q*(hi+lo)/2 + |q|*(hi-lo)/2 per channel, so the sum over channels is two batched matmuls
    # (the same bound up to fp32 rounding; faster on CPU than the elementwise form).
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
