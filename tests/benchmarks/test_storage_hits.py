"""Tests of ``benchmarks/storage_hits.py``: the paired statistics, the option errors, and a tiny real run (two
``vllm serve`` processes on the tiny model, storage hits checked by UCM's log lines and by the bytes read from disk)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.benchmarks import BENCHMARKS, load_script
from ucm.testing.models import ensure_tiny_llama

SCRIPT = BENCHMARKS / "storage_hits.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("storage_hits")


def variant(bench: ModuleType, name: str, ttft: list[float]) -> Any:
    v = bench.Variant(name, server=None)
    v.ttft_ms = list(ttft)
    v.disk_read_mb = [1.0] * len(ttft)
    v.idle = [0.95] * len(ttft)
    return v


def test_ratios_pair_the_samples_of_each_round(bench: ModuleType) -> None:
    # Round 2 is slow for both: paired, layerwise is faster in every round; unpaired medians would say little.
    ref = variant(bench, "blockwise", [100, 110, 400, 105, 120])
    other = variant(bench, "layerwise", [95, 100, 380, 100, 110])
    out = bench.summarize([ref, other], "blockwise")
    ratios = [o / r for o, r in zip(other.ttft_ms, ref.ttft_ms, strict=True)]
    entry = out["layerwise"]["over_blockwise"]
    assert entry["median"] == round(statistics.median(ratios), 3)
    assert entry["rounds_below_1"] == 5 and entry["rounds"] == 5
    low, high = entry["ci95"]
    assert min(ratios) - 1e-3 <= low <= entry["median"] <= high <= max(ratios) + 1e-3  # rounded to 3 digits
    assert high < 1  # every round below 1: the whole interval is
    assert "over_blockwise" not in out["blockwise"]
    assert out["blockwise"]["ttft_ms_median"] == 110


def test_bootstrap_interval(bench: ModuleType) -> None:
    assert bench.bootstrap_median_ci([2.0] * 7) == (2.0, 2.0)
    values = [0.9, 1.1, 0.95, 1.05, 1.0, 0.97, 1.02, 0.99, 1.01, 0.98]
    low, high = bench.bootstrap_median_ci(values)
    assert low < statistics.median(values) < high
    assert bench.bootstrap_median_ci(values) == (low, high)  # seeded: the same interval every time
    wide = bench.bootstrap_median_ci([0.5, 1.5, 0.6, 1.4, 1.0, 0.7, 1.3, 0.8, 1.2, 0.9])
    assert wide[1] - wide[0] > high - low


def test_kv_bytes_per_block(bench: ModuleType, tmp_path: Path) -> None:
    config = {"num_hidden_layers": 30, "num_key_value_heads": 3, "head_dim": 64, "hidden_size": 576}
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_attention_heads": 9}))
    assert bench.kv_bytes_per_block(tmp_path) == 30 * 2 * 128 * 3 * 64 * 2  # SmolLM2-135M: 2.81 MiB
    del config["head_dim"]  # derived from hidden_size / num_attention_heads
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_attention_heads": 9}))
    assert bench.kv_bytes_per_block(tmp_path) == 30 * 2 * 128 * 3 * 64 * 2


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--variants", "blockwise", "fastest"], "--variants fastest: unknown; allowed: blockwise, layerwise"),
        (["--variants", "layerwise", "compressed"], "--reference 'blockwise' is not among --variants"),
        (["--prompts", "1"], "--prompts 1: at least 2"),
    ],
)
def test_bad_options_are_named(bench: ModuleType, options: list[str], message: str, capsys: Any) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(options)
    assert message in capsys.readouterr().err


@pytest.mark.engine
def test_tiny_run_measures_storage_hits(tmp_path: Path) -> None:
    model = ensure_tiny_llama(Path("models"))
    out = tmp_path / "summary.json"
    cmd = [
        sys.executable, str(SCRIPT), "--model", str(model), "--variants", "blockwise", "layerwise", "blockwise_events",
        "example", "--rounds", "2", "--prompt-tokens", "512", "--prompts", "2", "--gap-s", "0.2", "--min-idle", "0",
        "--page-cache", "fadvise_dontneed", "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary == json.loads(out.read_text())
    assert summary["plot"] == str(tmp_path / "summary.png")  # the TTFT plot, beside the JSON
    assert (tmp_path / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert summary["problems"] == []  # every measured request was a UCM hit of every full block (or ExampleConnector's)
    assert summary["prompt_full_blocks"] == 4
    kv_mb = summary["prompt_kv_mb"]
    for name in ("blockwise", "layerwise", "blockwise_events"):
        entry = summary["variants"][name]
        assert len(entry["ttft_ms"]) == 2 and all(t > 0 for t in entry["ttft_ms"])
        # The blocks came from disk: page cache emptied, DRAM tier evicted by the other prompt.
        assert entry["disk_read_mb_median"] >= kv_mb, (name, entry, kv_mb)
    assert len(summary["variants"]["example"]["ttft_ms"]) == 2  # vLLM's ExampleConnector, its hit line checked
    ratio = summary["variants"]["layerwise"]["over_blockwise"]
    assert ratio["rounds"] == 2 and ratio["ci95"][0] <= ratio["median"] <= ratio["ci95"][1]
    assert summary["first_token_same_in_all_variants"] == "2/2 rounds"
    # vLLM's KV events (its own and UCM's) reached the benchmark's subscriber.
    assert summary["kv_events_received"]["blockwise_events"] > 0
