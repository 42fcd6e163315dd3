"""UCM's metrics on a real ``vllm serve``'s ``/metrics`` (scraped over HTTP), and its traces, through a cold request,
a DRAM hit, a storage hit after a restart on the same store, and a damaged block file.

One server on a fresh store serves prompt A twice (cold: dumps, no hits; then a DRAM hit, vLLM's own prefix cache
being off) and prompt B once (cold); it writes JSONL traces. A second server on the same store directory serves A
(every block a storage hit) and B after one of B's block files was damaged on disk (a failed load counted as
``damaged``, the block recomputed: the same answer as the cold one).
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from ucm.testing.engine import ucm_transfer_config
from ucm.testing.server import VllmServer
from ucm.testing.texts import prompt_of_tokens

pytestmark = pytest.mark.engine

BLOCK_SIZE = 32  # small blocks: a short prompt with several full blocks
FULL_BLOCKS = 6
PROMPT_TOKENS = FULL_BLOCKS * BLOCK_SIZE + 20  # + a partial block (never stored)
MAX_TOKENS = 6
SCRAPE_TIMEOUT_S = 60.0  # stats reach the API server with the engine's step outputs, just after the response


Metrics = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(server: VllmServer) -> Metrics:
    """``/metrics`` as ``{(sample name, labels without vLLM's model_name/engine): value}``, UCM's samples only."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as r:
        text = r.read().decode()
    out: Metrics = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("vllm:ucm_"):
                assert s.labels["model_name"] == server.model and s.labels["engine"] == "0"
                labels = frozenset((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine"))
                out[(s.name, labels)] = s.value
    return out


def value(metrics: Metrics, name: str, **labels: str) -> float:
    """A sample's value (0 when the series does not exist yet)."""
    return metrics.get((f"vllm:ucm_{name}", frozenset(labels.items())), 0.0)


def wait_for(server: VllmServer, done: Callable[[Metrics], bool]) -> Metrics:
    """Scrape until ``done(metrics)``; the last scrape (the assertions that follow say what is missing)."""
    deadline = time.monotonic() + SCRAPE_TIMEOUT_S
    while True:
        metrics = scrape(server)
        if done(metrics) or time.monotonic() > deadline:
            return metrics
        time.sleep(0.5)


def delta(after: Metrics, before: Metrics, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def complete(server: VllmServer, prompt: list[int]) -> dict[str, Any]:
    """A greedy completion of ``prompt`` (token ids): its response id and generated token ids."""
    body = {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "return_token_ids": True,
    }
    request = urllib.request.Request(
        f"{server.url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as r:
        answer = json.loads(r.read())
    return {"id": answer["id"], "token_ids": answer["choices"][0]["token_ids"]}


def start(model: Path, config_file: Path, log: Path) -> VllmServer:
    server = VllmServer(
        model,
        log,
        ucm_transfer_config({"UCM_CONFIG_FILE": str(config_file)}),
        max_model_len=1024,
        dtype="float32",
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
        extra_args=["--block-size", str(BLOCK_SIZE), "--no-enable-prefix-caching"],
    )
    return server.wait_ready()


def block_files(store: Path) -> set[Path]:
    return set(store.rglob("*.ucmb"))


def wait_for_files(store: Path, n: int, timeout_s: float = 60.0) -> set[Path]:
    """The store's block files once there are ``n`` (written back in the background)."""
    deadline = time.monotonic() + timeout_s
    while len(files := block_files(store)) < n and time.monotonic() < deadline:
        time.sleep(0.2)
    return files


def read_traces(directory: Path, role: str) -> list[dict[str, Any]]:
    (path,) = directory.glob(f"ucm-trace-*-{role}.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def served(records: list[dict[str, Any]], answer: dict[str, Any]) -> list[dict[str, Any]]:
    """Trace records naming the request of ``answer`` (vLLM's internal id extends the response id)."""
    return [r for r in records if any(q.startswith(answer["id"]) for q in r["requests"])]


def test_metrics_and_traces_through_restart_and_damage(tiny_model: Path, tokenizer: Any, tmp_path: Path) -> None:
    ids = tokenizer.encode(prompt_of_tokens(tokenizer, 2 * PROMPT_TOKENS + 10), add_special_tokens=False)
    prompt_a, prompt_b = ids[:PROMPT_TOKENS], ids[PROMPT_TOKENS : 2 * PROMPT_TOKENS]
    store, traces = tmp_path / "store", tmp_path / "traces"
    config_file = tmp_path / "ucm_config.yaml"
    config_file.write_text(
        yaml.safe_dump(
            {
                "ucm_connectors": [
                    {"ucm_connector_config": {"storage_backends": str(store), "cache_buffer_capacity_gb": 0.25}}
                ],
                "enable_record_traces": True,
                "record_traces_dir": str(traces),
            }
        )
    )
    full_bytes: float

    # -- first server: cold request, DRAM hit ----------------------------------------------------------------------
    first = start(tiny_model, config_file, tmp_path / "server1.log")
    try:
        m0 = scrape(first)
        assert value(m0, "lookups_total") == 0

        cold_a = complete(first, prompt_a)
        m1 = wait_for(first, lambda m: value(m, "dump_blocks_total", tier="dram") >= FULL_BLOCKS)
        assert delta(m1, m0, "lookups_total") == 1
        assert delta(m1, m0, "lookup_blocks_total") == FULL_BLOCKS
        assert delta(m1, m0, "lookup_hit_blocks_total") == 0
        assert delta(m1, m0, "dump_blocks_total", tier="dram") == FULL_BLOCKS
        assert value(m1, "hit_blocks_total", tier="dram") == value(m1, "hit_blocks_total", tier="storage") == 0
        full_bytes = value(m1, "dump_bytes_total", tier="dram")
        assert full_bytes > 0 and full_bytes % FULL_BLOCKS == 0
        assert value(m1, "used_bytes", tier="dram") == full_bytes
        assert value(m1, "capacity_bytes", tier="dram") == 0.25 * 2**30
        wait_for_files(store, FULL_BLOCKS)

        warm_a = complete(first, prompt_a)  # the same prompt: every full block from UCM's DRAM tier
        m2 = wait_for(first, lambda m: value(m, "hit_blocks_total", tier="dram") >= FULL_BLOCKS)
        assert warm_a["token_ids"] == cold_a["token_ids"]
        assert delta(m2, m1, "lookup_hit_blocks_total") == FULL_BLOCKS
        assert delta(m2, m1, "lookup_hit_tokens_total") == FULL_BLOCKS * BLOCK_SIZE
        assert delta(m2, m1, "load_blocks_total", tier="dram") == FULL_BLOCKS
        assert delta(m2, m1, "hit_blocks_total", tier="dram") == FULL_BLOCKS
        assert delta(m2, m1, "hit_tokens_total", tier="dram") == FULL_BLOCKS * BLOCK_SIZE
        assert delta(m2, m1, "load_bytes_total", tier="dram") == full_bytes
        assert value(m2, "load_seconds_count", tier="dram") == 1
        assert value(m2, "load_blocks_total", tier="storage") == 0
        # The cold request's write-back finished after its last step; it is reported with this request's steps.
        assert value(m2, "dump_blocks_total", tier="storage") == FULL_BLOCKS
        assert value(m2, "dump_bytes_total", tier="storage") == full_bytes
        assert value(m2, "dump_seconds_count", tier="storage") >= 1

        before_b = block_files(store)
        cold_b = complete(first, prompt_b)
        b_files = wait_for_files(store, 2 * FULL_BLOCKS) - before_b
        assert len(b_files) == FULL_BLOCKS
    finally:
        first.stop()

    scheduler_trace, worker_trace = read_traces(traces, "scheduler"), read_traces(traces, "worker")
    lookups = [r for r in scheduler_trace if r["op"] == "lookup"]
    assert [(r["blocks"], r["ok"], r["tokens"]) for r in lookups] == [
        (FULL_BLOCKS, 0, 0),
        (FULL_BLOCKS, FULL_BLOCKS, FULL_BLOCKS * BLOCK_SIZE),
        (FULL_BLOCKS, 0, 0),
    ]
    assert [len(served(lookups, a)) for a in (cold_a, warm_a, cold_b)] == [1, 1, 1]
    cold_records = {(r["op"], r["tier"]): r for r in served(worker_trace, cold_a)}
    assert cold_records[("dump", "dram")]["ok"] == FULL_BLOCKS
    assert cold_records[("dump", "storage")]["bytes"] == full_bytes  # the write-back, on another thread
    (warm_load,) = served(worker_trace, warm_a)
    assert (warm_load["op"], warm_load["tier"], warm_load["ok"], warm_load["bytes"]) == (
        "load",
        "dram",
        FULL_BLOCKS,
        full_bytes,
    )
    assert all(r["ms"] >= 0 for r in worker_trace)

    # -- second server on the same store: storage hits, then a damaged block ----------------------------------------
    damaged = sorted(b_files)[0]
    raw = bytearray(damaged.read_bytes())
    raw[-1] ^= 0xFF  # a payload byte: the checksum fails
    damaged.write_bytes(bytes(raw))

    second = start(tiny_model, config_file, tmp_path / "server2.log")
    try:
        n0 = scrape(second)
        restart_a = complete(second, prompt_a)
        n1 = wait_for(second, lambda m: value(m, "hit_blocks_total", tier="storage") >= FULL_BLOCKS)
        assert restart_a["token_ids"] == cold_a["token_ids"]
        assert delta(n1, n0, "lookup_hit_blocks_total") == FULL_BLOCKS
        assert delta(n1, n0, "load_blocks_total", tier="dram") == FULL_BLOCKS
        assert delta(n1, n0, "hit_blocks_total", tier="dram") == 0
        assert delta(n1, n0, "load_blocks_total", tier="storage") == FULL_BLOCKS
        assert delta(n1, n0, "hit_blocks_total", tier="storage") == FULL_BLOCKS
        assert delta(n1, n0, "load_bytes_total", tier="storage") == full_bytes
        assert value(n1, "load_seconds_count", tier="storage") >= 1
        assert value(n1, "used_bytes", tier="storage") >= 2 * full_bytes  # both prompts' files (with headers)

        damaged_b = complete(second, prompt_b)
        n2 = wait_for(second, lambda m: value(m, "load_failures_total", tier="storage", cause="damaged") >= 1)
        assert damaged_b["token_ids"] == cold_b["token_ids"]  # the damaged block was recomputed
        assert delta(n2, n1, "load_failures_total", tier="storage", cause="damaged") == 1
        assert delta(n2, n1, "hit_blocks_total", tier="storage") == FULL_BLOCKS - 1
        for cause in ("missing", "io_error", "foreign"):
            assert value(n2, "load_failures_total", tier="storage", cause=cause) == 0
    finally:
        log = second.stop()
    assert "1 of 6 blocks failed to load" in log, log[-3000:]
