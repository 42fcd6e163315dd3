"""ReRoPE attention over vLLM's paged CPU KV (``ucm.kernels.rerope.torch``) against the naive oracle: both CPU
layouts (``vec``/``vec16``: CPU_ATTN; ``amx``: CPU_ATTN_AMX), float32 and bf16, plain and leaky ReRoPE, a step that
mixes a chunked prefill and a decode, grouped-query heads, NeoX and GPT-J rotation, a partial rotary_dim."""

from __future__ import annotations

import math

import pytest
import torch

from ucm.kernels.layouts import KVLayout, cpu_attn_kv_views
from ucm.kernels.rerope import rerope_attention_reference, rope_reference
from ucm.kernels.rerope.torch import RequestKV, rerope_paged_attention

HEADS, KV_HEADS, D, BLOCK = 4, 2, 32, 32
BASE = 10000.0
# Per-dtype tolerances: float32 compute throughout; bf16 adds the output's rounding.
TOLERANCES = {torch.float32: 2e-4, torch.bfloat16: 8e-3}


def paged_step(
    dtype: torch.dtype, layout: KVLayout, seq_lens: list[int], query_lens: list[int], neox: bool, rotary_dim: int
) -> dict:
    """A step's inputs as vLLM hands them to attention (q and the cached k rotated by absolute positions, k and v
    written into a paged cache at shuffled blocks), and the pre-RoPE q and k the cached values correspond to."""
    g = torch.Generator().manual_seed(sum(seq_lens) + rotary_dim)
    blocks_per_req = [-(-n // BLOCK) for n in seq_lens]
    num_blocks = sum(blocks_per_req) + 3
    order = torch.randperm(num_blocks, generator=g)
    cache = torch.full((num_blocks, KV_HEADS, BLOCK, 2 * D), float("nan"), dtype=dtype)
    k_view, v_view = cpu_attn_kv_views(cache, layout)
    block_table = torch.zeros((len(seq_lens), max(blocks_per_req)), dtype=torch.int32)
    queries, requests, taken = [], [], 0
    for r, (n, nq) in enumerate(zip(seq_lens, query_lens, strict=True)):
        ids = order[taken : taken + blocks_per_req[r]]
        taken += blocks_per_req[r]
        block_table[r, : len(ids)] = ids.to(torch.int32)
        pos = torch.arange(n)
        k_pre = torch.randn((n, KV_HEADS, D), generator=g, dtype=torch.float64)
        v = torch.randn((n, KV_HEADS, D), generator=g, dtype=torch.float64).to(dtype)
        q_pre = torch.randn((nq, HEADS, D), generator=g, dtype=torch.float64)
        k_rot = rope_reference(k_pre, pos, rotary_dim, BASE, neox).to(dtype)
        q_rot = rope_reference(q_pre, pos[n - nq :], rotary_dim, BASE, neox).to(dtype)
        padded = torch.zeros((len(ids) * BLOCK, KV_HEADS, D), dtype=dtype)
        padded[:n] = k_rot
        k_view[ids.long()] = padded.view(len(ids), *k_view.shape[1:])
        padded = torch.zeros((len(ids) * BLOCK, KV_HEADS, D), dtype=dtype)
        padded[:n] = v
        v_view[ids.long()] = padded.view(len(ids), *v_view.shape[1:])
        queries.append(q_rot)
        # What the cache holds, back at position 0 in float64: the oracle's exact inputs for the stored values.
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
    }


CASES = [
    # (seq_lens, query_lens, window, leaky_factor)
    ([70, 45], [20, 1], 8, math.inf),  # a chunked prefill and a decode, far keys in both
    ([70, 45], [70, 1], 16, 4.0),  # a whole prefill, leaky
    ([33], [33], 1000, math.inf),  # every distance below the window: ordinary RoPE attention
]


# The layouts and dtypes vLLM's CPU kernel variants write: vec (float32, bf16), vec16, amx (bf16 only).
LAYOUT_DTYPES = [(KVLayout.CPU_ATTN, torch.float32), (KVLayout.CPU_ATTN, torch.bfloat16),
                 (KVLayout.CPU_ATTN_AMX, torch.bfloat16)]  # fmt: skip


@pytest.mark.parametrize(("layout", "dtype"), LAYOUT_DTYPES, ids=lambda x: getattr(x, "value", str(x)))
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"seq{c[0]}-q{c[1]}-w{c[2]}-k{c[3]}")
def test_matches_the_oracle(layout: KVLayout, dtype: torch.dtype, case: tuple) -> None:
    seq_lens, query_lens, window, leaky = case
    step = paged_step(dtype, layout, seq_lens, query_lens, neox=True, rotary_dim=D)
    got = rerope_paged_attention(
        step["query"], step["cache"], layout, step["block_table"], step["seq_lens"], step["query_start_loc"],
        window=window, leaky_factor=leaky, base=BASE,
    )  # fmt: skip
    assert got.dtype == dtype and got.shape == step["query"].shape
    starts = step["query_start_loc"].tolist()
    for r, (q_pre, k_pre, v, q_pos, k_pos) in enumerate(step["requests"]):
        want = rerope_attention_reference(q_pre, k_pre, v, q_pos, k_pos, window=window, leaky_factor=leaky, base=BASE)
        torch.testing.assert_close(
            got[starts[r] : starts[r + 1]].double(), want, atol=TOLERANCES[dtype], rtol=TOLERANCES[dtype]
        )


@pytest.mark.parametrize("leaky", [math.inf, 2.0])
@pytest.mark.parametrize("window", [1, 7, 16, 40])
def test_query_chunks_read_only_their_band_and_causal_keys(
    monkeypatch: pytest.MonkeyPatch, window: int, leaky: float
) -> None:
    """Chunks of 8 queries (as a long prefill is scored in chunks of QUERY_CHUNK): the near band, the far keys and
    the keys both near and far for some of a chunk's queries (a window above, at and below the chunk size) give the
    oracle's result, for a whole prefill, a chunked prefill and a decode in one step."""
    import ucm.kernels.rerope.torch as rerope_torch

    monkeypatch.setattr(rerope_torch, "QUERY_CHUNK", 8)
    step = paged_step(torch.float32, KVLayout.CPU_ATTN, [61, 70, 45], [61, 21, 1], neox=True, rotary_dim=D)
    got = rerope_paged_attention(
        step["query"], step["cache"], KVLayout.CPU_ATTN, step["block_table"], step["seq_lens"],
        step["query_start_loc"], window=window, leaky_factor=leaky, base=BASE,
    )  # fmt: skip
    starts = step["query_start_loc"].tolist()
    for r, (q_pre, k_pre, v, q_pos, k_pos) in enumerate(step["requests"]):
        want = rerope_attention_reference(q_pre, k_pre, v, q_pos, k_pos, window=window, leaky_factor=leaky, base=BASE)
        torch.testing.assert_close(got[starts[r] : starts[r + 1]].double(), want, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize(("neox", "rotary_dim"), [(False, D), (True, D // 2)])
def test_gptj_rotation_and_partial_rotary_dim(neox: bool, rotary_dim: int) -> None:
    step = paged_step(torch.float32, KVLayout.CPU_ATTN, [50], [50], neox=neox, rotary_dim=rotary_dim)
    got = rerope_paged_attention(
        step["query"], step["cache"], KVLayout.CPU_ATTN, step["block_table"], step["seq_lens"],
        step["query_start_loc"], window=6, rotary_dim=rotary_dim, base=BASE, neox=neox,
    )  # fmt: skip
    q_pre, k_pre, v, q_pos, k_pos = step["requests"][0]
    want = rerope_attention_reference(
        q_pre, k_pre, v, q_pos, k_pos, window=6, rotary_dim=rotary_dim, base=BASE, neox=neox
    )
    torch.testing.assert_close(got.double(), want, atol=2e-4, rtol=2e-4)


def test_rectification_changes_long_rows_only() -> None:
    """The same step with a window above every distance is ordinary attention; with a small window the long
    request's output differs (the test above would pass for an implementation that ignored the window only if the
    oracle did too: this pins that the rectification does something)."""
    step = paged_step(torch.float32, KVLayout.CPU_ATTN, [70], [10], neox=True, rotary_dim=D)
    args = (step["query"], step["cache"], KVLayout.CPU_ATTN, step["block_table"], step["seq_lens"])
    dense = rerope_paged_attention(*args, step["query_start_loc"], window=10_000, base=BASE)
    rectified = rerope_paged_attention(*args, step["query_start_loc"], window=4, base=BASE)
    assert (dense - rectified).abs().max() > 1e-2


def test_bad_arguments_name_the_value() -> None:
    step = paged_step(torch.float32, KVLayout.CPU_ATTN, [10], [10], neox=True, rotary_dim=D)
    args = (step["query"], step["cache"], KVLayout.CPU_ATTN, step["block_table"], step["seq_lens"])
    with pytest.raises(ValueError, match="window must be >= 1, got 0"):
        rerope_paged_attention(*args, step["query_start_loc"], window=0)
    with pytest.raises(ValueError, match="leaky_factor must be >= 1"):
        rerope_paged_attention(*args, step["query_start_loc"], window=4, leaky_factor=0.5)
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        rerope_paged_attention(*args, step["query_start_loc"], window=4, rotary_dim=3)
    with pytest.raises(ValueError, match="layout must be one of"):
        rerope_paged_attention(step["query"], step["cache"], KVLayout.FLASH_NHD, *args[3:], step["query_start_loc"],
                               window=4)  # fmt: skip


def _rewrite_positions(step: dict, layout: KVLayout, positions: list[int], seed: int) -> None:
    """Give request 0's tokens at ``positions`` new K and V in the paged cache (what a step that recomputes them,
    e.g. after rejected speculative tokens, writes)."""
    g = torch.Generator().manual_seed(seed)
    cache = step["cache"]
    for view in cpu_attn_kv_views(cache, layout):
        for p in positions:
            b = int(step["block_table"][0, p // BLOCK])
            tokens = view[b].reshape(BLOCK, KV_HEADS, D).clone()
            tokens[p % BLOCK] = torch.randn((KV_HEADS, D), generator=g).to(cache.dtype)
            view[b] = tokens.view(view.shape[1:])


@pytest.mark.parametrize(("layout", "dtype"), LAYOUT_DTYPES, ids=lambda x: getattr(x, "value", str(x)))
@pytest.mark.parametrize("leaky", [math.inf, 2.0])
def test_request_kv_kept_across_steps_gives_the_fresh_result_bit_for_bit(
    layout: KVLayout, dtype: torch.dtype, leaky: float
) -> None:
    """One request run step by step (two prefill chunks, decode steps, a step that recomputes its last two tokens
    as after rejected speculative tokens, more decode) with one RequestKV kept across the steps: every step's output
    equals, bit for bit, the same step with nothing kept (every key gathered and re-rotated), and the kept entry
    covers the step's values and far keys and no more."""
    window, total = 8, 90
    step = paged_step(dtype, layout, [total], [total], neox=True, rotary_dim=D)
    kept = RequestKV()
    # (first query position, number of queries): the step's seq_len is their sum.
    schedule = [(0, 40), (40, 20), *[(p, 1) for p in range(60, 75)], (73, 3), *[(p, 1) for p in range(76, total)]]
    for first, n in schedule:
        if (first, n) == (73, 3):
            _rewrite_positions(step, layout, [73, 74], seed=first)
        seq_len = first + n
        args = (step["query"][first:seq_len], step["cache"], layout, step["block_table"])
        lens = (torch.tensor([seq_len], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32))
        fresh = rerope_paged_attention(*args, *lens, window=window, leaky_factor=leaky, base=BASE)
        got = rerope_paged_attention(*args, *lens, window=window, leaky_factor=leaky, base=BASE, request_kv=[kept])
        assert torch.equal(got, fresh), f"step at positions {first}..{seq_len - 1}"
        assert (kept.num_values, kept.num_far) == (seq_len, max(0, seq_len - window))
