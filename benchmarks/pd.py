"""TTFT and TPOT of prefill/decode disaggregation (1P1D through the PD proxy) against a single vLLM instance.

Run::

    .venv/bin/python benchmarks/pd.py [--models-dir models] [--num-prompts 8] [--input-len 1024] [--output-len 32]

Set-up, all real vLLM OpenAI servers (CPU build) on loopback with the demo model (SmolLM2-135M-Instruct, bf16):
a single instance without connector; one prefill instance (UCMConnector ``kv_producer``) and one decode instance
(``kv_consumer``) sharing a fresh ``Cache|Posix`` store in a temporary directory; ``python -m ucm.pd.proxy`` in
front of those two. Prompts are random token ids (as ``vllm bench serve --dataset-name random``: uniform over the
vocabulary, seeded, no shared prefix), sent as token-id lists to ``/v1/completions`` with ``ignore_eos`` so every
request generates exactly ``--output-len`` tokens, streamed, one request at a time, alternating single instance
and proxy per prompt; one warm-up request per path is not counted.

- TTFT: from sending the request to the first streamed token (client side, ms); through the proxy this includes
  the prefill on P (whose answer waits until the prompt's blocks are in the store), the load on D and D's compute
  of the prompt's last partial block.
- TPOT: (end - TTFT) / (output_len - 1), ms per output token.

Last line: a JSON object with per-path medians and means, the ratios ``pd/single`` and each decode request's UCM hit
(``hit_external`` blocks, which should equal the prompt's full blocks). Small model, 2 CPU cores shared by all
servers: per-request fixed costs (HTTP hops, the durable dump) weigh heavily; PD pays off under load, where
prefills no longer stall decodes, which this one-at-a-time run does not show.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import yaml

from benchmarks.common import emit_summary, machine_info, utc_now, versions
from ucm.testing.engine import HIT_RE, ucm_transfer_config
from ucm.testing.models import ensure_smollm2
from ucm.testing.server import ProxyProcess, VllmServer, stream_completion

BLOCK_SIZE = 128


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models-dir", default="models", help="where the demo model is (built there if missing)")
    p.add_argument("--num-prompts", type=int, default=8, help="timed prompts per path (default 8)")
    p.add_argument("--input-len", type=int, default=1024, help="prompt tokens (default 1024)")
    p.add_argument("--output-len", type=int, default=32, help="generated tokens per request (default 32, >= 2)")
    p.add_argument("--seed", type=int, default=0, help="random prompts' seed")
    p.add_argument("--out", help="also write the JSON summary to this file")
    args = p.parse_args(argv)
    if args.output_len < 2:
        p.error(f"--output-len {args.output_len}: TPOT needs at least 2 output tokens")
    if args.num_prompts < 1 or args.input_len < 1:
        p.error("--num-prompts and --input-len must be >= 1")
    return args


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 1), "mean": round(statistics.fmean(values), 1)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = ensure_smollm2(Path(args.models_dir))
    from transformers import AutoTokenizer

    vocab = AutoTokenizer.from_pretrained(str(model)).vocab_size
    rng = random.Random(args.seed)
    # +1: the warm-up prompt of each path
    prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(2 * (args.num_prompts + 1))]

    tmp = Path(tempfile.mkdtemp(prefix="ucm-pd-bench-"))
    config = tmp / "ucm.yaml"
    store = {"store_pipeline": "Cache|Posix", "storage_backends": str(tmp / "store")}
    config.write_text(yaml.safe_dump({"ucm_connectors": [{"ucm_connector_config": store}]}))
    extra = {"UCM_CONFIG_FILE": str(config)}
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    single = VllmServer(model, tmp / "single.log", None, env=env)
    prefill = VllmServer(model, tmp / "prefill.log", ucm_transfer_config(extra, "kv_producer"), env=env)
    decode = VllmServer(model, tmp / "decode.log", ucm_transfer_config(extra, "kv_consumer"), env=env)
    servers = [single, prefill, decode]
    proxy: ProxyProcess | None = None
    results: dict[str, dict[str, list[float]]] = {p: {"ttft_ms": [], "tpot_ms": []} for p in ("single", "pd")}
    try:
        for s in servers:
            s.wait_ready()
        proxy = ProxyProcess([prefill.port], [decode.port], tmp / "proxy.log").wait_ready()
        for i in range(args.num_prompts + 1):
            for path, url in (("single", single.url), ("pd", proxy.url)):
                body = {
                    "model": str(model),
                    "prompt": prompts[2 * i + (path == "pd")],
                    "max_tokens": args.output_len,
                    "ignore_eos": True,
                    "temperature": 0.0,
                }
                _, ttft, total = stream_completion(f"{url}/v1/completions", body)
                if i == 0:
                    continue  # warm-up
                results[path]["ttft_ms"].append(ttft * 1e3)
                results[path]["tpot_ms"].append((total - ttft) * 1e3 / (args.output_len - 1))
        hits = [int(m[3]) for m in HIT_RE.findall(decode.read_log())]
    finally:
        if proxy is not None:
            proxy.stop()
        for s in servers:
            s.stop()

    summary: dict[str, Any] = {
        "benchmark": "pd",
        "date": utc_now(),
        "model": model.name,
        "options": vars(args),
        "single": {k: _stats(v) for k, v in results["single"].items()},
        "pd_1p1d": {k: _stats(v) for k, v in results["pd"].items()},
        "raw": {p: {k: [round(x, 1) for x in v] for k, v in r.items()} for p, r in results.items()},
        "decode_hit_external_blocks": hits,
        "full_blocks_per_prompt": args.input_len // BLOCK_SIZE,
        "logs": str(tmp),
        "versions": versions(),
        "machine": machine_info(),
    }
    for k in ("ttft_ms", "tpot_ms"):
        summary[f"{k.removesuffix('_ms')}_pd_over_single"] = round(
            statistics.median(results["pd"][k]) / statistics.median(results["single"][k]), 3
        )
    return emit_summary(summary, args.out)


if __name__ == "__main__":
    sys.exit(main())
