"""examples/pd_mixed/run.sh (the seed guide's PD-mixed procedure) run small, and its report on synthetic runs.

The engine test runs the real script on the tiny model (3 prompts of 512 tokens, 4 output tokens, a free port):
`vllm serve` with UCM, `vllm bench serve` twice, a restart, once more. Run 1 must hit nothing, runs 2 and 3 must
load every full block from UCM (vLLM's prefix caching is off), and the script must leave no server behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO, ucm_extra_config
from ucm.testing.engine import engine_env
from ucm.testing.server import free_port, kill_group

SCRIPT = REPO / "examples" / "pd_mixed" / "run.sh"
REPORT = REPO / "examples" / "pd_mixed" / "report.py"
NUM_PROMPTS = 3
INPUT_LEN = 512  # 4 full 128-token blocks per prompt
OUTPUT_LEN = 4
RUNS = ("run1_cold", "run2_same_server", "run3_after_restart")


def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)


@pytest.mark.engine
def test_pd_mixed_second_run_and_restart_hit_ucm(tiny_model, tmp_path):
    config = tmp_path / "ucm.yaml"
    config.write_text(yaml.safe_dump({**ucm_extra_config(tmp_path / "store"), "use_layerwise": True}))
    out = tmp_path / "out"
    env = engine_env(
        {
            "PYTHON": sys.executable,
            "MODEL": str(tiny_model),
            "PORT": str(free_port()),
            "NUM_PROMPTS": str(NUM_PROMPTS),
            "INPUT_LEN": str(INPUT_LEN),
            "OUTPUT_LEN": str(OUTPUT_LEN),
            "UCM_CONFIG_FILE": str(config),
            "OUT_DIR": str(out),
            "VLLM_CPU_KVCACHE_SPACE": "1",
        }
    )
    proc = subprocess.Popen(
        ["bash", str(SCRIPT)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # the script's trap stops its server
        output, _ = proc.communicate(timeout=120)
    finally:
        pgid_file = out / "server_pgid"
        left = int(pgid_file.read_text()) if pgid_file.exists() and kill_group(int(pgid_file.read_text())) else None
    assert proc.returncode == 0, output[-5000:]
    assert left is None, f"the script left its server running (process group {left})"

    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] and summary["vllm_prefix_caching"] == "off"
    runs = {r["name"]: r for r in summary["runs"]}
    assert list(runs) == list(RUNS)
    for r in runs.values():
        assert (r["completed"], r["failed"], r["ucm_requests"]) == (NUM_PROMPTS, 0, NUM_PROMPTS), r
        assert r["total_blocks"] == NUM_PROMPTS * INPUT_LEN // 128, r
        assert r["hit_hbm"] == 0 and r["failed_block_loads"] == 0, r
        assert all(v > 0 for v in r["latency_ms"].values()), r
    assert runs["run1_cold"]["hit_external"] == 0
    assert runs["run2_same_server"]["hit_external"] == runs["run2_same_server"]["total_blocks"]
    assert runs["run3_after_restart"]["hit_external"] == runs["run3_after_restart"]["total_blocks"]
    assert "RESULT " in output and "run3_after_restart" in output


def _fake_run(tmp: Path, name: str, lines: list[str], failed: int = 0) -> str:
    """A runs.tsv line for a run whose JSON and log part are made up here."""
    result = {"completed": 2, "failed": failed}
    for i, metric in enumerate(("ttft", "tpot", "e2el")):
        result |= {f"mean_{metric}_ms": 10.0 * (i + 1), f"p90_{metric}_ms": 12.0 * (i + 1)}
    (tmp / f"{name}.json").write_text(json.dumps(result))
    log = tmp / f"{name}.log"
    log.write_text("noise before\n" + "".join(f"[UC][I] {line}\n" for line in lines) + "noise after\n")
    return f"{name}\t{tmp / f'{name}.json'}\t{log}\t0\t{log.stat().st_size}\n"


def _hit_line(request: str, total: int, hbm: int, external: int) -> str:
    return f"request_id: {request}, total_blocks_num: {total}, hit hbm: {hbm}, hit external: {external}"


@pytest.mark.parametrize(
    ("prefix_caching", "run2", "ok"),
    [
        ("off", [_hit_line("b", 4, 0, 3), _hit_line("c", 4, 0, 3)], True),
        ("off", [_hit_line("b", 4, 4, 0), _hit_line("c", 4, 4, 0)], False),  # vLLM's hits, not UCM's
        ("on", [_hit_line("b", 4, 4, 0), _hit_line("c", 4, 4, 0)], True),
    ],
    ids=["ucm-hits", "hbm-hits-with-caching-off", "hbm-hits-with-caching-on"],
)
def test_report_reads_runs_and_checks_hits(tmp_path, prefix_caching, run2, ok):
    cold = [_hit_line("a", 4, 0, 0), _hit_line("z", 4, 0, 0), _hit_line("a", 4, 0, 0)]  # "a" re-scheduled
    restart = [_hit_line("d", 4, 0, 4), _hit_line("e", 4, 0, 4)]
    tsv = tmp_path / "runs.tsv"
    tsv.write_text(
        _fake_run(tmp_path, "run1", cold) + _fake_run(tmp_path, "run2", run2) + _fake_run(tmp_path, "run3", restart)
    )
    proc = subprocess.run(
        [sys.executable, str(REPORT), str(tsv), "--vllm-prefix-caching", prefix_caching, "--json", str(tmp_path / "s")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == (0 if ok else 1), proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "s").read_text())
    assert summary["ok"] is ok
    first = summary["runs"][0]
    assert (first["ucm_requests"], first["total_blocks"], first["hit_external"]) == (2, 8, 0)
    assert first["latency_ms"] == {
        "mean_ttft": 10.0, "p90_ttft": 12.0, "mean_tpot": 20.0, "p90_tpot": 24.0, "mean_e2el": 30.0, "p90_e2el": 36.0,
    }  # fmt: skip
    assert summary["runs"][2]["hit_external"] == 8
    if not ok:
        assert "run2: no hit on the same server (vLLM prefix caching off)" in proc.stderr
