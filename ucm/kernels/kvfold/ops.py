"""The KVfold codec's kernels (``ucm.store.kvfold``): validation, then dispatch by ``impl``.

**bf16 planes** (:func:`split_bf16_planes`, :func:`merge_bf16_planes`; lossless). A bf16 value is 16 bits: sign
(bit 15), exponent (bits 14-7), mantissa (bits 6-0). On real KV the sign and mantissa are close to uniform while the
exponent carries a third of its 8 bits (the real KV statistics under "KVfold codec" in benchmarks/RESULTS.md): the
lossless KVfold codec entropy-codes the exponent plane and stores the other raw. Splitting on the field boundary
(rather than the high/low byte) puts the whole exponent in one plane and the sign, which is incompressible, in the
raw plane::

    exp[i] = (v[i] >> 7) & 0xFF                       # the 8 exponent bits
    sm[i]  = ((v[i] >> 8) & 0x80) | (v[i] & 0x7F)      # sign in bit 7, mantissa in bits 6-0
    v[i]   = (exp[i] << 7) | ((sm[i] & 0x80) << 8) | (sm[i] & 0x7F)

A bijection on all 65,536 bit patterns (NaN payloads, infinities, -0.0, subnormals round-trip bit-exact).

**int8 groups** (:func:`quantize_int8_groups`, :func:`dequantize_int8_groups`; lossy). The KVfold fixed-rate mode
(``compress_ratio: 16``): 8-bit values with one bf16 scale per group of consecutive values. With the group =
``head_dim`` consecutive values of a canonical shard ``[block_size, num_kv_heads, head_dim]``, there is one scale per
(token, head): the best error per bit among the 8-bit formats measured on real SmolLM2 KV (see the real KV statistics
under "KVfold codec" in benchmarks/RESULTS.md: a fixed exponent window and fp8 e4m3 with a per-tensor scale lose
more). Cost: 8 + 16 / group bits per value (8.25 at head_dim 64). Per group ``g`` of values ``x`` (symmetric absmax
scaling)::

    s[g] = bf16(max|x| / 127), rounded up to the next bf16 when rounding went down (so |x| / s <= 127); 1.0 when
           max|x| = 0
    q    = clamp(round_half_even(x / s[g]), -127, 127)            (fp32 arithmetic)
    x'   = bf16(q * s[g])

Error bound per value: ``|x - x'| <= s[g] / 2 + |x'| * 2**-8`` (half a quantization step plus the bf16 rounding of
the output). Inputs must be finite: a group holding inf or NaN has no meaningful scale (the codec stores such blocks
losslessly instead; :func:`all_finite` checks).

Implementations (``impl=``, the vocabulary of ``ucm.kernels.utils``), identical results bit for bit:

- ``"triton"``: one elementwise kernel per direction (``kvfold.triton``), the default on CUDA; on CPU tensors the
  Triton interpreter (tests only; the int8 kernels need ``TRITON_INTERPRET=1`` there). Not fused with the block
  gather/scatter: the Compress stage runs on host buffers, after the gather.
- ``"cpu"``: the CPU fast path (``kvfold.cpu``): numba loops for the planes; scales in torch and the rounding in
  numpy for int8 quantization; the torch code for dequantization. The default on CPU.
- ``"torch"``: the formulas in torch int32 / fp32 arithmetic (``kvfold.torch``), any device.
- ``"reference"``: one value or group at a time (``kvfold.naive``, the test oracles; small inputs only).
"""

from __future__ import annotations

import numpy as np
import torch

from ucm.kernels.kvfold.cpu import merge_planes_np, quantize_groups_cpu, split_planes_np
from ucm.kernels.kvfold.naive import (
    dequantize_int8_groups_reference,
    merge_bf16_planes_reference,
    quantize_int8_groups_reference,
    split_bf16_planes_reference,
)
from ucm.kernels.kvfold.torch import (
    dequantize_groups_torch,
    merge_planes_torch,
    quantize_groups_torch,
    split_planes_torch,
)
from ucm.kernels.kvfold.triton import (
    dequantize_kernel,
    launch_groups,
    launch_planes,
    merge_planes_kernel,
    quantize_kernel,
    split_planes_kernel,
)
from ucm.kernels.utils import Impl, resolve_impl


def split_bf16_planes(x: torch.Tensor, *, impl: Impl = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Split the bf16 values of ``x`` into ``(exp, sm)`` planes.

    Args:
        x: contiguous bf16 tensor of any shape (or any 16-bit dtype, or uint8 bytes of an even count), ``n`` values.
        impl: see the module docstring.

    Returns:
        ``exp``: uint8 ``[n]``, the exponent field of each value; ``sm``: uint8 ``[n]``, sign in bit 7 and mantissa
        in bits 6-0. Both on ``x``'s device.

    Raises:
        TypeError / ValueError: bad dtype, non-contiguous input, odd byte count, unknown ``impl``.
    """
    w = _words(x)
    which = resolve_impl(impl, w.device, op="split_bf16_planes")
    if which == "reference":
        exp_ref, sm_ref = split_bf16_planes_reference(w)
        return exp_ref.to(w.device), sm_ref.to(w.device)
    if which == "triton":
        exp_out = torch.empty(w.numel(), dtype=torch.uint8, device=w.device)
        sm_out = torch.empty(w.numel(), dtype=torch.uint8, device=w.device)
        launch_planes(split_planes_kernel, w.numel(), w, exp_out, sm_out)
        return exp_out, sm_out
    if which == "cpu":
        return split_planes_np(w.numpy().view(np.uint16))
    return split_planes_torch(w)


def merge_bf16_planes(
    exp: torch.Tensor, sm: torch.Tensor, out: torch.Tensor | None = None, *, impl: Impl = "auto"
) -> torch.Tensor:
    """Merge ``exp`` and ``sm`` planes (from :func:`split_bf16_planes`) back into bf16 values.

    Args:
        exp, sm: contiguous uint8 ``[n]`` tensors on one device.
        out: optional contiguous destination of ``2 * n`` bytes (bf16 ``[..]`` with ``n`` values, or uint8 with
            ``2 * n`` bytes); written in place and returned.
        impl: see the module docstring.

    Returns:
        ``out``, or a new bf16 ``[n]`` tensor.

    Raises:
        TypeError / ValueError: planes not uint8, of different sizes or devices; ``out`` of the wrong size.
    """
    for name, t in (("exp", exp), ("sm", sm)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
            raise TypeError(f"{name} must be a torch.uint8 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if exp.numel() != sm.numel() or exp.device != sm.device:
        raise ValueError(f"exp and sm must match: {exp.numel()} vs {sm.numel()} values, {exp.device} vs {sm.device}")
    n = exp.numel()
    if out is None:
        out = torch.empty(n, dtype=torch.bfloat16, device=exp.device)
    w = _words(out)
    if w.numel() != n or out.device != exp.device:
        raise ValueError(f"out must hold {n} 16-bit values on {exp.device}, got {w.numel()} on {out.device}")
    which = resolve_impl(impl, exp.device, op="merge_bf16_planes")
    if which == "triton":
        launch_planes(merge_planes_kernel, n, exp.reshape(-1), sm.reshape(-1), w)
    elif which == "cpu":
        merge_planes_np(exp.reshape(-1).numpy(), sm.reshape(-1).numpy(), w.numpy().view(np.uint16))
    elif which == "reference":
        w.copy_(merge_bf16_planes_reference(exp, sm).view(torch.int16))
    else:
        merge_planes_torch(exp, sm, w)
    return out


def all_finite(x: torch.Tensor) -> bool:
    """True when every value of ``x`` is finite (no inf, no NaN)."""
    return bool(torch.isfinite(x).all())


def quantize_int8_groups(x: torch.Tensor, group: int, *, impl: Impl = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize finite bf16 values to int8 with one bf16 scale per ``group`` consecutive values.

    Args:
        x: contiguous finite bf16 tensor, ``n`` values, ``n % group == 0``.
        group: values per scale (``head_dim`` for a per-(token, head) scale).
        impl: see the module docstring.

    Returns:
        ``q``: int8 ``[n]`` in [-127, 127]; ``scale``: bf16 ``[n // group]``, all positive and finite.

    Raises:
        TypeError: ``x`` is not bf16. ValueError: not contiguous, ``group`` does not divide ``n``, unknown impl, or
        ``"triton"`` on CPU tensors without ``TRITON_INTERPRET=1``.
    """
    rows = _group_rows(x, group)
    which = resolve_impl(impl, x.device, op="quantize_int8_groups")
    if which == "triton":
        q_out = torch.empty(x.numel(), dtype=torch.int8, device=x.device)
        s_out = torch.empty(rows.shape[0], dtype=torch.bfloat16, device=x.device)
        if rows.shape[0]:
            launch_groups(quantize_kernel, rows.shape[0], group, rows, q_out, s_out.view(torch.int16))
        return q_out, s_out
    if which == "cpu":
        return quantize_groups_cpu(rows)
    if which == "reference":
        q_ref, s_ref = quantize_int8_groups_reference(x, group)
        return q_ref.to(x.device), s_ref.to(x.device)
    return quantize_groups_torch(rows)


def dequantize_int8_groups(
    q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None, *, impl: Impl = "auto"
) -> torch.Tensor:
    """Inverse of :func:`quantize_int8_groups` (up to the quantization error).

    Args:
        q: int8 ``[n]``; scale: bf16 ``[n // group]`` (group = ``n // scale.numel()``).
        out: optional contiguous bf16 destination of ``n`` values (any shape).
        impl: see the module docstring (``"cpu"`` and ``"torch"`` are the same torch code here).

    Returns:
        ``out`` or a new bf16 ``[n]``: ``bf16(q * scale)``.

    Raises:
        TypeError / ValueError: wrong dtypes, or sizes that do not divide; unknown ``impl``.
    """
    if q.dtype != torch.int8 or scale.dtype != torch.bfloat16:
        raise TypeError(f"q must be int8 and scale bf16, got {q.dtype} and {scale.dtype}")
    if scale.numel() == 0 or q.numel() % scale.numel():
        raise ValueError(f"scale ({scale.numel()} values) must divide q ({q.numel()} values) into equal groups")
    if out is not None and (out.dtype != torch.bfloat16 or out.numel() != q.numel() or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous bf16 tensor of {q.numel()} values")
    which = resolve_impl(impl, q.device, op="dequantize_int8_groups")
    if which == "triton":
        dst = out if out is not None else torch.empty(q.numel(), dtype=torch.bfloat16, device=q.device)
        n_groups, group = scale.numel(), q.numel() // scale.numel()
        launch_groups(dequantize_kernel, n_groups, group, q.contiguous(), scale.contiguous(), dst.view(torch.int16))
        return dst
    if which == "reference":
        x = dequantize_int8_groups_reference(q.reshape(-1), scale.reshape(-1)).to(q.device)
    else:  # "cpu" and "torch"
        x = dequantize_groups_torch(q, scale)
    if out is None:
        return x
    out.view(-1).copy_(x)
    return out


def _words(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a flat int16 view of its 16-bit words (bf16/int16/uint16/fp16 tensors, or uint8 bytes of even count).

    Raises:
        TypeError: ``x`` is not a tensor of a 16-bit dtype or uint8.
        ValueError: ``x`` is not contiguous, or holds an odd number of bytes.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_contiguous():
        raise ValueError("input must be contiguous")
    if x.dtype == torch.uint8:
        if x.numel() % 2:
            raise ValueError(f"a uint8 input must hold whole 16-bit values, got {x.numel()} bytes")
        return x.reshape(-1).view(torch.int16)
    if x.element_size() != 2:
        raise TypeError(f"expected bf16 (or another 16-bit dtype, or uint8 bytes), got {x.dtype}")
    return x.reshape(-1).view(torch.int16)


def _group_rows(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x`` as ``[num_groups, group]`` rows, after checking it.

    Raises:
        TypeError: ``x`` is not a bf16 tensor.
        ValueError: ``x`` is not contiguous, or ``group`` does not divide its size.
    """
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
        raise TypeError(f"x must be a torch.bfloat16 tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")
    if group < 1 or x.numel() % group:
        raise ValueError(f"group must be >= 1 and divide the {x.numel()} values of x, got group={group}")
    return x.reshape(-1, group)
