"""The PD-mixed example's table (examples/pd_mixed/run.sh): per run, `vllm bench serve`'s latencies and UCM's hits.

``runs.tsv`` has one line per run: name, the run's ``--save-result`` JSON, the server log, and the log's size before
and after the run (bytes). Latencies come from the JSON (``mean_ttft_ms``, ``p90_ttft_ms``, ...; p90 needs
``--metric-percentiles`` with 90); hits from UCM's per-request lines in that part of the log
(``request_id: .., total_blocks_num: .., hit hbm: .., hit external: ..``, ``ucm.testing.engine.HIT_RE``).

Checks (exit status 1 when one fails, naming it): every request completed; no block load failed; run 1 hit nothing;
the last run (after the restart) loaded blocks from UCM; so did run 2 with vLLM's prefix caching off (on, run 2 may
be served from vLLM's own cache instead: it must hit one of the two).

Run: ``python examples/pd_mixed/report.py RUNS_TSV [--vllm-prefix-caching off|on] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from ucm.testing.engine import HIT_RE, failed_loads

METRICS = ("ttft", "tpot", "e2el")


@dataclass
class Run:
    """One `vllm bench serve` run and UCM's lines for it.

    Attributes:
        name: run name (``run1_cold``, ...).
        completed / failed: requests, from the JSON.
        latency_ms: ``{"mean_ttft": .., "p90_ttft": .., ...}`` for ``METRICS``, from the JSON.
        ucm_requests: requests with a UCM line in the run's part of the log.
        total_blocks / hit_hbm / hit_external: those lines' sums (blocks).
        failed_block_loads: blocks whose load failed (recomputed), from UCM's warnings.
    """

    name: str
    completed: int
    failed: int
    latency_ms: dict[str, float]
    ucm_requests: int
    total_blocks: int
    hit_hbm: int
    hit_external: int
    failed_block_loads: int


def read_run(name: str, result_json: Path, log: Path, start: int, end: int) -> Run:
    """One run from its JSON and the bytes ``[start, end)`` of the server log."""
    result = json.loads(result_json.read_text())
    with log.open("rb") as f:
        f.seek(start)
        text = f.read(end - start).decode(errors="replace")
    first: dict[str, tuple[int, int, int]] = {}
    for request_id, total, hbm, external in HIT_RE.findall(text):
        first.setdefault(request_id, (int(total), int(hbm), int(external)))  # a re-scheduled request logs again
    latency = {f"{stat}_{m}": float(result[f"{stat}_{m}_ms"]) for m in METRICS for stat in ("mean", "p90")}
    return Run(
        name=name,
        completed=int(result["completed"]),
        failed=int(result.get("failed", 0)),
        latency_ms=latency,
        ucm_requests=len(first),
        total_blocks=sum(v[0] for v in first.values()),
        hit_hbm=sum(v[1] for v in first.values()),
        hit_external=sum(v[2] for v in first.values()),
        failed_block_loads=failed_loads(text),
    )


def check(runs: list[Run], prefix_caching: str) -> list[str]:
    """What went wrong, as sentences (empty: the procedure showed what it should)."""
    problems = [f"{r.name}: {r.failed} requests failed" for r in runs if r.failed]
    problems += [f"{r.name}: {r.failed_block_loads} block loads failed" for r in runs if r.failed_block_loads]
    first, last = runs[0], runs[-1]
    if first.hit_hbm or first.hit_external:
        problems.append(f"{first.name}: hits in a cold run (hbm {first.hit_hbm}, external {first.hit_external})")
    if last.hit_external == 0:
        problems.append(f"{last.name}: no block loaded from UCM's storage after the restart")
    for r in runs[1:-1]:
        hit = r.hit_external if prefix_caching == "off" else r.hit_external + r.hit_hbm
        if hit == 0:
            problems.append(f"{r.name}: no hit on the same server (vLLM prefix caching {prefix_caching})")
    return problems


def table(runs: list[Run]) -> str:
    """The per-run table, one row per run."""
    head = (
        f"{'run':20} {'reqs':>4}  {'TTFT mean':>9} {'p90':>7}  {'TPOT mean':>9} {'p90':>6}  {'E2EL mean':>9} "
        f"{'p90':>7}  {'blocks':>6} {'hit hbm':>7} {'hit ext':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in runs:
        ms = r.latency_ms
        lines.append(
            f"{r.name:20} {r.completed:4d}  {ms['mean_ttft']:9.1f} {ms['p90_ttft']:7.1f}  {ms['mean_tpot']:9.1f} "
            f"{ms['p90_tpot']:6.1f}  {ms['mean_e2el']:9.1f} {ms['p90_e2el']:7.1f}  {r.total_blocks:6d} "
            f"{r.hit_hbm:7d} {r.hit_external:7d}"
        )
    lines.append("(ms; blocks: the prompts' full 128-token blocks, summed over the run's requests, from UCM's log)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs_tsv", type=Path, help="the runs file run.sh writes")
    parser.add_argument("--vllm-prefix-caching", choices=["off", "on"], default="off", help="as the server ran")
    parser.add_argument("--json", type=Path, help="also write the runs and the check's result here")
    args = parser.parse_args(argv)

    runs = []
    for line in args.runs_tsv.read_text().splitlines():
        name, result_json, log, start, end = line.split("\t")
        runs.append(read_run(name, Path(result_json), Path(log), int(start), int(end)))
    problems = check(runs, args.vllm_prefix_caching)
    print()
    print(table(runs))
    summary = {"vllm_prefix_caching": args.vllm_prefix_caching, "runs": [asdict(r) for r in runs], "ok": not problems}
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    print("RESULT " + json.dumps(summary))
    for p in problems:
        print(f"FAILED: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
