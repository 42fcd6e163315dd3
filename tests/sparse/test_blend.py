"""CacheBlend's plain parts: the prompt's chunks, attention of queries at arbitrary positions (against a float64
loop), and its config section."""

from __future__ import annotations

import math

import pytest
import torch

from ucm.config import UcmConfigError, parse_config
from ucm.sparse.blend import attention_by_position, blend_end, chunk_spans


@pytest.mark.parametrize(
    ("ids", "spans", "end"),
    [
        ([1, 2, 9, 3, 9, 4, 5], [(0, 3), (3, 5)], 5),
        ([9, 1, 9], [(0, 1), (1, 3)], 2),  # a prompt ending with the chunk end: its last token is left to vLLM
        ([1, 2, 3], [], 0),
    ],
)
def test_chunks_end_with_the_chunk_end_token(ids, spans, end) -> None:
    assert chunk_spans(ids, 9) == spans
    assert blend_end(spans, len(ids)) == end


def _attention_loop(q, q_pos, k, v, k_pos, scale) -> torch.Tensor:
    n, heads, dim = q.shape
    group = heads // k.shape[1]
    out = torch.zeros(n, heads, dim, dtype=torch.float64)
    for i in range(n):
        for h in range(heads):
            scores = [
                scale * float(q[i, h].double() @ k[j, h // group].double()) if k_pos[j] <= q_pos[i] else -math.inf
                for j in range(k.shape[0])
            ]
            w = torch.softmax(torch.tensor(scores, dtype=torch.float64), 0)
            out[i, h] = (w[:, None] * v[:, h // group].double()).sum(0)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_by_position_matches_a_loop(dtype) -> None:
    """Queries at scattered, unsorted positions over keys at other scattered positions, grouped heads: the same as
    a float64 loop over the causal rule (tolerance per dtype: the inputs are rounded to it, the math is float32)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(7, 4, 16, generator=g).to(dtype)
    k = torch.randn(11, 2, 16, generator=g).to(dtype)
    v = torch.randn(11, 2, 16, generator=g).to(dtype)
    k_pos = torch.tensor([0, 1, 2, 3, 5, 8, 9, 10, 13, 14, 20])
    q_pos = torch.tensor([20, 3, 9, 0, 14, 5, 10])
    got = attention_by_position(q, q_pos, k, v, k_pos, 0.25)
    want = _attention_loop(q, q_pos, k, v, k_pos, 0.25)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_attention_by_position_refuses_a_query_with_no_key() -> None:
    q, k = torch.zeros(1, 2, 8), torch.zeros(1, 2, 8)
    with pytest.raises(ValueError, match="no key at or before"):
        attention_by_position(q, torch.tensor([0]), k, k, torch.tensor([1]), 1.0)


def test_blend_section_defaults() -> None:
    cfg = parse_config({"ucm_sparse_config": {"Blend": {"chunk_end_token_id": 5}}}).ucm_sparse_config
    assert cfg is not None and cfg.method == "Blend" and cfg.Blend is not None
    assert (cfg.Blend.check_layer, cfg.Blend.ratio, cfg.Blend.store_chunks) == (1, 0.15, True)
    upstream = {"chunk_end_token_id": 5, "compute_meta": {"model.layers.3.self_attn.attn": {"ratio": 1}}}
    cfg = parse_config({"ucm_sparse_config": {"Blend": upstream}}).ucm_sparse_config
    assert cfg is not None and cfg.Blend is not None and (cfg.Blend.check_layer, cfg.Blend.ratio) == (3, 1.0)


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        ({}, "ucm_sparse_config.Blend.chunk_end_token_id: Field required"),
        ({"chunk_end_token_id": -1}, "chunk_end_token_id: Input should be greater than or equal to 0"),
        (
            {"chunk_end_token_id": 5, "compute_meta": {"layers.1": {"ratio": 0.1}}},
            "compute_meta key 'layers.1' is not an attention layer name; allowed: 'model.layers.<i>.self_attn.attn'",
        ),
        (
            {"chunk_end_token_id": 5, "compute_meta": {}},
            "compute_meta has 0 entries ([]); this version takes exactly 1",
        ),
        (
            {"chunk_end_token_id": 5, "compute_meta": {"model.layers.1.self_attn.attn": {"ratio": 1.5}}},
            "ratio: Input should be less than or equal to 1",
        ),
        (
            {"chunk_end_token_id": 5, "compute_meta": {"model.layers.1.self_attn.attn": {"ration": 0.1}}},
            "unknown key 'ration' in ucm_sparse_config.Blend.compute_meta.model.layers.1.self_attn.attn; valid keys: "
            "ratio",
        ),
        ({"chunk_end_token_id": 5, "chunk_end": 1}, "unknown key 'chunk_end' in ucm_sparse_config.Blend; valid keys: "),
    ],
)
def test_blend_errors_name_the_key(section: dict, expected: str) -> None:
    with pytest.raises(UcmConfigError) as info:
        parse_config({"ucm_sparse_config": {"Blend": section}})
    assert expected in str(info.value)


def test_one_method_at_a_time() -> None:
    with pytest.raises(UcmConfigError, match="ReRoPE and Blend are both set"):
        parse_config({"ucm_sparse_config": {"ReRoPE": {"window": 8}, "Blend": {"chunk_end_token_id": 5}}})
