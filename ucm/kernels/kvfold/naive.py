"""Naive references of the KVfold kernels (``impl="reference"``; the test oracles), one value or one group at a time:
they are also the definition of both formats (see ``ucm.kernels.kvfold.ops``). Small inputs only."""

from __future__ import annotations

import torch

QMAX = 127  # int8_groups: quantized values lie in [-QMAX, QMAX]


def split_bf16_planes_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Test oracle of ``split_bf16_planes`` (``x``: contiguous bf16, another 16-bit dtype, or uint8 bytes of an even
    count): ``(exp, sm)`` uint8 ``[n]`` on CPU, one value at a time over Python ints."""
    values = [int(v) & 0xFFFF for v in x.reshape(-1).view(torch.int16).cpu().tolist()]
    exp = [(v >> 7) & 0xFF for v in values]
    sm = [((v >> 15) << 7) | (v & 0x7F) for v in values]
    return torch.tensor(exp, dtype=torch.uint8), torch.tensor(sm, dtype=torch.uint8)


def merge_bf16_planes_reference(exp: torch.Tensor, sm: torch.Tensor) -> torch.Tensor:
    """Test oracle of ``merge_bf16_planes``: uint8 ``exp``, ``sm`` ``[n]`` -> bf16 ``[n]`` on CPU, one value at a
    time over Python ints."""
    words = []
    for e, s in zip(exp.cpu().tolist(), sm.cpu().tolist(), strict=True):
        v = (e << 7) | ((s >> 7) << 15) | (s & 0x7F)
        words.append(v - 0x10000 if v >= 0x8000 else v)  # as a signed int16
    return torch.tensor(words, dtype=torch.int16).view(torch.bfloat16)


def quantize_int8_groups_reference(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Test oracle of ``quantize_int8_groups`` (``x``: contiguous finite bf16, ``n`` values, ``group`` divides
    ``n``): ``(q, scale)``, int8 ``[n]`` and bf16 ``[n // group]``, one group at a time."""
    qs, ss = [], []
    for row in x.reshape(-1, group):
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
    if not qs:
        return torch.empty(0, dtype=torch.int8), torch.empty(0, dtype=torch.bfloat16)
    return torch.cat(qs), torch.cat(ss)


def dequantize_int8_groups_reference(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Test oracle of ``dequantize_int8_groups``: ``q`` int8 ``[n]``, ``scale`` bf16 ``[n // group]`` -> bf16
    ``[n]``, ``bf16(q * scale)``, one group at a time."""
    group = q.numel() // scale.numel()
    parts = [
        (q[i * group : (i + 1) * group].float() * scale[i].float()).to(torch.bfloat16) for i in range(scale.numel())
    ]
    return torch.cat(parts)
