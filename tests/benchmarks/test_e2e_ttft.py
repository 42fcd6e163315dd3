"""Tests of ``benchmarks/e2e_ttft.py`` without engines: ``main()`` runs with its engine processes replaced by
:class:`FakeEngines`, a model of what they report (UCM's per-request hits under prefix semantics, vLLM's prefix
cache, ExampleConnector's whole-prompt hits), so that the phases, the checks and the JSON summary are exercised in
seconds. The real figures come from running the script (see benchmarks/RESULTS.md)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.benchmarks import load_script
from ucm.testing.engine import RequestResult

BLOCK_CHARS = 100  # the fake prompts' "block": 100 characters
SUMMARY_KEYS = [
    "prompt_tokens",
    "recompute_ms",
    "inmemory_hit_ms",
    "ucm_dram_hit_ms",
    "ucm_storage_hit_ms",
    "ucm_layerwise_storage_hit_ms",
    "layerwise_over_blockwise",
    "ucm_compressed_storage_hit_ms",
    "compressed_over_uncompressed",
    "store_bytes",
    "example_connector_restart_ms",
    "cold_without_ucm_ms",
    "cold_with_ucm_ms",
    "dram_hit_over_inmemory_hit",
    "storage_hit_over_inmemory_hit",
    "cold_overhead",
    "recompute_over_storage_hit",
    "ucm_hit_blocks",
    "multiturn",
    "page_cache_dropped",
    "page_cache_note",
    "outputs_identical",
    "outputs_inmemory_equal_recompute",
    "repeats",
    "restarts",
    "engine_core",
    "engine_seconds",
    "raw_ttft_ms",
    "ttft_samples_ms",
    "problems",
    "ucm_log_lines",
    "machine",
    "versions",
    "date",
    "runtime_s",
    "plot",
]
MULTITURN_KEYS = [
    "turn_prompt_tokens",
    "ucm_fill_ttft_ms",
    "ucm_fill_hit_blocks",
    "ucm_restart_ttft_ms",
    "ucm_restart_hit_blocks",
    "ucm_restart_total_blocks",
    "example_fill_ttft_ms",
    "example_restart_ttft_ms",
    "example_restart_hit_lines",
    "example_restart_requests",
    "fill_turns",
]


class FakeEngines:
    """Stands in for ``run_engine``: one call is one engine process. A prompt's blocks are its 100-character
    prefixes; a UCM store holds the blocks its processes computed (``lose`` names stores that keep nothing: every
    request misses); vLLM's prefix cache, when on, holds the blocks of this process (reset on request);
    ExampleConnector hits whole prompts it stored. ``crash`` names log files whose process fails."""

    def __init__(self, lose: tuple[str, ...] = (), crash: tuple[str, ...] = ()) -> None:
        self.stores: dict[str, set[str]] = {}
        self.lose, self.crash = lose, crash
        self.processes: list[str] = []

    def __call__(self, spec: dict[str, Any], env: Any = None, log_path: Path | None = None) -> tuple[list, str]:
        assert log_path is not None
        self.processes.append(log_path.stem)
        if log_path.stem in self.crash:
            log_path.write_text('File "x.py", line 1\nRuntimeError: boom\n')
            raise RuntimeError("engine process failed (exit 1):\nRuntimeError: boom")
        connector = spec["connector"] or {}
        extra = connector.get("kv_connector_extra_config", {})
        ucm = connector.get("kv_connector") == "UCMConnector"
        if ucm:
            config = extra["ucm_connectors"][0]["ucm_connector_config"]
            store_dir, pipeline = config["storage_backends"], config["store_pipeline"]
        else:
            store_dir, pipeline = extra.get("shared_storage_path", ""), ""
        stored = self.stores.setdefault(store_dir, set())
        hbm: set[str] = set()
        results, lines = [], []
        for i, req in enumerate(spec["requests"]):
            prompt = req["prompt"]
            if req.get("reset_prefix_cache"):
                hbm.clear()
            blocks = [prompt[: (b + 1) * BLOCK_CHARS] for b in range(len(prompt) // BLOCK_CHARS)]
            hit_hbm = _leading(blocks, hbm) if spec["enable_prefix_caching"] else 0
            result = RequestResult(
                token_ids=[len(prompt) % 97 + t for t in range(req["max_tokens"])],
                text="",
                logprobs=[0.0] * req["max_tokens"],
                ttft_ms=1000.0,
                num_prompt_tokens=len(prompt),
            )
            if ucm:
                hit_ext = max(0, _leading(blocks, stored) - hit_hbm)
                result.total_blocks, result.hit_hbm, result.hit_external = len(blocks), hit_hbm, hit_ext
                lines.append(
                    f"[UC][I] request_id: {i}, total_blocks_num: {len(blocks)}, hit hbm: {hit_hbm}, "
                    f"hit external: {hit_ext}"
                )
                if log_path.stem not in self.lose:
                    stored.update(blocks)
                    for b in blocks:  # one block file each, "compressed" in the KVfold store
                        name = hashlib.blake2b(b.encode(), digest_size=8).hexdigest() + ".ucmb"
                        (Path(store_dir) / name).write_bytes(b"\0" * (60 if "Compress" in pipeline else 90))
                served = hit_hbm + hit_ext
            elif store_dir:  # ExampleConnector
                served = len(blocks) if prompt in stored else hit_hbm
                if prompt in stored:
                    lines.append("External Cache Hit!")
                stored.add(prompt)
            else:
                served = hit_hbm
            result.ttft_ms = 50.0 + 1000.0 * (len(blocks) - served) / max(1, len(blocks)) + (20.0 if ucm else 0.0)
            if spec["enable_prefix_caching"]:
                hbm.update(blocks)
            results.append(result)
        stderr = "\n".join(lines) + "\n"
        log_path.write_text(stderr)
        return results, stderr


def _leading(blocks: list[str], held: set[str]) -> int:
    n = 0
    while n < len(blocks) and blocks[n] in held:
        n += 1
    return n


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> ModuleType:
    module = load_script("e2e_ttft")
    conversation = ["C" * 1600 + "?"]
    for k in range(2):
        conversation.append(conversation[-1] + chr(ord("D") + k) * 300 + "?")
    prompts = module.Prompts("M" * 1500, 1500, conversation, [len(t) for t in conversation])
    monkeypatch.setattr(module, "ensure_smollm2", lambda models_dir: tmp_path / "model")
    monkeypatch.setattr(module, "build_prompts", lambda *args: prompts)
    monkeypatch.setattr(module, "drop_page_cache", lambda: True)
    monkeypatch.setattr(module, "REPO", tmp_path)
    return module


def run_main(bench: ModuleType, engines: FakeEngines, tmp_path: Path, capsys: Any, *options: str) -> dict[str, Any]:
    bench.run_engine = engines
    out = tmp_path / "summary.json"
    assert bench.main(["--repeats", "2", "--restarts", "2", *options, "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert out.read_text() == json.dumps(summary, indent=1) + "\n"  # the file: the same summary, indented
    assert "TTFT through vLLM" in stdout  # the table comes before the JSON line
    # The work directory is removed; the plot is beside the JSON.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json", "summary.png"]
    assert summary["plot"] == str(tmp_path / "summary.png")
    assert (tmp_path / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return summary


def test_every_phase_runs_and_the_summary_has_every_key(bench, tmp_path, capsys):
    engines = FakeEngines()
    summary = run_main(bench, engines, tmp_path, capsys)
    assert engines.processes == [
        "recompute",
        "inmemory_hit",
        "ucm_fill",
        "example_fill",
        "ucm_compress_fill",
        *(f"{kind}{k}" for k in range(2) for kind in ("ucm_restart", "ucm_layerwise_restart",
                                                      "ucm_compress_restart", "example_restart")),
    ]  # fmt: skip
    assert list(summary) == SUMMARY_KEYS
    assert list(summary["multiturn"]) == MULTITURN_KEYS
    assert summary["problems"] == [] and summary["ucm_log_lines"] == {}
    assert summary["outputs_identical"] is True and summary["outputs_inmemory_equal_recompute"] is True
    assert summary["ucm_hit_blocks"] == {
        "dram_hit": [15, 15],
        "storage_hit": [15, 15],
        "layerwise_storage_hit": [15, 15],
        "compressed_storage_hit": [15, 15],
        "total_blocks": 15,
    }
    assert summary["recompute_ms"] == 1050.0 and summary["cold_without_ucm_ms"] == 1050.0
    assert summary["inmemory_hit_ms"] == 50.0 and summary["ucm_storage_hit_ms"] == 70.0
    assert summary["cold_overhead"] == round(1070 / 1050, 3) and summary["recompute_over_storage_hit"] == 15.0
    # Blocks of the warm-up prompt (1), the main prompt (15) and, in the uncompressed store, every turn (22).
    assert summary["store_bytes"] == {
        "Cache|Posix": {"files": 1 + 15 + 22, "bytes_per_block": 90},
        "Cache|Compress|Posix": {"files": 1 + 15, "bytes_per_block": 60},
    }
    mt = summary["multiturn"]
    # Turn 1 was stored before the restart; turns 2 and 3 share the previous turn's blocks with it.
    assert mt["ucm_restart_hit_blocks"] == [16, 16, 19] and mt["ucm_restart_total_blocks"] == [16, 19, 22]
    # ExampleConnector hits whole-prompt repeats only: the warm-up, the main prompt and turn 1.
    assert mt["example_restart_hit_lines"] == 3 and mt["fill_turns"] == 1
    assert summary["page_cache_dropped"] is True and summary["engine_core"] == "process"
    assert set(summary["raw_ttft_ms"]) == set(summary["engine_seconds"]) == set(engines.processes)
    samples = summary["ttft_samples_ms"]  # what the medians are taken over, as plotted
    assert list(samples) == [
        "cold, without UCM",
        "cold, with UCM",
        "recompute",
        "vLLM in-memory hit",
        "UCM DRAM hit",
        "UCM storage hit",
        "UCM storage hit, layerwise",
        "UCM storage hit, KVfold",
        "ExampleConnector restart",
    ]
    assert samples["recompute"] == [1050.0, 1050.0] and samples["UCM storage hit"] == [70.0, 70.0]


def test_misses_and_crashes_are_reported(bench, tmp_path, capsys):
    """A compressed store that keeps nothing: its restarts miss (problems, with their UCM log lines); an
    ExampleConnector restart that crashes: its figure is the error text, not a problem."""
    lost = ("ucm_compress_fill", "ucm_compress_restart0", "ucm_compress_restart1")
    engines = FakeEngines(lose=lost, crash=("example_restart0", "example_restart1"))
    summary = run_main(bench, engines, tmp_path, capsys, "--engine-core", "inproc")
    problems = summary["problems"]
    assert len(problems) == 3 and all("compressed hit after restart" in p for p in problems)
    assert summary["ucm_compressed_storage_hit_ms"] is None and summary["compressed_over_uncompressed"] is None
    assert set(summary["ucm_log_lines"]) == {"ucm_compress_restart0", "ucm_compress_restart1"}
    assert summary["example_connector_restart_ms"].startswith("error (restart process): RuntimeError")
    assert summary["multiturn"]["example_restart_ttft_ms"].startswith("error: ")
    assert summary["outputs_identical"] is True and summary["engine_core"] == "inproc"


@pytest.mark.parametrize(
    ("options", "message"),
    [(["--repeats", "0"], "need --prompt-tokens >= 200"), (["--fill-turns", "4"], "need 0 <= --fill-turns")],
)
def test_bad_options_are_refused(bench, options, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(options)
    assert message in capsys.readouterr().err
