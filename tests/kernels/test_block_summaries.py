"""block_summaries (per-block key min/max from the paged cache): every implementation bit-exact against the naive
reference, into NaN-poisoned tables, for CPU_ATTN, CPU_ATTN_AMX (tiled keys) and FLASH_NHD; the Triton kernel
compiled for sm_90 on this CPU, for plain and tiled keys.

Min and max never round, so bf16 inputs give exact fp32 results and ``torch.equal`` is the right comparison
(NaN-poisoned rows that are not written must stay NaN; written rows must not).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tests.kernels.interp import INTERPRETED, needs_interpreter, run_interpreted
from tests.kernels.kv_data import poisoned
from tests.kernels.sm90 import compile_for_sm90
from ucm.kernels.key_bounds import block_summaries, block_summaries_reference
from ucm.kernels.key_bounds.triton import block_summaries_kernel, summaries_kernel_meta
from ucm.kernels.layouts import KVLayout, cpu_attn_kv_views
from ucm.kernels.paged_keys import paged_keys

NUM_BLOCKS = 11
# (block_size, num_kv_heads, head_dim): SmolLM2's, odd head dim, a non-power-of-two block size (FLASH_NHD only:
# CPU_ATTN needs multiples of 32 in vLLM but the kernel does not care).
SHAPES = [(32, 3, 64), (16, 2, 80), (48, 1, 40)]
LAYOUTS = [KVLayout.CPU_ATTN, KVLayout.FLASH_NHD]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# CPU_ATTN_AMX (vLLM's amx variant): bf16 only, block_size and head_dim multiples of 32.
AMX_SHAPES = [(32, 3, 64), (64, 2, 128)]
AMX_DTYPES = [torch.bfloat16]
# Triton: the interpreter on CPU tensors; "cpu" runs the torch code; "reference" the oracle through the op's dispatch.
IMPLS = ["torch", "cpu", "reference", pytest.param("triton", marks=needs_interpreter)]
IDS = [9, 0, 4, 10, 7]
CPU_LAYOUTS = (KVLayout.CPU_ATTN, KVLayout.CPU_ATTN_AMX)


def _case(layout: KVLayout, shape: tuple[int, int, int], dtype: torch.dtype) -> Any:  # a pytest.param
    bs, h, d = shape
    return pytest.param(layout, shape, dtype, id=f"{layout.value}-bs{bs}-h{h}-d{d}-{str(dtype).split('.')[-1]}")


# (layout, (block_size, num_kv_heads, head_dim), dtype)
CASES = [_case(lay, s, dt) for lay in LAYOUTS for s in SHAPES for dt in DTYPES]
CASES += [_case(KVLayout.CPU_ATTN_AMX, s, dt) for s in AMX_SHAPES for dt in AMX_DTYPES]


def make_cache(layout: KVLayout, shape: tuple[int, int, int], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    bs, h, d = shape
    g = torch.Generator().manual_seed(seed)
    full = (NUM_BLOCKS, h, bs, 2 * d) if layout in CPU_LAYOUTS else (2, NUM_BLOCKS, bs, h, d)
    return (torch.randn(full, generator=g) * 3).to(dtype)


@pytest.mark.parametrize(("layout", "shape", "dtype"), CASES)
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


@pytest.mark.parametrize("impl", IMPLS)
def test_amx_and_cpu_attn_give_the_same_bounds(impl: str) -> None:
    """The same keys stored in CPU_ATTN and in CPU_ATTN_AMX (written through ``cpu_attn_kv_views``) give the same
    bounds, bit for bit."""
    bs, h, d = 64, 2, 128
    want = torch.randn((NUM_BLOCKS, bs, h, d), generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    ids = torch.tensor(IDS, dtype=torch.int64)
    counts = torch.tensor([bs, 1, bs - 3, 17, bs], dtype=torch.int64)
    got = []
    for layout in CPU_LAYOUTS:
        cache = torch.zeros((NUM_BLOCKS, h, bs, 2 * d), dtype=torch.bfloat16)
        k, _ = cpu_attn_kv_views(cache, layout)
        k.copy_(want.view(NUM_BLOCKS, *k.shape[1:]))
        kmin, kmax = poisoned((NUM_BLOCKS, h, d), torch.float32), poisoned((NUM_BLOCKS, h, d), torch.float32)
        block_summaries(paged_keys(cache, layout), ids, counts, kmin, kmax, impl=impl)
        got.append((kmin[ids], kmax[ids]))
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    assert torch.equal(got[0][0][2], want[IDS[2], : bs - 3].float().amin(dim=0))  # block 4: its first bs - 3 tokens


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
    with pytest.raises(ValueError, match=r"keys must be plain .* got 3-D \(11, 3, 64\)"):
        block_summaries(keys[:, :, 0], ids, counts, table, table.clone())


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 replaces @triton.jit")
@pytest.mark.parametrize(("word", "tiling"), [("bf16", "plain"), ("fp16", "plain"), ("fp32", "plain"), ("bf16", "amx")])
def test_kernel_compiles_for_sm90(word: str, tiling: str) -> None:
    bs, h, d = 128, 8, 128
    tile_tokens, tile_dims = (bs, d) if tiling == "plain" else (16, 2)  # CPU_ATTN_AMX: 16-token tiles, dim pairs
    const = {"NUM_HEADS": h, "HEAD_DIM": d, "BLOCK_SIZE": bs, **summaries_kernel_meta(bs, d, tile_tokens, tile_dims)}
    strides = ["stride_b", "stride_h", "stride_tile_t", "stride_t", "stride_tile_d", "stride_d"]
    sig = {
        "k_ptr": f"*{word}",
        "ids_ptr": "*i64",
        "counts_ptr": "*i64",
        "kmin_ptr": "*fp32",
        "kmax_ptr": "*fp32",
        **dict.fromkeys(strides, "i64"),
        **dict.fromkeys(const, "constexpr"),
    }
    compile_for_sm90(block_summaries_kernel, sig, const)


@pytest.mark.skipif(INTERPRETED, reason="this is the parent of the interpreted run")
def test_triton_cases_interpreted() -> None:
    """This module's Triton cases, in a child pytest under ``TRITON_INTERPRET=1`` (see ``tests.kernels.interp``)."""
    run_interpreted(__file__, "triton and not compiles and not interpreted and not native")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: native Triton runs only where a GPU exists")
@pytest.mark.parametrize("layout", [*LAYOUTS, KVLayout.CPU_ATTN_AMX], ids=lambda lay: lay.value)
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
