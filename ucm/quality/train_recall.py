"""Train UCM's small recall model: a 2-layer Llama that solves synthetic needle retrieval (see ``recall.py``).

Run (the shipped ``ucm/quality/assets/recall-llama`` came from exactly this command, seeded, one torch thread; its
training time is in benchmarks/RESULTS.md, "Quality harness")::

    nice -n 10 python -m ucm.quality.train_recall --out ucm/quality/assets/recall-llama

Default task: one key/value pair in the haystack (``--num-pairs 1``: passkey-style needle retrieval). With 8 pairs
(associative recall with distractors) the same model and schedule stayed at chance (benchmarks/RESULTS.md,
"Quality harness"): the induction circuit that multi-pair recall needs did not form within a CPU training budget, so
it is an option, not the default.

The model is a plain ``transformers.LlamaForCausalLM`` (RoPE, RMSNorm, SwiGLU, tied embeddings) saved as float32
safetensors with a WordLevel tokenizer, so vLLM serves it unchanged. Training: AdamW, linear warm-up then constant
learning rate, cross-entropy on the answer tokens only (each training sequence carries ``num_queries`` queries),
fresh random sequences every step (no epochs, no overfitting to a fixed set), and a length curriculum
(``--curriculum``: short sequences first, where answers are denser per token of compute, each stage until its
held-out accuracy reaches ``--stage-acc``; then the training length). Every ``--eval-every`` steps the greedy answer
accuracy (teacher-forced argmax at the answer position, i.e. what greedy decoding would emit first) is measured on
held-out sequences at the current length; training stops once the accuracy at the training length reaches
``--target-acc`` on two evaluations in a row, or at ``--max-steps`` / ``--max-minutes``. The final accuracy is then
measured at the training length and at 2x and 4x it.
The loss curve and evaluations are written to ``training_log.json`` next to the weights.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ucm.quality.recall import BOS, RecallSpec, build_tokenizer, make_example


def _encode(spec: RecallSpec, words: list[str]) -> list[int]:
    vocab = {w: i for i, w in enumerate(spec.vocab())}
    return [vocab[BOS], *(vocab[w] for w in words)]


def make_batch(spec: RecallSpec, rng: random.Random, batch: int, total_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` training sequences of ``total_len`` tokens.

    Returns:
        input_ids ``[batch, total_len]`` int64 and labels ``[batch, total_len]`` int64 (-100 except at the answers;
        transformers shifts them by one inside the loss).
    """
    vocab = {w: i for i, w in enumerate(spec.vocab())}
    ids = torch.empty(batch, total_len, dtype=torch.long)
    labels = torch.full((batch, total_len), -100, dtype=torch.long)
    for b in range(batch):
        ex = make_example(spec, rng, spec.haystack_len(total_len), spec.num_queries)
        row = _encode(spec, ex.words)
        ids[b] = torch.tensor(row)
        for pos, ans in zip(ex.answer_positions, ex.answers, strict=True):
            labels[b, pos + 1] = vocab[ans]  # +1: BOS
    return ids, labels


@torch.no_grad()
def recall_accuracy(model: Any, spec: RecallSpec, seed: int, total_len: int, n: int, batch: int = 32) -> float:
    """Fraction of ``n`` held-out prompts answered right (argmax): training sequences of ``total_len`` tokens cut
    after their first query's key (the prompts of the harness's ``recall`` task)."""
    rng = random.Random(seed)
    vocab = {w: i for i, w in enumerate(spec.vocab())}
    correct = 0
    model.eval()
    for start in range(0, n, batch):
        rows, answers = [], []
        for _ in range(min(batch, n - start)):
            ex = make_example(spec, rng, spec.haystack_len(total_len), 1)  # a training sequence up to its first key
            rows.append(_encode(spec, ex.words))
            answers.append(vocab[ex.answers[0]])
        logits = model(input_ids=torch.tensor(rows)).logits[:, -1]
        correct += int((logits.argmax(-1) == torch.tensor(answers)).sum())
    model.train()
    return correct / n


def build_model(spec: RecallSpec, hidden: int, layers: int, heads: int, max_positions: int) -> Any:
    """A randomly initialised ``LlamaForCausalLM`` for ``spec``'s vocabulary (float32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = spec.vocab()
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=hidden // heads,
        max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=vocab.index(BOS),
        eos_token_id=vocab.index("</s>"),
        pad_token_id=vocab.index("<pad>"),
        dtype="float32",
    )
    return LlamaForCausalLM(config)


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Train, save to ``args.out``, return the training record (also written to ``training_log.json``)."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    spec = RecallSpec(train_len=args.train_len, num_pairs=args.num_pairs)
    model = build_model(spec, args.hidden, args.layers, args.heads, 4 * args.train_len)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    curve: list[dict[str, float]] = []
    evals: list[dict[str, float]] = []
    start = time.perf_counter()
    cpu_start = time.process_time()
    hits_in_a_row = 0
    running = 0.0
    step = 0
    stages = [n for n in args.curriculum if n < args.train_len] + [args.train_len]
    stage = 0
    for step in range(1, args.max_steps + 1):
        cur_len = stages[stage]
        lr = args.lr * min(1.0, step / args.warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        ids, labels = make_batch(spec, rng, args.batch, cur_len)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        running += loss.item()
        if step % args.log_every == 0:
            curve.append(
                {
                    "step": step,
                    "len": cur_len,
                    "loss": round(running / args.log_every, 5),
                    "s": round(time.perf_counter() - start, 1),
                }
            )
            running = 0.0
            print(json.dumps(curve[-1]), flush=True)
        if step % args.eval_every == 0:
            acc = recall_accuracy(model, spec, seed=10_000 + args.seed, total_len=cur_len, n=args.eval_n)
            evals.append({"step": step, "len": cur_len, "acc": acc, "s": round(time.perf_counter() - start, 1)})
            print(json.dumps(evals[-1]), flush=True)
            if cur_len < args.train_len:
                if acc >= args.stage_acc:  # next curriculum stage
                    stage += 1
                continue
            hits_in_a_row = hits_in_a_row + 1 if acc >= args.target_acc else 0
            if hits_in_a_row >= 2:
                break
        if time.perf_counter() - start > 60 * args.max_minutes:
            break
    train_s = time.perf_counter() - start
    train_cpu_s = time.process_time() - cpu_start
    final = {
        f"acc_len_{mult}x_{mult * args.train_len}": recall_accuracy(
            model, spec, seed=20_000 + args.seed, total_len=mult * args.train_len, n=args.final_n
        )
        for mult in (1, 2, 4)
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    build_tokenizer(spec, out, 4 * args.train_len)
    spec.save(out)
    record = {
        "args": vars(args),
        "steps": step,
        "train_seconds": round(train_s, 1),
        "train_cpu_seconds": round(train_cpu_s, 1),
        "torch_threads": torch.get_num_threads(),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "final_teacher_forced_accuracy": final,
        "loss_curve": curve,
        "evals": evals,
    }
    (out / "training_log.json").write_text(json.dumps(record, indent=1) + "\n")
    for path in out.iterdir():  # safetensors writes files private to the user; a model directory is shared
        path.chmod(0o644)
    return record


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for the model (weights, tokenizer, task spec, log)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-len", type=int, default=256, help="tokens per training sequence")
    p.add_argument("--num-pairs", type=int, default=1, help="key/value pairs per haystack (1: single-needle retrieval)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--max-steps", type=int, default=6000)
    p.add_argument("--max-minutes", type=float, default=40.0)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-n", type=int, default=128)
    p.add_argument("--final-n", type=int, default=512)
    p.add_argument("--target-acc", type=float, default=0.99)
    p.add_argument(
        "--curriculum",
        type=lambda t: [int(x) for x in t.split(",") if x],
        default=[64, 128],
        help="shorter sequence lengths to train on first, comma-separated (each until --stage-acc); '' for none",
    )
    p.add_argument("--stage-acc", type=float, default=0.9, help="accuracy that ends a curriculum stage")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: on a shared machine, OpenMP threads spin-waiting for each other slow training down)",
    )
    args = p.parse_args(argv)
    record = train(args)
    print(
        json.dumps(
            {k: record[k] for k in ("steps", "train_seconds", "train_cpu_seconds", "final_teacher_forced_accuracy")}
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
