"""KVfold codec: compression ratio and speed on real KV, against zstd-1 and blosc2 on the same bytes.

Run ``python benchmarks/codec.py [--model models/SmolLM2-135M-Instruct] [--tokens 2048] [--kv saved.pt]
[--threads N] [--repeats 3]``. The KV is captured from the real model on real English text
(:func:`ucm.testing.kv_capture.capture_kv`: post-RoPE K and V, bf16, canonical blocks of ``--block-size`` tokens),
or read from a file that ``python -m ucm.testing.kv_capture`` saved.

Every codec works on the same units, one section = one layer's K or V of one block (``block_size * num_kv_heads *
head_dim`` bf16 values), the unit KVfold frames:

- ``kvfold_lossless``: :func:`ucm.store.kvfold.encode_block` (whole blocks; the container headers are counted).
- ``zstd1_raw``: zstd level 1 on the section's raw bytes.
- ``zstd1_hiplane``: zstd level 1 on the high-byte plane, the low-byte plane raw (the issue's reference split).
- ``blosc2_shuffle_zstd1``: blosc2, byte shuffle with typesize 2, zstd clevel 1.
- ``order0_bound``: the lossless bound of an order-0 coder of the exponent and sign+mantissa planes, with one
  table per layer K/V over all blocks: ``16 / (H(exp) + H(sm))`` bits.
- ``kvfold_int8`` (lossy, ``compress_ratio: 16``): ratio and the RMS error per layer, as a percentage of the
  layer's RMS (K and V separately).

Ratios: raw bytes / stored bytes, per layer (K and V together) with the worst and mean over layers, per K/V over
all layers, and overall. Speeds in MB/s (1e6 bytes of raw KV per second) for compress and decompress of whole
blocks, on 1 thread (per core) and on ``--threads`` threads (a pool over blocks; zstandard and numpy release the
GIL); median of ``--repeats``. ``targets`` compares with the issue's targets (lossless worst layer >= 1.40x, mean >=
1.47x, decompression >= zstd-1's speed per core, int8 RMS error <= 1.5% per layer), measured in this run. The LAST
line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import emit_summary, machine_info, utc_now  # noqa: E402
from ucm.store.kvfold import KVGeometry, decode_block, encode_block  # noqa: E402

MB = 1e6


def entropy_bits(values: np.ndarray) -> float:
    """Order-0 entropy (bits per symbol) of a uint8 array."""
    counts = np.bincount(values.ravel(), minlength=256).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


def ratios_summary(raw: np.ndarray, stored: np.ndarray) -> dict[str, Any]:
    """``raw`` / ``stored``: bytes ``[layers, 2]`` summed over blocks -> per-layer, K/V and overall ratios."""
    per_layer = raw.sum(1) / stored.sum(1)
    return {
        "worst_layer": round(float(per_layer.min()), 4),
        "worst_layer_index": int(per_layer.argmin()),
        "mean_over_layers": round(float(per_layer.mean()), 4),
        "overall": round(float(raw.sum() / stored.sum()), 4),
        "k": round(float(raw[:, 0].sum() / stored[:, 0].sum()), 4),
        "v": round(float(raw[:, 1].sum() / stored[:, 1].sum()), 4),
        "per_layer": [round(float(r), 4) for r in per_layer],
    }


def timed(fn: Callable[[], object], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(REPO / "models" / "SmolLM2-135M-Instruct"))
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--kv", help="a tensor saved by `python -m ucm.testing.kv_capture` (skips the capture)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # codec work is per block on our own threads; OpenMP workers only spin here

    import blosc2
    import zstandard

    if args.kv:
        kv = torch.load(args.kv)
        source = args.kv
    else:
        from ucm.testing.kv_capture import capture_kv

        kv = capture_kv(args.model, args.tokens, args.block_size)
        source = f"{args.model} on {args.tokens} tokens of real text"
    n_blocks, n_layers, _, block_size, heads, head_dim = kv.shape
    geometry = KVGeometry(n_layers, block_size, heads, head_dim, torch.bfloat16)
    blocks = [kv[b].contiguous().view(torch.uint8).reshape(-1) for b in range(n_blocks)]
    total_raw = sum(b.numel() for b in blocks)
    section_nbytes = block_size * heads * head_dim * 2
    print(
        f"KV: {source}: {n_blocks} blocks x {n_layers} layers, block_size {block_size}, {heads} KV heads, "
        f"head_dim {head_dim}, {total_raw / 2**20:.1f} MiB"
    )

    raw_bytes = np.full((n_layers, 2), n_blocks * section_nbytes, dtype=np.float64)
    results: dict[str, Any] = {}

    # -- ratios ----------------------------------------------------------------------------------------------
    stored = np.zeros((n_layers, 2))
    kvfold_total = 0
    containers = []
    for blk in blocks:
        container, sizes, used = encode_block(blk, "lossless", geometry)
        assert used == "lossless"
        out = torch.empty_like(blk)
        decode_block(container, out)
        if not torch.equal(out, blk):
            raise SystemExit("kvfold_lossless round trip is not bit-exact")
        containers.append(container)
        kvfold_total += len(container)
        stored += np.array(sizes, dtype=np.float64).reshape(n_layers, 2)
    results["kvfold_lossless"] = ratios_summary(raw_bytes, stored)
    results["kvfold_lossless"]["overall"] = round(total_raw / kvfold_total, 4)  # with container headers

    z1 = zstandard.ZstdCompressor(level=1)
    words = kv.view(torch.int16).numpy().view(np.uint16)  # [B, L, 2, bs, h, d]
    baselines: dict[str, np.ndarray] = {n: np.zeros((n_layers, 2)) for n in ("zstd1_raw", "zstd1_hiplane", "blosc2")}
    bound_bits = np.zeros((n_layers, 2))
    for layer in range(n_layers):
        for s in range(2):
            sec = words[:, layer, s]
            exp = ((sec >> 7) & 0xFF).astype(np.uint8)
            sm = (((sec >> 8) & 0x80) | (sec & 0x7F)).astype(np.uint8)
            bound_bits[layer, s] = entropy_bits(exp) + entropy_bits(sm)
            for b in range(n_blocks):
                one = np.ascontiguousarray(sec[b])
                baselines["zstd1_raw"][layer, s] += len(z1.compress(one.tobytes()))
                hi = (one >> 8).astype(np.uint8)
                baselines["zstd1_hiplane"][layer, s] += min(len(z1.compress(hi.tobytes())), hi.size) + hi.size
                baselines["blosc2"][layer, s] += len(
                    blosc2.compress(
                        one.tobytes(), typesize=2, clevel=1, filter=blosc2.Filter.SHUFFLE, codec=blosc2.Codec.ZSTD
                    )
                )
    results["zstd1_raw"] = ratios_summary(raw_bytes, baselines["zstd1_raw"])
    results["zstd1_hiplane"] = ratios_summary(raw_bytes, baselines["zstd1_hiplane"])
    results["blosc2_shuffle_zstd1"] = ratios_summary(raw_bytes, baselines["blosc2"])
    results["order0_bound"] = ratios_summary(raw_bytes, raw_bytes * bound_bits / 16)

    # -- fixed rate (lossy) ----------------------------------------------------------------------------------
    stored = np.zeros((n_layers, 2))
    err_sq = np.zeros((n_layers, 2))
    ref_sq = np.zeros((n_layers, 2))
    int8_total = 0
    for blk in blocks:
        container, sizes, used = encode_block(blk, "int8", geometry)
        assert used == "int8"
        int8_total += len(container)
        stored += np.array(sizes, dtype=np.float64).reshape(n_layers, 2)
        out = torch.empty_like(blk)
        decode_block(container, out)
        x = blk.view(torch.bfloat16).float().reshape(n_layers, 2, -1)
        y = out.view(torch.bfloat16).float().reshape(n_layers, 2, -1)
        err_sq += (x - y).pow(2).sum(-1).double().numpy()
        ref_sq += x.pow(2).sum(-1).double().numpy()
    rel = np.sqrt(err_sq / ref_sq) * 100
    results["kvfold_int8"] = ratios_summary(raw_bytes, stored)
    results["kvfold_int8"]["overall"] = round(total_raw / int8_total, 4)
    results["kvfold_int8"]["rms_error_pct"] = {
        "worst": round(float(rel.max()), 3),
        "worst_layer_kv": [int(i) for i in np.unravel_index(rel.argmax(), rel.shape)],
        "mean": round(float(rel.mean()), 3),
        "k_per_layer": [round(float(v), 3) for v in rel[:, 0]],
        "v_per_layer": [round(float(v), 3) for v in rel[:, 1]],
    }

    # -- speed -----------------------------------------------------------------------------------------------
    sections = [
        np.ascontiguousarray(words[b, layer, s]).tobytes()
        for b in range(n_blocks)
        for layer in range(n_layers)
        for s in range(2)
    ]
    zstd_frames = [z1.compress(sec) for sec in sections]
    local = __import__("threading").local()

    def zc(i: int) -> None:
        c = getattr(local, "c", None) or zstandard.ZstdCompressor(level=1)
        local.c = c
        for sec in sections[i * 2 * n_layers : (i + 1) * 2 * n_layers]:
            c.compress(sec)

    def zd(i: int) -> None:
        d = getattr(local, "d", None) or zstandard.ZstdDecompressor()
        local.d = d
        for f in zstd_frames[i * 2 * n_layers : (i + 1) * 2 * n_layers]:
            d.decompress(f)

    outs = [torch.empty_like(b) for b in blocks]

    def kc(i: int) -> None:
        encode_block(blocks[i], "lossless", geometry)

    def kd(i: int) -> None:
        decode_block(containers[i], outs[i])

    speed: dict[str, dict[str, float]] = {}
    for threads in sorted({1, args.threads}):
        with ThreadPoolExecutor(threads) as pool:
            for name, fn in (
                ("kvfold_compress", kc),
                ("kvfold_decompress", kd),
                ("zstd1_raw_compress", zc),
                ("zstd1_raw_decompress", zd),
            ):
                list(pool.map(fn, range(n_blocks)))  # warm up
                t = timed(lambda fn=fn: list(pool.map(fn, range(n_blocks))), args.repeats)
                speed.setdefault(name, {})[f"{threads}_threads"] = round(total_raw / t / MB, 1)
    results["speed_mbps"] = speed

    lossless = results["kvfold_lossless"]
    one = "1_threads"
    targets = {
        "lossless_worst_layer>=1.40": lossless["worst_layer"] >= 1.40,
        "lossless_mean>=1.47": lossless["mean_over_layers"] >= 1.47,
        "decompress_per_core>=zstd1": speed["kvfold_decompress"][one] >= speed["zstd1_raw_decompress"][one],
        "int8_rms_error_per_layer<=1.5%": results["kvfold_int8"]["rms_error_pct"]["worst"] <= 1.5,
        "decompress_speed_vs_zstd1_per_core": round(
            speed["kvfold_decompress"][one] / speed["zstd1_raw_decompress"][one], 3
        ),
    }

    for name in (
        "kvfold_lossless",
        "zstd1_raw",
        "zstd1_hiplane",
        "blosc2_shuffle_zstd1",
        "order0_bound",
        "kvfold_int8",
    ):
        r = results[name]
        print(
            f"{name:22s} worst layer {r['worst_layer']:.3f}x (layer {r['worst_layer_index']}), mean "
            f"{r['mean_over_layers']:.3f}x, overall {r['overall']:.3f}x, K {r['k']:.3f}x, V {r['v']:.3f}x"
        )
    e = results["kvfold_int8"]["rms_error_pct"]
    print(f"kvfold_int8 RMS error: worst {e['worst']:.2f}% (layer, K/V {e['worst_layer_kv']}), mean {e['mean']:.2f}%")
    for name, by in speed.items():
        print(f"{name:22s} " + ", ".join(f"{k.replace('_', ' ')}: {v:.0f} MB/s" for k, v in by.items()))
    print("targets: " + ", ".join(f"{k}: {v}" for k, v in targets.items()))
    summary = {
        "benchmark": "codec",
        "date": utc_now(),
        "machine": {**machine_info(), "cpus": os.cpu_count()},  # "cpus": the key of earlier codec summaries
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "zstandard": zstandard.__version__,
            "blosc2": blosc2.__version__,
        },
        "kv": {
            "source": source,
            "blocks": n_blocks,
            "layers": n_layers,
            "block_size": block_size,
            "num_kv_heads": heads,
            "head_dim": head_dim,
            "bytes": total_raw,
        },
        "threads": args.threads,
        "repeats": args.repeats,
        "results": results,
        "targets": targets,
    }
    if not all(math.isfinite(v) for by in speed.values() for v in by.values()):
        raise SystemExit("non-finite speed")
    return emit_summary(summary)


if __name__ == "__main__":
    raise SystemExit(main())
