"""ReRoPE's cost: prefill (TTFT) and decode time per token against dense attention, at several prompt lengths, through
the real engine (CPU build).

Run::

    .venv/bin/python benchmarks/rerope.py [--model recall] [--lengths 256,512,1024] [--window 128] [--repeats 3]
                                          [--max-tokens 32] [--out results.json]

Two engine processes run the same prompts, one at a time: both with UCMConnector as ``kv_consumer`` on an empty
store (so UCM only looks up, misses and never dumps: the same connector costs in both), one of them with
``ucm_sparse_config: {ReRoPE: {window: W}}``. vLLM's prefix cache is off. Prompts are the quality harness's recall
prompts (``--model recall``: the trained recall model) or its passkey prompts (any other model directory), a new
seed per repeat. Per request: TTFT (the engine's ``first_token_latency``) and decode time per token ((wall - TTFT) /
(generated tokens - 1)). Reported per length: medians over the repeats, and ReRoPE / dense ratios (the issue's target:
decode <= 2x dense at 4x the trained length). The first request of each engine is a warm-up (not counted). Last line:
JSON.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import emit_summary, machine_info, utc_now, versions  # noqa: E402
from ucm.quality import RECALL_MODEL_DIR  # noqa: E402
from ucm.quality.harness import build_items, model_max_len  # noqa: E402
from ucm.testing.engine import run_engine, ucm_transfer_config  # noqa: E402


def _config(store: Path, window: int | None) -> dict[str, Any]:
    config: dict[str, Any] = {
        "ucm_connectors": [
            {
                "ucm_connector_name": "UcmPipelineStore",
                "ucm_connector_config": {"store_pipeline": "Posix", "storage_backends": str(store)},
            }
        ]
    }
    if window is not None:
        config["ucm_sparse_config"] = {"ReRoPE": {"window": window}}
    return config


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="recall", help="'recall' (the trained recall model) or a model directory")
    p.add_argument("--lengths", default="256,512,1024", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--window", type=int, default=128, help="ReRoPE's window")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    model = RECALL_MODEL_DIR if args.model == "recall" else Path(args.model)
    suite = "recall" if args.model == "recall" else "real"
    lengths = [int(x) for x in args.lengths.split(",")]
    requests: list[dict[str, Any]] = []
    labels: list[int | None] = []
    for seed in range(args.repeats + 1):  # seed 0: the warm-up prompt
        items = [it for it in build_items(model, suite, lengths, True, seed) if it.answer is not None]
        picked = {it.length: it for it in items}  # one prompt per length and seed
        for length in lengths if seed else lengths[:1]:
            requests.append({"prompt": picked[length].prompt, "max_tokens": args.max_tokens})
            labels.append(length if seed else None)
    runs: dict[str, list[Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, window in (("dense", None), ("rerope", args.window)):
            config_path = Path(tmp) / f"{name}.yaml"
            config_path.write_text(yaml.safe_dump(_config(Path(tmp) / "store", window)))
            spec = {
                "model": str(model),
                "max_model_len": model_max_len(model),
                "enable_prefix_caching": False,
                "connector": ucm_transfer_config({"UCM_CONFIG_FILE": str(config_path)}, kv_role="kv_consumer"),
                "requests": requests,
            }
            (Path(tmp) / "store").mkdir(exist_ok=True)
            runs[name], _ = run_engine(spec, timeout_s=3600, log_path=Path(tmp) / f"{name}.log")
    per_length: dict[str, Any] = {}
    for length in lengths:
        row: dict[str, Any] = {}
        for name, results in runs.items():
            mine = [r for r, label in zip(results, labels, strict=True) if label == length]
            decode = [(r.wall_ms - r.ttft_ms) / (len(r.token_ids) - 1) for r in mine if len(r.token_ids) > 1]
            row[name] = {
                "ttft_ms": round(statistics.median(r.ttft_ms for r in mine), 2),
                "decode_ms_per_token": round(statistics.median(decode), 3) if decode else None,
                "generated_tokens": [len(r.token_ids) for r in mine],
            }
        dense, rerope = row["dense"], row["rerope"]
        row["ttft_ratio"] = round(rerope["ttft_ms"] / dense["ttft_ms"], 3)
        if dense["decode_ms_per_token"] and rerope["decode_ms_per_token"]:
            row["decode_ratio"] = round(rerope["decode_ms_per_token"] / dense["decode_ms_per_token"], 3)
        per_length[str(length)] = row
    summary = {
        "benchmark": "rerope",
        "date": utc_now(),
        "machine": machine_info(),
        "versions": versions(),
        "model": str(model),
        "window": args.window,
        "repeats": args.repeats,
        "max_tokens": args.max_tokens,
        "per_length": per_length,
        "target": "decode_ratio <= 2 at 4x the trained length",
    }
    return emit_summary(summary, args.out)


if __name__ == "__main__":
    sys.exit(main())
