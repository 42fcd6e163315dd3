"""vLLM's CPU attention kernel over GSA's replaced metadata equals dense torch attention restricted to the kept blocks.

No engine: a paged cache filled by vLLM's own ``cpu_attn_reshape_and_cache`` (so the in-block layout is the real
one), a batch mixing decode rows (one query each: sparse) and a prefill chunk (dense), the metadata built as vLLM's
builder builds it, then ``sparse_cpu_metadata`` and ``cpu_attention_with_kv_cache``. The reference attends, in
float64, to exactly the tokens of the blocks the selection names, so a wrong block id, a wrong length (partial last
block) or wrong scheduler metadata fails it.

The kernel variant is the one vLLM picks here (``_get_attn_isa``): fp32 runs ``vec``; bf16 runs ``amx`` on a CPU with
AMX tiles (keys read as ``KVLayout.CPU_ATTN_AMX``) and ``vec`` elsewhere.
"""

from __future__ import annotations

import math

import pytest
import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata, _get_attn_isa

from tests.helpers import cpu_attention
from ucm.config import GSAConfig, UcmConfigError
from ucm.integration.vllm.sparse_backend import layout_of_isa, sparse_cpu_metadata
from ucm.kernels.layouts import KVLayout
from ucm.kernels.paged_keys import paged_keys
from ucm.sparse import GSA
from ucm.sparse.gsa import select_reference

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 32  # SmolLM2's attention shape, vLLM's smallest CPU block
NUM_BLOCKS = 80
SEQ_LENS = [700, 300, 420, 97]  # decode, decode, prefill chunk of 6, decode (below min_blocks: dense)
QUERY_LENS = [1, 1, 6, 1]
SCALE = HEAD_DIM**-0.5
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
HAS_AMX = torch.cpu._is_amx_tile_supported()
if HAS_AMX:  # a process may use AMX tiles only after asking Linux (vLLM's amx kernel otherwise dies of SIGILL)
    torch.cpu._init_amx()


def _setup(dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(NUM_BLOCKS, generator=g)
    width = max(math.ceil(n / BLOCK_SIZE) for n in SEQ_LENS)
    table = torch.zeros((len(SEQ_LENS), width), dtype=torch.int32)
    k_all, v_all, q_all, slots = [], [], [], []
    used = 0
    for r, n in enumerate(SEQ_LENS):
        nb = math.ceil(n / BLOCK_SIZE)
        table[r, :nb] = perm[used : used + nb].to(torch.int32)
        used += nb
        # Keys with a per-block offset, so that blocks differ in relevance as in real text.
        k = (
            torch.randn((n, KV_HEADS, HEAD_DIM), generator=g)
            + torch.randn((nb, 1, HEAD_DIM), generator=g).repeat_interleave(BLOCK_SIZE, 0)[:n]
        )
        k_all.append(k.to(dtype))
        v_all.append(torch.randn((n, KV_HEADS, HEAD_DIM), generator=g).to(dtype))
        q_all.append(torch.randn((QUERY_LENS[r], HEADS, HEAD_DIM), generator=g).to(dtype) * 2)
        pos = torch.arange(n)
        slots.append(table[r, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE)
    isa = _get_attn_isa(dtype, BLOCK_SIZE, HEAD_DIM)
    assert isa == ("amx" if HAS_AMX and dtype == torch.bfloat16 else "vec")  # what this test covers
    kv_cache = torch.zeros((NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM), dtype=dtype)
    key_cache, value_cache = kv_cache.view(NUM_BLOCKS, KV_HEADS, 2 * BLOCK_SIZE, HEAD_DIM).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(
        torch.cat(k_all), torch.cat(v_all), key_cache, value_cache, torch.cat(slots), isa, kv_cache_dtype="auto"
    )
    query = torch.cat(q_all)
    qsl = torch.tensor([0, *torch.tensor(QUERY_LENS).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(SEQ_LENS, dtype=torch.int32)
    step_slots = torch.cat([s[-ql:] for s, ql in zip(slots, QUERY_LENS, strict=True)])  # this step's writes
    md = CPUAttentionMetadata(
        num_actual_tokens=query.shape[0],
        max_query_len=max(QUERY_LENS),
        query_start_loc=qsl,
        max_seq_len=max(SEQ_LENS),
        seq_lens=seq_lens,
        block_table=table,
        slot_mapping=step_slots,
        scheduler_metadata=_scheduler(seq_lens, qsl, dtype, isa),
    )
    return kv_cache, key_cache, value_cache, query, md, k_all, v_all, isa


def _scheduler(seq_lens: torch.Tensor, qsl: torch.Tensor, dtype: torch.dtype, isa: str) -> torch.Tensor:
    return ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(SEQ_LENS),
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        seq_lens=seq_lens,
        dtype=dtype,
        query_start_loc=qsl,
        causal=True,
        sliding_window_size=-1,
        isa=isa,
        enable_kv_split=False,
    )


def _attend(md: CPUAttentionMetadata, query, key_cache, value_cache) -> torch.Tensor:
    return cpu_attention(md, query, key_cache, value_cache, SCALE)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tokens: torch.Tensor, n: int) -> torch.Tensor:
    """float64 causal attention of queries at the last ``len(q)`` positions of a length-``n`` sequence, over the
    token positions ``tokens`` only."""
    group = HEADS // KV_HEADS
    kk = k[tokens].double().repeat_interleave(group, 1)  # [t, Hq, D]
    vv = v[tokens].double().repeat_interleave(group, 1)
    qpos = torch.arange(n - q.shape[0], n)
    logits = torch.einsum("qhd,thd->hqt", q.double(), kk) * SCALE
    logits = logits.masked_fill(tokens[None, None, :] > qpos[None, :, None], float("-inf"))
    return torch.einsum("hqt,thd->qhd", torch.softmax(logits, dim=-1), vv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("ratio", [0.3, 0.5, 1.0])
def test_kernel_over_selection_equals_restricted_dense(dtype: torch.dtype, ratio: float) -> None:
    kv_cache, key_cache, value_cache, query, md, k_all, v_all, isa = _setup(dtype)
    table_before, lens_before = md.block_table.clone(), md.seq_lens.clone()
    cfg = GSAConfig(sparse_ratio=ratio, min_blocks=4, block_scoring="key_bounds")  # select_reference's scoring
    method = GSA(cfg)
    summaries = method.new_summaries(NUM_BLOCKS, KV_HEADS, HEAD_DIM, kv_cache.device)
    sparse = sparse_cpu_metadata(method, summaries, md, query, kv_cache, isa=isa, num_heads=HEADS, scale=SCALE)
    assert torch.equal(md.block_table, table_before) and torch.equal(md.seq_lens, lens_before)  # replaced, not mutated
    got = _attend(sparse, query, key_cache, value_cache)

    decode_rows = [r for r, ql in enumerate(QUERY_LENS) if ql == 1]
    starts = md.query_start_loc.tolist()
    want_sel = select_reference(
        query[[starts[r] for r in decode_rows]],
        paged_keys(kv_cache, layout_of_isa(isa)),
        md.block_table[decode_rows],
        md.seq_lens[decode_rows],
        SCALE,
        cfg,
    )
    for r, n in enumerate(SEQ_LENS):
        nb = math.ceil(n / BLOCK_SIZE)
        if QUERY_LENS[r] == 1:
            kept_phys = want_sel[decode_rows.index(r)]
            assert sparse.block_table[r, : len(kept_phys)].tolist() == kept_phys
            if ratio < 1.0 and nb >= cfg.min_blocks:
                assert len(kept_phys) < nb
        else:
            kept_phys = md.block_table[r, :nb].tolist()  # prefill rows stay dense
            assert int(sparse.seq_lens[r]) == n
        logical = [md.block_table[r, :nb].tolist().index(b) for b in kept_phys]
        tokens = torch.cat([torch.arange(w * BLOCK_SIZE, min((w + 1) * BLOCK_SIZE, n)) for w in logical])
        assert int(sparse.seq_lens[r]) == tokens.numel()
        q = query[starts[r] : starts[r + 1]]
        want = _reference(q, k_all[r], v_all[r], tokens, n)
        torch.testing.assert_close(got[starts[r] : starts[r + 1]].double(), want, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("block_scoring", ["attention", "sparq"])
def test_other_scorings_through_the_kernel(block_scoring: str) -> None:
    """The other scorings (their own oracles are in ``tests/sparse``) read this machine's layout too: in bf16 (amx
    where AMX exists) they keep whole blocks, the last one included, and the kernel over the selection equals the
    restricted dense reference."""
    kv_cache, key_cache, value_cache, query, md, k_all, v_all, isa = _setup(torch.bfloat16)
    method = GSA(GSAConfig(sparse_ratio=0.3, min_blocks=4, block_scoring=block_scoring))
    summaries = method.new_summaries(NUM_BLOCKS, KV_HEADS, HEAD_DIM, kv_cache.device)
    sparse = sparse_cpu_metadata(method, summaries, md, query, kv_cache, isa=isa, num_heads=HEADS, scale=SCALE)
    got = _attend(sparse, query, key_cache, value_cache)
    starts = md.query_start_loc.tolist()
    for r, n in enumerate(SEQ_LENS):
        nb = math.ceil(n / BLOCK_SIZE)
        kept_phys = sparse.block_table[r, : math.ceil(int(sparse.seq_lens[r]) / BLOCK_SIZE)].tolist()
        dense = md.block_table[r, :nb].tolist()
        assert kept_phys[-1] == dense[-1] and set(kept_phys) <= set(dense)
        if QUERY_LENS[r] == 1 and nb >= 4:
            assert len(kept_phys) < nb
        logical = [dense.index(b) for b in kept_phys]
        tokens = torch.cat([torch.arange(w * BLOCK_SIZE, min((w + 1) * BLOCK_SIZE, n)) for w in logical])
        want = _reference(query[starts[r] : starts[r + 1]], k_all[r], v_all[r], tokens, n)
        tol = TOL[torch.bfloat16]
        torch.testing.assert_close(got[starts[r] : starts[r + 1]].double(), want, rtol=tol, atol=tol)


def test_warm_up_layout_is_the_one_vllm_will_pick() -> None:
    """At layer construction the wrapper predicts the layout from vLLM's own isa choice (the builder sets
    ``layer.isa`` later), so GSA's warm-up compiles for the cache the engine will have; unknown: no prediction."""
    from types import SimpleNamespace

    from ucm.integration.vllm.sparse_backend import _expected_layout

    config = SimpleNamespace(cache_config=SimpleNamespace(block_size=BLOCK_SIZE))
    amx = KVLayout.CPU_ATTN_AMX if HAS_AMX else KVLayout.CPU_ATTN
    assert _expected_layout(config, torch.bfloat16, HEAD_DIM) == amx
    assert _expected_layout(config, torch.float32, HEAD_DIM) == KVLayout.CPU_ATTN
    assert _expected_layout(config, torch.bfloat16, 80) == KVLayout.CPU_ATTN  # vec16
    assert _expected_layout(SimpleNamespace(cache_config=SimpleNamespace(block_size=None)), torch.float32, 64) is None


def test_isa_layouts_and_refusal() -> None:
    """vec/vec16 read as CPU_ATTN, amx as CPU_ATTN_AMX; any other kernel variant is refused with an error naming it
    and the verified ones, before anything is read."""
    assert layout_of_isa("vec") == layout_of_isa("vec16") == KVLayout.CPU_ATTN
    assert layout_of_isa("amx") == KVLayout.CPU_ATTN_AMX
    kv_cache, _, _, query, md, *_rest = _setup(torch.float32)
    method = GSA(GSAConfig())
    summaries = method.new_summaries(NUM_BLOCKS, KV_HEADS, HEAD_DIM, kv_cache.device)
    for isa in ("neon", None):
        with pytest.raises(
            UcmConfigError, match=rf"kernel variant {isa!r} here; .* only for \['vec', 'vec16', 'amx'\]"
        ):
            sparse_cpu_metadata(method, summaries, md, query, kv_cache, isa=isa, num_heads=HEADS, scale=SCALE)


def test_all_blocks_is_bitwise_dense() -> None:
    kv_cache, key_cache, value_cache, query, md, *_rest, isa = _setup(torch.bfloat16)
    method = GSA(GSAConfig(sparse_ratio=1.0))
    summaries = method.new_summaries(NUM_BLOCKS, KV_HEADS, HEAD_DIM, kv_cache.device)
    sparse = sparse_cpu_metadata(method, summaries, md, query, kv_cache, isa=isa, num_heads=HEADS, scale=SCALE)
    assert sparse is not md
    assert torch.equal(_attend(sparse, query, key_cache, value_cache), _attend(md, query, key_cache, value_cache))
