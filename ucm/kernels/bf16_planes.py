"""bf16_planes: split bf16 values into an exponent plane and a sign+mantissa plane, and merge them back.

A bf16 value is 16 bits: sign (bit 15), exponent (bits 14-7), mantissa (bits 6-0). On real KV the sign and
mantissa are close to uniform while the exponent carries a third of its 8 bits (the real KV statistics under
"KVfold codec" in benchmarks/RESULTS.md): the lossless KVfold codec entropy-codes the exponent plane and stores
the other raw. Splitting on the field boundary (rather than the high/low byte) puts the whole exponent in one plane
and the sign, which is incompressible, in the raw plane::

    exp[i] = (v[i] >> 7) & 0xFF                       # the 8 exponent bits
    sm[i]  = ((v[i] >> 8) & 0x80) | (v[i] & 0x7F)      # sign in bit 7, mantissa in bits 6-0
    v[i]   = (exp[i] << 7) | ((sm[i] & 0x80) << 8) | (sm[i] & 0x7F)

A bijection on all 65,536 bit patterns (NaN payloads, infinities, -0.0, subnormals round-trip bit-exact).

Implementations, identical results (``impl=``):
- ``"triton"``: one elementwise Triton kernel (``_split_kernel`` / ``_merge_kernel``), the default on CUDA; on CPU
  tensors it runs in the Triton interpreter (tests only: slow). Not fused with the block gather/scatter yet: the
  Compress stage runs on host buffers, after the gather.
- ``"cpu"``: the CPU fast path, a numba loop (``ucm.kernels._numba_planes``, compiled on first use, GIL released;
  the default on CPU).
- ``"numpy"``: numpy on the 16-bit words, several passes (kept as a second CPU implementation: about 40x slower
  than the numba loop).
- ``"torch"``: the same formulas in torch int32 arithmetic, any device (the default elsewhere).
- :func:`split_bf16_planes_reference` / :func:`merge_bf16_planes_reference`: the test oracles, a per-value loop
  over Python ints (small inputs only).
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
import triton
import triton.language as tl

from ucm.kernels._block_copy import _interpreted

PlanesImpl = Literal["auto", "triton", "cpu", "numpy", "torch"]
_IMPLS = ("auto", "triton", "cpu", "numpy", "torch")
TILE = 1024  # values per Triton program


@triton.jit
def _split_kernel(
    words_ptr,  # [n] int16: the bf16 bit patterns
    exp_ptr,  # [n] uint8
    sm_ptr,  # [n] uint8
    n,
    TILE: tl.constexpr,
):
    o_val = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)  # [TILE]
    m_val = o_val < n
    b_v = tl.load(words_ptr + o_val, mask=m_val, other=0).to(tl.int32) & 0xFFFF
    tl.store(exp_ptr + o_val, ((b_v >> 7) & 0xFF).to(tl.uint8), mask=m_val)
    tl.store(sm_ptr + o_val, (((b_v >> 8) & 0x80) | (b_v & 0x7F)).to(tl.uint8), mask=m_val)


@triton.jit
def _merge_kernel(
    exp_ptr,  # [n] uint8
    sm_ptr,  # [n] uint8
    words_ptr,  # [n] int16
    n,
    TILE: tl.constexpr,
):
    o_val = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)  # [TILE]
    m_val = o_val < n
    b_e = tl.load(exp_ptr + o_val, mask=m_val, other=0).to(tl.int32)
    b_s = tl.load(sm_ptr + o_val, mask=m_val, other=0).to(tl.int32)
    b_v = (b_e << 7) | ((b_s & 0x80) << 8) | (b_s & 0x7F)  # 0..65535
    tl.store(words_ptr + o_val, (b_v - ((b_v >> 15) << 16)).to(tl.int16), mask=m_val)


def _launch(kernel: Any, n: int, *tensors: torch.Tensor) -> None:
    """Launch an elementwise kernel over ``n`` values (the interpreter on CPU tensors)."""
    if n == 0:
        return
    fn = _interpreted(kernel) if tensors[0].device.type == "cpu" else kernel
    fn[(triton.cdiv(n, TILE),)](*tensors, n, TILE=TILE)


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


def _check_impl(impl: str, device: torch.device) -> str:
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    if impl == "auto":
        return {"cpu": "cpu", "cuda": "triton"}.get(device.type, "torch")
    if impl in ("cpu", "numpy") and device.type != "cpu":
        raise ValueError(f"impl={impl!r} needs CPU tensors, got device {device}")
    return impl


def split_bf16_planes(x: torch.Tensor, *, impl: PlanesImpl = "auto") -> tuple[torch.Tensor, torch.Tensor]:
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
    which = _check_impl(impl, w.device)
    if which == "triton":
        exp_out = torch.empty(w.numel(), dtype=torch.uint8, device=w.device)
        sm_out = torch.empty(w.numel(), dtype=torch.uint8, device=w.device)
        _launch(_split_kernel, w.numel(), w, exp_out, sm_out)
        return exp_out, sm_out
    if which == "cpu":
        return split_planes_np(w.numpy().view(np.uint16))
    if which == "numpy":
        v = w.numpy().view(np.uint16)
        exp = np.empty(v.shape, np.uint8)
        sm = np.empty(v.shape, np.uint8)
        np.right_shift(v, 7, out=exp, casting="unsafe")  # the cast to uint8 keeps bits 14-7
        hi = np.right_shift(v, 8)
        np.bitwise_and(hi, 0x80, out=hi)
        np.bitwise_or(hi, np.bitwise_and(v, 0x7F), out=hi)
        sm[...] = hi
        return torch.from_numpy(exp), torch.from_numpy(sm)
    v32 = w.to(torch.int32) & 0xFFFF
    exp_t = ((v32 >> 7) & 0xFF).to(torch.uint8)
    sm_t = (((v32 >> 8) & 0x80) | (v32 & 0x7F)).to(torch.uint8)
    return exp_t, sm_t


def merge_bf16_planes(
    exp: torch.Tensor, sm: torch.Tensor, out: torch.Tensor | None = None, *, impl: PlanesImpl = "auto"
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
    which = _check_impl(impl, exp.device)
    if which == "triton":
        _launch(_merge_kernel, n, exp.reshape(-1), sm.reshape(-1), w)
        return out
    if which == "cpu":
        merge_planes_np(exp.reshape(-1).numpy(), sm.reshape(-1).numpy(), w.numpy().view(np.uint16))
        return out
    if which == "numpy":
        e = exp.reshape(-1).numpy()
        s = sm.reshape(-1).numpy()
        v = w.numpy().view(np.uint16)
        np.left_shift(e, 7, out=v, dtype=np.uint16)
        t = np.bitwise_and(s, 0x80).astype(np.uint16)
        np.left_shift(t, 8, out=t)
        np.bitwise_or(v, t, out=v)
        np.bitwise_or(v, np.bitwise_and(s, 0x7F), out=v, casting="unsafe")
        return out
    e32 = exp.reshape(-1).to(torch.int32)
    s32 = sm.reshape(-1).to(torch.int32)
    v32 = (e32 << 7) | ((s32 & 0x80) << 8) | (s32 & 0x7F)
    w.copy_((v32 - ((v32 >> 15) << 16)).to(torch.int16))  # 0..65535 as signed int16, no overflow
    return out


def split_planes_np(words: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU fast path on numpy: ``words`` uint16 ``[n]`` -> ``(exp, sm)`` uint8 ``[n]`` tensors (numba loop)."""
    from ucm.kernels._numba_planes import split_planes

    exp = np.empty(words.shape, np.uint8)
    sm = np.empty(words.shape, np.uint8)
    split_planes(_read_only(words), exp, sm)
    return torch.from_numpy(exp), torch.from_numpy(sm)


def merge_planes_np(exp: np.ndarray, sm: np.ndarray, words: np.ndarray) -> None:
    """CPU fast path on numpy: uint8 ``exp``, ``sm`` ``[n]`` (read-only arrays allowed) -> ``words`` uint16 ``[n]``
    written in place (numba loop).

    Raises:
        ValueError: the three arrays differ in length.
    """
    if not exp.shape[0] == sm.shape[0] == words.shape[0]:
        raise ValueError(f"planes of {exp.shape[0]} and {sm.shape[0]} values for {words.shape[0]} words")
    from ucm.kernels._numba_planes import merge_planes

    merge_planes(_read_only(exp), _read_only(sm), words)


def _read_only(a: np.ndarray) -> np.ndarray:
    """A read-only view of ``a``. numba compiles a kernel once per argument type, and writability is part of the
    type: the codec's inputs are read-only (``bytes``) or not (a reused read buffer) depending on where they come
    from, so without this the first load of a process that reads another kind compiled (or loaded from numba's cache)
    a second specialization of the kernel, while every decoding thread waited on numba's compiler lock: ~0.1 s of
    a storage hit's TTFT after a fresh install (measured), more on a loaded machine."""
    if not a.flags.writeable:
        return a
    view = a.view()
    view.flags.writeable = False
    return view


def split_bf16_planes_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Test oracle of :func:`split_bf16_planes`: one value at a time over Python ints (small inputs only)."""
    words = [int(v) & 0xFFFF for v in _words(x).cpu().tolist()]
    exp = [(v >> 7) & 0xFF for v in words]
    sm = [((v >> 15) << 7) | (v & 0x7F) for v in words]
    return torch.tensor(exp, dtype=torch.uint8), torch.tensor(sm, dtype=torch.uint8)


def merge_bf16_planes_reference(exp: torch.Tensor, sm: torch.Tensor) -> torch.Tensor:
    """Test oracle of :func:`merge_bf16_planes`: one value at a time over Python ints; returns bf16 ``[n]``."""
    words = []
    for e, s in zip(exp.cpu().tolist(), sm.cpu().tolist(), strict=True):
        v = (e << 7) | ((s >> 7) << 15) | (s & 0x7F)
        words.append(v - 0x10000 if v >= 0x8000 else v)  # as a signed int16
    return torch.tensor(words, dtype=torch.int16).view(torch.bfloat16)
