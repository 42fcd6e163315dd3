"""GSA's keep rule in torch ops (``impl="torch"``, any device): :func:`aggregate_scores` and :func:`keep_mask`, which
``ucm.sparse.selection.ops`` composes with ``ucm.sparse.base.compact_block_table``; also the pieces the other
scorings' selection in ``ucm.sparse.gsa`` reuses."""

from __future__ import annotations

import torch

from ucm.config import GSAConfig


def kept_blocks(num_blocks: torch.Tensor, cfg: GSAConfig) -> torch.Tensor:
    """Blocks kept per row (int64 ``[R]``) for rows of ``num_blocks`` blocks: all below ``min_blocks``, else
    ``clamp(ceil(sparse_ratio * n), init_window_sz + local_window_sz, n)``."""
    n = num_blocks.long()
    # ceil with a small slack so that 0.3 * 10 (= 3.0000000000000004 in binary) keeps 3 blocks, not 4.
    budget = torch.ceil(n.double() * cfg.sparse_ratio - 1e-9).long()
    k = torch.minimum(budget.clamp(min=cfg.init_window_sz + cfg.local_window_sz), n)
    return torch.where(n < cfg.min_blocks, n, k)


def aggregate_scores(ub: torch.Tensor, scale: float) -> torch.Tensor:
    """Block scores float32 ``[R, W]`` from per-head bounds ``ub`` ``[R, num_heads, W]`` (``-inf`` = no block):
    the per-head softmax over blocks of ``scale * ub``, summed over heads; ``-inf`` where ``ub`` is ``-inf``."""
    valid = torch.isfinite(ub[:, 0])  # [R, W]
    p = torch.softmax(ub * scale, dim=-1)  # rows with no block at all give NaN, masked below
    return torch.where(valid, p.sum(dim=1), float("-inf"))


def keep_mask(scores: torch.Tensor, num_blocks: torch.Tensor, cfg: GSAConfig) -> torch.Tensor:
    """Bool ``[R, W]``: the blocks GSA keeps given block scores ``[R, W]`` (``ucm.sparse.gsa``'s module doc, step
    3)."""
    r, w = scores.shape
    n = num_blocks.long()
    k = kept_blocks(n, cfg)
    cols = torch.arange(w, device=scores.device)[None, :]
    forced = (cols < cfg.init_window_sz) | (cols >= (n - cfg.local_window_sz)[:, None])
    inside = cols < n[:, None]
    ranked = torch.where(forced, float("inf"), scores.float()).masked_fill(~inside, float("-inf"))
    # Rank every column (stable: ties go to the earlier block), keep the top k of each row.
    order = torch.sort(-ranked, dim=1, stable=True).indices
    rank = torch.empty_like(order).scatter_(1, order, cols.expand(r, w).contiguous())
    return (rank < k[:, None]) & inside
