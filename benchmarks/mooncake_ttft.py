"""TTFT of a prompt cold, from an instance's own DRAM, from another instance's DRAM through the Mooncake pool, and from
storage: the Mooncake guide's three-step measurement in miniature, on SmolLM2-135M-Instruct with real ``vllm serve``.

Run::

    .venv/bin/python benchmarks/mooncake_ttft.py [--prompts 8] [--prompt-tokens 2000] [--models-dir models]
                                                  [--out results.json]

Setup. Everything runs in a loopback-only network namespace (the script re-runs itself under ``unshare --net`` when
not in one; Mooncake's client listens on every interface): a real ``mooncake_master`` and ``vllm serve`` instances
with UCM ``Cache|Mooncake|Posix``. As users of the guide do, the Mooncake client's settings are a ``mooncake.json``
(``P2PHANDSHAKE``, ``tcp``, the master's address, ``--segment-gib`` of ``global_segment_size``) named by the
``MOONCAKE_CONFIG_PATH`` environment variable of the servers, and UCM's settings a YAML file (``UCM_CONFIG_FILE``:
``store_pipeline``, ``storage_backends``, ``cache_buffer_capacity_gb``). Instances 1 and 2 start at once, each a
process group of its own that mounts its own segment into the pool ("another node"); each has its own store
directory (another node's local disk), so a hit on instance 2 of a prompt only instance 1 served can come from the
pool only. vLLM's prefix caching is on (its default) and its development endpoints too (``VLLM_SERVER_DEV_MODE=1``,
for ``POST /reset_prefix_cache``).

Prompts: ``--prompts`` N distinct cuts of real text (``ucm.testing.texts``) of ``--prompt-tokens`` tokens, each
followed by a question; every request asks for 1 token (greedy), one at a time. TTFT is taken client side: from
sending the streaming request to its first token. Before each measured request the script pauses ``--gap-s`` (the
last server's engine core stops polling), evicts the stores' files from the page cache (``posix_fadvise``) and waits
for idle CPUs (``--min-idle``, at most 3 s).

Steps:
- TTFT1: each prompt to instance 1: cold, no cache anywhere.
- Then the script waits until the pool holds every block (``master_key_count`` of the master's metrics) and the
  files are written, and, per prompt p, in an order that alternates every other prompt: ``POST /reset_prefix_cache``
  on instance 1 (vLLM's prefix cache emptied; UCM's DRAM tier and the pool keep the blocks) then TTFT2(p), p to
  instance 1 (a UCM hit in its own DRAM tier); TTFT3(p), p to instance 2, which never saw p (a UCM hit on instance
  1's blocks through the pool, read from instance 1's segment over TCP).
- TTFT_storage: both instances stopped, the master killed and restarted (every pool key lost), instance 3 started
  on instance 1's store directory; each prompt once (served by the Posix tier, the files read from disk).
A warm-up prompt (a further cut of the text) goes through each path first (instance 1 cold, its DRAM, instance 2
through the pool; instance 3 from storage), so the one-time costs of a new server and of the first transfer are paid
before the measurements; it is checked but not counted.

Each measurement is checked to be the hit it claims: UCM's per-request line (``hit hbm: X, hit external: Y``,
``ucm.testing.engine.HIT_RE``) must say 0 external blocks for TTFT1 and every full block, none from vLLM's prefix
cache, for the others; during TTFT3 the master must have found an object for each block read (``pool_gets``: its
replica-lookup counters less their failures) and during TTFT2 none; no server may log blocks that failed to load
(``ucm.testing.engine.failed_loads``). After the cold requests the pool must hold every block instance 1 stored in
instance 1's own segment (``objects_by_segment``: each object's replica endpoint, asked of the master by a client of
this script that mounts no segment, matched to the port an instance's processes listen on), so that TTFT3 crosses
from one instance's DRAM to the other's. Any that is not is listed in ``problems`` (and the exit status is 1).

Reported (the last line printed is a JSON object): the medians (ms) of TTFT1, TTFT2, TTFT3 and TTFT_storage and
their samples; the paired ratios TTFT3/TTFT2 (median over prompts of the per-prompt ratio; the guide's target is
<= 1.2) and TTFT1/TTFT3; per phase the UCM hit counts, the master's object lookups for gets and the bytes the
serving instance read from the block device; the pool's state (segments mounted, keys after the fill and after the
master's restart); whether the greedy 1-token outputs agreed across the four paths; machine, versions, command.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import emit_summary, evict_page_cache, load_avg, machine_info, utc_now, versions  # noqa: E402
from benchmarks.storage_hits import (  # noqa: E402
    MAX_MODEL_LEN,
    build_prompts,
    kv_bytes_per_block,
    read_bytes,
    wait_idle,
)
from ucm.store.mooncake import connect  # noqa: E402
from ucm.store.posix.format import HEADER, HEADER_NBYTES  # noqa: E402
from ucm.testing.engine import HIT_RE, failed_loads, ucm_transfer_config  # noqa: E402
from ucm.testing.models import ensure_smollm2  # noqa: E402
from ucm.testing.mooncake import MooncakeMaster, loopback_netns_argv, write_mooncake_json  # noqa: E402
from ucm.testing.server import VllmServer, http_json, stream_completion  # noqa: E402

_IN_NETNS = "UCM_MOONCAKE_TTFT_NETNS"
PIPELINE = "Cache|Mooncake|Posix"
# Phases, in the order they run: what each request must be.
COLD, DRAM, POOL, STORAGE = "ttft1", "ttft2", "ttft3", "ttft_storage"
PHASES = (COLD, DRAM, POOL, STORAGE)
# The master's counters of the objects it looked up for gets (a client reads an object after asking where it is),
# and of those lookups that found nothing.
GET_COUNTERS = ("master_get_replica_list_requests_total", "master_batch_get_replica_list_items_total")
GET_FAILURES = ("master_get_replica_list_failures_total", "master_batch_get_replica_list_failed_items_total")


@dataclass
class Sample:
    """One request: its TTFT, answer, UCM's line for it, the pool's get lookups and the disk bytes read meanwhile."""

    phase: str
    prompt: int  # -1: the warm-up prompt
    ttft_ms: float
    text: str
    hit_hbm: int
    hit_external: int
    total_blocks: int
    pool_gets: int
    disk_read_mb: float
    idle: float


@dataclass
class Instance:
    """A ``vllm serve`` with UCM and how many of UCM's per-request lines its log held at the last look."""

    name: str
    server: VllmServer
    lines_seen: int = 0
    log: str = ""
    samples: list[Sample] = field(default_factory=list)

    def new_hit_lines(self, timeout_s: float = 5.0) -> list[tuple[str, ...]]:
        """UCM's per-request lines logged since the last call (waits up to ``timeout_s`` for at least one)."""
        deadline = time.monotonic() + timeout_s
        while True:
            hits = HIT_RE.findall(self.server.read_log())
            if len(hits) > self.lines_seen or time.monotonic() > deadline:
                new, self.lines_seen = hits[self.lines_seen :], len(hits)
                return new
            time.sleep(0.05)


# ---------------------------------------------------------------------------------------------------- helpers
def master_metrics(master: MooncakeMaster) -> dict[str, float]:
    """The master's Prometheus counters and gauges (``/metrics``), by name."""
    with urllib.request.urlopen(f"http://127.0.0.1:{master.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and not line.startswith("#"):
            with contextlib.suppress(ValueError):
                out[parts[0]] = float(parts[1])
    return out


def pool_gets(master: MooncakeMaster) -> int:
    """Objects the master has found for gets so far."""
    metrics = master_metrics(master)
    found = sum(metrics.get(name, 0.0) for name in GET_COUNTERS) - sum(metrics.get(name, 0.0) for name in GET_FAILURES)
    return int(found)


def block_files(store: Path) -> int:
    """Block files under ``store`` (``*.ucmb``; names starting with ``.`` are files being written)."""
    return sum(1 for p in store.rglob("*.ucmb") if not p.name.startswith("."))


def wait_stored(master: MooncakeMaster, store: Path, blocks: int, timeout_s: float = 120.0) -> tuple[int, int]:
    """Wait until the pool holds ``blocks`` keys and ``store`` as many block files (the dumps are written in the
    background); return what they hold then."""
    deadline = time.monotonic() + timeout_s
    while True:
        keys, files = int(master_metrics(master).get("master_key_count", 0)), block_files(store)
        if (keys >= blocks and files >= blocks) or time.monotonic() > deadline:
            return keys, files
        time.sleep(0.2)


def listening_ports(pids: list[int]) -> set[int]:
    """TCP ports that processes ``pids`` listen on (their sockets' inodes in ``/proc/net/tcp*`` of this namespace)."""
    inodes: set[int] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:["):
                        inodes.add(int(target[len("socket:[") : -1]))
    ports: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[9]) in inodes:  # 0A: LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def placement(
    master: MooncakeMaster, store: Path, instances: list[Instance], timeout_s: float = 30.0
) -> dict[str, int]:
    """In whose segment the pool holds the blocks of ``store``: the objects' names from the block files' headers
    (``ucm/<namespace tag>/<key>``, as the Mooncake stage names them), their replicas' transport endpoints asked of
    the master by a client of this process (it mounts no segment), each endpoint's port matched to the instance
    whose processes listen on it. Counts by instance name, ``other`` and ``not_in_pool``. The master counts a key
    from the start of its put, and an object whose put is still in flight has no replica yet (the master answers
    ``REPLICA_IS_NOT_READY``): the question is asked again every 0.2 s, for up to ``timeout_s`` seconds, until
    every object has an in-memory replica."""
    names = []
    for path in sorted(store.rglob("*.ucmb")):
        if not path.name.startswith("."):
            with path.open("rb") as f:
                _, _, _, ns_tag, _, key, _ = HEADER.unpack(f.read(HEADER_NBYTES))
            names.append(f"ucm/{ns_tag:08x}/{key.hex()}")
    owners = {port: inst.name for inst in instances for port in listening_ports(inst.server.pids())}
    client = connect(master.address, global_segment_size=0, local_buffer_size=0)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            replicas = client.batch_get_replica_desc(names) if names else {}
            ready = all(any(r.is_memory_replica() for r in replicas.get(name, [])) for name in names)
            if ready or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        client.close()
    counts: dict[str, int] = {}
    for name in names:
        where = "not_in_pool"
        for replica in replicas.get(name, []):
            if replica.is_memory_replica():
                endpoint = replica.get_memory_descriptor().buffer_descriptor.transport_endpoint
                where = owners.get(int(endpoint.rsplit(":", 1)[1]), "other")
        counts[where] = counts.get(where, 0) + 1
    return counts


def reset_prefix_cache(instance: Instance, problems: list[str]) -> None:
    """``POST /reset_prefix_cache`` (vLLM's prefix cache only: UCM's tiers keep their blocks); vLLM refuses while
    blocks are held (e.g. by transfers in flight), so it is retried for up to 10 s."""
    deadline = time.monotonic() + 10
    while True:
        status, answer = http_json(f"{instance.server.url}/reset_prefix_cache", {}, timeout_s=60)
        if status == 404:
            raise SystemExit(f"{instance.name}: no /reset_prefix_cache (is VLLM_SERVER_DEV_MODE=1 set?)")
        if status == 200 and isinstance(answer, dict) and answer.get("success"):
            return
        if time.monotonic() > deadline:
            problems.append(f"{instance.name}: /reset_prefix_cache did not succeed: {status} {answer}")
            return
        time.sleep(0.5)


def measure(
    instance: Instance,
    phase: str,
    index: int,
    prompt: str,
    master: MooncakeMaster,
    args: argparse.Namespace,
    problems: list[str],
) -> Sample:
    """One request of ``phase``: pause, evict the stores' page cache, wait for idle CPUs, time it, check its hit."""
    time.sleep(args.gap_s)
    evict_page_cache("fadvise_dontneed", args.store_root)
    idle = wait_idle(args.min_idle, timeout_s=3.0)
    pids = instance.server.pids()
    gets0, read0 = pool_gets(master), read_bytes(pids)
    body = {"model": args.model_path, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    text, ttft_s, _ = stream_completion(f"{instance.server.url}/v1/completions", body)
    read1, gets1 = read_bytes(pids), pool_gets(master)
    lines = instance.new_hit_lines()
    label = f"{phase} {'warm-up' if index < 0 else f'prompt {index}'} on {instance.name}"
    total, hbm, external = (int(x) for x in lines[-1][1:]) if lines else (-1, -1, -1)
    if len(lines) != 1:
        problems.append(f"{label}: {len(lines)} UCM lookup lines for one request")
    sample = Sample(
        phase, index, round(ttft_s * 1e3, 2), text, hbm, external, total, gets1 - gets0, (read1 - read0) / 1e6, idle
    )
    if phase == COLD:
        if external != 0 or hbm != 0:
            problems.append(f"{label}: not cold: hit hbm {hbm}, hit external {external}")
    elif total <= 0 or external != total or hbm != 0:
        problems.append(f"{label}: expected all {total} blocks from UCM, got hit hbm {hbm}, hit external {external}")
    if phase == POOL and sample.pool_gets < max(1, external):
        problems.append(f"{label}: the master looked up {sample.pool_gets} objects for gets, {external} expected")
    if phase == DRAM and sample.pool_gets:
        problems.append(f"{label}: {sample.pool_gets} pool gets: not served by instance 1's own DRAM tier")
    instance.samples.append(sample)
    print(
        f"[mooncake_ttft] {label}: {sample.ttft_ms:.0f} ms, hit hbm {hbm} external {external} of {total}, "
        f"pool gets {sample.pool_gets}",
        file=sys.stderr,
        flush=True,
    )
    return sample


def median(values: list[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


def paired_ratios(num: dict[int, float], den: dict[int, float]) -> list[float]:
    """``num[p] / den[p]`` for every prompt p in both."""
    return [round(num[p] / den[p], 4) for p in sorted(num) if p in den and den[p] > 0]


def write_configs(tmp: Path, master: MooncakeMaster, args: argparse.Namespace) -> dict[str, Path]:
    """The guide's ``mooncake.json`` and a UCM YAML per store directory (``a`` for instances 1 and 3, ``b`` for 2)."""
    mooncake_json = write_mooncake_json(tmp / "mooncake.json", master.address, int(args.segment_gib * 2**30))
    paths = {"mooncake.json": mooncake_json}
    for name in ("a", "b"):
        store = args.store_root / name
        store.mkdir(parents=True)
        config = {
            "ucm_connectors": [
                {
                    "ucm_connector_name": "UcmPipelineStore",
                    "ucm_connector_config": {
                        "store_pipeline": PIPELINE,
                        "storage_backends": str(store),
                        "cache_buffer_capacity_gb": args.cache_gb,
                    },
                }
            ]
        }
        paths[name] = tmp / f"ucm_{name}.yaml"
        paths[name].write_text(yaml.safe_dump(config, sort_keys=False))
    return paths


def start(name: str, model_dir: Path, tmp: Path, config: Path, mooncake_json: Path) -> Instance:
    """Start ``vllm serve`` with UCM from ``config`` and Mooncake from ``mooncake_json`` (not waited for)."""
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1", "MOONCAKE_CONFIG_PATH": str(mooncake_json)}
    transfer = ucm_transfer_config({"UCM_CONFIG_FILE": str(config)})
    server = VllmServer(model_dir, tmp / f"{name}.log", transfer, max_model_len=MAX_MODEL_LEN, env=env)
    return Instance(name, server)


def stop(instance: Instance, problems: list[str]) -> None:
    """Stop the server (graceful) and check its log for blocks that failed to load."""
    if instance.log:
        return
    instance.log = instance.server.stop()
    failed = failed_loads(instance.log)
    if failed:
        problems.append(f"{instance.name}: {failed} blocks failed to load (recomputed)")


def ucm_warnings(log: str, limit: int = 10) -> list[str]:
    """UCM's warnings and errors in a server log (the first ``limit``)."""
    return [ln.strip()[:300] for ln in log.splitlines() if "[UC][W]" in ln or "[UC][E]" in ln][:limit]


# ------------------------------------------------------------------------------------------------------- run
def run(args: argparse.Namespace, prompts: list[str], tmp: Path) -> dict[str, Any]:
    """The three steps and the storage hit (see the module docstring); the summary's measured part."""
    warmup, measured = prompts[0], prompts[1:]
    problems: list[str] = []
    pool: dict[str, Any] = {}
    instances: list[Instance] = []
    master = MooncakeMaster(tmp / "master.log")
    try:
        paths = write_configs(tmp, master, args)
        print(f"[mooncake_ttft] starting instances 1 and 2 (logs in {tmp}) ...", file=sys.stderr, flush=True)
        one = start("instance1", args.model_dir, tmp, paths["a"], paths["mooncake.json"])
        instances.append(one)
        two = start("instance2", args.model_dir, tmp, paths["b"], paths["mooncake.json"])
        instances.append(two)
        t0 = time.perf_counter()
        one.server.wait_ready()
        two.server.wait_ready()
        startup_s = round(time.perf_counter() - t0, 1)
        metrics = master_metrics(master)
        pool["segments_gib"] = round(metrics.get("master_total_capacity_bytes", 0) / 2**30, 3)
        pool["active_clients"] = int(metrics.get("master_active_clients", 0))

        # Warm-up through every path (instance 1 cold then from its DRAM, instance 2 through the pool).
        w = measure(one, COLD, -1, warmup, master, args, problems)
        wait_stored(master, args.store_root / "a", w.total_blocks)
        reset_prefix_cache(one, problems)
        measure(one, DRAM, -1, warmup, master, args, problems)
        measure(two, POOL, -1, warmup, master, args, problems)

        # Step 1: every prompt cold on instance 1.
        for i, prompt in enumerate(measured):
            measure(one, COLD, i, prompt, master, args, problems)
        blocks = sum(s.total_blocks for s in one.samples if s.phase == COLD)
        keys, files = wait_stored(master, args.store_root / "a", blocks)
        pool.update(blocks_dumped=blocks, keys_after_fill=keys, files_after_fill=files)
        if keys < blocks or files < blocks:
            problems.append(f"after the cold requests the pool holds {keys} and storage {files} of {blocks} blocks")
        pool["objects_by_segment"] = placement(master, args.store_root / "a", [one, two])
        elsewhere = {k: v for k, v in pool["objects_by_segment"].items() if k != one.name}
        if elsewhere:
            problems.append(f"blocks instance 1 stored are not in its own segment: {elsewhere} (TTFT3 not all remote)")

        # Steps 2 and 3, paired per prompt, the order alternating.
        for i, prompt in enumerate(measured):
            for phase in (DRAM, POOL) if i % 2 == 0 else (POOL, DRAM):
                if phase == DRAM:
                    reset_prefix_cache(one, problems)
                    measure(one, DRAM, i, prompt, master, args, problems)
                else:
                    measure(two, POOL, i, prompt, master, args, problems)
        pool["allocated_gib_before_restart"] = round(master_metrics(master).get("master_allocated_bytes", 0) / 2**30, 3)

        # Storage hit: instances down, master restarted (an empty pool), instance 3 on instance 1's store.
        with ThreadPoolExecutor(2) as pool_of_two:  # both shut down at once
            list(pool_of_two.map(lambda inst: stop(inst, problems), (one, two)))
        master.kill()
        master.start()
        pool["keys_after_master_restart"] = int(master_metrics(master).get("master_key_count", -1))
        if pool["keys_after_master_restart"] != 0:
            problems.append(f"the restarted master holds {pool['keys_after_master_restart']} keys, 0 expected")
        print("[mooncake_ttft] starting instance 3 (storage hits) ...", file=sys.stderr, flush=True)
        three = start("instance3", args.model_dir, tmp, paths["a"], paths["mooncake.json"])
        instances.append(three)
        three.server.wait_ready()
        measure(three, STORAGE, -1, warmup, master, args, problems)
        for i, prompt in enumerate(measured):
            measure(three, STORAGE, i, prompt, master, args, problems)
        stop(three, problems)
    finally:
        for instance in instances:
            if not instance.log:
                instance.log = instance.server.stop()
        master.kill()

    samples = [s for inst in instances for s in inst.samples if s.prompt >= 0]
    by_phase = {ph: {s.prompt: s for s in samples if s.phase == ph} for ph in PHASES}
    ttft = {ph: {p: s.ttft_ms for p, s in by_phase[ph].items()} for ph in PHASES}
    texts = [{by_phase[ph][p].text for ph in PHASES if p in by_phase[ph]} for p in range(len(measured))]
    r32 = paired_ratios(ttft[POOL], ttft[DRAM])
    r13 = paired_ratios(ttft[COLD], ttft[POOL])
    return {
        "ttft_ms": {ph: median(list(ttft[ph].values())) for ph in PHASES},
        "ratio_ttft3_over_ttft2": median(r32),
        "ratio_ttft1_over_ttft3": median(r13),
        "target": "ratio_ttft3_over_ttft2 <= 1.2 (median of the per-prompt ratios)",
        "meets_target": bool(r32) and statistics.median(r32) <= 1.2,
        "ratio_samples": {"ttft3_over_ttft2": r32, "ttft1_over_ttft3": r13},
        "ttft_samples_ms": {ph: [ttft[ph][p] for p in sorted(ttft[ph])] for ph in PHASES},
        "ttft2_first": [i % 2 == 0 for i in range(len(measured))],
        "hits": {
            ph: {
                key: [getattr(by_phase[ph][p], key) for p in sorted(by_phase[ph])]
                for key in ("hit_hbm", "hit_external", "total_blocks", "pool_gets")
            }
            for ph in PHASES
        },
        "disk_read_mb_median": {
            ph: median([s.disk_read_mb for s in by_phase[ph].values()]) for ph in PHASES if by_phase[ph]
        },
        "idle_cpu_median": median([s.idle for s in samples]),
        "warmup_ttft_ms": {
            f"{s.phase} ({inst.name})": s.ttft_ms for inst in instances for s in inst.samples if s.prompt < 0
        },
        "pool": pool,
        "startup_s_instances_1_2": startup_s,
        "outputs_identical": all(len(t) == 1 for t in texts),
        "outputs_agree": f"{sum(len(t) == 1 for t in texts)}/{len(texts)} prompts",
        "problems": problems,
        "ucm_warnings": {inst.name: warns for inst in instances if (warns := ucm_warnings(inst.log))},
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models-dir", default="models", help="where SmolLM2-135M-Instruct is (converted on first use)")
    p.add_argument("--prompts", type=int, default=8, help="distinct prompts (each measured once per phase)")
    p.add_argument("--prompt-tokens", type=int, default=2000, help="tokens of real text per prompt")
    p.add_argument("--segment-gib", type=float, default=1.0, help="global_segment_size of each instance (GiB)")
    p.add_argument("--cache-gb", type=float, default=1.0, help="cache_buffer_capacity_gb (UCM's DRAM tier)")
    p.add_argument("--gap-s", type=float, default=1.5, help="pause before each request (s)")
    p.add_argument("--min-idle", type=float, default=0.9, help="idle CPU fraction waited for before each request")
    p.add_argument("--out", default=None, help="also write the JSON summary to this file")
    p.add_argument("--keep-logs", action="store_true", help="keep the servers' logs and stores (path in the JSON)")
    args = p.parse_args(argv)
    if args.prompts < 1 or args.prompt_tokens < 128:
        p.error("--prompts >= 1 and --prompt-tokens >= 128 (one block) are needed")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.environ.get(_IN_NETNS) != "1":
        env = {**os.environ, _IN_NETNS: "1"}
        command = loopback_netns_argv([sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]])
        return os.spawnvpe(os.P_WAIT, command[0], command, env)

    started = time.perf_counter()
    load_start = load_avg()
    args.model_dir = ensure_smollm2(Path(args.models_dir))
    args.model_path = str(args.model_dir)
    # One more prompt than measured: the warm-up's.
    prompts, _ = build_prompts(args.model_dir, args.prompts + 1, args.prompt_tokens, 0, 0)
    tmp = Path(tempfile.mkdtemp(prefix="ucm-mooncake-ttft-"))
    args.store_root = tmp / "stores"
    try:
        measured = run(args, prompts, tmp)
    finally:
        if not args.keep_logs:
            shutil.rmtree(tmp, ignore_errors=True)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    summary: dict[str, Any] = {
        "benchmark": "mooncake_ttft",
        "date": utc_now(),
        "command": " ".join(["benchmarks/mooncake_ttft.py", *(sys.argv[1:] if argv is None else argv)]),
        "options": {k: v for k, v in vars(args).items() if k not in ("model_dir", "model_path", "store_root")}
        | {"store_pipeline": PIPELINE},
        "model": args.model_dir.name,
        "prompt_tokens": [len(tokenizer.encode(p)) for p in prompts[1:]],
        "prompt_kv_mb": round(args.prompt_tokens // 128 * kv_bytes_per_block(args.model_dir) / 1e6, 2),
        **measured,
        "logs": str(tmp) if args.keep_logs else None,
        "machine": machine_info(load_start) | {"nproc": len(os.sched_getaffinity(0))},
        "versions": versions(),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    return emit_summary(summary, args.out, failed=bool(measured["problems"]))


if __name__ == "__main__":
    sys.exit(main())
