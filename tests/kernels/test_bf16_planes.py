"""bf16_planes: split/merge bit-exact against the per-value reference, for every bf16 bit pattern."""

from __future__ import annotations

import os

import pytest
import torch

from tests.kernels.sm90 import compile_for_sm90
from ucm.kernels.kvfold import (
    merge_bf16_planes,
    merge_bf16_planes_reference,
    split_bf16_planes,
    split_bf16_planes_reference,
)
from ucm.kernels.kvfold.cpu import merge_planes_numpy, split_planes_numpy

# "numpy": the numba-free numpy version in kvfold.cpu, reached by no impl= name (see split/merge below).
IMPLS = ["triton", "cpu", "numpy", "torch", "reference"]
SIZES = [1, 7, 1000, 4099]


def all_patterns() -> torch.Tensor:
    """All 65,536 bf16 bit patterns: NaN payloads, +-inf, +-0.0, subnormals."""
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def split(x: torch.Tensor, impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    if impl == "numpy":
        return split_planes_numpy(x.reshape(-1).view(torch.int16))
    return split_bf16_planes(x, impl=impl)  # type: ignore[arg-type]


def merge(exp: torch.Tensor, sm: torch.Tensor, out: torch.Tensor, impl: str) -> None:
    if impl == "numpy":
        merge_planes_numpy(exp, sm, out.reshape(-1).view(torch.int16))
    else:
        assert merge_bf16_planes(exp, sm, out=out, impl=impl) is out  # type: ignore[arg-type]


@pytest.mark.parametrize("impl", IMPLS)
def test_all_patterns_split_matches_reference_and_merges_back(impl: str) -> None:
    x = all_patterns()
    exp, sm = split(x, impl)
    ref_exp, ref_sm = split_bf16_planes_reference(x)
    assert torch.equal(exp, ref_exp) and torch.equal(sm, ref_sm)
    out = torch.full((x.numel(),), float("nan"), dtype=torch.bfloat16)
    merge(exp, sm, out, impl)
    assert torch.equal(out.view(torch.int16), x.view(torch.int16))
    assert torch.equal(merge_bf16_planes_reference(exp, sm).view(torch.int16), x.view(torch.int16))


def test_fields() -> None:
    # -1.5 = sign 1, exponent 127, mantissa 0b1000000
    exp, sm = split_bf16_planes(torch.tensor([-1.5, 0.0, -0.0], dtype=torch.bfloat16))
    assert exp.tolist() == [127, 0, 0]
    assert sm.tolist() == [0x80 | 0x40, 0, 0x80]


@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("impl", IMPLS)
def test_uint8_input_and_odd_sizes(impl: str, n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    raw = torch.randint(0, 256, (2 * n,), dtype=torch.uint8, generator=gen)
    exp, sm = split(raw, impl)
    ref = split_bf16_planes_reference(raw)
    assert torch.equal(exp, ref[0]) and torch.equal(sm, ref[1])
    out = torch.full((2 * n,), 0xA5, dtype=torch.uint8)
    merge(exp, sm, out, impl)
    assert torch.equal(out, raw)


def test_bad_inputs() -> None:
    with pytest.raises(TypeError, match="float32"):
        split_bf16_planes(torch.zeros(4))
    with pytest.raises(ValueError, match="whole 16-bit"):
        split_bf16_planes(torch.zeros(5, dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous"):
        split_bf16_planes(torch.zeros(4, 4, dtype=torch.bfloat16).t())
    with pytest.raises(ValueError, match="impl"):
        split_bf16_planes(torch.zeros(4, dtype=torch.bfloat16), impl="cuda")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"impl must be one of .*, got 'numpy'"):  # numpy is no impl= name
        split_bf16_planes(torch.zeros(4, dtype=torch.bfloat16), impl="numpy")  # type: ignore[arg-type]
    e = torch.zeros(4, dtype=torch.uint8)
    with pytest.raises(ValueError, match="must match"):
        merge_bf16_planes(e, torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="hold 4"):
        merge_bf16_planes(e, e, out=torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="exp"):
        merge_bf16_planes(e.to(torch.int16), e)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 replaces @triton.jit")
@pytest.mark.parametrize("kernel", ["split", "merge"])
def test_kernel_compiles_for_sm90(kernel: str) -> None:
    """``triton.compile`` down to PTX and cubin (ptxas ships with triton) for an H100/H200 target."""
    from ucm.kernels.kvfold.triton import TILE, merge_planes_kernel, split_planes_kernel

    if kernel == "split":
        fn, sig = split_planes_kernel, {"words_ptr": "*i16", "exp_ptr": "*u8", "sm_ptr": "*u8"}
    else:
        fn, sig = merge_planes_kernel, {"exp_ptr": "*u8", "sm_ptr": "*u8", "words_ptr": "*i16"}
    compile_for_sm90(
        fn,
        {**sig, "n": "i64", "TILE": "constexpr"},
        {"TILE": TILE},
        attrs={(i,): [["tt.divisibility", 16]] for i in range(3)},
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_triton_matches_reference() -> None:
    x = all_patterns().cuda()
    exp, sm = split_bf16_planes(x)
    ref = split_bf16_planes_reference(x)
    assert torch.equal(exp.cpu(), ref[0]) and torch.equal(sm.cpu(), ref[1])
    assert torch.equal(merge_bf16_planes(exp, sm).view(torch.int16).cpu(), x.view(torch.int16).cpu())
