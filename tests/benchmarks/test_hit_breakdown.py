"""Tests of ``benchmarks/hit_breakdown.py``: the exclusive phase timer, and the script itself on the tiny model
(two real engine processes, a real store directory)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from tests.benchmarks import BENCHMARKS, load_script
from ucm.testing.models import ensure_tiny_llama


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("hit_breakdown")


class _Calls:
    def outer(self) -> None:
        time.sleep(0.02)
        self.inner()

    def inner(self) -> None:
        time.sleep(0.03)


def test_phases_are_exclusive(bench: ModuleType) -> None:
    timer = bench.PhaseTimer()
    calls = _Calls()
    timer.wrap(calls, "outer", "a")
    timer.wrap(calls, "inner", "b")
    t0 = time.perf_counter()
    calls.outer()
    wall_ms = (time.perf_counter() - t0) * 1e3
    assert timer.calls == {"a": 1, "b": 1}
    assert timer.ms["a"] >= 20 and timer.ms["b"] >= 30
    assert timer.ms["a"] + timer.ms["b"] == pytest.approx(wall_ms, abs=2)  # a without b (else over by >= 30 ms)


def test_engines_alternate_which_runs_first(bench: ModuleType) -> None:
    orders = bench.engine_orders(3)
    assert orders == [("without", "with"), ("with", "without"), ("without", "with")]


@pytest.mark.engine
def test_breakdown_on_the_tiny_model(tmp_path: Path) -> None:
    model = ensure_tiny_llama(Path("models"))
    out = tmp_path / "breakdown.json"
    cmd = [
        sys.executable, str(BENCHMARKS / "hit_breakdown.py"), "--model", str(model), "--prompt-tokens", "300",
        "--repeats", "2", "--rounds", "1", "--max-model-len", "512", "--dtype", "float32", "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary == json.loads(out.read_text())
    assert summary["problems"] == []
    conds = summary["conditions"]
    assert set(conds) == {
        "cold_first_without_ucm", "cold_without_ucm", "inmemory_hit",
        "cold_first_with_ucm", "cold_with_ucm", "dram_hit", "storage_hit",
    }  # fmt: skip
    for name, c in conds.items():
        assert c["n"] == (1 if name.startswith("cold_first") else 2), name
        assert c["phases_ms"]["forward"] > 0 and c["steps"] >= 1, name
    for name in ("dram_hit", "storage_hit"):  # UCM loaded and scattered; nothing of UCM in vLLM's own hit
        assert conds[name]["phases_ms"]["ucm_scatter"] > 0 and conds[name]["phases_ms"]["ucm_load"] > 0
    assert conds["storage_hit"]["store_ms"]["storage"] > 0 and conds["dram_hit"]["store_ms"].get("storage", 0) == 0
    assert (
        conds["cold_with_ucm"]["phases_ms"]["ucm_gather"] > 0 and conds["cold_with_ucm"]["phases_ms"]["ucm_lookup"] > 0
    )
    assert all(conds["inmemory_hit"]["phases_ms"][p] == 0 for p in ("ucm_scatter", "ucm_gather", "ucm_lookup"))
    assert set(summary["ratios"]) == {
        "dram_over_inmemory",
        "storage_over_inmemory",
        "cold_overhead",
        "cold_first_overhead",
        "dram_over_inmemory_same_forward",
        "storage_over_inmemory_same_forward",
        "cold_ucm_share",
        "cold_first_ucm_share",
    }
    assert conds["cold_with_ucm"]["ucm_ms"] > 0 and conds["inmemory_hit"]["ucm_ms"] == 0
    assert all(r > 0 for r in summary["ratios"].values())
