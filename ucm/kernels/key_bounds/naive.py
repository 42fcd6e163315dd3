"""Naive references of the key-bounds kernels (``impl="reference"``; the test oracles): one block, or one request
and head, at a time. Formulas in ``ucm.kernels.key_bounds.ops``."""

from __future__ import annotations

import torch

from ucm.kernels.paged_keys import block_keys, key_geometry


def block_summaries_reference(
    keys: torch.Tensor, block_ids: torch.Tensor, counts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Test oracle of ``block_summaries``: ``(kmin, kmax)``, each float32 ``[n, num_kv_heads, head_dim]`` on CPU,
    one block at a time (``keys`` plain or tiled, as ``block_summaries`` takes them)."""
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


def block_scores_reference(
    q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, block_table: torch.Tensor, num_blocks: torch.Tensor
) -> torch.Tensor:
    """Test oracle of ``block_scores``: the same float32 ``[R, num_heads, W]`` bounds on CPU, one request and head
    at a time."""
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
