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
    written), gather their first ``rotary_dim`` channels, rotate them in float32 (``x * cos + rotate_half(x) *
    sin``, ``ucm.kernels.rerope.torch.rotate_with``), round to the key dtype and write them back, in chunks of
    :data:`CHUNK_TOKENS` tokens."""
    rows = torch.nonzero(delta != 0).flatten().to(keys.device)
    if rows.numel() == 0:
        return
    cos, sin = delta_cos_sin(delta, rotary_dim, base, keys.device)
    rotated_part = keys[:, :, :rotary_dim]  # a view: writes land in keys
    for start in range(0, rows.numel(), CHUNK_TOKENS):
        r = rows[start : start + CHUNK_TOKENS]
        x = rotated_part.index_select(0, r)  # [n, H, rotary_dim]
        y = rotate_with(x, cos[r][:, None, :], sin[r][:, None, :], rotary_dim, neox)
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


def question_attention_torch(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ucm.kernels.blend.question_attention` in torch ops, one KV head's group of query heads at a time
    (float32 logits ``[group, m, S]``): logits and softmax in float32, the output rounded to ``query``'s dtype."""
    m, num_heads, _ = query.shape
    s, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    visible = torch.arange(s, device=query.device)[None, :] <= torch.arange(s - m, s, device=query.device)[:, None]
    out = torch.empty_like(query)
    received = torch.zeros(s, dtype=torch.float32, device=query.device)
    for h in range(num_kv_heads):
        q = query[:, h * group : (h + 1) * group].transpose(0, 1).float()  # [group, m, D]
        k, v = keys[:, h].float(), values[:, h].float()  # [S, D]
        probs = (q @ k.T * scale).masked_fill(~visible, float("-inf")).softmax(-1)  # [group, m, S]
        out[:, h * group : (h + 1) * group] = (probs @ v).transpose(0, 1).to(query.dtype)
        received += probs.sum(dim=(0, 1))
    return out, received
