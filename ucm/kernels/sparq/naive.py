"""Naive references of the SparQ ops (``impl="reference"``; the test oracles): one request, head and block at a
time. Definitions in ``ucm.kernels.sparq.ops``."""

from __future__ import annotations

import torch

from ucm.kernels.paged_keys import block_keys, key_geometry


def sparq_query_reference(
    query: torch.Tensor, num_kv_heads: int, channels: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Test oracle of ``sparq_query``: ``(q_r, idx)``, float32 ``[R, num_heads, C]`` and int64 ``[R, num_kv_heads,
    C]`` on CPU, one row and KV head at a time; components of equal ``|q|`` in ascending order."""
    r, hq, d = query.shape
    group = hq // num_kv_heads
    c = max(1, min(channels, d))
    q_r = torch.empty((r, hq, c), dtype=torch.float32)
    idx = torch.empty((r, num_kv_heads, c), dtype=torch.int64)
    for i in range(r):
        for h in range(num_kv_heads):
            heads = query[i, h * group : (h + 1) * group].float().cpu()  # [group, D]
            magnitude = heads.abs().sum(0).tolist()  # |q| per component, summed over the KV head's query heads
            kept = sorted(range(d), key=lambda x: (-magnitude[x], x))[:c]
            idx[i, h] = torch.tensor(kept)
            for g in range(group):
                values = heads[g, kept]
                share = values.abs().sum() / heads[g].abs().sum().clamp_min(1e-30)  # the |q| the components keep
                q_r[i, h * group + g] = values * (scale / share.clamp_min(1e-30).sqrt())
    return q_r, idx


def sparq_block_lse_reference(
    q: torch.Tensor, channels: torch.Tensor, keys: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor
) -> torch.Tensor:
    """Test oracle of ``sparq_block_lse``: the same float32 ``[R, num_heads, W]`` log-sum-exps on CPU, one request,
    head and block at a time (``keys`` plain or tiled)."""
    r, hq, _ = q.shape
    _, h, bs, _ = key_geometry(keys)
    group = hq // h
    out = torch.full((r, hq, block_table.shape[1]), float("-inf"), dtype=torch.float32)
    for i in range(r):
        length = int(seq_lens[i])
        for w in range(-(-length // bs)):
            count = min(bs, length - w * bs)
            block = block_keys(keys, [int(block_table[i, w])])[0]  # [H, bs, D]
            for j in range(hq):
                k = block[j // group, :count][:, channels[i, j // group]].float()  # [count, C]
                out[i, j, w] = torch.logsumexp(k @ q[i, j], dim=0)
    return out
