"""Which tokens should CacheBlend recompute? Rules compared on the ``blend`` suite's multi-document QA through the
pure-torch reference of the blend (``ucm.quality.blend_reference``), without an engine: full prefill's answers
against each rule's, on the same questions.

Run::

    .venv/bin/python benchmarks/blend_selection.py [--model smollm2|DIR] [--models-dir models] [--lengths 1280]
        [--orders 6] [--seeds 0-9] [--rule deviation@1:0.15 --rule oracle@1:0.15 ...]
        [--chunk-context first_chunk|none] [--block-size 32] [--out results.json]

Rules (``--rule``, repeatable; ``kind[lo:hi]@layer:ratio[,layer:ratio...]``): ``deviation`` (UCM's engine rule
by default: the tokens whose K and V deviate most at the layer), ``progressive`` (CacheBlend's gradual filtering
over several layers), ``question`` (the tokens the question attends to most over the naive KV, summed over the
layers ``[lo, hi)``, by default every layer after the first quarter; ``selection: question`` in the engine; blended
for each question) and ``oracle`` (the tokens whose stored KV is farthest from full prefill's over the later
layers: it needs the full prefill, so it is an upper bound for choosing that many tokens at that layer, not a rule
an engine can run). See ``ucm.quality.blend_reference``.

The prompts are ``benchmarks/blend_quality.py``'s (``ucm.quality.tasks.blend_items``, chunk end ``<file_sep>``),
and the store is primed the same way: every chunk is in the store before a question is scored. The reference is
float32 torch, not vLLM's kernels; use ``blend_quality.py`` (the engine) to confirm a rule's figures.

Printed: per seed the right answers of full prefill and of each rule; then pooled over the seeds, each rule's ratio
to full prefill's right answers with a 95% paired bootstrap interval (``ucm.quality.blend.paired_ratio_interval``),
the right answers by the asked document's position, and the mean recomputed tokens per prompt; the JSON summary is
the last line (with every question's answers per mode under ``per_seed``, to compare with ``blend_quality.py``'s
reports question by question). Exit status 0 when the runs completed (whatever the numbers), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, get_args

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.blend_quality import seed_list  # noqa: E402
from benchmarks.common import emit_summary, load_avg, machine_info  # noqa: E402
from ucm.config import ChunkContext  # noqa: E402
from ucm.quality.blend import paired_ratio_interval  # noqa: E402
from ucm.quality.blend_reference import ReferenceModel, Rule, blend, parse_rule  # noqa: E402
from ucm.quality.tasks import BLEND_CHUNK_END, blend_items, is_correct  # noqa: E402

DEFAULT_RULES = ("deviation@1:0.15", "oracle@1:0.15")


def _rule(text: str) -> Rule:
    try:
        return parse_rule(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def run_seed(
    model: ReferenceModel,
    tokenizer: Any,
    seed: int,
    rules: list[Rule],
    *,
    lengths: list[int],
    orders: int,
    chunk_context: ChunkContext,
    block_size: int,
) -> dict[str, Any]:
    """One seed's questions: per question its id, the asked document's position (``depth``) and whether full
    prefill and each rule answered right; per rule the recomputed tokens of each blended context."""
    chunk_end_id = tokenizer.convert_tokens_to_ids(BLEND_CHUNK_END)
    items = blend_items(tokenizer, lengths, seed, orders=orders)
    store: dict[tuple[int, ...], Any] = {}
    key: tuple[int, ...] | None = None  # the context whose KV ``kvs`` holds, per mode
    kvs: dict[str, Any] = {}
    questions: list[dict[str, Any]] = []
    recomputed: dict[str, list[int]] = defaultdict(list)
    for item in items:
        ids = tokenizer(item.prompt, add_special_tokens=False).input_ids
        end = max(i for i, t in enumerate(ids) if t == chunk_end_id) + 1
        # An order's questions come together and share its context: blend it once, except for the rules that read
        # the question (blended for each question, as the engine does with vLLM's prefix cache reset between them).
        new_context = key != tuple(ids[:end])
        if new_context:
            key = tuple(ids[:end])
            full_kv, _ = model.prefill(ids[:end])
            kvs = {"full": full_kv}
        for rule in rules:
            if not new_context and rule.kind != "question":
                continue
            result = blend(
                model,
                ids[:end],
                store,
                chunk_end_id=chunk_end_id,
                rule=rule,
                block_size=block_size,
                chunk_context=chunk_context,
                full_kv=kvs["full"],
                query_ids=ids[end:],
            )
            kvs[rule.name] = result.kv
            recomputed[rule.name].append(result.recomputed)
        row: dict[str, Any] = {"id": item.id, "depth": round(item.depth, 2)}
        for name, kv in kvs.items():
            answer = tokenizer.decode(model.greedy(kv, ids[end:], item.max_tokens))
            row[name] = is_correct(item, answer)
        questions.append(row)
    return {"seed": seed, "questions": questions, "recomputed": dict(recomputed)}


def pool(seeds: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """Right answers per mode (``full`` and each rule), each rule against full prefill (paired interval), right
    answers by the asked document's position, mean recomputed tokens per blended context."""
    questions = [q for s in seeds for q in s["questions"]]
    out: dict[str, Any] = {"seeds": [s["seed"] for s in seeds], "questions": len(questions), "right": {}}
    out["right"] = {name: sum(q[name] for q in questions) for name in ["full", *names]}
    full = [q["full"] for q in questions]
    if any(full):  # a ratio to no right answer has no meaning (a random model may answer nothing right)
        out["vs_full"] = {name: paired_ratio_interval(full, [q[name] for q in questions]) for name in names}
    depths = sorted({q["depth"] for q in questions})
    out["right_by_depth"] = {
        name: {f"{d:.2f}": sum(q[name] for q in questions if q["depth"] == d) for d in depths}
        for name in ["full", *names]
    }
    out["recomputed_mean"] = {
        name: round(
            sum(r for s in seeds for r in s["recomputed"][name]) / sum(len(s["recomputed"][name]) for s in seeds), 1
        )
        for name in names
    }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="'smollm2' (built into --models-dir) or a model directory")
    p.add_argument("--models-dir", type=Path, default=REPO / "models")
    p.add_argument("--lengths", type=lambda t: [int(x) for x in t.split(",")], default=[1280], help="tokens")
    p.add_argument("--orders", type=int, default=6, help="distinct document orders per length")
    p.add_argument("--seeds", type=seed_list, default=[0], help="a range A-B or comma-separated seeds")
    p.add_argument(
        "--rule",
        type=_rule,
        action="append",
        default=None,
        help=f"kind@layer:ratio[,layer:ratio...], repeatable (default: {' '.join(DEFAULT_RULES)})",
    )
    p.add_argument("--chunk-context", default="first_chunk", choices=get_args(ChunkContext))
    p.add_argument("--block-size", type=int, default=32, help="the store's block, tokens")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON summary here")
    args = p.parse_args(argv)
    rules: list[Rule] = args.rule or [parse_rule(r) for r in DEFAULT_RULES]
    names = [r.name for r in rules]
    if len(set(names)) != len(names):
        p.error(f"--rule: a rule is given twice: {names}")
    if args.model == "smollm2":
        from ucm.testing.models import ensure_smollm2

        model_dir = ensure_smollm2(args.models_dir)
    else:
        model_dir = Path(args.model)
        if not (model_dir / "config.json").is_file():
            p.error(f"--model {args.model!r}: no config.json there (a model directory, or 'smollm2')")
    from transformers import AutoTokenizer

    model = ReferenceModel(model_dir)
    for rule in rules:
        if rule.stages[-1][0] >= model.num_layers:
            p.error(f"--rule {rule.name}: layer {rule.stages[-1][0]} >= the model's {model.num_layers} layers")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    load_start, t0 = load_avg(), time.perf_counter()
    seeds = []
    for seed in args.seeds:
        try:
            result = run_seed(
                model,
                tokenizer,
                seed,
                rules,
                lengths=args.lengths,
                orders=args.orders,
                chunk_context=args.chunk_context,
                block_size=args.block_size,
            )
        except ValueError as err:  # lengths too short for the documents, orders out of range
            p.error(str(err))
        seeds.append(result)
        right = {name: sum(q[name] for q in result["questions"]) for name in ["full", *names]}
        print(f"seed {seed}: " + ", ".join(f"{n} {r}" for n, r in right.items()), flush=True)
    pooled = pool(seeds, names)
    print(
        f"{len(args.seeds)} seeds, {pooled['questions']} questions; right answers (full prefill: "
        f"{pooled['right']['full']}):"
    )
    for name in names:
        vs = (pooled.get("vs_full") or {}).get(name)
        ratio = f"/ full {vs['ratio']:.3f} [{vs['low']:.3f}, {vs['high']:.3f}]" if vs else "/ full -"
        print(
            f"  {name:28s} {pooled['right'][name]:5d}  {ratio}  recomputed {pooled['recomputed_mean'][name]} "
            "tokens per prompt"
        )
    summary = {
        "benchmark": "blend_selection",
        "model": str(model_dir),
        "chunk_context": args.chunk_context,
        "lengths": args.lengths,
        "orders": args.orders,
        "block_size": args.block_size,
        "pooled": pooled,
        "per_seed": seeds,
        "machine": machine_info(load_start),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    return emit_summary(summary, args.out)


if __name__ == "__main__":
    sys.exit(main())
