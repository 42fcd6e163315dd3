"""vLLM's fused CPU RMSNorm kernels as provider ``ucm_cpu`` of vLLM's IR ops (``ucm.integration.vllm.cpu_norms``),
used by CacheBlend's eager calls of the model's layers: inside ``cpu_norms()`` the IR ops run the C++ kernels
(within rounding of vLLM's native implementation, their reference), outside it vLLM's own priority holds, and what
the kernels do not take (non-contiguous activations) falls back to the native implementation."""

from __future__ import annotations

import pytest
import torch

vllm_ir = pytest.importorskip("vllm.ir")

from ucm.integration.vllm.cpu_norms import PROVIDER, cpu_norms, register_cpu_norms  # noqa: E402

# (rtol, atol) of the kernels against the native implementation: float32 differs in summation order only; bfloat16
# and float16 by one rounding (the native implementation rounds before multiplying by the weight).
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2**-7, 2**-6), torch.float16: (2**-10, 2**-9)}


def _inputs(dtype: torch.dtype, rows: int = 37) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(rows, 576, generator=g) * 3).to(dtype)
    residual = torch.randn(rows, 576, generator=g).to(dtype)
    weight = torch.randn(576, generator=g).to(dtype)
    return x, residual, weight


def test_registered_once_and_usable_on_cpu() -> None:
    assert register_cpu_norms() and register_cpu_norms()
    assert PROVIDER in vllm_ir.ops.rms_norm.impls and PROVIDER in vllm_ir.ops.fused_add_rms_norm.impls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_inside_the_block_the_ops_run_vllms_cpu_kernels(dtype: torch.dtype) -> None:
    ops = vllm_ir.ops
    x, residual, weight = _inputs(dtype)
    native_fused = ops.fused_add_rms_norm.impls["native"].impl_fn(x.clone(), residual.clone(), weight, 1e-5)
    native = ops.rms_norm.impls["native"].impl_fn(x, weight, 1e-5)
    # vLLM's C++ kernels called directly: what the provider must give
    want_x, want_residual = x.clone(), residual.clone()
    torch.ops._C.fused_add_rms_norm(want_x, want_residual, weight, 1e-5)
    want = torch.empty_like(x)
    torch.ops._C.rms_norm(want, x, weight, 1e-5)
    before = ops.rms_norm.get_priority(), ops.fused_add_rms_norm.get_priority()
    with cpu_norms():
        assert ops.rms_norm.get_priority() == ops.fused_add_rms_norm.get_priority() == [PROVIDER, "native"]
        got_x, got_residual = ops.fused_add_rms_norm.maybe_inplace(x.clone(), residual.clone(), weight, 1e-5)
        got = ops.rms_norm(x, weight, 1e-5)
    assert (ops.rms_norm.get_priority(), ops.fused_add_rms_norm.get_priority()) == before  # restored
    assert torch.equal(got_x, want_x) and torch.equal(got_residual, want_residual) and torch.equal(got, want)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got_x, native_fused[0], rtol=rtol, atol=atol)
    torch.testing.assert_close(got_residual, native_fused[1], rtol=0, atol=0)  # x + residual, rounded once
    torch.testing.assert_close(got, native, rtol=rtol, atol=atol)
    if dtype != torch.float32:  # the kernels really ran: their single rounding differs from native somewhere
        assert not torch.equal(got, native)


def test_non_contiguous_activations_fall_back_to_native() -> None:
    ops = vllm_ir.ops
    x, _, weight = _inputs(torch.bfloat16, rows=74)
    strided = x[::2]
    assert not strided.is_contiguous()
    with cpu_norms():
        got = ops.rms_norm(strided, weight, 1e-5)
    assert torch.equal(got, ops.rms_norm.impls["native"].impl_fn(strided, weight, 1e-5))
