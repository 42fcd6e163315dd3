"""block_scores (Quest upper bounds of q.k per block): every implementation against the naive reference (fp32
tolerance: the head_dim sum is reordered), the bound property on real keys, and the Triton kernel compiled for sm_90.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.kernels.interp import INTERPRETED, needs_interpreter, run_interpreted
from tests.kernels.sm90 import compile_for_sm90
from ucm.kernels.key_bounds import block_scores, block_scores_reference
from ucm.kernels.key_bounds.triton import block_scores_kernel, scores_kernel_meta

NUM_BLOCKS = 37
# (num_heads, num_kv_heads, head_dim): SmolLM2 (9/3/64), MHA with an odd head dim, 8-way GQA.
SHAPES = [(9, 3, 64), (4, 4, 80), (8, 1, 128)]
# Triton: the interpreter on CPU tensors; "cpu" runs the torch code; "reference" the oracle through the op's dispatch.
IMPLS = ["torch", "cpu", "reference", pytest.param("triton", marks=needs_interpreter)]
RTOL, ATOL = 1e-5, 1e-4  # fp32 sums of 64-128 products reordered


def make_inputs(hq: int, h: int, d: int, width: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn((3, hq, d), generator=g).to(torch.bfloat16)
    a, b = torch.randn((NUM_BLOCKS, h, d), generator=g), torch.randn((NUM_BLOCKS, h, d), generator=g)
    kmin, kmax = torch.minimum(a, b), torch.maximum(a, b)
    table = torch.randint(0, NUM_BLOCKS, (3, width), generator=g, dtype=torch.int32)
    num_blocks = torch.tensor([width, 1, width - 3], dtype=torch.int32)
    return q, kmin, kmax, table, num_blocks


@pytest.mark.parametrize("width", [5, 300], ids=["w5", "w300"])  # 300 > one program's chunk of blocks
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"q{s[0]}-kv{s[1]}-d{s[2]}")
@pytest.mark.parametrize("impl", IMPLS)
def test_matches_reference(impl: str, shape: tuple, width: int) -> None:
    q, kmin, kmax, table, n = make_inputs(*shape, width)
    got = block_scores(q, kmin, kmax, table, n, impl=impl)
    want = block_scores_reference(q, kmin, kmax, table, n)
    assert got.shape == want.shape
    assert torch.equal(torch.isinf(got), torch.isinf(want))  # -inf exactly past each row's blocks
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("impl", IMPLS)
def test_is_an_upper_bound(impl: str) -> None:
    """For every key in a block, q.k <= the block's bound (computed from that block's own min/max)."""
    g = torch.Generator().manual_seed(1)
    hq, h, d, bs, nb = 6, 2, 32, 16, 8
    keys = torch.randn((nb, h, bs, d), generator=g)
    q = torch.randn((1, hq, d), generator=g)
    table = torch.arange(nb, dtype=torch.int64)[None]
    ub = block_scores(q, keys.amin(2), keys.amax(2), table, torch.tensor([nb]), impl=impl)[0]  # [hq, nb]
    exact = torch.einsum("jd,bjtd->jbt", q[0], keys.repeat_interleave(hq // h, dim=1)).amax(-1)  # [hq, nb]
    assert (exact <= ub + 1e-5).all()


def test_errors_name_the_bad_value() -> None:
    q, kmin, kmax, table, n = make_inputs(9, 3, 64, 5)
    with pytest.raises(ValueError, match=r"num_heads \(8\) must be a multiple of num_kv_heads \(3\)"):
        block_scores(q[:, :8], kmin, kmax, table, n)
    with pytest.raises(ValueError, match="kmin/kmax must be float32"):
        block_scores(q, kmin.half(), kmax, table, n)
    with pytest.raises(ValueError, match=r"num_blocks must lie in \[0, 5\]"):
        block_scores(q, kmin, kmax, table, torch.tensor([6, 1, 1]))
    with pytest.raises(ValueError, match="impl must be one of"):
        block_scores(q, kmin, kmax, table, n, impl="cuda")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 replaces @triton.jit")
@pytest.mark.parametrize("word", ["bf16", "fp16", "fp32"])
def test_kernel_compiles_for_sm90(word: str) -> None:
    const = {"HQ": 32, "NUM_KV_HEADS": 8, "HEAD_DIM": 128, **scores_kernel_meta(128)}
    sig = {
        "q_ptr": f"*{word}",
        "kmin_ptr": "*fp32",
        "kmax_ptr": "*fp32",
        "table_ptr": "*i32",
        "nblocks_ptr": "*i32",
        "out_ptr": "*fp32",
        "stride_table": "i64",
        "W": "i32",
        **dict.fromkeys(const, "constexpr"),
    }
    compile_for_sm90(block_scores_kernel, sig, const)


@pytest.mark.skipif(INTERPRETED, reason="this is the parent of the interpreted run")
def test_triton_cases_interpreted() -> None:
    """This module's Triton cases, in a child pytest under ``TRITON_INTERPRET=1`` (see ``tests.kernels.interp``)."""
    run_interpreted(__file__, "triton and not compiles and not interpreted and not native")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: native Triton runs only where a GPU exists")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"q{s[0]}-kv{s[1]}-d{s[2]}")
def test_native_triton_matches_reference(shape: tuple) -> None:
    q, kmin, kmax, table, n = make_inputs(*shape, 300)
    got = block_scores(q.cuda(), kmin.cuda(), kmax.cuda(), table.cuda(), n.cuda()).cpu()  # auto: Triton
    want = block_scores_reference(q, kmin, kmax, table, n)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=RTOL, atol=ATOL)
