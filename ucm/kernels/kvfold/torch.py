"""The KVfold kernels in plain torch (``impl="torch"``, any device; the default on devices other than CPU and CUDA):
the formulas of ``ucm.kernels.kvfold.ops`` in int32 / fp32 tensor arithmetic. Inputs as the ops validated them."""

from __future__ import annotations

import torch

from ucm.kernels.kvfold.naive import QMAX


def split_planes_torch(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int16 ``[n]`` bf16 bit patterns -> ``(exp, sm)`` uint8 ``[n]``."""
    v32 = words.to(torch.int32) & 0xFFFF
    exp_t = ((v32 >> 7) & 0xFF).to(torch.uint8)
    sm_t = (((v32 >> 8) & 0x80) | (v32 & 0x7F)).to(torch.uint8)
    return exp_t, sm_t


def merge_planes_torch(exp: torch.Tensor, sm: torch.Tensor, words: torch.Tensor) -> None:
    """uint8 ``exp``, ``sm`` ``[n]`` -> ``words`` int16 ``[n]``, written in place."""
    e32 = exp.reshape(-1).to(torch.int32)
    s32 = sm.reshape(-1).to(torch.int32)
    v32 = (e32 << 7) | ((s32 & 0x80) << 8) | (s32 & 0x7F)
    words.copy_((v32 - ((v32 >> 15) << 16)).to(torch.int16))  # 0..65535 as signed int16, no overflow


def group_scales(absmax: torch.Tensor) -> torch.Tensor:
    """bf16 scales ``[G]`` from fp32 group maxima ``[G]``: ``bf16(absmax / 127)``, rounded up to the next bf16 when
    rounding went down; 1.0 for an all-zero group."""
    s32 = absmax / QMAX
    s = s32.to(torch.bfloat16)
    low = s.float() < s32  # rounded down: take the next bf16 up (positive values: the next bit pattern)
    s = torch.where(low, (s.view(torch.int16) + 1).view(torch.bfloat16), s)
    return torch.where(absmax == 0, torch.ones_like(s), s)


def quantize_groups_torch(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 ``[G, group]`` -> ``(q, scale)``: int8 ``[G * group]``, bf16 ``[G]``."""
    g = rows.float()  # [G, group]
    s = group_scales(g.abs().amax(dim=1))
    q = torch.round(g / s.float()[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.reshape(-1), s


def dequantize_groups_torch(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 ``[n]`` and bf16 ``[G]`` -> bf16 ``[n]``: ``bf16(q * scale)`` per group of ``n // G`` values."""
    return (q.reshape(scale.numel(), -1).float() * scale.float()[:, None]).to(torch.bfloat16).reshape(-1)
