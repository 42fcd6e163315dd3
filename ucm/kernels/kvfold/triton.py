"""The KVfold kernels in Triton (``impl="triton"``, the default on CUDA): bf16 planes (one elementwise kernel each way,
``TILE`` values per program) and int8 groups (one kernel each way, ``TILE_GROUPS`` groups per program). Formats in
``ucm.kernels.kvfold.ops``.

int8 groups: IEEE division (``div_rn``) and round-half-even by adding and subtracting 1.5 * 2**23 (exact for
|y| < 2**22; here |y| <= 127), bf16 rounding written out in integer arithmetic (the interpreter's own conversion does
not round to nearest even). The int8 kernels call ``tl.max``, a ``@triton.jit`` library function that only the
global interpreter mode patches: on CPU tensors they need ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

from ucm.kernels.utils import launchable

TILE = 1024  # bf16 planes: values per Triton program
TILE_GROUPS = 16  # int8 groups: groups per Triton program


@triton.jit
def split_planes_kernel(
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
def merge_planes_kernel(
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


def launch_planes(kernel: Any, n: int, *tensors: torch.Tensor) -> None:
    """Launch ``split_planes_kernel`` or ``merge_planes_kernel`` over ``n`` values (the interpreter on CPU
    tensors)."""
    if n == 0:
        return
    launchable(kernel, tensors[0].device)[(triton.cdiv(n, TILE),)](*tensors, n, TILE=TILE)


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
def quantize_kernel(
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
def dequantize_kernel(
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


def launch_groups(kernel: Any, num_groups: int, group: int, *tensors: torch.Tensor) -> None:
    """Launch ``quantize_kernel`` or ``dequantize_kernel`` over ``num_groups`` groups of ``group`` values.

    Raises:
        ValueError: CPU tensors without ``TRITON_INTERPRET=1``.
    """
    if tensors[0].device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # The kernels use tl.max, a @triton.jit library function that only the global interpreter mode patches.
        raise ValueError("impl='triton' on CPU tensors needs TRITON_INTERPRET=1 (the Triton interpreter)")
    fn = launchable(kernel, tensors[0].device)
    grid = (triton.cdiv(num_groups, TILE_GROUPS),)
    fn[grid](*tensors, num_groups, GROUP=group, TILE_G=TILE_GROUPS, TILE_V=triton.next_power_of_2(group))
