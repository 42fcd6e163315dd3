"""What every kernel package shares: the ``impl`` vocabulary and its resolution, and running Triton kernels on CPU
tensors (the interpreter).

One vocabulary for every op (``impl=``)::

    "auto"       the fastest implementation for the tensors' device: "triton" on CUDA, "cpu" on CPU, "torch" on
                 other devices (XPU, NPU, ...); an op without that implementation falls back to "torch"
    "triton"     the Triton kernel; on CPU tensors it runs in the Triton interpreter (tests only: slow)
    "cpu"        the CPU fast path, whatever it is built with (numba, numpy, memmove, or torch code where nothing
                 faster exists); CPU tensors only
    "torch"      plain torch ops, any device
    "reference"  the naive oracle the tests compare against (loops; small inputs only)

Each op says in its docstring what each name runs for it; an op without one of them (e.g. no Triton kernel for a
step of a handful of torch ops) raises ``ValueError`` naming the ones it has.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any, Literal

import torch

Impl = Literal["auto", "triton", "cpu", "torch", "reference"]
IMPLS: tuple[str, ...] = ("auto", "triton", "cpu", "torch", "reference")
ALL_IMPLS: tuple[str, ...] = IMPLS[1:]  # what an op with every implementation has


def resolve_impl(impl: str, device: torch.device, available: Sequence[str] = ALL_IMPLS, op: str = "this op") -> str:
    """The implementation ``impl`` names for tensors on ``device``, among the ``available`` ones of ``op``.

    Raises:
        ValueError: ``impl`` is not one of ``IMPLS``, not available for ``op``, or ``"cpu"`` for non-CPU tensors.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {list(IMPLS)}, got {impl!r}")
    if impl == "auto":
        preferred = {"cpu": "cpu", "cuda": "triton"}.get(device.type, "torch")
        return preferred if preferred in available else "torch"
    if impl not in available:
        raise ValueError(f"{op} has no {impl!r} implementation; impl must be one of {['auto', *available]}")
    if impl == "cpu" and device.type != "cpu":
        raise ValueError(f"impl='cpu' needs CPU tensors, got device {device}")
    return impl


@functools.cache
def interpreted(fn: Any) -> Any:
    """The Triton interpreter's version of a ``@triton.jit`` kernel, for CPU tensors (what ``TRITON_INTERPRET=1``
    makes of every kernel at import; built here so CPU and CUDA tensors can use one process)."""
    from triton.runtime.interpreter import InterpretedFunction

    return fn if isinstance(fn, InterpretedFunction) else InterpretedFunction(fn.fn)


def launchable(kernel: Any, device: torch.device) -> Any:
    """``kernel`` as launched for tensors on ``device``: itself on a GPU, :func:`interpreted` on CPU."""
    return interpreted(kernel) if device.type == "cpu" else kernel


def num_warps(default: int = 4) -> int:
    """Warps per program for a launch: ``default``, or 1 under ``TRITON_INTERPRET=1``."""
    return 1 if os.environ.get("TRITON_INTERPRET") == "1" else default
