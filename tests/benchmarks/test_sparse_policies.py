"""Tests of ``benchmarks/sparse_policies.py`` on the tiny random-weight Llama: its block-sparse decode equals dense
when every block is kept and keeps GSA's budget otherwise; its attention mass per block is the softmax's."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.benchmarks import BENCHMARKS, load_script

SCRIPT = BENCHMARKS / "sparse_policies.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("sparse_policies")


def test_tiny_run(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(SCRIPT), "--model", str(tiny_model), "--seeds", "0", "--lengths", "1024"]
    policies = ["gsa", "oracle", "oracle4", "snap4", "sparq8", "oracle_head", "snap4_head"]
    cmd += ["--fractions", "1.0", "0.3", "--policies", *policies, "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary == json.loads(out.read_text())
    results = summary["results"]
    items = 5 + 4  # passkey depths + multi-doc questions at one length
    for policy in policies:
        full, sparse = results[f"{policy}@1.0"], results[f"{policy}@0.3"]
        assert full["same_tokens_as_dense"] == f"{items}/{items}" and full["kept_block_fraction"] == 1.0
        # ~1024-token prompts are 8-9 blocks: ceil(0.3 n) = 3 kept (the two windows and one more), per KV head too
        assert 0.3 <= sparse["kept_block_fraction"] <= 0.4
        assert sparse["passkey"]["of"] == 5 and sparse["multidoc"]["of"] == 4


def test_smaller_blocks(tiny_model: Path) -> None:
    """``--block-size 32``: ~1024-token prompts are 32-33 blocks, of which ceil(0.3 n) = 10-11 are kept."""
    cmd = [sys.executable, str(SCRIPT), "--model", str(tiny_model), "--seeds", "0", "--lengths", "1024"]
    cmd += ["--block-size", "32", "--fractions", "1.0", "0.3", "--policies", "oracle"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["block_size"] == 32
    results = summary["results"]
    assert results["oracle@1.0"]["same_tokens_as_dense"] == "9/9" and results["oracle@1.0"]["kept_block_fraction"] == 1
    assert 0.3 <= results["oracle@0.3"]["kept_block_fraction"] <= 0.34


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--policies", "quest"], "allowed are gsa, oracle, oracle<K>, snap<W>, sparq<R>, oracle_head, snap<W>_head"),
        (["--block-size", "0"], "--block-size 0: must be a positive number of tokens"),
    ],
)
def test_bad_argument_is_refused(args: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)
    assert proc.returncode == 2 and message in proc.stderr


@pytest.mark.parametrize("block_size", [128, 32])
def test_block_mass_is_the_softmax_mass_of_each_block(bench: ModuleType, block_size: int) -> None:
    g = torch.Generator().manual_seed(0)
    kv_heads, group, dim, length = 2, 3, 16, 3 * block_size + 5
    k = torch.randn(kv_heads, length, dim, generator=g)
    q = torch.randn(kv_heads * group, 1, dim, generator=g)
    mass = bench.block_mass(q, k, group, 0.25, length - 1, math.ceil(length / block_size), block_size)
    for h in range(kv_heads * group):
        p = torch.softmax((k[h // group] @ q[h, 0]) * 0.25, dim=0)
        want = [float(p[i : i + block_size].sum()) for i in range(0, length, block_size)]
        assert mass[h].tolist() == pytest.approx(want, abs=1e-6)
