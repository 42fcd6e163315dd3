"""Smoke test of ``benchmarks/codec.py``: a tiny run on synthetic bf16 KV saved like a capture, its last line a JSON
summary with every figure (the real-KV figures come from running it on the real model; see benchmarks/RESULTS.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "codec.py"
CODECS = ("kvfold_lossless", "zstd1_raw", "zstd1_hiplane", "blosc2_shuffle_zstd1", "order0_bound", "kvfold_int8")
SPEEDS = ("kvfold_compress", "kvfold_decompress", "zstd1_raw_compress", "zstd1_raw_decompress")


def test_tiny_run_reports_every_figure(tmp_path: Path) -> None:
    # [blocks, layers, K/V, block_size, num_kv_heads, head_dim]: normal values with per-channel scales
    gen = torch.Generator().manual_seed(0)
    scale = torch.rand((1, 3, 2, 1, 2, 32), generator=gen) * 4
    kv = (torch.randn((2, 3, 2, 16, 2, 32), generator=gen) * scale).to(torch.bfloat16)
    path = tmp_path / "kv.pt"
    torch.save(kv, path)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--kv", str(path), "--threads", "2", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) > 1, "human-readable lines expected before the JSON"
    summary = json.loads(lines[-1])
    assert summary["benchmark"] == "codec"
    assert summary["kv"]["layers"] == 3 and summary["kv"]["blocks"] == 2
    results = summary["results"]
    for name in CODECS:
        r = results[name]
        assert len(r["per_layer"]) == 3
        assert 0 < r["worst_layer"] <= r["mean_over_layers"]
        assert r["k"] > 0 and r["v"] > 0
    # The order-0 bound of the planes is an upper bound for KVfold's per-section coder on this data only up to
    # zstd's table overhead; both must compress normal values well above 1x.
    assert results["kvfold_lossless"]["overall"] > 1.2
    assert results["order0_bound"]["overall"] > 1.2
    int8 = results["kvfold_int8"]
    assert 1.8 < int8["overall"] < 2.0  # 8 + 16/32 bits per value plus headers
    assert 0 < int8["rms_error_pct"]["worst"] < 1.5
    assert len(int8["rms_error_pct"]["k_per_layer"]) == 3
    for name in SPEEDS:
        assert set(results["speed_mbps"][name]) == {"1_threads", "2_threads"}
        assert all(v > 0 for v in results["speed_mbps"][name].values())
    assert set(summary["targets"]) >= {"lossless_worst_layer>=1.40", "decompress_per_core>=zstd1"}
