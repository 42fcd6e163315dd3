"""Storage-hit TTFT, store variants side by side: interleaved requests, page cache dropped before each, paired ratios.

Run::

    .venv/bin/python benchmarks/storage_hits.py [--rounds 20] [--prompt-tokens 2000] [--out results.json]

Why this benchmark. A storage hit after a restart (``benchmarks/e2e_ttft.py``) costs one engine start per sample,
so it gets 3-5 samples per variant, and single restarts differ by more than the gaps between the variants (see
"End-to-end TTFT" in benchmarks/RESULTS.md): too few to tell layerwise from blockwise or compressed from
uncompressed. Here every variant is a long-running server (a real ``vllm serve`` process group, vLLM's own process
layout), all started at once and left idle but for their own requests, and the storage hits are taken in rounds:
in each round every variant serves the same prompt once, in a shuffled order, each request after the page cache was
dropped and the CPUs went idle. A round gives one paired sample per variant, taken seconds apart; the statistics
are over the rounds.

What makes each measured request a storage hit:
- vLLM's prefix caching is off (``--no-enable-prefix-caching``), so only the connector can serve the prefix;
- ``--prompts`` K distinct prompts (default 3) are served in rotation, and the DRAM tier of the ``Cache|...``
  pipelines holds 0.75 (K - 1) prompts' KV (``cache_buffer_capacity_gb``, from the model's shapes). Since a
  prompt was last served, the K - 1 others were, so the least-recently-used DRAM tier has evicted its blocks;
- the page cache is emptied before each request: ``sync; echo 3 > /proc/sys/vm/drop_caches`` where permitted
  (root), else (or with ``--page-cache fadvise_dontneed``) ``posix_fadvise(DONTNEED)`` on the stores' files after
  a ``syncfs`` of their file system (``benchmarks/common.py``); ``options.page_cache`` in the JSON says which.
It is checked, not assumed: UCM's per-request log line must report every full block as an external hit, and the
bytes the server's processes read from the block device during the request (``read_bytes`` of
``/proc/<pid>/io``) are reported per variant (``disk_read_mb``); a DRAM hit or a page-cache hit would read ~0.

Variants (``--variants``): ``blockwise`` (``Cache|Posix``), ``layerwise`` (the same with ``use_layerwise: true``),
``compressed`` (``Cache|Compress|Posix``, KVfold lossless), ``compressed_layerwise``, ``posix`` /
``posix_layerwise`` (``Posix`` alone: no DRAM tier), ``blockwise_traces`` (``blockwise`` with
``enable_record_traces: true``: the cost of the JSONL trace), ``blockwise_quiet`` (``blockwise`` with
``enable_metrics: false``; UCM's metrics are on in every other UCM variant), ``blockwise_events`` (``blockwise`` with
vLLM's KV events on, ``--kv-events-config`` with a ZMQ publisher, drained by a subscriber in this process: with
``--reference blockwise_quiet``, the cost of metrics and events together), ``example`` (vLLM's own
``ExampleConnector``, safetensors files per prompt in its own directory, read from disk like UCM's; each of its
requests must log ExampleConnector's hit line), and ``recompute`` (no connector: the prompt is computed).
Each UCM variant has its own fresh store directory, filled by serving every prompt once before the rounds.

``--suffix-tokens S`` appends S tokens of new real text (different in every round, the same for every variant of
a round) to the stored prompt: a storage hit on the prefix plus S tokens to compute, the case layerwise loading is
for (the next layers load while the first compute).

Reported (the last line printed is a JSON object): per variant the median TTFT (ms, client side: from sending the
streaming request to its first token), the quartiles and every sample; per UCM variant the ratio to the reference
(``--reference``, default ``blockwise``) as the median over rounds of the per-round ratio, with a 95% bootstrap
confidence interval (10,000 resamples of the rounds) and the number of rounds it was below 1. A ratio whose whole
interval lies below 1 is a measured speed-up; an interval that contains 1 is a tie at this noise level. The median
of the per-round ratios can fall on the other side of 1 than the ratio of the two medians (a few slow rounds move
one variant's median but not the paired ratios); the paired figure is the one that cancels the machine's drift.
Also per variant the median disk read per request (MB) and the idle CPU fraction just before the requests.

With ``--out results.json`` a plot of every variant's TTFT samples (quartiles, median, min and max;
``benchmarks/plots.py``) is written beside it as ``results.png`` (or where ``--plot`` says); its path is the
summary's ``plot``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import (  # noqa: E402
    PAGE_CACHE_METHODS,
    emit_summary,
    evict_page_cache,
    machine_info,
    utc_now,
    versions,
)
from benchmarks.e2e_ttft import EXAMPLE_HIT_LINE, QUESTIONS, example_connector  # noqa: E402
from benchmarks.plots import png_beside, ttft_boxplot  # noqa: E402
from ucm.testing.engine import HIT_RE, ucm_transfer_config  # noqa: E402
from ucm.testing.models import ensure_smollm2  # noqa: E402
from ucm.testing.server import VllmServer, stream_completion  # noqa: E402
from ucm.testing.texts import real_text  # noqa: E402

BLOCK_SIZE = 128  # tokens per block: the CPU attention backend's
MAX_MODEL_LEN = 4096


@dataclass(frozen=True)
class UcmVariant:
    """How a UCM variant's server is configured."""

    pipeline: str
    layerwise: bool = False
    traces: bool = False  # enable_record_traces
    metrics: bool = True  # enable_metrics
    kv_events: bool = False  # vLLM's --kv-events-config (ZMQ publisher)


VARIANTS: dict[str, UcmVariant | None] = {  # None: no connector
    "blockwise": UcmVariant("Cache|Posix"),
    "layerwise": UcmVariant("Cache|Posix", layerwise=True),
    "compressed": UcmVariant("Cache|Compress|Posix"),
    "compressed_layerwise": UcmVariant("Cache|Compress|Posix", layerwise=True),
    "posix": UcmVariant("Posix"),
    "posix_layerwise": UcmVariant("Posix", layerwise=True),
    "blockwise_traces": UcmVariant("Cache|Posix", traces=True),
    "blockwise_quiet": UcmVariant("Cache|Posix", metrics=False),
    "blockwise_events": UcmVariant("Cache|Posix", kv_events=True),
    "example": None,  # vLLM's ExampleConnector (see EXAMPLE)
    "recompute": None,
}
# The variant served by vLLM's own ExampleConnector (safetensors files per prompt, in its own directory): the
# simplest storage connector vLLM ships, which UCM's storage hit must beat (issue 36).
EXAMPLE = "example"
DEFAULT_VARIANTS = ("blockwise", "layerwise", "compressed", "recompute")


@dataclass
class Variant:
    """One server and its samples (one per round)."""

    name: str
    server: VllmServer
    ttft_ms: list[float] = field(default_factory=list)
    disk_read_mb: list[float] = field(default_factory=list)
    idle: list[float] = field(default_factory=list)
    first_tokens: list[str] = field(default_factory=list)
    hit_lines_seen: int = 0

    @property
    def uses_ucm(self) -> bool:
        return VARIANTS[self.name] is not None


# ---------------------------------------------------------------------------------------------------- helpers
def kv_bytes_per_block(model_dir: Path) -> int:
    """Bytes of one block's KV over all layers (bf16): layers x (K, V) x block_size x num_kv_heads x head_dim x 2."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return int(cfg["num_hidden_layers"]) * 2 * BLOCK_SIZE * int(cfg["num_key_value_heads"]) * int(head_dim) * 2


def build_prompts(model_dir: Path, count: int, tokens: int, rounds: int, suffix_tokens: int) -> tuple[list, list]:
    """``count`` prompts of ``tokens`` tokens of distinct real text plus a question, and ``rounds`` suffixes of
    ``suffix_tokens`` tokens of further text (empty strings when 0)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    needed = count * tokens + rounds * suffix_tokens
    # verbose=False: the source text is longer than the model's context; only cuts of it are prompts
    ids = tokenizer.encode(real_text(min_chars=6 * needed), add_special_tokens=False, verbose=False)
    if len(ids) < needed:
        raise SystemExit(f"only {len(ids)} tokens of real text on this machine; {needed} needed")
    prompts = [
        tokenizer.decode(ids[i * tokens : (i + 1) * tokens]) + "\n\n" + QUESTIONS[i % len(QUESTIONS)] + "\n"
        for i in range(count)
    ]
    pos = count * tokens
    cuts = [ids[pos + r * suffix_tokens : pos + (r + 1) * suffix_tokens] for r in range(rounds)]
    suffixes = ["\n\n" + tokenizer.decode(cut) if cut else "" for cut in cuts]
    longest = max(len(tokenizer.encode(p + s)) for p in prompts for s in suffixes[:1] or [""])
    if longest + 1 > MAX_MODEL_LEN:
        raise SystemExit(f"a prompt has {longest} tokens; it must fit max_model_len {MAX_MODEL_LEN}")
    return prompts, suffixes


def ucm_extra(store_dir: Path, variant: UcmVariant, cache_gb: float) -> dict[str, Any]:
    """``kv_connector_extra_config`` for one UCM variant (inline config); with ``variant.traces``, the JSONL trace
    is on (in ``store_dir/traces``)."""
    store: dict[str, Any] = {"store_pipeline": variant.pipeline, "storage_backends": str(store_dir)}
    if variant.pipeline.startswith("Cache|"):
        store["cache_buffer_capacity_gb"] = cache_gb
    return {
        "ucm_connectors": [{"ucm_connector_name": "UcmPipelineStore", "ucm_connector_config": store}],
        "use_layerwise": variant.layerwise,
        "enable_record_traces": variant.traces,
        "enable_metrics": variant.metrics,
    }


class EventDrain:
    """A ZMQ SUB socket bound on 127.0.0.1 that vLLM's KV-event publisher connects to, drained by a daemon thread
    (a router's subscriber, so that publishing costs what it costs in service); counts the events it decodes."""

    def __init__(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        from ucm.testing.server import free_port

        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.events = 0
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.bind(self.endpoint)
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-event-drain", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(200):
                *_, payload = self._sock.recv_multipart()
                self.events += len(self._decoder.decode(payload).events)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close(linger=0)
        self._ctx.term()


def read_bytes(pids: list[int]) -> int:
    """Sum of ``read_bytes`` (bytes fetched from the block device) of ``/proc/<pid>/io`` over ``pids``."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/io").read_text().splitlines():
                if line.startswith("read_bytes:"):
                    total += int(line.split()[1])
        except OSError:
            pass  # the process ended
    return total


def empty_page_cache(mode: str, store_root: Path) -> None:
    """Empty the page cache before a request (:func:`benchmarks.common.evict_page_cache`): ``drop_caches`` (the
    whole machine's; root) or ``fadvise_dontneed`` (every file under ``store_root``; any user).

    Raises:
        SystemExit: ``drop_caches`` is not permitted here (the hits would be served from memory).
    """
    try:
        evict_page_cache(mode, store_root)
    except OSError as exc:
        raise SystemExit(
            f"the page cache cannot be dropped here (root needed); use --page-cache fadvise_dontneed ({exc})"
        ) from exc


def _cpu_times() -> tuple[int, int]:
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return fields[3] + fields[4], sum(fields)  # idle + iowait, total (clock ticks)


def wait_idle(min_idle: float, timeout_s: float, window_s: float = 0.2) -> float:
    """Wait until the machine's CPUs were at least ``min_idle`` idle over a ``window_s`` window (or ``timeout_s``
    passed); return the last window's idle fraction (0..1)."""
    deadline = time.monotonic() + timeout_s
    while True:
        idle0, total0 = _cpu_times()
        time.sleep(window_s)
        idle1, total1 = _cpu_times()
        frac = (idle1 - idle0) / max(1, total1 - total0)
        if frac >= min_idle or time.monotonic() > deadline:
            return frac


def bootstrap_median_ci(values: list[float], resamples: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap confidence interval of the median of ``values``."""
    data = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng(seed)
    medians = np.median(data[rng.integers(0, len(data), size=(resamples, len(data)))], axis=1)
    low, high = np.percentile(medians, [2.5, 97.5])
    return float(low), float(high)


def measure(v: Variant, model: str, prompt: str, problems: list[str], label: str, args: argparse.Namespace) -> None:
    """One storage-hit request on ``v``: empty the page cache, wait for idle CPUs, time the request, check the hit."""
    time.sleep(args.gap_s)  # the last server's engine processes stop polling
    empty_page_cache(args.page_cache, args.store_root)
    v.idle.append(wait_idle(args.min_idle, timeout_s=5.0))
    pids = v.server.pids()
    before = read_bytes(pids)
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    text, ttft_s, _ = stream_completion(f"{v.server.url}/v1/completions", body)
    v.disk_read_mb.append((read_bytes(pids) - before) / 1e6)
    v.ttft_ms.append(ttft_s * 1e3)
    v.first_tokens.append(text)
    if v.uses_ucm:
        hits = HIT_RE.findall(v.server.read_log())
        new, v.hit_lines_seen = hits[v.hit_lines_seen :], len(hits)
        if len(new) != 1:
            problems.append(f"{v.name} {label}: {len(new)} UCM lookup lines for one request")
        else:
            external = int(new[0][3])
            if external < args.prompt_blocks:
                problems.append(f"{v.name} {label}: hit external {external} of {args.prompt_blocks} stored blocks")
    elif v.name == EXAMPLE:
        seen, v.hit_lines_seen = v.hit_lines_seen, hit_lines(v)
        if v.hit_lines_seen == seen:
            problems.append(f"{v.name} {label}: no '{EXAMPLE_HIT_LINE}' line: ExampleConnector did not load")


def hit_lines(v: Variant) -> int:
    """How many hit lines ``v``'s server has logged: UCM's lookup lines, or ExampleConnector's load lines."""
    log = v.server.read_log()
    return log.count(EXAMPLE_HIT_LINE) if v.name == EXAMPLE else len(HIT_RE.findall(log))


def summarize(variants: list[Variant], reference: str) -> dict[str, Any]:
    """Per-variant medians and paired ratios to ``reference`` (see the module docstring)."""
    out: dict[str, Any] = {}
    ref = next((v for v in variants if v.name == reference), None)
    for v in variants:
        q1, med, q3 = (float(x) for x in np.percentile(v.ttft_ms, [25, 50, 75]))
        entry: dict[str, Any] = {
            "ttft_ms_median": round(med, 1),
            "ttft_ms_quartiles": [round(q1, 1), round(q3, 1)],
            "disk_read_mb_median": round(statistics.median(v.disk_read_mb), 2),
            "idle_before_median": round(statistics.median(v.idle), 3),
            "ttft_ms": [round(x, 1) for x in v.ttft_ms],
        }
        if ref is not None and v is not ref:
            ratios = [a / b for a, b in zip(v.ttft_ms, ref.ttft_ms, strict=True)]
            low, high = bootstrap_median_ci(ratios)
            entry[f"over_{reference}"] = {
                "median": round(statistics.median(ratios), 3),
                "ci95": [round(low, 3), round(high, 3)],
                "rounds_below_1": sum(r < 1 for r in ratios),
                "rounds": len(ratios),
            }
        out[v.name] = entry
    return out


def measured_command(argv: list[str]) -> str:
    """The command line that ran, without where its output went (``--out``, ``--plot``: in ``options``)."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--out", "--plot"):
            skip = True
        elif not arg.startswith(("--out=", "--plot=")):
            kept.append(arg)
    return " ".join(["benchmarks/storage_hits.py", *kept])


def write_plot(summary: dict[str, Any], path: str | Path) -> Path:
    """Plot the TTFT samples of every variant of ``summary`` (this script's JSON summary) into the PNG ``path``,
    titled with the prompt and rounds, the machine, versions, date and command under the axis.

    Raises:
        ValueError: a variant has no sample; OSError: the file cannot be written.
    """
    samples = {name: entry["ttft_ms"] for name, entry in summary["variants"].items()}
    rounds = max(len(v) for v in samples.values()) if samples else 0
    machine, versions_ = summary["machine"], summary["versions"]
    title = (
        f"Storage-hit TTFT: {summary['model']}, {summary['prompt_full_blocks']} stored blocks of {BLOCK_SIZE} "
        f"tokens, {rounds} paired rounds"
    )
    cpu = machine.get("cpu_model") or machine.get("processor") or "unknown CPU"
    note = (
        f"{cpu}, {machine.get('cpu_count')} CPUs; vLLM {versions_.get('vllm')}; {summary['date']}; "
        f"{summary.get('command', 'benchmarks/storage_hits.py')}"
    )
    return ttft_boxplot(samples, path, title=title, note=note)


# ------------------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Storage-hit TTFT of UCM store variants, interleaved and paired.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--models-dir", default="models", help="where the demo model is (built there if missing)")
    p.add_argument("--model", default=None, help="another model directory; None: SmolLM2 in --models-dir")
    p.add_argument(
        "--page-cache",
        choices=("auto", *PAGE_CACHE_METHODS),
        default="auto",
        help="how the page cache is emptied before each request: the whole machine's (root), or the stores' files; "
        "auto: drop_caches where permitted",
    )
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), help=f"of {', '.join(VARIANTS)}")
    p.add_argument("--reference", default="blockwise", help="the variant the ratios divide by")
    p.add_argument("--rounds", type=int, default=20, help="measured rounds (one request per variant each)")
    p.add_argument("--prompt-tokens", type=int, default=2000, help="tokens of each stored prompt")
    p.add_argument("--prompts", type=int, default=3, help="distinct prompts served in rotation (>= 2)")
    p.add_argument("--suffix-tokens", type=int, default=0, help="new tokens after the stored prompt, per round")
    p.add_argument("--gap-s", type=float, default=1.5, help="pause before each request (s)")
    p.add_argument("--min-idle", type=float, default=0.9, help="idle CPU fraction waited for before each request")
    p.add_argument("--ucm-log-level", default=None, help="UC_LOGGER_LEVEL of the UCM servers (e.g. debug)")
    p.add_argument("--seed", type=int, default=0, help="seed of the per-round variant order")
    p.add_argument("--out", default=None, help="also write the JSON summary to this file")
    p.add_argument(
        "--plot", default=None, help="write the TTFT plot (PNG) here; default: beside --out (results.png), else none"
    )
    p.add_argument("--keep-logs", action="store_true", help="keep the servers' logs and stores (path in the JSON)")
    args = p.parse_args(argv)
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error(f"--variants {' '.join(unknown)}: unknown; allowed: {', '.join(VARIANTS)}")
    if args.reference not in args.variants:
        p.error(f"--reference {args.reference!r} is not among --variants {' '.join(args.variants)}")
    if args.prompts < 2:
        p.error(f"--prompts {args.prompts}: at least 2 are needed for the DRAM tier to miss")
    if args.rounds < 1 or args.prompt_tokens < BLOCK_SIZE or args.suffix_tokens < 0:
        p.error("--rounds >= 1, --prompt-tokens >= 128 and --suffix-tokens >= 0 are needed")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.page_cache == "auto":
        args.page_cache = "drop_caches" if os.access("/proc/sys/vm/drop_caches", os.W_OK) else "fadvise_dontneed"
    model_dir = Path(args.model) if args.model else ensure_smollm2(Path(args.models_dir))
    model = str(model_dir)
    prompts, suffixes = build_prompts(model_dir, args.prompts, args.prompt_tokens, args.rounds, args.suffix_tokens)
    args.prompt_blocks = args.prompt_tokens // BLOCK_SIZE  # full blocks of real text in every prompt (at least)
    prompt_kv = args.prompt_blocks * kv_bytes_per_block(model_dir)
    cache_gb = round(0.75 * (args.prompts - 1) * prompt_kv / 2**30, 6)

    tmp = Path(tempfile.mkdtemp(prefix="ucm-storage-hits-"))
    args.store_root = tmp / "stores"
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    if args.ucm_log_level:
        env["UC_LOGGER_LEVEL"] = args.ucm_log_level
    variants: list[Variant] = []
    problems: list[str] = []
    drains: dict[str, EventDrain] = {}
    try:
        for name in args.variants:
            spec = VARIANTS[name]
            transfer = None
            extra_args = ["--no-enable-prefix-caching"]
            if name == EXAMPLE:
                transfer = example_connector(args.store_root / name)
            elif spec is not None:
                transfer = ucm_transfer_config(ucm_extra(args.store_root / name, spec, cache_gb))
                if spec.kv_events:
                    drains[name] = EventDrain()
                    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": drains[name].endpoint}
                    extra_args += ["--kv-events-config", json.dumps(events)]
            server = VllmServer(
                model_dir, tmp / f"{name}.log", transfer, max_model_len=MAX_MODEL_LEN, env=env, extra_args=extra_args
            )
            variants.append(Variant(name, server))
        kept = "kept" if args.keep_logs else "removed at the end; --keep-logs keeps them"
        print(
            f"[storage_hits] starting {len(variants)} servers (logs in {tmp}, {kept}) ...", file=sys.stderr, flush=True
        )
        for v in variants:
            v.server.wait_ready()
        # Fill: every prompt once per server (UCM misses and dumps; also every server's one-time costs).
        for v in variants:
            for prompt in prompts:
                stream_completion(f"{v.server.url}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 1})
            v.hit_lines_seen = hit_lines(v)
        rng = random.Random(args.seed)
        for r in range(args.rounds):
            prompt = prompts[r % len(prompts)] + suffixes[r]
            order = list(variants)
            rng.shuffle(order)
            for v in order:
                measure(v, model, prompt, problems, f"round {r}", args)
            line = ", ".join(f"{v.name} {v.ttft_ms[-1]:.0f} ms" for v in variants)
            print(f"[storage_hits] round {r + 1}/{args.rounds}: {line}", file=sys.stderr, flush=True)
    finally:
        for v in variants:
            v.server.stop()
        for drain in drains.values():
            drain.close()

    agree = sum(len({v.first_tokens[r] for v in variants}) == 1 for r in range(args.rounds))
    summary: dict[str, Any] = {
        "benchmark": "storage_hits",
        "command": measured_command(sys.argv[1:] if argv is None else argv),
        "date": utc_now(),
        "model": model_dir.name,
        "options": {k: v for k, v in vars(args).items() if k not in ("prompt_blocks", "store_root")},
        "prompt_full_blocks": args.prompt_blocks,
        "prompt_kv_mb": round(prompt_kv / 1e6, 2),
        "cache_buffer_capacity_gb": cache_gb,
        "variants": summarize(variants, args.reference),
        "first_token_same_in_all_variants": f"{agree}/{args.rounds} rounds",
        "kv_events_received": {name: drain.events for name, drain in drains.items()},
        "problems": problems,
        "logs": str(tmp) if args.keep_logs else None,
        "versions": versions(),
        "machine": machine_info(),
    }
    if not args.keep_logs:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    plot = args.plot or (png_beside(args.out) if args.out else None)
    summary["plot"] = str(plot) if plot else None
    if plot:
        print(f"[storage_hits] plot: {write_plot(summary, plot)}", file=sys.stderr, flush=True)
    return emit_summary(summary, args.out, failed=bool(problems))


if __name__ == "__main__":
    sys.exit(main())
