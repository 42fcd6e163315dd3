"""CacheBlend's plain parts: the prompt's chunks and the run a blend fills, and its config section."""

from __future__ import annotations

import pytest

from ucm.config import UcmConfigError, default_question_layers, parse_config
from ucm.sparse.blend import blend_end, chunk_spans


@pytest.mark.parametrize(
    ("ids", "spans", "end"),
    [
        ([1, 2, 9, 3, 9, 4, 5], [(0, 3), (3, 5)], 6),  # the run takes the question but its last token
        ([9, 1, 9], [(0, 1), (1, 3)], 2),  # a prompt ending with the chunk end: its last token is left to vLLM
        ([1, 2, 3], [], 0),
    ],
)
def test_chunks_end_with_the_chunk_end_token(ids, spans, end) -> None:
    assert chunk_spans(ids, 9) == spans
    assert blend_end(spans, len(ids)) == end


def test_blend_section_defaults() -> None:
    cfg = parse_config({"ucm_sparse_config": {"Blend": {"chunk_end_token_id": 5}}}).ucm_sparse_config
    assert cfg is not None and cfg.method == "Blend" and cfg.Blend is not None
    assert (cfg.Blend.check_layer, cfg.Blend.ratio, cfg.Blend.store_chunks) == (1, 0.15, True)
    assert (cfg.Blend.chunk_context, cfg.Blend.selection, cfg.Blend.question_layers) == ("none", "deviation", None)
    section = {"chunk_end_token_id": 5, "selection": "question", "question_layers": [10, 30]}
    cfg = parse_config({"ucm_sparse_config": {"Blend": section}}).ucm_sparse_config
    assert cfg is not None and cfg.Blend is not None and cfg.Blend.question_layers == [10, 30]
    upstream = {"chunk_end_token_id": 5, "compute_meta": {"model.layers.3.self_attn.attn": {"ratio": 1}}}
    cfg = parse_config({"ucm_sparse_config": {"Blend": upstream}}).ucm_sparse_config
    assert cfg is not None and cfg.Blend is not None and (cfg.Blend.check_layer, cfg.Blend.ratio) == (3, 1.0)


@pytest.mark.parametrize(
    ("num_layers", "layers"), [(30, (8, 30)), (32, (8, 32)), (4, (1, 4)), (2, (1, 2)), (1, (0, 1))]
)
def test_question_layers_default_skips_the_first_quarter(num_layers: int, layers: tuple[int, int]) -> None:
    assert default_question_layers(num_layers) == layers


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
        (
            {"chunk_end_token_id": 5, "chunk_context": "head"},
            "ucm_sparse_config.Blend.chunk_context: Input should be 'none' or 'first_chunk'",
        ),
        ({"chunk_end_token_id": 5, "chunk_end": 1}, "unknown key 'chunk_end' in ucm_sparse_config.Blend; valid keys: "),
        (
            {"chunk_end_token_id": 5, "selection": "attention"},
            "ucm_sparse_config.Blend.selection: Input should be 'deviation' or 'question'",
        ),
        (
            {"chunk_end_token_id": 5, "question_layers": [10, 30]},
            "question_layers [10, 30] is set but selection is 'deviation'; it applies to selection 'question' only",
        ),
        (
            {"chunk_end_token_id": 5, "selection": "question", "question_layers": [30, 10]},
            "question_layers [30, 10] must be [first, end) with 0 <= first < end",
        ),
    ],
)
def test_blend_errors_name_the_key(section: dict, expected: str) -> None:
    with pytest.raises(UcmConfigError) as info:
        parse_config({"ucm_sparse_config": {"Blend": section}})
    assert expected in str(info.value)


def test_one_method_at_a_time() -> None:
    with pytest.raises(UcmConfigError, match="ReRoPE and Blend are both set"):
        parse_config({"ucm_sparse_config": {"ReRoPE": {"window": 8}, "Blend": {"chunk_end_token_id": 5}}})
