"""int8_groups: lossy 8-bit quantization of bf16 values with one bf16 scale per group of consecutive values.

The KVfold fixed-rate mode (``compress_ratio: 16``). With the group = ``head_dim`` consecutive values of a canonical
shard ``[block_size, num_kv_heads, head_dim]``, there is one scale per (token, head): the best error per bit among
the 8-bit formats measured on real SmolLM2 KV (see the real KV statistics under "KVfold codec" in
benchmarks/RESULTS.md: a fixed exponent window and fp8 e4m3 with a per-tensor scale lose more). Cost: 8 + 16 / group
bits per value (8.25 at head_dim 64).

Per group ``g`` of values ``x`` (symmetric absmax scaling)::

    s[g] = bf16(max|x| / 127), rounded up to the next bf16 when rounding went down (so |x| / s <= 127); 1.0 when
           max|x| = 0
    q    = clamp(round_half_even(x / s[g]), -127, 127)            (fp32 arithmetic)
    x'   = bf16(q * s[g])

Error bound per value: ``|x - x'| <= s[g] / 2 + |x'| * 2**-8`` (half a quantization step plus the bf16 rounding of
the output). Inputs must be finite: a group holding inf or NaN has no meaningful scale (the codec stores such blocks
losslessly instead; :func:`all_finite` checks).

Implementations of :func:`quantize_int8_groups` / :func:`dequantize_int8_groups` (``impl=``), identical results:

- ``"triton"``: one kernel each (``_quantize_kernel`` / ``_dequantize_kernel``), a tile of groups per program; the
  default on CUDA; on CPU tensors it runs in the Triton interpreter (tests). IEEE division (``div_rn``) and
  round-half-even by adding and subtracting 1.5 * 2**23 (exact for |y| < 2**22; here |y| <= 127), bf16 rounding
  written out in integer arithmetic. Checked bit-exact against the reference in the interpreter (CPU tensors need
  ``TRITON_INTERPRET=1``) and compiled for sm_90; not run on a GPU yet.
- ``"cpu"``: scales in torch, the division and rounding in numpy (single-threaded; the default on CPU).
- ``"torch"``: vectorized torch, any device.
- the per-group reference loops beside them (the test oracles).
"""

from __future__ import annotations

import os
from typing import Literal

import numpy as np
import torch
import triton
import triton.language as tl

from ucm.kernels._block_copy import _interpreted

QMAX = 127
Int8Impl = Literal["auto", "triton", "cpu", "torch"]
_IMPLS = ("auto", "triton", "cpu", "torch")
TILE_GROUPS = 16  # groups per Triton program
_RNE = 12582912.0  # 1.5 * 2**23: (y + _RNE) - _RNE rounds y to the nearest integer, ties to even, for |y| < 2**22


@triton.jit
def _bf16_bits_rne(x):
    """fp32 -> bf16 bit pattern (int32 in 0..65535), round to nearest even, for finite ``x``: written out in
    integer arithmetic because the Triton interpreter's own conversion does not round to nearest even."""
    b_bits = x.to(tl.int32, bitcast=True)
    b_bits = b_bits + (((b_bits >> 16) & 1) + 0x7FFF)
    return (b_bits >> 16) & 0xFFFF


@triton.jit
def _bf16_from_bits(bits):
    """bf16 bit pattern (int32 0..65535) -> its fp32 value (exact)."""
    return (bits << 16).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_kernel(
    x_ptr,  # [num_groups, GROUP] bf16
    q_ptr,  # [num_groups, GROUP] int8
    s_ptr,  # [num_groups] int16: the bf16 scales' bits
    num_groups,
    GROUP: tl.constexpr,
    TILE_G: tl.constexpr,
    TILE_V: tl.constexpr,
):
    o_g = tl.program_id(0).to(tl.int64) * TILE_G + tl.arange(0, TILE_G)  # [TILE_G]
    o_v = tl.arange(0, TILE_V)  # [TILE_V]
    m_g = o_g < num_groups
    m_x = m_g[:, None] & (o_v[None, :] < GROUP)  # [TILE_G, TILE_V]
    p_x = o_g[:, None] * GROUP + o_v[None, :]
    b_x = tl.load(x_ptr + p_x, mask=m_x, other=0.0).to(tl.float32)
    b_amax = tl.max(tl.abs(b_x), axis=1)  # [TILE_G]
    b_s32 = tl.math.div_rn(b_amax, tl.full([TILE_G], 127.0, tl.float32))
    b_bits = _bf16_bits_rne(b_s32)
    b_bits = tl.where(_bf16_from_bits(b_bits) < b_s32, b_bits + 1, b_bits)  # rounded down: next bf16 up
    b_bits = tl.where(b_amax == 0.0, 0x3F80, b_bits)  # 1.0
    b_s = _bf16_from_bits(b_bits)  # [TILE_G], exact
    b_y = tl.math.div_rn(b_x, b_s[:, None])
    b_r = (b_y + 12582912.0) - 12582912.0
    b_q = tl.minimum(tl.maximum(b_r, -127.0), 127.0).to(tl.int8)
    tl.store(q_ptr + p_x, b_q, mask=m_x)
    tl.store(s_ptr + o_g, (b_bits - ((b_bits >> 15) << 16)).to(tl.int16), mask=m_g)


@triton.jit
def _dequantize_kernel(
    q_ptr,  # [num_groups, GROUP] int8
    s_ptr,  # [num_groups] bf16
    x_ptr,  # [num_groups, GROUP] int16: the bf16 results' bits
    num_groups,
    GROUP: tl.constexpr,
    TILE_G: tl.constexpr,
    TILE_V: tl.constexpr,
):
    o_g = tl.program_id(0).to(tl.int64) * TILE_G + tl.arange(0, TILE_G)  # [TILE_G]
    o_v = tl.arange(0, TILE_V)  # [TILE_V]
    m_g = o_g < num_groups
    m_x = m_g[:, None] & (o_v[None, :] < GROUP)
    p_x = o_g[:, None] * GROUP + o_v[None, :]
    b_q = tl.load(q_ptr + p_x, mask=m_x, other=0).to(tl.float32)
    b_s = tl.load(s_ptr + o_g, mask=m_g, other=0.0).to(tl.float32)
    b_bits = _bf16_bits_rne(b_q * b_s[:, None])
    tl.store(x_ptr + p_x, (b_bits - ((b_bits >> 15) << 16)).to(tl.int16), mask=m_x)


def _which(impl: str, device: torch.device) -> str:
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    if impl == "auto":
        return {"cpu": "cpu", "cuda": "triton"}.get(device.type, "torch")
    if impl == "cpu" and device.type != "cpu":
        raise ValueError(f"impl='cpu' needs CPU tensors, got device {device}")
    return impl


def _launch(kernel: object, num_groups: int, group: int, *tensors: torch.Tensor) -> None:
    if tensors[0].device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # The kernels use tl.max, a @triton.jit library function that only the global interpreter mode patches.
        raise ValueError("impl='triton' on CPU tensors needs TRITON_INTERPRET=1 (the Triton interpreter)")
    fn = _interpreted(kernel) if tensors[0].device.type == "cpu" else kernel
    grid = (triton.cdiv(num_groups, TILE_GROUPS),)
    fn[grid](*tensors, num_groups, GROUP=group, TILE_G=TILE_GROUPS, TILE_V=triton.next_power_of_2(group))  # type: ignore[index]


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


def quantize_int8_groups(x: torch.Tensor, group: int, *, impl: Int8Impl = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize finite bf16 values to int8 with one bf16 scale per ``group`` consecutive values.

    Args:
        x: contiguous finite bf16 tensor, ``n`` values, ``n % group == 0``.
        group: values per scale (``head_dim`` for a per-(token, head) scale).
        impl: see the module docstring.

    Returns:
        ``q``: int8 ``[n]`` in [-127, 127]; ``scale``: bf16 ``[n // group]``, all positive and finite.

    Raises:
        TypeError: ``x`` is not bf16. ValueError: not contiguous, ``group`` does not divide ``n``, unknown impl.
    """
    rows = _check(x, group)
    which = _which(impl, x.device)
    if which == "triton":
        q_out = torch.empty(x.numel(), dtype=torch.int8, device=x.device)
        s_out = torch.empty(rows.shape[0], dtype=torch.bfloat16, device=x.device)
        if rows.shape[0]:
            _launch(_quantize_kernel, rows.shape[0], group, rows, q_out, s_out.view(torch.int16))
        return q_out, s_out
    g = rows.float()  # [G, group]
    s = _scales(g.abs().amax(dim=1))
    if which == "cpu":
        # numpy's rint is round-half-even like torch.round, single-threaded: torch.round's OpenMP loop was seen
        # taking 15 ms for 24 K values on a busy 2-core machine (0.04 ms idle).
        qn = np.rint(g.numpy() / s.float().numpy()[:, None])
        np.clip(qn, -QMAX, QMAX, out=qn)
        return torch.from_numpy(qn.astype(np.int8).reshape(-1)), s
    q = torch.round(g / s.float()[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.reshape(-1), s


def dequantize_int8_groups(
    q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None, *, impl: Int8Impl = "auto"
) -> torch.Tensor:
    """Inverse of :func:`quantize_int8_groups` (up to the quantization error).

    Args:
        q: int8 ``[n]``; scale: bf16 ``[n // group]`` (group = ``n // scale.numel()``).
        out: optional contiguous bf16 destination of ``n`` values (any shape).
        impl: see the module docstring (``"cpu"`` and ``"torch"`` are the same torch code here).

    Returns:
        ``out`` or a new bf16 ``[n]``: ``bf16(q * scale)``.

    Raises:
        TypeError / ValueError: wrong dtypes, or sizes that do not divide.
    """
    if q.dtype != torch.int8 or scale.dtype != torch.bfloat16:
        raise TypeError(f"q must be int8 and scale bf16, got {q.dtype} and {scale.dtype}")
    if scale.numel() == 0 or q.numel() % scale.numel():
        raise ValueError(f"scale ({scale.numel()} values) must divide q ({q.numel()} values) into equal groups")
    if out is not None and (out.dtype != torch.bfloat16 or out.numel() != q.numel() or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous bf16 tensor of {q.numel()} values")
    if _which(impl, q.device) == "triton":
        dst = out if out is not None else torch.empty(q.numel(), dtype=torch.bfloat16, device=q.device)
        n_groups, group = scale.numel(), q.numel() // scale.numel()
        _launch(_dequantize_kernel, n_groups, group, q.contiguous(), scale.contiguous(), dst.view(torch.int16))
        return dst
    x = (q.reshape(scale.numel(), -1).float() * scale.float()[:, None]).to(torch.bfloat16).reshape(-1)
    if out is None:
        return x
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
