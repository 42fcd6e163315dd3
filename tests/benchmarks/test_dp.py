"""Tests of ``benchmarks/dp.py``: its parsing and statistics, the option errors, and a tiny real run (the tiny
model served by 2 DP ranks, HBM PC and UCM PC)."""

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
from ucm.testing.models import ensure_tiny_llama

SCRIPT = BENCHMARKS / "dp.py"

METRICS_PAGE = """\
# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 2560.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 1280.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 1024.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 0.0
vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 1024.0
vllm:external_prefix_cache_hits_total{engine="1",model_name="m"} 0.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 2.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 1.0
vllm:request_success_total{engine="1",finished_reason="length",model_name="m"} 1.0
vllm:request_success_created{engine="1",finished_reason="length",model_name="m"} 1.7e9
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9
"""


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("dp")


def test_metrics_are_read_per_engine(bench: ModuleType) -> None:
    m = bench.parse_metrics(METRICS_PAGE)
    assert m["prefix_cache_queries"] == {"0": 2560.0, "1": 1280.0}  # *_created samples ignored
    assert m["request_success"] == {"0": 3.0, "1": 1.0}  # summed over finished_reason
    ranks = bench.metrics_delta(bench.parse_metrics(""), m)
    assert ranks["0"] == {"requests": 3, "hit_ratio": 0.8, "external_hit_ratio": 0.4}  # local + external hits
    assert ranks["1"] == {"requests": 1, "hit_ratio": 0.0, "external_hit_ratio": 0.0}
    assert bench.metrics_delta(m, m)["0"] == {"requests": 0, "hit_ratio": 0.0, "external_hit_ratio": 0.0}


def test_ucm_lines_are_grouped_by_dp_rank(bench: ModuleType) -> None:
    log = "\n".join(
        [
            "[UC][I] request_id: cmpl-a-0-1f, total_blocks_num: 10, hit hbm: 8, hit external: 0, dp rank: 0",
            "[UC][I] request_id: cmpl-b-0-2e, total_blocks_num: 10, hit hbm: 0, hit external: 8, dp rank: 1",
            "[UC][I] request_id: cmpl-c-0-3d, total_blocks_num: 10, hit hbm: 0, hit external: 6, dp rank: 1",
            "[UC][I] request_id: cmpl-x, total_blocks_num: 10, hit hbm: 0, hit external: 0",  # not a DP engine
        ]
    )
    lines = bench.ucm_lines(log)
    assert bench.line_of(lines, "cmpl-b") == (10, 0, 8, 1)
    assert bench.line_of(lines, "cmpl-x") is None
    ranks = bench.ucm_ranks(list(lines.values()))
    assert ranks == {
        "0": {"requests": 1, "hit_ratio": 0.8, "external_hit_ratio": 0.0},
        "1": {"requests": 2, "hit_ratio": 0.7, "external_hit_ratio": 0.7},
    }


def test_latency_statistics(bench: ModuleType) -> None:
    samples = [
        bench.Sample(f"r{i}", ttft_s=0.1 * (i + 1), e2el_s=0.1 * (i + 1) + 0.9, output_tokens=10) for i in range(10)
    ]
    stats = bench.latency_stats(samples)
    assert stats["ttft_ms"] == {"mean": 550.0, "p90": 910.0}
    assert stats["tpot_ms"] == {"mean": 100.0, "p90": 100.0}
    assert stats["e2el_ms"]["mean"] == 1450.0
    assert bench.Sample("one", 0.1, 0.1, 1).tpot_s is None


def test_prompts_extend_their_seeds(bench: ModuleType) -> None:
    seeds, full, warmup = bench.make_prompts(vocab=1000, n=3, seed_len=8, full_len=10, seed=0)
    assert [len(p) for p in seeds] == [8] * 3 and [len(p) for p in full] == [10] * 3 and len(warmup) == 2
    assert all(f[:8] == s for s, f in zip(seeds, full, strict=True))
    assert bench.make_prompts(1000, 3, 8, 10, 0) == (seeds, full, warmup)  # seeded


def test_targets(bench: ModuleType) -> None:
    def config(ttft: float, ratios: list[float]) -> dict[str, Any]:
        return {"ttft_ms": {"mean": ttft}, "ranks": {str(i): {"hit_ratio": r} for i, r in enumerate(ratios)}}

    met = bench.check_targets({"hbm_pc": config(900.0, [0.4, 0.5]), "ucm_pc": config(300.0, [0.8, 0.79])})
    assert met["ucm_hit_ratio_at_least_0.79_on_every_rank"] and met["ucm_mean_ttft_below_hbm"]
    assert met["hbm_hit_ratio_below_ucm_on_every_rank"]
    missed = bench.check_targets({"hbm_pc": config(200.0, [0.8, 0.8]), "ucm_pc": config(300.0, [0.8, 0.7])})
    assert not any(v for k, v in missed.items() if isinstance(v, bool))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--configs", "ucm_pc", "lmcache"], "--configs lmcache: unknown; allowed: recompute, hbm_pc, ucm_pc"),
        (["--num-prompts", "1"], "--num-prompts 1: at least 2"),
        (["--output-len", "1"], "--output-len 1: TPOT needs at least 2"),
        (["--block-size", "100"], "--block-size 100: vLLM's CPU build needs a multiple of 32"),
        (["--input-len", "100"], "--input-len 100: the seed prompt must hold at least one"),
    ],
)
def test_bad_options_are_named(bench: ModuleType, options: list[str], message: str, capsys: Any) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(options)
    assert message in capsys.readouterr().err


@pytest.mark.engine
def test_tiny_run(tmp_path: Path) -> None:
    """4 prompts of 320 tokens (10 blocks of 32, the seeds 8): UCM PC hits 8 of 10 blocks on both ranks."""
    ensure_tiny_llama(Path("models"))
    out = tmp_path / "summary.json"
    cmd = [
        sys.executable, str(SCRIPT), "--model", "tiny", "--configs", "hbm_pc", "ucm_pc", "--num-prompts", "4",
        "--input-len", "320", "--block-size", "32", "--output-len", "3", "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # the script's log folder lands in the test's directory
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary == json.loads(out.read_text())
    assert summary["problems"] == []
    assert "HBM PC" in proc.stdout and "UCM PC" in proc.stdout  # the table
    ucm = summary["configs"]["ucm_pc"]
    assert ucm["ucm_lines_found"] == "4/4"
    assert set(ucm["ranks"]) == {"0", "1"}  # vLLM's load balancing used both ranks
    for rank in ("0", "1"):
        assert ucm["ranks"][rank]["hit_ratio"] == 0.8  # every seed block, on either rank
        assert ucm["vllm_metrics"][rank]["hit_ratio"] == 0.8  # vLLM counts the same hits
    assert sum(r["requests"] for r in summary["configs"]["hbm_pc"]["ranks"].values()) == 4
    assert summary["targets"]["ucm_hit_ratio_at_least_0.79_on_every_rank"]
    assert Path(summary["logs"]).parent == tmp_path and not (Path(summary["logs"]) / "store").exists()
