"""GSA on plain tensors: summaries, selection against a row-by-row reference, table compaction, freshness; the same
selections from keys in vLLM's two CPU layouts (CPU_ATTN and CPU_ATTN_AMX's tiled keys)."""

from __future__ import annotations

import math

import pytest
import torch

from ucm.config import GSAConfig
from ucm.kernels.layouts import KVLayout, cpu_attn_kv_views
from ucm.kernels.paged_keys import paged_keys
from ucm.sparse import GSA, compact_block_table, invalidate_blocks, make_method
from ucm.sparse.gsa import select_reference
from ucm.sparse.selection import kept_blocks

NUM_BLOCKS = 61
# (num_kv_heads, num_heads, head_dim, block_size): SmolLM2's heads, a 4-way GQA with odd head_dim, MHA.
SHAPES = [(3, 9, 64, 32), (2, 8, 40, 48), (4, 4, 32, 16)]
SHAPE_IDS = [f"kv{h}-q{hq}-d{d}-bs{bs}" for h, hq, d, bs in SHAPES]
# Key-bounds scoring (the oracle ``select_reference`` computes it); the sparq tests below switch the scoring.
CONFIGS = [
    GSAConfig(sparse_ratio=0.3, block_scoring="key_bounds"),
    GSAConfig(sparse_ratio=0.5, init_window_sz=2, local_window_sz=3, min_blocks=8, block_scoring="key_bounds"),
    GSAConfig(sparse_ratio=0.1, init_window_sz=0, local_window_sz=1, min_blocks=2, block_scoring="key_bounds"),
]
CONFIG_IDS = ["r0.3", "r0.5-w2-3-min8", "r0.1-w0-1-min2"]
# CPU_ATTN_AMX (bf16, block_size and head_dim multiples of 32): SmolLM2's heads, 4-way GQA at 128-dim heads.
AMX_SHAPES = [(3, 9, 64, 32), (2, 8, 128, 64)]
AMX_SHAPE_IDS = [f"kv{h}-q{hq}-d{d}-bs{bs}" for h, hq, d, bs in AMX_SHAPES]
SCORINGS = ["key_bounds", "attention", "sparq"]
IMPLS = ["cpu", "torch", "reference"]


def _batch(h: int, hq: int, d: int, bs: int, seed: int = 0):
    """A paged CPU_ATTN cache, a shuffled block table of 4 rows (lengths: partial last blocks, one short row)."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn((NUM_BLOCKS, h, bs, 2 * d), generator=g).to(torch.bfloat16)
    lens = torch.tensor([17 * bs + 5, 9 * bs, 3 * bs - 1, 12 * bs + 1], dtype=torch.int32)
    width = 20
    perm = torch.randperm(NUM_BLOCKS, generator=g).to(torch.int32)
    table = torch.stack(
        [perm[i * 15 : i * 15 + width] if i * 15 + width <= NUM_BLOCKS else perm[-width:] for i in range(4)]
    )
    q = torch.randn((4, hq, d), generator=g).to(torch.bfloat16)
    return paged_keys(cache, KVLayout.CPU_ATTN), table, lens, q


def _cpu_keys(h: int, d: int, bs: int, seed: int = 0) -> dict[KVLayout, torch.Tensor]:
    """The same random bf16 keys in a CPU_ATTN cache and in a CPU_ATTN_AMX cache (written through
    ``cpu_attn_kv_views``), as each layout's paged keys."""
    want = torch.randn((NUM_BLOCKS, bs, h, d), generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    out = {}
    for layout in (KVLayout.CPU_ATTN, KVLayout.CPU_ATTN_AMX):
        cache = torch.zeros((NUM_BLOCKS, h, bs, 2 * d), dtype=torch.bfloat16)
        k, _ = cpu_attn_kv_views(cache, layout)
        k.copy_(want.view(NUM_BLOCKS, *k.shape[1:]))
        out[layout] = paged_keys(cache, layout)
    return out


def _kept_ids(sel, r: int) -> list[int]:
    return sel.block_table[r, : int(sel.kept[r])].tolist()


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize(("h", "hq", "d", "bs"), SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("impl", IMPLS)
def test_selection_matches_reference(h: int, hq: int, d: int, bs: int, cfg: GSAConfig, impl: str) -> None:
    keys, table, lens, q = _batch(h, hq, d, bs)
    method = GSA(cfg, impl=impl)
    sel = method.select(q, keys, method.new_summaries(NUM_BLOCKS, h, d, torch.device("cpu")), table, lens, d**-0.5)
    want = select_reference(q, keys, table, lens, d**-0.5, cfg)
    for r in range(4):
        n = math.ceil(int(lens[r]) / bs)
        assert _kept_ids(sel, r) == want[r]
        assert int(sel.kept[r]) == int(kept_blocks(torch.tensor([n]), cfg)[0])
        # Only full blocks are dropped: the length falls by whole blocks and the last (partial) block stays last.
        assert int(sel.seq_lens[r]) == int(lens[r]) - (n - int(sel.kept[r])) * bs
        assert _kept_ids(sel, r)[-1] == int(table[r, n - 1])


@pytest.mark.parametrize("scoring", SCORINGS)
@pytest.mark.parametrize(("h", "hq", "d", "bs"), AMX_SHAPES, ids=AMX_SHAPE_IDS)
@pytest.mark.parametrize("impl", IMPLS)
def test_amx_keys_select_what_cpu_attn_keys_select(impl: str, h: int, hq: int, d: int, bs: int, scoring: str) -> None:
    """The same keys in CPU_ATTN (plain keys) and CPU_ATTN_AMX (tiled keys) give the same selection, for each block
    scoring and implementation (``attention``: after a prefill observation of row 0, the other rows from their
    query); the selection drops blocks, so it is not the dense table by construction."""
    _, table, lens, q = _batch(h, hq, d, bs)
    prompt = torch.randn((4, hq, d), generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    cfg = GSAConfig(sparse_ratio=0.3, block_scoring=scoring, score_channels=8)
    kept, lengths = {}, {}
    for layout, keys in _cpu_keys(h, d, bs).items():
        method = GSA(cfg, impl=impl)
        summaries = method.new_summaries(NUM_BLOCKS, h, d, torch.device("cpu"))
        method.observe(prompt, keys, summaries, table[0], int(lens[0]) - 1, d**-0.5)
        sel = method.select(q, keys, summaries, table, lens, d**-0.5)
        kept[layout], lengths[layout] = [_kept_ids(sel, r) for r in range(4)], sel.seq_lens.tolist()
    assert kept[KVLayout.CPU_ATTN_AMX] == kept[KVLayout.CPU_ATTN]
    assert lengths[KVLayout.CPU_ATTN_AMX] == lengths[KVLayout.CPU_ATTN]
    assert len(kept[KVLayout.CPU_ATTN][0]) < math.ceil(int(lens[0]) / bs)


def test_windows_always_kept_and_best_block_found() -> None:
    """A block holding one key aligned with the query is selected even when every other key is larger on average."""
    h, hq, d, bs = 1, 2, 16, 8
    n = 12
    keys = torch.full((n, h, bs, d), 0.5)
    keys[:, :, :, : d // 2] = -0.5
    needle_block, needle_tok = 6, 3
    q = torch.zeros((1, hq, d))
    q[0, :, : d // 2] = 1.0
    keys[needle_block, 0, needle_tok, : d // 2] = 4.0
    table = torch.arange(n, dtype=torch.int32)[None]
    cfg = GSAConfig(sparse_ratio=0.34, min_blocks=4, block_scoring="key_bounds")  # keep 5 of 12
    method = GSA(cfg)
    sel = method.select(
        q, keys, method.new_summaries(n, h, d, torch.device("cpu")), table, torch.tensor([n * bs]), 0.25
    )
    got = _kept_ids(sel, 0)
    assert len(got) == 5
    assert {0, 10, 11, needle_block} <= set(got)


def test_short_rows_stay_dense() -> None:
    keys, table, lens, q = _batch(3, 9, 64, 32)
    cfg = GSAConfig(sparse_ratio=0.1, min_blocks=19)  # rows of 18, 9, 3 and 13 blocks: all below
    method = GSA(cfg)
    sel = method.select(q, keys, method.new_summaries(NUM_BLOCKS, 3, 64, torch.device("cpu")), table, lens, 0.125)
    assert torch.equal(sel.seq_lens, lens)
    for r in range(4):
        n = math.ceil(int(lens[r]) / 32)
        assert _kept_ids(sel, r) == table[r, :n].tolist()


def test_all_blocks_kept_gives_the_dense_table() -> None:
    keys, table, lens, q = _batch(3, 9, 64, 32)
    method = GSA(GSAConfig(sparse_ratio=1.0))
    sel = method.select(q, keys, method.new_summaries(NUM_BLOCKS, 3, 64, torch.device("cpu")), table, lens, 0.125)
    assert torch.equal(sel.seq_lens, lens)
    for r in range(4):
        n = math.ceil(int(lens[r]) / 32)
        assert torch.equal(sel.block_table[r, :n], table[r, :n])


def test_compact_refuses_dropping_the_last_block() -> None:
    table = torch.arange(8, dtype=torch.int32).view(1, 8)
    keep = torch.ones((1, 8), dtype=torch.bool)
    keep[0, 4] = False  # the last of 5 blocks (seq_len 70 with block size 16)
    with pytest.raises(ValueError, match="last block"):
        compact_block_table(table, torch.tensor([70]), keep, 16)


def test_compact_keeps_input_untouched() -> None:
    table = torch.arange(10, dtype=torch.int32).view(2, 5)
    before = table.clone()
    keep = torch.tensor([[True, False, True, False, True], [False, True, True, True, True]])
    sel = compact_block_table(table, torch.tensor([70, 65]), keep, 16)
    assert torch.equal(table, before)
    assert sel.block_table[0, :3].tolist() == [0, 2, 4] and int(sel.seq_lens[0]) == 70 - 2 * 16
    assert sel.block_table[1, :4].tolist() == [6, 7, 8, 9] and int(sel.seq_lens[1]) == 65 - 16


def test_summaries_follow_writes_and_loads() -> None:
    """Stale summaries are recomputed: after a slot write, after a connector load (``invalidate_blocks``), and when
    the request's token count in a block changes; fresh ones are not."""
    h, d, bs = 2, 8, 4
    keys = torch.randn((6, h, bs, d))
    method = GSA(GSAConfig(block_scoring="key_bounds"))
    table = method.new_summaries(6, h, d, torch.device("cpu"))
    ids = torch.tensor([1, 4], dtype=torch.int64)
    full = torch.tensor([bs, bs])
    assert table.refresh(keys, ids, full) == 2
    assert table.refresh(keys, ids, full) == 0
    keys[4] += 10.0
    table.invalidate_slots(torch.tensor([4 * bs + 2, -1]), bs)  # a write into block 4 (and a padding slot)
    assert table.refresh(keys, ids, full) == 1
    assert torch.equal(table.kmax[4], keys[4].amax(dim=1))
    keys[1] -= 10.0
    invalidate_blocks([1])  # what the connector does after scattering loaded blocks
    assert table.refresh(keys, ids, full) == 1
    assert torch.equal(table.kmin[1], keys[1].amin(dim=1))
    assert table.refresh(keys, ids, torch.tensor([bs, 3])) == 1  # block 4 now counts 3 tokens for this request
    assert torch.equal(table.kmin[4], keys[4, :, :3].amin(dim=1))


def test_make_method() -> None:
    from ucm.config import UcmSparseConfig

    assert make_method(None) is None
    assert make_method(UcmSparseConfig()) is None
    method = make_method(UcmSparseConfig.model_validate({"GSA": {"sparse_ratio": 0.5}}))
    assert isinstance(method, GSA) and method.cfg.sparse_ratio == 0.5


# -- block_scoring: attention ------------------------------------------------------------------------------------


def _mass_reference(q: torch.Tensor, keys: torch.Tensor, ids: list[int], length: int, scale: float) -> torch.Tensor:
    """Row by row, query by query: attention mass per block (float64) of queries ``[W, Hq, D]`` ending at
    ``length - 1``."""
    h, bs = keys.shape[1], keys.shape[2]
    group = q.shape[1] // h
    k = torch.cat([keys[b] for b in ids], dim=1)[:, :length].double()  # [KVH, length, D]
    mass = torch.zeros(len(ids), dtype=torch.float64)
    for i in range(q.shape[0]):
        pos = length - q.shape[0] + i
        for j in range(q.shape[1]):
            p = torch.softmax(k[j // group, : pos + 1] @ q[i, j].double() * scale, dim=0)
            for t in range(pos + 1):
                mass[t // bs] += p[t]
    return mass


@pytest.mark.parametrize(("h", "hq", "d", "bs"), SHAPES, ids=SHAPE_IDS)
def test_attention_mass_matches_reference(h: int, hq: int, d: int, bs: int) -> None:
    from ucm.sparse.gsa import attention_mass

    keys, table, lens, _ = _batch(h, hq, d, bs)
    g = torch.Generator().manual_seed(5)
    for r, w in [(0, 1), (0, 7), (3, 3)]:
        length = int(lens[r])
        ids = table[r, : math.ceil(length / bs)]
        q = torch.randn((w, hq, d), generator=g).to(torch.bfloat16)
        got = attention_mass(q, keys, ids, length, d**-0.5)
        want = _mass_reference(q, keys, ids.tolist(), length, d**-0.5)
        assert got.tolist() == pytest.approx(want.tolist(), abs=1e-5)
        assert float(got.sum()) == pytest.approx(w * hq, rel=1e-5)


def test_attention_scoring_keeps_the_blocks_the_prompt_attended_to() -> None:
    """Prefill scores from the prompt's last queries pick the blocks; a decode step whose own query points
    elsewhere keeps them (static within the block), and the request's next block recomputes from its query."""
    h, hq, d, bs = 2, 4, 16, 8
    cfg = GSAConfig(sparse_ratio=0.3, block_scoring="attention", observation_window=4)
    method = GSA(cfg)
    num_blocks = 40
    g = torch.Generator().manual_seed(0)
    keys = torch.randn((num_blocks, h, bs, d), generator=g) * 0.1
    ids = list(range(10, 30))  # 20 blocks: keep ceil(0.3 * 20) = 6 = 3 forced + 3 chosen
    needle = [13, 17, 21]  # vLLM ids of blocks 3, 7, 11 of the request
    direction = torch.zeros(d)
    direction[0] = 8.0
    for b in needle:
        keys[b, :, 2] = direction  # one strongly matching key per needle block
    other = torch.zeros(d)
    other[1] = 8.0
    for b in (15, 19, 23):
        keys[b, :, 5] = other
    summaries = method.new_summaries(num_blocks, h, d, torch.device("cpu"))
    table = torch.tensor(ids + [0] * 4, dtype=torch.int32)
    length = 19 * bs + 3  # the last block holds 3 tokens
    prompt_q = direction.expand(4, hq, d).clone()
    method.observe(prompt_q, keys, summaries, table, length, d**-0.5)

    def kept(q: torch.Tensor, n_tokens: int) -> list[int]:
        sel = method.select(q[None], keys, summaries, table[None], torch.tensor([n_tokens]), d**-0.5)
        return sel.block_table[0, : int(sel.kept[0])].tolist()

    decode_q = other.expand(hq, d).clone()  # looks for the "other" blocks
    assert kept(decode_q, length + 1) == [10, *needle, 28, 29]  # the prefill's choice, not this query's
    summaries.invalidate_slots(torch.tensor([30 * bs]), bs)  # block 30 starts (another request): no effect
    assert kept(decode_q, length + 2) == [10, *needle, 28, 29]
    table[20] = 30  # the request moves on to block 30: scores recomputed from the current query
    ids30 = kept(decode_q, 20 * bs + 1)  # 21 blocks: keep 7 = 3 forced + 4 chosen
    assert len(ids30) == 7 and {10, 29, 30, 15, 19, 23} <= set(ids30) and not set(needle) & set(ids30)
    assert 29 not in summaries.entries and 30 in summaries.entries  # re-keyed under the new last block
    invalidate_blocks([30])  # e.g. loaded from the store: the entry goes
    assert 30 not in summaries.entries


def test_attention_scoring_with_all_blocks_kept_is_the_dense_table() -> None:
    keys, table, lens, q = _batch(3, 9, 64, 32)
    method = GSA(GSAConfig(sparse_ratio=1.0, block_scoring="attention"))
    summaries = method.new_summaries(NUM_BLOCKS, 3, 64, torch.device("cpu"))
    sel = method.select(q, keys, summaries, table, lens, 0.125)
    assert torch.equal(sel.seq_lens, lens) and sel.kept.tolist() == [18, 9, 3, 13]
    for r in range(4):
        assert _kept_ids(sel, r) == table[r, : int(sel.kept[r])].tolist()


# -- block_scoring: sparq ----------------------------------------------------------------------------------------


def _sparq_reference(q: torch.Tensor, keys: torch.Tensor, ids: list[int], length: int, scale: float, r: int):
    """Query head by query head (float64): the mass per block of one query ``[Hq, D]`` at ``length - 1`` from the
    ``r`` components of largest ``|q|`` summed over the KV head's query heads, temperature ``scale / sqrt(share)``."""
    h, bs = keys.shape[1], keys.shape[2]
    group = q.shape[0] // h
    k = torch.cat([keys[b] for b in ids], dim=1)[:, :length].double()  # [KVH, length, D]
    q = q.double()
    mass = torch.zeros(len(ids), dtype=torch.float64)
    for kv in range(h):
        weight = q[kv * group : (kv + 1) * group].abs().sum(0)
        chosen = sorted(range(q.shape[1]), key=lambda c: -float(weight[c]))[:r]
        for j in range(kv * group, (kv + 1) * group):
            share = float(q[j, chosen].abs().sum() / q[j].abs().sum())
            p = torch.softmax(k[kv][:, chosen] @ q[j, chosen] * scale / math.sqrt(share), dim=0)
            for t in range(length):
                mass[t // bs] += p[t]
    return mass


@pytest.mark.parametrize("channels", [1, 8, 40])
@pytest.mark.parametrize(("h", "hq", "d", "bs"), SHAPES, ids=SHAPE_IDS)
def test_sparq_mass_matches_reference(h: int, hq: int, d: int, bs: int, channels: int) -> None:
    from ucm.sparse.gsa import sparq_mass

    keys, table, lens, q = _batch(h, hq, d, bs)
    for r in (0, 3):
        length = int(lens[r])
        ids = table[r, : math.ceil(length / bs)]
        got = sparq_mass(q[r], keys, ids, length, d**-0.5, channels)
        want = _sparq_reference(q[r], keys, ids.tolist(), length, d**-0.5, min(channels, d))
        assert got.tolist() == pytest.approx(want.tolist(), abs=1e-5)
        assert float(got.sum()) == pytest.approx(hq, rel=1e-5)


@pytest.mark.parametrize(("h", "hq", "d", "bs"), SHAPES, ids=SHAPE_IDS)
def test_sparq_with_every_channel_is_the_exact_mass(h: int, hq: int, d: int, bs: int) -> None:
    from ucm.sparse.gsa import attention_mass, sparq_mass

    keys, table, lens, q = _batch(h, hq, d, bs)
    length = int(lens[0])
    ids = table[0, : math.ceil(length / bs)]
    exact = attention_mass(q[0][None], keys, ids, length, d**-0.5)
    for channels in (d, d + 7):
        assert sparq_mass(q[0], keys, ids, length, d**-0.5, channels).tolist() == pytest.approx(
            exact.tolist(), abs=1e-6
        )


def test_sparq_scoring_follows_the_current_query() -> None:
    """Every step scores from its own query: blocks holding a key along the query's direction are kept, and a
    query along another direction switches to that direction's blocks at once."""
    h, hq, d, bs = 2, 4, 16, 8
    method = GSA(GSAConfig(sparse_ratio=0.3, block_scoring="sparq", score_channels=2))
    num_blocks = 40
    g = torch.Generator().manual_seed(0)
    keys = torch.randn((num_blocks, h, bs, d), generator=g) * 0.1
    table = torch.tensor(list(range(10, 30)), dtype=torch.int32)[None]  # 20 blocks: 3 forced + 3 chosen
    first, second = torch.zeros(d), torch.zeros(d)
    first[0], second[1] = 8.0, 8.0
    for b in (13, 17, 21):
        keys[b, :, 2] = first
    for b in (15, 19, 23):
        keys[b, :, 5] = second
    summaries = method.new_summaries(num_blocks, h, d, torch.device("cpu"))
    lens = torch.tensor([19 * bs + 3])

    def kept(direction: torch.Tensor) -> list[int]:
        sel = method.select(direction.expand(1, hq, d).clone(), keys, summaries, table, lens, d**-0.5)
        return _kept_ids(sel, 0)

    assert kept(first) == [10, 13, 17, 21, 28, 29]
    assert kept(second) == [10, 15, 19, 23, 28, 29]


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_sparq_selection_keeps_the_top_approximate_mass(cfg: GSAConfig) -> None:
    from ucm.sparse.gsa import sparq_mass
    from ucm.sparse.selection import keep_mask

    keys, table, lens, q = _batch(3, 9, 64, 32)
    sparq = GSAConfig.model_validate({**cfg.model_dump(), "block_scoring": "sparq", "score_channels": 8})
    method = GSA(sparq)
    sel = method.select(q, keys, method.new_summaries(NUM_BLOCKS, 3, 64, torch.device("cpu")), table, lens, 0.125)
    for r in range(4):
        n = math.ceil(int(lens[r]) / 32)
        if n < cfg.min_blocks:
            want = table[r, :n].tolist()
        else:
            scores = sparq_mass(q[r], keys, table[r, :n], int(lens[r]), 0.125, 8)
            keep = keep_mask(scores[None], torch.tensor([n]), sparq)[0]
            want = table[r, :n][keep].tolist()
        assert _kept_ids(sel, r) == want


def test_sparq_scoring_with_all_blocks_kept_is_the_dense_table() -> None:
    keys, table, lens, q = _batch(3, 9, 64, 32)
    method = GSA(GSAConfig(sparse_ratio=1.0, block_scoring="sparq"))
    sel = method.select(q, keys, method.new_summaries(NUM_BLOCKS, 3, 64, torch.device("cpu")), table, lens, 0.125)
    assert torch.equal(sel.seq_lens, lens) and sel.kept.tolist() == [18, 9, 3, 13]
    for r in range(4):
        assert _kept_ids(sel, r) == table[r, : int(sel.kept[r])].tolist()


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize(("h", "hq", "d", "bs"), SHAPES, ids=SHAPE_IDS)
def test_sparq_selection_is_the_reference_kernels(h: int, hq: int, d: int, bs: int, cfg: GSAConfig) -> None:
    """The batched CPU paths (the numba fused pass of ``impl="cpu"``; torch's one gather and matmul for all rows)
    keep the blocks the loop-by-loop oracle keeps."""
    keys, table, lens, q = _batch(h, hq, d, bs)
    sparq = GSAConfig.model_validate({**cfg.model_dump(), "block_scoring": "sparq", "score_channels": 8})
    kept = {}
    for impl in ("cpu", "torch", "reference"):
        method = GSA(sparq, impl=impl)
        sel = method.select(q, keys, method.new_summaries(NUM_BLOCKS, h, d, torch.device("cpu")), table, lens, d**-0.5)
        kept[impl] = [_kept_ids(sel, r) for r in range(4)]
    assert kept["cpu"] == kept["torch"] == kept["reference"]


def test_fused_sparq_selection_refuses_blocks_outside_the_cache() -> None:
    keys, table, lens, q = _batch(3, 9, 64, 32)
    method = GSA(GSAConfig(block_scoring="sparq"), impl="cpu")
    bad = table.clone()
    bad[0, 4] = NUM_BLOCKS + 2
    summaries = method.new_summaries(NUM_BLOCKS, 3, 64, torch.device("cpu"))
    with pytest.raises(ValueError, match=rf"block_table names blocks in \[\d+, {NUM_BLOCKS + 2}\]; the cache has"):
        method.select(q, keys, summaries, bad, lens, 0.125)


_WARM_UP_CHILD = """
import json, sys, torch
from ucm.config import GSAConfig
from ucm.kernels.paged_keys import paged_keys
from ucm.kernels.layouts import KVLayout
from ucm.kernels.sparq import cpu_numba as sparq_kernels
from ucm.sparse import GSA
from ucm.sparse.selection import cpu_numba as selection_kernels

dtype, warm_layout, layout = getattr(torch, sys.argv[1]), KVLayout(sys.argv[2]), KVLayout(sys.argv[3])
kernels = (sparq_kernels.sparq_query_kernel, sparq_kernels.block_lse_kernel, selection_kernels.keep_blocks_kernel)
method = GSA(GSAConfig(block_scoring="sparq"))
method.warm_up(dtype, torch.device("cpu"), warm_layout)
before = [len(k.signatures) for k in kernels]
keys = paged_keys(torch.randn((40, 3, 32, 128)).to(dtype), layout)
table = torch.randperm(40).to(torch.int32).view(2, 20)
lens = torch.tensor([20 * 32 - 3, 3 * 32], dtype=torch.int32)
sel = method.select(torch.randn((2, 9, 64)).to(dtype), keys, method.new_summaries(40, 3, 64, torch.device("cpu")),
                    table, lens, 0.125)
print(json.dumps({"before": before, "after": [len(k.signatures) for k in kernels], "kept": sel.kept.tolist()}))
"""


# (KV dtype, layout warmed up, layout of the engine's cache): what vLLM's CPU variants give (fp32: vec; bf16: vec or
# amx), and a warm-up of one CPU layout serving the other (one numba specialization for both).
WARM_UPS = [
    ("float32", "cpu_attn", "cpu_attn"),
    ("bfloat16", "cpu_attn", "cpu_attn"),
    ("bfloat16", "cpu_attn_amx", "cpu_attn_amx"),
    ("bfloat16", "cpu_attn", "cpu_attn_amx"),
]


@pytest.mark.parametrize(("dtype", "warm_layout", "layout"), WARM_UPS, ids=["-".join(w) for w in WARM_UPS])
def test_warm_up_compiles_what_the_engine_runs(dtype: str, warm_layout: str, layout: str) -> None:
    """In a fresh process, after ``warm_up`` a selection with the engine's argument types (int32 block table and
    lengths, a larger cache, a row below ``min_blocks``) adds no numba specialization: the first decode step does not
    wait for the compiler. Both CPU layouts run the same specialization."""
    import json
    import subprocess
    import sys

    child = subprocess.run(
        [sys.executable, "-c", _WARM_UP_CHILD, dtype, warm_layout, layout],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    got = json.loads(child.stdout.strip().splitlines()[-1])
    assert got["before"] == [1, 1, 1]  # warm-up compiled (or loaded) one specialization of each kernel
    assert got["after"] == got["before"] and got["kept"] == [6, 3]
