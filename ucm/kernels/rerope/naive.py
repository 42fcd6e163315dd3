"""Naive references for ReRoPE (the test oracles): rotary position embedding, and causal attention whose relative
positions are rectified, computed as a full score matrix in float64.

ReRoPE (Su Jianlin, "Rectified Rotary Position Embeddings", 2023; reference code in the bojone/rerope repository):
with RoPE, the score of query ``i`` and key ``j`` depends on their positions only through ``d = pos_q - pos_k``.
ReRoPE keeps ``d`` where ``d < window`` and reads every larger distance as ``window``; leaky ReRoPE reads it as
``window + (d - window) / leaky_factor``. So a model never sees a relative position beyond ``window`` plus a
compressed tail, whatever the length of the context. ``leaky_factor = inf`` is plain ReRoPE, ``leaky_factor = 1``
is RoPE.

Rotation conventions are vLLM's ``RotaryEmbedding``: inverse frequencies ``base ** (-2 i / rotary_dim)`` for
``i < rotary_dim / 2``; GPT-NeoX style (``neox=True``, Llama's) rotates the two halves of the first
``rotary_dim`` channels, GPT-J style the interleaved pairs; channels past ``rotary_dim`` are not rotated.
"""

from __future__ import annotations

import math

import torch


def rectified_distance(d: torch.Tensor, window: int, leaky_factor: float) -> torch.Tensor:
    """ReRoPE's relative position for distances ``d`` (float64, any shape): ``d`` below ``window``, else ``window +
    (d - window) / leaky_factor`` (``window`` for ``leaky_factor = inf``)."""
    tail = torch.full_like(d, float(window)) if math.isinf(leaky_factor) else window + (d - window) / leaky_factor
    return torch.where(d < window, d, tail)


def rope_reference(
    x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, base: float, neox: bool = True
) -> torch.Tensor:
    """``x`` (``[n, heads, head_dim]``, any float dtype) rotated by RoPE at ``positions`` (``[n]``, integer or float:
    a rectified position may be fractional), computed in float64; returns float64 ``[n, heads, head_dim]``.

    Raises:
        ValueError: ``rotary_dim`` odd, < 2 or above ``head_dim``; ``positions`` not ``[n]``.
    """
    n, _, head_dim = x.shape
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim must be even, >= 2 and <= head_dim ({head_dim}), got {rotary_dim}")
    if positions.shape != (n,):
        raise ValueError(f"positions must be [{n}], got {list(positions.shape)}")
    half = rotary_dim // 2
    inv_freq = base ** (-torch.arange(half, dtype=torch.float64) * 2 / rotary_dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # [n, half]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]  # [n, 1, half]
    x = x.to(torch.float64)
    out = x.clone()
    if neox:
        x1, x2 = x[..., :half], x[..., half:rotary_dim]
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half:rotary_dim] = x2 * cos + x1 * sin
    else:
        x1, x2 = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
        out[..., 0:rotary_dim:2] = x1 * cos - x2 * sin
        out[..., 1:rotary_dim:2] = x2 * cos + x1 * sin
    return out


def rerope_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    *,
    window: int,
    leaky_factor: float = math.inf,
    rotary_dim: int | None = None,
    base: float = 10000.0,
    neox: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention with ReRoPE's rectified relative positions, the full score matrix in float64.

    Query ``i`` attends to key ``j`` when ``k_positions[j] <= q_positions[i]``, with the score ``scale * (R(r) q_i)
    . k_j`` where ``r`` is :func:`rectified_distance` of ``q_positions[i] - k_positions[j]`` and ``R(r)`` the
    rotation by RoPE at position ``r`` (rotating the query alone by the relative position is the same as rotating
    both by their absolute ones, RoPE's identity).

    Args:
        q: ``[num_q, num_heads, head_dim]``, the queries *before* RoPE.
        k: ``[num_k, num_kv_heads, head_dim]``, the keys before RoPE (``num_heads`` a multiple of ``num_kv_heads``:
            grouped-query attention).
        v: ``[num_k, num_kv_heads, head_dim]``.
        q_positions / k_positions: ``[num_q]`` / ``[num_k]`` integer positions.
        window: ReRoPE's window ``w`` (>= 1).
        leaky_factor: ``k`` of leaky ReRoPE (>= 1; ``inf``: plain ReRoPE, 1: RoPE).
        rotary_dim: channels rotated (None: ``head_dim``).
        base: RoPE's base (``rope_theta``).
        neox: GPT-NeoX rotation (Llama's) or GPT-J's.
        scale: score scale (None: ``head_dim ** -0.5``).

    Returns:
        float64 ``[num_q, num_heads, head_dim]``; a query with no key to attend to gets zeros.

    Raises:
        ValueError: bad shapes, ``window`` < 1, ``leaky_factor`` < 1, or a bad ``rotary_dim``.
    """
    num_q, num_heads, head_dim = q.shape
    num_k, num_kv_heads, _ = k.shape
    if k.shape[2] != head_dim or v.shape != k.shape:
        raise ValueError(f"k and v must be [num_k, num_kv_heads, {head_dim}], got {list(k.shape)}, {list(v.shape)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if q_positions.shape != (num_q,) or k_positions.shape != (num_k,):
        raise ValueError(f"positions must be [{num_q}] and [{num_k}]")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if not leaky_factor >= 1:
        raise ValueError(f"leaky_factor must be >= 1 (inf: plain ReRoPE, 1: RoPE), got {leaky_factor}")
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    scale = head_dim**-0.5 if scale is None else scale
    group = num_heads // num_kv_heads
    keys = k.to(torch.float64).repeat_interleave(group, dim=1)  # [num_k, num_heads, head_dim]
    values = v.to(torch.float64).repeat_interleave(group, dim=1)
    out = torch.zeros((num_q, num_heads, head_dim), dtype=torch.float64)
    k_pos = k_positions.to(torch.float64)
    for i in range(num_q):
        d = float(q_positions[i]) - k_pos  # [num_k]
        visible = d >= 0
        if not bool(visible.any()):
            continue
        rel = rectified_distance(d[visible], window, leaky_factor)
        rotated = rope_reference(q[i].expand(len(rel), num_heads, head_dim), rel, rotary_dim, base, neox)
        scores = (rotated * keys[visible]).sum(dim=-1) * scale  # [n_visible, num_heads]
        probs = torch.softmax(scores, dim=0)
        out[i] = (probs[:, :, None] * values[visible]).sum(dim=0)
    return out
