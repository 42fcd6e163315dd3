"""Tests of ``benchmarks/soak.py``: the output comparison, the option errors, and its short form on the tiny model
(real ``vllm serve`` instances on one store and a reference, concurrent clients, every kind of fault)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.benchmarks import BENCHMARKS, load_script
from ucm.config import UcmConfig
from ucm.testing.models import ensure_tiny_llama

SCRIPT = BENCHMARKS / "soak.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("soak")


def test_compare_tells_near_ties_from_mismatches(bench: ModuleType) -> None:
    top = [{"a": -0.1, "b": -3.0}, {"c": -0.70, "d": -0.71}]
    assert bench.compare([1, 2], [1, 2], top, 0.05) == "matched"
    assert bench.compare([1, 3], [1, 2], top, 0.05) == "near_tie"  # the reference hesitated at token 1
    assert bench.compare([9, 2], [1, 2], top, 0.05) == "mismatched"  # it did not at token 0
    assert bench.compare([1], [1, 2], top, 0.05) == "near_tie"  # shorter: differs at 1
    assert bench.compare([1, 3], [1, 2], top, 0.001) == "mismatched"


def test_rss_growth_is_taken_within_one_incarnation(bench: ModuleType) -> None:
    rows = [
        {"t_s": 10, "ucm0_rss_mib": 100.0, "ucm0_incarnation": 0},
        {"t_s": 60, "ucm0_rss_mib": 110.0, "ucm0_incarnation": 0},
        {"t_s": 70, "ucm0_rss_mib": 90.0, "ucm0_incarnation": 1},  # restarted after mid-run
        {"t_s": 100, "ucm0_rss_mib": 99.0, "ucm0_incarnation": 1},
    ]
    assert bench.rss_growth_last_half(rows, 1) == {"ucm0": 0.1}
    for r, ref in zip(rows, (500.0, 520.0, 530.0, 546.0), strict=True):
        r["reference_rss_mib"] = ref
    assert bench.rss_growth_last_half(rows, 1) == {"ucm0": 0.1, "reference": 0.05}  # from t=60 s (mid-run: 50 s)
    for r, anon in zip(rows, (50.0, 40.0, 30.0, 36.0), strict=True):  # a part of RSS, from the same rows
        r["ucm0_anon_mib"] = anon
    assert bench.rss_growth_last_half(rows, 1, "anon") == {"ucm0": 0.2}


def test_group_usage_splits_rss_into_its_parts(bench: ModuleType) -> None:
    usage, fds = bench.group_usage([os.getpid(), 2**22 + 1])  # the second: no such process, skipped
    assert set(usage) == {"rss", "anon", "file", "shmem"} and fds > 0
    assert usage["anon"] > 0 and usage["file"] > 0
    assert usage["rss"] == pytest.approx(usage["anon"] + usage["file"] + usage["shmem"], abs=0.3)


def test_bad_options_are_named(bench: ModuleType, capsys: Any) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(["--faults", "kill", "meteor"])
    assert "--faults meteor: unknown; allowed: corrupt, truncate" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--malloc", "jemalloc"])
    assert "--malloc jemalloc: unknown; allowed: auto, tcmalloc, glibc" in capsys.readouterr().err
    assert bench.parse_args([]).malloc in ("tcmalloc", "glibc")  # auto, resolved
    with pytest.raises(SystemExit):
        bench.parse_args(["--dram-gb", "0.2", "--prefault-gb", "0.5"])
    assert "--prefault-gb 0.5: allowed 0 .. --dram-gb (0.2)" in capsys.readouterr().err


def test_dram_tier_is_prefaulted_in_full_by_default(bench: ModuleType, tmp_path: Path) -> None:
    args = bench.parse_args(["--dram-gb", "0.2"])
    assert args.prefault_gb == 0.2
    config = bench.ucm_config(tmp_path, args.dram_gb, 1.0, None, args.prefault_gb)
    assert config["ucm_connectors"][0]["ucm_connector_config"]["cache_prefault_gb"] == 0.2
    UcmConfig.model_validate(config)  # a config UCM accepts


@pytest.mark.engine
def test_short_soak_loses_nothing(tmp_path: Path) -> None:
    model = ensure_tiny_llama(Path("models"))
    out = tmp_path / "soak.json"
    cmd = [
        sys.executable, str(SCRIPT), "--model", str(model), "--duration-s", "50", "--concurrency", "6",
        "--max-model-len", "512", "--max-tokens", "4", "--dram-gb", "0.002",
        "--storage-gb", "0.01", "--fault-interval-s", "2", "--sample-interval-s", "5", "--load-timeout-ms", "3000",
        "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    requests = summary["requests"]
    assert proc.returncode == 0, (requests, summary["crashes"], summary["verify"], proc.stderr[-3000:])
    assert requests["mismatched"] == 0 and requests["hung"] == 0 and not summary["crashes"]
    assert requests["matched"] > 20, requests
    assert summary["verify"]["damaged_other"] == [], summary["verify"]  # damage left by UCM, not by the faults
    assert sum(n for kind, n in summary["faults"].items() if "failed" not in kind) >= 5, summary["faults"]
    assert summary["timeline"] and (tmp_path / "soak.png").read_bytes()[:4] == b"\x89PNG"
    assert all(r["reference_rss_mib"] > 0 for r in summary["timeline"])
    # RSS's parts, where the instance was up at the sample (a killed one reads 0 until it is back)
    assert all(r["ucm0_anon_mib"] > 0 for r in summary["timeline"] if r["ucm0_rss_mib"] > 0)
    assert set(summary["rss_parts_growth_last_half"]) == {"anon", "file", "shmem"}
