"""CacheBlend's quality: exact match and token F1 of multi-document QA whose documents come back in shuffled orders,
for full prefill, UCM prefix caching only, naive reuse (Blend ratio 0) and Blend at several ratios, through the real
engine (CPU build).

Run::

    .venv/bin/python benchmarks/blend_quality.py [--model smollm2|DIR] [--models-dir models] [--lengths 1536]
        [--docs 4] [--orders 3] [--questions Q] [--ratios 0,0.05,0.15,0.3,1] [--no-prefix-only]
        [--chunk-end '<file_sep>'] [--check-layer model.layers.1.self_attn.attn] [--chunk-context none|first_chunk]
        [--selection deviation|question] [--question-layers 15:30] [--dtype float32]
        [--block-size 32] [--seed 0 | --seeds 0-39] [--work-dir DIR] [--out results.json]
    .venv/bin/python benchmarks/blend_quality.py --pool seed0.json seed1.json ...

What runs: ``ucm.quality.blend.run_blend_quality`` (its module docstring: the modes, the store-primed pass, the
configs). Prompts: the quality harness's ``blend`` task (``ucm.quality.tasks.blend_items``): per length ``--docs``
real documents, each with a fact line "The reference number of Document k is N." and headed "Document k" wherever
it stands, each ended by ``--chunk-end``, in ``--orders`` distinct seeded orders, then "What is the reference number
of Document k?" (``--questions`` per order, default every document). Exact match: the first number of the answer is
N; F1: SQuAD's token F1 of the answer sentence (``ucm.quality.tasks.answer_f1``).

With ``--seeds`` (a range ``A-B`` or a comma-separated list) the comparison runs once per seed (other orders,
numbers and questions each time), each seed's report written to ``--work-dir`` (``seed<S>.json``) when given, and
the summary pools them (``ucm.quality.blend.pool_reports``): right answers per mode and seed, and against full
prefill the ratio of right answers with a 95% bootstrap interval over the questions, resampled in pairs. A model of
SmolLM2's size flips single answers both ways under any change of its KV, so one seed (24 questions) cannot tell
94% from 98%; ``--pool`` pools reports saved by earlier runs (``--out`` of single-seed runs) without running.

Printed: one table row per mode as its engine finishes (EM, F1, exact-match rate of the generated tokens against
full prefill, and for Blend the scored prompts' reused and recomputed tokens and the chunks they had to compute, 0
when every document came from the store), the issue's target (ratio 0.15: EM and F1 >= 98% of full prefill's),
then the whole report as one JSON line, the last line. Exit status 0 when the runs completed (whatever the numbers),
2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, get_args

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import emit_summary, load_avg, machine_info  # noqa: E402
from ucm.config import BlendSelection, ChunkContext  # noqa: E402
from ucm.quality.blend import (  # noqa: E402
    CHECK_LAYER,
    RATIOS,
    modes,
    pool_reports,
    question_layers_error,
    run_blend_quality,
)
from ucm.quality.harness import DTYPES  # noqa: E402
from ucm.quality.tasks import BLEND_CHUNK_END, NUM_DOCS  # noqa: E402


def _numbers(kind: type, text: str) -> list[Any]:
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated {kind.__name__}s") from None
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r}: no value given")
    return values


HEADER = f"{'mode':12s} {'EM':>6s} {'F1':>6s} {'tokens=full':>11s} {'reused':>7s} {'recomp':>7s} {'computed':>8s}"


def row(name: str, m: dict[str, Any]) -> str:
    """One mode's table row: EM and F1 (all lengths), the fraction of prompts whose generated tokens equal full
    prefill's, and for Blend the scored prompts' reused tokens, recomputed tokens and computed chunks."""
    same = (m.get("vs_dense") or {}).get("exact_match_rate")
    blend = m.get("blend") or {}
    return (
        f"{name:12s} {m['accuracy']['blend']['all']:6.3f} {m['f1']['blend']['all']:6.3f} "
        f"{'-' if same is None else f'{same:.3f}':>11s} {blend.get('reused_tokens', '-')!s:>7s} "
        f"{blend.get('recomputed_tokens', '-')!s:>7s} {blend.get('chunks_computed', '-')!s:>8s}"
    )


def target_line(report: dict[str, Any]) -> str | None:
    """The issue's target, as a sentence (None when full prefill or ratio 0.15 did not run)."""
    t = report.get("target")
    if t is None:
        return None
    return (
        f"target: ratio {t['ratio']}: EM {t['accuracy_vs_full']} and F1 {t['f1_vs_full']} of full prefill's "
        f"(>= {t['fraction']}): {'met' if t['met'] else 'NOT met'}"
    )


def seed_list(text: str) -> list[int]:
    """``"0-39"`` or ``"0,3,7"``: the seeds, in order, each once."""
    try:
        if "-" in text.strip("-"):
            first, last = (int(x) for x in text.split("-"))
            seeds = list(range(first, last + 1))
        else:
            seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a range A-B or comma-separated seeds") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"{text!r}: expected at least one seed, each once")
    return seeds


def layer_range(text: str) -> list[int]:
    """``"15:30"``: Blend's ``question_layers`` as ``[15, 30]`` (their rules are the config's:
    ``ucm.quality.blend.question_layers_error``)."""
    try:
        return _numbers(int, text.replace(":", ","))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected FIRST:END, two integers") from None


def pooled_lines(pooled: dict[str, Any]) -> list[str]:
    """The pooled sample as text: right answers per mode, each mode's ratio to full prefill with its interval, and
    the right answers by the asked document's position."""
    lines = [f"{len(pooled['seeds'])} seeds, {pooled['questions']} questions; right answers:"]
    for name, right in pooled["right"].items():
        vs = (pooled.get("vs_full") or {}).get(name)
        extra = (
            f"  / full {vs['ratio']:.3f}, 95% interval [{vs['low']:.3f}, {vs['high']:.3f}]; only full right "
            f"{vs['only_full_right']}, only this right {vs['only_this_right']}"
            if vs
            else ""
        )
        lines.append(f"  {name:12s} {right:5d}{extra}")
    depths = pooled.get("right_by_depth") or {}
    if any(depths.values()):
        lines.append("right answers by the asked document's position (0.00 first, 1.00 last):")
        for name, cells in depths.items():
            lines.append(f"  {name:12s} " + ", ".join(f"{d}: {r}/{n}" for d, (r, n) in cells.items()))
    t = pooled.get("target")
    if t is not None:
        lines.append(
            f"target: ratio {t['ratio']}: {t['accuracy_vs_full']:.3f} of full prefill's right answers (>= "
            f"{t['fraction']}): {'met' if t['met'] else 'NOT met'}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="'smollm2' (built into --models-dir) or a model directory")
    p.add_argument("--models-dir", type=Path, default=REPO / "models")
    p.add_argument("--lengths", type=lambda t: _numbers(int, t), default=[1536], help="prompt lengths, tokens")
    p.add_argument("--docs", type=int, default=NUM_DOCS, help="documents per prompt")
    p.add_argument("--orders", type=int, default=3, help="distinct document orders per length")
    p.add_argument("--questions", type=int, default=None, help="questions per order (default: every document)")
    p.add_argument("--ratios", type=lambda t: _numbers(float, t), default=list(RATIOS), help="Blend ratios (0: naive)")
    p.add_argument("--no-prefix-only", action="store_true", help="skip the prefix-caching-only mode")
    p.add_argument("--chunk-end", default=BLEND_CHUNK_END, help="chunk-end text (one token of the tokenizer)")
    p.add_argument("--check-layer", default=CHECK_LAYER, help="compute_meta's attention layer")
    p.add_argument(
        "--chunk-context", default="none", choices=get_args(ChunkContext), help="Blend's chunk_context"
    )  # fmt: skip
    p.add_argument("--selection", default="deviation", choices=get_args(BlendSelection), help="Blend's selection")
    p.add_argument(
        "--question-layers",
        type=layer_range,
        default=None,
        help="Blend's question_layers FIRST:END (selection question; default: every layer after the first quarter)",
    )
    p.add_argument("--dtype", default="float32", help=f"one of {', '.join(DTYPES)}")
    p.add_argument("--block-size", type=int, default=32, help="vLLM KV block size (the store's unit)")
    one_or_many = p.add_mutually_exclusive_group()
    one_or_many.add_argument("--seed", type=int, default=0)
    one_or_many.add_argument(
        "--seeds", type=seed_list, default=None, help="run every seed of a range A-B or list, and pool"
    )
    p.add_argument("--pool", type=Path, nargs="+", default=None, help="pool these saved reports; run nothing")
    p.add_argument("--work-dir", type=Path, default=None, help="keep engine logs, configs and stores here")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON report here")
    args = p.parse_args(argv)
    if args.pool is not None:
        try:
            pooled = pool_reports([_read_report(path) for path in args.pool])
        except (OSError, ValueError, KeyError) as err:
            p.error(f"--pool: {err}")
        print("\n".join(pooled_lines(pooled)))
        return emit_summary({"benchmark": "blend_quality", "pooled": pooled}, args.out)
    bad_layers = question_layers_error(args.selection, args.question_layers)  # before full prefill's run
    if bad_layers is not None:
        p.error(f"--question-layers: {bad_layers}")
    if args.model == "smollm2":
        from ucm.testing.models import ensure_smollm2

        model = ensure_smollm2(args.models_dir)
    else:
        model = Path(args.model)
        if not (model / "config.json").is_file():
            p.error(f"--model {args.model!r}: no config.json there (a model directory, or 'smollm2')")
    load_start = load_avg()
    t0 = time.perf_counter()
    printed: list[str] = []

    def progress(name: str, entry: dict[str, Any]) -> None:  # a row as each engine finishes
        if not printed:
            print(HEADER)
        printed.append(name)
        print(row(name, entry), flush=True)

    reports = []
    for seed in args.seeds or [args.seed]:
        if args.seeds:
            print(f"seed {seed}:", flush=True)
            printed.clear()
        work_dir = args.work_dir / f"seed{seed}" if args.work_dir and args.seeds else args.work_dir
        try:
            report = run_blend_quality(
                model,
                lengths=args.lengths,
                mode_list=modes(args.ratios, prefix_only=not args.no_prefix_only),
                num_docs=args.docs,
                orders=args.orders,
                questions=args.questions,
                chunk_end=args.chunk_end,
                check_layer=args.check_layer,
                chunk_context=args.chunk_context,
                selection=args.selection,
                question_layers=args.question_layers,
                seed=seed,
                dtype=args.dtype,
                block_size=args.block_size,
                work_dir=work_dir,
                progress=progress,
            )
        except ValueError as err:  # bad ratios, lengths, chunk-end text, dtype, question layers
            p.error(str(err))
        line = target_line(report)
        if line is not None:
            print(line, flush=True)
        if args.seeds and args.work_dir:
            (args.work_dir / f"seed{seed}.json").write_text(json.dumps(report) + "\n")
        reports.append(report)
    if args.seeds:
        pooled = pool_reports(reports)
        print("\n".join(pooled_lines(pooled)))
        summary: dict[str, Any] = {"benchmark": "blend_quality", "pooled": pooled}
    else:
        summary = reports[0]
    summary["machine"] = machine_info(load_start)
    summary["wall_s"] = round(time.perf_counter() - t0, 1)
    return emit_summary(summary, args.out)


def _read_report(path: Path) -> dict[str, Any]:
    """A single-seed report saved by ``--out`` (or ``seed<S>.json`` of ``--seeds --work-dir``)."""
    report = json.loads(path.read_text().strip().splitlines()[-1])
    if "modes" not in report or "seed" not in report:
        raise ValueError(f"{path} is not a single-seed report of this script (no 'modes' or 'seed')")
    return report


if __name__ == "__main__":
    sys.exit(main())
