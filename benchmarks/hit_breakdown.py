"""Where a hit's TTFT goes: UCM's DRAM and storage hits and cold requests, phase by phase, next to vLLM's own.

Run::

    .venv/bin/python benchmarks/hit_breakdown.py [--prompt-tokens 2000] [--repeats 8] [--out breakdown.json]

Two engine processes run one after the other on SmolLM2-135M-Instruct (or ``--model``), ``--rounds`` times (2 by
default) in alternating order, each round UCM's on a fresh store; each process the real vLLM engine
(CPU build) with the engine core and the model worker in the process that runs the requests
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, vLLM's one-process ``uni`` executor), so that every phase can be timed in
one thread:

- without a connector, vLLM's prefix caching on: ``cold_first`` (the engine's first request, a prompt of
  ``--prompt-tokens`` real-text tokens), ``cold`` (``--repeats`` further new prompts of that length), then
  ``inmemory_hit`` (the first prompt again, ``--repeats`` times: vLLM's own prefix-cache hit);
- with UCMConnector (``Cache|Posix`` on a fresh store directory), vLLM's prefix caching off so that every hit is
  UCM's: the same ``cold_first`` and ``cold`` prompts (UCM looks up, misses and dumps), ``dram_hit`` (the first
  prompt again), and ``storage_hit``: before each, ``reset_prefix_cache(reset_connector=True)`` empties UCM's DRAM
  tier (the store directory is kept) and ``posix_fadvise(DONTNEED)`` drops the block files from the page cache.

Every request asks for one token and runs alone, so all that the engine does between its arrival and its first
token is that request's. Phases (ms, exclusive: a phase's time excludes the timed phases it calls, so they add up):

- ``vllm_schedule`` / ``vllm_update``: vLLM's ``Scheduler.schedule`` / ``update_from_output``;
- ``forward``: the executor's ``execute_model`` (the model's forward pass; UCM's worker hooks, which vLLM calls
  inside it, are taken out), ``sample``: ``sample_tokens``;
- ``ucm_key_hashing`` and ``ucm_lookup``: the scheduler side's block keys and store lookup; ``ucm_scheduler_other``:
  the rest of the scheduler-side connector calls (``get_num_new_matched_tokens``, ``update_state_after_alloc``,
  ``build_connector_meta``, ``update_connector_output``, ``request_finished``);
- ``ucm_load``: the worker's ``start_load_kv`` / ``wait_for_layer_load`` without the scatter: the wait for the
  store (the tiers' own times are ``store_ms``), ``ucm_scatter``: copying loaded blocks into the paged KV;
- ``ucm_gather`` (the dump's gather out of the paged KV) and ``ucm_dump`` (the rest of ``wait_for_save`` /
  ``save_kv_layer``: handing the blocks to the store); ``ucm_worker_other``: the worker's other connector calls;
- ``other``: TTFT minus all of the above: the engine loop, input and output processing, waits between steps.

``steps`` counts the forward passes of the request; ``store_ms`` gives the loads' time per tier from UCM's own
observations (they overlap ``ucm_load``, so they are not added). Per condition: the medians over its requests.
``ucm_ms``: the sum of the ``ucm_*`` phases; ``beside_forward_ms``: TTFT minus ``forward``.
``extra_over_inmemory_ms``: each hit's phase medians minus the in-memory hit's; ``cold_extra_ms``: UCM's cold
phases minus those without UCM. Ratios: ``dram_over_inmemory``, ``storage_over_inmemory``, ``cold_overhead``
(``cold`` with over without UCM) and ``cold_first_overhead`` (one request per round: noisy). The two engines are two
processes, run one after the other (alternating which goes first, round by round): the same forward pass may differ
between them by more than UCM's share (a shared machine), so two ratios hold that out:
``*_over_inmemory_same_forward`` (the hit's TTFT with its forward pass as long as the in-memory hit's: its
``beside_forward_ms`` plus the in-memory hit's ``forward``, over the in-memory hit's TTFT) and ``cold_ucm_share`` /
``cold_first_ucm_share`` (UCM's phases of a cold request over the TTFT of the same cold request without UCM).

Exit status 1 (``problems`` lists them) when a request was not what its condition says (UCM's load observations
show a DRAM hit reading storage, a storage hit not reading it, or a cold prompt loading anything).

Numbers are from one machine and one run; compare ratios from the same run only.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import emit_summary, fadvise_dontneed, load_avg, machine_info, utc_now, versions  # noqa: E402

PHASES = (
    "vllm_schedule", "vllm_update", "forward", "sample", "ucm_key_hashing", "ucm_lookup", "ucm_scheduler_other",
    "ucm_load", "ucm_scatter", "ucm_gather", "ucm_dump", "ucm_worker_other", "other",
)  # fmt: skip
_RESULT_PREFIX = "HIT_BREAKDOWN_RESULT "


# ----------------------------------------------------------------------------------------- in the engine process
class PhaseTimer:
    """Exclusive wall time per phase of functions wrapped by :meth:`wrap`, on the main thread only (calls from
    other threads run untimed); calls nest, and a caller's time excludes its timed callees'."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}
        self.calls: Counter[str] = Counter()
        self._stack: list[float] = []  # per open call: its timed callees' seconds

    def reset(self) -> None:
        self.ms.clear()
        self.calls.clear()

    def wrap(self, owner: Any, attr: str, phase: str) -> None:
        fn: Callable[..., Any] = getattr(owner, attr)
        timer = self

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is not threading.main_thread():
                return fn(*args, **kwargs)
            timer._stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                callees = timer._stack.pop()
                timer.ms[phase] = timer.ms.get(phase, 0.0) + (dt - callees) * 1e3
                timer.calls[phase] += 1
                if timer._stack:
                    timer._stack[-1] += dt

        setattr(owner, attr, timed)


def install(timer: PhaseTimer, store_ms: Counter[str]) -> None:
    """Wrap vLLM's and UCM's functions (before the engine is built); UCM's load observations go to ``store_ms``."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    import ucm.integration.vllm.worker as worker_mod
    from ucm.integration.vllm.scheduler import UCMScheduler
    from ucm.integration.vllm.ucm_connector import UCMConnector

    timer.wrap(Scheduler, "schedule", "vllm_schedule")
    timer.wrap(Scheduler, "update_from_output", "vllm_update")
    timer.wrap(UniProcExecutor, "execute_model", "forward")
    timer.wrap(UniProcExecutor, "sample_tokens", "sample")
    timer.wrap(UCMScheduler, "_keys", "ucm_key_hashing")
    timer.wrap(UCMScheduler, "_lookup", "ucm_lookup")
    for name in (
        "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "update_connector_output",
        "request_finished",
    ):  # fmt: skip
        timer.wrap(UCMConnector, name, "ucm_scheduler_other")
    for name in ("start_load_kv", "wait_for_layer_load"):
        timer.wrap(UCMConnector, name, "ucm_load")
    for name in ("wait_for_save", "save_kv_layer"):
        timer.wrap(UCMConnector, name, "ucm_dump")
    for name in (
        "bind_connector_metadata", "clear_connector_metadata", "get_finished", "get_block_ids_with_load_errors",
        "build_connector_worker_meta",
    ):  # fmt: skip
        if hasattr(UCMConnector, name):
            timer.wrap(UCMConnector, name, "ucm_worker_other")
    for name in ("scatter_blocks", "scatter_layers"):
        timer.wrap(worker_mod, name, "ucm_scatter")
    timer.wrap(worker_mod, "gather_blocks", "ucm_gather")

    init = UCMConnector.__init__

    def observed_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)

        def sink(obs: Any) -> None:
            if obs.op == "load":
                store_ms[obs.tier] += obs.seconds * 1e3

        self._obs.recorder.add_sink(sink)

    UCMConnector.__init__ = observed_init  # type: ignore[method-assign]


def child(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Run ``spec``'s requests in this process; per request its condition, TTFT, phases, steps and store times."""
    timer, store_ms = PhaseTimer(), Counter[str]()
    install(timer, store_ms)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {}
    if spec["connector"]:
        kwargs["kv_transfer_config"] = spec["connector"]
    llm = LLM(
        model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"], enforce_eager=True,
        enable_prefix_caching=spec["connector"] is None, disable_log_stats=False, seed=0, **kwargs,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=1)
    out = []
    for req in spec["requests"]:
        if req.get("storage"):
            llm.reset_prefix_cache(reset_connector=True)
            llm.generate(
                [TokensPrompt(prompt_token_ids=[1, 2, 3])], params, use_tqdm=False
            )  # the workers apply the reset
            fadvise_dontneed(Path(spec["store"]))
        timer.reset()
        store_ms.clear()
        t0 = time.perf_counter()
        (result,) = llm.generate([TokensPrompt(prompt_token_ids=req["ids"])], params, use_tqdm=False)
        wall_ms = (time.perf_counter() - t0) * 1e3
        ttft = getattr(result.metrics, "first_token_latency", 0.0) if result.metrics else 0.0
        ttft_ms = ttft * 1e3 if ttft > 0 else wall_ms
        phases = {p: round(timer.ms.get(p, 0.0), 3) for p in PHASES if p != "other"}
        phases["other"] = round(ttft_ms - sum(phases.values()), 3)
        out.append({
            "condition": req["condition"], "ttft_ms": round(ttft_ms, 3), "phases_ms": phases,
            "steps": timer.calls.get("forward", 0), "store_ms": {k: round(v, 3) for k, v in store_ms.items()},
        })  # fmt: skip
    return out


# ------------------------------------------------------------------------------------------------------ parent
def prompts(model: Path, tokens: int, count: int) -> list[list[int]]:
    """``count`` prompts of ``tokens`` token ids each: distinct cuts of real text."""
    from transformers import AutoTokenizer

    from ucm.testing.texts import real_text

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    ids = tokenizer.encode(real_text(min_chars=tokens * 6 * count), add_special_tokens=False, verbose=False)
    if len(ids) < tokens * count:
        raise ValueError(f"the real text on this machine has {len(ids)} tokens, fewer than {tokens} x {count}")
    return [ids[i * tokens : (i + 1) * tokens] for i in range(count)]


def engine_orders(rounds: int) -> list[tuple[str, str]]:
    """The order of the two engines in each of ``rounds`` rounds: without UCM first in even rounds, with UCM first
    in odd ones, so that neither always runs second (on these machines the later of two processes has run faster
    or slower by more than UCM's share)."""
    return [("without", "with") if r % 2 == 0 else ("with", "without") for r in range(rounds)]


def run_child(spec: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
    from ucm.testing.engine import engine_env

    env = engine_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    proc = subprocess.run(
        [sys.executable, __file__, "--child"], input=json.dumps(spec), capture_output=True, text=True, env=env,
        timeout=timeout_s,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"engine process failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1][len(_RESULT_PREFIX) :])


def condition_medians(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-field medians of one condition's requests."""
    tiers = sorted({t for r in records for t in r["store_ms"]})
    return {
        "n": len(records),
        "ttft_ms": round(statistics.median(r["ttft_ms"] for r in records), 2),
        "phases_ms": {p: round(statistics.median(r["phases_ms"][p] for r in records), 2) for p in PHASES},
        "steps": statistics.median(r["steps"] for r in records),
        # UCM's own phases, and everything but the forward pass (both per request, then the median)
        "ucm_ms": round(
            statistics.median(sum(v for p, v in r["phases_ms"].items() if p.startswith("ucm_")) for r in records), 2
        ),
        "beside_forward_ms": round(statistics.median(r["ttft_ms"] - r["phases_ms"]["forward"] for r in records), 2),
        "store_ms": {t: round(statistics.median(r["store_ms"].get(t, 0.0) for r in records), 2) for t in tiers},
    }


def summarize(without: list[dict[str, Any]], with_ucm: list[dict[str, Any]]) -> dict[str, Any]:
    conditions: dict[str, Any] = {}
    for label, records in (("without_ucm", without), ("with_ucm", with_ucm)):
        for cond in dict.fromkeys(r["condition"] for r in records):
            name = cond if cond.endswith("hit") else f"{cond}_{label}"
            conditions[name] = condition_medians([r for r in records if r["condition"] == cond])
    base = conditions["inmemory_hit"]

    def minus(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
        return {p: round(a["phases_ms"][p] - b["phases_ms"][p], 2) for p in PHASES}

    def ratio(a: str, b: str) -> float:
        return round(conditions[a]["ttft_ms"] / conditions[b]["ttft_ms"], 3)

    def same_forward(a: str) -> float:  # a's TTFT had its forward pass taken as long as the in-memory hit's
        return round((base["phases_ms"]["forward"] + conditions[a]["beside_forward_ms"]) / base["ttft_ms"], 3)

    def ucm_share(a: str, b: str) -> float:  # UCM's phases in a over b's TTFT
        return round(conditions[a]["ucm_ms"] / conditions[b]["ttft_ms"], 4)

    return {
        "conditions": conditions,
        "extra_over_inmemory_ms": {c: minus(conditions[c], base) for c in ("dram_hit", "storage_hit")},
        "cold_extra_ms": minus(conditions["cold_with_ucm"], conditions["cold_without_ucm"]),
        "ratios": {
            "dram_over_inmemory": ratio("dram_hit", "inmemory_hit"),
            "storage_over_inmemory": ratio("storage_hit", "inmemory_hit"),
            "cold_overhead": ratio("cold_with_ucm", "cold_without_ucm"),
            "cold_first_overhead": ratio("cold_first_with_ucm", "cold_first_without_ucm"),
            "dram_over_inmemory_same_forward": same_forward("dram_hit"),
            "storage_over_inmemory_same_forward": same_forward("storage_hit"),
            "cold_ucm_share": ucm_share("cold_with_ucm", "cold_without_ucm"),
            "cold_first_ucm_share": ucm_share("cold_first_with_ucm", "cold_first_without_ucm"),
        },
    }


def check_hits(with_ucm: list[dict[str, Any]]) -> list[str]:
    """Requests that were not what their condition says, from UCM's load observations: a DRAM hit that read
    storage or loaded nothing, a storage hit that did not read storage, a cold request that loaded anything."""
    problems = []
    for i, r in enumerate(with_ucm):
        tiers, cond = r["store_ms"], r["condition"]
        if cond == "dram_hit" and (not tiers or tiers.get("storage", 0.0) > 0):
            problems.append(f"request {i} ({cond}): store tiers {tiers}, not a DRAM-only load")
        if cond == "storage_hit" and not tiers.get("storage", 0.0) > 0:
            problems.append(f"request {i} ({cond}): store tiers {tiers}, storage not read")
        if cond.startswith("cold") and tiers:
            problems.append(f"request {i} ({cond}): store tiers {tiers}, loaded on a cold prompt")
    return problems


def print_table(summary: dict[str, Any]) -> None:
    conds = summary["conditions"]
    names = list(conds)
    print(f"{'phase (ms, median)':<22}" + "".join(f"{n[:20]:>21}" for n in names), file=sys.stderr)
    for p in (*PHASES, "ucm_ms", "beside_forward_ms", "ttft_ms", "steps"):
        vals = [conds[n]["phases_ms"][p] if p in PHASES else conds[n][p] for n in names]
        print(f"{p:<22}" + "".join(f"{v:>21.2f}" for v in vals), file=sys.stderr)
    print(json.dumps(summary["ratios"]), file=sys.stderr)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory; None: SmolLM2 in --models-dir")
    p.add_argument("--models-dir", default="models")
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=8, help="requests per condition and round (cold_first: one)")
    p.add_argument("--rounds", type=int, default=2, help="engine pairs, in alternating order (see engine_orders)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per engine process")
    p.add_argument("--out", default=None, help="also write the JSON summary here")
    args = p.parse_args(argv)
    if min(args.repeats, args.prompt_tokens, args.rounds) < 1:
        p.error(f"--repeats {args.repeats} / --prompt-tokens {args.prompt_tokens} / --rounds {args.rounds}: at least 1")
    if args.prompt_tokens >= args.max_model_len:
        p.error(f"--prompt-tokens {args.prompt_tokens} must be below --max-model-len {args.max_model_len}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from ucm.testing.engine import ucm_transfer_config
    from ucm.testing.models import ensure_smollm2

    load_start = load_avg()
    model = Path(args.model) if args.model else ensure_smollm2(Path(args.models_dir))
    first, *others = prompts(model, args.prompt_tokens, 1 + args.repeats)
    cold = [{"condition": "cold_first", "ids": first}] + [{"condition": "cold", "ids": ids} for ids in others]
    common = {"model": str(model), "dtype": args.dtype, "max_model_len": args.max_model_len}
    without: list[dict[str, Any]] = []
    with_ucm: list[dict[str, Any]] = []
    for r, order in enumerate(engine_orders(args.rounds)):
        with tempfile.TemporaryDirectory(prefix="ucm-breakdown-") as tmp:  # each round: a fresh store
            store = Path(tmp) / "kv"
            connector = ucm_transfer_config(
                {
                    "ucm_connectors": [
                        {"ucm_connector_config": {"store_pipeline": "Cache|Posix", "storage_backends": str(store)}}
                    ]
                }
            )
            specs = {
                "without": {**common, "connector": None, "store": None,
                            "requests": cold + [{"condition": "inmemory_hit", "ids": first}] * args.repeats},
                "with": {**common, "connector": connector, "store": str(store),
                         "requests": cold + [{"condition": "dram_hit", "ids": first}] * args.repeats
                         + [{"condition": "storage_hit", "ids": first, "storage": True}] * args.repeats},
            }  # fmt: skip
            for engine in order:
                records = [{**rec, "round": r} for rec in run_child(specs[engine], args.timeout_s)]
                (without if engine == "without" else with_ucm).extend(records)
    result = summarize(without, with_ucm)
    result["problems"] = check_hits(with_ucm)
    print_table(result)
    summary = {
        "benchmark": "hit_breakdown",
        "command": "benchmarks/hit_breakdown.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": utc_now(),
        "model": model.name,
        "options": vars(args),
        **result,
        "raw": {"without_ucm": without, "with_ucm": with_ucm},
        "versions": versions(),
        "machine": machine_info(load_start),
    }
    return emit_summary(summary, args.out, failed=bool(result["problems"]))


if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        _out = child(json.loads(sys.stdin.read()))
        print(_RESULT_PREFIX + json.dumps(_out), flush=True)
        sys.exit(0)
    sys.exit(main())
