"""int8_groups: fixed-rate quantization against the per-group reference, and its documented error bound."""

from __future__ import annotations

import pytest
import torch

from ucm.kernels.int8_groups import (
    dequantize_int8_groups,
    dequantize_int8_groups_reference,
    quantize_int8_groups,
    quantize_int8_groups_reference,
)

GROUPS = [64, 7, 128]


def kv_like(n_groups: int, group: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scale = torch.rand((n_groups, 1), generator=gen) * 10 + 1e-3
    x = torch.randn((n_groups, group), generator=gen) * scale
    x[0] = 0.0  # an all-zero group
    x[1, 0] = 3e-39  # a subnormal
    x[2] = torch.rand(group, generator=gen) * 1e30  # a huge group
    return x.to(torch.bfloat16).reshape(-1)


@pytest.mark.parametrize("group", GROUPS, ids=lambda g: f"g{g}")
def test_matches_reference_and_bound(group: int) -> None:
    x = kv_like(37, group, seed=group)
    q, s = quantize_int8_groups(x, group)
    q_ref, s_ref = quantize_int8_groups_reference(x, group)
    assert torch.equal(q, q_ref)
    assert torch.equal(s.view(torch.int16), s_ref.view(torch.int16))
    out = torch.full((x.numel(),), float("nan"), dtype=torch.bfloat16)
    dequantize_int8_groups(q, s, out=out)
    assert torch.equal(out.view(torch.int16), dequantize_int8_groups_reference(q, s).view(torch.int16))
    assert int(q.abs().max()) <= 127 and bool((s.float() > 0).all())
    # Documented bound: |x - x'| <= s / 2 + |x'| * 2**-8 (plus fp32 slack)
    xf, yf = x.float().reshape(-1, group), out.float().reshape(-1, group)
    bound = s.float()[:, None] / 2 * (1 + 1e-6) + yf.abs() * 2**-8
    assert bool(((xf - yf).abs() <= bound).all())
    assert torch.equal(out.reshape(-1, group)[0].float(), torch.zeros(group))


def test_bad_inputs() -> None:
    with pytest.raises(TypeError, match="bfloat16"):
        quantize_int8_groups(torch.zeros(64), 64)
    with pytest.raises(ValueError, match="divide"):
        quantize_int8_groups(torch.zeros(65, dtype=torch.bfloat16), 64)
    with pytest.raises(ValueError, match="divide"):
        dequantize_int8_groups(torch.zeros(65, dtype=torch.int8), torch.ones(2, dtype=torch.bfloat16))
