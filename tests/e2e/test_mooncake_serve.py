"""Two `vllm serve` instances with UCM share their DRAM through a real Mooncake master (issue 34): one hits the
other's blocks with the same answer; the holder killed, then the master killed, each answer is still the right one
(``tests/e2e/mooncake_serve_case.py``, run in a loopback-only network namespace)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.store.test_mooncake import REASON
from ucm.testing.mooncake import loopback_netns_argv

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.engine, pytest.mark.skipif(REASON is not None, reason=REASON or "")]


def test_two_instances_share_dram_through_mooncake(real_model: Path, tmp_path: Path) -> None:
    run = subprocess.run(
        loopback_netns_argv([sys.executable, "-m", "tests.e2e.mooncake_serve_case", str(real_model), str(tmp_path)]),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    output = run.stdout + run.stderr
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob("*.log")))
    assert run.returncode == 0 and "scenario ok" in run.stdout, output[-6000:] + logs
    assert "B hit" in run.stdout and "A killed" in run.stdout and "master killed" in run.stdout
