"""Seeded evaluation sets for the quality harness: long-context tasks on real text, CacheBlend's reordered
documents, and synthetic recall.

Three suites:

- ``real`` (any text model, e.g. SmolLM2-135M-Instruct), built from the offline English text of
  ``ucm.testing.texts`` (licence texts of the machine). Text roles, by source order, so no text appears in two roles:
  source 0 (then 1, both repeated for long prompts) is the passkey haystack, source 2 is held out for perplexity,
  the longest of sources 3.. are the documents of multi-document QA.

  - ``passkey``: passkey retrieval after Mohtashami & Jaggi 2023 ("Landmark Attention: Random-Access Infinite
    Context Length for Transformers", appendix prompt): a 5-digit pass key stated in one line inserted at relative
    depth d of a real-text haystack; the prompt ends with "What is the pass key? The pass key is". Correct when the
    first number in the answer is the key.
  - ``multidoc``: question answering over several independent documents (the setting of CacheBlend, Yao et al.
    2024: retrieved chunks concatenated, a question about one of them). Each document (a different licence text)
    carries one line "The reference number of Document i is N."; the question asks for document j's number, the
    others act as distractors. All questions at one length share the same documents (so their KV is shared by a
    cache). Correct when the first number in the answer is N.
  - ``perplexity``: held-out real text, scored teacher-forced through vLLM's ``prompt_logprobs``.

- ``blend`` (any text model whose tokenizer has a chunk-end token, e.g. SmolLM2's ``<file_sep>``): multi-document QA
  where the same documents come back in other orders, the setting of CacheBlend (Yao et al. 2024), whose stored
  chunks are reused wherever they appear (``ucm.integration.vllm.blend``). Per length, ``num_docs`` documents (the
  multidoc sources and fact lines); document ``k`` is always headed "Document k" whatever its position. The prompt
  is an intro, then the documents in one of ``orders`` distinct seeded orders, each chunk (the intro and every
  document) ended by the chunk-end text, then "What is the reference number of Document k?". The chunk-end text is
  a special token, so the tokenizer splits there and each document has the same tokens in every position. Scored
  like multidoc, and by token F1.

- ``recall`` (UCM's trained recall model, see ``recall.py``): associative recall at the model's training length and
  2x / 4x it (where plain RoPE models are expected to degrade), at several needle depths: a sequence of the length's
  haystack, cut after its first query's key (``length - 3 * num_queries + 2`` tokens). Perplexity on held-out
  training-format sequences.

Scores: :func:`is_correct` (exact match of the first number, or first word for recall) and :func:`answer_f1` (token F1
as SQuAD defines it, Rajpurkar et al. 2016, of the answer span against the gold answer; see :func:`answer_span`).

Lengths are prompt lengths in tokens of the model's tokenizer (the real prompt is within a few tokens of it).
Everything is deterministic given the seed (:func:`seeded_rng`, independent of ``PYTHONHASHSEED``).
"""

from __future__ import annotations

import hashlib
import math
import random
import re
import string
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ucm.logger import init_logger
from ucm.quality.recall import RecallSpec, make_example
from ucm.testing.texts import Tokenizer, source_texts

logger = init_logger(__name__)

Suite = Literal["real", "recall", "blend"]
SUITES: tuple[Suite, ...] = ("real", "recall", "blend")
DEPTHS: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
SHORT_DEPTHS: tuple[float, ...] = (0.0, 0.5, 1.0)
REAL_LENGTHS: tuple[int, ...] = (1024, 2048, 4096, 8192)
SHORT_REAL_LENGTHS: tuple[int, ...] = (1024,)
BLEND_LENGTHS: tuple[int, ...] = (1024, 2048)
SHORT_BLEND_LENGTHS: tuple[int, ...] = (1024,)
NUM_DOCS = 4
BLEND_ORDERS = 4  # distinct document orders per length (short: 2)
BLEND_CHUNK_END = "<file_sep>"  # one special token (id 5) of SmolLM2's tokenizer
ANSWER_TOKENS_REAL = 12  # a 5-digit number is 5 SmolLM2 tokens; room for a leading space or words
ANSWER_TOKENS_RECALL = 4
ANSWER_TOKENS_BLEND = 8  # " 12345." is 7 SmolLM2 tokens: the whole answer sentence's end, for F1
PERPLEXITY_TOKENS = 1024
_NUMBER_RE = re.compile(r"\d+")
_SENTENCE_END_RE = re.compile(r"[.!?](?=\s|$)|\n")
_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)

_PASSKEY_INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n\n"
)
_PASSKEY_QUESTION = "\n\nWhat is the pass key? The pass key is"
_MULTIDOC_INTRO = "Below are several independent documents. Each document has a reference number.\n\n"
_BLEND_INTRO = "Below are several independent documents. Each document has a reference number.\n"
_BLEND_QUESTION = (
    "\nQuestion: What is the reference number of Document {k}?\nAnswer: The reference number of Document {k} is"
)


@dataclass(frozen=True)
class EvalItem:
    """One evaluation prompt.

    Attributes:
        id: unique, readable (``passkey-L2048-d0.50``).
        task: ``passkey``, ``multidoc``, ``blend``, ``recall`` or ``perplexity``.
        length: the target prompt length in tokens (the bucket reported).
        prompt: the text given to the engine (the tokenizer adds its special tokens, as vLLM does).
        answer: the expected answer (digits or a word); None for perplexity items.
        max_tokens: tokens to generate (greedy); 1 for perplexity items.
        depth: relative needle depth in [0, 1] (blend: the asked document's position, first 0, last 1); None where
            it does not apply.
        scored_tokens: perplexity items only: the prompt tokens scored, as indices into the request's
            ``prompt_logprobs`` (index ``i`` is prompt token ``i + 1``); None: every token after the first.
    """

    id: str
    task: str
    length: int
    prompt: str
    answer: str | None
    max_tokens: int
    depth: float | None = None
    scored_tokens: tuple[int, ...] | None = None

    @property
    def is_perplexity(self) -> bool:
        """True for teacher-forced perplexity items (scored on prompt log-probs, not on generated text)."""
        return self.task == "perplexity"


def is_correct(item: EvalItem, generated_text: str) -> bool:
    """Score a generated answer: the first number (real suite) or first word (recall) equals ``item.answer``.

    Raises:
        ValueError: ``item`` is a perplexity item (it has no answer).
    """
    if item.answer is None:
        raise ValueError(f"item {item.id} ({item.task}) has no answer to score")
    if item.task == "recall":
        words = generated_text.split()
        return bool(words) and words[0] == item.answer
    match = _NUMBER_RE.search(generated_text)
    return match is not None and match.group(0) == item.answer


def normalize_answer(text: str) -> str:
    """SQuAD's answer normalization: lower case, punctuation and the articles a/an/the removed, whitespace collapsed
    (``normalize_answer`` of the SQuAD v1.1 evaluation script)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES_RE.sub(" ", text).split())


def token_f1(prediction: str, gold: str) -> float:
    """Token F1 of ``prediction`` against ``gold`` as SQuAD defines it: both normalized (:func:`normalize_answer`)
    and split on whitespace; precision and recall of the common tokens (a multiset intersection). Where either side
    has no token left, 1.0 if both are empty, else 0.0."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def answer_span(item: EvalItem, generated_text: str) -> str:
    """The part of a generation that answers ``item``: for recall its first word; otherwise the rest of the
    sentence the prompt ends in ("... The pass key is", "... of Document 3 is"), i.e. the text up to the first
    line break or sentence end (``.``, ``!`` or ``?`` before whitespace or the end; "12.5" is not one)."""
    if item.task == "recall":
        words = generated_text.split()
        return words[0] if words else ""
    match = _SENTENCE_END_RE.search(generated_text)
    return (generated_text if match is None else generated_text[: match.start()]).strip()


def answer_f1(item: EvalItem, generated_text: str) -> float:
    """Token F1 (:func:`token_f1`) of the generation's :func:`answer_span` against ``item.answer``. For a one-number
    answer it is 1 for the number alone, 1/n for the number among n words, 0 without it.

    Raises:
        ValueError: ``item`` is a perplexity item (it has no answer).
    """
    if item.answer is None:
        raise ValueError(f"item {item.id} ({item.task}) has no answer to score")
    return token_f1(answer_span(item, generated_text), item.answer)


def seeded_rng(name: str) -> random.Random:
    """A ``random.Random`` seeded from the SHA-256 of ``name``.

    Not ``random.Random(name)``: Python's string seeding feeds the string into Mersenne Twister's ``init_by_array``,
    and similar strings then give nearly equal first outputs (``"0-passkey-8172-0.0"`` and ``"0-multidoc-8172"``
    drew the same 5-digit key).
    """
    return random.Random(int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big"))


def _budget(tokenizer: Tokenizer, *texts: str) -> int:
    return sum(len(tokenizer.encode(t, add_special_tokens=False)) for t in texts)


def _insert_line(tokenizer: Tokenizer, ids: list[int], depth: float, line: str) -> str:
    """Decode ``ids`` with ``line`` inserted on its own line at the first line break at or after ``depth``."""
    cut = round(depth * len(ids))
    head, tail = tokenizer.decode(ids[:cut]), tokenizer.decode(ids[cut:])
    if depth >= 1.0 or not tail:
        return f"{head}\n{line}"
    if depth <= 0.0:
        return f"{line}\n{head}{tail}"
    br = tail.find("\n")
    if br < 0:
        return f"{head}{tail}\n{line}"
    return f"{head}{tail[:br]}\n{line}{tail[br:]}"


def _key(rng: random.Random) -> str:
    return str(rng.randrange(10_000, 100_000))


def passkey_items(tokenizer: Tokenizer, lengths: Sequence[int], depths: Sequence[float], seed: int) -> list[EvalItem]:
    """Passkey retrieval prompts, one per (length, depth); see the module docstring.

    A haystack longer than its two sources repeats them, as the filler of Mohtashami & Jaggi's prompt repeats its
    sentences.
    """
    text = "\n\n".join(source_texts()[:2])
    stream, copies = tokenizer.encode(text, add_special_tokens=False), 1  # the haystack: ``copies`` times ``text``
    items = []
    for length in lengths:
        for depth in depths:
            rng = seeded_rng(f"{seed}-passkey-{length}-{depth}")
            key = _key(rng)
            needle = f"The pass key is {key}. Remember it. {key} is the pass key."
            n_hay = length - _budget(tokenizer, _PASSKEY_INTRO, needle, _PASSKEY_QUESTION) - 4
            while len(stream) < n_hay:
                copies += 1
                stream = tokenizer.encode("\n\n".join([text] * copies), add_special_tokens=False)
            body = _insert_line(tokenizer, stream[:n_hay], depth, needle)
            items.append(
                EvalItem(
                    id=f"passkey-L{length}-d{depth:.2f}",
                    task="passkey",
                    length=length,
                    prompt=_PASSKEY_INTRO + body + _PASSKEY_QUESTION,
                    answer=key,
                    max_tokens=ANSWER_TOKENS_REAL,
                    depth=depth,
                )
            )
    return items


@dataclass(frozen=True)
class _MultidocPlan:
    """One length's multidoc layout: the documents' numbers, fact lines and headers, the question template (``{j}``:
    the document asked), and the tokens each document gets (``per_doc``)."""

    rng: random.Random  # seeded for the length; drawn on for the facts' depths
    numbers: list[str]
    facts: list[str]
    headers: list[str]
    question: str
    per_doc: int


def _multidoc_plan(tokenizer: Tokenizer, length: int, seed: int, num_docs: int) -> _MultidocPlan:
    rng = seeded_rng(f"{seed}-multidoc-{length}")
    numbers = [_key(rng) for _ in range(num_docs)]
    question = "\n\nQuestion: What is the reference number of Document {j}?\nAnswer: The reference number of "
    question += "Document {j} is"
    facts = [f"The reference number of Document {i + 1} is {numbers[i]}." for i in range(num_docs)]
    headers = [f"Document {i + 1}:\n" for i in range(num_docs)]
    overhead = _budget(tokenizer, _MULTIDOC_INTRO, question.format(j=1), *facts, *headers) + 2 * num_docs + 4
    return _MultidocPlan(rng, numbers, facts, headers, question, (length - overhead) // num_docs)


def multidoc_fits(tokenizer: Tokenizer, length: int, seed: int, num_docs: int = NUM_DOCS) -> bool:
    """Whether the machine's document sources are long enough for :func:`multidoc_items` at ``length``.

    Raises:
        RuntimeError: fewer than ``num_docs`` document sources.
    """
    shortest = min(
        len(tokenizer.encode(text, add_special_tokens=False)) for text in _document_sources("multidoc", num_docs)
    )
    return _multidoc_plan(tokenizer, length, seed, num_docs).per_doc <= shortest


def multidoc_items(
    tokenizer: Tokenizer, lengths: Sequence[int], seed: int, num_docs: int = NUM_DOCS, questions: int = NUM_DOCS
) -> list[EvalItem]:
    """Multi-document QA prompts: per length, ``num_docs`` documents and ``questions`` questions (documents 1..).

    Raises:
        RuntimeError: fewer than ``num_docs`` document sources, or a source too short for its share of a length
            (:func:`multidoc_fits` says beforehand).
    """
    sources = _document_sources("multidoc", num_docs)
    items = []
    for length in lengths:
        plan = _multidoc_plan(tokenizer, length, seed, num_docs)
        docs = []
        for i in range(num_docs):
            ids = tokenizer.encode(sources[i], add_special_tokens=False)
            if plan.per_doc > len(ids):
                raise RuntimeError(
                    f"multidoc length {length} needs {plan.per_doc} tokens per document, a source has {len(ids)}"
                )
            docs.append(
                plan.headers[i] + _insert_line(tokenizer, ids[: plan.per_doc], plan.rng.random(), plan.facts[i])
            )
        context = _MULTIDOC_INTRO + "\n\n".join(docs)
        for j in range(questions):
            items.append(
                EvalItem(
                    id=f"multidoc-L{length}-doc{j + 1}",
                    task="multidoc",
                    length=length,
                    prompt=context + plan.question.format(j=j + 1),
                    answer=plan.numbers[j],
                    max_tokens=ANSWER_TOKENS_REAL,
                )
            )
    return items


def _document_sources(task: str, num_docs: int) -> list[str]:
    """The ``num_docs`` longest texts of sources 3.. (fixed order): the documents of multidoc and blend.

    Raises:
        RuntimeError: the machine has fewer such sources.
    """
    sources = sorted(source_texts()[3:], key=len, reverse=True)[:num_docs]
    if len(sources) < num_docs:
        raise RuntimeError(f"{task} needs {num_docs} document sources, this machine has {len(sources)}")
    return sources


def document_orders(num_docs: int, count: int, rng: random.Random) -> list[tuple[int, ...]]:
    """``count`` distinct orders (permutations of ``0..num_docs-1``) drawn from ``rng``.

    Raises:
        ValueError: ``count`` < 1 or more than the ``num_docs!`` orders there are.
    """
    if not 1 <= count <= math.factorial(num_docs):
        raise ValueError(f"orders={count} must be in 1..{math.factorial(num_docs)} ({num_docs} documents)")
    orders: list[tuple[int, ...]] = []
    while len(orders) < count:  # rejection: count <= num_docs! and orders are drawn uniformly
        order = tuple(rng.sample(range(num_docs), num_docs))
        if order not in orders:
            orders.append(order)
    return orders


def blend_items(
    tokenizer: Tokenizer,
    lengths: Sequence[int],
    seed: int,
    *,
    num_docs: int = NUM_DOCS,
    orders: int = BLEND_ORDERS,
    questions: int | None = None,
    chunk_end: str = BLEND_CHUNK_END,
) -> list[EvalItem]:
    """CacheBlend's multi-document QA (see the module docstring): per length, ``orders`` distinct orders of the same
    ``num_docs`` documents, and per order ``questions`` questions (default: every document).

    Order ``o`` asks documents ``o * questions ..`` (mod ``num_docs``), so that over the orders every document is
    asked, at different positions. Item ids: ``blend-L<length>-o<order>-doc<k>``; ``depth`` is the asked document's
    relative position in the order. The prompt ``intro + chunk_end + ("\\nDocument k:\\n" + text + "\\n" +
    chunk_end) * num_docs + question``: every chunk ends with ``chunk_end``, the question follows the last one.

    Raises:
        ValueError: ``num_docs`` < 2, ``questions`` outside 1..``num_docs``, ``orders`` outside 1..``num_docs!``, or
            ``chunk_end`` empty or found in a document source, or a length too short for the documents (< 16 tokens
            each).
        RuntimeError: too few document sources, or a source too short for its share of a length.
    """
    if num_docs < 2:
        raise ValueError(f"num_docs={num_docs} must be >= 2 (the documents are reordered)")
    questions = num_docs if questions is None else questions
    if not 1 <= questions <= num_docs:
        raise ValueError(f"questions={questions} must be in 1..num_docs={num_docs}")
    if not chunk_end:
        raise ValueError("chunk_end must be a non-empty text (the chunk-end token's text, e.g. '<file_sep>')")
    sources = _document_sources("blend", num_docs)
    if any(chunk_end in text for text in sources):
        raise ValueError(f"chunk_end {chunk_end!r} occurs in a document source: choose a special token's text")
    items = []
    for length in lengths:
        rng = seeded_rng(f"{seed}-blend-{length}")
        numbers = [_key(rng) for _ in range(num_docs)]
        facts = [f"The reference number of Document {k + 1} is {numbers[k]}." for k in range(num_docs)]
        headers = [f"\nDocument {k + 1}:\n" for k in range(num_docs)]
        intro = _BLEND_INTRO + chunk_end
        overhead = _budget(tokenizer, intro, _BLEND_QUESTION.format(k=1), *facts, *headers, chunk_end * num_docs)
        per_doc = (length - overhead - 2 * num_docs - 4) // num_docs  # slack: line breaks merged or split
        if per_doc < 16:
            raise ValueError(f"blend length {length} leaves {per_doc} tokens per document (< 16) for {num_docs}")
        chunks = []
        for k in range(num_docs):
            ids = tokenizer.encode(sources[k], add_special_tokens=False)
            if per_doc > len(ids):
                raise RuntimeError(
                    f"blend length {length} needs {per_doc} tokens per document, a source has {len(ids)}"
                )
            body = _insert_line(tokenizer, ids[:per_doc], rng.random(), facts[k])
            chunks.append(f"{headers[k]}{body}\n{chunk_end}")
        for o, order in enumerate(document_orders(num_docs, orders, rng)):
            context = intro + "".join(chunks[k] for k in order)
            for q in range(questions):
                k = (o * questions + q) % num_docs
                items.append(
                    EvalItem(
                        id=f"blend-L{length}-o{o}-doc{k + 1}",
                        task="blend",
                        length=length,
                        prompt=context + _BLEND_QUESTION.format(k=k + 1),
                        answer=numbers[k],
                        max_tokens=ANSWER_TOKENS_BLEND,
                        depth=order.index(k) / (num_docs - 1),
                    )
                )
    return items


def blend_suite(tokenizer: Tokenizer, lengths: Sequence[int], short: bool, seed: int) -> list[EvalItem]:
    """The ``blend`` suite: :func:`blend_items` with ``BLEND_ORDERS`` orders, every document asked in each (short: 2
    orders, 2 questions each)."""
    if short:
        return blend_items(tokenizer, lengths, seed, orders=2, questions=2)
    return blend_items(tokenizer, lengths, seed)


def perplexity_items(tokenizer: Tokenizer, n_tokens: int, count: int) -> list[EvalItem]:
    """``count`` consecutive segments of ``n_tokens`` tokens of held-out real text (source 2).

    Raises:
        RuntimeError: the held-out source is shorter than ``count * n_tokens`` tokens.
    """
    ids = tokenizer.encode(source_texts()[2], add_special_tokens=False)
    if count * n_tokens > len(ids):
        raise RuntimeError(f"perplexity needs {count}x{n_tokens} tokens, the held-out text has {len(ids)}")
    return [
        EvalItem(
            id=f"perplexity-L{n_tokens}-{i}",
            task="perplexity",
            length=n_tokens,
            prompt=tokenizer.decode(ids[i * n_tokens : (i + 1) * n_tokens]),
            answer=None,
            max_tokens=1,
        )
        for i in range(count)
    ]


def real_suite(
    tokenizer: Tokenizer, lengths: Sequence[int], short: bool, seed: int, max_model_len: int
) -> list[EvalItem]:
    """The ``real`` suite: passkey at every (length, depth), multidoc at every length, perplexity segments.

    Lengths above ``max_model_len - ANSWER_TOKENS_REAL - 8`` are clipped to it (label kept: an "8192" prompt of an
    8K-context model is ~8170 tokens, leaving room for the answer). A length whose share per document is longer than
    the machine's document sources gets no multidoc items (a warning says so); passkey covers every length.
    """

    def fit(length: int) -> int:
        return min(length, max_model_len - ANSWER_TOKENS_REAL - 8)

    depths = SHORT_DEPTHS if short else DEPTHS
    items: list[EvalItem] = []
    for length in lengths:
        for item in passkey_items(tokenizer, [fit(length)], depths, seed):
            items.append(_relabel(item, length))
        if multidoc_fits(tokenizer, fit(length), seed):
            multidoc = multidoc_items(tokenizer, [fit(length)], seed, questions=2 if short else NUM_DOCS)
            items += [_relabel(item, length) for item in multidoc]
        else:
            logger.warning("quality: no multidoc items at length %d: the documents are shorter than its share", length)
    items += perplexity_items(tokenizer, 256 if short else PERPLEXITY_TOKENS, 1 if short else 2)
    return items


def _relabel(item: EvalItem, length: int) -> EvalItem:
    if item.length == length:
        return item
    new_id = item.id.replace(f"-L{item.length}-", f"-L{length}-")
    return EvalItem(new_id, item.task, length, item.prompt, item.answer, item.max_tokens, item.depth)


def recall_suite(spec: RecallSpec, lengths: Sequence[int], short: bool, seed: int) -> list[EvalItem]:
    """The ``recall`` suite: ``per_cell`` single-query prompts per (length, depth), plus perplexity sequences at
    every length.

    Full: 4 prompts per cell at 5 depths, 2 perplexity sequences per length; short: 2 per cell at 3 depths, 1
    sequence per length. A perplexity sequence is a held-out sequence of the training distribution (all
    ``num_queries`` queries answered) of ``length - 1`` tokens, so that it fits a context of ``length`` with the
    one token its request generates. Only its answer tokens are scored (``scored_tokens``): the model was trained on
    those alone, and the filler words are uniform random, so their log-probs say nothing about recall.
    """
    depths = SHORT_DEPTHS if short else DEPTHS
    per_cell = 2 if short else 4
    items = []
    for length in lengths:
        for depth in depths:
            for k in range(per_cell):
                rng = seeded_rng(f"{seed}-recall-{length}-{depth}-{k}")
                # a training sequence of `length` tokens cut after its first query's key, as in training
                ex = make_example(spec, rng, spec.haystack_len(length), 1, depth=depth)
                items.append(
                    EvalItem(
                        id=f"recall-L{length}-d{depth:.2f}-{k}",
                        task="recall",
                        length=length,
                        prompt=" ".join(ex.words),
                        answer=ex.answers[0],
                        max_tokens=ANSWER_TOKENS_RECALL,
                        depth=depth,
                    )
                )
    for length in lengths:
        for k in range(1 if short else 2):
            rng = seeded_rng(f"{seed}-recall-perplexity-{length}-{k}")
            ex = make_example(spec, rng, spec.haystack_len(length) - 1, spec.num_queries)
            # word i is prompt token i + 1 (after BOS), whose log-prob is prompt_logprobs[i]
            items.append(
                EvalItem(
                    f"perplexity-L{length}-{k}",
                    "perplexity",
                    length,
                    " ".join(ex.words),
                    None,
                    1,
                    scored_tokens=tuple(ex.answer_positions),
                )
            )
    return items


def default_lengths(suite: Suite, model_dir: Path, short: bool) -> list[int]:
    """Real: 1K, 2K, 4K, 8K (short: 1K). Blend: 1K, 2K (short: 1K). Recall: the training length, 2x and 4x (short:
    1x and 2x)."""
    if suite == "real":
        return list(SHORT_REAL_LENGTHS if short else REAL_LENGTHS)
    if suite == "blend":
        return list(SHORT_BLEND_LENGTHS if short else BLEND_LENGTHS)
    train_len = RecallSpec.load(model_dir).train_len
    return [train_len, 2 * train_len] if short else [train_len, 2 * train_len, 4 * train_len]
