"""Tests of ``benchmarks/common.py``, the helpers every benchmark script ends and empties the page cache with."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from benchmarks import common


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
