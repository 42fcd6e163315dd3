"""Smoke test of ``benchmarks/store_bandwidth.py``: a tiny run, its last line a JSON summary with every figure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "store_bandwidth.py"
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


def run(tmp_path: Path, *options: str) -> dict[str, Any]:
    # fadvise, not drop_caches: a test must not empty the whole machine's page cache.
    cmd = [sys.executable, str(SCRIPT), "--total-gb", "0.02", "--repeats", "1", "--page-cache", "fadvise_dontneed"]
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
