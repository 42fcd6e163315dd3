"""sparq_scores (per-block log-sum-exp of logits from a few key components): every implementation against the naive
reference (fp32 tolerance: the component sum is reordered), in vLLM's CPU and FlashAttention layouts, and the
Triton kernel compiled for sm_90."""

from __future__ import annotations

import os

import pytest
import torch

from tests.kernels.interp import INTERPRETED, needs_interpreter, run_interpreted
from tests.kernels.sm90 import compile_for_sm90
from ucm.kernels.block_summaries import paged_keys
from ucm.kernels.layouts import KVLayout
from ucm.kernels.sparq_scores import (
    _key_rows,
    _sparq_lse_kernel,
    sparq_block_lse,
    sparq_block_lse_reference,
    sparq_kernel_meta,
)

NUM_BLOCKS = 23
# (num_heads, num_kv_heads, head_dim, block_size): SmolLM2 at 32-token blocks, MHA with an odd head_dim and block
# size, 8-way GQA at vLLM's CPU block size.
SHAPES = [(9, 3, 64, 32), (4, 4, 40, 24), (8, 1, 128, 128)]
SHAPE_IDS = [f"q{s[0]}-kv{s[1]}-d{s[2]}-bs{s[3]}" for s in SHAPES]
LAYOUTS = [KVLayout.CPU_ATTN, KVLayout.FLASH_NHD]
# (impl, components read): the interpreter runs each program's component loop in Python, so it gets fewer cases.
CASES = [("torch", 1), ("torch", 16), ("torch", 40), ("numba", 1), ("numba", 16), ("numba", 40)]
CASES += [pytest.param("triton", c, marks=needs_interpreter) for c in (3, 16)]  # interpreter on CPU tensors
RTOL, ATOL = 1e-5, 1e-4  # fp32 sums of up to 40 products reordered


def make_inputs(hq: int, h: int, d: int, bs: int, layout: KVLayout, channels: int, seed: int = 0):
    """Paged bf16 keys in ``layout``, 3 rows over a shuffled table of width 6 (lengths: a partial last block, one
    block, the whole width), the chosen components and the (scaled) query values there."""
    g = torch.Generator().manual_seed(seed)
    if layout == KVLayout.CPU_ATTN:
        cache = torch.randn((NUM_BLOCKS, h, bs, 2 * d), generator=g).to(torch.bfloat16)
    else:
        cache = torch.randn((2, NUM_BLOCKS, bs, h, d), generator=g).to(torch.bfloat16)
    keys = paged_keys(cache, layout)
    width = 6
    table = torch.randperm(NUM_BLOCKS, generator=g)[: 3 * width].view(3, width).to(torch.int32)
    table[1, 1:] = -1  # past the row's one block: never read
    seq_lens = torch.tensor([4 * bs + 5, bs, width * bs], dtype=torch.int32)
    chans = torch.stack([torch.randperm(d, generator=g)[:channels] for _ in range(3 * h)]).view(3, h, channels)
    q = torch.randn((3, hq, channels), generator=g) * d**-0.5
    return q, chans, keys, table, seq_lens


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.value)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize(("impl", "channels"), CASES)
def test_matches_reference(impl: str, channels: int, shape: tuple, layout: KVLayout) -> None:
    q, chans, keys, table, lens = make_inputs(*shape, layout, min(channels, shape[2]))
    if impl == "numba" and layout != KVLayout.CPU_ATTN:  # tokens not contiguous: the numba kernel refuses
        with pytest.raises(ValueError, match=r"impl='numba' takes CPU keys .* tokens are contiguous"):
            sparq_block_lse(q, chans, keys, table, lens, impl=impl)
        return
    got = sparq_block_lse(q, chans, keys, table, lens, impl=impl)
    want = sparq_block_lse_reference(q, chans, keys, table, lens)
    assert got.shape == want.shape == (3, shape[0], 6)
    assert torch.equal(torch.isinf(got), torch.isinf(want))  # -inf exactly past each row's blocks
    assert int(torch.isfinite(want).sum()) == shape[0] * (5 + 1 + 6)
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("block_size", [32, 128])
def test_numba_over_many_tiles(dtype: torch.dtype, block_size: int) -> None:
    """The numba kernel over rows of many tiles (256 tokens each), with a partial last block in the middle of a tile,
    a row ending on a tile boundary, and a block whose logits lie far below the rest (its sum underflows against the
    tile's max and is redone with its own), in bf16 and fp32, against the reference."""
    h, hq, d, nb = 3, 9, 64, 80
    g = torch.Generator().manual_seed(1)
    cache = torch.randn((nb, h, block_size, 2 * d), generator=g).to(dtype)
    keys = paged_keys(cache, KVLayout.CPU_ATTN)
    keys[5] = keys[5] * 0 - 300.0  # block 5: every key -300 in every component
    width = 37
    table = torch.randperm(nb, generator=g)[: 2 * width].view(2, width)
    table[0, 11] = 5
    lens = torch.tensor([29 * block_size + 7, (256 // block_size) * 4 * block_size]).clamp(max=width * block_size)
    chans = torch.stack([torch.randperm(d, generator=g)[:16] for _ in range(2 * h)]).view(2, h, 16)
    q = torch.rand((2, hq, 16), generator=g) * d**-0.5 + 0.05  # positive: block 5's logits ~ -300 * 16 * 0.1
    got = sparq_block_lse(q, chans, keys, table, lens, impl="numba")
    want = sparq_block_lse_reference(q, chans, keys, table, lens)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    assert float(want[0, :, 11].max()) < float(want[0, :, 12].min()) - 100  # the underflow case is exercised
    torch.testing.assert_close(got[finite], want[finite], rtol=RTOL, atol=ATOL)


def test_numba_is_the_cpu_default_where_it_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    """``impl="auto"`` on CPU: numba for CPU_ATTN keys (bf16, fp32), torch for fp16 or a layout without contiguous
    tokens; an out-of-range block id is an error before the unchecked kernel runs."""
    import ucm.kernels.sparq_scores as mod

    calls: list[str] = []
    for name in ("_lse_numba", "_lse_torch"):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    q, chans, keys, table, lens = make_inputs(9, 3, 64, 32, KVLayout.CPU_ATTN, 16)
    sparq_block_lse(q, chans, keys, table, lens)
    sparq_block_lse(q, chans, keys.float(), table, lens)  # .float() keeps the strides: still CPU_ATTN
    sparq_block_lse(q, chans, keys.half(), table, lens)
    sparq_block_lse(q, chans, *make_inputs(9, 3, 64, 32, KVLayout.FLASH_NHD, 16)[2:4], lens)
    assert calls == ["_lse_numba", "_lse_numba", "_lse_torch", "_lse_torch"]
    bad = table.clone()
    bad[2, 3] = NUM_BLOCKS
    with pytest.raises(ValueError, match=rf"block_table names blocks in \[\d+, {NUM_BLOCKS}\]; the cache has"):
        sparq_block_lse(q, chans, keys, bad, lens, impl="numba")


def test_cpu_layout_is_read_as_contiguous_runs() -> None:
    """In CPU_ATTN the torch path gathers rows of a 2-D view of the cache (one run of block_size values per block,
    head and component); the view's rows are the keys' components, and the layout without one falls back."""
    keys = make_inputs(9, 3, 64, 32, KVLayout.CPU_ATTN, 16)[2]
    rows = _key_rows(keys)
    assert rows is not None and rows.data_ptr() == keys.data_ptr()
    s0, s1, _, s3 = keys.stride()
    for b, h, c in [(0, 0, 0), (7, 2, 63), (NUM_BLOCKS - 1, 2, 63), (11, 1, 5)]:
        assert torch.equal(rows[(b * s0 + h * s1 + c * s3) // s3], keys[b, h, :, c])
    assert _key_rows(make_inputs(9, 3, 64, 32, KVLayout.FLASH_NHD, 16)[2]) is None


def test_errors_name_the_bad_value() -> None:
    q, chans, keys, table, lens = make_inputs(9, 3, 64, 32, KVLayout.CPU_ATTN, 16)
    with pytest.raises(ValueError, match=r"num_heads \(8\) must be a multiple of num_kv_heads \(3\)"):
        sparq_block_lse(q[:, :8], chans, keys, table, lens)
    with pytest.raises(ValueError, match="q must be float32"):
        sparq_block_lse(q.half(), chans, keys, table, lens)
    bad = chans.clone()
    bad[1, 2, 3] = 64
    with pytest.raises(ValueError, match=r"channels must lie in \[0, 64\) \(head_dim\), got values in \[0, 64\]"):
        sparq_block_lse(q, bad, keys, table, lens)
    with pytest.raises(ValueError, match=r"seq_lens must lie in \[0, 192\]"):
        sparq_block_lse(q, chans, keys, table, torch.tensor([1, 1, 193], dtype=torch.int32))
    with pytest.raises(ValueError, match="impl must be one of"):
        sparq_block_lse(q, chans, keys, table, lens, impl="cuda")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 replaces @triton.jit")
@pytest.mark.parametrize("word", ["bf16", "fp16", "fp32"])
def test_kernel_compiles_for_sm90(word: str) -> None:
    const = sparq_kernel_meta(32, 8, 16)  # a Llama-3-8B-like head layout at FlashAttention's 16-token blocks
    sig = {
        "q_ptr": "*fp32",
        "ch_ptr": "*i64",
        "k_ptr": f"*{word}",
        "table_ptr": "*i32",
        "lens_ptr": "*i32",
        "out_ptr": "*fp32",
        **dict.fromkeys(["stride_kb", "stride_kh", "stride_kt", "stride_kd", "stride_table"], "i64"),
        "W": "i32",
        "C": "i32",
        **dict.fromkeys(const, "constexpr"),
    }
    compile_for_sm90(_sparq_lse_kernel, sig, const)


@pytest.mark.skipif(INTERPRETED, reason="this is the parent of the interpreted run")
def test_triton_cases_interpreted() -> None:
    """This module's Triton cases, in a child pytest under ``TRITON_INTERPRET=1`` (see ``tests.kernels.interp``)."""
    run_interpreted(__file__, "triton and not compiles and not interpreted and not native")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: native Triton runs only where a GPU exists")
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.value)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_native_triton_matches_reference(shape: tuple, layout: KVLayout) -> None:
    q, chans, keys, table, lens = make_inputs(*shape, layout, 16)
    got = sparq_block_lse(q.cuda(), chans.cuda(), keys.cuda(), table.cuda(), lens.cuda()).cpu()  # auto: Triton
    want = sparq_block_lse_reference(q, chans, keys, table, lens)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=RTOL, atol=ATOL)
