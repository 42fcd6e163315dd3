"""Tests of ``benchmarks/store_bandwidth.py``: tiny runs, their last line a JSON summary with every figure; the phase
order rotates over the repeats; ratios pair the samples of the same repeat."""

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

SCRIPT = BENCHMARKS / "store_bandwidth.py"
BLOCKS = ("llama8b_block_16MiB", "layer_shard_512KiB")
RAW_FIGURES = {
    "write_files",
    "write_files_synced",
    "write_bigfile",
    "write_bigfile_synced",
    "read_files_cold",
    "read_files_warm",
    "read_bigfile_cold",
    "read_bigfile_warm",
}
STORE_FIGURES = {
    "Posix": {"dump", "dump_synced", "load_cold", "load_warm"},
    "Cache|Posix": {"dump", "dump_synced", "dump_accept", "load_dram_hit", "load_cold", "load_warm"},
}


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("store_bandwidth")


def run(tmp_path: Path, *options: str, repeats: int = 1) -> dict[str, Any]:
    # fadvise, not drop_caches: a test must not empty the whole machine's page cache.
    cmd = [sys.executable, str(SCRIPT), "--total-gb", "0.02", "--repeats", str(repeats)]
    cmd += ["--page-cache", "fadvise_dontneed"]
    proc = subprocess.run([*cmd, "--dir", str(tmp_path), *options], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) > 1, "human-readable lines expected before the JSON"
    summary = json.loads(lines[-1])
    assert list(tmp_path.iterdir()) == [], "the benchmark must remove its files"
    return summary


def test_tiny_run_reports_every_figure(tmp_path: Path) -> None:
    summary = run(tmp_path)
    assert summary["benchmark"] == "store_bandwidth"
    assert summary["problems"] == []
    assert summary["page_cache"]["method"] == "fadvise_dontneed"
    assert summary["filesystem"]["type"]
    assert summary["raw_io"] == "buffered"
    assert set(summary["results"]) == set(BLOCKS)
    for label in BLOCKS:
        r = summary["results"][label]
        assert r["blocks"] >= 1 and r["bytes"] == r["blocks"] * r["block_bytes"]
        assert set(r["raw_gbps"]) == RAW_FIGURES
        assert all(v > 0 for v in r["raw_gbps"].values())
        assert set(r["stores"]) == set(STORE_FIGURES)
        for name, figures in STORE_FIGURES.items():
            s = r["stores"][name]
            # The layerwise read pattern (32 shards of 512 KiB) is measured on the 16 MiB blocks.
            assert set(s["gbps"]) == figures | ({"load_layerwise_cold"} if label == BLOCKS[0] else set())
            assert all(v > 0 for v in s["gbps"].values())
            assert s["failed_keys"] == 0
            assert {"dump/write_files", "dump/write_bigfile", "load_cold/read_files_cold"} <= set(s["ratios"])
            assert all(v > 0 for v in s["ratios"].values())


def test_refused_config_is_reported_not_measured(tmp_path: Path) -> None:
    summary = run(tmp_path, "--io-engine", "uring", "--io-direct", "--blocks", "layer_shard_512KiB", "--no-warm")
    assert summary["problems"] == []
    r = summary["results"]["layer_shard_512KiB"]
    for name in STORE_FIGURES:
        reason = r["stores"][name]["unsupported"]
        assert "posix_io_engine" in reason and "uring" in reason
    # The raw baseline still runs (O_DIRECT where the file system takes it).
    assert summary["raw_io"] == "O_DIRECT" or summary["raw_io"].startswith("buffered (O_DIRECT refused")
    assert set(r["raw_gbps"]) == {f for f in RAW_FIGURES if not f.endswith("_warm")}
    assert all(v > 0 for v in r["raw_gbps"].values())


def test_rotated_puts_every_phase_in_every_position(bench: ModuleType) -> None:
    phases = ["a", "b", "c", "d"]
    orders = [bench.rotated(phases, rep) for rep in range(len(phases))]
    assert orders[0] == phases and orders[1] == ["b", "c", "d", "a"] and bench.rotated(phases, 5) == orders[1]
    for position in range(len(phases)):
        assert sorted(order[position] for order in orders) == phases


def test_paired_ratios_divide_samples_of_the_same_repeat(bench: ModuleType) -> None:
    # Seconds per repeat. Paired GB/s ratios (raw s / store s): 1, 2, 0.25, median 1; the ratio of the medians
    # (median store 2 s, median raw 1 s) would be 0.5, and pairing other repeats gives other values.
    store = {"dump": [1.0, 2.0, 4.0], "load_cold": [2.0, 2.0]}
    raw = {"write_files": [1.0, 4.0, 1.0], "read_files_cold": [1.0, 3.0], "write_bigfile": [1.0]}
    paired = bench.paired_ratios(store, raw)
    assert paired == {"dump/write_files": [1.0, 2.0, 0.25], "load_cold/read_files_cold": [0.5, 1.5]}
    assert statistics.median(paired["dump/write_files"]) == 1.0


def test_phase_order_rotates_and_ratios_are_paired(tmp_path: Path) -> None:
    summary = run(tmp_path, "--stores", "Posix", "--blocks", "llama8b_block_16MiB", "--no-warm", repeats=3)
    assert summary["problems"] == []
    r = summary["results"]["llama8b_block_16MiB"]
    writes = ["raw write_files", "raw write_bigfile", "Posix dump"]
    reads = ["raw read_files", "raw read_bigfile", "Posix load", "Posix load_layerwise_cold"]
    assert r["phase_orders"] == [
        {"write": writes, "read": reads},
        {"write": writes[1:] + writes[:1], "read": reads[1:] + reads[:1]},
        {"write": writes[2:] + writes[:2], "read": reads[2:] + reads[:2]},
    ]
    s = r["stores"]["Posix"]
    for key, samples in s["ratio_samples"].items():
        fig, base = key.split("/")
        assert len(samples) == 3
        for store_gbps, raw_gbps, ratio in zip(
            s["samples_gbps"][fig], r["raw_samples_gbps"][base], samples, strict=True
        ):
            assert ratio == pytest.approx(
                store_gbps / raw_gbps, rel=0.02
            )  # all three are rounded to 3 significant digits
        assert s["ratios"][key] == pytest.approx(statistics.median(samples), abs=0.002)
        assert s["ratios_of_medians"][key] == pytest.approx(s["gbps"][fig] / r["raw_gbps"][base], rel=0.02)
    below = [
        f"llama8b_block_16MiB Posix {key}"
        for key, v in s["ratios"].items()
        if key.startswith(("dump/", "load_cold/")) and v < 0.9
    ]
    assert summary["posix_below_0.9x_raw"] == below
