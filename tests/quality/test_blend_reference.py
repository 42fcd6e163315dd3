"""Tests of ``ucm.quality.blend_reference`` (the pure-torch blend) and ``benchmarks/blend_selection.py``, on a
4-layer random Llama: recomputing every token gives full prefill's KV and tokens; recomputing none keeps the stored
KV after the choosing layer, keys moved to the chunk's positions; the question's scores are the attention
weights Hugging Face's eager attention reports; the oracle needs full prefill's KV; bad rules are named."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.benchmarks import BENCHMARKS
from tests.helpers import MODELS_DIR
from ucm.kernels.blend import recompute_count
from ucm.quality.blend_reference import ReferenceModel, Rule, blend, chunk_spans, parse_rule

CE = 5  # SmolLM2's <file_sep>, the chunk end
BS = 16


@pytest.fixture(scope="module")
def model() -> ReferenceModel:
    from ucm.testing.models import ensure_tiny_llama

    return ReferenceModel(ensure_tiny_llama(MODELS_DIR, num_hidden_layers=4))


def _prompt(order: list[int]) -> list[int]:
    """A head of 20 tokens, then three documents (70, 53, 90 tokens) in ``order``, each ended by the chunk end."""
    rng = random.Random(7)
    head = [rng.randrange(100, 40000) for _ in range(20)] + [CE]
    docs = [[rng.randrange(100, 40000) for _ in range(n)] + [CE] for n in (70, 53, 90)]
    return head + [t for k in order for t in docs[k]]


@pytest.mark.parametrize("context", ["first_chunk", "none"])
def test_recomputing_every_token_is_full_prefill(model: ReferenceModel, context: str) -> None:
    store: dict = {}
    blend(model, _prompt([0, 1, 2]), store, chunk_end_id=CE, rule=parse_rule("deviation@1:0"), block_size=BS,
          chunk_context=context)  # fmt: skip  # the store now holds every document
    ids = _prompt([2, 0, 1])
    full, _ = model.prefill(ids)
    for rule in ("deviation@1:1", "progressive@0:1,2:1", "oracle@2:1", "question@1:1", "question[0:4]@0:1"):
        got = blend(model, ids, store, chunk_end_id=CE, rule=parse_rule(rule), block_size=BS, chunk_context=context,
                    full_kv=full, query_ids=[300, 301])  # fmt: skip
        assert got.recomputed == len(ids) - got.start
        torch.testing.assert_close(got.kv, full, atol=2e-5, rtol=1e-4)
        assert model.greedy(got.kv, [300, 301], 4) == model.greedy(full, [300, 301], 4)


def test_recomputing_no_token_keeps_the_moved_stored_kv(model: ReferenceModel) -> None:
    store: dict = {}
    ids = _prompt([2, 0, 1])
    got = blend(model, ids, store, chunk_end_id=CE, rule=Rule("deviation", ((1, 0.0),)), block_size=BS)
    spans = chunk_spans(ids, CE)
    head = spans[0][1]
    assert got.start == spans[1][1] // BS * BS  # the head and the first document are the stored prefix
    full, _ = model.prefill(ids)
    torch.testing.assert_close(got.kv[:, :, : got.start], full[:, :, : got.start])
    torch.testing.assert_close(got.kv[:2], full[:2], atol=2e-5, rtol=1e-4)  # up to the choosing layer: computed
    s, e = spans[2]  # the second document, computed after the head: stored whole, its partial last block too
    assert (head + e - s) % BS != 0
    chunk = store[tuple(ids[:head] + ids[s:e])]
    moved = chunk[:, 0, head:].clone()
    flat = moved.reshape(-1, model.num_kv_heads, model.head_dim)
    model.rotate_(flat, torch.full((flat.shape[0],), s - head, dtype=torch.int64))
    torch.testing.assert_close(got.kv[2:, 0, s:e], moved.view_as(moved)[2:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.kv[2:, 1, s:e], chunk[2:, 1, head:])
    assert got.stored == len(ids) - got.start and got.recomputed == 0


def test_question_scores_are_the_attention_weights(model: ReferenceModel) -> None:
    """Over full prefill's KV, the attention the question's tokens pay to each earlier token, summed over heads,
    tokens and layers, is what Hugging Face's eager attention reports for the whole prompt; the question rule
    recomputes the stored tokens of highest score."""
    from transformers import AutoModelForCausalLM

    from ucm.testing.models import ensure_tiny_llama

    ids, query = _prompt([2, 0, 1]), [300, 301, 302]
    full, _ = model.prefill(ids)
    got = model.question_scores(full, query, range(2, 4))
    checkpoint = ensure_tiny_llama(MODELS_DIR, num_hidden_layers=4)  # the one ReferenceModel loaded
    hf = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32, attn_implementation="eager")
    weights = hf(torch.tensor([ids + query]), output_attentions=True).attentions  # per layer [1, heads, T, T]
    want = sum(w[0, :, len(ids) :, : len(ids)].sum(dim=(0, 1)) for w in weights[2:4])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    store: dict = {}
    picked = blend(model, ids, store, chunk_end_id=CE, rule=parse_rule("question[2:4]@1:0.2"), block_size=BS,
                   query_ids=query)  # fmt: skip
    assert picked.recomputed == recompute_count(picked.stored, 0.2) == picked.chosen.shape[0]


def test_rules_and_errors_are_named(model: ReferenceModel) -> None:
    assert parse_rule("progressive@1:0.4,3:0.15").stages == ((1, 0.4), (3, 0.15))
    assert parse_rule("oracle@2:0.1").name == "oracle@2:0.1"
    assert parse_rule("question[2:4]@1:0.1").name == "question[2:4]@1:0.1"
    assert parse_rule("question@1:0.1").question_layers(30) == range(8, 30)
    for text, needle in (
        ("deviation", "is not kind[lo:hi]@layer:ratio"),
        ("deviation@1", "is not kind[lo:hi]@layer:ratio"),
        ("best@1:0.1", "'best' is not one of"),
        ("deviation@1:0.1,2:0.05", "takes one (layer, ratio) stage"),
        ("progressive@2:0.1,1:0.05", "must be >= 0 and increasing"),
        ("progressive@1:0.1,2:0.3", "must be in [0, 1] and not increasing"),
        ("oracle@1:1.5", "must be in [0, 1]"),
        ("deviation[1:2]@1:0.1", "are for 'question' only"),
        ("question[3:1]@1:0.1", "score layers [3, 1] must be [lo:hi) with 0 <= lo < hi"),
        ("question[3]@1:0.1", "is not kind[lo:hi]@layer:ratio"),
    ):
        with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
            parse_rule(text)
    ids = _prompt([0, 1, 2])
    with pytest.raises(ValueError, match="needs the full prefill's KV"):
        blend(model, ids, {}, chunk_end_id=CE, rule=parse_rule("oracle@1:0.1"), block_size=BS)
    with pytest.raises(ValueError, match="needs the prompt's tokens after the context"):
        blend(model, ids, {}, chunk_end_id=CE, rule=parse_rule("question@1:0.1"), block_size=BS)
    with pytest.raises(ValueError, match="layer 4 >= the model's 4 layers"):
        blend(model, ids, {}, chunk_end_id=CE, rule=parse_rule("deviation@4:0.1"), block_size=BS)
    with pytest.raises(ValueError, match="must end with chunk_end_id"):
        blend(model, [*ids, 300], {}, chunk_end_id=CE, rule=parse_rule("deviation@1:0.1"), block_size=BS)


def test_selection_script_pools_rules_against_full_prefill(tiny_model: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / "blend_selection.py"), "--model", str(tiny_model), "--lengths", "400",
         "--orders", "2", "--seeds", "0-1", "--rule", "deviation@1:0.15", "--rule", "oracle@0:0.15", "--rule",
         "question@1:0.15"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    pooled = summary["pooled"]
    assert pooled["seeds"] == [0, 1] and pooled["questions"] == 16  # 2 seeds x 2 orders x 4 documents
    assert set(pooled["right"]) == {"full", "deviation@1:0.15", "oracle@0:0.15", "question@1:0.15"}
    for name, right in pooled["right"].items():
        assert sum(pooled["right_by_depth"][name].values()) == right
    assert pooled["recomputed_mean"]["deviation@1:0.15"] > 0
    assert len(summary["per_seed"][0]["recomputed"]["question@1:0.15"]) == 8  # blended for each question
    questions = [q for seed in summary["per_seed"] for q in seed["questions"]]
    assert len(questions) == 16 and sum(q["full"] for q in questions) == pooled["right"]["full"]
    assert "seed 0:" in run.stdout and "seed 1:" in run.stdout
    bad = subprocess.run(
        [sys.executable, str(BENCHMARKS / "blend_selection.py"), "--model", str(tiny_model), "--rule", "x@1:0.1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "'x' is not one of" in bad.stderr
