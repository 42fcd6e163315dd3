"""int8_groups: fixed-rate quantization against the per-group reference, and its documented error bound."""

from __future__ import annotations

import os

import pytest
import torch

from tests.kernels.sm90 import compile_for_sm90
from ucm.kernels.kvfold import (
    dequantize_int8_groups,
    dequantize_int8_groups_reference,
    quantize_int8_groups,
    quantize_int8_groups_reference,
)

GROUPS = [64, 7, 128]
IMPLS = [
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(
            os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton kernels on CPU need TRITON_INTERPRET=1"
        ),
    ),
    "cpu",
    "torch",
    "reference",
]


def kv_like(n_groups: int, group: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scale = torch.rand((n_groups, 1), generator=gen) * 10 + 1e-3
    x = torch.randn((n_groups, group), generator=gen) * scale
    x[0] = 0.0  # an all-zero group
    x[1, 0] = 3e-39  # a subnormal
    x[2] = torch.rand(group, generator=gen) * 1e30  # a huge group
    return x.to(torch.bfloat16).reshape(-1)


@pytest.mark.parametrize("group", GROUPS, ids=lambda g: f"g{g}")
@pytest.mark.parametrize("impl", IMPLS)
def test_matches_reference_and_bound(impl: str, group: int) -> None:
    x = kv_like(37, group, seed=group)
    q, s = quantize_int8_groups(x, group, impl=impl)  # type: ignore[arg-type]
    q_ref, s_ref = quantize_int8_groups_reference(x, group)
    assert torch.equal(q, q_ref)
    assert torch.equal(s.view(torch.int16), s_ref.view(torch.int16))
    out = torch.full((x.numel(),), float("nan"), dtype=torch.bfloat16)
    dequantize_int8_groups(q, s, out=out, impl=impl)  # type: ignore[arg-type]
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
    with pytest.raises(ValueError, match="impl"):
        quantize_int8_groups(torch.zeros(64, dtype=torch.bfloat16), 64, impl="gpu")  # type: ignore[arg-type]
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            quantize_int8_groups(torch.zeros(64, dtype=torch.bfloat16), 64, impl="triton")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 replaces @triton.jit")
@pytest.mark.parametrize("kernel", ["quantize", "dequantize"])
def test_kernel_compiles_for_sm90(kernel: str) -> None:
    """``triton.compile`` down to PTX and cubin for an H100/H200 target (head_dim 128 groups)."""
    from ucm.kernels.kvfold.triton import TILE_GROUPS, dequantize_kernel, quantize_kernel

    if kernel == "quantize":
        fn, sig = quantize_kernel, {"x_ptr": "*bf16", "q_ptr": "*i8", "s_ptr": "*i16"}
    else:
        fn, sig = dequantize_kernel, {"q_ptr": "*i8", "s_ptr": "*bf16", "x_ptr": "*i16"}
    const = {"GROUP": 128, "TILE_G": TILE_GROUPS, "TILE_V": 128}
    asm = compile_for_sm90(
        fn,
        {**sig, "num_groups": "i64", **dict.fromkeys(const, "constexpr")},
        const,
        attrs={(i,): [["tt.divisibility", 16]] for i in range(3)},
    )
    if kernel == "quantize":
        assert "div.rn.f32" in asm["ptx"]  # IEEE division, as the reference


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_triton_matches_reference() -> None:
    x = kv_like(37, 64, seed=5)
    q, s = quantize_int8_groups(x.cuda(), 64)
    q_ref, s_ref = quantize_int8_groups_reference(x, 64)
    assert torch.equal(q.cpu(), q_ref) and torch.equal(s.cpu().view(torch.int16), s_ref.view(torch.int16))
    y = dequantize_int8_groups(q, s)
    assert torch.equal(y.cpu().view(torch.int16), dequantize_int8_groups_reference(q_ref, s_ref).view(torch.int16))
