"""The quality harness's evaluation sets and metrics, without an engine: prompts hold their answers, lengths are
right, everything is seeded, scoring and comparison catch differences."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from ucm.quality import RECALL_MODEL_DIR
from ucm.quality.harness import compare, logprob_diffs, summarize
from ucm.quality.recall import QUERY, RecallSpec, make_example
from ucm.quality.tasks import (
    EvalItem,
    answer_f1,
    answer_span,
    is_correct,
    multidoc_items,
    passkey_items,
    real_suite,
    recall_suite,
    seeded_rng,
    token_f1,
)
from ucm.quality.train_recall import make_batch
from ucm.testing.engine import RequestResult

LENGTHS = [300, 1000, 2500]  # not powers of two
DEPTHS = [0.0, 0.3, 1.0]


@pytest.fixture(scope="module")
def smol_tokenizer(real_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(real_model))


def test_passkey_prompts_hold_the_key_once_at_the_asked_length(smol_tokenizer):
    items = passkey_items(smol_tokenizer, LENGTHS, DEPTHS, seed=3)
    assert len(items) == len(LENGTHS) * len(DEPTHS)
    for it in items:
        assert it.answer is not None and len(it.answer) == 5
        assert it.prompt.count(f"The pass key is {it.answer}.") == 1
        assert it.prompt.endswith("The pass key is")
        n = len(smol_tokenizer.encode(it.prompt, add_special_tokens=False))
        assert it.length - 16 <= n <= it.length, (it.id, n)
    # depth 0 puts the needle before the haystack, depth 1 right before the question
    first, last = items[0], items[len(DEPTHS) - 1]
    assert first.prompt.index(first.answer) < 300
    assert last.prompt.rindex(last.answer) > len(last.prompt) - 200


def test_long_haystacks_repeat_the_text_and_multidoc_stops_where_documents_end(smol_tokenizer):
    """A passkey prompt longer than the haystack sources (GPL-3 + GPL-2) repeats them, the key still once; a length
    the document sources cannot fill has passkey items and no multidoc ones."""
    from ucm.testing.texts import source_texts

    sources = len(smol_tokenizer.encode("\n\n".join(source_texts()[:2]), add_special_tokens=False))
    long = 3 * sources  # a quarter of it is longer than any licence text (multidoc's documents)
    (it,) = passkey_items(smol_tokenizer, [long], [0.5], seed=3)
    assert it.prompt.count(f"The pass key is {it.answer}.") == 1
    assert long - 16 <= len(smol_tokenizer.encode(it.prompt, add_special_tokens=False)) <= long
    suite = real_suite(smol_tokenizer, [long], short=True, seed=0, max_model_len=long + 64)
    assert {i.task for i in suite if i.length == long} == {"passkey"}


def test_multidoc_documents_share_context_and_differ_in_numbers(smol_tokenizer):
    items = multidoc_items(smol_tokenizer, [1500], seed=1)
    assert len(items) == 4
    context = items[0].prompt.rsplit("\n\nQuestion:", 1)[0]
    for j, it in enumerate(items, start=1):
        assert it.prompt.startswith(context)
        assert f"The reference number of Document {j} is {it.answer}." in it.prompt
        assert it.prompt.endswith(f"The reference number of Document {j} is")
    assert len({it.answer for it in items}) == 4


def test_suites_are_seeded(smol_tokenizer):
    a = real_suite(smol_tokenizer, [1024], short=True, seed=0, max_model_len=8192)
    b = real_suite(smol_tokenizer, [1024], short=True, seed=0, max_model_len=8192)
    c = real_suite(smol_tokenizer, [1024], short=True, seed=1, max_model_len=8192)
    assert a == b
    assert [x.answer for x in a if x.answer] != [x.answer for x in c if x.answer]


def test_seeded_rng_separates_similar_names():
    # random.Random("0-passkey-8172-0.0") and random.Random("0-multidoc-8172") draw the same first key
    keys = {seeded_rng(n).randrange(10**4, 10**5) for n in ("0-passkey-8172-0.0", "0-multidoc-8172")}
    assert len(keys) == 2


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_recall_prompt_answer_is_the_queried_pair(depth):
    spec = RecallSpec()
    ex = make_example(spec, random.Random(7), 253, 1, depth=depth)
    assert ex.words[-2] == QUERY and len(ex.words) == 255
    key = ex.words[-1]
    pos = ex.words.index(key)
    assert ex.words[pos + 1] == ex.answers[0]
    assert ex.words[:-2].count(key) == 1
    assert abs(ex.depth - depth) < 0.02


def test_training_labels_sit_on_the_answers():
    spec = RecallSpec()
    ids, labels = make_batch(spec, random.Random(0), batch=3, total_len=spec.train_len)
    assert ids.shape == labels.shape == (3, spec.train_len)
    mask = labels != -100
    assert int(mask.sum()) == 3 * spec.num_queries
    assert bool((ids[mask] == labels[mask]).all())  # the label at p is the token at p (the loss shifts)


def test_recall_suite_on_shipped_tokenizer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(RECALL_MODEL_DIR))
    spec = RecallSpec.load(RECALL_MODEL_DIR)
    items = recall_suite(spec, [spec.train_len, 2 * spec.train_len], short=True, seed=0)
    assert [it.length for it in items if it.is_perplexity] == [spec.train_len, 2 * spec.train_len]
    for it in items:
        ids = tok.encode(it.prompt)
        assert ids[0] == tok.bos_token_id and tok.unk_token_id not in ids
        if it.is_perplexity:  # a whole training-format sequence, one token short of its length
            assert len(ids) == it.length - 1
            # the scored tokens are the queries' answers: prompt_logprobs[i] is token i + 1, the word after "? kNN"
            assert it.scored_tokens is not None and len(it.scored_tokens) == spec.num_queries
            words = it.prompt.split()
            assert all(words[i - 2] == "?" and words[i].startswith("v") for i in it.scored_tokens)
            assert all(ids[i + 1] == tok.convert_tokens_to_ids(words[i]) for i in it.scored_tokens)
        else:
            assert len(ids) == spec.haystack_len(it.length) + 3  # BOS, haystack, "? kNN"


def test_is_correct():
    item = EvalItem("x", "passkey", 10, "p", "12345", 8)
    assert is_correct(item, " 12345. Remember")
    assert not is_correct(item, " 1234 5")
    assert not is_correct(item, " no number")
    recall = EvalItem("y", "recall", 10, "p", "v07", 4)
    assert is_correct(recall, " v07 ? k01")
    assert not is_correct(recall, " v70 v07")
    with pytest.raises(ValueError, match="no answer"):
        is_correct(EvalItem("z", "perplexity", 10, "p", None, 1), "x")


@pytest.mark.parametrize(
    ("prediction", "gold", "f1"),
    [
        ("12345", "12345", 1.0),
        ("The 12345!", "12345", 1.0),  # articles and punctuation go (SQuAD's normalization)
        ("12345 and 678", "12345", 0.5),  # P 1/3, R 1
        ("the cat sat", "Cat sat down.", 0.8),  # P 1, R 2/3
        ("x x y", "x y", 0.8),  # a multiset: one x in common
        ("678", "12345", 0.0),
        ("", "12345", 0.0),
        ("the", "a", 1.0),  # both empty after normalization
    ],
    ids=["same", "normalized", "extra-words", "partial", "repeats", "wrong", "empty", "both-empty"],
)
def test_token_f1(prediction, gold, f1):
    assert token_f1(prediction, gold) == pytest.approx(f1)


def test_answer_span_and_f1():
    item = EvalItem("x", "blend", 10, "p", "12345", 8)
    assert answer_span(item, " 12345.\nQuestion") == "12345"
    assert answer_span(item, " 12345. Remember it") == "12345"
    assert answer_span(item, " 12.5 or 12345?") == "12.5 or 12345"  # "12.5" ends no sentence
    assert answer_span(item, " 12345") == "12345"
    assert answer_f1(item, " 12345.") == 1.0
    assert answer_f1(item, " 12345 and 678.") == pytest.approx(0.5)
    assert answer_f1(item, " 54321.") == 0.0
    recall = EvalItem("y", "recall", 10, "p", "v07", 4)
    assert answer_span(recall, " v07 ? k01") == "v07" and answer_f1(recall, " v07 ? k01") == 1.0
    with pytest.raises(ValueError, match="no answer"):
        answer_f1(EvalItem("z", "perplexity", 10, "p", None, 1), "x")


def _res(tokens, lps, top=None, prompt_lps=()):
    return RequestResult(tokens, " v01", list(lps), 0.0, 5, 0, 1, 2, top or [], list(prompt_lps))


def test_compare_counts_mismatches_and_logprob_drift():
    items = [EvalItem("a", "recall", 8, "p", "v01", 3), EvalItem("ppl", "perplexity", 8, "p", None, 1)]
    base = [_res([1, 2, 3], [-0.1, -0.2, -0.3]), _res([9], [-1.0], prompt_lps=[-2.0, -3.0])]
    same = compare(items, base, base)
    assert same["exact_match_rate"] == 1.0 and same["mean_abs_logprob_diff"] == 0.0
    other = [
        _res([1, 5, 6], [-0.15, -0.1, -0.1], top=[{1: -0.15}, {5: -0.1, 2: -0.7}, {6: -0.1}]),
        _res([9], [-1.0], prompt_lps=[-2.5, -3.0]),
    ]
    got = compare(items, base, other)
    assert got["exact_match_rate"] == 0.0 and got["mismatched"] == ["a"]
    assert got["token_match_rate"] == pytest.approx(1 / 3)
    # position 0 (same token): 0.05; position 1 (first divergence, baseline token in top-k): 0.5; then stop
    assert got["logprob_positions"] == 2
    assert got["mean_abs_logprob_diff"] == pytest.approx(0.275)
    assert got["perplexity_mean_abs_logprob_diff"] == pytest.approx(0.25)
    diffs, missing = logprob_diffs(base[0], _res([7, 2, 3], [-0.1, -0.2, -0.3], top=[{7: -0.1}]))
    assert diffs == [] and missing == 1
    summary = summarize(items, other)
    assert summary["accuracy"]["recall"] == {"8": 1.0, "all": 1.0}
    assert summary["f1"]["recall"] == {"8": 1.0, "all": 1.0}
    assert summary["accuracy_by_depth"] == {}  # the item has no depth
    assert summary["perplexity"] == pytest.approx(2.718281828**2.75, rel=1e-6)
    assert summary["perplexity_by_length"] == {"8": pytest.approx(2.718281828**2.75, rel=1e-6)}
    longer = EvalItem("ppl16", "perplexity", 16, "p", None, 1)
    by_length = summarize([*items, longer], [*other, _res([9], [-1.0], prompt_lps=[-1.0])])["perplexity_by_length"]
    assert by_length == {"8": pytest.approx(2.718281828**2.75, rel=1e-6), "16": pytest.approx(2.718281828)}
    picked = EvalItem("ppl", "perplexity", 8, "p", None, 1, scored_tokens=(1,))  # token 2 only: log-prob -3.0
    assert summarize([picked], [other[1]])["perplexity"] == pytest.approx(2.718281828**3, rel=1e-6)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--suite", "bogus"], "'bogus' is not one of auto, real, recall, blend"),
        (["--dtype", "int4"], "'int4' is not one of auto, bfloat16"),
        (["--lengths", "1k"], "--lengths '1k'"),
        (["--model", "/nonexistent"], "no config.json"),
        (["--model", "recall", "--lengths", "9999"], "length 9999 must be in 64..1024"),
    ],
    ids=["suite", "dtype", "lengths-syntax", "model", "length-range"],
)
def test_cli_rejects_bad_input(args, needle):
    proc = subprocess.run([sys.executable, "-m", "ucm.quality", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert needle in proc.stderr
