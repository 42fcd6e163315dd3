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
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_timing import MODELS, figures, make_case, nbytes_of, plain_copy, timed_pair

from benchmarks.common import emit_summary, machine_info, utc_now
from ucm.kernels import KVLayout
from ucm.kernels.layouts import CPU_LAYOUTS

OPS = ("gather_blocks", "scatter_blocks", "gather_layers_1")  # this script's cases (bench_block_copy.py: every op)


def run_case(
    model: str, n: int, layout: KVLayout, device: torch.device, repeats: int, impl: str
) -> list[dict[str, object]]:
    case = make_case(model, n, layout, device, impl)
    rows: list[dict[str, object]] = []
    for op in OPS:
        fn, staging = case.ops[op]
        nbytes = nbytes_of(staging)
        copy = plain_copy(nbytes, device)
        copy_times, op_times = timed_pair([copy, fn], device, repeats)
        del copy
        rows.append(
            {
                "op": op,
                "layout": layout.value,
                "model": model,
                "blocks": n,
                "impl": impl,
                "bytes": nbytes,
                **figures(nbytes, copy_times, op_times),
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
        "date": utc_now(),
        "machine": {
            **machine_info(),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
            "cpu_threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        "results": {f"{r['op']}/{r['layout']}/{r['model']}/{r['blocks']}": r for r in rows},
    }
    raise SystemExit(emit_summary(summary))


if __name__ == "__main__":
    main()
