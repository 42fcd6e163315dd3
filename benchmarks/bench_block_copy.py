"""pytest-benchmark of the block-copy ops (``ucm/kernels/block_copy/``; tests: ``tests/kernels/test_block_copy.py``):
every op (``gather_blocks``, ``scatter_blocks``, and ``gather_layers`` / ``scatter_layers`` of one layer) in every
layout of the device (CPU: CPU_ATTN, CPU_ATTN_AMX, FLASH_NHD, MLA; CUDA: FLASH_NHD, MLA) at real model shapes
(``benchmarks/kernel_timing.py``), ``impl="auto"``.

Run ``.venv/bin/python -m pytest benchmarks/ --benchmark-only`` (``--big`` for ``benchmarks/kernels.py``'s sizes;
``--benchmark-autosave`` then ``--benchmark-compare`` to compare runs). Each round times the op after a plain copy
of the same bytes (timed in the round's setup, so the two alternate); ``extra_info`` holds the bytes moved, GB/s of
the best round, the copy's GB/s and the median over rounds of copy time / op time (``ratio``), also printed in a
table at the end of the run.
"""

from __future__ import annotations

import pytest
import torch
from kernel_timing import (
    CPU_BENCH_LAYOUTS,
    GPU_BENCH_LAYOUTS,
    MLA_MODELS,
    MODELS,
    OPS,
    Case,
    big_sizes,
    figures,
    make_case,
    nbytes_of,
    plain_copy,
    resolve_device,
    synced,
    time_once,
)

from ucm.kernels import KVLayout

ROUNDS = 10

# (model, blocks) per layout kind: the default fits a 2-CPU machine in minutes; --big is benchmarks/kernels.py's
# default per device (plus the MLA model at the same block counts).
SIZES = {
    ("cpu", False): {"llama8b": [2, 16], "deepseek_v2_lite": [2, 16]},
    ("cpu", True): {"llama8b": [16, 64], "qwen32b": [16], "deepseek_v2_lite": [16, 64]},
    ("cuda", False): {"llama8b": [16], "deepseek_v2_lite": [16]},
    ("cuda", True): {**{m: [16, 64, 256] for m in MODELS}, "deepseek_v2_lite": [16, 64, 256]},
}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """(op, layout, model, blocks) cases for the chosen device and size, one case's ops in a row (they share the
    caches)."""
    if "op" not in metafunc.fixturenames:
        return
    device = resolve_device(metafunc.config.getoption("--bench-device")).type
    big = big_sizes(bool(metafunc.config.getoption("--big")))
    layouts = GPU_BENCH_LAYOUTS if device == "cuda" else CPU_BENCH_LAYOUTS
    cases = []
    for layout in layouts:
        for model, counts in SIZES[(device, big)].items():
            if (model in MLA_MODELS) != (layout == KVLayout.MLA):
                continue
            for n in counts:
                cases += [pytest.param(op, layout, model, n, id=f"{op}-{layout.value}-{model}-{n}") for op in OPS]
    metafunc.parametrize(("op", "layout", "model", "blocks"), cases)


_last: dict[tuple[str, int, KVLayout, str], Case] = {}


def case_of(model: str, blocks: int, layout: KVLayout, device: torch.device) -> Case:
    """The case's caches, made once for its ops in a row (only the latest case is kept: they are large)."""
    key = (model, blocks, layout, str(device))
    if key not in _last:
        _last.clear()
        _last[key] = make_case(model, blocks, layout, device)
    return _last[key]


def test_block_copy(
    benchmark,  # pytest-benchmark's fixture
    bench_device: torch.device,
    bench_rows: list[dict[str, object]],
    op: str,
    layout: KVLayout,
    model: str,
    blocks: int,
) -> None:
    case = case_of(model, blocks, layout, bench_device)
    fn, staging = case.ops[op]
    nbytes = nbytes_of(staging)
    copy = plain_copy(nbytes, bench_device)
    copy_times: list[float] = []
    benchmark.group = f"{layout.value}-{model}-{blocks}"
    info = {"op": op, "layout": layout.value, "model": model, "blocks": blocks, "impl": case.impl, "bytes": nbytes}
    benchmark.extra_info.update(info, device=str(bench_device))
    benchmark.pedantic(
        synced(fn, bench_device),
        setup=lambda: copy_times.append(time_once(copy, bench_device, events=False)),
        rounds=ROUNDS,
        warmup_rounds=1,
    )
    if benchmark.stats is None:  # --benchmark-disable: ran once, untimed
        return
    op_times = list(benchmark.stats.stats.data)
    row = {**info, **figures(nbytes, copy_times[-len(op_times) :], op_times)}
    benchmark.extra_info.update(row)
    bench_rows.append(row)
