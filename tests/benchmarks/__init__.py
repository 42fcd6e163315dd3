"""Tests of the scripts in ``benchmarks/``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_script(name: str) -> ModuleType:
    """Import ``benchmarks/<name>.py`` as module ``bench_<name>`` (the scripts are not a package); it is registered
    in ``sys.modules``, as dataclasses need."""
    module_name = f"bench_{name}"
    spec = importlib.util.spec_from_file_location(module_name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module
