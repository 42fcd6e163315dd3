"""Tests of ``benchmarks/common.py``, the helpers every benchmark script ends and empties the page cache with, and
the turns engines take for paired timings (real shells running the before-commands)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from benchmarks import common
from benchmarks.common import TakeTurns


@pytest.mark.parametrize(("indent", "failed", "code"), [(None, False, 0), (1, True, 1)])
def test_emit_summary_prints_the_last_line_and_writes_the_file(
    tmp_path: Path, capsys: Any, indent: int | None, failed: bool, code: int
) -> None:
    summary = {"benchmark": "x", "figures": {"a": 1.5, "b": [1, 2]}, "problems": []}
    out = tmp_path / "summary.json"
    print("a human-readable line")
    assert common.emit_summary(summary, out, out_indent=indent, failed=failed) == code
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "a human-readable line" and json.loads(lines[-1]) == summary
    assert out.read_text() == json.dumps(summary, indent=indent) + "\n"


def test_emit_summary_without_a_file(capsys: Any) -> None:
    assert common.emit_summary({"a": 1}) == 0
    assert capsys.readouterr().out == '{"a": 1}\n'


def test_fadvise_evicts_every_file_and_skips_what_is_gone(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    for name in ("a/x.bin", "a/b/y.bin", "z.bin"):
        (tmp_path / name).write_bytes(os.urandom(1 << 16))
    common.evict_page_cache("fadvise_dontneed", tmp_path)  # nothing to check portably but that it runs
    common.fadvise_dontneed(tmp_path / "missing")  # a store not created yet: syncs, evicts nothing


def test_unknown_page_cache_method_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'drop'; allowed: drop_caches, fadvise_dontneed"):
        common.evict_page_cache("drop", tmp_path)


def test_machine_info_and_versions() -> None:
    info = common.machine_info(load_avg_start=0.5)
    assert set(info) == {"platform", "cpu_count", "cpu_model", "processor", "load_avg_1min_start", "load_avg_1min_end"}
    assert info["load_avg_1min_start"] == 0.5 and info["cpu_count"] == os.cpu_count()
    assert "load_avg_1min_start" not in common.machine_info()
    assert set(common.versions()) == {"vllm", "torch", "ucm"}
    assert common.utc_now().endswith("+00:00")


def _engine(turns: TakeTurns, engine: int, requests: int, log: Path) -> None:
    """A stand-in for an engine process: before each request its before_cmd (a real shell, as
    ``ucm.testing.engine`` runs it), then a 50 ms request whose start and end it logs."""
    try:
        for i in range(requests):
            subprocess.run(turns.before_cmd(engine, i), shell=True, check=True, timeout=30)
            with log.open("a") as f:
                f.write(f"{engine} {i} start {time.monotonic()}\n")
            time.sleep(0.05)
            with log.open("a") as f:
                f.write(f"{engine} {i} end {time.monotonic()}\n")
    finally:
        turns.exited[engine] = True


def test_engines_take_turns_request_by_request(tmp_path: Path) -> None:
    turns = TakeTurns(tmp_path, engines=3, requests=3, settle_s=0.01)
    log = tmp_path / "log"
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        granting = pool.submit(turns.run)
        engines = [pool.submit(_engine, turns, e, 3, log) for e in (2, 0, 1)]  # started in another order
        for f in engines:
            f.result(timeout=60)
        granting.result(timeout=60)
    events = [line.split() for line in log.read_text().splitlines()]
    # one request at a time, round-robin by request: (0, 0) (1, 0) (2, 0) (0, 1) ...
    assert [(int(e), int(i), what) for e, i, what, _ in events] == [
        (e, i, what) for i in range(3) for e in range(3) for what in ("start", "end")
    ]
    times = [float(t) for *_, t in events]
    assert times == sorted(times)


def test_a_failed_engine_releases_the_others(tmp_path: Path) -> None:
    turns = TakeTurns(tmp_path, engines=2, requests=3, settle_s=0.01)
    log = tmp_path / "log"
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        granting = pool.submit(turns.run)
        turns.failed = True  # engine 0 never asks for a turn (it failed at start)
        turns.exited[0] = True
        other = pool.submit(_engine, turns, 1, 3, log)
        other.result(timeout=60)
        granting.result(timeout=60)
    assert len(log.read_text().splitlines()) == 6  # engine 1 served every request
