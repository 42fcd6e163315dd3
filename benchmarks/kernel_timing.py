"""Cases and timing shared by the kernel benchmarks: ``benchmarks/kernels.py`` (CLI, JSON summary) and
``benchmarks/bench_block_copy.py`` (pytest-benchmark).

A case is one model's paged KV caches in one layout (block_size 128, random bf16 bit patterns) and ``n`` blocks to
move. Each op is timed against a torch ``copy_`` of the same number of bytes (the size of the canonical staging
tensor, counted once), the two run in alternation so that drift in the machine's state (other jobs, memory
bandwidth) reaches both alike: GB/s is 1e9 bytes/s of the best repeat, ``ratio`` the median over repeats of that
repeat's copy time / op time (op speed as a fraction of the copy's; > 1: faster than the copy).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ucm.kernels import KVLayout, gather_blocks, gather_layers, scatter_blocks, scatter_layers
from ucm.kernels.layouts import CPU_LAYOUTS

BLOCK_SIZE = 128
# layers, KV heads, head_dim (MLA: latent_dim): Llama-3-8B-like (16 MiB per bf16 block), Qwen-32B-like (32 MiB);
# DeepSeek-V2-Lite's MLA (27 layers, latent 512 + 64 RoPE dims: 3.8 MiB), for the MLA layout only.
MODELS = {"llama8b": (32, 8, 128), "qwen32b": (64, 8, 128)}
MLA_MODELS = {"deepseek_v2_lite": (27, 1, 576)}
# The ops and what each moves: every layer of the blocks, or one layer of them (the layerwise unit).
OPS = ("gather_blocks", "scatter_blocks", "gather_layers_1", "scatter_layers_1")
CPU_BENCH_LAYOUTS = (*CPU_LAYOUTS, KVLayout.FLASH_NHD, KVLayout.MLA)
GPU_BENCH_LAYOUTS = (KVLayout.FLASH_NHD, KVLayout.MLA)


def resolve_device(option: str | None) -> torch.device:
    """The benchmark device: ``option`` (``--bench-device``), else CUDA where present, else CPU."""
    return torch.device(option or ("cuda" if torch.cuda.is_available() else "cpu"))


def big_sizes(option: bool) -> bool:
    """Whether to run the full sizes: ``--big`` or ``UCM_BENCH_BIG=1``."""
    return option or os.environ.get("UCM_BENCH_BIG") == "1"


def paged(layout: KVLayout, num_blocks: int, heads: int, dim: int) -> tuple[int, ...]:
    """One layer's paged KV shape in ``layout`` at ``BLOCK_SIZE``."""
    if layout in CPU_LAYOUTS:
        return (num_blocks, heads, BLOCK_SIZE, 2 * dim)
    if layout == KVLayout.MLA:
        return (num_blocks, BLOCK_SIZE, dim)
    return (2, num_blocks, BLOCK_SIZE, heads, dim)


def model_shape(model: str) -> tuple[int, int, int]:
    """``(layers, kv_heads, head_dim)`` of ``model`` (``MODELS`` or ``MLA_MODELS``)."""
    return {**MODELS, **MLA_MODELS}[model]


@dataclass
class Case:
    """One model's caches in one layout and the blocks to move; ``ops[name]``: the op as a call and its staging
    tensor (whose bytes are the bytes moved)."""

    model: str
    blocks: int
    layout: KVLayout
    impl: str
    ops: dict[str, tuple[Callable[[], object], torch.Tensor]]


def make_case(model: str, n: int, layout: KVLayout, device: torch.device, impl: str = "auto") -> Case:
    """``n`` randomly chosen blocks of ``n + 8`` in ``model``'s caches in ``layout``, with staging for each op."""
    layers, heads, dim = model_shape(model)
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
    ops: dict[str, tuple[Callable[[], object], torch.Tensor]] = {
        "gather_blocks": (lambda: gather_blocks(caches, ids, layout, out=blocks, impl=impl), blocks),  # type: ignore[arg-type]
        "scatter_blocks": (lambda: scatter_blocks(blocks, caches, ids, layout, impl=impl), blocks),  # type: ignore[arg-type]
        "gather_layers_1": (lambda: gather_layers(caches[:1], ids, layout, out=one_layer, impl=impl), one_layer),  # type: ignore[arg-type]
        "scatter_layers_1": (lambda: scatter_layers(one_layer, caches[:1], ids, layout, impl=impl), one_layer),  # type: ignore[arg-type]
    }
    return Case(model, n, layout, impl, ops)


def nbytes_of(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def plain_copy(nbytes: int, device: torch.device) -> Callable[[], object]:
    """A torch ``copy_`` of ``nbytes`` bytes between two buffers on ``device``: the baseline of every op."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def synced(fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """``fn`` followed by a device synchronization on CUDA (so a wall clock times the work, not the launch)."""
    if device.type != "cuda":
        return fn

    def run() -> object:
        out = fn()
        torch.cuda.synchronize()
        return out

    return run


def time_once(fn: Callable[[], object], device: torch.device, events: bool = True) -> float:
    """Seconds one call of ``fn`` takes: CUDA events on CUDA (``events``), else ``perf_counter`` around the call
    (and a synchronization on CUDA)."""
    if device.type == "cuda" and events:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    run = synced(fn, device)
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def timed_pair(fns: Sequence[Callable[[], object]], device: torch.device, repeats: int) -> list[list[float]]:
    """Wall times in seconds of each of ``fns``, ``repeats`` each (after one warm-up call each), timed in
    alternation: every repeat runs each once, so that drift in the machine's state (other jobs, memory bandwidth)
    reaches all alike and per-repeat ratios compare like with like."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for k, fn in enumerate(fns):
            times[k].append(time_once(fn, device))
    return times


def figures(nbytes: int, copy_times: Sequence[float], op_times: Sequence[float]) -> dict[str, float]:
    """``gbps`` (best repeat), ``copy_gbps`` and the paired ``ratio`` (median of copy time / op time)."""
    return {
        "gbps": round(nbytes / min(op_times) / 1e9, 2),
        "copy_gbps": round(nbytes / min(copy_times) / 1e9, 2),
        "ratio": round(statistics.median([c / o for c, o in zip(copy_times, op_times, strict=True)]), 3),
    }
