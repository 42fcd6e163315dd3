"""CacheBlend's quality comparison (``ucm.quality.blend``) and its ``blend`` task (``tasks.blend_items``).

Without an engine: every document is followed by the chunk-end token and has the same tokens in every order and
position, the orders differ, the questions' answers are the asked document's number, and the comparison's pieces
(modes, configs, UCM's blend log lines) are right. With the engine (SmolLM2, float32, tiny prompts): Blend at ratio 1
recomputes every token, so its answers are full prefill's, while every scored prompt takes its documents from the
store.
"""

from __future__ import annotations

import itertools
import math

import pytest

from tests.helpers import LOGPROB_TOL, MODELS_DIR
from ucm.config import load_config_file
from ucm.quality.blend import (
    Mode,
    blend_totals,
    chunk_end_token_id,
    modes,
    paired_ratio_interval,
    parse_blends,
    pool_reports,
    primers,
    run_blend_quality,
    ucm_config,
)
from ucm.quality.harness import build_items
from ucm.quality.tasks import BLEND_CHUNK_END, blend_items, blend_suite, document_orders, seeded_rng

LENGTHS = [700, 1500]  # not powers of two
SEP_ID = 5  # <file_sep> in SmolLM2's tokenizer


@pytest.fixture(scope="module")
def smol_tokenizer(real_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(real_model))


def _chunks(tokenizer, prompt: str, end_id: int) -> list[tuple[int, ...]]:
    """The prompt's token ids cut after each chunk-end token; the last piece is the question."""
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    out, start = [], 0
    for i, tok in enumerate(ids):
        if tok == end_id:
            out.append(tuple(ids[start : i + 1]))
            start = i + 1
    out.append(tuple(ids[start:]))
    return out


@pytest.mark.parametrize(
    ("chunk_end", "end_id"), [(BLEND_CHUNK_END, SEP_ID), ("<repo_name>", 3)], ids=["file_sep", "repo"]
)
def test_every_document_ends_with_the_chunk_end_token(smol_tokenizer, chunk_end, end_id):
    items = blend_items(smol_tokenizer, LENGTHS, seed=2, num_docs=3, orders=3, chunk_end=chunk_end)
    assert len(items) == len(LENGTHS) * 3 * 3
    for it in items:
        pieces = _chunks(smol_tokenizer, it.prompt, end_id)
        assert len(pieces) == 3 + 2  # intro, 3 documents, question
        assert all(p[-1] == end_id for p in pieces[:-1])
        assert end_id not in pieces[-1]
        assert it.prompt.count(chunk_end) == 4
        n = len(smol_tokenizer.encode(it.prompt, add_special_tokens=False))
        assert it.length - 24 <= n <= it.length, (it.id, n)


def test_same_documents_in_different_orders(smol_tokenizer):
    items = blend_items(smol_tokenizer, LENGTHS, seed=0, orders=4)
    for length in LENGTHS:
        cell = [it for it in items if it.length == length]
        assert len(cell) == 16  # 4 orders x 4 questions
        docs = [_chunks(smol_tokenizer, it.prompt, SEP_ID)[1:-1] for it in cell]
        # every prompt holds the same 4 documents, token for token, whatever their positions
        assert all(sorted(d) == sorted(docs[0]) for d in docs)
        assert len(set(docs[0])) == 4
        assert len({tuple(d) for d in docs}) == 4  # 4 distinct orders, each asked 4 questions
        intro = {_chunks(smol_tokenizer, it.prompt, SEP_ID)[0] for it in cell}
        assert len(intro) == 1
        # a document's header names it whatever its position
        for d in docs:
            for piece in d:
                k = smol_tokenizer.decode(piece).split("Document ", 1)[1][0]
                assert f"The reference number of Document {k} is" in smol_tokenizer.decode(piece)


def test_questions_ask_a_document_by_name_and_answers_are_its_number(smol_tokenizer):
    items = blend_items(smol_tokenizer, [1200], seed=5, orders=3, questions=2)
    assert [it.id for it in items] == [
        "blend-L1200-o0-doc1",
        "blend-L1200-o0-doc2",
        "blend-L1200-o1-doc3",
        "blend-L1200-o1-doc4",
        "blend-L1200-o2-doc1",
        "blend-L1200-o2-doc2",
    ]
    for it in items:
        k = it.id.rsplit("doc", 1)[1]
        assert it.task == "blend" and it.answer is not None and len(it.answer) == 5
        assert it.prompt.count(f"The reference number of Document {k} is {it.answer}.") == 1
        assert it.prompt.endswith(
            f"Question: What is the reference number of Document {k}?\nAnswer: The reference number of Document {k} is"
        )
        # depth: the asked document's relative position in this order
        docs = it.prompt.split(BLEND_CHUNK_END)[1:-1]
        pos = next(i for i, d in enumerate(docs) if d.startswith(f"\nDocument {k}:\n"))
        assert it.depth == pytest.approx(pos / 3)
    assert len({it.answer for it in items}) == 4
    # the same document keeps its number in every order
    assert items[0].answer == items[4].answer


def test_blend_items_are_seeded(smol_tokenizer):
    a = blend_suite(smol_tokenizer, [1024], short=True, seed=0)
    assert a == blend_suite(smol_tokenizer, [1024], short=True, seed=0)
    assert len(a) == 4  # 2 orders x 2 questions
    b = blend_suite(smol_tokenizer, [1024], short=True, seed=1)
    assert [x.answer for x in a] != [x.answer for x in b]


def test_harness_builds_the_blend_suite(real_model):
    """``python -m ucm.quality --suite blend``: the harness's item builder gives the short blend suite."""
    items = build_items(real_model, "blend", [1024], short=True, seed=0)
    assert [it.task for it in items] == ["blend"] * 4
    assert all(it.prompt.count(BLEND_CHUNK_END) == 5 for it in items)


def test_document_orders_are_distinct():
    orders = document_orders(3, 6, seeded_rng("x"))
    assert sorted(orders) == sorted(itertools.permutations(range(3)))
    with pytest.raises(ValueError, match=r"orders=7 must be in 1\.\.6"):
        document_orders(3, 7, seeded_rng("x"))


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"num_docs": 1}, "num_docs=1 must be >= 2"),
        ({"questions": 5}, "questions=5 must be in 1..num_docs=4"),
        ({"orders": 25}, r"orders=25 must be in 1\.\.24"),
        ({"chunk_end": ""}, "chunk_end must be a non-empty text"),
        ({"chunk_end": "License"}, "occurs in a document source"),
        ({"lengths": [150]}, "blend length 150 leaves"),
    ],
    ids=["docs", "questions", "orders", "chunk-end", "chunk-end-in-text", "length"],
)
def test_blend_items_reject_bad_parameters(smol_tokenizer, kwargs, needle):
    lengths = kwargs.pop("lengths", [1000])
    with pytest.raises(ValueError, match=needle):
        blend_items(smol_tokenizer, lengths, 0, **kwargs)


def test_chunk_end_token_id(smol_tokenizer):
    assert chunk_end_token_id(smol_tokenizer, BLEND_CHUNK_END) == SEP_ID
    with pytest.raises(ValueError, match="is 2 tokens"):
        chunk_end_token_id(smol_tokenizer, "two words")


def test_comparison_rejects_a_chunk_end_found_elsewhere_in_the_prompts(real_model):
    """'Question' is one token and absent from the documents, but the question line holds it too (6 times in a
    prompt, not 5): the comparison fails before starting an engine."""
    with pytest.raises(ValueError, match=r"holds the chunk-end token 17872 \('Question'\) 6 times, expected 5"):
        run_blend_quality(real_model, lengths=[800], chunk_end="Question")


def test_modes_and_their_configs(tmp_path):
    got = modes()
    assert [m.name for m in got] == [
        "full",
        "prefix_only",
        "naive_reuse",
        "blend_0.05",
        "blend_0.15",
        "blend_0.3",
        "blend_1",
    ]
    assert [m.ratio for m in got] == [None, None, 0.0, 0.05, 0.15, 0.3, 1.0]
    assert [m.name for m in modes([0.15], prefix_only=False)] == ["full", "blend_0.15"]
    with pytest.raises(ValueError, match="outside"):
        modes([1.5])
    with pytest.raises(ValueError, match="twice"):
        modes([0.1, 0.1])
    with pytest.raises(ValueError, match="no UCM config"):
        ucm_config(got[0], SEP_ID)
    # the YAMLs pass UCM's own schema
    import yaml

    for mode in got[1:]:
        path = tmp_path / f"{mode.name}.yaml"
        path.write_text(yaml.safe_dump(ucm_config(mode, SEP_ID)))
        cfg = load_config_file(path)
        if mode.ratio is None:
            assert cfg.ucm_sparse_config is None
        else:
            assert cfg.ucm_sparse_config is not None and cfg.ucm_sparse_config.Blend is not None
            assert cfg.ucm_sparse_config.Blend.ratio == mode.ratio
            assert cfg.ucm_sparse_config.Blend.chunk_end_token_id == SEP_ID
    path = tmp_path / "question.yaml"
    path.write_text(yaml.safe_dump(ucm_config(got[4], SEP_ID, selection="question", question_layers=[15, 30])))
    blend = load_config_file(path).ucm_sparse_config.Blend  # type: ignore[union-attr]
    assert blend is not None and (blend.selection, blend.question_layers) == ("question", [15, 30])


def test_blend_log_lines_are_summed_per_request():
    line = (
        "INFO [blend.py:305] request_id: {rid}, blend of tokens {s}-{e}: 5 chunks, {r} tokens with their chunk's "
        "own KV ({c} chunks were not stored: computed on their own and stored now), {k} recomputed after "
        "model.layers.1.self_attn.attn (ratio 0.15, by KV deviation); chunks 3 ms, pass 40 ms"
    )
    log = "\n".join(
        [
            line.format(rid="0", s=0, e=900, r=800, c=4, k=120),
            "unrelated",
            line.format(rid="1", s=0, e=900, r=850, c=0, k=130),
            line.format(rid="2", s=0, e=500, r=400, c=0, k=60),
            line.format(rid="2", s=500, e=900, r=300, c=0, k=50),
        ]
    )
    logs = parse_blends(log)
    assert [(b.request_id, b.tokens, b.reused, b.computed_chunks, b.recomputed) for b in logs] == [
        ("0", 900, 800, 4, 120),
        ("1", 900, 850, 0, 130),
        ("2", 900, 700, 0, 110),
    ]
    totals = blend_totals(logs, num_primers=1, num_scored=2)
    assert totals["complete"] and totals["chunks_computed"] == 0 and totals["primer_chunks_computed"] == 4
    assert totals["reused_tokens"] == 1550 and totals["recomputed_tokens"] == 240
    assert not blend_totals(logs, num_primers=1, num_scored=3)["complete"]


def test_primers_are_the_first_item_of_each_length(smol_tokenizer):
    items = blend_items(smol_tokenizer, LENGTHS, seed=0, orders=2, questions=1)
    assert [it.id for it in primers(items)] == ["blend-L700-o0-doc1", "blend-L1500-o0-doc1"]


@pytest.mark.engine
def test_ratio_one_answers_as_full_prefill(tmp_path):
    """SmolLM2 (float32, 32-token blocks): 3 documents of ~110 tokens in 2 orders, one question each; the UCM engine
    first runs a primer that stores the documents, then both scored prompts blend them from the store."""
    from ucm.testing.models import ensure_smollm2

    model = ensure_smollm2(MODELS_DIR)
    report = run_blend_quality(
        model,
        lengths=[400],
        mode_list=[Mode("full", ucm=False), Mode("blend_1", ucm=True, ratio=1.0)],
        num_docs=3,
        orders=2,
        questions=1,
        block_size=32,
        work_dir=tmp_path,
    )
    full, blend = report["modes"]["full"], report["modes"]["blend_1"]
    assert report["num_prompts"] == 2 and report["num_primers"] == 1
    assert blend["answers"] == full["answers"]
    assert blend["accuracy"] == full["accuracy"] and blend["f1"] == full["f1"]
    vs = blend["vs_dense"]
    assert vs["exact_match_rate"] == 1.0, vs["mismatched"]
    assert vs["max_abs_logprob_diff"] < LOGPROB_TOL
    totals = blend["blend"]
    assert totals["complete"] and totals["blends"] == 2
    # the primer computed the 3 documents and the prompt's head (its first chunk, shorter than a block: stored as a
    # partial block)
    assert totals["chunks_computed"] == 0 and totals["primer_chunks_computed"] == 4
    assert totals["reused_tokens"] > 0.7 * totals["blended_tokens"]  # the documents came from the store
    assert math.isclose(totals["recomputed_tokens"], totals["blended_tokens"])  # ratio 1: every token


def test_paired_ratio_interval():
    same = [True, False, True, True] * 10
    assert paired_ratio_interval(same, same) == {"ratio": 1.0, "low": 1.0, "high": 1.0, "share_at_target": 1.0}
    # 40 questions: the other mode loses 4 of the baseline's 30 right answers and gains 1
    base = [True] * 30 + [False] * 10
    other = [False] * 4 + [True] * 26 + [True] + [False] * 9
    got = paired_ratio_interval(base, other)
    assert got["ratio"] == 27 / 30
    assert 0.75 < got["low"] < 0.9 < got["high"] < 1.1 and 0 < got["share_at_target"] < 0.2
    assert paired_ratio_interval(base, other) == got  # seeded
    # pairing: the same flips among 4x the questions give an interval about half as wide
    wide = paired_ratio_interval(base * 4, other * 4)
    assert wide["ratio"] == got["ratio"] and wide["high"] - wide["low"] < 0.6 * (got["high"] - got["low"])
    with pytest.raises(ValueError, match="3 baseline and 2 other"):
        paired_ratio_interval([True] * 3, [True] * 2)
    with pytest.raises(ValueError, match="answered no question right"):
        paired_ratio_interval([False] * 3, [True] * 3)


def _report(seed: int, full: list[bool], blend: list[bool], **settings) -> dict:
    ids = [f"blend-L400-o0-doc{i + 1}" for i in range(len(full))]
    return {
        "seed": seed,
        "model": "m",
        "dtype": "float32",
        "block_size": 32,
        "lengths": [400],
        "num_docs": 4,
        "orders": 1,
        "chunk_end": "<file_sep>",
        "check_layer": "model.layers.1.self_attn.attn",
        "chunk_context": "none",
        **settings,
        "depths": {item: i / max(1, len(ids) - 1) for i, item in enumerate(ids)},
        "modes": {
            "full": {"correct": dict(zip(ids, full, strict=True))},
            "blend_0.15": {"correct": dict(zip(ids, blend, strict=True))},
        },
    }


def test_pool_reports_pairs_questions_across_seeds():
    a = _report(0, [True, True, False, True], [True, False, False, True])
    b = _report(3, [True, False, True, True], [True, True, True, True])
    pooled = pool_reports([a, b])
    assert pooled["seeds"] == [0, 3] and pooled["questions"] == 8
    assert pooled["right"] == {"full": 6, "blend_0.15": 6}
    assert pooled["right_per_seed"] == {"full": {0: 3, 3: 3}, "blend_0.15": {0: 2, 3: 4}}
    assert pooled["right_by_depth"] == {
        "full": {"0.00": [2, 2], "0.33": [1, 2], "0.67": [1, 2], "1.00": [2, 2]},
        "blend_0.15": {"0.00": [2, 2], "0.33": [1, 2], "0.67": [1, 2], "1.00": [2, 2]},
    }
    vs = pooled["vs_full"]["blend_0.15"]
    assert (vs["ratio"], vs["only_full_right"], vs["only_this_right"]) == (1.0, 1, 1)
    assert pooled["target"]["met"] and pooled["target"]["interval"] == [vs["low"], vs["high"]]
    with pytest.raises(ValueError, match=r"seeds \[0, 0\] name one seed twice"):
        pool_reports([a, a])
    with pytest.raises(ValueError, match=r"seed 3's report differs from seed 0's in \['check_layer'\]"):
        pool_reports([a, _report(3, [True], [True], check_layer="model.layers.3.self_attn.attn")])
    with pytest.raises(ValueError, match="no report"):
        pool_reports([])
    nothing_right = pool_reports([_report(0, [False, False], [True, False])])
    assert nothing_right["right"] == {"full": 0, "blend_0.15": 1} and "vs_full" not in nothing_right
