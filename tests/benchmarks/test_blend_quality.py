"""Tests of ``benchmarks/blend_quality.py``: a tiny two-seed run (the 2-layer random Llama, two documents, one
question per seed) pools its seeds into one sample, and ``--pool`` of the per-seed reports it saved gives the same
sample; bad seed lists and files that are not reports are named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks import BENCHMARKS, load_script


def _run(*args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / "blend_quality.py"), *args], capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return run, json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.engine
def test_seeds_are_run_saved_and_pooled(tiny_model: Path, tmp_path: Path) -> None:
    run, summary = _run(
        "--model", str(tiny_model), "--seeds", "0-1", "--lengths", "400", "--docs", "2", "--orders", "1",
        "--questions", "1", "--ratios", "0.15", "--no-prefix-only", "--work-dir", str(tmp_path),
    )  # fmt: skip
    pooled = summary["pooled"]
    assert pooled["seeds"] == [0, 1] and pooled["questions"] == 2
    assert set(pooled["right"]) == {"full", "blend_0.15"}
    reports = [json.loads((tmp_path / f"seed{s}.json").read_text()) for s in (0, 1)]
    assert [r["seed"] for r in reports] == [0, 1]
    for name in ("full", "blend_0.15"):
        per_seed = [sum(r["modes"][name]["correct"].values()) for r in reports]
        assert pooled["right_per_seed"][name] == {"0": per_seed[0], "1": per_seed[1]}
        assert pooled["right"][name] == sum(per_seed)
        by_depth = pooled["right_by_depth"][name]  # two documents: the first and the last
        assert set(by_depth) <= {"0.00", "1.00"} and sum(n for _, n in by_depth.values()) == 2
        assert sum(r for r, _ in by_depth.values()) == pooled["right"][name]
    assert reports[0]["modes"]["blend_0.15"]["blend"]["chunks_computed"] == 0  # the primer stored both documents
    assert "seed 0:" in run.stdout and "seed 1:" in run.stdout and "2 seeds, 2 questions" in run.stdout
    if pooled["right"]["full"]:  # a random model may answer nothing right: then there is no ratio
        assert pooled["vs_full"]["blend_0.15"]["ratio"] == pooled["target"]["accuracy_vs_full"]
        assert pooled["target"]["accuracy_vs_full"] == pooled["right"]["blend_0.15"] / pooled["right"]["full"]
    else:
        assert "vs_full" not in pooled and "target" not in pooled
    _, again = _run("--pool", str(tmp_path / "seed0.json"), str(tmp_path / "seed1.json"))
    assert again["pooled"] == pooled


def test_bad_seed_lists_and_reports_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = load_script("blend_quality")
    assert script.seed_list("3-5") == [3, 4, 5] and script.seed_list("0,7") == [0, 7]
    for bad, needle in (
        ("a-b", "expected a range A-B"),
        ("1,1", "expected at least one seed, each once"),
        ("5-4", "expected at"),
    ):
        with pytest.raises(SystemExit):
            script.main(["--seeds", bad])
        assert f"argument --seeds: {bad!r}: {needle}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        script.main(["--seed", "1", "--seeds", "0-1"])
    assert "not allowed with argument" in capsys.readouterr().err
    other = tmp_path / "other.json"
    other.write_text('{"benchmark": "blend"}\n')
    with pytest.raises(SystemExit):
        script.main(["--pool", str(other)])
    assert f"--pool: {other} is not a single-seed report of this script" in capsys.readouterr().err
    for layers, needle in (
        ("15:30", "question_layers [15, 30] is set but selection is 'deviation'"),
        ("30:15", "question_layers [30, 15] must be [first, end) with 0 <= first < end"),
        ("15", "question_layers [15] must be two numbers, [first, end)"),
    ):
        with pytest.raises(SystemExit):
            script.main(["--question-layers", layers, "--selection", "question" if layers != "15:30" else "deviation"])
        err = capsys.readouterr().err
        assert "--question-layers: " in err and needle in err
