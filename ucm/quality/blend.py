"""CacheBlend's quality: the ``blend`` suite (``tasks.blend_items``) through full prefill, UCM prefix caching and
CacheBlend at several recompute ratios, against one full-prefill baseline.

Modes (:func:`modes`), one engine process each (``harness.run_dense`` / ``harness.run_ucm``; the same dtype, block
size, OpenMP cores; greedy; requests one at a time; vLLM's prefix cache reset before each):

- ``full``: full prefill, no KV connector (the baseline every other mode is compared with);
- ``prefix_only``: UCM (``Cache|Posix`` on a fresh store) without ``ucm_sparse_config``: lossless prefix caching;
- ``naive_reuse``: UCM with ``Blend`` at ratio 0: the chunks' stored KV reused as stored (keys moved to their new
  positions), only the tokens without stored KV (the question's) recomputed;
- ``blend_<r>``: UCM with ``Blend`` at ratio ``r`` (``r = 1``: every token recomputed, the full prefill's KV).

Store-primed pass. A UCM engine first runs one *primer* per length (that length's first item, not scored): it
computes every document on its own and stores it (Blend), or stores its prefix (``prefix_only``). Every scored
prompt then finds its documents in the store, in whatever order it holds them: the state of the harness's ``warm``
pass, at the cost of one prompt per length instead of a second pass. For Blend the report checks it from UCM's
per-blend log line (``chunks_computed`` must be 0 over the scored prompts).

The Blend config: ``{chunk_end_token_id: <the chunk-end text's token>, compute_meta: {<check_layer>: {ratio: r}},
chunk_context: <none or first_chunk>, selection: <deviation or question>}`` (:func:`ucm_config`, plus
``question_layers`` when given); with ``first_chunk`` each document is computed after the prompt's intro, which is
the same in every item. The chunk-end text must be exactly one token of the model's tokenizer
(:func:`chunk_end_token_id`).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ucm.config import BlendSelection, ChunkContext, UcmConfigError, parse_config
from ucm.quality.harness import (
    DTYPES,
    RunOutput,
    engine_spec,
    environment_info,
    model_max_len,
    run_dense,
    run_entry,
    run_ucm,
)
from ucm.quality.tasks import BLEND_CHUNK_END, NUM_DOCS, EvalItem, blend_items
from ucm.testing.engine import BLEND_RE
from ucm.testing.texts import Tokenizer

RATIOS: tuple[float, ...] = (0.0, 0.05, 0.15, 0.3, 1.0)  # the issue's: naive reuse, then CacheBlend's ratios
CHECK_LAYER = "model.layers.1.self_attn.attn"  # where CacheBlend picks the tokens to recompute (its paper's layer)
STORE_PIPELINE = "Cache|Posix"
TARGET_RATIO = 0.15
TARGET_FRACTION = 0.98  # the target: accuracy at ratio 0.15 >= 98% of full prefill's


@dataclass(frozen=True)
class Mode:
    """One engine configuration of the comparison.

    Attributes:
        name: ``full``, ``prefix_only``, ``naive_reuse`` or ``blend_<ratio>``.
        ucm: runs through UCMConnector (False: full prefill, no connector).
        ratio: Blend's recompute ratio; None: no ``ucm_sparse_config``.
    """

    name: str
    ucm: bool
    ratio: float | None = None


def modes(ratios: Sequence[float] = RATIOS, prefix_only: bool = True) -> list[Mode]:
    """``full``, then ``prefix_only`` (unless False), then one Blend mode per ratio (0: ``naive_reuse``).

    Raises:
        ValueError: a ratio outside [0, 1], or a ratio given twice.
    """
    bad = [r for r in ratios if not 0.0 <= r <= 1.0]
    if bad:
        raise ValueError(f"ratios {bad} are outside [0, 1]")
    if len(set(ratios)) != len(ratios):
        raise ValueError(f"ratios {list(ratios)} name a ratio twice")
    out = [Mode("full", ucm=False)]
    if prefix_only:
        out.append(Mode("prefix_only", ucm=True))
    out += [Mode("naive_reuse" if r == 0 else f"blend_{r:g}", ucm=True, ratio=r) for r in ratios]
    return out


def question_layers_error(selection: str, question_layers: Sequence[int] | None) -> str | None:
    """Why the config would refuse ``Blend.question_layers`` with ``selection`` (its message), or None: for scripts
    that check their arguments before any engine starts (an ``end`` past the model's layers is refused only then)."""
    if question_layers is None:
        return None
    blend = {"chunk_end_token_id": 0, "selection": selection, "question_layers": list(question_layers)}
    try:
        parse_config({"ucm_sparse_config": {"Blend": blend}})
    except UcmConfigError as err:
        return str(err)
    return None


def chunk_end_token_id(tokenizer: Tokenizer, chunk_end: str) -> int:
    """The token id of ``chunk_end``.

    Raises:
        ValueError: the tokenizer does not encode ``chunk_end`` as exactly one token.
    """
    ids = tokenizer.encode(chunk_end, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(
            f"chunk_end {chunk_end!r} is {len(ids)} tokens {ids} of this tokenizer; it must be one (a special token, "
            f"e.g. {BLEND_CHUNK_END!r} of SmolLM2's)"
        )
    return int(ids[0])


def ucm_config(
    mode: Mode,
    chunk_end_id: int,
    check_layer: str = CHECK_LAYER,
    chunk_context: ChunkContext = "none",
    selection: BlendSelection = "deviation",
    question_layers: Sequence[int] | None = None,
) -> dict[str, Any]:
    """The UCM YAML of a UCM mode: ``Cache|Posix`` (its store directory set per run by ``harness.run_ucm``), plus
    ``ucm_sparse_config.Blend`` at ``mode.ratio`` (and ``chunk_context``, ``selection``, ``question_layers`` when
    given) unless the ratio is None.

    Raises:
        ValueError: ``mode`` is not a UCM mode.
    """
    if not mode.ucm:
        raise ValueError(f"mode {mode.name!r} runs without UCM: it has no UCM config")
    config: dict[str, Any] = {
        "ucm_connectors": [
            {
                "ucm_connector_name": "UcmPipelineStore",
                "ucm_connector_config": {"store_pipeline": STORE_PIPELINE, "storage_backends": "unused"},
            }
        ]
    }
    if mode.ratio is not None:
        config["ucm_sparse_config"] = {
            "Blend": {
                "chunk_end_token_id": chunk_end_id,
                "compute_meta": {check_layer: {"ratio": mode.ratio}},
                "chunk_context": chunk_context,
                "selection": selection,
            }
        }
        if question_layers is not None:
            config["ucm_sparse_config"]["Blend"]["question_layers"] = list(question_layers)
    return config


@dataclass
class BlendLog:
    """One request's blend, from UCM's info line (summed if a request has several)."""

    request_id: str
    tokens: int = 0
    chunks: int = 0
    reused: int = 0
    computed_chunks: int = 0
    recomputed: int = 0


def parse_blends(stderr: str) -> list[BlendLog]:
    """The blends of an engine's log, one per request that blended, in the order the requests first blended."""
    out: dict[str, BlendLog] = {}
    for m in BLEND_RE.finditer(stderr):
        log = out.setdefault(m.group(1), BlendLog(m.group(1)))
        log.tokens += int(m.group(3)) - int(m.group(2))
        log.chunks += int(m.group(4))
        log.reused += int(m.group(5))
        log.computed_chunks += int(m.group(6))
        log.recomputed += int(m.group(7))
    return list(out.values())


def primers(items: Sequence[EvalItem]) -> list[EvalItem]:
    """The first item of each length: run once, unscored, before the scored items (see the module docstring)."""
    seen: dict[int, EvalItem] = {}
    for it in items:
        seen.setdefault(it.length, it)
    return list(seen.values())


def blend_totals(logs: list[BlendLog], num_primers: int, num_scored: int) -> dict[str, Any]:
    """The scored prompts' blend figures; ``complete`` is False when the log does not hold one blend per request
    (a blend failed and vLLM recomputed, or the request was not blended): then the totals are over all lines."""
    complete = len(logs) == num_primers + num_scored
    scored = logs[num_primers:] if complete else logs
    return {
        "complete": complete,
        "blends": len(scored),
        "blended_tokens": sum(b.tokens for b in scored),
        "reused_tokens": sum(b.reused for b in scored),
        "recomputed_tokens": sum(b.recomputed for b in scored),
        "chunks_computed": sum(b.computed_chunks for b in scored),
        "primer_chunks_computed": sum(b.computed_chunks for b in logs[:num_primers]) if complete else None,
    }


def run_blend_quality(
    model_dir: Path,
    *,
    lengths: Sequence[int],
    mode_list: Sequence[Mode] | None = None,
    num_docs: int = NUM_DOCS,
    orders: int = 3,
    questions: int | None = None,
    chunk_end: str = BLEND_CHUNK_END,
    check_layer: str = CHECK_LAYER,
    chunk_context: ChunkContext = "none",
    selection: BlendSelection = "deviation",
    question_layers: Sequence[int] | None = None,
    seed: int = 0,
    dtype: str = "float32",
    block_size: int | None = 32,
    work_dir: Path | None = None,
    timeout_s: float = 3600,
    kvcache_gib: int = 1,
    progress: Callable[[str, dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run every mode of ``mode_list`` (default :func:`modes`) on the same ``blend`` items; return the report.

    Args:
        model_dir: a model vLLM serves whose tokenizer has ``chunk_end`` as one token.
        lengths, num_docs, orders, questions, chunk_end, seed: the items (``tasks.blend_items``).
        check_layer: ``compute_meta``'s attention layer.
        chunk_context: ``Blend.chunk_context`` (``none`` or ``first_chunk``: the prompt's intro).
        selection, question_layers: ``Blend.selection`` and ``Blend.question_layers`` (None: not set).
        dtype: the engines' dtype (float32 by default: ratio 1 then reproduces full prefill to float rounding,
            so differences are the blend's, not bf16's summation orders).
        block_size: vLLM's KV block size (the store's unit; a chunk's last partial block is stored in a block of
            its own).
        work_dir: engine logs and stores; None: a temporary directory, removed at the end.
        progress: called with each mode's name and report entry as soon as its engine finished.

    Returns:
        ``{"environment", "model", "dtype", "block_size", "lengths", "num_prompts", "prompt_tokens", "modes":
        {name: {"ucm", "ratio", "accuracy", "f1", "correct", "answers", "engine_wall_s" (``harness.run_entry``),
        for the other modes "vs_dense" (against full: ``harness.compare``), for Blend modes "blend"
        (:func:`blend_totals`)}}, "target"}``
        where ``target`` compares ``blend_0.15``'s accuracy and F1 with full prefill's (when both ran).

    Raises:
        ValueError: bad ``dtype``, a chunk-end text that is not one token or occurs elsewhere in the prompts, or
            bad item parameters.
        RuntimeError: an engine process failed.
    """
    from transformers import AutoTokenizer

    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {DTYPES}")
    mode_list = list(mode_list or modes())
    if not mode_list or mode_list[0].ucm:
        raise ValueError("mode_list must start with the full-prefill mode (the baseline), e.g. modes()")
    tokenizer: Tokenizer = AutoTokenizer.from_pretrained(str(model_dir))  # type: ignore[assignment]
    end_id = chunk_end_token_id(tokenizer, chunk_end)
    max_len = model_max_len(model_dir)
    if not lengths or max(lengths) > max_len:
        raise ValueError(f"lengths {list(lengths)}: give 1 or more, each at most the model's context length {max_len}")
    items = blend_items(
        tokenizer, lengths, seed, num_docs=num_docs, orders=orders, questions=questions, chunk_end=chunk_end
    )
    for it in items:  # e.g. a chunk-end text that is an ordinary word also occurs inside the documents
        count = tokenizer.encode(it.prompt, add_special_tokens=False).count(end_id)
        if count != num_docs + 1:
            raise ValueError(
                f"item {it.id} holds the chunk-end token {end_id} ({chunk_end!r}) {count} times, expected "
                f"{num_docs + 1} (after the intro and after each document): choose a special token"
            )
    first = primers(items)
    own_dir = work_dir is None
    work = Path(tempfile.mkdtemp(prefix="ucm-blend-quality-")) if work_dir is None else work_dir
    work.mkdir(parents=True, exist_ok=True)
    spec = engine_spec(model_dir, dtype, block_size)
    entries: dict[str, dict[str, Any]] = {}
    base: RunOutput | None = None
    try:
        for mode in mode_list:
            blend = None
            if not mode.ucm:
                run = run_dense(items, spec, work / f"{mode.name}.log", kvcache_gib=kvcache_gib, timeout_s=timeout_s)
                base = base or run
            else:
                config = work / f"{mode.name}.yaml"
                config.write_text(
                    yaml.safe_dump(
                        ucm_config(mode, end_id, check_layer, chunk_context, selection, question_layers),
                        sort_keys=False,
                    )
                )
                primed, stderr = run_ucm(
                    first + items, spec, config, work, tag=mode.name, kvcache_gib=kvcache_gib, timeout_s=timeout_s
                )
                run = RunOutput(mode.name, primed.results[len(first) :], primed.wall_s)
                if mode.ratio is not None:
                    blend = blend_totals(parse_blends(stderr), len(first), len(items))
            entry = run_entry(items, run, None if run is base else base)
            entry.update(ucm=mode.ucm, ratio=mode.ratio)
            if blend is not None:
                entry["blend"] = blend
            entries[mode.name] = entry
            if progress is not None:
                progress(mode.name, entry)
    finally:
        if own_dir:
            shutil.rmtree(work, ignore_errors=True)
    assert base is not None  # mode_list starts with the full-prefill mode
    report: dict[str, Any] = {
        "environment": environment_info(),
        "model": str(model_dir),
        "dtype": dtype,
        "block_size": block_size,
        "lengths": list(lengths),
        "num_docs": num_docs,
        "orders": orders,
        "chunk_end": chunk_end,
        "chunk_end_token_id": end_id,
        "check_layer": check_layer,
        "chunk_context": chunk_context,
        "selection": selection,
        "question_layers": None if question_layers is None else list(question_layers),
        "seed": seed,
        "num_prompts": len(items),
        "num_primers": len(first),
        "prompt_tokens": {it.id: r.num_prompt_tokens for it, r in zip(items, base.results, strict=True)},
        "depths": {it.id: it.depth for it in items},  # the asked document's position: first 0, last 1
        "modes": entries,
    }
    report["target"] = target(report)
    return report


def target(report: dict[str, Any]) -> dict[str, Any] | None:
    """The issue's target: ``blend_0.15``'s accuracy and F1 (task ``blend``, all lengths) against
    ``TARGET_FRACTION`` of full prefill's; None when either mode did not run."""
    got, full = report["modes"].get(f"blend_{TARGET_RATIO:g}"), report["modes"].get("full")
    if got is None or full is None:
        return None
    em, f1 = got["accuracy"]["blend"]["all"], got["f1"]["blend"]["all"]
    full_em, full_f1 = full["accuracy"]["blend"]["all"], full["f1"]["blend"]["all"]
    return {
        "ratio": TARGET_RATIO,
        "fraction": TARGET_FRACTION,
        "accuracy_vs_full": em / full_em if full_em else None,
        "f1_vs_full": f1 / full_f1 if full_f1 else None,
        "met": em >= TARGET_FRACTION * full_em and f1 >= TARGET_FRACTION * full_f1,
    }


def paired_ratio_interval(
    baseline: Sequence[bool], other: Sequence[bool], draws: int = 20_000, seed: int = 0
) -> dict[str, float]:
    """How precisely a sample of questions gives ``other``'s accuracy as a fraction of ``baseline``'s: the ratio of
    their right answers, and its 95% percentile-bootstrap interval from resampling the questions *in pairs* (both
    modes answered the same questions, so what varies between questions cancels out).

    Args:
        baseline / other: per question (the same questions, in the same order), whether each mode answered right.
        draws: bootstrap resamples; seed: their generator's (numpy's ``default_rng``).

    Returns:
        ``ratio``, ``low`` and ``high`` (the interval's 2.5% and 97.5% percentiles), and ``share_at_target``: the
        fraction of the draws whose ratio reaches ``TARGET_FRACTION``.

    Raises:
        ValueError: the sequences differ in length, are empty, or the baseline answered none right.
    """
    import numpy as np

    if len(baseline) != len(other) or not baseline:
        raise ValueError(f"paired answers: {len(baseline)} baseline and {len(other)} other; need the same number > 0")
    if not any(baseline):
        raise ValueError("paired answers: the baseline answered no question right; the ratio is undefined")
    pairs = np.stack([np.asarray(baseline, dtype=np.int64), np.asarray(other, dtype=np.int64)])
    picks = np.random.default_rng(seed).integers(0, pairs.shape[1], size=(draws, pairs.shape[1]))
    right = pairs[:, picks].sum(axis=2)  # [2, draws]
    ratios = right[1] / np.maximum(right[0], 1)
    low, high = np.percentile(ratios, [2.5, 97.5])
    return {
        "ratio": float(pairs[1].sum() / pairs[0].sum()),
        "low": float(low),
        "high": float(high),
        "share_at_target": float((ratios >= TARGET_FRACTION).mean()),
    }


def pool_reports(reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several seeds' reports (:func:`run_blend_quality`, the same settings but the seed) as one sample: per mode,
    the right answers per seed, per position of the asked document (``right_by_depth``: ``"0.00"`` the first,
    ``"1.00"`` the last, each ``[right, asked]``; from reports that list ``depths``) and in all, and against full
    prefill the paired ratio with its interval (:func:`paired_ratio_interval`) over every question of every seed
    (left out where full prefill ran nowhere or answered nothing right).

    Raises:
        ValueError: no report, a seed given twice, reports whose settings other than the seed differ, or modes or
            questions that differ between a report's modes.
    """
    if not reports:
        raise ValueError("pool: no report given")
    seeds = [r["seed"] for r in reports]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"pool: seeds {seeds} name one seed twice")
    keys = (
        "model",
        "dtype",
        "block_size",
        "lengths",
        "num_docs",
        "orders",
        "chunk_end",
        "check_layer",
        "chunk_context",
        "selection",
        "question_layers",
    )
    settings = [{k: r.get(k) for k in keys} for r in reports]
    for seed, setting in zip(seeds, settings, strict=True):
        if setting != settings[0]:
            changed = sorted(k for k in setting if setting[k] != settings[0][k])
            raise ValueError(f"pool: seed {seed}'s report differs from seed {seeds[0]}'s in {changed}")
    names = list(reports[0]["modes"])
    correct: dict[str, list[bool]] = {name: [] for name in names}
    per_seed: dict[str, dict[int, int]] = {name: {} for name in names}
    by_depth: dict[str, dict[str, list[int]]] = {name: {} for name in names}  # [right, asked] per position
    for seed, report in zip(seeds, reports, strict=True):
        if list(report["modes"]) != names:
            raise ValueError(f"pool: seed {seed} ran modes {list(report['modes'])}, seed {seeds[0]} {names}")
        ids = list(report["modes"][names[0]]["correct"])
        depths = report.get("depths", {})
        for name in names:
            answers = report["modes"][name]["correct"]
            if list(answers) != ids:
                raise ValueError(f"pool: seed {seed}'s mode {name} answered other questions than its {names[0]}")
            rights = [bool(answers[i]) for i in ids]
            correct[name] += rights
            per_seed[name][seed] = sum(rights)
            for item, right in zip(ids, rights, strict=True):
                if depths.get(item) is not None:
                    cell = by_depth[name].setdefault(f"{depths[item]:.2f}", [0, 0])
                    cell[0] += right
                    cell[1] += 1
    pooled: dict[str, Any] = {
        "seeds": seeds,
        "questions": len(correct[names[0]]),
        "settings": settings[0],
        "right": {name: sum(v) for name, v in correct.items()},
        "right_per_seed": per_seed,
        "right_by_depth": {name: dict(sorted(cells.items())) for name, cells in by_depth.items()},
    }
    if any(correct.get("full", ())):  # no right full-prefill answer (a random model): no ratio to give
        pooled["vs_full"] = {
            name: {
                **paired_ratio_interval(correct["full"], answers),
                "only_full_right": sum(f and not o for f, o in zip(correct["full"], answers, strict=True)),
                "only_this_right": sum(o and not f for f, o in zip(correct["full"], answers, strict=True)),
            }
            for name, answers in correct.items()
            if name != "full"
        }
        at_target = pooled["vs_full"].get(f"blend_{TARGET_RATIO:g}")
        if at_target is not None:
            pooled["target"] = {
                "ratio": TARGET_RATIO,
                "fraction": TARGET_FRACTION,
                "accuracy_vs_full": at_target["ratio"],
                "interval": [at_target["low"], at_target["high"]],
                "met": at_target["ratio"] >= TARGET_FRACTION,
            }
    return pooled
