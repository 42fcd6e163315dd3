"""The JSONL trace: its lines, its size bound (rotation), and its set-up from the config."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ucm.config import UcmConfigError, parse_config
from ucm.integration.vllm.metrics import Observability
from ucm.store.observe import Observation
from ucm.store.traces import TraceWriter


def _obs(i: int) -> Observation:
    return Observation("load", "storage", 3, 2, 2 * 4096, seconds=0.0125, requests=(f"req-{i}",))


def test_lines_and_rotation(tmp_path: Path) -> None:
    bound = 2048
    writer = TraceWriter(str(tmp_path / "t"), bound, "worker")
    try:
        writer.write(Observation("lookup", "all", 7, 5, seconds=0.0001, tokens=640, requests=("a",)))
        writer.write(Observation("load_failure", "storage", 1, cause="damaged", key="ab" * 16))
        first = [json.loads(line) for line in Path(writer.path).read_text().splitlines()]
        assert first[0]["op"] == "lookup" and first[0]["tokens"] == 640 and first[0]["requests"] == ["a"]
        assert first[1]["cause"] == "damaged" and first[1]["key"] == "ab" * 16
        for i in range(100):
            writer.write(_obs(i))
    finally:
        writer.close()
    writer.write(_obs(-1))  # after close: dropped, no error
    current, previous = Path(writer.path), Path(writer.path + ".1")
    assert current.stat().st_size <= bound and previous.stat().st_size <= bound
    lines = [json.loads(line) for p in (previous, current) for line in p.read_text().splitlines()]
    last = lines[-1]
    assert last == {
        "ts": last["ts"],
        "op": "load",
        "tier": "storage",
        "requests": ["req-99"],
        "blocks": 3,
        "ok": 2,
        "bytes": 8192,
        "ms": 12.5,
    }
    ids = [x["requests"][0] for x in lines]  # the latest lines, in order: older ones were rotated away
    assert 0 < len(ids) < 100 and ids == [f"req-{i}" for i in range(100 - len(ids), 100)]
    assert os.stat(writer.path).st_mode & 0o777 == 0o600
    assert {p.name for p in (tmp_path / "t").iterdir()} == {current.name, previous.name}


def test_bound_must_be_sane(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="1024"):
        TraceWriter(str(tmp_path), 100, "worker")


def test_observability_from_config(tmp_path: Path) -> None:
    store_dir = tmp_path / "kv"
    config = parse_config(
        {
            "ucm_connectors": [{"ucm_connector_config": {"storage_backends": str(store_dir)}}],
            "enable_record_traces": True,
        }
    )
    obs = Observability(config, 128, "scheduler")
    try:
        assert obs.trace is not None
        assert Path(obs.trace.path).parent == store_dir / "traces"
        obs.recorder.record(Observation("lookup", "all", 2, 2, tokens=255, requests=("x",)))
        (line,) = Path(obs.trace.path).read_text().splitlines()
        assert json.loads(line)["tokens"] == 255
        stats = obs.stats.take()
        assert stats is not None and stats.data["counters"]["lookup_hit_tokens"] == {"": 255}
    finally:
        obs.close()
    assert Observability(parse_config({}), 128, "worker").trace is None  # off by default

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    bad = parse_config({"enable_record_traces": True, "record_traces_dir": str(blocker / "traces")})
    with pytest.raises(UcmConfigError, match="record_traces_dir"):
        Observability(bad, 128, "worker")
