"""Make UCM's ``vllm.general_plugins`` entry point visible to engine subprocesses when the package metadata lacks it.

The entry point lives in ``pyproject.toml`` and exists once the package is (re)installed (``pip install -e .``). A
checkout whose installed metadata predates it (an editable install of another tree) can still run the plugin in an
engine subprocess: :func:`plugin_env` writes a minimal ``*.dist-info`` directory declaring the same entry point into
a temporary directory and puts it on ``PYTHONPATH``, where ``importlib.metadata`` (which vLLM uses to find plugins)
discovers it. Nothing is installed and nothing outside the temporary directory changes.
"""

from __future__ import annotations

import functools
import os
import tempfile
from importlib.metadata import entry_points
from pathlib import Path

from ucm.integration.vllm.plugin import ENTRY_POINT, PLUGIN_NAME

GROUP = "vllm.general_plugins"


def entry_point_installed() -> bool:
    """Whether this interpreter's package metadata declares UCM's plugin entry point."""
    return any(ep.name == PLUGIN_NAME and ep.value == ENTRY_POINT for ep in entry_points(group=GROUP))


@functools.cache
def _dist_info_dir() -> str:
    root = Path(tempfile.mkdtemp(prefix="ucm_plugin_"))
    info = root / "ucm_sparse_plugin-0.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ucm-sparse-plugin\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text(f"[{GROUP}]\n{PLUGIN_NAME} = {ENTRY_POINT}\n")
    return str(root)


def plugin_env() -> dict[str, str]:
    """Environment additions for an engine subprocess so that it loads UCM's plugin (empty when installed)."""
    if entry_point_installed():
        return {}
    paths = [_dist_info_dir(), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    return {"PYTHONPATH": os.pathsep.join(paths)}
