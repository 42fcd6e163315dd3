"""The CacheBlend kernels in Triton (``impl="triton"``, the default on CUDA; the interpreter on CPU tensors, tests
only). Definitions in ``ucm.kernels.blend.ops``; one config each, chosen from the shape.

- ``rope_delta_kernel``: one program per block of tokens, looping over the KV heads, rotating the first
  ``rotary_dim`` channels of each key in place by the host-computed float32 cos/sin of its delta
  (``ucm.kernels.blend.torch.delta_cos_sin``); tokens whose delta is 0 are neither read nor written. The arithmetic
  is the torch path's, operation for operation (``x1 * cos - x2 * sin``, ``x2 * cos + x1 * sin``, each product
  rounded to float32 before the sum), so the two agree bit for bit: the launch disables the backend's fusion of a
  multiply and an add into an FMA (``enable_fp_fusion=False``), and the float32 -> bfloat16 rounding is done on
  the bits (round to nearest even, as torch rounds; NaN -> a quiet NaN), because the Triton interpreter's own
  bfloat16 cast truncates.
- ``kv_deviation_kernel``: one program per block of tokens, reading K and V, new and old, one KV head at a time:
  per token, the float32 sum over heads of each head's sum over channels of the squared differences.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ucm.kernels.utils import launchable, num_warps


@triton.jit
def _round_to_key_dtype(x, IS_BF16: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """float32 ``x`` rounded to nearest even in the key dtype (bfloat16 on the bits, see the module doc)."""
    if IS_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, 0x7FC0, rounded)  # NaN: a quiet NaN (the sum above could carry into the sign)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(OUT_DTYPE)


@triton.jit
def rope_delta_kernel(
    k_ptr,  # [T, H, D] keys, element (t, h, c) at t*stride_t + h*stride_h + c*stride_d; rotated in place
    delta_ptr,  # [T] int64 position deltas; 0: the token is left untouched
    cos_ptr,  # [T, HALF] float32 contiguous
    sin_ptr,  # [T, HALF] float32 contiguous
    num_tokens,
    stride_t,
    stride_h,
    stride_d,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,  # rotary_dim / 2: rotated pairs per key
    NEOX: tl.constexpr,  # pairs (c, c + HALF) if set, else (2c, 2c + 1)
    IS_BF16: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,  # next power of two >= HALF
):
    pid = tl.program_id(0).to(tl.int64)
    o_t = pid * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)  # [BT]
    o_r = tl.arange(0, BLOCK_R).to(tl.int64)  # [BR]
    m_t = o_t < num_tokens
    b_delta = tl.load(delta_ptr + o_t, mask=m_t, other=0)
    m_tr = (m_t & (b_delta != 0))[:, None] & (o_r < HALF)[None, :]  # [BT, BR]
    o_cs = o_t[:, None] * HALF + o_r[None, :]
    b_cos = tl.load(cos_ptr + o_cs, mask=m_tr, other=1.0)  # [BT, BR]
    b_sin = tl.load(sin_ptr + o_cs, mask=m_tr, other=0.0)
    if NEOX:
        o_1 = o_r * stride_d
        o_2 = (o_r + HALF) * stride_d
    else:
        o_1 = (2 * o_r) * stride_d
        o_2 = (2 * o_r + 1) * stride_d
    p_k = k_ptr + o_t[:, None] * stride_t  # [BT, 1] the tokens' first head
    for _ in range(NUM_HEADS):
        p_1 = p_k + o_1[None, :]  # [BT, BR]
        p_2 = p_k + o_2[None, :]
        b_1 = tl.load(p_1, mask=m_tr, other=0.0)
        b_2 = tl.load(p_2, mask=m_tr, other=0.0)
        x_1 = b_1.to(tl.float32)
        x_2 = b_2.to(tl.float32)
        y_1 = x_1 * b_cos - x_2 * b_sin
        y_2 = x_2 * b_cos + x_1 * b_sin
        tl.store(p_1, _round_to_key_dtype(y_1, IS_BF16, b_1.dtype), mask=m_tr)
        tl.store(p_2, _round_to_key_dtype(y_2, IS_BF16, b_2.dtype), mask=m_tr)
        p_k += stride_h


def rope_kernel_meta(num_kv_heads: int, rotary_dim: int, neox: bool, dtype: torch.dtype) -> dict[str, int]:
    """The constexprs of ``rope_delta_kernel`` chosen from the shape (also used by the sm_90 compile test): about
    2K pairs per program and head."""
    block_r = triton.next_power_of_2(rotary_dim // 2)
    return {
        "NUM_HEADS": num_kv_heads,
        "HALF": rotary_dim // 2,
        "NEOX": int(neox),
        "IS_BF16": int(dtype == torch.bfloat16),
        "BLOCK_T": max(1, 2048 // block_r),
        "BLOCK_R": block_r,
    }


def rope_delta_triton(
    keys: torch.Tensor, delta: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, neox: bool
) -> None:
    """Launch ``rope_delta_kernel`` on ``keys`` (``[T, H, D]``, T >= 1, any strides); ``delta`` int64 ``[T]`` and
    ``cos``/``sin`` float32 ``[T, rotary_dim / 2]`` contiguous, on ``keys``' device."""
    t, h, _ = keys.shape
    meta = rope_kernel_meta(h, rotary_dim, neox, keys.dtype)
    meta["BLOCK_T"] = min(meta["BLOCK_T"], triton.next_power_of_2(t))
    grid = (triton.cdiv(t, meta["BLOCK_T"]),)
    launchable(rope_delta_kernel, keys.device)[grid](
        keys,
        delta,
        cos,
        sin,
        t,
        *keys.stride(),
        num_warps=num_warps(),
        enable_fp_fusion=False,  # no FMA: the torch path's rounding (see the module doc)
        **meta,
    )


@triton.jit
def kv_deviation_kernel(
    kn_ptr,  # [T, H, D] new keys, element (t, h, c) at t*s_kn_t + h*s_kn_h + c (channels contiguous)
    vn_ptr,  # [T, H, D] new values
    ko_ptr,  # [T, H, D] old (stored) keys
    vo_ptr,  # [T, H, D] old (stored) values
    out_ptr,  # [T] float32
    num_tokens,
    s_kn_t,
    s_kn_h,
    s_vn_t,
    s_vn_h,
    s_ko_t,
    s_ko_h,
    s_vo_t,
    s_vo_h,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM
):
    pid = tl.program_id(0).to(tl.int64)
    o_t = pid * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)  # [BT]
    o_d = tl.arange(0, BLOCK_D).to(tl.int64)  # [BD]
    m_t = o_t < num_tokens
    m_td = m_t[:, None] & (o_d < HEAD_DIM)[None, :]  # [BT, BD]
    p_kn = kn_ptr + o_t[:, None] * s_kn_t + o_d[None, :]  # [BT, BD] the tokens' first head
    p_vn = vn_ptr + o_t[:, None] * s_vn_t + o_d[None, :]
    p_ko = ko_ptr + o_t[:, None] * s_ko_t + o_d[None, :]
    p_vo = vo_ptr + o_t[:, None] * s_vo_t + o_d[None, :]
    b_acc = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for _ in range(NUM_HEADS):
        b_dk = tl.load(p_kn, mask=m_td, other=0.0).to(tl.float32) - tl.load(p_ko, mask=m_td, other=0.0).to(tl.float32)
        b_dv = tl.load(p_vn, mask=m_td, other=0.0).to(tl.float32) - tl.load(p_vo, mask=m_td, other=0.0).to(tl.float32)
        b_acc += tl.sum(b_dk * b_dk + b_dv * b_dv, axis=1)  # [BT]
        p_kn += s_kn_h
        p_vn += s_vn_h
        p_ko += s_ko_h
        p_vo += s_vo_h
    tl.store(out_ptr + o_t, b_acc, mask=m_t)


def deviation_kernel_meta(num_kv_heads: int, head_dim: int) -> dict[str, int]:
    """The constexprs of ``kv_deviation_kernel`` chosen from the shape (also used by the sm_90 compile test): about
    4K elements of each of the four tensors per program and head."""
    block_d = triton.next_power_of_2(head_dim)
    return {"NUM_HEADS": num_kv_heads, "HEAD_DIM": head_dim, "BLOCK_T": max(1, 4096 // block_d), "BLOCK_D": block_d}


def kv_deviation_triton(
    k_new: torch.Tensor, v_new: torch.Tensor, k_old: torch.Tensor, v_old: torch.Tensor, out: torch.Tensor
) -> None:
    """Launch ``kv_deviation_kernel`` into ``out`` (float32 ``[T]``, T >= 1); the inputs ``[T, H, D]`` of any
    strides (one whose channels are not contiguous is copied first)."""
    t, h, d = k_new.shape
    tensors = [x if x.stride(2) == 1 or d == 1 else x.contiguous() for x in (k_new, v_new, k_old, v_old)]
    meta = deviation_kernel_meta(h, d)
    meta["BLOCK_T"] = min(meta["BLOCK_T"], triton.next_power_of_2(t))
    strides = [s for x in tensors for s in x.stride()[:2]]
    launchable(kv_deviation_kernel, k_new.device)[(triton.cdiv(t, meta["BLOCK_T"]),)](
        *tensors, out, t, *strides, num_warps=num_warps(), **meta
    )
