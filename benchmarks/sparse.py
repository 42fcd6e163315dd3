"""GSA sparse decode attention: retrieval accuracy vs kept fraction (real model, real engine) and decode time.

Run::

    PYTHONPATH=. .venv/bin/python benchmarks/sparse.py [--models-dir models] [--lengths 2048 6144]
        [--depths 0.25 0.5 0.75] [--fractions 0.7 0.5 0.3 0.1] [--block-scoring sparq [key_bounds ...]]
        [--block-size 128] [--isas auto [vec amx]]
        [--skip-engine] [--out results.json]

Parts (the last line printed is a JSON object with every number):

1. ``accuracy``: passkey retrieval with SmolLM2-135M-Instruct (bf16) through the real vLLM engine (CPU build) with
   UCMConnector (``kv_consumer`` on an empty store: no loads, no dumps) and its attention plugin. Each prompt is real
   text (``ucm.testing.texts``) of ``--lengths`` tokens with one sentence "The secret passkey is NNNNN." inserted at
   a relative depth of ``--depths``, ending with a question and "The secret passkey is"; greedy, 8 tokens. A prompt
   passes when the first 5-digit run of the answer is the passkey. One engine per configuration: dense (plugin
   loaded, no ``ucm_sparse_config``) and GSA for each ``--block-scoring`` at each kept fraction (configuration
   ``<block_scoring>_<sparse_ratio>``; ``init_window_sz`` 1, ``local_window_sz`` 2, ``min_blocks`` 4, vLLM block size
   ``--block-size``, default 128 as in vLLM's CPU backend). Reported per configuration and length:
   passed / prompts, and ``same_as_dense``: answers token-identical to dense. Caveat: the first answer token comes
   from the (dense) prefill; GSA decides the others (SmolLM2 writes one digit per token, so 4 of the 5 digits).
2. ``decode_ms_per_token`` (same engines): the longest prompt again (a vLLM prefix-cache hit, so its prefill is
   short) with 32 output tokens; ``(wall - TTFT) / 31``: whole decode steps (all 30 layers, MLP included).
3. ``attention_kernel``: in-process, one layer of SmolLM2's attention shape (9 query heads, 3 KV heads, head dim 64,
   bf16, ``--block-size``) at ``--kernel-contexts`` tokens, one decode query: vLLM's CPU attention kernel on the dense
   block table vs GSA's selection (``select_ms``: scoring, top-k, metadata) plus the kernel on the kept blocks
   (``attend_ms``), for each ``--block-scoring`` and kept fraction. Median of ``--repeats`` interleaved rounds (every
   variant once per round, so the scorings are compared under the same load), ``--kernel-threads`` threads (default
   1), the request's blocks at ``--block-table`` ids (``shuffled``: scattered over the cache, the default;
   ``ascending``: in order, as a fresh engine allocates them). Shows how the attention itself scales with the
   fraction read, and what each scoring costs. ``--impls`` selects GSA's kernel implementations (``auto``: what
   the engine runs; ``cpu``/``torch``: the two CPU paths of the ``sparq`` scoring, ``cpu`` its numba kernels); with
   more than one, each variant is named ``<scoring>_<fraction>@<impl>``. ``--isas`` picks vLLM's CPU attention
   kernel variants, each with its own cache layout holding the same keys (``auto``: the one vLLM picks for bf16 here,
   ``amx`` on CPUs with AMX tiles, where GSA reads the keys in ``KVLayout.CPU_ATTN_AMX``; ``vec``:
   ``KVLayout.CPU_ATTN``); with more than one, names end in ``/<isa>``.

Timings come from a shared 2-core machine: compare ratios within one run, not absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import emit_summary, machine_info, utc_now  # noqa: E402
from ucm.testing.engine import run_engine, ucm_transfer_config  # noqa: E402
from ucm.testing.plugin import plugin_env  # noqa: E402
from ucm.testing.texts import real_text  # noqa: E402

ANSWER_TOKENS = 8
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB: ~45 K tokens of SmolLM2 KV, enough for these prompts
TIMING_TOKENS = 32
QUESTION = "\n\nQuestion: What is the secret passkey mentioned in the text above?\nAnswer: The secret passkey is"


def passkey_prompt(tokenizer: Any, n_tokens: int, depth: float, key: str) -> str:
    """Real text of about ``n_tokens`` tokens with the passkey sentence at relative ``depth``, then the question."""
    needle = f" The secret passkey is {key}. Remember it: the secret passkey is {key}. "
    budget = n_tokens - len(tokenizer.encode(needle + QUESTION, add_special_tokens=False))
    ids = tokenizer.encode(real_text(8 * n_tokens), add_special_tokens=False)[:budget]
    cut = int(len(ids) * depth)
    return tokenizer.decode(ids[:cut]) + needle + tokenizer.decode(ids[cut:]) + QUESTION


def _answer_key(text: str) -> str | None:
    m = re.search(r"\d{5}", text.replace(" ", ""))
    return m.group(0) if m else None


def run_accuracy(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from ucm.testing.models import ensure_smollm2

    model = ensure_smollm2(Path(args.models_dir))
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    rng = random.Random(0)
    cases = [
        {"length": n, "depth": d, "key": str(rng.randrange(10000, 100000))} for n in args.lengths for d in args.depths
    ]
    prompts = [passkey_prompt(tokenizer, c["length"], c["depth"], c["key"]) for c in cases]
    longest = prompts[max(range(len(cases)), key=lambda i: cases[i]["length"])]
    requests = [{"prompt": p, "max_tokens": ANSWER_TOKENS} for p in prompts]
    requests.append({"prompt": longest, "max_tokens": TIMING_TOKENS})  # prefix-cache hit: decode timing
    configs: list[tuple[str, dict[str, Any] | None]] = [] if args.no_dense else [("dense", None)]
    configs += [
        (f"{scoring}_{f}", {"GSA": {"sparse_ratio": f, "block_scoring": scoring}})
        for scoring in args.block_scoring
        for f in args.fractions
    ]
    out: dict[str, Any] = {"cases": cases, "configs": {}}
    dense_tokens: list[list[int]] = []
    for name, sparse in configs:
        with tempfile.TemporaryDirectory(prefix="ucm_sparse_bench_") as store:
            extra: dict[str, Any] = {
                "ucm_connectors": [
                    {
                        "ucm_connector_name": "UcmPipelineStore",
                        "ucm_connector_config": {"store_pipeline": "Posix", "storage_backends": store},
                    }
                ]
            }
            if sparse is not None:
                extra["ucm_sparse_config"] = sparse
            spec = {
                "model": str(model),
                "dtype": "bfloat16",
                "max_model_len": 8192,
                "enable_prefix_caching": True,
                "engine_args": {"block_size": args.block_size},
                "connector": ucm_transfer_config(extra, kv_role="kv_consumer"),
                "requests": requests,
                "engine_core_process": True,  # vLLM's own layout: decode times as a deployment sees them
            }
            t0 = time.perf_counter()
            try:
                results, stderr = run_engine(spec, env={**ENGINE_ENV, **plugin_env()}, timeout_s=3600)
            except RuntimeError as err:  # e.g. the OOM killer on a shared machine: record it, go on
                out["configs"][name] = {"error": str(err)[-800:]}
                print(name, "engine failed", str(err)[-300:], flush=True)
                continue
            elapsed = time.perf_counter() - t0
        answers = results[: len(cases)]
        if name == "dense":
            dense_tokens = [r.token_ids for r in answers]
        if not dense_tokens:
            dense_tokens = [[] for _ in answers]  # dense failed: same_as_dense counts nothing
        kept = re.findall(r"first decode selection kept (\d+) of (\d+) blocks", stderr)
        per_length: dict[str, dict[str, int]] = {}
        for c, r, dt in zip(cases, answers, dense_tokens, strict=True):
            row = per_length.setdefault(str(c["length"]), {"passed": 0, "prompts": 0, "same_as_dense": 0})
            row["prompts"] += 1
            row["passed"] += int(_answer_key(r.text) == c["key"])
            row["same_as_dense"] += int(r.token_ids == dt)
        timing = results[-1]
        out["configs"][name] = {
            "sparse_ratio": 1.0 if sparse is None else sparse["GSA"]["sparse_ratio"],
            "per_length": per_length,
            "passed": sum(v["passed"] for v in per_length.values()),
            "prompts": len(cases),
            "answers": [r.text for r in answers],
            "first_selection_kept_of": [int(x) for x in kept[0]] if kept else None,
            "decode_ms_per_token": (timing.wall_ms - timing.ttft_ms) / (len(timing.token_ids) - 1),
            "timing_prompt_tokens": timing.num_prompt_tokens,
            "engine_s": round(elapsed, 1),
        }
        print(name, json.dumps({k: v for k, v in out["configs"][name].items() if k != "answers"}), flush=True)
    return out


def kernel_isas(requested: list[str], block_size: int) -> list[str]:
    """The CPU attention kernel variants of the kernel part: ``auto`` is the one vLLM picks here for bf16 (``amx`` on
    a CPU with AMX tiles and 32-multiple blocks, else ``vec``/``vec16``); duplicates dropped, order kept.

    Raises:
        ValueError: ``amx`` without AMX tiles, or ``amx``/``vec`` with a block size not a multiple of 32.
    """
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    out: list[str] = []
    for isa in requested:
        if isa == "auto":
            isa = _get_attn_isa(torch.bfloat16, block_size, 64)
        elif block_size % 32:
            raise ValueError(f"--isas {isa} needs --block-size a multiple of 32, got {block_size}")
        elif isa == "amx" and not torch.cpu._is_amx_tile_supported():
            raise ValueError("--isas amx needs a CPU with AMX tiles (vLLM's amx attention kernel uses them)")
        if isa not in out:
            out.append(isa)
    if "amx" in out:
        # Linux lets a process use AMX tiles only after it asks (arch_prctl); vLLM's engine gets that through its
        # bf16 matmuls (oneDNN asks), this kernel-only benchmark asks here, else the kernel dies of SIGILL.
        torch.cpu._init_amx()
    return out


def run_kernel(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

    from ucm.config import GSAConfig
    from ucm.integration.vllm.sparse_backend import layout_of_isa, sparse_cpu_metadata
    from ucm.kernels.layouts import cpu_attn_kv_views
    from ucm.sparse import GSA

    # One thread: on a shared machine, OpenMP workers spin-waiting for busy cores make multi-thread timings noise.
    torch.set_num_threads(args.kernel_threads)
    heads, kv_heads, dim, bs, dtype = 9, 3, 64, args.block_size, torch.bfloat16
    scale = dim**-0.5
    isas = kernel_isas(args.isas, bs)
    out: dict[str, Any] = {"threads": torch.get_num_threads(), "isa": isas[0] if len(isas) == 1 else isas}
    out["contexts"] = {}
    for ctx in args.kernel_contexts:
        nb = math.ceil(ctx / bs)
        g = torch.Generator().manual_seed(0)
        k_canonical = torch.randn((nb, bs, kv_heads, dim), generator=g).to(dtype)  # the same keys for every isa
        v_canonical = torch.randn((nb, bs, kv_heads, dim), generator=g).to(dtype)
        query = torch.randn((1, heads, dim), generator=g).to(dtype)
        qsl = torch.tensor([0, 1], dtype=torch.int32)
        seq_lens = torch.tensor([ctx], dtype=torch.int32)
        ids = torch.randperm(nb, generator=g) if args.block_table == "shuffled" else torch.arange(nb)
        table = ids.to(torch.int32)[None]
        # Every variant once per round, rounds repeated: load changes on a shared machine hit all variants alike.
        variants: dict[str, Any] = {}
        row: dict[str, Any] = {"blocks": nb}
        configs: list[tuple[str, str]] = []  # (variant name, its isa's suffix)
        for isa in isas:
            suffix = f"/{isa}" if len(isas) > 1 else ""
            kv_cache = torch.empty((nb, kv_heads, bs, 2 * dim), dtype=dtype)
            k_view, v_view = cpu_attn_kv_views(kv_cache, layout_of_isa(isa))
            k_view.copy_(k_canonical.view(nb, *k_view.shape[1:]))
            v_view.copy_(v_canonical.view(nb, *v_view.shape[1:]))
            key_cache, value_cache = kv_cache.view(nb, kv_heads, 2 * bs, dim).chunk(2, dim=2)

            def sched(lens: torch.Tensor, qsl: torch.Tensor = qsl, isa: str = isa) -> torch.Tensor:
                return ops.cpu_attn_get_scheduler_metadata(
                    num_reqs=1,
                    num_heads=heads,
                    num_kv_heads=kv_heads,
                    head_dim=dim,
                    seq_lens=lens,
                    dtype=dtype,
                    query_start_loc=qsl,
                    causal=True,
                    sliding_window_size=-1,
                    isa=isa,
                    enable_kv_split=False,
                )

            md = CPUAttentionMetadata(
                num_actual_tokens=1,
                max_query_len=1,
                query_start_loc=qsl,
                max_seq_len=ctx,
                seq_lens=seq_lens,
                block_table=table,
                slot_mapping=torch.tensor([-1]),
                scheduler_metadata=sched(seq_lens),
            )

            def attend(m: CPUAttentionMetadata, query=query, key_cache=key_cache, value_cache=value_cache) -> None:
                o = torch.empty_like(query)
                ops.cpu_attention_with_kv_cache(
                    query=query,
                    key_cache=key_cache,
                    value_cache=value_cache,
                    output=o,
                    query_start_loc=m.query_start_loc,
                    seq_lens=m.seq_lens,
                    scale=scale,
                    causal=True,
                    alibi_slopes=None,
                    sliding_window=-1,
                    block_table=m.block_table,
                    softcap=0,
                    scheduler_metadata=m.scheduler_metadata,
                    s_aux=None,
                )

            variants[f"dense_attend{suffix}"] = lambda md=md, attend=attend: attend(md)
            tag = len(args.impls) > 1
            for scoring in args.block_scoring:
                for f in args.fractions:
                    for impl in args.impls:
                        name = f"{scoring}_{f}" + (f"@{impl}" if tag else "") + suffix
                        method = GSA(GSAConfig(sparse_ratio=f, block_scoring=scoring), impl=impl)
                        summaries = method.new_summaries(nb, kv_heads, dim, kv_cache.device)

                        def select(method=method, summaries=summaries, md=md, query=query, kv_cache=kv_cache, isa=isa):
                            return sparse_cpu_metadata(
                                method, summaries, md, query, kv_cache, isa=isa, num_heads=heads, scale=scale
                            )

                        sparse_md = select()  # computes every block's summary once (what decode amortizes)
                        row[name] = {"kept_blocks": math.ceil(int(sparse_md.seq_lens[0]) / bs)}
                        variants[f"{name}.select"] = select
                        variants[f"{name}.attend"] = lambda m=sparse_md, attend=attend: attend(m)
                        configs.append((name, suffix))
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.repeats + 1):
            for name, fn in variants.items():
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) * 1e3)
        med = {name: statistics.median(t[1:]) for name, t in times.items()}  # round 0 is a warm-up
        for isa in isas:
            suffix = f"/{isa}" if len(isas) > 1 else ""
            row[f"dense_attend_ms{suffix}"] = med[f"dense_attend{suffix}"]
        for name, _suffix in configs:
            row[name]["select_ms"] = med[f"{name}.select"]
            row[name]["attend_ms"] = med[f"{name}.attend"]
        out["contexts"][str(ctx)] = row
        print("kernel", ctx, json.dumps(row), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models-dir", default=str(REPO / "models"))
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 6144])
    parser.add_argument("--depths", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.7, 0.5, 0.3, 0.1])
    parser.add_argument("--block-scoring", nargs="+", default=["sparq"], choices=["key_bounds", "attention", "sparq"])
    parser.add_argument("--block-size", type=int, default=128, help="vLLM KV block size, a multiple of 32 on CPU")
    parser.add_argument("--no-dense", action="store_true", help="skip the dense engine (same_as_dense then 0)")
    parser.add_argument("--kernel-contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--kernel-threads", type=int, default=1)
    parser.add_argument(
        "--block-table",
        default="shuffled",
        choices=["shuffled", "ascending"],
        help="the request's block ids in the kernel part: a random permutation, or 0..n-1 (a fresh engine's)",
    )
    parser.add_argument(
        "--impls",
        nargs="+",
        default=["auto"],
        choices=["auto", "cpu", "torch"],
        help="GSA kernel implementations compared in the kernel part (cpu: the numba paths; sparq scoring only)",
    )
    parser.add_argument(
        "--isas",
        nargs="+",
        default=["auto"],
        choices=["auto", "vec", "amx"],
        help="vLLM CPU attention kernel variants (and so KV layouts) of the kernel part: auto is vLLM's pick for bf16 "
        "here (amx with AMX tiles: keys in CPU_ATTN_AMX; else vec: CPU_ATTN); with more than one, each variant is "
        "named <scoring>_<fraction>[@<impl>]/<isa>",
    )
    parser.add_argument("--skip-engine", action="store_true", help="only the in-process attention kernel part")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import torch
    import vllm

    result: dict[str, Any] = {
        "benchmark": "sparse",
        "date": utc_now(),
        "machine": {**machine_info(), "cpus": os.cpu_count()},
        "versions": {"torch": torch.__version__, "vllm": vllm.__version__},
        "block_scoring": args.block_scoring,
        "block_size": args.block_size,
        "block_table": args.block_table,
        "impls": args.impls,
        "attention_kernel": run_kernel(args),
    }
    if not args.skip_engine:
        result["accuracy"] = run_accuracy(args)
    raise SystemExit(emit_summary(result, args.out))


if __name__ == "__main__":
    main()
