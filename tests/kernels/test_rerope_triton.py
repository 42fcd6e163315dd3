"""ReRoPE attention in Triton over FlashAttention's paged KV (``ucm.kernels.rerope.triton``): the kernel in the
interpreter (a child pytest with ``TRITON_INTERPRET=1``) against the naive float64 oracle, in float32, bf16 and
fp16, plain and leaky ReRoPE, a step that mixes a chunked prefill and a decode, grouped-query heads, NeoX and GPT-J
rotation, a partial rotary_dim, odd head and block sizes; the host's angle tables at long positions; the kernel
compiled for sm_90; the argument errors."""

from __future__ import annotations

import math

import pytest
import torch

from tests.kernels.interp import INTERPRETED, needs_interpreter, run_interpreted
from tests.kernels.sm90 import compile_for_sm90
from ucm.kernels.layouts import KVLayout
from ucm.kernels.rerope import rerope_attention_reference, rope_reference
from ucm.kernels.rerope import triton as rerope_triton
from ucm.kernels.rerope.triton import (
    angle_tables,
    rerope_attention_kernel,
    rerope_kernel_meta,
    rerope_paged_attention_triton,
)

BASE = 10000.0
# Per-dtype tolerances: float32 throughout; 16-bit operands of the matrix products (re-rotated q and k, the
# probabilities) and the output's rounding.
TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 2e-3}
DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def paged_step(
    dtype: torch.dtype,
    seq_lens: list[int],
    query_lens: list[int],
    *,
    heads: int = 6,
    kv_heads: int = 2,
    head_dim: int = 16,
    block_size: int = 16,
    rotary_dim: int | None = None,
    neox: bool = True,
) -> dict:
    """A step's inputs as vLLM hands them to attention: q and the cached k rotated by absolute positions, k and v
    written into a FLASH_NHD cache at shuffled blocks (the rest NaN: never read), and the pre-RoPE q and k the
    stored values correspond to (rotated back in float64: the oracle's exact inputs)."""
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    g = torch.Generator().manual_seed(sum(seq_lens) + rotary_dim + head_dim)
    blocks_per_req = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_req) + 3
    order = torch.randperm(num_blocks, generator=g)
    cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    width = max(blocks_per_req) + 1  # one unused column: the table is wider than any request
    block_table = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    queries, requests, taken = [], [], 0
    for r, (n, nq) in enumerate(zip(seq_lens, query_lens, strict=True)):
        ids = order[taken : taken + blocks_per_req[r]]
        taken += blocks_per_req[r]
        block_table[r, : len(ids)] = ids.to(torch.int32)
        pos = torch.arange(n)
        k_rot = rope_reference(torch.randn((n, kv_heads, head_dim), generator=g), pos, rotary_dim, BASE, neox)
        v = torch.randn((n, kv_heads, head_dim), generator=g).to(dtype)
        q_rot = rope_reference(torch.randn((nq, heads, head_dim), generator=g), pos[n - nq :], rotary_dim, BASE, neox)
        k_rot, q_rot = k_rot.to(dtype), q_rot.to(dtype)
        for t in range(n):  # token t of the request: slot t % block_size of its block t // block_size
            cache[0, ids[t // block_size], t % block_size] = k_rot[t]
            cache[1, ids[t // block_size], t % block_size] = v[t]
        queries.append(q_rot)
        requests.append(
            (
                rope_reference(q_rot, -pos[n - nq :].double(), rotary_dim, BASE, neox),
                rope_reference(k_rot, -pos.double(), rotary_dim, BASE, neox),
                v,
                pos[n - nq :],
                pos,
            )
        )
    starts = torch.tensor([0, *torch.cumsum(torch.tensor(query_lens), 0).tolist()], dtype=torch.int32)
    return {
        "query": torch.cat(queries),
        "cache": cache,
        "block_table": block_table,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "query_start_loc": starts,
        "requests": requests,
        "rotary_dim": rotary_dim,
        "neox": neox,
    }


def run_step(step: dict, window: int, leaky: float = math.inf) -> torch.Tensor:
    """The kernel on ``step`` into an output filled with NaN (a row it forgot to write fails the comparison)."""
    out = torch.full_like(step["query"], float("nan"))
    got = rerope_paged_attention_triton(
        step["query"], step["cache"], KVLayout.FLASH_NHD, step["block_table"], step["seq_lens"],
        step["query_start_loc"], window=window, leaky_factor=leaky, rotary_dim=step["rotary_dim"], base=BASE,
        neox=step["neox"], out=out,
    )  # fmt: skip
    assert got is out
    return got


def check_against_oracle(step: dict, got: torch.Tensor, window: int, leaky: float = math.inf) -> None:
    tol = TOLERANCES[got.dtype]
    starts = step["query_start_loc"].tolist()
    for r, (q_pre, k_pre, v, q_pos, k_pos) in enumerate(step["requests"]):
        want = rerope_attention_reference(
            q_pre, k_pre, v, q_pos, k_pos, window=window, leaky_factor=leaky, rotary_dim=step["rotary_dim"],
            base=BASE, neox=step["neox"],
        )  # fmt: skip
        torch.testing.assert_close(got[starts[r] : starts[r + 1]].double(), want, atol=tol, rtol=tol)


# (seq_lens, query_lens, window, leaky_factor)
CASES = [
    ([70, 45], [20, 1], 8, math.inf),  # a chunked prefill and a decode, far keys in both; rows in all three runs
    ([60, 37], [60, 1], 16, 4.0),  # a whole prefill, leaky
    ([33], [33], 1000, math.inf),  # shorter than the window: ordinary (dense) RoPE attention
]


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"seq{c[0]}-q{c[1]}-w{c[2]}-k{c[3]}")
def test_interp_matches_the_oracle(dtype: torch.dtype, case: tuple) -> None:
    seq_lens, query_lens, window, leaky = case
    step = paged_step(dtype, seq_lens, query_lens)
    got = run_step(step, window, leaky)
    assert got.dtype == dtype and got.shape == step["query"].shape
    check_against_oracle(step, got, window, leaky)


# (heads, kv_heads, head_dim, block_size, rotary_dim, neox)
SHAPES = [
    (4, 4, 32, 16, 32, False),  # MHA, GPT-J rotation
    (8, 1, 32, 16, 16, True),  # 8-way GQA (one KV head), partial rotary_dim
    (3, 1, 24, 24, 8, False),  # head_dim and block_size not powers of two, GPT-J on a partial rotary_dim
]


@needs_interpreter
@pytest.mark.parametrize(
    "shape", SHAPES, ids=lambda s: f"q{s[0]}-kv{s[1]}-d{s[2]}-bs{s[3]}-rot{s[4]}-{'neox' if s[5] else 'gptj'}"
)
def test_interp_shapes_and_rotations(shape: tuple) -> None:
    heads, kv_heads, head_dim, block_size, rotary_dim, neox = shape
    step = paged_step(
        torch.float32, [50, 29], [18, 1], heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
        rotary_dim=rotary_dim, neox=neox,
    )  # fmt: skip
    # The query as a view of a wider tensor (vLLM's q of a fused qkv projection: rows strided), no out given.
    q = step["query"]
    query = torch.cat((q, torch.full_like(q, float("nan"))), dim=1)[:, : q.shape[1]]
    got = rerope_paged_attention_triton(
        query, step["cache"], KVLayout.FLASH_NHD, step["block_table"], step["seq_lens"], step["query_start_loc"],
        window=6, leaky_factor=8.0, rotary_dim=rotary_dim, base=BASE, neox=neox,
    )  # fmt: skip
    assert got.is_contiguous()
    check_against_oracle(step, got, 6, 8.0)


@needs_interpreter
@pytest.mark.parametrize("leaky", [math.inf, 3.0], ids=["plain", "leaky"])
def test_interp_coarse_angles(monkeypatch: pytest.MonkeyPatch, leaky: float) -> None:
    """With 8-position fine tables every angle combines a coarse and a fine row (the default tile exceeds these
    positions)."""
    monkeypatch.setattr(rerope_triton, "ANGLE_TILE", 8)
    step = paged_step(torch.float32, [70, 45], [20, 1])
    check_against_oracle(step, run_step(step, 8, leaky), 8, leaky)


@needs_interpreter
def test_interp_rectification_changes_long_rows_only() -> None:
    """A small window changes the output of every row with a key beyond it and of no other (row 12's farthest key
    sits at the window: the same relative position either way)."""
    step = paged_step(torch.float32, [40], [40])
    dense, rectified = run_step(step, 1000), run_step(step, 12)
    assert torch.equal(dense[:12], rectified[:12])  # rows 0..11: every distance below the window
    assert (dense[13:] - rectified[13:]).abs().amax(dim=(1, 2)).min() > 1e-4


@pytest.mark.parametrize("leaky", [math.inf, 16.0, 1.0], ids=["plain", "leaky16", "rope"])
def test_angle_tables_at_long_positions(leaky: float) -> None:
    """The kernel's angles, a coarse and a fine float32 table row combined, against float64 angles at positions up
    to ~1.3e5: within a few float32 roundings."""
    rotary_dim, window = 128, 512
    inv_k = 0.0 if math.isinf(leaky) else 1.0 / leaky
    fine, k_coarse, q_coarse = angle_tables(131072, rotary_dim, BASE, inv_k, window, torch.device("cpu"))
    tile = rerope_triton.ANGLE_TILE
    pos = torch.tensor([0, 1, tile - 1, tile, 4097, 65535, 99991, 131071])
    inv_freq = BASE ** (-torch.arange(rotary_dim // 2, dtype=torch.float64) * 2 / rotary_dim)
    for coarse, offset in ((k_coarse, 0.0), (q_coarse, window * (1 - inv_k))):
        c, f = coarse[pos // tile].double(), fine[pos % tile].double()  # [n, 2, half]
        cos = c[:, 0] * f[:, 0] - c[:, 1] * f[:, 1]
        sin = c[:, 1] * f[:, 0] + c[:, 0] * f[:, 1]
        angle = (offset + pos.double() * (inv_k - 1))[:, None] * inv_freq[None, :]
        assert (cos - angle.cos()).abs().max() < 5e-7 and (sin - angle.sin()).abs().max() < 5e-7


@pytest.mark.skipif(INTERPRETED, reason="TRITON_INTERPRET=1 replaces @triton.jit")
@pytest.mark.parametrize(
    ("word", "head_dim", "max_query_len"),
    [("bf16", 128, 512), ("bf16", 64, 1), ("fp16", 128, 1), ("fp16", 64, 512), ("fp32", 128, 512)],
    ids=["bf16-d128-prefill", "bf16-d64-decode", "fp16-d128-decode", "fp16-d64-prefill", "fp32-d128-prefill"],
)
def test_kernel_compiles_for_sm90(word: str, head_dim: int, max_query_len: int) -> None:
    # Llama-3-8B-like heads (32 query heads over 8 KV heads) at FlashAttention's 16-token blocks, NeoX rotation; a
    # decode (16 rows: 4 tokens of 4 heads) and a prefill chunk (64 rows) per program.
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[word]
    const = rerope_kernel_meta(32, 8, head_dim, 16, head_dim, True, max_query_len, dtype)
    strides = ["stride_qt", "stride_qh", "stride_kv", "stride_kb", "stride_kt", "stride_kh", "stride_ot", "stride_oh"]
    sig = {
        "q_ptr": f"*{word}",
        "kv_ptr": f"*{word}",
        "table_ptr": "*i32",
        "lens_ptr": "*i32",
        "starts_ptr": "*i32",
        "fine_ptr": "*fp32",
        "k_coarse_ptr": "*fp32",
        "q_coarse_ptr": "*fp32",
        "out_ptr": f"*{word}",
        **dict.fromkeys(strides, "i64"),
        "stride_table": "i32",
        "window": "i32",
        "qk_scale": "fp32",
        **dict.fromkeys(const, "constexpr"),
    }
    compile_for_sm90(rerope_attention_kernel, sig, const)


def test_bad_arguments_name_the_value() -> None:
    step = paged_step(torch.float32, [10], [10])
    q, cache, table, lens, starts = (step[k] for k in ("query", "cache", "block_table", "seq_lens", "query_start_loc"))
    nhd = KVLayout.FLASH_NHD
    with pytest.raises(ValueError, match="window must be >= 1, got 0"):
        rerope_paged_attention_triton(q, cache, nhd, table, lens, starts, window=0)
    with pytest.raises(ValueError, match=r"leaky_factor must be >= 1 \(inf: plain ReRoPE, 1: RoPE\), got 0.5"):
        rerope_paged_attention_triton(q, cache, nhd, table, lens, starts, window=4, leaky_factor=0.5)
    with pytest.raises(ValueError, match=r"rotary_dim must be even, >= 2 and <= head_dim \(16\), got 3"):
        rerope_paged_attention_triton(q, cache, nhd, table, lens, starts, window=4, rotary_dim=3)
    with pytest.raises(ValueError, match=r"rotary_dim must be even, >= 2 and <= head_dim \(16\), got 18"):
        rerope_paged_attention_triton(q, cache, nhd, table, lens, starts, window=4, rotary_dim=18)
    with pytest.raises(ValueError, match=r"layout must be flash_nhd, got <KVLayout\.CPU_ATTN"):
        rerope_paged_attention_triton(q, cache, KVLayout.CPU_ATTN, table, lens, starts, window=4)
    with pytest.raises(ValueError, match=r"FLASH_NHD KV must be \[2, num_blocks, block_size, num_kv_heads, head_dim\]"):
        rerope_paged_attention_triton(q, cache[0], nhd, table, lens, starts, window=4)
    with pytest.raises(ValueError, match="num_heads 5 is not a multiple of num_kv_heads 2"):
        rerope_paged_attention_triton(q[:, :5], cache, nhd, table, lens, starts, window=4)
    with pytest.raises(ValueError, match=r"query must be \[num_tokens, num_heads, 16\], got \(10, 6, 8\)"):
        rerope_paged_attention_triton(q[..., :8], cache, nhd, table, lens, starts, window=4)
    with pytest.raises(ValueError, match=r"share one dtype of .*got torch.bfloat16 and torch.float32"):
        rerope_paged_attention_triton(q.bfloat16(), cache, nhd, table, lens, starts, window=4)
    with pytest.raises(ValueError, match=r"share one dtype of \['torch.float16', .*got torch.float64"):
        rerope_paged_attention_triton(q.double(), cache.double(), nhd, table, lens, starts, window=4)
    with pytest.raises(ValueError, match=r"query_start_loc must be \[2\], got \[3\]"):
        rerope_paged_attention_triton(q, cache, nhd, table, lens, torch.tensor([0, 5, 10]), window=4)
    with pytest.raises(ValueError, match=r"block_table must be an int32/int64 tensor of 2 dims on cpu, got torch.flo"):
        rerope_paged_attention_triton(q, cache, nhd, table.float(), lens, starts, window=4)
    with pytest.raises(ValueError, match=r"block_table must be \[1, \*\], got \[2, 2\]"):
        rerope_paged_attention_triton(q, cache, nhd, table.repeat(2, 1), lens, starts, window=4)
    with pytest.raises(ValueError, match=r"out must be \(10, 6, 16\) torch.float32 on cpu .*got \(10, 6, 16\) torch"):
        rerope_paged_attention_triton(q, cache, nhd, table, lens, starts, window=4, out=torch.empty_like(q).half())


@pytest.mark.skipif(INTERPRETED, reason="this is the parent of the interpreted run")
def test_triton_cases_interpreted() -> None:
    """This module's Triton cases, in a child pytest under ``TRITON_INTERPRET=1`` (see ``tests.kernels.interp``)."""
    run_interpreted(__file__, "interp_")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: native Triton runs only where a GPU exists")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"seq{c[0]}-q{c[1]}-w{c[2]}-k{c[3]}")
def test_native_triton_matches_the_oracle(dtype: torch.dtype, case: tuple) -> None:
    seq_lens, query_lens, window, leaky = case
    step = paged_step(dtype, seq_lens, query_lens, heads=32, kv_heads=8, head_dim=128)
    for key in ("query", "cache", "block_table", "seq_lens", "query_start_loc"):
        step[key] = step[key].cuda()
    check_against_oracle(step, run_step(step, window, leaky).cpu(), window, leaky)
