"""The Mooncake stage's GB/s against raw Mooncake put/get of the same bytes (issue 34's bandwidth target: >= 0.9x).

Setup: a real ``mooncake_master`` and two clients in this process, in a loopback-only network namespace (the script
re-runs itself under ``unshare --net`` when not in one; Mooncake's client listens on every interface): the writer
mounts a segment, the reader none, so every get crosses from one client to the other over TCP, as an instance
reading another instance's DRAM does.

Each round, in rotated order: raw put (``batch_put_from`` of the rows, no header) then raw get (``batch_get_into``)
of ``--blocks`` blocks; stage dump (``MooncakeStore.dump``: header, checksum, multi-buffer put) then stage load
(``load``: multi-buffer get and validation) of the same bytes under other names. Objects are removed after each
phase (a put on an existing name is a no-op). Ratios are paired within a round: stage / raw seconds turned into
GB/s ratios, median over the rounds.

Usage: ``python benchmarks/mooncake_bandwidth.py [--block-mib 0.7] [--blocks 16] [--rounds 8]``. Last line: JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import emit_summary, machine_info, utc_now, versions
from benchmarks.store_bandwidth import rotated, sig3
from ucm.store.mooncake import MooncakeStore, connect
from ucm.testing.mooncake import MooncakeMaster, loopback_netns_argv

GB = 1e9
_IN_NETNS = "UCM_MOONCAKE_BENCH_NETNS"


def names_and_keys(tag: str, n: int) -> tuple[list[str], list[bytes]]:
    keys = [hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=16).digest() for i in range(n)]
    return [f"raw/{tag}/{k.hex()}" for k in keys], keys


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--block-mib", type=float, default=0.703125, help="block size (default: SmolLM2 float32's)")
    p.add_argument("--blocks", type=int, default=16, help="blocks per batch")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if os.environ.get(_IN_NETNS) != "1":
        env = {**os.environ, _IN_NETNS: "1"}
        argv = loopback_netns_argv([sys.executable, *sys.argv])
        return os.spawnvpe(os.P_WAIT, argv[0], argv, env)

    row = int(args.block_mib * 2**20)
    n = args.blocks
    src = torch.randint(0, 256, (n, row), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    dst = torch.zeros_like(src)
    nbytes = n * row
    segment = max(64 << 20, 4 * nbytes)
    seconds: dict[str, list[float]] = {"raw_put": [], "raw_get": [], "stage_dump": [], "stage_load": []}
    with tempfile.TemporaryDirectory() as tmp, MooncakeMaster(Path(tmp) / "master.log") as master:
        writer = connect(master.address, global_segment_size=segment, local_buffer_size=16 << 20)
        reader = connect(master.address, global_segment_size=0, local_buffer_size=16 << 20)
        stage_w, stage_r = MooncakeStore(writer), MooncakeStore(reader)
        dst.view(-1).fill_(1)  # pages touched before any timing

        def raw(tag: str) -> None:
            names, _ = names_and_keys(tag, n)
            s0, d0 = src.data_ptr(), dst.data_ptr()
            t0 = time.perf_counter()
            status = writer.batch_put_from(names, [s0 + i * row for i in range(n)], [row] * n)
            t1 = time.perf_counter()
            got = reader.batch_get_into(names, [d0 + i * row for i in range(n)], [row] * n)
            t2 = time.perf_counter()
            assert set(status) == {0} and set(got) == {row}, (status, got)
            assert torch.equal(dst, src)
            seconds["raw_put"].append(t1 - t0)
            seconds["raw_get"].append(t2 - t1)
            writer.batch_remove(names, True)

        def stage(tag: str) -> None:
            _, keys = names_and_keys(tag, n)
            t0 = time.perf_counter()
            assert stage_w.dump(keys, src).result().ok
            t1 = time.perf_counter()
            assert stage_r.load(keys, dst).result().ok
            t2 = time.perf_counter()
            assert torch.equal(dst, src)
            seconds["stage_dump"].append(t1 - t0)
            seconds["stage_load"].append(t2 - t1)
            writer.batch_remove([stage_w._name(k) for k in keys], True)

        raw("warm-up")
        stage("warm-up")
        for key in seconds:
            seconds[key].clear()
        for r in range(args.rounds):
            for phase in rotated([raw, stage], r):
                dst.zero_()
                phase(f"{phase.__name__}{r}")
        stage_r.close()
        stage_w.close()

    gbps = {k: sig3(nbytes / statistics.median(v) / GB) for k, v in seconds.items()}
    put_ratios = [r / s for r, s in zip(seconds["raw_put"], seconds["stage_dump"], strict=True)]
    get_ratios = [r / s for r, s in zip(seconds["raw_get"], seconds["stage_load"], strict=True)]
    summary = {
        "benchmark": "mooncake_bandwidth",
        "date": utc_now(),
        "machine": machine_info(),
        "versions": versions(),
        "block_bytes": row,
        "blocks": n,
        "rounds": args.rounds,
        "gbps": gbps,
        "ratio_dump_vs_put": sig3(statistics.median(put_ratios)),
        "ratio_load_vs_get": sig3(statistics.median(get_ratios)),
        "ratio_samples": {
            "dump_vs_put": [sig3(x) for x in put_ratios],
            "load_vs_get": [sig3(x) for x in get_ratios],
        },
        "target": ">= 0.9 (stage / raw GB/s, paired per round)",
    }
    return emit_summary(summary, args.out)


if __name__ == "__main__":
    sys.exit(main())
