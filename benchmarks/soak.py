"""Soak: UCM under concurrent load with faults injected while it serves; every output checked, memory watched.

Run::

    .venv/bin/python benchmarks/soak.py [--duration-s 3600] [--concurrency 16] [--out soak.json]

What runs (all real processes on 127.0.0.1):
- ``--instances`` (default 2) ``vllm serve`` instances with UCMConnector on ONE store directory (``Cache|Posix``, a
  small DRAM tier, ``posix_capacity_gb`` small enough that garbage collection runs all the time), vLLM's own prefix
  caching off so that every reused prefix goes through UCM; and one reference ``vllm serve`` without a connector.
  All float32 (``--dtype``), so that the outputs of the same prompt compare exactly.
- ``--concurrency`` clients (asyncio + aiohttp), each sending, one after the other, greedy completions by token ids
  to a random live UCM instance and the same request to the reference: requests on shared prefixes (a few documents
  of real text, a random cut of one plus new text), multi-turn conversations (the previous prompt and answer plus a
  new turn, restarted once past the model length) and fresh prompts, of random lengths up to ``--max-model-len``.
- Faults, one every ``--fault-interval-s`` (random kind, ``--faults``): a block file's payload corrupted
  (``corrupt``), cut short (``truncate``), deleted (``delete``), replaced by a FIFO (``fifo``: a read that would
  block forever, which UCM's load deadline must turn into a miss); the store directory remounted read-only for a
  few seconds (``readonly``, a read-only bind mount: needs root, reported unavailable otherwise); one UCM instance
  SIGKILLed and restarted (``kill``; on its own clock with ``--kill-interval-s``, and only in the first
  ``--kill-until-s`` seconds if given, so that a long run can keep its instances up long enough to measure their
  memory); ``python -m ucm.store gc`` (``gc``) and ``verify --remove``
  (``verify``) run concurrently with the servers.

How outputs are compared. Each request asks for its top-2 log-probabilities. An answer equal to the reference's
counts as ``matched``. When they differ, at the first differing token: if the reference's two best tokens were
within ``--tie-logprob`` of each other (a near tie that float32 rounding in another batch composition can flip) the
pair counts as ``near_tie``; otherwise it is ``mismatched`` (wrong KV shows as large differences, never as ties).
A request that gets no answer within ``--request-timeout-s`` is ``hung``; a request refused or cut because its
instance was killed by the soak is ``aborted_by_kill``; any other failure is an error, counted by kind.

Reported (the last line printed is a JSON object): requests sent, matched, near ties, mismatched (and the first 20
mismatches: instance, incarnation, prompt length, first differing position, the reference's top-2 log-probabilities
there, both outputs, and with ``--keep-logs`` the prompt's token ids), hung, errors by kind, faults by kind, kills
and unexpected engine exits (a UCM instance that died without being killed is restarted and counted as ``crashes``;
a restart that fails to start is retried and listed in ``restart_failures``), TTFT p50/p99 of the UCM instances (ms,
client side), and, every ``--sample-interval-s``: the hit rate of the interval (UCM's per-request log lines:
external-hit blocks over full prompt blocks), each instance's RSS (MiB, all processes of its group, and its parts:
anonymous, file-backed and shared memory) and open file descriptors, the reference server's, and ``/dev/shm`` use.
``rss_growth_last_half`` is each instance's RSS growth over the second half of the run (its incarnation since the
last restart, when it was restarted then), and the reference's, the baseline: vLLM's own growth under the same load
(``rss_parts_growth_last_half``: the same for each part); ``verify`` is ``python -m ucm.store verify`` on the store
at the end (the servers stopped). A PNG of hit rate and memory over time is written beside ``--out`` (or at
``--plot``).

Memory. Each instance's DRAM tier is allocated and written in full at start by default (``cache_prefault_gb`` =
``--dram-gb``; ``--prefault-gb`` sets less), as a deployment that watches its RSS sets it: otherwise the tier's slots
beyond one request's blocks are allocated as the cache first fills, which shows as RSS growth of a freshly (re)started
instance for as long as its tier takes to fill.

Memory allocator (``--malloc``): vLLM's CPU guide preloads tcmalloc into every server (``LD_PRELOAD``); its wheel
here ships none and vLLM warns at start. ``tcmalloc`` preloads Debian's ``libtcmalloc_minimal.so.4`` (package
``libtcmalloc-minimal4``; ``make setup`` installs it as root) into every server, the reference included; ``glibc``
runs them on glibc's malloc; ``auto`` (default) is ``tcmalloc`` where it is installed. The summary's ``options``
give the one used.

Exit status 1 when any output mismatched, a request hung, an instance crashed or ``verify`` found a damaged block
other than one a fault damaged (``verify.damaged_other``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import emit_summary, load_avg, machine_info, utc_now, versions  # noqa: E402
from ucm.testing.engine import HIT_RE, ucm_transfer_config  # noqa: E402
from ucm.testing.models import ensure_smollm2  # noqa: E402
from ucm.testing.server import VllmServer  # noqa: E402
from ucm.testing.texts import real_text  # noqa: E402

FAULTS = ("corrupt", "truncate", "delete", "fifo", "readonly", "kill", "gc", "verify")
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"  # Debian's libtcmalloc-minimal4
MALLOCS = ("auto", "tcmalloc", "glibc")
BLOCK_SIZE = 128  # vLLM's CPU attention block size


# ------------------------------------------------------------------------------------------------- servers
@dataclass
class Instance:
    """One UCM server; replaced by a new process (same port) after a kill or a crash."""

    index: int
    server: VllmServer
    incarnation: int = 0
    alive: bool = True  # serving (False while killed or restarting)
    killing: bool = False
    log_offset: int = 0  # HIT_RE matches of this incarnation's log already counted
    samples: list[dict[str, Any]] = field(default_factory=list)


def ucm_config(
    store: Path, dram_gb: float, storage_gb: float, load_timeout_ms: int | None, prefault_gb: float
) -> dict[str, Any]:
    store_cfg: dict[str, Any] = {
        "store_pipeline": "Cache|Posix",
        "storage_backends": str(store),
        "cache_buffer_capacity_gb": dram_gb,
        "cache_prefault_gb": prefault_gb,
        "posix_capacity_gb": storage_gb,
    }
    config: dict[str, Any] = {"ucm_connectors": [{"ucm_connector_config": store_cfg}]}
    if load_timeout_ms is not None:
        config["load_timeout_ms"] = load_timeout_ms
    return config


class Fleet:
    """The servers of one soak: UCM instances on one store, and the reference."""

    def __init__(self, args: argparse.Namespace, model: Path, work: Path) -> None:
        self.args, self.model, self.work = args, model, work
        self.store = work / "store"
        self.store.mkdir(parents=True)
        self.transfer = ucm_transfer_config(
            ucm_config(self.store, args.dram_gb, args.storage_gb, args.load_timeout_ms, args.prefault_gb)
        )
        self.env = {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gb)}
        if args.malloc == "tcmalloc":
            self.env["LD_PRELOAD"] = ":".join(p for p in (TCMALLOC, os.environ.get("LD_PRELOAD", "")) if p)
        self.reference = self._server("reference", None)
        self.instances = [Instance(i, self._server(f"ucm{i}-0", self.transfer)) for i in range(args.instances)]

    def _server(self, name: str, transfer: dict[str, Any] | None, port: int | None = None) -> VllmServer:
        return VllmServer(
            self.model, self.work / f"{name}.log", transfer, port=port, max_model_len=self.args.max_model_len,
            dtype=self.args.dtype, env=self.env, extra_args=["--no-enable-prefix-caching"],
        )  # fmt: skip

    def wait_ready(self) -> None:
        self.reference.wait_ready()
        for inst in self.instances:
            inst.server.wait_ready()

    def restart(self, inst: Instance, failures: list[str], attempts: int = 10) -> None:
        """Start a new process for ``inst`` on its port (blocking: run it in a thread), retrying a start that fails
        (e.g. while the ``readonly`` fault holds the store read-only, UCM refuses to start a ``kv_both`` instance)
        after ``--fault-interval-s``; each failed start is added to ``failures``."""
        for _ in range(attempts):
            inst.incarnation += 1
            inst.log_offset = 0
            name = f"ucm{inst.index}-{inst.incarnation}"
            inst.server = self._server(name, self.transfer, port=inst.server.port)
            try:
                inst.server.wait_ready()
            except RuntimeError as exc:
                reason = next((ln for ln in str(exc).splitlines() if "Error" in ln), str(exc).splitlines()[0])
                failures.append(f"{name}: {reason.strip()[:200]}")
                time.sleep(self.args.fault_interval_s)
                continue
            inst.alive = True
            return

    def stop(self) -> None:
        for s in [self.reference, *(i.server for i in self.instances)]:
            with contextlib.suppress(Exception):
                s.stop()


# ------------------------------------------------------------------------------------------------ workload
class Workload:
    """Prompts (token ids): cuts of shared documents plus new text, multi-turn conversations, fresh text."""

    def __init__(self, model: Path, max_model_len: int, max_tokens: int, seed: int) -> None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model))
        self.ids: list[int] = tokenizer.encode(real_text(min_chars=120_000), add_special_tokens=False, verbose=False)
        self.max_prompt = max_model_len - max_tokens - 1
        self.max_tokens = max_tokens
        self.rng = random.Random(seed)
        n_docs = 6
        self.docs = [self._text(self.max_prompt * 3 // 4) for _ in range(n_docs)]

    def _text(self, n: int) -> list[int]:
        start = self.rng.randrange(0, len(self.ids) - n)
        return self.ids[start : start + n]

    def shared_prefix(self) -> list[int]:
        doc = self.rng.choice(self.docs)
        cut = self.rng.randrange(BLOCK_SIZE, len(doc) + 1)
        return doc[:cut] + self._text(self.rng.randrange(1, 200))[: max(1, self.max_prompt - cut)]

    def fresh(self) -> list[int]:
        return self._text(self.rng.randrange(16, self.max_prompt))

    def next_turn(self, history: list[int] | None) -> list[int]:
        turn = self._text(self.rng.randrange(8, min(160, self.max_prompt // 4)))
        if history is None or len(history) + len(turn) > self.max_prompt:
            start = self.rng.choice(self.docs)[: self.rng.randrange(1, self.max_prompt - len(turn) + 1)]
            return start + turn
        return history + turn


@dataclass
class Tally:
    sent: int = 0
    matched: int = 0
    near_tie: int = 0
    mismatched: int = 0
    hung: int = 0
    aborted_by_kill: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    ttft_ms: list[float] = field(default_factory=list)
    mismatch_examples: list[dict[str, Any]] = field(default_factory=list)


async def complete(session: Any, url: str, model: str, prompt: list[int], max_tokens: int, timeout_s: float) -> Any:
    """One streamed greedy completion: ``(token ids, top-2 logprobs per token, TTFT s)``."""
    import aiohttp

    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "logprobs": 2,
        "return_token_ids": True, "stream": True,
    }  # fmt: skip
    t0 = time.perf_counter()
    ttft = None
    tokens: list[int] = []
    top: list[dict[str, float]] = []
    async with session.post(
        f"{url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
    ) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:200]}")
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            choice = chunk["choices"][0]
            if choice.get("token_ids"):
                if ttft is None:
                    ttft = time.perf_counter() - t0
                tokens.extend(choice["token_ids"])
                top.extend((choice.get("logprobs") or {}).get("top_logprobs") or [{}] * len(choice["token_ids"]))
    return tokens, top, ttft


def first_difference(got: list[int], want: list[int]) -> int:
    """Index of the first token where ``got`` and ``want`` differ (the shorter one's length when one is a prefix of
    the other)."""
    return next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))


def compare(got: list[int], want: list[int], want_top: list[dict[str, float]], tie: float) -> str:
    """``matched``, ``near_tie`` or ``mismatched`` (see the module docstring)."""
    if got == want:
        return "matched"
    p = first_difference(got, want)
    if p < len(want_top):
        best = sorted(want_top[p].values(), reverse=True)
        if len(best) >= 2 and best[0] - best[1] <= tie:
            return "near_tie"
    return "mismatched"


async def client(fleet: Fleet, work: Workload, tally: Tally, stop_at: float, seed: int) -> None:
    import aiohttp

    rng = random.Random(seed)
    args = fleet.args
    history: list[int] | None = None
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < stop_at:
            live = [i for i in fleet.instances if i.alive]
            if not live:
                await asyncio.sleep(0.5)
                continue
            kind = rng.random()
            if kind < 0.5:
                prompt = work.shared_prefix()
            elif kind < 0.85:
                prompt = history = work.next_turn(history)
            else:
                prompt = work.fresh()
            max_tokens = rng.randrange(1, work.max_tokens + 1)
            inst = rng.choice(live)
            incarnation = inst.incarnation
            tally.sent += 1
            try:
                want, want_top, _ = await complete(
                    session, fleet.reference.url, str(fleet.model), prompt, max_tokens, args.request_timeout_s
                )
            except Exception as exc:  # the reference failing is not UCM's fault: go on with another prompt
                tally.errors[f"reference: {type(exc).__name__}: {str(exc)[:80]}"] += 1
                continue
            try:
                got, _, ttft = await complete(
                    session, inst.server.url, str(fleet.model), prompt, max_tokens, args.request_timeout_s
                )
            except asyncio.TimeoutError:
                tally.hung += 1
                continue
            except Exception as exc:
                if inst.killing or inst.incarnation != incarnation or not inst.alive:
                    tally.aborted_by_kill += 1
                else:
                    tally.errors[type(exc).__name__ + ": " + str(exc)[:80]] += 1
                continue
            if ttft is not None:
                tally.ttft_ms.append(ttft * 1e3)
            outcome = compare(got, want, want_top, args.tie_logprob)
            setattr(tally, outcome, getattr(tally, outcome) + 1)
            if outcome == "mismatched" and len(tally.mismatch_examples) < 20:
                diff = first_difference(got, want)
                tally.mismatch_examples.append(
                    {
                        "instance": inst.index, "incarnation": incarnation, "t_s": round(time.monotonic(), 1),
                        "prompt_tokens": len(prompt), "first_diff": diff, "got": got, "want": want,
                        "want_top": want_top[diff] if diff < len(want_top) else None,
                        "prompt": prompt if fleet.args.keep_logs else None,
                    }
                )  # fmt: skip
            if history is prompt:
                history = prompt + got


# -------------------------------------------------------------------------------------------------- faults
def block_files(store: Path) -> list[Path]:
    return [p for p in store.rglob("*.ucmb") if not p.name.startswith(".")]


class Faults:
    """Injects one fault at a time; counts what it did, and why a fault could not be done."""

    def __init__(self, fleet: Fleet, seed: int) -> None:
        self.fleet = fleet
        self.rng = random.Random(seed)
        self.done: Counter[str] = Counter()
        self.unavailable: dict[str, str] = {}
        self.kills = 0
        self.restarts: list[asyncio.Task[None]] = []  # of killed instances, in the background
        self.restart_failures: list[str] = []
        self.injected: set[str] = set()  # block paths this soak damaged (corrupt, truncate, fifo)

    async def run(self, stop_at: float, kinds: list[str], interval_s: float) -> None:
        """One fault of a random kind of ``kinds`` every ``interval_s``, none after ``stop_at``."""
        while time.monotonic() + interval_s < stop_at:
            await asyncio.sleep(interval_s)
            available = [k for k in kinds if k not in self.unavailable]
            if not available:
                return
            kind = self.rng.choice(available)
            try:
                if await getattr(self, f"_{kind}")():
                    self.done[kind] += 1
            except Exception as exc:  # a fault that fails to be injected is reported, never fatal
                self.done[f"{kind}_failed: {type(exc).__name__}"] += 1

    def _victim(self) -> Path | None:
        files = block_files(self.fleet.store)
        return self.rng.choice(files) if files else None

    async def _corrupt(self) -> bool:
        path = self._victim()
        if path is None:
            return False
        with contextlib.suppress(OSError), open(path, "r+b") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(self.rng.randrange(64, max(65, size)))
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([(byte[0] if byte else 0) ^ 0xFF]))
            self.injected.add(str(path))
            return True
        return False

    async def _truncate(self) -> bool:
        path = self._victim()
        if path is None:
            return False
        with contextlib.suppress(OSError):
            os.truncate(path, os.path.getsize(path) // 2)
            self.injected.add(str(path))
            return True
        return False

    async def _delete(self) -> bool:
        path = self._victim()
        if path is None:
            return False
        with contextlib.suppress(OSError):
            os.unlink(path)
            return True
        return False

    async def _fifo(self) -> bool:
        path = self._victim()
        if path is None:
            return False
        with contextlib.suppress(OSError):
            os.unlink(path)
            os.mkfifo(path)
            self.injected.add(str(path))
            return True
        return False

    async def _readonly(self) -> bool:
        store = str(self.fleet.store)
        bind = await asyncio.create_subprocess_exec("mount", "--bind", store, store, stderr=subprocess.PIPE)
        _, err = await bind.communicate()
        if bind.returncode != 0:
            self.unavailable["readonly"] = f"mount --bind: {err.decode().strip()[:120]}"
            return False
        try:
            ro = await asyncio.create_subprocess_exec(
                "mount", "-o", "remount,bind,ro", store, store, stderr=subprocess.PIPE
            )
            _, err = await ro.communicate()
            if ro.returncode != 0:
                self.unavailable["readonly"] = f"remount ro: {err.decode().strip()[:120]}"
                return False
            await asyncio.sleep(self.fleet.args.fault_interval_s)
            return True
        finally:
            umount = await asyncio.create_subprocess_exec("umount", store)
            await umount.wait()

    async def _kill(self) -> bool:
        live = [i for i in self.fleet.instances if i.alive]
        if len(live) < 2:  # keep one instance serving
            return False
        inst = self.rng.choice(live)
        inst.killing, inst.alive = True, False
        await asyncio.to_thread(inst.server.kill)
        self.kills += 1
        inst.killing = False
        self.restarts.append(asyncio.create_task(asyncio.to_thread(self.fleet.restart, inst, self.restart_failures)))
        return True

    async def _cli(self, *command: str) -> bool:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "ucm.store", *command, "--storage-backends", str(self.fleet.store),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        _, err = await proc.communicate()
        if proc.returncode not in (0, 1):  # 1: damaged files found (and removed): expected under this soak
            raise RuntimeError(err.decode()[-200:])
        return True

    async def _gc(self) -> bool:
        return await self._cli("gc", "--target-gb", str(self.fleet.args.storage_gb / 2))

    async def _verify(self) -> bool:
        return await self._cli("verify", "--remove")


# ------------------------------------------------------------------------------------------------ watching
# The parts of RSS that /proc/PID/status gives (kB): VmRSS = RssAnon (heap, stacks, anonymous mappings) + RssFile
# (mapped files: libraries, model weights) + RssShmem (shared memory: /dev/shm, which vLLM's processes map).
RSS_PARTS = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}


def group_usage(pids: list[int]) -> tuple[dict[str, float], int]:
    """RSS (MiB) and open file descriptors of ``pids`` together (processes that vanished are skipped); the RSS as
    ``rss`` and its parts ``anon``, ``file``, ``shmem`` (see :data:`RSS_PARTS`)."""
    kib = dict.fromkeys(RSS_PARTS.values(), 0)
    fds = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                name, _, value = line.partition(":")
                if name in RSS_PARTS:
                    kib[RSS_PARTS[name]] += int(value.split()[0])
            fds += len(os.listdir(f"/proc/{pid}/fd"))
    return {part: round(k / 1024, 1) for part, k in kib.items()}, fds


def shm_mib() -> float:
    total = 0
    for entry in os.scandir("/dev/shm"):
        with contextlib.suppress(OSError):
            total += entry.stat(follow_symlinks=False).st_size
    return total / 2**20


async def watch(
    fleet: Fleet, timeline: list[dict[str, Any]], stop_at: float, t0: float, crashes: list[str], failures: list[str]
) -> None:
    while time.monotonic() < stop_at:
        await asyncio.sleep(fleet.args.sample_interval_s)
        hits = blocks = 0
        row: dict[str, Any] = {"t_s": round(time.monotonic() - t0, 1), "shm_mib": round(shm_mib(), 1)}
        for inst in fleet.instances:
            if inst.alive and not inst.server.alive():  # died without being killed by the soak
                inst.alive = False
                crashes.append(f"instance {inst.index} incarnation {inst.incarnation} at {row['t_s']} s")
                await asyncio.to_thread(fleet.restart, inst, failures)
            with contextlib.suppress(OSError):
                lines = HIT_RE.findall(inst.server.log.read_text(errors="replace"))
                for m in lines[inst.log_offset :]:
                    blocks += int(m[1]) - int(m[2])
                    hits += int(m[3])
                inst.log_offset = len(lines)
            usage, fds = group_usage(inst.server.pids()) if inst.alive else (dict.fromkeys(RSS_PARTS.values(), 0.0), 0)
            for part, mib in usage.items():
                row[f"ucm{inst.index}_{part}_mib"] = mib
            row[f"ucm{inst.index}_fds"] = fds
            row[f"ucm{inst.index}_incarnation"] = inst.incarnation
        usage, fds = group_usage(fleet.reference.pids())
        for part, mib in usage.items():
            row[f"reference_{part}_mib"] = mib
        row["reference_fds"] = fds
        row["hit_rate"] = round(hits / blocks, 3) if blocks else None
        timeline.append(row)
        print(f"[soak] {json.dumps(row)}", file=sys.stderr, flush=True)


def rss_growth_last_half(timeline: list[dict[str, Any]], instances: int, part: str = "rss") -> dict[str, float | None]:
    """Per instance: RSS (or its ``part``, see :data:`RSS_PARTS`) at the end over the same at mid-run (or at its last
    restart after mid-run), minus 1; and the same for the reference server (``reference``, never restarted), where
    the timeline has it."""
    out: dict[str, float | None] = {}
    if not timeline:
        return out
    mid = timeline[-1]["t_s"] / 2
    field = f"{part}_mib"
    ref = [r for r in timeline if r.get(f"reference_{field}")]
    if ref:
        start = next((r for r in ref if r["t_s"] >= mid), None)
        grew = start is not None and start is not ref[-1]
        out["reference"] = (
            round(ref[-1][f"reference_{field}"] / start[f"reference_{field}"] - 1, 4) if grew and start else None
        )
    for i in range(instances):
        rows = [r for r in timeline if r.get(f"ucm{i}_{field}", 0) > 0]
        last = rows[-1] if rows else None
        same = [r for r in rows if last is not None and r[f"ucm{i}_incarnation"] == last[f"ucm{i}_incarnation"]]
        start = next((r for r in same if r["t_s"] >= mid), None)
        if last is None or start is None or start is last:
            out[f"ucm{i}"] = None
            continue
        out[f"ucm{i}"] = round(last[f"ucm{i}_{field}"] / start[f"ucm{i}_{field}"] - 1, 4)
    return out


def write_plot(timeline: list[dict[str, Any]], instances: int, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["t_s"] / 60 for r in timeline]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax1.plot(t, [r["hit_rate"] if r["hit_rate"] is not None else float("nan") for r in timeline], ".-")
    ax1.set_ylabel("UCM hit rate (blocks)")
    ax1.set_ylim(0, 1.05)
    for i in range(instances):
        ax2.plot(t, [r[f"ucm{i}_rss_mib"] for r in timeline], label=f"instance {i} RSS")
    ax2.plot(t, [r.get("reference_rss_mib", float("nan")) for r in timeline], label="reference (no UCM) RSS")
    ax2.plot(t, [r["shm_mib"] for r in timeline], label="/dev/shm")
    ax2.set_ylabel("MiB")
    ax2.set_xlabel("minutes")
    ax2.legend()
    fig.suptitle("UCM soak: hit rate and memory over time")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory; None: SmolLM2 in --models-dir")
    p.add_argument("--models-dir", default="models")
    p.add_argument("--duration-s", type=float, default=3600.0, help="how long the load runs")
    p.add_argument("--concurrency", type=int, default=16, help="clients sending requests at once")
    p.add_argument("--instances", type=int, default=2, help="UCM instances on the one store (>= 2 for kills)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=12, help="most tokens generated per request")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-gb", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (GiB) of every server")
    p.add_argument("--dram-gb", type=float, default=0.05, help="UCM's DRAM tier (cache_buffer_capacity_gb)")
    p.add_argument(
        "--prefault-gb", type=float, default=None,
        help="UCM's cache_prefault_gb: DRAM tier paged in at start (None: all of --dram-gb; see 'Memory')",
    )  # fmt: skip
    p.add_argument("--storage-gb", type=float, default=0.5, help="posix_capacity_gb of the shared store")
    p.add_argument("--load-timeout-ms", type=int, default=None, help="UCM's load_timeout_ms (None: its default)")
    p.add_argument("--faults", nargs="+", default=list(FAULTS), help=f"of {', '.join(FAULTS)}")
    p.add_argument("--fault-interval-s", type=float, default=5.0)
    p.add_argument(
        "--kill-interval-s", type=float, default=None,
        help="SIGKILL an instance every this many seconds, apart from the other faults (None: kill is one of them)",
    )  # fmt: skip
    p.add_argument(
        "--kill-until-s", type=float, default=None,
        help="with --kill-interval-s: no kill after this many seconds (e.g. to keep the instances up through the "
        "half of the run whose RSS growth is measured); None: until the end",
    )  # fmt: skip
    p.add_argument("--sample-interval-s", type=float, default=10.0)
    p.add_argument("--request-timeout-s", type=float, default=300.0, help="a request without answer by then hung")
    p.add_argument("--tie-logprob", type=float, default=0.05, help="see 'How outputs are compared'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the JSON summary here (and the PNG beside it)")
    p.add_argument("--plot", default=None, help="PNG path (default: beside --out)")
    p.add_argument("--keep-logs", action="store_true", help="keep the servers' logs and the store")
    p.add_argument(
        "--malloc",
        default="auto",
        help=f"the servers' allocator, of {', '.join(MALLOCS)} (auto: tcmalloc if installed)",
    )
    args = p.parse_args(argv)
    if args.prefault_gb is None:
        args.prefault_gb = args.dram_gb
    if not 0 <= args.prefault_gb <= args.dram_gb:
        p.error(f"--prefault-gb {args.prefault_gb}: allowed 0 .. --dram-gb ({args.dram_gb})")
    if args.malloc not in MALLOCS:
        p.error(f"--malloc {args.malloc}: unknown; allowed: {', '.join(MALLOCS)}")
    if args.malloc == "auto":
        args.malloc = "tcmalloc" if os.path.exists(TCMALLOC) else "glibc"
    if args.malloc == "tcmalloc" and not os.path.exists(TCMALLOC):
        p.error(f"--malloc tcmalloc: {TCMALLOC} not found; install Debian's libtcmalloc-minimal4 (make setup does) "
                "or pass --malloc glibc")  # fmt: skip
    bad = [f for f in args.faults if f not in FAULTS]
    if bad:
        p.error(f"--faults {' '.join(bad)}: unknown; allowed: {', '.join(FAULTS)}")
    if args.instances < 1 or args.concurrency < 1:
        p.error(f"--instances {args.instances} / --concurrency {args.concurrency}: at least 1")
    return args


async def soak(args: argparse.Namespace, fleet: Fleet, work: Workload) -> tuple[dict[str, Any], set[str]]:
    """Run the load, the faults and the sampling; the result and the block paths the faults damaged."""
    tally = Tally()
    faults = Faults(fleet, args.seed + 1)
    timeline: list[dict[str, Any]] = []
    crashes: list[str] = []
    t0 = time.monotonic()
    stop_at = t0 + args.duration_s
    tasks = [
        asyncio.create_task(client(fleet, work, tally, stop_at, args.seed + 10 + c)) for c in range(args.concurrency)
    ]
    kinds = list(args.faults)
    if args.kill_interval_s is not None and "kill" in kinds:  # kills on their own clock
        kinds.remove("kill")
        kills_end = stop_at if args.kill_until_s is None else min(stop_at, t0 + args.kill_until_s)
        tasks.append(asyncio.create_task(faults.run(kills_end, ["kill"], args.kill_interval_s)))
    tasks += [
        asyncio.create_task(faults.run(stop_at, kinds, args.fault_interval_s)),
        asyncio.create_task(watch(fleet, timeline, stop_at, t0, crashes, faults.restart_failures)),
    ]
    await asyncio.gather(*tasks)
    await asyncio.gather(*faults.restarts)
    ttft = sorted(tally.ttft_ms)
    return {
        "requests": {
            "sent": tally.sent,
            "matched": tally.matched,
            "near_tie": tally.near_tie,
            "mismatched": tally.mismatched,
            "hung": tally.hung,
            "aborted_by_kill": tally.aborted_by_kill,
            "errors": dict(tally.errors),
        },
        "mismatch_examples": tally.mismatch_examples,
        "ttft_ms": {
            "p50": round(ttft[len(ttft) // 2], 1) if ttft else None,
            "p99": round(ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], 1) if ttft else None,
        },
        "faults": dict(faults.done),
        "faults_unavailable": faults.unavailable,
        "kills": faults.kills,
        "crashes": crashes,
        "restart_failures": faults.restart_failures,
        "timeline": timeline,
        "rss_growth_last_half": rss_growth_last_half(timeline, args.instances),
        # the same for RSS's parts: which of them grew (heap, mapped files, shared memory)
        "rss_parts_growth_last_half": {
            part: rss_growth_last_half(timeline, args.instances, part) for part in ("anon", "file", "shmem")
        },
    }, faults.injected


def verify_store(store: Path, injected: set[str]) -> dict[str, Any]:
    """``python -m ucm.store verify`` on the store: its summary line, and its damaged files split into those at a
    path a fault damaged (``damaged_injected``: a damage no load has met since; expected) and any other
    (``damaged_other``: UCM wrote or left a bad block; must be empty). A path a fault damaged and UCM rewrote later
    counts as injected, so the split can only under-count UCM's damage on those few paths."""
    proc = subprocess.run(
        [sys.executable, "-m", "ucm.store", "verify", "--storage-backends", str(store)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    lines = proc.stdout.strip().splitlines()
    damaged = [ln.removeprefix("damaged: ").split(": ", 1)[0] for ln in lines if ln.startswith("damaged: ")]
    unreadable = [ln for ln in lines if ln.startswith("unreadable: ")]
    return {
        "exit_status": proc.returncode,
        "summary": lines[-1] if lines else proc.stderr[-300:],
        "damaged_injected": sum(p in injected for p in damaged),
        "damaged_other": [p for p in damaged if p not in injected] + unreadable,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_start = load_avg()
    model = Path(args.model) if args.model else ensure_smollm2(Path(args.models_dir))
    work_dir = Path(tempfile.mkdtemp(prefix="ucm-soak-"))
    work = Workload(model, args.max_model_len, args.max_tokens, args.seed)
    fleet = Fleet(args, model, work_dir)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        print(f"[soak] starting {args.instances + 1} servers (logs in {work_dir}) ...", file=sys.stderr, flush=True)
        fleet.wait_ready()
        result, injected = asyncio.run(soak(args, fleet, work))
    finally:
        fleet.stop()
        signal.signal(signal.SIGTERM, previous)
    result["verify"] = verify_store(fleet.store, injected)
    failed = bool(
        result["requests"]["mismatched"] or result["requests"]["hung"] or result["crashes"]
        or result["verify"]["damaged_other"]
    )  # fmt: skip
    summary = {
        "benchmark": "soak",
        "command": "benchmarks/soak.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": utc_now(),
        "model": model.name,
        "options": {k: v for k, v in vars(args).items()},
        **result,
        "logs": str(work_dir) if args.keep_logs else None,
        "versions": versions(),
        "machine": machine_info(load_start),
    }
    plot = Path(args.plot) if args.plot else (Path(args.out).with_suffix(".png") if args.out else None)
    if plot is not None and result["timeline"]:
        summary["plot"] = str(write_plot(result["timeline"], args.instances, plot))
    if not args.keep_logs:
        import shutil

        shutil.rmtree(work_dir, ignore_errors=True)
    return emit_summary(summary, args.out, failed=failed)


if __name__ == "__main__":
    sys.exit(main())
