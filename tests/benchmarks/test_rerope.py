"""Tests of ``benchmarks/rerope.py``: a tiny run (one length, one prompt, two engines) ends with a JSON summary whose
figures are positive and whose ratios follow from them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.benchmarks import BENCHMARKS

pytestmark = pytest.mark.engine


def test_tiny_run_reports_ttft_and_decode_for_both_engines() -> None:
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / "rerope.py"), "--lengths", "256", "--repeats", "1", "--max-tokens", "4"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    row = summary["per_length"]["256"]
    for name in ("dense", "rerope"):
        assert row[name]["ttft_ms"] > 0 and row[name]["decode_ms_per_token"] > 0
        assert row[name]["generated_tokens"] == [4]
    assert row["ttft_ratio"] == round(row["rerope"]["ttft_ms"] / row["dense"]["ttft_ms"], 3)
    assert summary["window"] == 128 and summary["benchmark"] == "rerope"
