"""int8_groups: lossy 8-bit quantization of bf16 values with one bf16 scale per group of consecutive values.

The KVfold fixed-rate mode (``compress_ratio: 16``). With the group = ``head_dim`` consecutive values of a canonical
shard ``[block_size, num_kv_heads, head_dim]``, there is one scale per (token, head): the best error per bit among
the 8-bit formats measured on real SmolLM2 KV (0.5-1.1% RMS error against 5.2% for a fixed exponent window and
2.7% for fp8 e4m3 with a per-tensor scale; see ``/work/shared/VLLM_NOTES.md``). Cost: 8 + 16 / group bits per
value (8.25 at head_dim 64).

Per group ``g`` of values ``x`` (symmetric absmax scaling)::

    s[g] = bf16(max|x| / 127), rounded up to the next bf16 when rounding went down (so |x| / s <= 127); 1.0 when
           max|x| = 0
    q    = clamp(round_half_even(x / s[g]), -127, 127)            (fp32 arithmetic)
    x'   = bf16(q * s[g])

Error bound per value: ``|x - x'| <= s[g] / 2 + |x'| * 2**-8`` (half a quantization step plus the bf16 rounding of
the output). Inputs must be finite: a group holding inf or NaN has no meaningful scale (the codec stores such blocks
losslessly instead; :func:`all_finite` checks).

Implementations: :func:`quantize_int8_groups` / :func:`dequantize_int8_groups` (vectorized torch, any device: the
CPU path) and the per-group reference loops beside them (the test oracles). A Triton kernel is not built yet.
"""

from __future__ import annotations

import numpy as np
import torch

QMAX = 127


def _check(x: torch.Tensor, group: int) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
        raise TypeError(f"x must be a torch.bfloat16 tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")
    if group < 1 or x.numel() % group:
        raise ValueError(f"group must be >= 1 and divide the {x.numel()} values of x, got group={group}")
    return x.reshape(-1, group)


def _scales(absmax: torch.Tensor) -> torch.Tensor:
    """bf16 scales ``[G]`` from fp32 group maxima ``[G]`` (see the module docstring)."""
    s32 = absmax / QMAX
    s = s32.to(torch.bfloat16)
    low = s.float() < s32  # rounded down: take the next bf16 up (positive values: the next bit pattern)
    s = torch.where(low, (s.view(torch.int16) + 1).view(torch.bfloat16), s)
    return torch.where(absmax == 0, torch.ones_like(s), s)


def all_finite(x: torch.Tensor) -> bool:
    """True when every value of ``x`` is finite (no inf, no NaN)."""
    return bool(torch.isfinite(x).all())


def quantize_int8_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize finite bf16 values to int8 with one bf16 scale per ``group`` consecutive values.

    Args:
        x: contiguous finite bf16 tensor, ``n`` values, ``n % group == 0``.
        group: values per scale (``head_dim`` for a per-(token, head) scale).

    Returns:
        ``q``: int8 ``[n]`` in [-127, 127]; ``scale``: bf16 ``[n // group]``, all positive and finite.

    Raises:
        TypeError: ``x`` is not bf16. ValueError: not contiguous, or ``group`` does not divide ``n``.
    """
    g = _check(x, group).float()  # [G, group]
    s = _scales(g.abs().amax(dim=1))
    if g.device.type == "cpu":
        # numpy's rint is round-half-even like torch.round, single-threaded: torch.round's OpenMP loop was seen
        # taking 15 ms for 24 K values on a busy 2-core machine (0.04 ms idle).
        qn = np.rint(g.numpy() / s.float().numpy()[:, None])
        np.clip(qn, -QMAX, QMAX, out=qn)
        return torch.from_numpy(qn.astype(np.int8).reshape(-1)), s
    q = torch.round(g / s.float()[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.reshape(-1), s


def dequantize_int8_groups(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`quantize_int8_groups` (up to the quantization error).

    Args:
        q: int8 ``[n]``; scale: bf16 ``[n // group]`` (group = ``n // scale.numel()``).
        out: optional contiguous bf16 destination of ``n`` values (any shape).

    Returns:
        ``out`` or a new bf16 ``[n]``: ``bf16(q * scale)``.

    Raises:
        TypeError / ValueError: wrong dtypes, or sizes that do not divide.
    """
    if q.dtype != torch.int8 or scale.dtype != torch.bfloat16:
        raise TypeError(f"q must be int8 and scale bf16, got {q.dtype} and {scale.dtype}")
    if scale.numel() == 0 or q.numel() % scale.numel():
        raise ValueError(f"scale ({scale.numel()} values) must divide q ({q.numel()} values) into equal groups")
    x = (q.reshape(scale.numel(), -1).float() * scale.float()[:, None]).to(torch.bfloat16).reshape(-1)
    if out is None:
        return x
    if out.dtype != torch.bfloat16 or out.numel() != x.numel() or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous bf16 tensor of {x.numel()} values")
    out.view(-1).copy_(x)
    return out


def quantize_int8_groups_reference(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Test oracle of :func:`quantize_int8_groups`: one group at a time."""
    rows = _check(x, group)
    qs, ss = [], []
    for row in rows:
        f = row.float()
        absmax = f.abs().max()
        s32 = absmax / QMAX
        s = s32.to(torch.bfloat16)
        if s.float() < s32:
            s = (s.view(torch.int16) + 1).view(torch.bfloat16)
        if absmax == 0:
            s = torch.tensor(1.0, dtype=torch.bfloat16)
        qs.append(torch.round(f / s.float()).clamp(-QMAX, QMAX).to(torch.int8))
        ss.append(s.reshape(1))
    return torch.cat(qs), torch.cat(ss)


def dequantize_int8_groups_reference(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Test oracle of :func:`dequantize_int8_groups`: one group at a time."""
    group = q.numel() // scale.numel()
    parts = [
        (q[i * group : (i + 1) * group].float() * scale[i].float()).to(torch.bfloat16) for i in range(scale.numel())
    ]
    return torch.cat(parts)
