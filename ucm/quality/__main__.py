"""CLI of the quality harness.

Usage::

    python -m ucm.quality --model models/SmolLM2-135M-Instruct --config examples/ucm_config_example.yaml
    python -m ucm.quality --model recall --config examples/ucm_config_example.yaml --short
    python -m ucm.quality --suite blend --config blend.yaml --dtype float32 --block-size 32

``--suite blend`` is CacheBlend's reordered-documents QA (``tasks.blend_items``), for a config with
``ucm_sparse_config: {Blend: ...}`` whose ``chunk_end_token_id`` is the token of ``tasks.BLEND_CHUNK_END``
(``<file_sep>``, id 5 for SmolLM2); ``benchmarks/blend_quality.py`` compares several Blend ratios at once.

``--model recall`` names the trained recall model shipped in ``ucm/quality/assets/recall-llama``. Without
``--config`` only the dense baseline runs. One line per run and task goes to stdout, then the last line: the whole
report as JSON (``harness.run_quality``). Exit status 0 when the runs completed (whatever the numbers), 2 on bad
arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ucm.quality import RECALL_MODEL_DIR
from ucm.quality.harness import DTYPES, run_quality
from ucm.quality.tasks import SUITES


def _lengths(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--lengths {text!r}: expected comma-separated integers, e.g. 1024,2048"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError(f"--lengths {text!r}: no length given")
    return values


def _lines(report: dict[str, Any]) -> list[str]:
    out = []
    for name, run in report["runs"].items():
        for metric in ("accuracy", "f1"):
            for task, cells in run[metric].items():
                cells_text = " ".join(f"{k}:{v:.2f}" for k, v in cells.items())
                out.append(f"{name:5s} {task:9s} {metric:8s} {cells_text}")
        if run["perplexity"] is not None:
            by_length = " ".join(f"{k}:{v:.3f}" for k, v in run["perplexity_by_length"].items())
            out.append(f"{name:5s} perplexity {run['perplexity']:.3f} (by length {by_length})")
        if "vs_dense" in run:
            v = run["vs_dense"]
            out.append(
                f"{name:5s} vs dense: exact match {v['exact_match_rate']}, mean |dlogp| {v['mean_abs_logprob_diff']}, "
                f"max |dlogp| {v['max_abs_logprob_diff']}, hit rate {v['hit_rate']}"
            )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ucm.quality", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="models/SmolLM2-135M-Instruct", help="model directory, or 'recall'")
    p.add_argument("--config", type=Path, default=None, help="UCM config YAML (omit: dense baseline only)")
    p.add_argument("--suite", default="auto", help=f"auto (from the model), or one of {', '.join(SUITES)}")
    p.add_argument("--lengths", type=_lengths, default=None, help="prompt lengths in tokens, comma-separated")
    p.add_argument("--short", action="store_true", help="the CI-sized variant")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", help=f"one of {', '.join(DTYPES)}")
    p.add_argument("--block-size", type=int, default=None, help="vLLM KV block size (default: vLLM's)")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length; above the model's max_position_embeddings it raises that through hf_overrides "
        "(ReRoPE past the trained length)",
    )
    p.add_argument("--keep-store", action="store_true", help="use the config's storage_backends, not a fresh dir")
    p.add_argument("--work-dir", type=Path, default=None, help="keep engine logs (and the store) here")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON report to this file")
    args = p.parse_args(argv)
    if args.suite != "auto" and args.suite not in SUITES:
        p.error(f"--suite {args.suite!r} is not one of auto, {', '.join(SUITES)}")
    if args.dtype not in DTYPES:
        p.error(f"--dtype {args.dtype!r} is not one of {', '.join(DTYPES)}")
    model = RECALL_MODEL_DIR if args.model == "recall" else Path(args.model)
    if not (model / "config.json").is_file():
        p.error(f"--model {args.model!r}: no config.json there (a model directory, or 'recall')")
    if args.config is not None and not args.config.is_file():
        p.error(f"--config {str(args.config)!r}: no such file")
    try:
        report = run_quality(
            model,
            args.config,
            suite=None if args.suite == "auto" else args.suite,
            lengths=args.lengths,
            short=args.short,
            seed=args.seed,
            dtype=args.dtype,
            block_size=args.block_size,
            keep_store=args.keep_store,
            work_dir=args.work_dir,
            max_model_len=args.max_model_len,
        )
    except ValueError as err:  # bad lengths, bad config (UcmConfigError is a ValueError)
        p.error(str(err))
    for line in _lines(report):
        print(line)
    text = json.dumps(report)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
