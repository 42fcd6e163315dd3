"""The CacheBlend ops in torch (``impl="torch"``, any device; also the CPU path, ``impl="cpu"``), and the host-side
cos/sin tables the Triton kernel reads too. Definitions in ``ucm.kernels.blend.ops``."""

from __future__ import annotations

import torch

from ucm.kernels.blend.naive import recompute_count
from ucm.kernels.rerope.torch import rope_cos_sin, rotate_with

# Tokens per chunk of the torch paths: bounds their float32 temporaries (8 MiB each at 8 heads of 128 channels).
CHUNK_TOKENS = 2048


def delta_cos_sin(
    delta: torch.Tensor, rotary_dim: int, base: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of RoPE's angles ``delta[t] * base ** (-2 i / rotary_dim)``, computed on the host in float64 and
    rounded once to float32: two contiguous float32 ``[num_tokens, rotary_dim / 2]`` tables on ``device``. Both the
    torch path and the Triton kernel read these tables, so they rotate by the same float32 values whatever the
    device's ``cos``."""
    cos, sin = rope_cos_sin(delta.cpu().to(torch.float64), rotary_dim, base)  # [T, 1, half] each
    return cos[:, 0].to(device), sin[:, 0].to(device)


def rope_delta_torch(keys: torch.Tensor, delta: torch.Tensor, rotary_dim: int, base: float, neox: bool) -> None:
    """:func:`ucm.kernels.blend.rope_delta_` in torch ops: for the tokens whose delta is not 0 (the others are not
    written), take their first ``rotary_dim`` channels, rotate them in float32 (``x * cos + rotate_half(x) * sin``,
    ``ucm.kernels.rerope.torch.rotate_with``), round to the key dtype and write them back, in chunks of
    :data:`CHUNK_TOKENS` tokens. The cos/sin tables are computed once per distinct delta (a stored chunk moves all
    its tokens by one delta) and are the values :func:`delta_cos_sin` gives per token; when every token moves, the
    channels are rotated where they lie (no gather, no scatter)."""
    moved = delta != 0
    rows = torch.nonzero(moved).flatten().to(keys.device)
    if rows.numel() == 0:
        return
    distinct, which = torch.unique(delta[moved], return_inverse=True)
    cos, sin = delta_cos_sin(distinct, rotary_dim, base, keys.device)  # [U, half] each
    which = which.to(keys.device)
    every = rows.numel() == keys.shape[0]
    rotated_part = keys[:, :, :rotary_dim]  # a view: writes land in keys
    for start in range(0, rows.numel(), CHUNK_TOKENS):
        part = slice(start, start + CHUNK_TOKENS)
        if distinct.numel() == 1:
            c, s = cos[:, None, :], sin[:, None, :]  # [1, 1, half]: broadcast over the tokens
        else:
            c, s = cos[which[part]][:, None, :], sin[which[part]][:, None, :]
        if every and neox:  # in place, half by half: x1 * cos - x2 * sin, x2 * cos + x1 * sin (rotate_with's values)
            x = rotated_part[part]
            x1, x2 = x[..., : rotary_dim // 2], x[..., rotary_dim // 2 :]
            f1, f2 = x1.float(), x2.float()  # float32 keys: the halves themselves, so both are computed first
            y1, y2 = f1 * c - f2 * s, f2 * c + f1 * s
            x1.copy_(y1)
            x2.copy_(y2)
        elif every:
            x = rotated_part[part]
            x.copy_(rotate_with(x, c, s, rotary_dim, neox))
        else:
            r = rows[part]
            y = rotate_with(rotated_part.index_select(0, r), c, s, rotary_dim, neox)
            rotated_part.index_copy_(0, r, y.to(keys.dtype))


def kv_deviation_torch(
    k_new: torch.Tensor, v_new: torch.Tensor, k_old: torch.Tensor, v_old: torch.Tensor
) -> torch.Tensor:
    """:func:`ucm.kernels.blend.kv_deviation` in torch ops: float32 differences, squares and sums (torch's reduction
    order), in chunks of :data:`CHUNK_TOKENS` tokens; float32 ``[num_tokens]`` on the inputs' device."""
    n = k_new.shape[0]
    out = torch.empty(n, dtype=torch.float32, device=k_new.device)
    for start in range(0, n, CHUNK_TOKENS):
        s = slice(start, start + CHUNK_TOKENS)
        dk = k_new[s].float() - k_old[s].float()
        dv = v_new[s].float() - v_old[s].float()
        out[s] = (dk * dk).sum(dim=(1, 2)) + (dv * dv).sum(dim=(1, 2))
    return out


def select_recompute_torch(deviation: torch.Tensor, ratio: float, always: torch.Tensor | None) -> torch.Tensor:
    """:func:`ucm.kernels.blend.select_recompute` with ``torch.topk``, any device: ``topk`` gives the ``k``-th
    largest deviation ``thr`` (a value, whatever order ``topk`` returns equal ones in); the tokens above ``thr``
    are taken, then the tokens equal to it in ascending index order (a cumulative count) until ``k`` are chosen.
    NaN ranks as ``+inf``. int64 ``[m]`` indices in ascending order on ``deviation``'s device."""
    n = deviation.shape[0]
    k = recompute_count(n, ratio)
    if k == n:
        chosen = torch.ones(n, dtype=torch.bool, device=deviation.device)
    elif k == 0:
        chosen = torch.zeros(n, dtype=torch.bool, device=deviation.device)
    else:
        d = torch.nan_to_num(deviation, nan=float("inf"), posinf=float("inf"), neginf=float("-inf"))
        thr = d.topk(k, sorted=False).values.min()
        above = d > thr
        tied = d == thr
        room = k - above.sum()  # tied tokens still to take (>= 1); a tensor: no device sync here
        chosen = above | (tied & (tied.cumsum(0) <= room))
    if always is not None:
        chosen = chosen | always
    return torch.nonzero(chosen).flatten()


def _float32_head_major(x: torch.Tensor) -> torch.Tensor:
    """``x`` (``[S, H, D]``) as a contiguous float32 ``[H, S, D]``: ``x.transpose(0, 1)`` itself when it is one."""
    heads = x.transpose(0, 1)
    if heads.dtype == torch.float32 and heads.is_contiguous():
        return heads
    return torch.empty(heads.shape, dtype=torch.float32, device=x.device).copy_(heads)


def question_attention_torch(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ucm.kernels.blend.question_attention` in torch ops, all KV heads at once (float32 logits
    ``[num_kv_heads, group, m, S]``, batched matmuls over the KV heads): logits and softmax in float32, the output
    rounded to ``query``'s dtype. The causal mask only touches the last ``m`` keys (the earlier ones are visible to
    every query row). The keys and values are read head-major in float32 (``[num_kv_heads, S, head_dim]``): one
    copy, none when the caller hands float32 tensors whose heads are contiguous
    (``keys.transpose(0, 1).is_contiguous()``)."""
    m, num_heads, head_dim = query.shape
    s, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    k_heads, v_heads = _float32_head_major(keys), _float32_head_major(values)  # [num_kv_heads, S, D]
    # [m, num_heads, D] -> [num_kv_heads, group * m, D]: query head h * group + j reads KV head h
    q = query.to(torch.float32).view(m, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    logits = torch.bmm(q.reshape(num_kv_heads, group * m, head_dim), k_heads.transpose(1, 2)).mul_(scale)
    logits = logits.view(num_kv_heads, group, m, s)
    hidden = torch.ones(m, m, dtype=torch.bool, device=query.device).triu_(1)  # row i sits at position s - m + i
    logits[..., s - m :].masked_fill_(hidden, float("-inf"))
    probs = logits.softmax(-1)
    out = torch.bmm(probs.view(num_kv_heads, group * m, s), v_heads)  # [num_kv_heads, group * m, D]
    out = out.view(num_kv_heads, group, m, head_dim).permute(2, 0, 1, 3).reshape(m, num_heads, head_dim)
    return out.to(query.dtype), probs.sum(dim=(0, 1, 2))
