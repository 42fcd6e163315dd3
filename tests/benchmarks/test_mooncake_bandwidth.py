"""Tests of ``benchmarks/mooncake_bandwidth.py``: a tiny run (its own network namespace and master) ends with a JSON
summary holding every figure and one paired ratio per round."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.benchmarks import BENCHMARKS
from tests.store.test_mooncake import REASON

pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


def test_tiny_run_reports_every_figure_and_paired_ratios() -> None:
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / "mooncake_bandwidth.py"), "--block-mib", "0.25", "--blocks", "4",
         "--rounds", "2"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["block_bytes"] == 2**18 and summary["blocks"] == 4 and summary["rounds"] == 2
    assert set(summary["gbps"]) == {"raw_put", "raw_get", "stage_dump", "stage_load"}
    assert all(v > 0 for v in summary["gbps"].values())
    assert [len(v) for v in summary["ratio_samples"].values()] == [2, 2]
    assert summary["ratio_dump_vs_put"] > 0 and summary["ratio_load_vs_get"] > 0
