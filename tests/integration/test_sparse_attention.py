"""vLLM's CPU attention kernel over GSA's replaced metadata equals dense torch attention restricted to the kept blocks.

No engine: a paged cache filled by vLLM's own ``cpu_attn_reshape_and_cache`` (so the in-block layout is the real
one), a batch mixing decode rows (one query each: sparse) and a prefill chunk (dense), the metadata built as vLLM's
builder builds it, then ``sparse_cpu_metadata`` and ``cpu_attention_with_kv_cache``. The reference attends, in
float64, to exactly the tokens of the blocks the selection names, so a wrong block id, a wrong length (partial last
block) or wrong scheduler metadata fails it.
"""

from __future__ import annotations

import math

import pytest
import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata, _get_attn_isa

from ucm.config import GSAConfig
from ucm.integration.vllm.sparse_backend import sparse_cpu_metadata
from ucm.kernels.block_summaries import paged_keys
from ucm.kernels.layouts import KVLayout
from ucm.sparse import GSA
from ucm.sparse.gsa import select_reference

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 32  # SmolLM2's attention shape, vLLM's smallest CPU block
NUM_BLOCKS = 80
SEQ_LENS = [700, 300, 420, 97]  # decode, decode, prefill chunk of 6, decode (below min_blocks: dense)
QUERY_LENS = [1, 1, 6, 1]
SCALE = HEAD_DIM**-0.5
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


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
    out = torch.empty_like(query)
    ops.cpu_attention_with_kv_cache(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        output=out,
        query_start_loc=md.query_start_loc,
        seq_lens=md.seq_lens,
        scale=SCALE,
        causal=md.causal,
        alibi_slopes=None,
        sliding_window=-1,
        block_table=md.block_table,
        softcap=0,
        scheduler_metadata=md.scheduler_metadata,
        s_aux=None,
    )
    return out


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
        _keys_view(kv_cache),
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


def _keys_view(kv_cache: torch.Tensor) -> torch.Tensor:
    return paged_keys(kv_cache, KVLayout.CPU_ATTN)


def test_all_blocks_is_bitwise_dense() -> None:
    kv_cache, key_cache, value_cache, query, md, *_rest, isa = _setup(torch.bfloat16)
    method = GSA(GSAConfig(sparse_ratio=1.0))
    summaries = method.new_summaries(NUM_BLOCKS, KV_HEADS, HEAD_DIM, kv_cache.device)
    sparse = sparse_cpu_metadata(method, summaries, md, query, kv_cache, isa=isa, num_heads=HEADS, scale=SCALE)
    assert sparse is not md
    assert torch.equal(_attend(sparse, query, key_cache, value_cache), _attend(md, query, key_cache, value_cache))
