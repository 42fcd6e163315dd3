"""End-to-end TTFT through the real vLLM engine (CPU build) on SmolLM2-135M-Instruct, with and without UCM.

Run::

    .venv/bin/python benchmarks/e2e_ttft.py [--models-dir models] [--prompt-tokens 2000] [--out results.json]

What is measured (time to first token, ms, as vLLM reports it: ``first_token_latency`` of the request). Every
engine is a fresh process (``ucm.testing.engine.run_engine``) that runs its requests one at a time; its first
request is a short unrelated warm-up (~50 tokens, ignored) that pays the one-time costs of a new process. All
timed requests ask for 1 token; the same real-text prompt of ``--prompt-tokens`` tokens is used throughout.

Process layout (``--engine-core``). ``process`` (the default) is vLLM's own: ``LLM`` in the engine's process, the
engine core in a second one and, on vLLM's CPU platform (which replaces the one-process ``uni`` executor by ``mp``),
the model worker, where UCM's connector and I/O threads run, in a third. While the worker runs a step, the engine
core waits for its answer on vLLM's shared-memory queue by spinning (``SpinCondition``, up to 1 s), which keeps one
CPU core busy: on a 2-core machine UCM's I/O and decode threads then share the other core with the forward pass.
``inproc`` runs the engine core and the worker in the engine's main process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
so vLLM keeps the ``uni`` executor, which GPU deployments with one rank use too): nothing spins. Every phase of a
run uses the same layout.

- ``recompute_ms``: no connector, vLLM prefix caching off; median of the ``--repeats`` runs of the prompt that follow
  its first run.
- ``inmemory_hit_ms``: no connector, prefix caching on; the prompt 1 + r times in one process, median of the r
  repeats (vLLM's own in-memory prefix cache hit: the best any cache can do).
- ``ucm_dram_hit_ms``: UCM ``Cache|Posix`` on a fresh store directory, vLLM prefix caching off; the prompt 1 + r
  times, median of those of the r repeats that UCM served (``hit_external`` > 0; a repeat it did not serve is listed
  in ``problems`` and its TTFT is in ``raw_ttft_ms``).
- ``cold_without_ucm_ms`` / ``cold_with_ucm_ms``: the first run of the prompt in the recompute process and in the UCM
  process (fresh store: UCM looks up, misses and dumps every block). ``cold_overhead`` = with / without.
- ``ucm_storage_hit_ms``: a new process (restart) on the store written above, vLLM prefix caching on but empty, the
  prompt once: served by UCM's Posix tier. Before the process starts the page cache is dropped
  (``sync; echo 3 > /proc/sys/vm/drop_caches``; ``page_cache_dropped`` says whether that worked). The engine start
  re-reads the model weights (so those are in the page cache again), but the KV files are first read by the
  measured request. Median over ``--restarts`` restarts (one measurement per restart).
- ``ucm_compressed_storage_hit_ms``: the same as ``ucm_storage_hit_ms`` with ``Cache|Compress|Posix`` (KVfold
  lossless): a fill process on its own fresh store (the prompt, then its 16-token answer), then per restart the page
  cache dropped and a new process running the prompt once (median over restarts); ``compressed_over_uncompressed``
  divides it by ``ucm_storage_hit_ms``. ``store_bytes`` gives both stores' block files (count, mean bytes per file;
  the uncompressed store also holds the multi-turn blocks).
- ``ucm_layerwise_storage_hit_ms``: the same as ``ucm_storage_hit_ms`` on the same store with ``use_layerwise:
  true`` (each restart's layerwise process runs right after its blockwise one, page cache dropped before each);
  ``layerwise_over_blockwise`` divides it by ``ucm_storage_hit_ms`` (the target: <= 1).
- ``example_connector_restart_ms``: vLLM's built-in ``ExampleConnector`` (safetensors files): one process fills, a
  second process (restart, page cache dropped before it as well) runs the prompt once. An error is recorded as
  text instead of a number.
- ``multiturn``: a conversation whose turn k prompt extends turn k-1's by ``--turn-tokens`` tokens of further real
  text plus a question (turn 1 is ``--prompt-tokens`` tokens of other real text plus a question). The filling
  processes run the first ``--fill-turns`` turns (default 1); the restarted processes run all turns, each with
  vLLM's prefix cache reset first, so only the connector can help: UCM hits every stored full block of the shared
  prefix, ExampleConnector only whole-prompt repeats (with the default, turns 2.. are new after the restart;
  ``--fill-turns`` equal to ``--turns`` makes every turn a whole-prompt repeat). Per-turn TTFT and UCM
  ``hit_external`` blocks are reported; for ExampleConnector the number of its "External Cache Hit!" log lines in
  the restarted process.
- ``outputs_identical``: greedy 16-token answers to the prompt from the recompute baseline, a UCM DRAM hit and a
  UCM hit after restart (each checked to be a real hit) have the same token ids. The in-memory hit's answer is
  reported too (``outputs_inmemory_equal_recompute``) as a reference for bf16 noise between compute paths.

How to read it: ``*_over_inmemory_hit`` near 1 means UCM serves the prefix about as fast as vLLM's own in-memory
cache; ``recompute_over_storage_hit`` is the speed-up of a restart with UCM over recomputing; ``cold_overhead`` near
1 means UCM costs nothing when it misses. Numbers are from one machine and one run: small models on few CPU cores
make fixed per-request costs weigh heavily. The restart rows give one sample per restart, so their ratios
(``layerwise_over_blockwise``, ``compressed_over_uncompressed``) carry the noise of a few restarts; for those
comparisons ``benchmarks/storage_hits.py`` measures a long-running server's storage hits in paired rounds. The last
line printed is a JSON object with every number; ``ttft_samples_ms`` holds the samples each median above is taken
over, by variant, and with ``--out results.json`` a plot of them (quartiles, median, min and max;
``benchmarks/plots.py``) is written beside it as ``results.png`` (or where ``--plot`` says; path in ``plot``).
"""

from __future__ import annotations

import argparse
import functools
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import drop_caches, emit_summary, load_avg, machine_info, utc_now, versions  # noqa: E402
from benchmarks.plots import png_beside, ttft_boxplot  # noqa: E402
from ucm.testing.engine import RequestResult, run_engine, ucm_transfer_config  # noqa: E402
from ucm.testing.models import ensure_smollm2  # noqa: E402
from ucm.testing.texts import real_text  # noqa: E402

MAX_MODEL_LEN = 4096
ANSWER_TOKENS = 16
WARMUP_PROMPT = (
    "Describe a quiet morning at a small harbour: the boats coming back from the night, the smell of the sea, "
    "the gulls above the market and the people who buy fish before going to work."
)
QUESTIONS = (
    "Question: In two sentences, what is the main purpose of the text above?",
    "Question: Which obligations does the text above place on someone who distributes copies?",
    "Question: What does the text above say about warranties and liability?",
    "Question: Summarize the last paragraph above in one sentence.",
)
EXAMPLE_HIT_LINE = "External Cache Hit!"


# --------------------------------------------------------------------------------------------------- prompts
@dataclass
class Prompts:
    """The benchmark's prompts: the main prompt and the multi-turn conversation (each turn extends the last)."""

    main: str
    main_tokens: int
    turns: list[str]
    turn_tokens: list[int]


def build_prompts(model_dir: Path, prompt_tokens: int, turns: int, turn_tokens: int) -> Prompts:
    """Cut the prompts out of real text: the main prompt first, then the conversation from the text after it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    needed = 2 * prompt_tokens + (turns - 1) * turn_tokens
    ids = tokenizer.encode(real_text(min_chars=6 * needed), add_special_tokens=False, verbose=False)
    if len(ids) < needed:
        raise SystemExit(f"only {len(ids)} tokens of real text on this machine; {needed} needed")
    main = tokenizer.decode(ids[:prompt_tokens])
    pos = prompt_tokens
    conversation = tokenizer.decode(ids[pos : pos + prompt_tokens])
    pos += prompt_tokens
    turn_prompts: list[str] = []
    for k in range(turns):
        if k > 0:
            conversation += "\n\n" + tokenizer.decode(ids[pos : pos + turn_tokens]).strip()
            pos += turn_tokens
        conversation += "\n\n" + QUESTIONS[k % len(QUESTIONS)] + "\n"
        turn_prompts.append(conversation)
    count = [len(tokenizer.encode(p)) for p in [main, *turn_prompts]]
    if max(count) + ANSWER_TOKENS > MAX_MODEL_LEN:
        raise SystemExit(f"the longest prompt has {max(count)} tokens; it must fit max_model_len {MAX_MODEL_LEN}")
    return Prompts(main=main, main_tokens=count[0], turns=turn_prompts, turn_tokens=count[1:])


# ------------------------------------------------------------------------------------------ engine processes
def request(prompt: str, max_tokens: int = 1, reset: bool = False) -> dict[str, Any]:
    """One request of a ``run_engine`` spec."""
    return {"prompt": prompt, "max_tokens": max_tokens, "reset_prefix_cache": reset}


def ucm_connector(store_dir: Path, pipeline: str = "Cache|Posix", layerwise: bool = False) -> dict[str, Any]:
    """kv_transfer_config for UCM ``pipeline`` over ``store_dir`` (inline config), blockwise or layerwise."""
    store = {"store_pipeline": pipeline, "storage_backends": str(store_dir)}
    return ucm_transfer_config(
        {
            "ucm_connectors": [{"ucm_connector_name": "UcmPipelineStore", "ucm_connector_config": store}],
            "use_layerwise": layerwise,
        }
    )


def example_connector(storage_dir: Path) -> dict[str, Any]:
    """kv_transfer_config for vLLM's built-in ExampleConnector over ``storage_dir``."""
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(storage_dir)},
    }


@dataclass
class Phase:
    """One engine process: its results (warm-up removed), stderr, wall time, error text if it failed."""

    name: str
    results: list[RequestResult] = field(default_factory=list)
    stderr: str = ""
    seconds: float = 0.0
    error: str | None = None

    def ttft(self, index: int) -> float | None:
        return round(self.results[index].ttft_ms, 2) if index < len(self.results) else None

    def uc_lines(self) -> list[str]:
        return [ln for ln in self.stderr.splitlines() if "[UC]" in ln]


def run_phase(
    name: str,
    model: Path,
    connector: dict[str, Any] | None,
    prefix_caching: bool,
    requests: list[dict[str, Any]],
    log_dir: Path,
    engine_core_process: bool = True,
) -> Phase:
    """Run the warm-up request then ``requests`` in a fresh engine process; errors are recorded, not raised.

    ``engine_core_process``: vLLM's own layout (``--engine-core process``), else ``inproc``."""
    spec = {
        "model": str(model),
        "dtype": "bfloat16",
        "max_model_len": MAX_MODEL_LEN,
        "enable_prefix_caching": prefix_caching,
        "connector": connector,
        "requests": [request(WARMUP_PROMPT), *requests],
        "engine_core_process": engine_core_process,
    }
    phase = Phase(name)
    log_path = log_dir / f"{name}.log"
    print(f"[e2e_ttft] {name}: {len(requests)} requests ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        # vLLM logs to stdout by default; stderr is what run_engine returns (worker tracebacks, connector lines).
        results, phase.stderr = run_engine(spec, env={"VLLM_LOGGING_STREAM": "ext://sys.stderr"}, log_path=log_path)
        phase.results = results[1:]
    except Exception as exc:  # an engine crash is a result to report (ExampleConnector), not a reason to stop
        phase.error = f"{type(exc).__name__}: {exc}"
        phase.stderr = log_path.read_text() if log_path.exists() else ""
    phase.seconds = time.perf_counter() - start
    print(f"[e2e_ttft] {name}: {phase.seconds:.1f} s{' FAILED' if phase.error else ''}", file=sys.stderr, flush=True)
    return phase


def drop_page_cache() -> bool:
    """Empty the machine's page cache (:func:`benchmarks.common.drop_caches`); False if not permitted (not root,
    container)."""
    try:
        drop_caches()
        return True
    except OSError as exc:
        print(f"[e2e_ttft] cannot drop the page cache: {exc}", file=sys.stderr)
        return False


# ----------------------------------------------------------------------------------------------------- helpers
def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 2) if present else None


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def error_tail(phase: Phase, chars: int = 1500) -> str:
    """The end of a failed phase's error text (the child's stderr tail is in it)."""
    return (phase.error or "")[-chars:]


def error_report(phase: Phase) -> str:
    """A failed phase for the problem list: the root-cause lines of its stderr, its [UC] lines, the error's end."""
    lines = phase.stderr.splitlines()
    causes = [ln.strip() for ln in lines if ln.lstrip().startswith(("File ", "RuntimeError", "ValueError", "Error"))]
    return (
        "root-cause lines:\n"
        + "\n".join(causes[-12:])
        + "\n[UC] lines:\n"
        + "\n".join(phase.uc_lines()[-20:])
        + "\nerror tail:\n"
        + error_tail(phase, 600)
    )


def expect_hits(phase: Phase, indices: list[int], what: str, problems: list[str], full: bool = True) -> None:
    """Record a problem for each request in ``indices`` that UCM did not serve as expected.

    ``full``: every full block of the prompt; otherwise at least the full blocks of the previous request of the
    phase (a turn that extends the previous turn). Requests are numbered from 0 after the warm-up; the phase's
    [UC] lines go to ``ucm_log_lines`` in the JSON.
    """
    for i in indices:
        if i >= len(phase.results) or (not full and i == 0):
            continue
        r = phase.results[i]
        prev_blocks = phase.results[i - 1].total_blocks if i > 0 else 0
        if not (served(phase, i) if full else r.hit_external + r.hit_hbm >= prev_blocks):
            want = f"all {r.total_blocks} blocks" if full else f"the previous turn's {prev_blocks} blocks"
            problems.append(
                f"{phase.name}: {what} (request {i}) expected {want} from UCM, got hit_external={r.hit_external} "
                f"of total_blocks={r.total_blocks}, hit_hbm={r.hit_hbm}, TTFT {r.ttft_ms:.1f} ms"
            )


def served(phase: Phase, index: int) -> bool:
    """Whether UCM loaded every full block of request ``index`` of ``phase``."""
    if index >= len(phase.results):
        return False
    r = phase.results[index]
    return r.total_blocks > 0 and r.hit_external + r.hit_hbm >= r.total_blocks


def raw_ttfts(phase: Phase) -> list[float] | str:
    """Every request's TTFT (ms, warm-up removed), or the error."""
    return [round(x.ttft_ms, 1) for x in phase.results] if not phase.error else "error"


# ----------------------------------------------------------------------------------------------- command line
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="End-to-end TTFT through vLLM: recompute vs prefix hits vs UCM.")
    p.add_argument("--models-dir", default="models", help="where the demo model is (built there if missing)")
    p.add_argument("--prompt-tokens", type=int, default=2000, help="length of the measured prompt")
    p.add_argument("--repeats", type=int, default=3, help="repeats of in-process hits and recompute (median)")
    p.add_argument("--restarts", type=int, default=1, help="restarts for the storage hits (median)")
    p.add_argument("--turns", type=int, default=3, help="turns of the multi-turn conversation")
    p.add_argument("--turn-tokens", type=int, default=300, help="real-text tokens each later turn adds")
    p.add_argument(
        "--fill-turns",
        type=int,
        default=1,
        help="turns the filling processes run before the restart (default 1: later turns are new after the "
        "restart and share only a prefix with a stored prompt, which ExampleConnector cannot serve; "
        "--fill-turns equal to --turns makes every turn a whole-prompt repeat)",
    )
    p.add_argument(
        "--engine-core",
        choices=("process", "inproc"),
        default="process",
        help="process (default): vLLM's own layout, engine core and, on CPU, the model worker each in a process of "
        "their own; inproc: both in the engine's main process (VLLM_ENABLE_V1_MULTIPROCESSING=0), with no process "
        "spin-waiting on the worker (see the module doc)",
    )
    p.add_argument("--out", default=None, help="also write the JSON summary to this file")
    p.add_argument(
        "--plot", default=None, help="write the TTFT plot (PNG) here; default: beside --out (results.png), else none"
    )
    p.add_argument("--keep-logs", default=None, help="copy each engine process's stderr into this directory")
    args = p.parse_args(argv)
    if args.prompt_tokens < 200 or args.repeats < 1 or args.restarts < 1 or args.turns < 1 or args.turn_tokens < 1:
        p.error("need --prompt-tokens >= 200 and --repeats, --restarts, --turns, --turn-tokens >= 1")
    if not 0 <= args.fill_turns <= args.turns:
        p.error("need 0 <= --fill-turns <= --turns")
    return args


# ------------------------------------------------------------------------------------------------ the phases
@dataclass
class Plan:
    """The requests of the engine processes, built from the prompts and the options. Results are indexed from 0
    after each process's warm-up request."""

    prompt: str  # the measured prompt
    repeats: int  # r: in-process phases run the prompt 1 + r times
    fill_turns: int  # turns of the conversation the filling processes run
    timed: list[dict[str, Any]]  # the prompt 1 + r times, 1 token each
    answer: dict[str, Any]  # the prompt with an ANSWER_TOKENS-token answer, vLLM's prefix cache reset first
    turns_fill: list[dict[str, Any]]  # the first fill_turns turns
    turns_reset: list[dict[str, Any]]  # every turn, vLLM's prefix cache reset before each

    @property
    def answer_at(self) -> int:
        """Index of the answer request in the recompute, in-memory and UCM fill processes."""
        return 1 + self.repeats


def plan_requests(prompts: Prompts, repeats: int, fill_turns: int) -> Plan:
    """The requests of every process (see the module docstring for what each measures)."""
    return Plan(
        prompt=prompts.main,
        repeats=repeats,
        fill_turns=fill_turns,
        timed=[request(prompts.main) for _ in range(1 + repeats)],
        answer=request(prompts.main, ANSWER_TOKENS, reset=True),
        turns_fill=[request(t) for t in prompts.turns[:fill_turns]],
        turns_reset=[request(t, reset=True) for t in prompts.turns],
    )


@dataclass
class Dirs:
    """The run's directories: the stores (fresh) and the engine processes' logs."""

    ucm: Path  # Cache|Posix
    compress: Path  # Cache|Compress|Posix
    example: Path  # ExampleConnector's
    logs: Path


@dataclass
class Runs:
    """Every engine process of a run, and what the run left in the stores."""

    recompute: Phase
    inmem: Phase
    ucm_fill: Phase
    ex_fill: Phase
    zfill: Phase
    ucm_restarts: list[Phase]
    lw_restarts: list[Phase]
    z_restarts: list[Phase]
    ex_restarts: list[Phase]
    page_cache_dropped: list[bool]  # one per restart process
    store_bytes: dict[str, dict[str, int]]  # per UCM pipeline: block files and mean bytes per file

    def phases(self) -> tuple[Phase, ...]:
        """All processes, in the order they ran within each kind."""
        return (
            self.recompute,
            self.inmem,
            self.ucm_fill,
            self.ex_fill,
            self.zfill,
            *self.ucm_restarts,
            *self.lw_restarts,
            *self.z_restarts,
            *self.ex_restarts,
        )


RunFn = Callable[..., Phase]  # run_phase with the run's process layout bound


def run_first_processes(run: RunFn, model: Path, plan: Plan, dirs: Dirs) -> tuple[Phase, Phase, Phase, Phase, Phase]:
    """The processes that meet the prompt first: recompute (its first run is ``cold_without_ucm_ms``), vLLM's
    in-memory hit, UCM on a fresh store with vLLM's prefix caching off (the cold run with UCM, then DRAM hits; it
    fills the store and runs the first turns), ExampleConnector's fill and the compressed store's fill."""
    main_prompt, logs = plan.prompt, dirs.logs
    recompute = run("recompute", model, None, False, [*plan.timed, plan.answer], logs)
    inmem = run("inmemory_hit", model, None, True, [*plan.timed, request(main_prompt, ANSWER_TOKENS)], logs)
    ucm_fill = run(
        "ucm_fill", model, ucm_connector(dirs.ucm), False, [*plan.timed, plan.answer, *plan.turns_fill], logs
    )
    ex_fill = run(
        "example_fill", model, example_connector(dirs.example), True, [request(main_prompt), *plan.turns_fill], logs
    )
    compressed = ucm_connector(dirs.compress, "Cache|Compress|Posix")
    zfill = run("ucm_compress_fill", model, compressed, True, [request(main_prompt), plan.answer], logs)
    return recompute, inmem, ucm_fill, ex_fill, zfill


def run_restarts(
    run: RunFn, model: Path, plan: Plan, dirs: Dirs, restarts: int
) -> tuple[list[Phase], list[Phase], list[Phase], list[Phase], list[bool]]:
    """``restarts`` rounds of new processes on the filled stores, the page cache dropped before each: UCM blockwise,
    UCM layerwise, UCM compressed, ExampleConnector. The first round also runs the answer and the conversation."""
    main_prompt, answer, logs = plan.prompt, plan.answer, dirs.logs
    dropped: list[bool] = []
    ucm: list[Phase] = []
    layerwise: list[Phase] = []
    compressed: list[Phase] = []
    example: list[Phase] = []
    for k in range(restarts):
        first = k == 0
        dropped.append(drop_page_cache())
        ucm_requests = [request(main_prompt), *([answer, *plan.turns_reset] if first else [])]
        ucm.append(run(f"ucm_restart{k}", model, ucm_connector(dirs.ucm), True, ucm_requests, logs))
        dropped.append(drop_page_cache())
        lw_connector = ucm_connector(dirs.ucm, layerwise=True)
        lw_requests = [request(main_prompt), *([answer] if first else [])]
        layerwise.append(run(f"ucm_layerwise_restart{k}", model, lw_connector, True, lw_requests, logs))
        dropped.append(drop_page_cache())
        z_connector = ucm_connector(dirs.compress, "Cache|Compress|Posix")
        z_requests = [request(main_prompt), *([answer] if first else [])]
        compressed.append(run(f"ucm_compress_restart{k}", model, z_connector, True, z_requests, logs))
        dropped.append(drop_page_cache())
        ex_requests = [request(main_prompt), *(plan.turns_reset if first else [])]
        example.append(run(f"example_restart{k}", model, example_connector(dirs.example), True, ex_requests, logs))
    return ucm, layerwise, compressed, example, dropped


def store_file_sizes(dirs: Dirs) -> dict[str, dict[str, int]]:
    """Block files of both UCM stores: count and mean bytes per file."""
    out: dict[str, dict[str, int]] = {}
    for name, d in (("Cache|Posix", dirs.ucm), ("Cache|Compress|Posix", dirs.compress)):
        sizes = [p.stat().st_size for p in d.rglob("*.ucmb") if not p.name.startswith(".")]
        out[name] = {"files": len(sizes), "bytes_per_block": round(statistics.mean(sizes)) if sizes else 0}
    return out


def run_all(args: argparse.Namespace, model: Path, plan: Plan) -> Runs:
    """Every engine process, in a temporary directory on the repository's disk (not /dev/shm: the storage tier is
    a real file system), removed at the end (the logs copied to ``--keep-logs`` first)."""
    run = functools.partial(run_phase, engine_core_process=args.engine_core == "process")
    work = Path(tempfile.mkdtemp(prefix=".e2e_ttft-", dir=REPO))
    dirs = Dirs(work / "ucm_store", work / "ucm_compress_store", work / "example_store", work / "logs")
    for d in (dirs.ucm, dirs.example, dirs.logs, dirs.compress):
        d.mkdir()
    try:
        first = run_first_processes(run, model, plan, dirs)
        *restarts, dropped = run_restarts(run, model, plan, dirs, args.restarts)
        store_bytes = store_file_sizes(dirs)
        if args.keep_logs:
            shutil.copytree(dirs.logs, args.keep_logs, dirs_exist_ok=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return Runs(*first, *restarts, page_cache_dropped=dropped, store_bytes=store_bytes)


# ------------------------------------------------------------------------------------------ numbers and checks
def check_hits(runs: Runs, plan: Plan) -> list[str]:
    """Problems: failed processes (ExampleConnector's are reported as its figure instead) and requests that UCM did
    not serve as expected (the cold run must miss; repeats, answers and restarts must hit every full block)."""
    problems: list[str] = []
    checked = (runs.recompute, runs.inmem, runs.ucm_fill, runs.zfill, *runs.ucm_restarts, *runs.lw_restarts)
    for phase in (*checked, *runs.z_restarts):
        if phase.error:
            problems.append(f"{phase.name} failed: {error_report(phase)}")
    r, answer_at, ucm_fill = plan.repeats, plan.answer_at, runs.ucm_fill
    if not ucm_fill.error:
        cold_result = ucm_fill.results[0]
        if cold_result.hit_external != 0:
            problems.append(f"ucm_fill: cold run on a fresh store had hit_external={cold_result.hit_external}")
        expect_hits(ucm_fill, [*range(1, 1 + r), answer_at], "DRAM hit", problems)
        # Each later turn extends the previous one, whose blocks this process has just stored.
        turn_ids = [answer_at + 1 + i for i in range(1, plan.fill_turns)]
        expect_hits(ucm_fill, turn_ids, "multi-turn turn (previous turn stored by this process)", problems, full=False)
    for restarts, what in (
        (runs.ucm_restarts, "hit after restart"),
        (runs.lw_restarts, "layerwise hit after restart"),
        (runs.z_restarts, "compressed hit after restart"),
    ):
        for phase in restarts:
            if not phase.error:
                expect_hits(phase, [0, 1] if phase is restarts[0] else [0], what, problems)
    return problems


def ttft_figures(runs: Runs, plan: Plan) -> dict[str, Any]:
    """The TTFTs of the summary (ms): medians over repeats or restarts of the requests UCM served in full, the cold
    runs, and ExampleConnector's restart (its error text if it failed)."""
    r = plan.repeats
    ex_ok = [p for p in runs.ex_restarts if not p.error]
    example_ms: float | str | None
    if runs.ex_fill.error:
        example_ms = f"error (fill process): {error_tail(runs.ex_fill)}"
    elif not ex_ok:
        example_ms = f"error (restart process): {error_tail(runs.ex_restarts[0])}"
    else:
        example_ms = median([p.ttft(0) for p in ex_ok])
    return {
        "recompute_ms": median([runs.recompute.ttft(i) for i in range(1, 1 + r)]),
        "inmemory_hit_ms": median([runs.inmem.ttft(i) for i in range(1, 1 + r)]),
        # Only repeats that UCM served in full count as DRAM hits (others are listed in problems, their TTFT in raw).
        "ucm_dram_hit_ms": median([runs.ucm_fill.ttft(i) for i in range(1, 1 + r) if served(runs.ucm_fill, i)]),
        "ucm_storage_hit_ms": median([p.ttft(0) for p in runs.ucm_restarts if served(p, 0)]),
        "ucm_layerwise_storage_hit_ms": median([p.ttft(0) for p in runs.lw_restarts if served(p, 0)]),
        "ucm_compressed_storage_hit_ms": median([p.ttft(0) for p in runs.z_restarts if served(p, 0)]),
        "example_connector_restart_ms": example_ms,
        "cold_without_ucm_ms": runs.recompute.ttft(0),
        "cold_with_ucm_ms": runs.ucm_fill.ttft(0),
    }


def ttft_samples(runs: Runs, plan: Plan) -> dict[str, list[float]]:
    """The samples (ms) the medians of :func:`ttft_figures` are taken over, by variant, for the plot; a variant
    without any (a failed phase, a repeat UCM did not serve) is left out."""
    r = plan.repeats
    samples: dict[str, list[float | None]] = {
        "cold, without UCM": [runs.recompute.ttft(0)],
        "cold, with UCM": [runs.ucm_fill.ttft(0)],
        "recompute": [runs.recompute.ttft(i) for i in range(1, 1 + r)],
        "vLLM in-memory hit": [runs.inmem.ttft(i) for i in range(1, 1 + r)],
        "UCM DRAM hit": [runs.ucm_fill.ttft(i) for i in range(1, 1 + r) if served(runs.ucm_fill, i)],
        "UCM storage hit": [p.ttft(0) for p in runs.ucm_restarts if served(p, 0)],
        "UCM storage hit, layerwise": [p.ttft(0) for p in runs.lw_restarts if served(p, 0)],
        "UCM storage hit, KVfold": [p.ttft(0) for p in runs.z_restarts if served(p, 0)],
        "ExampleConnector restart": [] if runs.ex_fill.error else [p.ttft(0) for p in runs.ex_restarts if not p.error],
    }
    kept = {name: [v for v in values if v is not None] for name, values in samples.items()}
    return {name: values for name, values in kept.items() if values}


def write_plot(summary: dict[str, Any], path: str | Path) -> Path:
    """Plot ``summary["ttft_samples_ms"]`` (this script's JSON summary) into the PNG ``path``, titled with the
    prompt length, with the machine, versions and date under the axis.

    Raises:
        ValueError: no variant has a sample; OSError: the file cannot be written.
    """
    machine, versions_ = summary["machine"], summary["versions"]
    cpu = machine.get("cpu_model") or machine.get("processor") or "unknown CPU"
    title = (
        f"End-to-end TTFT, SmolLM2-135M-Instruct, {summary['prompt_tokens']}-token prompt "
        f"({summary['repeats']} repeats, {summary['restarts']} restarts)"
    )
    note = (
        f"{cpu}, {machine.get('cpu_count')} CPUs; vLLM {versions_.get('vllm')}; {summary['date']}; "
        f"benchmarks/e2e_ttft.py, engine core: {summary['engine_core']}"
    )
    return ttft_boxplot(summary["ttft_samples_ms"], path, title=title, note=note)


def answer_tokens(phase: Phase, index: int) -> list[int] | None:
    return phase.results[index].token_ids if index < len(phase.results) else None


def compare_outputs(runs: Runs, plan: Plan, problems: list[str]) -> tuple[bool | None, bool | None]:
    """Whether the greedy answers of UCM's hits (DRAM, after restart: blockwise, layerwise, compressed) equal the
    recompute's (a difference is a problem), and whether vLLM's in-memory hit's does (bf16 noise reference); None
    where an answer is missing."""
    answer_at = plan.answer_at
    baseline = answer_tokens(runs.recompute, answer_at)
    compared = {
        "ucm_dram_hit": answer_tokens(runs.ucm_fill, answer_at),
        "ucm_after_restart": answer_tokens(runs.ucm_restarts[0], 1),
        "ucm_layerwise_after_restart": answer_tokens(runs.lw_restarts[0], 1),
        "ucm_compressed_after_restart": answer_tokens(runs.z_restarts[0], 1),
    }
    outputs_identical: bool | None = None
    if baseline is not None and all(v is not None for v in compared.values()):
        outputs_identical = all(v == baseline for v in compared.values())
        if not outputs_identical:
            problems.append(f"outputs differ: recompute {baseline} vs {compared}")
    inmem_answer = answer_tokens(runs.inmem, answer_at)
    inmem_equal = None if inmem_answer is None or baseline is None else inmem_answer == baseline
    return outputs_identical, inmem_equal


def multiturn_report(runs: Runs, prompts: Prompts, plan: Plan, problems: list[str]) -> dict[str, Any]:
    """Per-turn TTFTs and UCM hits of the conversation, in the filling processes and after the first restart, with
    ExampleConnector's; a turn after the restart that UCM did not serve as expected is a problem."""
    answer_at, fill_n, turns_n = plan.answer_at, plan.fill_turns, len(prompts.turns)
    ucm_fill, ex_fill = runs.ucm_fill, runs.ex_fill
    ucm_b, ex_b = runs.ucm_restarts[0], runs.ex_restarts[0]
    multiturn = {
        "turn_prompt_tokens": prompts.turn_tokens,
        "ucm_fill_ttft_ms": [ucm_fill.ttft(answer_at + 1 + i) for i in range(fill_n)],
        "ucm_fill_hit_blocks": [
            ucm_fill.results[answer_at + 1 + i].hit_external if answer_at + 1 + i < len(ucm_fill.results) else None
            for i in range(fill_n)
        ],
        "ucm_restart_ttft_ms": [ucm_b.ttft(2 + i) for i in range(turns_n)],
        "ucm_restart_hit_blocks": [
            ucm_b.results[2 + i].hit_external if 2 + i < len(ucm_b.results) else None for i in range(turns_n)
        ],
        "ucm_restart_total_blocks": [
            ucm_b.results[2 + i].total_blocks if 2 + i < len(ucm_b.results) else None for i in range(turns_n)
        ],
        "example_fill_ttft_ms": [ex_fill.ttft(1 + i) for i in range(fill_n)],
        "example_restart_ttft_ms": (
            [ex_b.ttft(1 + i) for i in range(turns_n)] if not ex_b.error else f"error: {error_tail(ex_b)}"
        ),
        "example_restart_hit_lines": ex_b.stderr.count(EXAMPLE_HIT_LINE),
        "example_restart_requests": f"{2 + turns_n} including the warm-up",
        "fill_turns": fill_n,
    }
    if not ucm_b.error:
        # A turn stored before the restart hits in full; a later one hits the previous turn (stored in this process).
        expect_hits(ucm_b, [2 + i for i in range(min(fill_n, turns_n))], "multi-turn turn after restart", problems)
        later = [2 + i for i in range(max(fill_n, 1), turns_n)]
        expect_hits(ucm_b, later, "multi-turn turn after restart, new", problems, full=False)
    return multiturn


def summarize(
    args: argparse.Namespace,
    prompts: Prompts,
    plan: Plan,
    runs: Runs,
    problems: list[str],
    load_start: float,
    t_start: float,
) -> dict[str, Any]:
    """The JSON summary (keys described in the module docstring); appends the problems its checks find."""
    t = ttft_figures(runs, plan)
    outputs_identical, inmem_equal = compare_outputs(runs, plan, problems)
    multiturn = multiturn_report(runs, prompts, plan, problems)
    r, ucm_fill, all_phases = plan.repeats, runs.ucm_fill, runs.phases()
    storage_ms, inmem_ms = t["ucm_storage_hit_ms"], t["inmemory_hit_ms"]
    return {
        "prompt_tokens": prompts.main_tokens,
        "recompute_ms": t["recompute_ms"],
        "inmemory_hit_ms": inmem_ms,
        "ucm_dram_hit_ms": t["ucm_dram_hit_ms"],
        "ucm_storage_hit_ms": storage_ms,
        "ucm_layerwise_storage_hit_ms": t["ucm_layerwise_storage_hit_ms"],
        "layerwise_over_blockwise": ratio(t["ucm_layerwise_storage_hit_ms"], storage_ms),
        "ucm_compressed_storage_hit_ms": t["ucm_compressed_storage_hit_ms"],
        "compressed_over_uncompressed": ratio(t["ucm_compressed_storage_hit_ms"], storage_ms),
        "store_bytes": runs.store_bytes,
        "example_connector_restart_ms": t["example_connector_restart_ms"],
        "cold_without_ucm_ms": t["cold_without_ucm_ms"],
        "cold_with_ucm_ms": t["cold_with_ucm_ms"],
        "dram_hit_over_inmemory_hit": ratio(t["ucm_dram_hit_ms"], inmem_ms),
        "storage_hit_over_inmemory_hit": ratio(storage_ms, inmem_ms),
        "cold_overhead": ratio(t["cold_with_ucm_ms"], t["cold_without_ucm_ms"]),
        "recompute_over_storage_hit": ratio(t["recompute_ms"], storage_ms),
        "ucm_hit_blocks": {
            "dram_hit": [ucm_fill.results[i].hit_external for i in range(1, min(1 + r, len(ucm_fill.results)))],
            "storage_hit": [p.results[0].hit_external for p in runs.ucm_restarts if p.results],
            "layerwise_storage_hit": [p.results[0].hit_external for p in runs.lw_restarts if p.results],
            "compressed_storage_hit": [p.results[0].hit_external for p in runs.z_restarts if p.results],
            "total_blocks": ucm_fill.results[0].total_blocks if ucm_fill.results else None,
        },
        "multiturn": multiturn,
        "page_cache_dropped": all(runs.page_cache_dropped),
        "page_cache_note": "dropped before each restart process starts; the engine start re-reads the model "
        "weights, the KV files are first read by the measured request",
        "outputs_identical": outputs_identical,
        "outputs_inmemory_equal_recompute": inmem_equal,
        "repeats": r,
        "restarts": args.restarts,
        "engine_core": args.engine_core,
        "engine_seconds": {p.name: round(p.seconds, 1) for p in all_phases},
        "raw_ttft_ms": {p.name: raw_ttfts(p) for p in all_phases},
        "ttft_samples_ms": ttft_samples(runs, plan),
        "problems": problems,
        "ucm_log_lines": {
            p.name: p.uc_lines() for p in all_phases if p.uc_lines() and any(p.name in x for x in problems)
        },
        "machine": machine_info(load_avg_start=load_start),
        "versions": versions(),
        "date": utc_now(),
        "runtime_s": round(time.perf_counter() - t_start, 1),
        "plot": None,
    }


# ------------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    load_start = load_avg()
    model = ensure_smollm2(args.models_dir)
    prompts = build_prompts(model, args.prompt_tokens, args.turns, args.turn_tokens)
    plan = plan_requests(prompts, args.repeats, args.fill_turns)
    runs = run_all(args, model, plan)
    problems = check_hits(runs, plan)
    summary = summarize(args, prompts, plan, runs, problems, load_start, t_start)
    print_table(summary)
    plot = args.plot or (png_beside(args.out) if args.out else None)
    if plot and summary["ttft_samples_ms"]:
        summary["plot"] = str(write_plot(summary, plot))
        print(f"plot: {summary['plot']}")
    return emit_summary(summary, args.out, out_indent=1)


def print_table(s: dict[str, Any]) -> None:
    """A readable table of the TTFTs, ratios and checks."""

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:10.1f}"
        if v is None:
            return f"{'n/a':>10}"
        if isinstance(v, str):
            return f"{'error':>10}"
        return f"{v!s:>10}"

    mt = s["multiturn"]
    rows = [
        ("recompute (no connector, prefix caching off)", s["recompute_ms"]),
        ("vLLM in-memory prefix hit", s["inmemory_hit_ms"]),
        ("UCM DRAM hit (vLLM prefix caching off)", s["ucm_dram_hit_ms"]),
        ("UCM storage hit after restart", s["ucm_storage_hit_ms"]),
        ("UCM storage hit after restart, layerwise", s["ucm_layerwise_storage_hit_ms"]),
        ("UCM storage hit after restart, KVfold lossless", s["ucm_compressed_storage_hit_ms"]),
        ("ExampleConnector after restart", s["example_connector_restart_ms"]),
        ("cold, without UCM", s["cold_without_ucm_ms"]),
        ("cold, with UCM (fresh store)", s["cold_with_ucm_ms"]),
    ]
    print(f"\nTTFT through vLLM, SmolLM2-135M-Instruct bf16, {s['prompt_tokens']}-token prompt")
    print(f"{'case':<48}{'TTFT ms':>10}")
    for name, value in rows:
        print(f"{name:<48}{fmt(value)}")
    print()
    for key in (
        "dram_hit_over_inmemory_hit",
        "storage_hit_over_inmemory_hit",
        "cold_overhead",
        "recompute_over_storage_hit",
        "compressed_over_uncompressed",
        "layerwise_over_blockwise",
    ):
        print(f"{key:<48}{fmt(s[key])}")
    print(f"block files: {s['store_bytes']}")
    print(f"\nmulti-turn after restart (prefix cache reset before each turn), prompt tokens {mt['turn_prompt_tokens']}")
    print(f"{'turn':<6}{'UCM ms':>10}{'UCM hit/total blocks':>22}{'Example ms':>12}")
    ex = mt["example_restart_ttft_ms"]
    for i in range(len(mt["turn_prompt_tokens"])):
        ex_v = ex[i] if isinstance(ex, list) else "error"
        hit = f"{mt['ucm_restart_hit_blocks'][i]}/{mt['ucm_restart_total_blocks'][i]}"
        print(f"{i + 1:<6}{fmt(mt['ucm_restart_ttft_ms'][i])}{hit:>22}{fmt(ex_v):>12}")
    print(
        f"\npage_cache_dropped={s['page_cache_dropped']}  outputs_identical={s['outputs_identical']}  "
        f"(in-memory hit equal to recompute: {s['outputs_inmemory_equal_recompute']})  runtime {s['runtime_s']} s"
    )
    for problem in s["problems"]:
        print(f"PROBLEM: {problem}")
    for name, lines in s["ucm_log_lines"].items():
        print(f"[UC] lines of {name}:")
        for line in lines:
            print(f"  {line[:200]}")
    if isinstance(s["example_connector_restart_ms"], str):
        print(f"ExampleConnector: {s['example_connector_restart_ms']}")


if __name__ == "__main__":
    raise SystemExit(main())
