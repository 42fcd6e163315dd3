"""Compile a Triton kernel for an NVIDIA H100-class GPU (sm_90) on this CPU: lowering errors show without a GPU."""

from __future__ import annotations

from typing import Any


def compile_for_sm90(
    fn: Any, signature: dict[str, str], constexprs: dict[Any, Any], attrs: dict[Any, Any] | None = None
) -> dict[str, Any]:
    """Compile ``fn`` (a ``triton.jit`` kernel) for sm_90 and return its assembly by stage (``ptx``, ``cubin``...).

    ``signature`` maps argument names to Triton types (``"*fp32"``, ``"i64"``, ``"constexpr"``); ``constexprs`` gives
    the constexpr values; ``attrs`` optional argument attributes (e.g. 16-byte alignment).

    Raises:
        AssertionError: a compilation stage is missing from the result.
        triton.CompilationError: the kernel does not lower.
    """
    import triton
    from triton.backends.compiler import GPUTarget

    kwargs = {"attrs": attrs} if attrs is not None else {}
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, **kwargs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    assert {"ttgir", "llir", "ptx", "cubin"} <= set(compiled.asm)
    return compiled.asm
