"""block_summaries (per-block key min/max from the paged cache): every implementation bit-exact against the naive
reference, into NaN-poisoned tables, for CPU_ATTN and FLASH_NHD; the Triton kernel compiled for sm_90 on this CPU.

Min and max never round, so bf16 inputs give exact fp32 results and ``torch.equal`` is the right comparison
(NaN-poisoned rows that are not written must stay NaN; written rows must not).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.kernels.interp import INTERPRETED, needs_interpreter, run_interpreted
from tests.kernels.kv_data import poisoned
from tests.kernels.sm90 import compile_for_sm90
from ucm.kernels.block_summaries import (
    _block_summaries_kernel,
    block_summaries,
    block_summaries_reference,
    paged_keys,
    summaries_kernel_meta,
)
from ucm.kernels.layouts import KVLayout

NUM_BLOCKS = 11
# (block_size, num_kv_heads, head_dim): SmolLM2's, odd head dim, a non-power-of-two block size (FLASH_NHD only:
# CPU_ATTN needs multiples of 32 in vLLM but the kernel does not care).
SHAPES = [(32, 3, 64), (16, 2, 80), (48, 1, 40)]
LAYOUTS = [KVLayout.CPU_ATTN, KVLayout.FLASH_NHD]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
IMPLS = ["torch", pytest.param("triton", marks=needs_interpreter)]  # Triton interpreter on CPU tensors
IDS = [9, 0, 4, 10, 7]


def make_cache(layout: KVLayout, shape: tuple[int, int, int], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    bs, h, d = shape
    g = torch.Generator().manual_seed(seed)
    full = (NUM_BLOCKS, h, bs, 2 * d) if layout == KVLayout.CPU_ATTN else (2, NUM_BLOCKS, bs, h, d)
    return (torch.randn(full, generator=g) * 3).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"bs{s[0]}-h{s[1]}-d{s[2]}")
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.value)
@pytest.mark.parametrize("impl", IMPLS)
def test_matches_reference(impl: str, layout: KVLayout, shape: tuple, dtype: torch.dtype) -> None:
    bs, h, d = shape
    keys = paged_keys(make_cache(layout, shape, dtype), layout)
    ids = torch.tensor(IDS, dtype=torch.int64)
    counts = torch.tensor([bs, 1, bs - 3, 5, bs], dtype=torch.int64)  # full, one token, partial blocks
    kmin, kmax = poisoned((NUM_BLOCKS, h, d), torch.float32), poisoned((NUM_BLOCKS, h, d), torch.float32)
    block_summaries(keys, ids, counts, kmin, kmax, impl=impl)
    want_min, want_max = block_summaries_reference(keys, ids, counts)
    assert torch.equal(kmin[ids], want_min)
    assert torch.equal(kmax[ids], want_max)
    untouched = [b for b in range(NUM_BLOCKS) if b not in IDS]
    assert kmin[untouched].isnan().all() and kmax[untouched].isnan().all()


def test_keys_view_reads_the_cpu_layout() -> None:
    """``paged_keys`` on CPU_ATTN: K stored transposed ``[head_dim, block_size]`` per (block, head)."""
    bs, h, d = 32, 2, 8
    cache = torch.arange(4 * h * bs * 2 * d, dtype=torch.float32).view(4, h, bs, 2 * d)
    keys = paged_keys(cache, KVLayout.CPU_ATTN)
    flat = cache.view(4, h, 2 * bs * d)
    b, hh, t, dd = 3, 1, 5, 6
    assert keys[b, hh, t, dd] == flat[b, hh, dd * bs + t]


def test_errors_name_the_bad_value() -> None:
    keys = paged_keys(make_cache(KVLayout.CPU_ATTN, (32, 3, 64), torch.bfloat16), KVLayout.CPU_ATTN)
    table = torch.zeros((NUM_BLOCKS, 3, 64))
    ids, counts = torch.tensor([1]), torch.tensor([3])
    with pytest.raises(ValueError, match=r"counts must lie in \[1, block_size=32\]"):
        block_summaries(keys, ids, torch.tensor([33]), table, table.clone())
    with pytest.raises(ValueError, match=r"block_ids must lie in \[0, 11\)"):
        block_summaries(keys, torch.tensor([11]), counts, table, table.clone())
    with pytest.raises(ValueError, match="kmin must be a contiguous float32"):
        block_summaries(keys, ids, counts, table.half(), table.clone())
    with pytest.raises(ValueError, match="impl must be one of"):
        block_summaries(keys, ids, counts, table, table.clone(), impl="numba")
    with pytest.raises(ValueError, match="layout 'mla' is not supported"):
        paged_keys(torch.zeros((4, 16, 64)), KVLayout.MLA)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 replaces @triton.jit")
@pytest.mark.parametrize("word", ["bf16", "fp16", "fp32"])
def test_kernel_compiles_for_sm90(word: str) -> None:
    bs, h, d = 128, 8, 128
    const = {"NUM_HEADS": h, "HEAD_DIM": d, "BLOCK_SIZE": bs, **summaries_kernel_meta(bs, d)}
    sig = {
        "k_ptr": f"*{word}",
        "ids_ptr": "*i64",
        "counts_ptr": "*i64",
        "kmin_ptr": "*fp32",
        "kmax_ptr": "*fp32",
        "stride_b": "i64",
        "stride_h": "i64",
        "stride_t": "i64",
        "stride_d": "i64",
        **dict.fromkeys(const, "constexpr"),
    }
    compile_for_sm90(_block_summaries_kernel, sig, const)


@pytest.mark.skipif(INTERPRETED, reason="this is the parent of the interpreted run")
def test_triton_cases_interpreted() -> None:
    """This module's Triton cases, in a child pytest under ``TRITON_INTERPRET=1`` (see ``tests.kernels.interp``)."""
    run_interpreted(__file__, "triton and not compiles and not interpreted and not native")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: native Triton runs only where a GPU exists")
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.value)
def test_native_triton_matches_reference(layout: KVLayout) -> None:
    bs, h, d = 128, 8, 128
    cache = make_cache(layout, (bs, h, d), torch.bfloat16)
    ids = torch.tensor(IDS, dtype=torch.int64)
    counts = torch.tensor([bs, 1, bs - 3, 5, bs], dtype=torch.int64)
    kmin = poisoned((NUM_BLOCKS, h, d), torch.float32).cuda()
    kmax = poisoned((NUM_BLOCKS, h, d), torch.float32).cuda()
    block_summaries(paged_keys(cache.cuda(), layout), ids.cuda(), counts.cuda(), kmin, kmax)  # auto: Triton
    want_min, want_max = block_summaries_reference(paged_keys(cache, layout), ids, counts)
    assert torch.equal(kmin[ids.cuda()].cpu(), want_min) and torch.equal(kmax[ids.cuda()].cpu(), want_max)
