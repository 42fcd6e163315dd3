"""Naive references of the CacheBlend ops (``impl="reference"``; the test oracles), in float64 or plain Python, and
the rule that turns a recompute ratio into a token count. Definitions in ``ucm.kernels.blend.ops``."""

from __future__ import annotations

import math
import numbers
from fractions import Fraction

import torch

from ucm.kernels.rerope.naive import rope_reference


def rope_delta_reference(
    keys: torch.Tensor, delta: torch.Tensor, *, rotary_dim: int, base: float, neox: bool
) -> torch.Tensor:
    """Test oracle of ``rope_delta_``: ``keys`` (``[num_tokens, num_kv_heads, head_dim]``, any float dtype) rotated
    by RoPE at positions ``delta`` (integer ``[num_tokens]``), angles and vectors in float64; a new float64
    ``[num_tokens, num_kv_heads, head_dim]`` on CPU (``keys`` is not modified). vLLM's conventions
    (``ucm.kernels.rerope.naive.rope_reference``)."""
    return rope_reference(keys.cpu(), delta.cpu(), rotary_dim, base, neox)


def kv_deviation_reference(
    k_new: torch.Tensor, v_new: torch.Tensor, k_old: torch.Tensor, v_old: torch.Tensor
) -> torch.Tensor:
    """Test oracle of ``kv_deviation``: per token, ``sum_{h, c} (k_new - k_old)^2 + (v_new - v_old)^2`` over the
    ``[num_tokens, num_kv_heads, head_dim]`` inputs, in float64; float64 ``[num_tokens]`` on CPU."""
    dk = k_new.cpu().to(torch.float64) - k_old.cpu().to(torch.float64)
    dv = v_new.cpu().to(torch.float64) - v_old.cpu().to(torch.float64)
    return (dk * dk).sum(dim=(1, 2)) + (dv * dv).sum(dim=(1, 2))


def recompute_count(num_tokens: int, ratio: float) -> int:
    """``ceil(ratio * num_tokens)``, the number of tokens ``select_recompute`` picks by deviation, with ``ratio``
    read as the shortest decimal that round-trips (Python's ``repr``) and the product computed exactly: a ratio
    written in decimal gives the count its decimal value gives (0.07 of 100 tokens is 7, not the 8 that the float
    product ``7.000000000000001`` rounds up to).

    Raises:
        ValueError: ``ratio`` is not a real number in ``[0, 1]`` (NaN included), or ``num_tokens`` is negative.
    """
    if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) or not 0.0 <= float(ratio) <= 1.0:
        raise ValueError(f"ratio must be a real number in [0, 1], got {ratio!r}")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return min(num_tokens, math.ceil(Fraction(repr(float(ratio))) * num_tokens))


def select_recompute_reference(
    deviation: torch.Tensor, ratio: float, *, always: torch.Tensor | None = None
) -> torch.Tensor:
    """Test oracle of ``select_recompute``: the :func:`recompute_count` tokens of highest ``deviation`` (float
    ``[num_tokens]``; NaN ranks as ``+inf``), equal deviations taken in ascending index order, together with the
    tokens of the bool mask ``always``; int64 indices in ascending order on CPU, by a Python sort."""
    values = [math.inf if math.isnan(x) else x for x in deviation.cpu().to(torch.float64).tolist()]
    k = recompute_count(len(values), ratio)
    chosen = set(sorted(range(len(values)), key=lambda t: (-values[t], t))[:k])
    if always is not None:
        chosen.update(t for t, must in enumerate(always.cpu().tolist()) if must)
    return torch.tensor(sorted(chosen), dtype=torch.int64)


def question_attention_reference(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Test oracle of ``question_attention``: causal softmax attention of the last ``m`` tokens (``query`` ``[m,
    num_heads, head_dim]``) over ``keys`` / ``values`` (``[S, num_kv_heads, head_dim]``), in float64; returns the
    output ``[m, num_heads, head_dim]`` in ``query``'s dtype and the attention each key receives, summed over heads
    and queries (float64 ``[S]``), on CPU."""
    m, num_heads, _ = query.shape
    s = keys.shape[0]
    group = num_heads // keys.shape[1]
    q = query.cpu().to(torch.float64).transpose(0, 1)  # [H, m, D]
    k = keys.cpu().to(torch.float64).repeat_interleave(group, 1).transpose(0, 1)  # [H, S, D]
    v = values.cpu().to(torch.float64).repeat_interleave(group, 1).transpose(0, 1)
    logits = q @ k.transpose(1, 2) * scale  # [H, m, S]
    visible = torch.arange(s)[None, :] <= torch.arange(s - m, s)[:, None]
    probs = logits.masked_fill(~visible, -math.inf).softmax(-1)
    return (probs @ v).transpose(0, 1).to(query.dtype), probs.sum(dim=(0, 1))
