"""SparQ (``ucm.kernels.sparq``): ``sparq_block_lse`` (per-block log-sum-exp of logits from a few key components):
every implementation against the naive reference (fp32 tolerance: the component sum is reordered), in vLLM's CPU
layouts (CPU_ATTN, CPU_ATTN_AMX: tiled keys) and FlashAttention's, and the Triton kernel compiled for sm_90 for plain
and tiled keys; ``sparq_query`` (the query step): every implementation against the reference."""

from __future__ import annotations

import os

import pytest
import torch

from tests.kernels.interp import INTERPRETED, needs_interpreter, run_interpreted
from tests.kernels.sm90 import compile_for_sm90
from ucm.kernels.layouts import KVLayout, cpu_attn_kv_views
from ucm.kernels.paged_keys import paged_keys
from ucm.kernels.sparq import (
    cpu_applies,
    sparq_block_lse,
    sparq_block_lse_reference,
    sparq_query,
    sparq_query_reference,
)
from ucm.kernels.sparq.torch import key_rows
from ucm.kernels.sparq.triton import sparq_kernel_meta, sparq_lse_kernel

NUM_BLOCKS = 23
# (num_heads, num_kv_heads, head_dim, block_size): SmolLM2 at 32-token blocks, MHA with an odd head_dim and block
# size, 8-way GQA at vLLM's CPU block size.
SHAPES = [(9, 3, 64, 32), (4, 4, 40, 24), (8, 1, 128, 128)]
LAYOUTS = [KVLayout.CPU_ATTN, KVLayout.FLASH_NHD]
# CPU_ATTN_AMX (vLLM's amx variant, bf16): block_size and head_dim multiples of 32.
AMX_SHAPES = [(9, 3, 64, 32), (8, 2, 128, 64)]
CPU_LAYOUTS = (KVLayout.CPU_ATTN, KVLayout.CPU_ATTN_AMX)


def shape_id(s: tuple[int, int, int, int]) -> str:
    return f"q{s[0]}-kv{s[1]}-d{s[2]}-bs{s[3]}"


SHAPE_IDS = [shape_id(s) for s in SHAPES]
# (layout, shape): every shape in CPU_ATTN and FLASH_NHD, the amx-sized ones in CPU_ATTN_AMX.
LAYOUT_SHAPES = [pytest.param(lay, s, id=f"{lay.value}-{shape_id(s)}") for lay in LAYOUTS for s in SHAPES]
LAYOUT_SHAPES += [pytest.param(KVLayout.CPU_ATTN_AMX, s, id=f"cpu_attn_amx-{shape_id(s)}") for s in AMX_SHAPES]
# (impl, components read): the interpreter runs each program's component loop in Python, so it gets fewer cases.
CASES = [("torch", 1), ("torch", 16), ("torch", 40), ("cpu", 1), ("cpu", 16), ("cpu", 40), ("reference", 16)]
CASES += [pytest.param("triton", c, marks=needs_interpreter) for c in (3, 16)]  # interpreter on CPU tensors
RTOL, ATOL = 1e-5, 1e-4  # fp32 sums of up to 40 products reordered


def make_inputs(hq: int, h: int, d: int, bs: int, layout: KVLayout, channels: int, seed: int = 0):
    """Paged bf16 keys in ``layout``, 3 rows over a shuffled table of width 6 (lengths: a partial last block, one
    block, the whole width), the chosen components and the (scaled) query values there."""
    g = torch.Generator().manual_seed(seed)
    if layout in CPU_LAYOUTS:
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


@pytest.mark.parametrize(("layout", "shape"), LAYOUT_SHAPES)
@pytest.mark.parametrize(("impl", "channels"), CASES)
def test_matches_reference(impl: str, channels: int, shape: tuple, layout: KVLayout) -> None:
    q, chans, keys, table, lens = make_inputs(*shape, layout, min(channels, shape[2]))
    if impl == "cpu" and layout not in CPU_LAYOUTS:  # tokens not contiguous nor in small tiles: numba refuses
        with pytest.raises(ValueError, match=r"impl='cpu' takes CPU keys .* tokens are contiguous"):
            sparq_block_lse(q, chans, keys, table, lens, impl=impl)
        return
    got = sparq_block_lse(q, chans, keys, table, lens, impl=impl)
    want = sparq_block_lse_reference(q, chans, keys, table, lens)
    assert got.shape == want.shape == (3, shape[0], 6)
    assert torch.equal(torch.isinf(got), torch.isinf(want))  # -inf exactly past each row's blocks
    assert int(torch.isfinite(want).sum()) == shape[0] * (5 + 1 + 6)
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(
    ("layout", "dtype"),
    [(KVLayout.CPU_ATTN, torch.bfloat16), (KVLayout.CPU_ATTN, torch.float32), (KVLayout.CPU_ATTN_AMX, torch.bfloat16)],
    ids=["cpu_attn-bf16", "cpu_attn-fp32", "cpu_attn_amx-bf16"],
)
@pytest.mark.parametrize("block_size", [32, 128])
def test_cpu_over_many_tiles(layout: KVLayout, dtype: torch.dtype, block_size: int) -> None:
    """The CPU path's numba kernel over rows of many tiles (256 tokens each), with a partial last block in the middle
    of a tile, a row ending on a tile boundary, and a block whose logits lie far below the rest (its sum underflows
    against the tile's max and is redone with its own), in bf16 and fp32, against the reference."""
    h, hq, d, nb = 3, 9, 64, 80
    g = torch.Generator().manual_seed(1)
    cache = torch.randn((nb, h, block_size, 2 * d), generator=g).to(dtype)
    cpu_attn_kv_views(cache, layout)[0][5] = -300.0  # block 5: every key -300 in every component
    keys = paged_keys(cache, layout)
    width = 37
    table = torch.randperm(nb, generator=g)[: 2 * width].view(2, width)
    table[0, 11] = 5
    lens = torch.tensor([29 * block_size + 7, (256 // block_size) * 4 * block_size]).clamp(max=width * block_size)
    chans = torch.stack([torch.randperm(d, generator=g)[:16] for _ in range(2 * h)]).view(2, h, 16)
    q = torch.rand((2, hq, 16), generator=g) * d**-0.5 + 0.05  # positive: block 5's logits ~ -300 * 16 * 0.1
    got = sparq_block_lse(q, chans, keys, table, lens, impl="cpu")
    want = sparq_block_lse_reference(q, chans, keys, table, lens)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    assert float(want[0, :, 11].max()) < float(want[0, :, 12].min()) - 100  # the underflow case is exercised
    torch.testing.assert_close(got[finite], want[finite], rtol=RTOL, atol=ATOL)


def test_cpu_path_is_the_cpu_default_where_it_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    """``impl="auto"`` on CPU: the numba path for CPU_ATTN keys (bf16, fp32) and CPU_ATTN_AMX keys, torch for fp16 or
    a layout whose tokens are neither contiguous nor in small tiles; an out-of-range block id is an error before the
    unchecked kernel runs."""
    import ucm.kernels.sparq.ops as mod

    calls: list[str] = []
    for name in ("lse_cpu", "lse_torch"):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    q, chans, keys, table, lens = make_inputs(9, 3, 64, 32, KVLayout.CPU_ATTN, 16)
    sparq_block_lse(q, chans, keys, table, lens)
    sparq_block_lse(q, chans, keys.float(), table, lens)  # .float() keeps the strides: still CPU_ATTN
    sparq_block_lse(q, chans, keys.half(), table, lens)
    sparq_block_lse(q, chans, *make_inputs(9, 3, 64, 32, KVLayout.FLASH_NHD, 16)[2:4], lens)
    sparq_block_lse(q, chans, *make_inputs(9, 3, 64, 32, KVLayout.CPU_ATTN_AMX, 16)[2:4], lens)
    assert calls == ["lse_cpu", "lse_cpu", "lse_torch", "lse_torch", "lse_cpu"]
    bad = table.clone()
    bad[2, 3] = NUM_BLOCKS
    with pytest.raises(ValueError, match=rf"block_table names blocks in \[\d+, {NUM_BLOCKS}\]; the cache has"):
        sparq_block_lse(q, chans, keys, bad, lens, impl="cpu")


def test_cpu_layout_is_read_as_contiguous_runs() -> None:
    """In CPU_ATTN the torch path gathers rows of a 2-D view of the cache (one run of block_size values per block,
    head and component); the view's rows are the keys' components, and the layout without one falls back."""
    keys = make_inputs(9, 3, 64, 32, KVLayout.CPU_ATTN, 16)[2]
    rows = key_rows(keys)
    assert rows is not None and rows.data_ptr() == keys.data_ptr()
    s0, s1, _, s3 = keys.stride()
    for b, h, c in [(0, 0, 0), (7, 2, 63), (NUM_BLOCKS - 1, 2, 63), (11, 1, 5)]:
        assert torch.equal(rows[(b * s0 + h * s1 + c * s3) // s3], keys[b, h, :, c])
    assert key_rows(make_inputs(9, 3, 64, 32, KVLayout.FLASH_NHD, 16)[2]) is None
    assert key_rows(make_inputs(9, 3, 64, 32, KVLayout.CPU_ATTN_AMX, 16)[2]) is None  # tiled: the generic path


# (dtype, tokens per tile TT, components per group TD, padding P) of hand-made tiled keys [nb, H, bs/TT, TT, D/TD, TD]
# stored as [nb, H, bs/TT, D/TD, TT, TD + P] from element P on: a tile's run of one component is TT values at stride
# TD + P. For the numba kernel, the first is CPU_ATTN_AMX's case (bf16 at stride 2, read as 32-bit words), the next
# three take its general strided loop (the second: bf16 at stride 2 over an odd number of words); fp32 at stride 2
# over 16 tokens spans more than a cache line, so numba does not take it.
TILINGS = [
    (torch.bfloat16, 16, 2, 0),
    (torch.bfloat16, 16, 1, 1),
    (torch.bfloat16, 8, 4, 0),
    (torch.float32, 4, 2, 1),
    (torch.float32, 16, 1, 1),
]


@pytest.mark.parametrize(
    ("dtype", "tt", "td", "pad"), TILINGS, ids=[f"{str(t[0])[6:]}-tt{t[1]}-td{t[2]}-pad{t[3]}" for t in TILINGS]
)
@pytest.mark.parametrize("impl", ["cpu", "torch"])
def test_tiled_keys_of_any_tiling(impl: str, dtype: torch.dtype, tt: int, td: int, pad: int) -> None:
    """Tiled keys of other tilings than CPU_ATTN_AMX's: the CPU paths against the reference."""
    hq, h, d, bs, nb = 6, 2, 32, 32, NUM_BLOCKS
    g = torch.Generator().manual_seed(3)
    buf = torch.randn((nb, h, bs // tt, d // td, tt, td + pad), generator=g).to(dtype)
    keys = buf[..., pad:].permute(0, 1, 2, 4, 3, 5)  # [nb, H, bs/TT, TT, D/TD, TD]
    assert cpu_applies(keys) == ((tt - 1) * (td + pad) * keys.element_size() < 64)
    q, chans, _, table, lens = make_inputs(hq, h, d, bs, KVLayout.CPU_ATTN, 12)
    if impl == "cpu" and not cpu_applies(keys):
        with pytest.raises(ValueError, match="impl='cpu' takes CPU keys"):
            sparq_block_lse(q, chans, keys, table, lens, impl=impl)
        return
    got = sparq_block_lse(q, chans, keys, table, lens, impl=impl)
    want = sparq_block_lse_reference(q, chans, keys, table, lens)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("impl", ["cpu", "torch", pytest.param("triton", marks=needs_interpreter)])
def test_amx_and_cpu_attn_give_the_same_scores(impl: str) -> None:
    """The same keys stored in CPU_ATTN and in CPU_ATTN_AMX (written through ``cpu_attn_kv_views``) give the same
    log-sum-exps up to fp32 rounding (the numba kernel's gather differs: contiguous runs vs 16-token tiles); the CPU
    path takes both layouts."""
    hq, h, d, bs = 8, 2, 128, 64
    q, chans, _, table, lens = make_inputs(hq, h, d, bs, KVLayout.CPU_ATTN, 16)
    want = torch.randn((NUM_BLOCKS, bs, h, d), generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    got = []
    for layout in CPU_LAYOUTS:
        cache = torch.zeros((NUM_BLOCKS, h, bs, 2 * d), dtype=torch.bfloat16)
        k, _ = cpu_attn_kv_views(cache, layout)
        k.copy_(want.view(NUM_BLOCKS, *k.shape[1:]))
        keys = paged_keys(cache, layout)
        assert cpu_applies(keys)
        got.append(sparq_block_lse(q, chans, keys, table, lens, impl=impl))
    assert torch.equal(torch.isinf(got[0]), torch.isinf(got[1]))
    finite = torch.isfinite(got[0])
    torch.testing.assert_close(got[1][finite], got[0][finite], rtol=RTOL, atol=ATOL)


QUERY_SHAPES = [(3, 9, 64, 16), (2, 8, 40, 40), (4, 4, 32, 1)]  # (num_kv_heads, num_heads, head_dim, channels)


def query_inputs(h: int, hq: int, d: int) -> torch.Tensor:
    """bf16-valued float32 decode queries of 5 rows; row 2's first KV head has all-zero query heads (the share clamps,
    nothing divides by zero)."""
    q = torch.randn((5, hq, d), generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).float()
    q[2, : hq // h] = 0.0
    return q


def by_component(idx: torch.Tensor, q_r: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(idx, q_r)`` with each KV head's components sorted (components of equal ``|q|`` may come in another
    order), each query head's values following its KV head's."""
    idx, order = idx.sort(dim=-1)
    per_head = order.repeat_interleave(group, dim=1)  # [R, HQ, C]: each query head follows its KV head
    return idx, q_r.gather(2, per_head)


@pytest.mark.parametrize(("h", "hq", "d", "channels"), QUERY_SHAPES)
@pytest.mark.parametrize("impl", ["cpu", "torch", "reference"])
def test_sparq_query_matches_reference(impl: str, h: int, hq: int, d: int, channels: int) -> None:
    """Every implementation of the query step picks the reference's components (compared sorted) and scales them
    alike (fp32 rounding)."""
    q = query_inputs(h, hq, d)
    got_q, got_idx = sparq_query(q, h, channels, d**-0.5, impl=impl)  # type: ignore[arg-type]
    want_q, want_idx = sparq_query_reference(q, h, channels, d**-0.5)
    assert got_q.dtype == torch.float32 and got_idx.dtype == torch.int64
    assert got_q.shape == want_q.shape == (5, hq, min(channels, d)) and got_idx.shape == (5, h, min(channels, d))
    got_idx, got_q = by_component(got_idx, got_q, hq // h)
    want_idx, want_q = by_component(want_idx, want_q, hq // h)
    rows = [0, 1, 3, 4]  # row 2's first KV head: every |q| is 0, any components are right
    assert torch.equal(got_idx[rows], want_idx[rows]) and torch.equal(got_idx[2, 1:], want_idx[2, 1:])
    torch.testing.assert_close(got_q, want_q, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("h", "hq", "d", "channels"), QUERY_SHAPES)
def test_cpu_sparq_query_is_the_torch_one(h: int, hq: int, d: int, channels: int) -> None:
    """SparQ's query step in numba (the fused CPU selection's first step) picks the torch path's components and
    scales them alike (fp32 rounding); components of equal ``|q|`` may come in another order (compared sorted)."""
    q = query_inputs(h, hq, d)
    want_q, want_idx = sparq_query(q, h, channels, d**-0.5, impl="torch")
    got_q, got_idx = sparq_query(q, h, channels, d**-0.5, impl="cpu")
    got_idx, got_q = by_component(got_idx, got_q, hq // h)
    want_idx, want_q = by_component(want_idx, want_q, hq // h)
    rows = [0, 1, 3, 4]  # row 2's first KV head: every |q| is 0, any components are right
    assert torch.equal(got_idx[rows], want_idx[rows]) and torch.equal(got_idx[2, 1:], want_idx[2, 1:])
    torch.testing.assert_close(got_q, want_q, rtol=1e-6, atol=1e-6)


def test_sparq_query_errors_name_the_bad_value() -> None:
    q = query_inputs(3, 9, 64)
    with pytest.raises(ValueError, match=r"sparq_query has no 'triton' implementation; impl must be one of"):
        sparq_query(q, 3, 16, 0.125, impl="triton")
    with pytest.raises(ValueError, match=r"impl must be one of .*got 'numba'"):
        sparq_query(q, 3, 16, 0.125, impl="numba")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"num_heads a multiple of num_kv_heads \(2\), got \(5, 9, 64\)"):
        sparq_query(q, 2, 16, 0.125)


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
@pytest.mark.parametrize(("word", "tiling"), [("bf16", "plain"), ("fp16", "plain"), ("fp32", "plain"), ("bf16", "amx")])
def test_kernel_compiles_for_sm90(word: str, tiling: str) -> None:
    # A Llama-3-8B-like head layout at FlashAttention's 16-token blocks (plain keys), or at 32-token blocks of
    # CPU_ATTN_AMX's tiles of 16 tokens and component pairs.
    const = sparq_kernel_meta(32, 8, 16, 16, 128, 16) if tiling == "plain" else sparq_kernel_meta(32, 8, 32, 16, 2, 16)
    strides = ["stride_kb", "stride_kh", "stride_ktt", "stride_kt", "stride_kdd", "stride_kd", "stride_table"]
    sig = {
        "q_ptr": "*fp32",
        "ch_ptr": "*i64",
        "k_ptr": f"*{word}",
        "table_ptr": "*i32",
        "lens_ptr": "*i32",
        "out_ptr": "*fp32",
        **dict.fromkeys(strides, "i64"),
        "W": "i32",
        **dict.fromkeys(const, "constexpr"),
    }
    compile_for_sm90(sparq_lse_kernel, sig, const)


@pytest.mark.skipif(INTERPRETED, reason="this is the parent of the interpreted run")
def test_triton_cases_interpreted() -> None:
    """This module's Triton cases, in a child pytest under ``TRITON_INTERPRET=1`` (see ``tests.kernels.interp``)."""
    run_interpreted(__file__, "triton and not compiles and not interpreted and not native")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: native Triton runs only where a GPU exists")
@pytest.mark.parametrize(("layout", "shape"), LAYOUT_SHAPES)
def test_native_triton_matches_reference(shape: tuple, layout: KVLayout) -> None:
    q, chans, keys, table, lens = make_inputs(*shape, layout, 16)
    got = sparq_block_lse(q.cuda(), chans.cuda(), keys.cuda(), table.cuda(), lens.cuda()).cpu()  # auto: Triton
    want = sparq_block_lse_reference(q, chans, keys, table, lens)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=RTOL, atol=ATOL)
