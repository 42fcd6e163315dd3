"""Kernel throughput: gather/scatter of KV blocks against a plain copy of the same bytes.

Run ``python benchmarks/kernels.py [--device cpu|cuda] [--quick]``. For each op (``gather_blocks``,
``scatter_blocks``, ``gather_layers`` of one layer), layout and size it times the op and a contiguous torch
``copy_`` of the same number of bytes in the same run (``--repeats`` each, the two timed in alternation; CUDA
timed with events), and prints a table, then as its LAST line a JSON object: per case the bytes moved, GB/s
(1e9 bytes/s, best repeat; bytes counted once, the size of the canonical staging tensor), the copy's GB/s and
``ratio``: the median over repeats of that repeat's copy time / op time (op speed as a fraction of the copy's,
paired so that machine noise cancels).

Sizes come from real models at block_size 128: Llama-8B-like (32 layers, 8 KV heads, head_dim 128, 16 MiB per
bf16 block) and Qwen-32B-like (64 layers, 8 KV heads, head_dim 128, 32 MiB per block), 16 to 256 blocks. On CPU the
default runs the sizes that fit a small machine's memory (Llama 16 and 64 blocks, Qwen 16); ``--blocks`` overrides.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ucm.kernels import KVLayout, gather_blocks, gather_layers, scatter_blocks
from ucm.kernels.layouts import CPU_LAYOUTS

MODELS = {"llama8b": (32, 8, 128), "qwen32b": (64, 8, 128)}  # layers, kv heads, head_dim
BLOCK_SIZE = 128


def timed_pair(fns: Sequence[Callable[[], object]], device: torch.device, repeats: int) -> list[list[float]]:
    """Wall times in seconds of each of ``fns``, ``repeats`` each (after one warm-up call each), timed in
    alternation: every repeat runs each once, so that drift in the machine's state (other jobs, memory bandwidth)
    reaches all alike and per-repeat ratios compare like with like."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for k, fn in enumerate(fns):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times[k].append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
    return times


def paged(layout: KVLayout, num_blocks: int, heads: int, dim: int) -> tuple[int, ...]:
    if layout in CPU_LAYOUTS:
        return (num_blocks, heads, BLOCK_SIZE, 2 * dim)
    return (2, num_blocks, BLOCK_SIZE, heads, dim)


def run_case(
    model: str, n: int, layout: KVLayout, device: torch.device, repeats: int, impl: str
) -> list[dict[str, object]]:
    layers, heads, dim = MODELS[model]
    num_blocks = n + 8
    caches = [
        torch.randint(-(2**15), 2**15, paged(layout, num_blocks, heads, dim), dtype=torch.int16, device=device).view(
            torch.bfloat16
        )
        for _ in range(layers)
    ]
    ids = torch.randperm(num_blocks, device="cpu")[:n].to(device)
    blocks = gather_blocks(caches, ids, layout, impl=impl)  # type: ignore[arg-type]
    one_layer = gather_layers(caches[:1], ids, layout, impl=impl)  # type: ignore[arg-type]
    rows: list[dict[str, object]] = []
    ops: dict[str, tuple[Callable[[], object], torch.Tensor]] = {
        "gather_blocks": (lambda: gather_blocks(caches, ids, layout, out=blocks, impl=impl), blocks),  # type: ignore[arg-type]
        "scatter_blocks": (lambda: scatter_blocks(blocks, caches, ids, layout, impl=impl), blocks),  # type: ignore[arg-type]
        "gather_layers_1": (lambda: gather_layers(caches[:1], ids, layout, out=one_layer, impl=impl), one_layer),  # type: ignore[arg-type]
    }
    for op, (fn, staging) in ops.items():
        nbytes = staging.numel() * staging.element_size()
        src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
        dst = torch.empty_like(src)

        def copy(src: torch.Tensor = src, dst: torch.Tensor = dst) -> object:
            return dst.copy_(src)

        copy_times, op_times = timed_pair([copy, fn], device, repeats)
        t_copy, t_op = min(copy_times), min(op_times)
        del src, dst
        rows.append(
            {
                "op": op,
                "layout": layout.value,
                "model": model,
                "blocks": n,
                "impl": impl,
                "bytes": nbytes,
                "gbps": round(nbytes / t_op / 1e9, 2),
                "copy_gbps": round(nbytes / t_copy / 1e9, 2),
                "ratio": round(statistics.median([c / o for c, o in zip(copy_times, op_times, strict=True)]), 3),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--blocks", type=int, nargs="*", help="block counts (default: by device)")
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--impl", default="auto", choices=["auto", "triton", "cpu", "torch"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="one small size per model (smoke run)")
    args = parser.parse_args()
    device = torch.device(args.device)
    layouts = [KVLayout.FLASH_NHD] if device.type == "cuda" else [*CPU_LAYOUTS, KVLayout.FLASH_NHD]
    sizes: dict[str, list[int]]
    if args.quick:
        sizes = {m: [16] for m in args.models}
    elif args.blocks:
        sizes = {m: list(args.blocks) for m in args.models}
    elif device.type == "cuda":
        sizes = {m: [16, 64, 256] for m in args.models}
    else:
        sizes = {"llama8b": [16, 64], "qwen32b": [16]}
    rows = []
    for model in args.models:
        for n in sizes.get(model, []):
            for layout in layouts:
                rows.extend(run_case(model, n, layout, device, args.repeats, args.impl))
    print(f"{'op':16} {'layout':12} {'model':8} {'blocks':>6} {'MiB':>8} {'GB/s':>8} {'copy GB/s':>9} {'ratio':>6}")
    for r in rows:
        mib = int(r["bytes"]) / 2**20  # type: ignore[call-overload]
        print(
            f"{r['op']:16} {r['layout']:12} {r['model']:8} {r['blocks']:>6} {mib:>8.1f} {r['gbps']:>8} "
            f"{r['copy_gbps']:>9} {r['ratio']:>6}"
        )
    summary = {
        "benchmark": "kernels",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
            "cpu_threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        "results": {f"{r['op']}/{r['layout']}/{r['model']}/{r['blocks']}": r for r in rows},
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
