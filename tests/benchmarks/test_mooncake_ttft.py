"""Tests of ``benchmarks/mooncake_ttft.py``: a tiny run (one short prompt, no pauses; its own network namespace,
master and three ``vllm serve`` instances) ends with a JSON summary holding every figure, TTFT3 a real hit through
the pool, and no problems."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks import BENCHMARKS
from tests.store.test_mooncake import REASON

pytestmark = [pytest.mark.engine, pytest.mark.skipif(REASON is not None, reason=REASON or "")]


def test_tiny_run_reports_every_figure_with_real_hits(real_model: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / "mooncake_ttft.py"), "--models-dir", str(real_model.parent),
         "--prompts", "1", "--prompt-tokens", "300", "--gap-s", "0.2", "--min-idle", "0"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-6000:] + run.stdout[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["problems"] == [], summary["problems"]
    phases = ["ttft1", "ttft2", "ttft3", "ttft_storage"]
    assert list(summary["ttft_ms"]) == phases and all(summary["ttft_ms"][ph] > 0 for ph in phases)
    assert summary["ratio_ttft3_over_ttft2"] > 0 and summary["ratio_ttft1_over_ttft3"] > 0
    hits = summary["hits"]
    assert hits["ttft1"]["hit_external"] == [0]
    for ph in phases[1:]:  # every full block from UCM, none from vLLM's prefix cache
        assert hits[ph]["hit_external"] == hits[ph]["total_blocks"] and hits[ph]["total_blocks"][0] >= 2
        assert hits[ph]["hit_hbm"] == [0]
    # TTFT3 read instance 1's blocks from the pool, from instance 1's segment; TTFT2 and the storage hit did not.
    assert hits["ttft3"]["pool_gets"][0] >= hits["ttft3"]["hit_external"][0]
    assert hits["ttft2"]["pool_gets"] == [0] and hits["ttft_storage"]["pool_gets"] == [0]
    pool = summary["pool"]
    assert set(pool["objects_by_segment"]) == {"instance1"} and pool["keys_after_master_restart"] == 0
    assert summary["machine"]["nproc"] >= 1
