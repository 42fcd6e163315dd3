"""vLLM's fused CPU RMSNorm kernels as a provider of vLLM's IR ops, for CacheBlend's eager calls of the model's layers.

vLLM computes RMSNorm through its IR ops ``vllm.ir.ops.rms_norm`` and ``vllm.ir.ops.fused_add_rms_norm``. On CPU
their only provider is the native torch implementation, which ``torch.compile`` fuses when it compiles the model.
CacheBlend calls the decoder layers eagerly (``ucm.integration.vllm.blend``), where the native implementation is a
chain of separate float32 ops over the whole batch: cast, add, square, mean, rsqrt, multiply, cast. vLLM's CPU build
also ships fused C++ kernels for both (``torch.ops._C.rms_norm``, ``torch.ops._C.fused_add_rms_norm``), but
vLLM's IR registry offers them to GPU platforms only.

:func:`register_cpu_norms` registers those kernels as provider :data:`PROVIDER` of both IR ops, through vLLM's
extension point (``IrOp.register_impl``). :func:`cpu_norms` puts that provider first for the length of a ``with``
block, with the native implementation as the fallback for what it does not take (see ``_supports_*``). vLLM's
own passes keep their priority: nothing changes outside the block.

Numerics: the C++ kernels round once, to the activations' dtype; the native implementation rounds the normalized
value before it multiplies by the weight. So in bfloat16 and float16 outputs can differ by one unit in the last
place; in float32 only the summation order differs.
"""

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import Tensor

PROVIDER = "ucm_cpu"


def _supports_rms_norm(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> bool:
    return (
        variance_size is None
        and weight is not None
        and weight.dtype == x.dtype
        and x.device.type == "cpu"
        and x.is_contiguous()
    )


def _supports_fused_add_rms_norm(
    x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None
) -> bool:
    return _supports_rms_norm(x, weight, epsilon, variance_size) and x_residual.is_contiguous()


def _rms_norm(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
    out = torch.empty_like(x)
    torch.ops._C.rms_norm(out, x, weight, epsilon)
    return out


def _fused_add_rms_norm(
    x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None
) -> tuple[Tensor, Tensor]:
    torch.ops._C.fused_add_rms_norm(x, x_residual, weight, epsilon)  # in place: x normalized, x_residual = x + it
    return x, x_residual


def _kernels_present() -> bool:
    import vllm._custom_ops  # noqa: F401  (loads vLLM's C++ extension, which registers torch.ops._C)

    ops = torch.ops._C
    return hasattr(ops, "rms_norm") and hasattr(ops, "fused_add_rms_norm")


@functools.cache
def register_cpu_norms() -> bool:
    """Register :data:`PROVIDER` for ``vllm.ir.ops.rms_norm`` and ``fused_add_rms_norm`` (once per process; later
    calls return the first call's answer). Call it before
    vLLM's worker sets its op priorities (UCM's ``vllm.general_plugins`` entry point does), or vLLM logs a warning
    that an impl was registered while a priority was set. Returns whether the provider is usable here: vLLM's CPU
    platform with the C++ kernels present."""
    from vllm import ir
    from vllm.platforms import current_platform

    supported = current_platform.is_cpu() and _kernels_present()
    if PROVIDER not in ir.ops.rms_norm.impls:
        ir.ops.rms_norm.register_impl(PROVIDER, supported=supported, supports_args=_supports_rms_norm)(_rms_norm)
    if PROVIDER not in ir.ops.fused_add_rms_norm.impls:
        ir.ops.fused_add_rms_norm.register_impl(
            PROVIDER, supported=supported, supports_args=_supports_fused_add_rms_norm, inplace=True
        )(_fused_add_rms_norm)
    return bool(ir.ops.rms_norm.impls[PROVIDER].supported and ir.ops.fused_add_rms_norm.impls[PROVIDER].supported)


@contextlib.contextmanager
def cpu_norms() -> Iterator[None]:
    """Within the block, vLLM's RMSNorm IR ops run vLLM's fused CPU kernels where they take the arguments, else the
    native implementation (the priority before the block is restored after it). Where the provider is not usable
    (:func:`register_cpu_norms` is False), a no-op."""
    from vllm import ir

    if not register_cpu_norms():
        yield
        return
    with (
        ir.ops.rms_norm.set_priority([PROVIDER, "native"]),
        ir.ops.fused_add_rms_norm.set_priority([PROVIDER, "native"]),
    ):
        yield
