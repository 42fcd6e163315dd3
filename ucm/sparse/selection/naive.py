"""Naive reference of GSA's keep rule (``impl="reference"``; the test oracle): one row at a time, in plain Python over
per-row torch softmaxes."""

from __future__ import annotations

import math

import torch

from ucm.config import GSAConfig


def keep_mask_reference(
    head_scores: torch.Tensor, temperature: float, num_blocks: torch.Tensor, cfg: GSAConfig
) -> torch.Tensor:
    """Test oracle of the keep rule: bool ``[S, W]`` on CPU, the blocks each row keeps given its per-head scores
    ``head_scores`` float32 ``[S, num_heads, W]`` and ``num_blocks`` int ``[S]`` blocks (``ucm.sparse.gsa``'s
    module doc, steps 2-3: per head a softmax over the row's blocks of ``temperature * scores``, summed over heads;
    the ``init_window_sz`` first and ``local_window_sz`` last blocks forced; the best others, ties to the earlier
    block, up to ``kept_blocks``; every block of a row below ``min_blocks``)."""
    s, _, width = head_scores.shape
    keep = torch.zeros((s, width), dtype=torch.bool)
    for r in range(s):
        n = min(int(num_blocks[r]), width)
        chosen = set(range(n))
        if n >= cfg.min_blocks:
            x = head_scores[r, :, :n].float().cpu() * temperature  # [HQ, n]
            mass = torch.softmax(x, dim=-1).sum(dim=0).tolist()  # per head over blocks, summed over heads
            k = min(max(math.ceil(n * cfg.sparse_ratio - 1e-9), cfg.init_window_sz + cfg.local_window_sz), n)
            forced = set(range(min(cfg.init_window_sz, n))) | set(range(max(0, n - cfg.local_window_sz), n))
            others = sorted((w for w in range(n) if w not in forced), key=lambda w: (-mass[w], w))
            chosen = forced | set(others[: k - len(forced)])
        keep[r, sorted(chosen)] = True
    return keep
