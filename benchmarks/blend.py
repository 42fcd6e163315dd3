"""CacheBlend's TTFT against full prefill and against prefix-only caching, through the real engine (CPU build), on
RAG-like prompts whose documents come back in another order.

Run::

    .venv/bin/python benchmarks/blend.py [--model smollm2|tiny] [--models-dir models] [--chunks 4]
                                         [--chunk-tokens 512] [--ratios 0.15] [--prompts 3] [--seed 0]
                                         [--max-tokens 8] [--check-layer model.layers.1.self_attn.attn]
                                         [--chunk-context none|first_chunk] [--selection deviation|question]
                                         [--question-layers 15:30]
                                         [--keep-logs DIR] [--out results.json]

Prompts. ``--chunks`` documents of ``--chunk-tokens`` tokens each, cut out of real text
(``ucm.testing.texts.source_texts``: the cuts are spread evenly over all the text on this machine, so they come from
different sources), each followed by the chunk-end token ``<file_sep>`` (one token of SmolLM2's tokenizer), then a
question in a ChatML user turn (quote the first words of the last document: the answer depends on the order). The
*in-order* prompt holds documents ``0..n-1``; the ``--prompts`` measured prompts hold the same documents in distinct
other orders (seeded shuffles), the same question last. The tokenizer splits the text at the chunk-end tokens, so a
document has the same tokens wherever it stands. With ``--chunk-context first_chunk`` every prompt starts with the
same head, a ChatML system turn followed by the chunk-end token (:data:`HEAD`), before the documents.

Engines: one process per mode (``ucm.testing.engine.run_engine``, engine core in that process), each on a fresh
store directory of UCM's default ``Cache|Posix`` pipeline; greedy, ``--max-tokens`` tokens per request; vLLM's
prefix cache on but reset before every request, so it never serves one; block size 128 (the CPU build's default).
Every engine runs the same requests: a short warm-up prompt without a chunk-end token (ignored), the in-order prompt
(its TTFT is ``ttft_first_ms``), then the measured prompts. The engines run at once but take turns
(``benchmarks.common.TakeTurns``): one request at a time over all engines, round-robin by request (full prefill's
prompt ``i``, prefix-only's, each blend's, then prompt ``i + 1``), 0.2 s apart; so the TTFTs whose ratios are taken
are measured moments apart, and a change of the machine's speed during the run (these machines are shared) moves
both sides of a ratio alike.

- ``full``: full prefill. UCMConnector as ``kv_consumer`` on an empty store, without Blend: it looks up, misses and
  never stores, so the connector's per-request costs are paid as in the other modes (as in ``rerope.py``).
- ``prefix_only``: UCMConnector ``kv_both`` without Blend. The in-order prompt stores its prefix blocks (and each
  measured prompt its own); a measured prompt loads only the leading full blocks it shares with an earlier prompt
  (the same first document or documents), and computes the rest.
- ``blend`` (one engine per ``--ratios`` entry): UCMConnector ``kv_both`` with ``ucm_sparse_config: {Blend:
  {chunk_end_token_id: <file_sep>, compute_meta: {model.layers.1.self_attn.attn: {ratio: r}}, store_chunks: true}}``.
  The in-order prompt computes every document on its own (positions from 0) and stores it; a measured prompt loads
  its first document as a stored prefix and the others' stored KV at their new positions, recomputes every blended
  token through layers 0-1 and, after layer 1, the ``r`` of them whose KV deviates most (plus the question's
  tokens but the last, which have no stored KV); vLLM then computes the prompt's last token. With
  ``--chunk-context first_chunk`` (Blend's ``chunk_context``) the in-order prompt computes each document after the
  head and stores it under the keys of head + document; a measured prompt's first document after the head is a
  stored prefix, and each other document's blocks are loaded from the one holding the head/document boundary on.
  With ``--selection question`` (Blend's ``selection``) the tokens recomputed after layer 1 are those the question
  attends to most over the stored KV (a probe of the question through the layers before the pass, its attention
  summed over ``--question-layers``, Blend's ``question_layers``), not those of highest deviation.

Reported per mode: ``ttft_ms``, the median TTFT (vLLM's ``first_token_latency``) over the measured prompts, with
every sample; ``ratio_to_full``, the median over the prompts of the mode's TTFT / full prefill's TTFT of the same
prompt; ``hit_external_blocks``, the stored prefix blocks of each measured prompt (UCM's per-request log line);
``first_token_agreement``, the fraction of measured prompts whose first generated token equals full prefill's, with
``first_token_logprob_diff`` (per prompt, |log-prob of that token - full prefill's| where they agree),
``matching_prefix_tokens`` (per prompt, how many leading generated tokens equal full prefill's) and the ``answers``.
For blend, from UCM's per-blend log line of each measured prompt: ``reused_tokens`` (blended tokens whose KV came
from stored documents), ``recomputed_tokens`` (tokens recomputed after the check layer), ``computed_chunks``
(documents the store lacked, computed and stored: 0 once the in-order prompt stored them), and the blend's document
loading and layer-pass times; ``prompt_reused_tokens`` adds the stored prefix blocks' tokens (for ``prefix_only``:
those alone). The issue's target: blend TTFT <= 0.5x full prefill at ratio 0.15 (``meets_target``). ``--model
tiny`` runs a random-weight 4-layer Llama (the smoke test's; its greedy tokens flip on noise: never judge agreement
on it). The last line printed is a JSON object with every figure.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import math
import random
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import yaml

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.blend_quality import layer_range  # noqa: E402
from benchmarks.common import TakeTurns, emit_summary, load_avg, machine_info, utc_now, versions  # noqa: E402
from ucm.config import BLEND_LAYER_RE, BlendSelection, ChunkContext  # noqa: E402
from ucm.quality.blend import question_layers_error  # noqa: E402
from ucm.testing.engine import (  # noqa: E402
    BLEND_RE,
    HIT_RE,
    RequestResult,
    failed_loads,
    run_engine,
    ucm_transfer_config,
)
from ucm.testing.models import ensure_smollm2, ensure_tiny_llama  # noqa: E402
from ucm.testing.texts import source_texts  # noqa: E402

BLOCK_SIZE = 128  # vLLM CPU's default, set explicitly: the stored blocks and the hit counts are in these units
MAX_MODEL_LEN = 8192  # SmolLM2's (and the tiny model's) positions
CHUNK_END = "<file_sep>"
CHECK_LAYER = "model.layers.1.self_attn.attn"
STORE_PIPELINE = "Cache|Posix"
# A ChatML user turn (SmolLM2-Instruct's format): asked in plain text after the documents, the model ends its answer
# at once (its first token is <|im_end|> whatever the KV), which would make the agreement figures vacuous. The answer
# depends on which document comes last.
QUESTION = "<|im_start|>user\nQuote the first words of the last document above.<|im_end|>\n<|im_start|>assistant\n"
WARMUP_PROMPT = (
    "Describe a quiet morning at a small harbour: the boats coming back from the night, the smell of the sea, "
    "the gulls above the market and the people who buy fish before going to work."
)
# --chunk-context first_chunk: the head every prompt starts with (one chunk, the same in every prompt). Shorter than a
# block, it is never a stored prefix on its own; head + first document is, and the other documents are stored after it.
HEAD = (
    "<|im_start|>system\nYou are a careful assistant. Read the documents below, then answer the question after "
    "them.<|im_end|>\n"
)
TARGET_RATIO = 0.15
TARGET_TTFT = 0.5


@dataclass
class BlendLine:
    """One request's blend, from UCM's log (summed over the request's blends: one in practice)."""

    tokens: int = 0
    chunks: int = 0
    reused: int = 0
    computed_chunks: int = 0
    recomputed: int = 0
    chunks_ms: float = 0.0
    pass_ms: float = 0.0


def blend_lines(stderr: str) -> dict[str, BlendLine]:
    """Request id -> its blend, parsed from an engine's stderr."""
    out: dict[str, BlendLine] = {}
    for m in BLEND_RE.finditer(stderr):
        line = out.setdefault(m.group(1), BlendLine())
        line.tokens += int(m.group(3)) - int(m.group(2))
        line.chunks += int(m.group(4))
        line.reused += int(m.group(5))
        line.computed_chunks += int(m.group(6))
        line.recomputed += int(m.group(7))
        line.chunks_ms += float(m.group(8))
        line.pass_ms += float(m.group(9))
    return out


# --------------------------------------------------------------------------------------------------- prompts
def build_chunks(tokenizer: Any, n: int, tokens: int) -> list[str]:
    """``n`` documents of ``tokens`` tokens each: cuts spread evenly over all the real text on this machine (every
    source of ``ucm.testing.texts``, joined).

    Raises:
        SystemExit: there is not enough text.
    """
    ids = tokenizer.encode("\n\n".join(source_texts()), add_special_tokens=False)
    stride = len(ids) // n
    if stride < tokens:
        raise SystemExit(f"only {len(ids)} tokens of real text on this machine; {n} x {tokens} needed")
    return [tokenizer.decode(ids[i * stride : i * stride + tokens]) for i in range(n)]


def shuffles(n: int, count: int, seed: int) -> list[tuple[int, ...]]:
    """``count`` distinct orders of ``n`` documents, none of them the in-order one (seeded).

    Raises:
        SystemExit: there are fewer than ``count`` such orders.
    """
    available = math.factorial(n) - 1
    if count > available:
        raise SystemExit(f"--prompts {count}: {n} documents have only {available} orders besides the in-order one")
    identity = tuple(range(n))
    if n <= 8:  # few enough to list: sample without repeats
        return random.Random(seed).sample([p for p in itertools.permutations(range(n)) if p != identity], count)
    rng = random.Random(seed)
    out: list[tuple[int, ...]] = []
    while len(out) < count:
        order = tuple(rng.sample(range(n), n))
        if order != identity and order not in out:
            out.append(order)
    return out


def prompt_of(chunks: list[str], order: tuple[int, ...], head: str = "") -> str:
    """``head`` (if any) and the documents in ``order``, each followed by the chunk-end token, then the question."""
    return (head + CHUNK_END if head else "") + "".join(chunks[i] + CHUNK_END for i in order) + QUESTION


# ------------------------------------------------------------------------------------------ engine processes
def ucm_config(
    store: Path,
    chunk_end_id: int,
    ratio: float | None,
    check_layer: str = CHECK_LAYER,
    chunk_context: ChunkContext = "none",
    selection: BlendSelection = "deviation",
    question_layers: list[int] | None = None,
) -> dict[str, Any]:
    """UCM's config: the store pipeline on ``store``, with Blend at ``ratio`` (chosen at ``check_layer`` by
    ``selection``, over ``question_layers`` when given, chunks computed after ``chunk_context``) unless it is
    None."""
    config: dict[str, Any] = {
        "ucm_connectors": [
            {
                "ucm_connector_name": "UcmPipelineStore",
                "ucm_connector_config": {"store_pipeline": STORE_PIPELINE, "storage_backends": str(store)},
            }
        ]
    }
    if ratio is not None:
        config["ucm_sparse_config"] = {
            "Blend": {
                "chunk_end_token_id": chunk_end_id,
                "compute_meta": {check_layer: {"ratio": ratio}},
                "store_chunks": True,
                "chunk_context": chunk_context,
                "selection": selection,
            }
        }
        if question_layers is not None:
            config["ucm_sparse_config"]["Blend"]["question_layers"] = question_layers
    return config


@dataclass
class ModeRun:
    """One engine's measured requests: the in-order prompt's result, the measured prompts' results and their
    blends (in the measured prompts' order; empty without Blend), and the blocks whose load failed."""

    first: RequestResult
    measured: list[RequestResult]
    blends: list[BlendLine]
    failed_loads: int


def run_mode(
    name: str,
    base: dict[str, Any],
    config: dict[str, Any],
    kv_role: str,
    tmp: Path,
    keep_logs: Path | None,
    before_cmds: list[str] | None = None,
) -> ModeRun:
    """Run one mode's engine on ``base`` (model, requests) with UCM ``config``, each request ``i`` after the shell
    command ``before_cmds[i]`` if given; parse its log."""
    config_path = tmp / f"{name}.yaml"
    config_path.write_text(yaml.safe_dump(config))
    spec = {**base, "connector": ucm_transfer_config({"UCM_CONFIG_FILE": str(config_path)}, kv_role=kv_role)}
    if before_cmds is not None:
        spec["requests"] = [{**req, "before_cmd": cmd} for req, cmd in zip(spec["requests"], before_cmds, strict=True)]
    log = tmp / f"{name}.log"
    results, stderr = run_engine(spec, timeout_s=3600, log_path=log)
    if keep_logs is not None:
        keep_logs.mkdir(parents=True, exist_ok=True)
        shutil.copy(log, keep_logs / log.name)
    request_ids = [m[0] for m in HIT_RE.findall(stderr)]  # one per request, in order (run_engine checked the count)
    blends = blend_lines(stderr)
    return ModeRun(
        first=results[1],
        measured=results[2:],
        blends=[blends[rid] for rid in request_ids[2:] if rid in blends],
        failed_loads=failed_loads(stderr),
    )


# --------------------------------------------------------------------------------------------------- summary
def _median(values: list[float], digits: int = 2) -> float:
    return round(statistics.median(values), digits)


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def mode_summary(run: ModeRun, full: ModeRun) -> dict[str, Any]:
    """One mode's figures (ratios and agreement against ``full``)."""
    ttfts = [r.ttft_ms for r in run.measured]
    row: dict[str, Any] = {
        "ttft_ms": _median(ttfts),
        "ttft_samples_ms": [round(x, 2) for x in ttfts],
        "ttft_first_ms": round(run.first.ttft_ms, 2),
        "hit_external_blocks": [r.hit_external for r in run.measured],
        "first_tokens": [r.token_ids[0] for r in run.measured],
        "answers": [r.text for r in run.measured],
        "failed_loads": run.failed_loads,
    }
    if run is not full:
        row["ratio_to_full"] = _median(
            [r.ttft_ms / f.ttft_ms for r, f in zip(run.measured, full.measured, strict=True)], 3
        )
        pairs = list(zip(run.measured, full.measured, strict=True))
        agree = [r.token_ids[0] == f.token_ids[0] for r, f in pairs]
        row["first_token_agreement"] = round(sum(agree) / len(agree), 3)
        row["first_token_logprob_diff"] = [
            round(abs(r.logprobs[0] - f.logprobs[0]), 4) if same else None
            for (r, f), same in zip(pairs, agree, strict=True)
        ]
        row["matching_prefix_tokens"] = [_common_prefix(r.token_ids, f.token_ids) for r, f in pairs]
    prefix_tokens = [r.hit_external * BLOCK_SIZE for r in run.measured]
    if run.blends:
        row.update(
            blended_prompts=len(run.blends),
            blended_tokens=[b.tokens for b in run.blends],
            reused_tokens=[b.reused for b in run.blends],
            recomputed_tokens=[b.recomputed for b in run.blends],
            computed_chunks=[b.computed_chunks for b in run.blends],
            blend_chunks_ms=_median([b.chunks_ms for b in run.blends], 1),
            blend_pass_ms=_median([b.pass_ms for b in run.blends], 1),
        )
        if len(run.blends) == len(run.measured):
            row["prompt_reused_tokens"] = [p + b.reused for p, b in zip(prefix_tokens, run.blends, strict=True)]
    elif run is not full:
        row["prompt_reused_tokens"] = prefix_tokens
    return row


# ----------------------------------------------------------------------------------------------- command line
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", choices=("smollm2", "tiny"), default="smollm2", help="SmolLM2-135M bf16, or the tiny Llama"
    )
    p.add_argument("--models-dir", default="models", help="where the models are (built there if missing)")
    p.add_argument("--chunks", type=int, default=4, help="documents per prompt")
    p.add_argument(
        "--chunk-tokens", type=int, default=512, help="tokens of each document (its chunk-end token follows)"
    )
    p.add_argument(
        "--ratios", default=str(TARGET_RATIO), help="Blend recompute ratios, comma-separated (an engine each)"
    )
    p.add_argument("--prompts", type=int, default=3, help="measured prompts (distinct orders of the documents)")
    p.add_argument("--seed", type=int, default=0, help="seed of the orders")
    p.add_argument(
        "--max-tokens", type=int, default=8, help="tokens generated per request (greedy; compared with full prefill's)"
    )
    p.add_argument(
        "--check-layer", default=CHECK_LAYER, help="compute_meta's attention layer (every token is computed up to it)"
    )
    p.add_argument(
        "--chunk-context",
        choices=get_args(ChunkContext),
        default="none",
        help="Blend's chunk_context; first_chunk also starts every prompt with a head (a system turn)",
    )
    p.add_argument(
        "--selection", choices=get_args(BlendSelection), default="deviation", help="Blend's selection of the tokens"
    )
    p.add_argument(
        "--question-layers",
        type=layer_range,
        default=None,
        help="Blend's question_layers FIRST:END (selection question; default: every layer after the first quarter)",
    )
    p.add_argument("--keep-logs", default=None, help="copy each engine process's stderr into this directory")
    p.add_argument("--out", default=None, help="also write the JSON summary to this file")
    args = p.parse_args(argv)
    if not BLEND_LAYER_RE.match(args.check_layer):
        p.error(
            f"--check-layer {args.check_layer!r}: not an attention layer name; allowed: model.layers.<i>.self_attn.attn"
        )
    bad_layers = question_layers_error(args.selection, args.question_layers)  # before full prefill's run
    if bad_layers is not None:
        p.error(f"--question-layers: {bad_layers}")
    if args.chunks < 2 or args.chunk_tokens < 1 or args.prompts < 1 or args.max_tokens < 1:
        p.error("need --chunks >= 2 and --chunk-tokens, --prompts, --max-tokens >= 1")
    try:
        args.ratio_list = [float(x) for x in args.ratios.split(",")]
    except ValueError:
        p.error(f"--ratios {args.ratios!r}: comma-separated numbers in [0, 1], e.g. 0.15,0.3")
    if not all(0 <= r <= 1 for r in args.ratio_list) or len(set(args.ratio_list)) != len(args.ratio_list):
        p.error(f"--ratios {args.ratios!r}: distinct numbers in [0, 1]")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    load_start = load_avg()
    from transformers import AutoTokenizer

    if args.model == "tiny":
        model, dtype = ensure_tiny_llama(args.models_dir, num_hidden_layers=4), "float32"
    else:
        model, dtype = ensure_smollm2(args.models_dir), "bfloat16"
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    chunk_end_ids = tokenizer.encode(CHUNK_END, add_special_tokens=False)
    if len(chunk_end_ids) != 1:
        raise SystemExit(f"{CHUNK_END!r} is {chunk_end_ids} for this tokenizer; the chunk-end must be one token")
    chunk_end_id = chunk_end_ids[0]
    chunks = build_chunks(tokenizer, args.chunks, args.chunk_tokens)
    chunk_tokens = [len(tokenizer.encode(c, add_special_tokens=False)) for c in chunks]
    orders = shuffles(args.chunks, args.prompts, args.seed)
    in_order = tuple(range(args.chunks))
    head = HEAD if args.chunk_context == "first_chunk" else ""
    prompts = [prompt_of(chunks, order, head) for order in (in_order, *orders)]
    longest = max(len(tokenizer.encode(p)) for p in prompts)
    if longest + args.max_tokens > MAX_MODEL_LEN:
        raise SystemExit(f"the prompts have up to {longest} tokens; with --max-tokens they must fit {MAX_MODEL_LEN}")
    base = {
        "model": str(model),
        "dtype": dtype,
        "max_model_len": MAX_MODEL_LEN,
        "enable_prefix_caching": True,
        "engine_args": {"block_size": BLOCK_SIZE},
        "reset_prefix_cache": True,  # before every request: vLLM's own cache never serves one
        "requests": [{"prompt": p, "max_tokens": args.max_tokens} for p in [WARMUP_PROMPT, *prompts]],
    }
    keep_logs = Path(args.keep_logs) if args.keep_logs else None
    with tempfile.TemporaryDirectory(prefix="ucm-blend-") as tmp_name:
        tmp = Path(tmp_name)
        modes: list[tuple[str, str, float | None]] = [("full", "kv_consumer", None), ("prefix_only", "kv_both", None)]
        modes += [(f"blend_{r:g}", "kv_both", r) for r in args.ratio_list]
        turns_dir = tmp / "turns"
        turns_dir.mkdir()
        turns = TakeTurns(turns_dir, len(modes), len(base["requests"]))

        def engine(index: int, name: str, role: str, ratio: float | None) -> ModeRun:
            store = tmp / f"store-{name}"
            store.mkdir()
            config = ucm_config(
                store, chunk_end_id, ratio, args.check_layer, args.chunk_context, args.selection, args.question_layers
            )
            before = [turns.before_cmd(index, i) for i in range(len(base["requests"]))]
            try:
                return run_mode(name, base, config, role, tmp, keep_logs, before)
            except BaseException:
                turns.failed = True
                raise
            finally:
                turns.exited[index] = True

        # Every engine at once, serving its requests in turns (TakeTurns): each measured prompt runs in every mode
        # moments apart, so the ratios to full prefill pair requests run under the same machine conditions.
        with concurrent.futures.ThreadPoolExecutor(len(modes) + 1) as pool:
            granting = pool.submit(turns.run)
            futures = {name: pool.submit(engine, k, name, role, ratio) for k, (name, role, ratio) in enumerate(modes)}
            runs = {name: f.result() for name, f in futures.items()}
            granting.result()
    full = runs["full"]
    blend = {f"{r:g}": mode_summary(runs[f"blend_{r:g}"], full) for r in args.ratio_list}
    target = blend.get(f"{TARGET_RATIO:g}")
    summary = {
        "benchmark": "blend",
        "date": utc_now(),
        "command": " ".join(["benchmarks/blend.py", *argv]),
        "machine": machine_info(load_start),
        "versions": versions(),
        "model": str(model),
        "dtype": dtype,
        "block_size": BLOCK_SIZE,
        "store_pipeline": STORE_PIPELINE,
        "chunk_end": {"text": CHUNK_END, "token_id": chunk_end_id},
        "check_layer": args.check_layer,
        "chunk_context": args.chunk_context,
        "selection": args.selection,
        "question_layers": args.question_layers,
        "head_tokens": len(tokenizer.encode(head, add_special_tokens=False)) if head else 0,
        "chunks": args.chunks,
        "chunk_tokens": chunk_tokens,
        "prompts": args.prompts,
        "orders": [list(o) for o in orders],
        "prompt_tokens": [r.num_prompt_tokens for r in full.measured],
        "max_tokens": args.max_tokens,
        "full_prefill": "UCMConnector kv_consumer on an empty store, no Blend",
        "full": mode_summary(full, full),
        "prefix_only": mode_summary(runs["prefix_only"], full),
        "blend": blend,
        "target": f"blend ttft <= {TARGET_TTFT}x full prefill at ratio {TARGET_RATIO}",
        "meets_target": None if target is None else target["ratio_to_full"] <= TARGET_TTFT,
    }
    return emit_summary(summary, args.out)


if __name__ == "__main__":
    sys.exit(main())
