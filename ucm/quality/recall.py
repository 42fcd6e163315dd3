"""Synthetic associative recall: the task of UCM's small trained model, and its word-level tokenizer.

A sequence is a haystack of random filler words into which ``num_pairs`` key/value pairs (``kNN vNN``, adjacent
tokens, distinct keys) are placed at random positions, followed by queries ``? kNN`` whose answer is the key's
value. Recalling it needs an induction mechanism (find the earlier occurrence of the query key, copy the token after
it), as in the multi-query associative recall of Arora et al. 2023 ("Zoology: Measuring and Improving Recall in
Efficient Language Models") and the needle/passkey retrieval of Mohtashami & Jaggi 2023 ("Landmark Attention").
The position of the queried pair in the haystack is the needle's *depth* (0 = start, 1 = end).

Sequences are plain space-separated words so that a ``tokenizers`` WordLevel tokenizer maps each word to one id and
vLLM serves the model with it unchanged (``PreTrainedTokenizerFast``). Everything here is deterministic given a
``random.Random`` seed; no torch needed.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
QUERY = "?"
TASK_FILE = "ucm_recall_task.json"  # written next to a trained model: marks it as a recall model, holds the spec


@dataclass(frozen=True)
class RecallSpec:
    """Vocabulary and shape of the recall task.

    Attributes:
        num_keys: size of the key alphabet (``k00`` ..).
        num_values: size of the value alphabet (``v00`` ..).
        num_fillers: size of the filler alphabet (``w00`` ..).
        num_pairs: key/value pairs per haystack (distinct keys; values may repeat).
        train_len: tokens per training sequence (BOS + haystack + queries), the model's "training length".
        num_queries: queries per training sequence (loss on each answer); the first asks pair 0, the others pairs
            drawn with replacement.
    """

    num_keys: int = 48
    num_values: int = 48
    num_fillers: int = 96
    num_pairs: int = 8
    train_len: int = 256
    num_queries: int = 8

    def vocab(self) -> list[str]:
        """All words, index = token id: specials, ``?``, keys, values, fillers."""
        return [
            PAD,
            BOS,
            EOS,
            UNK,
            QUERY,
            *(f"k{i:02d}" for i in range(self.num_keys)),
            *(f"v{i:02d}" for i in range(self.num_values)),
            *(f"w{i:02d}" for i in range(self.num_fillers)),
        ]

    def haystack_len(self, total_len: int) -> int:
        """Haystack words in a training sequence of ``total_len`` tokens (BOS and ``num_queries`` x 3 excluded)."""
        return total_len - 1 - 3 * self.num_queries

    def save(self, model_dir: Path) -> None:
        """Write the spec to ``model_dir/ucm_recall_task.json``."""
        (model_dir / TASK_FILE).write_text(json.dumps(asdict(self), indent=1, sort_keys=True) + "\n")

    @classmethod
    def load(cls, model_dir: Path) -> RecallSpec:
        """Read the spec of a trained recall model.

        Raises:
            FileNotFoundError: ``model_dir`` has no ``ucm_recall_task.json``.
        """
        return cls(**json.loads((model_dir / TASK_FILE).read_text()))


@dataclass(frozen=True)
class RecallExample:
    """One recall sequence.

    Attributes:
        words: the haystack followed by the queries, without BOS (BOS is added by the tokenizer).
        answers: the value word of each query, in order.
        answer_positions: index in ``words`` of each answer word (training targets).
        depth: relative position in the haystack of the first query's pair, in [0, 1].
    """

    words: list[str]
    answers: list[str]
    answer_positions: list[int]
    depth: float


def make_example(
    spec: RecallSpec, rng: random.Random, haystack_len: int, num_queries: int, depth: float | None = None
) -> RecallExample:
    """Build one sequence: a haystack of ``haystack_len`` words with ``spec.num_pairs`` pairs, then queries.

    With ``num_queries == 1`` the sequence ends with the queried key (``... ? kNN``): an evaluation prompt whose
    answer is ``answers[0]``. Otherwise each query is followed by its answer (a training sequence). ``depth`` (in
    [0, 1]) puts the first queried pair at that relative position of the haystack; None: anywhere.

    Raises:
        ValueError: ``haystack_len`` too short for the pairs, ``num_queries`` < 1, or ``depth``
            outside [0, 1].
    """
    if haystack_len < 2 * spec.num_pairs:
        raise ValueError(f"haystack_len={haystack_len} is shorter than 2 * num_pairs={2 * spec.num_pairs}")
    if num_queries < 1:
        raise ValueError(f"num_queries={num_queries} must be >= 1")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth={depth} must be in [0, 1]")
    keys = rng.sample(range(spec.num_keys), spec.num_pairs)
    values = [rng.randrange(spec.num_values) for _ in keys]
    words = [f"w{rng.randrange(spec.num_fillers):02d}" for _ in range(haystack_len)]
    # Slots: pair j occupies two words starting at an even offset inside one of num_pairs equal segments, so pairs
    # never overlap and spread over the whole haystack; pair 0 is the first query's.
    slots = haystack_len // 2  # pair start = 2 * slot
    if depth is None:
        chosen = sorted(rng.sample(range(slots), spec.num_pairs))
        rng.shuffle(chosen)
    else:
        target = min(slots - 1, round(depth * (slots - 1)))
        others = rng.sample([s for s in range(slots) if s != target], spec.num_pairs - 1)
        chosen = [target, *others]
    for key, value, slot in zip(keys, values, chosen, strict=True):
        words[2 * slot] = f"k{key:02d}"
        words[2 * slot + 1] = f"v{value:02d}"
    first_depth = chosen[0] / max(1, slots - 1)
    # Later queries pick pairs with replacement: without it, elimination of the pairs already asked would let a model
    # answer later queries better than chance without retrieving anything (seen: loss below ln(num_pairs) while the
    # first query stayed at chance).
    order = [0, *(rng.randrange(spec.num_pairs) for _ in range(num_queries - 1))]
    answers: list[str] = []
    positions: list[int] = []
    for q, j in enumerate(order):
        words += [QUERY, f"k{keys[j]:02d}"]
        answers.append(f"v{values[j]:02d}")
        if num_queries > 1 or q < num_queries - 1:
            positions.append(len(words))
            words.append(answers[-1])
    return RecallExample(words=words, answers=answers, answer_positions=positions, depth=first_depth)


def build_tokenizer(spec: RecallSpec, model_dir: Path, model_max_length: int) -> None:
    """Write a WordLevel tokenizer for ``spec`` (``tokenizer.json``, ``tokenizer_config.json``) into ``model_dir``.

    Words are split on whitespace; encoding adds BOS; decoding joins words with spaces. transformers and vLLM load
    it as ``PreTrainedTokenizerFast``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {w: i for i, w in enumerate(spec.vocab())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    tok.add_special_tokens([PAD, BOS, EOS, UNK])
    tok.save(str(model_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "pad_token": PAD,
        "model_max_length": model_max_length,
        "add_bos_token": True,
        "clean_up_tokenization_spaces": False,
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
