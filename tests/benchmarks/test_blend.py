"""Tests of ``benchmarks/blend.py``: a tiny run (the 4-layer random Llama, two documents, one reordered prompt) ends
with a JSON summary holding every figure; its blend reused stored documents and computed none, and prefix-only
caching reused fewer of the prompt's tokens."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks import BENCHMARKS, load_script

pytestmark = pytest.mark.engine

MODE_FIELDS = ("ttft_ms", "ttft_samples_ms", "ttft_first_ms", "hit_external_blocks", "first_tokens", "answers")
VS_FULL_FIELDS = ("ratio_to_full", "first_token_agreement", "first_token_logprob_diff", "matching_prefix_tokens")
BLEND_FIELDS = ("reused_tokens", "recomputed_tokens", "computed_chunks", "blend_chunks_ms", "blend_pass_ms")


def test_tiny_run_reports_every_mode_and_blend_reuses_stored_chunks() -> None:
    args = ["--model", "tiny", "--chunks", "2", "--chunk-tokens", "160", "--prompts", "1", "--max-tokens", "2",
            "--check-layer", "model.layers.2.self_attn.attn", "--selection", "question",
            "--question-layers", "1:4"]  # fmt: skip
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / "blend.py"), *args], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-4000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["benchmark"] == "blend" and summary["command"] == "benchmarks/blend.py " + " ".join(args)
    assert {"machine", "versions", "date"} <= summary.keys() and summary["orders"] == [[1, 0]]
    assert summary["check_layer"] == "model.layers.2.self_attn.attn" and summary["selection"] == "question"
    assert summary["question_layers"] == [1, 4]
    full, prefix, blend = summary["full"], summary["prefix_only"], summary["blend"]["0.15"]
    for row in (full, prefix, blend):
        assert all(field in row for field in MODE_FIELDS), row
        assert row["ttft_ms"] > 0 and row["ttft_first_ms"] > 0 and len(row["ttft_samples_ms"]) == 1
        assert row["failed_loads"] == 0
    for row in (prefix, blend):
        assert all(field in row for field in VS_FULL_FIELDS), row
        assert 0 <= row["matching_prefix_tokens"][0] <= 2
        # one prompt: the ratio of its TTFTs (computed before the TTFTs were rounded to 0.01 ms)
        assert row["ratio_to_full"] == pytest.approx(row["ttft_ms"] / full["ttft_ms"], rel=2e-3, abs=1e-3)
        assert 0 <= row["first_token_agreement"] <= 1
    assert full["hit_external_blocks"] == [0]  # kv_consumer on an empty store
    assert all(field in blend for field in BLEND_FIELDS) and blend["blended_prompts"] == 1
    assert blend["reused_tokens"][0] > 0 and blend["computed_chunks"] == [0]
    assert blend["recomputed_tokens"][0] > 0
    assert prefix["hit_external_blocks"][0] < blend["hit_external_blocks"][0]
    assert prefix["prompt_reused_tokens"][0] < blend["prompt_reused_tokens"][0]
    assert summary["meets_target"] in (True, False)


def test_a_bad_check_layer_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        load_script("blend").parse_args(["--check-layer", "layers.1"])
    assert "--check-layer 'layers.1': not an attention layer name; allowed: model.layers.<i>.self_attn.attn" in (
        capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        load_script("blend").parse_args(["--question-layers", "4:1", "--selection", "question"])
    assert "question_layers [4, 1] must be [first, end) with 0 <= first < end" in capsys.readouterr().err


def test_shuffles_are_distinct_and_never_in_order() -> None:
    blend = load_script("blend")
    orders = blend.shuffles(4, 23, seed=0)
    assert len(set(orders)) == 23 and (0, 1, 2, 3) not in orders
    assert blend.shuffles(4, 3, seed=1) == blend.shuffles(4, 3, seed=1)
    with pytest.raises(SystemExit):
        blend.shuffles(2, 2, seed=0)


def test_blend_lines_parses_the_log_of_each_request() -> None:
    blend = load_script("blend")
    log = (
        "[UC][I] request_id: 2-b2, blend of tokens 128-322: 2 chunks, 128 tokens with their chunk's own KV (0 chunks "
        "were not stored: computed on their own and stored now), 69 recomputed after model.layers.1.self_attn.attn "
        "(ratio 0.15, by the question's attention); chunks 29 ms, pass 530 ms\n"
    )
    (line,) = blend.blend_lines(log).values()
    assert (line.tokens, line.chunks, line.reused, line.computed_chunks, line.recomputed) == (194, 2, 128, 0, 69)
    assert (line.chunks_ms, line.pass_ms) == (29.0, 530.0)


def test_first_chunk_prompts_start_with_the_head_as_their_own_chunk(tmp_path: Path) -> None:
    blend = load_script("blend")
    assert blend.prompt_of(["a", "b"], (1, 0)) == "b<file_sep>a<file_sep>" + blend.QUESTION
    with_head = blend.prompt_of(["a", "b"], (1, 0), blend.HEAD)
    assert with_head == blend.HEAD + "<file_sep>b<file_sep>a<file_sep>" + blend.QUESTION
    args = blend.parse_args(["--chunk-context", "first_chunk"])
    config = blend.ucm_config(tmp_path, 5, 0.15, args.check_layer, args.chunk_context)
    assert config["ucm_sparse_config"]["Blend"]["chunk_context"] == "first_chunk"
    assert "ucm_sparse_config" not in blend.ucm_config(tmp_path, 5, None)
    with pytest.raises(SystemExit):
        blend.parse_args(["--chunk-context", "head"])
