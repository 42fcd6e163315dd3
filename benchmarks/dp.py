"""Data parallelism with and without UCM's shared store: the seeds' DP benchmark procedure in miniature.

Run::

    .venv/bin/python benchmarks/dp.py [--model real|tiny] [--num-prompts 16] [--input-len 1280] [--output-len 32]

Set-up: one ``vllm serve --data-parallel-size 2`` (vLLM's internal load balancing: its API server sends each
request to the DP rank with the fewest waiting and running requests), each rank's OpenMP threads on cores of its
own (``VLLM_CPU_OMP_THREADS_BIND`` ``0|1`` on 2 cores), in three configurations, one after the other:

- ``recompute``: vLLM's prefix caching off, no connector;
- ``hbm_pc``: vLLM's prefix caching on (each rank caches in its own KV memory), no connector;
- ``ucm_pc``: vLLM's prefix caching on and UCMConnector (``Cache|Posix``, one fresh directory shared by the ranks,
  each rank with its own DRAM tier).

The other DP form of the seeds (one ``vllm serve`` per rank with ``--data-parallel-rank``, vLLM's external load
balancing) does not run on vLLM 0.32's CPU build (see ``docs/operations.md``, "Data parallelism").

Procedure (the seeds' "pre-seed with 128 prompts at 0.8 of the input length, then 128 prompts at full length"):
after one warm-up request per rank (not counted), ``--num-prompts`` N prompts of ``round(prefix_ratio *
input_len)`` random token ids with 1 output token, all sent at once (as ``vllm bench serve --request-rate inf``);
then the N full prompts, each its seed prompt followed by more random tokens (``--input-len`` in all), with
``--output-len`` tokens each (``ignore_eos``), all sent at once, streamed; only this second phase is measured. Prompts
are random token ids (as ``vllm bench serve --dataset-name random``: uniform over the vocabulary, seeded). The full
prompts go out in a seeded shuffled order (``--order same`` keeps the seeds' order), so that, as with many clients
behind a load balancer, a full prompt may reach another rank than the one that served its seed prompt.

Reported per configuration: TTFT (client side, from sending to the first streamed token), TPOT ((E2EL - TTFT) /
(output tokens - 1)) and E2EL, mean and p90 over the N requests (ms); per DP rank, the requests it served and its
prefix hit ratio: hit tokens / prompt tokens from vLLM's ``/metrics`` (``prefix_cache_hits`` +
``external_prefix_cache_hits`` over ``prefix_cache_queries``, per ``engine`` label), and for ``ucm_pc`` also from
UCM's per-request log lines (``hit hbm`` + ``hit external`` over ``total_blocks_num``, per ``dp rank``), with the
share UCM loaded (``hit external``) and how many full prompts reached another rank than their seed. Targets (the
``targets`` key): UCM's hit ratio >= 0.79 on every rank, HBM PC's below it, UCM PC's mean TTFT below HBM PC's.
With ``--input-len`` a multiple of 5 blocks, the seed prompt is exactly 0.8 of the full prompt's blocks.

Last line: a JSON object (``benchmarks/common.py``). The servers' logs stay in the printed ``logs`` directory; the
UCM store is removed at the end.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from benchmarks.common import emit_summary, load_avg, machine_info, utc_now, versions  # noqa: E402
from ucm.testing.engine import DP_HIT_RE, ucm_transfer_config  # noqa: E402
from ucm.testing.models import ensure_smollm2, ensure_tiny_llama  # noqa: E402
from ucm.testing.server import VllmServer, sse_chunks  # noqa: E402

DP_SIZE = 2
CONFIGS = ("recompute", "hbm_pc", "ucm_pc")
LABELS = {"recompute": "Recompute", "hbm_pc": "HBM PC", "ucm_pc": "UCM PC"}
UCM_HIT_TARGET = 0.79
_METRIC_RE = re.compile(r"^vllm:(\w+)\{([^}]*)\}\s+(\S+)$")
_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "external_prefix_cache_hits", "request_success")


# --------------------------------------------------------------------------------------------- set-up
def omp_threads_bind(dp_size: int, num_cpus: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` giving each of ``dp_size`` ranks its own equal slice of ``num_cpus`` cores
    (vLLM reads one ``|``-separated list per rank; ``auto`` would bind every rank to all the cores of one NUMA node).

    Raises:
        ValueError: fewer CPUs than ranks.
    """
    per_rank = num_cpus // dp_size
    if per_rank < 1:
        raise ValueError(f"{num_cpus} CPUs cannot give each of {dp_size} DP ranks a core of its own")
    slices = [(r * per_rank, (r + 1) * per_rank - 1) for r in range(dp_size)]
    return "|".join(str(first) if first == last else f"{first}-{last}" for first, last in slices)


def make_prompts(vocab: int, n: int, seed_len: int, full_len: int, seed: int) -> tuple[list[list[int]], ...]:
    """``(seed prompts, full prompts, warm-up prompts)``: random token ids; full prompt i starts with seed prompt i;
    one warm-up prompt per rank, sharing nothing with the others."""
    rng = random.Random(seed)
    full = [[rng.randrange(vocab) for _ in range(full_len)] for _ in range(n)]
    warmup = [[rng.randrange(vocab) for _ in range(full_len)] for _ in range(DP_SIZE)]
    return [p[:seed_len] for p in full], full, warmup


# ------------------------------------------------------------------------------------------- requests
@dataclass
class Sample:
    """One streamed request: the response id, TTFT and E2EL (s), and the output tokens the server counted."""

    request_id: str
    ttft_s: float
    e2el_s: float
    output_tokens: int

    @property
    def tpot_s(self) -> float | None:
        """(E2EL - TTFT) / (output tokens - 1); None for a single output token."""
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def stream(url: str, body: dict[str, Any], rank: int | None = None, timeout_s: float = 1800.0) -> Sample:
    """POST a streaming completion; TTFT is taken at the first chunk that carries a choice (one token).

    ``rank``: send it to that DP rank (vLLM's ``X-data-parallel-rank`` header); None: vLLM's load balancing.

    Raises:
        urllib.error.HTTPError: the server refused the request.
        RuntimeError: the stream ended without a token or without usage figures.
    """
    headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
    full = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft: float | None = None
    request_id, tokens = "", None
    for elapsed, chunk in sse_chunks(url, full, headers, timeout_s):
        request_id = chunk.get("id", request_id)
        if chunk.get("choices") and ttft is None:
            ttft = elapsed
        if chunk.get("usage"):
            tokens = int(chunk["usage"]["completion_tokens"])
    e2el = time.perf_counter() - t0
    if ttft is None or tokens is None:
        raise RuntimeError(f"{url}: stream of {request_id or 'a request'} ended without a token or usage")
    return Sample(request_id, ttft, e2el, tokens)


def run_phase(url: str, model: str, prompts: list[list[int]], max_tokens: int) -> list[Sample]:
    """Send every prompt at once (one thread each), as ``--request-rate inf``; samples in prompt order."""
    body = {"model": model, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0}
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        futures = [pool.submit(stream, f"{url}/v1/completions", {**body, "prompt": p}) for p in prompts]
        return [f.result() for f in futures]


# ---------------------------------------------------------------------------------------- measurements
def parse_metrics(text: str) -> dict[str, dict[str, float]]:
    """``{counter: {engine: value}}`` of the counters in :data:`_COUNTERS` (``*_total`` samples, summed over the
    other labels) from a Prometheus ``/metrics`` page."""
    out: dict[str, dict[str, float]] = {name: defaultdict(float) for name in _COUNTERS}
    for line in text.splitlines():
        m = _METRIC_RE.match(line.strip())
        if m is None or not m.group(1).endswith("_total"):
            continue
        name = m.group(1).removesuffix("_total")
        if name not in out:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        out[name][labels.get("engine", "0")] += float(m.group(3))
    return {name: dict(values) for name, values in out.items()}


def metrics_delta(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Per engine (DP rank): requests finished and prefix hit ratio (hit tokens, local plus connector, over
    queried tokens) between two :func:`parse_metrics` snapshots."""
    engines = sorted(set().union(*(after[name] for name in _COUNTERS)))
    ranks: dict[str, Any] = {}
    for engine in engines:
        d = {name: after[name].get(engine, 0.0) - before[name].get(engine, 0.0) for name in _COUNTERS}
        hits = d["prefix_cache_hits"] + d["external_prefix_cache_hits"]
        queries = d["prefix_cache_queries"]
        ranks[engine] = {
            "requests": int(d["request_success"]),
            "hit_ratio": round(hits / queries, 4) if queries else 0.0,
            "external_hit_ratio": round(d["external_prefix_cache_hits"] / queries, 4) if queries else 0.0,
        }
    return ranks


def ucm_lines(log: str) -> dict[str, tuple[int, int, int, int]]:
    """UCM's per-request lines of a DP server: ``{request id: (total blocks, hit hbm, hit external, dp rank)}``."""
    return {m[0]: (int(m[1]), int(m[2]), int(m[3]), int(m[4])) for m in DP_HIT_RE.findall(log)}


def line_of(lines: dict[str, tuple[int, int, int, int]], response_id: str) -> tuple[int, int, int, int] | None:
    """The UCM line of the request answered as ``response_id`` (vLLM's internal request id extends it)."""
    found = [v for k, v in lines.items() if k == response_id or k.startswith(response_id + "-")]
    return found[0] if len(found) == 1 else None


def ucm_ranks(lines: list[tuple[int, int, int, int]]) -> dict[str, Any]:
    """Per DP rank, from UCM's lines: requests, hit ratio ((hit hbm + hit external) / full blocks) and the share
    of full blocks UCM loaded (hit external)."""
    by_rank: dict[int, list[tuple[int, int, int, int]]] = defaultdict(list)
    for line in lines:
        by_rank[line[3]].append(line)
    out: dict[str, Any] = {}
    for rank, rows in sorted(by_rank.items()):
        total = sum(r[0] for r in rows)
        out[str(rank)] = {
            "requests": len(rows),
            "hit_ratio": round(sum(r[1] + r[2] for r in rows) / total, 4) if total else 0.0,
            "external_hit_ratio": round(sum(r[2] for r in rows) / total, 4) if total else 0.0,
        }
    return out


def p90(values: list[float]) -> float:
    """90th percentile (linear interpolation between closest ranks)."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=10, method="inclusive")[8]


def latency_stats(samples: list[Sample]) -> dict[str, dict[str, float]]:
    """Mean and p90 of TTFT, TPOT and E2EL, ms."""
    series = {
        "ttft_ms": [s.ttft_s * 1e3 for s in samples],
        "tpot_ms": [s.tpot_s * 1e3 for s in samples if s.tpot_s is not None],
        "e2el_ms": [s.e2el_s * 1e3 for s in samples],
    }
    return {
        k: {"mean": round(statistics.fmean(v), 1), "p90": round(p90(v), 1)} if v else {"mean": 0.0, "p90": 0.0}
        for k, v in series.items()
    }


# ------------------------------------------------------------------------------------------------ runs
def start_server(args: argparse.Namespace, config: str, model: Path, dtype: str, tmp: Path) -> VllmServer:
    """The DP server of one configuration (started; not yet ready)."""
    extra = ["--data-parallel-size", str(DP_SIZE), "--block-size", str(args.block_size)]
    transfer = None
    if config == "recompute":
        extra.append("--no-enable-prefix-caching")
    elif config == "ucm_pc":
        store = {
            "store_pipeline": "Cache|Posix",
            "storage_backends": str(tmp / "store"),
            "cache_buffer_capacity_gb": args.cache_gb,
        }
        (tmp / "store").mkdir(exist_ok=True)
        config_file = tmp / "ucm_config.yaml"
        config_file.write_text(yaml.safe_dump({"ucm_connectors": [{"ucm_connector_config": store}]}))
        transfer = ucm_transfer_config({"UCM_CONFIG_FILE": str(config_file)})
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": omp_threads_bind(DP_SIZE, os.cpu_count() or 1),
        "VLLM_CPU_KVCACHE_SPACE": str(args.kvcache_gib),
    }
    return VllmServer(
        model,
        tmp / f"{config}.log",
        transfer,
        max_model_len=args.input_len + args.output_len + args.block_size,
        dtype=dtype,
        env=env,
        extra_args=extra,
    )


def wait_for_files(store: Path, n: int, timeout_s: float) -> tuple[int, float]:
    """Wait until ``store`` holds ``n`` block files (written back in the background); ``(files, seconds waited)``."""
    t0 = time.monotonic()
    while True:
        count = sum(1 for _ in store.rglob("*.ucmb"))
        if count >= n or time.monotonic() - t0 > timeout_s:
            return count, round(time.monotonic() - t0, 2)
        time.sleep(0.2)


def fetch_metrics(url: str) -> dict[str, dict[str, float]]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=60) as r:
        return parse_metrics(r.read().decode())


def run_config(
    args: argparse.Namespace, config: str, model: Path, dtype: str, prompts: tuple[list[list[int]], ...], tmp: Path
) -> dict[str, Any]:
    """Start the configuration's server, run warm-up, seed and full phases, stop it; its figures."""
    seeds, full, warmup = prompts
    order = list(range(len(full)))
    if args.order == "shuffled":
        random.Random(args.seed + 1).shuffle(order)
    server = start_server(args, config, model, dtype, tmp)
    result: dict[str, Any] = {}
    try:
        t0 = time.monotonic()
        server.wait_ready()
        result["startup_s"] = round(time.monotonic() - t0, 1)
        url = server.url
        for rank, prompt in enumerate(warmup):
            body = {"model": str(model), "prompt": prompt, "max_tokens": 2, "ignore_eos": True, "temperature": 0.0}
            stream(f"{url}/v1/completions", body, rank=rank)
        seed_samples = run_phase(url, str(model), seeds, 1)
        if config == "ucm_pc":
            # Every full block of the warm-up and seed prompts (distinct random prompts share no block).
            want = len(warmup) * (args.input_len // args.block_size) + len(seeds) * (len(seeds[0]) // args.block_size)
            result["seed_files"], result["seed_files_wait_s"] = wait_for_files(tmp / "store", want, 120.0)
        else:
            time.sleep(1.0)
        before = fetch_metrics(url)
        samples = run_phase(url, str(model), [full[i] for i in order], args.output_len)
        result["vllm_metrics"] = metrics_delta(before, fetch_metrics(url))
        log = server.read_log()
    finally:
        server.stop()
    result.update(latency_stats(samples))
    result["ranks"] = result["vllm_metrics"]
    if config == "ucm_pc":
        lines = ucm_lines(log)
        seed_lines = [line_of(lines, s.request_id) for s in seed_samples]
        full_lines = [line_of(lines, s.request_id) for s in samples]
        found = [x for x in full_lines if x is not None]
        result["ucm_lines_found"] = f"{len(found)}/{len(samples)}"
        result["ranks"] = ucm_ranks(found)
        # The rank of each full prompt's seed prompt and its own (UCM's line names it), where both were found.
        pairs = [(seed_lines[i], line) for i, line in zip(order, full_lines, strict=True)]
        crossed = [seed[3] != line[3] for seed, line in pairs if seed is not None and line is not None]
        result["full_prompts_on_another_rank_than_their_seed"] = f"{sum(crossed)}/{len(crossed)}"
    result["raw"] = {
        "ttft_ms": [round(s.ttft_s * 1e3, 1) for s in samples],
        "e2el_ms": [round(s.e2el_s * 1e3, 1) for s in samples],
        "output_tokens": [s.output_tokens for s in samples],
    }
    return result


def check_targets(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The brief's targets, where the configurations they compare were run."""
    targets: dict[str, Any] = {}
    ucm, hbm = results.get("ucm_pc"), results.get("hbm_pc")
    if ucm is not None:
        worst = min(r["hit_ratio"] for r in ucm["ranks"].values())
        targets["ucm_hit_ratio_min_over_ranks"] = worst
        targets["ucm_hit_ratio_at_least_0.79_on_every_rank"] = worst >= UCM_HIT_TARGET and len(ucm["ranks"]) == DP_SIZE
    if hbm is not None:
        targets["hbm_hit_ratio_max_over_ranks"] = max((r["hit_ratio"] for r in hbm["ranks"].values()), default=0.0)
    if ucm is not None and hbm is not None:
        targets["hbm_hit_ratio_below_ucm_on_every_rank"] = all(
            hbm["ranks"].get(rank, {"hit_ratio": 0.0})["hit_ratio"] < r["hit_ratio"] for rank, r in ucm["ranks"].items()
        )
        targets["ucm_mean_ttft_below_hbm"] = ucm["ttft_ms"]["mean"] < hbm["ttft_ms"]["mean"]
    return targets


def table(results: dict[str, dict[str, Any]], input_len: int, output_len: int) -> str:
    """The seed's table, one row per configuration, plus the hit ratio per DP rank."""
    head = (
        f"{'input':>6} {'output':>6}  {'config':<10} {'TTFT mean':>10} {'p90':>9} {'TPOT mean':>10} {'p90':>7} "
        f"{'E2EL mean':>10} {'p90':>9}  hit ratio per rank (requests)"
    )
    rows = [head]
    for config, r in results.items():
        ranks = ", ".join(f"{k}: {v['hit_ratio']:.3f} ({v['requests']})" for k, v in sorted(r["ranks"].items()))
        rows.append(
            f"{input_len:>6} {output_len:>6}  {LABELS[config]:<10} {r['ttft_ms']['mean']:>10.1f} "
            f"{r['ttft_ms']['p90']:>9.1f} {r['tpot_ms']['mean']:>10.1f} {r['tpot_ms']['p90']:>7.1f} "
            f"{r['e2el_ms']['mean']:>10.1f} {r['e2el_ms']['p90']:>9.1f}  {ranks}"
        )
    return "\n".join(rows) + "\n(ms; hit ratio: UCM PC from UCM's log lines, the others from vLLM's /metrics)"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model", choices=["real", "tiny"], default="real", help="SmolLM2-135M bf16, or the tiny Llama")
    p.add_argument("--models-dir", default="models", help="where the models are (built there if missing)")
    p.add_argument("--num-prompts", type=int, default=16, help="prompts per phase (N)")
    p.add_argument("--input-len", type=int, default=1280, help="tokens of a full prompt")
    p.add_argument("--prefix-ratio", type=float, default=0.8, help="seed prompt length / input length")
    p.add_argument("--output-len", type=int, default=32, help="output tokens of a full prompt (>= 2)")
    p.add_argument("--block-size", type=int, default=128, help="vLLM's block size (CPU: a multiple of 32)")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), help=f"any of {', '.join(CONFIGS)}")
    p.add_argument("--order", choices=["shuffled", "same"], default="shuffled", help="order of the full prompts")
    p.add_argument("--kvcache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE of each rank (GiB)")
    p.add_argument("--cache-gb", type=float, default=1.0, help="UCM's DRAM tier per rank (GiB)")
    p.add_argument("--seed", type=int, default=0, help="random prompts' seed")
    p.add_argument("--out", help="also write the JSON summary to this file")
    args = p.parse_args(argv)
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        p.error(f"--configs {' '.join(unknown)}: unknown; allowed: {', '.join(CONFIGS)}")
    if args.num_prompts < 2:
        p.error(f"--num-prompts {args.num_prompts}: at least 2 (one per DP rank)")
    if args.output_len < 2:
        p.error(f"--output-len {args.output_len}: TPOT needs at least 2 output tokens")
    if not 0 < args.prefix_ratio < 1:
        p.error(f"--prefix-ratio {args.prefix_ratio}: must be between 0 and 1")
    if args.block_size % 32:
        p.error(f"--block-size {args.block_size}: vLLM's CPU build needs a multiple of 32")
    if round(args.prefix_ratio * args.input_len) < args.block_size:
        p.error(f"--input-len {args.input_len}: the seed prompt must hold at least one --block-size block")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start_load = load_avg()
    if args.model == "real":
        model, dtype = ensure_smollm2(Path(args.models_dir)), "bfloat16"
    else:
        model, dtype = ensure_tiny_llama(Path(args.models_dir)), "float32"
    from transformers import AutoTokenizer

    vocab = AutoTokenizer.from_pretrained(str(model)).vocab_size
    seed_len = round(args.prefix_ratio * args.input_len)
    prompts = make_prompts(vocab, args.num_prompts, seed_len, args.input_len, args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="ucm-dp-bench-"))
    results: dict[str, dict[str, Any]] = {}
    try:
        for config in args.configs:
            results[config] = run_config(args, config, model, dtype, prompts, tmp)
    finally:
        shutil.rmtree(tmp / "store", ignore_errors=True)
    problems = [
        f"{config}: {r['ucm_lines_found']} full prompts with a UCM log line"
        for config, r in results.items()
        if "ucm_lines_found" in r and r["ucm_lines_found"] != f"{args.num_prompts}/{args.num_prompts}"
    ]
    problems += [
        f"{config}: output tokens {sorted(set(r['raw']['output_tokens']))}, not {args.output_len}"
        for config, r in results.items()
        if set(r["raw"]["output_tokens"]) != {args.output_len}
    ]
    print(table(results, args.input_len, args.output_len))
    summary: dict[str, Any] = {
        "benchmark": "dp",
        "date": utc_now(),
        "model": model.name,
        "options": vars(args),
        "form": f"vllm serve --data-parallel-size {DP_SIZE} (internal load balancing)",
        "omp_threads_bind": omp_threads_bind(DP_SIZE, os.cpu_count() or 1),
        "seed_prompt_tokens": seed_len,
        "configs": results,
        "targets": check_targets(results),
        "problems": problems,
        "logs": str(tmp),
        "versions": versions(),
        "machine": machine_info(start_load),
    }
    return emit_summary(summary, args.out, failed=bool(problems))


if __name__ == "__main__":
    sys.exit(main())
