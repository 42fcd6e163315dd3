"""The `vllm` package metadata that `make setup` writes (tools/vllm_metadata.py) for vLLM's CPU wheel.

The real venv's metadata is checked as it is (vLLM's own CLI reads it); the refusals run the script and the
connector's check against stale or foreign metadata placed first on ``sys.path`` in a temp directory, so the venv
is never changed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO
from ucm.integration.vllm.version import VllmVersionMismatchError, check_vllm_metadata

SCRIPT = REPO / "tools" / "vllm_metadata.py"
VLLM_CLI = Path(sys.executable).parent / "vllm"


def fake_dist(site: Path, version: str, installer: str) -> None:
    """A ``vllm-<version>.dist-info`` under ``site`` written by ``installer``."""
    info = site / f"vllm-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    (info / "INSTALLER").write_text(installer + "\n")


def run_script(*args: str, site: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=120)


def test_the_venv_metadata_matches_and_the_cli_runs() -> None:
    from vllm import __version__

    assert check_vllm_metadata() == __version__
    assert run_script("--check").returncode == 0
    out = subprocess.run([str(VLLM_CLI), "--version"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == f"{__version__}+cpu"


def test_stale_metadata_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_dist(tmp_path, "0.31.0+cpu", "ucm-tools-vllm-metadata")
    check = run_script("--check", site=tmp_path)
    assert check.returncode == 1 and "0.31.0+cpu" in check.stderr and "run `make setup`" in check.stderr
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    importlib.invalidate_caches()
    with pytest.raises(VllmVersionMismatchError, match=r"metadata 'vllm' says version '0.31.0\+cpu' but .* '0.32"):
        check_vllm_metadata()


def test_a_foreign_vllm_distribution_is_never_overwritten(tmp_path: Path) -> None:
    fake_dist(tmp_path, "0.32.0", "pip")  # a real vllm install (owns code): not this script's to replace
    for args in ((), ("--check",)):
        out = run_script(*args, site=tmp_path)
        assert out.returncode != 0 and "refusing to write metadata over a real vllm install" in out.stderr
