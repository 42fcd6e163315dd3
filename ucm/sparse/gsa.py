"""GSA: block-sparse decode attention with per-block key bounds (training-free).

Summaries. Per KV block and KV head, the element-wise min and max of the block's (post-RoPE) keys, as in Quest
(Tang et al., 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference"). Chosen over the mean
key because it gives a true upper bound of ``q . k`` for every key in the block (a block with one strongly matching
key, a "needle", cannot hide behind its average), costs two vectors per block and head, and is exact to update (min
and max do not round). Computed by ``ucm.kernels.block_summaries``.

Selection at decode, per request and layer (one block set for all heads of the layer, since a paged-attention
kernel takes one block table per request):
1. ``ub[j, w]``: Quest's upper bound of ``q_j . k`` over block ``w``, for every query head ``j`` against its KV
   head's bounds (grouped-query heads share them) -- ``ucm.kernels.block_scores``;
2. per head, ``p[j, :] = softmax(scale * ub[j, :])`` over the request's blocks: an estimate of the share of head
   ``j``'s attention each block would get; the block score is ``sum_j p[j, w]``, the estimated attention mass over
   all heads of the layer (normalizing per head first keeps one head with large logits from deciding alone);
3. keep ``k = clamp(ceil(sparse_ratio * n), init_window_sz + local_window_sz, n)`` blocks: the first
   ``init_window_sz`` (attention sinks), the last ``local_window_sz`` (recent context; the last holds the current
   token), and the best-scoring others. Requests with fewer than ``min_blocks`` blocks stay dense, as does prefill
   (the wrapper only hands one-query rows to :meth:`GSA.select`).
"""

from __future__ import annotations

import math

import torch

from ucm.config import GSAConfig
from ucm.kernels.block_scores import block_scores, block_scores_reference
from ucm.kernels.block_summaries import block_summaries
from ucm.sparse.base import BlockSummaries, Selection, SparseMethod, compact_block_table


class KeyBounds(BlockSummaries):
    """Per-block key bounds of one layer: ``kmin``/``kmax`` float32 ``[num_blocks, num_kv_heads, head_dim]``."""

    def __init__(self, num_blocks: int, num_kv_heads: int, head_dim: int, device: torch.device, impl: str) -> None:
        super().__init__(num_blocks, device)
        self.impl = impl
        self.kmin = torch.zeros((num_blocks, num_kv_heads, head_dim), dtype=torch.float32, device=device)
        self.kmax = torch.zeros_like(self.kmin)

    def _compute(self, keys: torch.Tensor, block_ids: torch.Tensor, counts: torch.Tensor) -> None:
        block_summaries(keys, block_ids, counts, self.kmin, self.kmax, impl=self.impl)


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
    """Bool ``[R, W]``: the blocks GSA keeps given block scores ``[R, W]`` (see the module doc, step 3)."""
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


class GSA(SparseMethod):
    """GSA block selection (see the module doc).

    Args:
        cfg: ``ucm_sparse_config.GSA``.
        impl: kernel implementation for summaries and scores (``"auto"``: Triton on CUDA, torch otherwise;
            ``"triton"``, ``"torch"``, or ``"reference"``: the test oracles).
    """

    name = "GSA"

    def __init__(self, cfg: GSAConfig, impl: str = "auto") -> None:
        if impl not in ("auto", "triton", "torch", "reference"):
            raise ValueError(f"impl must be one of ['auto', 'triton', 'torch', 'reference'], got {impl!r}")
        self.cfg = cfg
        self.impl = impl

    def new_summaries(self, num_blocks: int, num_kv_heads: int, head_dim: int, device: torch.device) -> KeyBounds:
        """An all-stale :class:`KeyBounds` table for ``num_blocks`` blocks."""
        return KeyBounds(num_blocks, num_kv_heads, head_dim, device, "torch" if self.impl == "reference" else self.impl)

    def select(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        summaries: BlockSummaries,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> Selection:
        """See :meth:`SparseMethod.select`. Rows with fewer than ``min_blocks`` blocks keep all of them.

        Raises:
            TypeError: ``summaries`` is not a :class:`KeyBounds`.
        """
        if not isinstance(summaries, KeyBounds):
            raise TypeError(f"GSA needs KeyBounds summaries, got {type(summaries).__name__}")
        block_size = keys.shape[2]
        n = torch.div(seq_lens.long() + block_size - 1, block_size, rounding_mode="floor")
        sparse = n >= self.cfg.min_blocks
        keep = torch.ones(block_table.shape, dtype=torch.bool, device=block_table.device)
        if bool(sparse.any()):
            rows = sparse.nonzero().flatten()
            table, nb, lens = block_table[rows], n[rows], seq_lens[rows].long()
            cols = torch.arange(table.shape[1], device=table.device)[None, :]
            inside = cols < nb[:, None]
            counts = torch.where(cols == (nb - 1)[:, None], lens[:, None] - (nb - 1)[:, None] * block_size, block_size)
            summaries.refresh(keys, table[inside].long(), counts[inside])
            if self.impl == "reference":
                ub = block_scores_reference(query[rows], summaries.kmin, summaries.kmax, table, nb)
            else:
                ub = block_scores(query[rows], summaries.kmin, summaries.kmax, table, nb, impl=self.impl)
            keep[rows] = keep_mask(aggregate_scores(ub, scale), nb, self.cfg)
        return compact_block_table(block_table, seq_lens, keep, block_size)


def select_reference(
    query: torch.Tensor,
    keys: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    cfg: GSAConfig,
) -> list[list[int]]:
    """Test oracle: for each row, the kept vLLM block ids in token order, computed one row at a time from the keys
    (no summary table, no kernels): bounds by ``amin``/``amax``, per-head softmax, sum, sort."""
    block_size, h = keys.shape[2], keys.shape[1]
    out: list[list[int]] = []
    for r in range(block_table.shape[0]):
        length = int(seq_lens[r])
        n = math.ceil(length / block_size)
        ids = [int(b) for b in block_table[r, :n]]
        if n < cfg.min_blocks:
            out.append(ids)
            continue
        group = query.shape[1] // h
        mass = torch.zeros(n, dtype=torch.float32)
        for j in range(query.shape[1]):
            q = query[r, j].float()
            ub = torch.empty(n, dtype=torch.float32)
            for w, b in enumerate(ids):
                c = block_size if w < n - 1 else length - (n - 1) * block_size
                k = keys[b, j // group, :c].float()  # [c, D]
                ub[w] = torch.maximum(q * k.amin(0), q * k.amax(0)).sum()
            mass += torch.softmax(ub * scale, dim=0)
        k_keep = min(max(math.ceil(n * cfg.sparse_ratio - 1e-9), cfg.init_window_sz + cfg.local_window_sz), n)
        forced = set(range(min(cfg.init_window_sz, n))) | set(range(max(0, n - cfg.local_window_sz), n))
        others = sorted((w for w in range(n) if w not in forced), key=lambda w: (-float(mass[w]), w))
        chosen = sorted(forced | set(others[: k_keep - len(forced)]))
        out.append([ids[w] for w in chosen])
    return out
