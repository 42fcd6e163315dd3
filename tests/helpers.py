"""Helpers shared by the test suite (plain functions and constants; the fixtures are in ``tests/conftest.py``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MODELS_DIR = Path(os.environ.get("UCM_MODELS_DIR", REPO / "models"))
needs_aio = pytest.mark.needs_aio  # skipped, with the reason, where aio cannot start (see tests/conftest.py)

# float32 engine: a correct load reproduces log-probs to ~1e-6 (only the attention's summation order differs);
# a wrong block moves them by ~1e-2 even on the tiny model (seen in this repo's engine tests).
LOGPROB_TOL = 1e-3


def assert_same_output(got, want) -> None:
    """Two ``RequestResult``s agree: greedy tokens identical and log-probs within ``LOGPROB_TOL``."""
    assert got.token_ids == want.token_ids
    diff = max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True))
    assert diff < LOGPROB_TOL, f"log-probs differ by {diff}"


def ucm_extra_config(store_dir: Path | str, pipeline: str = "Cache|Posix") -> dict:
    """Inline UCM config (kv_connector_extra_config) for a store at ``store_dir``."""
    return {
        "ucm_connectors": [
            {
                "ucm_connector_name": "UcmPipelineStore",
                "ucm_connector_config": {"store_pipeline": pipeline, "storage_backends": str(store_dir)},
            }
        ]
    }


def cpu_attention(md, query, key_cache, value_cache, scale: float):
    """vLLM's CPU attention kernel (``cpu_attention_with_kv_cache``) over the paged ``key_cache`` / ``value_cache``
    for ``query`` (``[num_tokens, num_heads, head_dim]``) as ``md`` (a ``CPUAttentionMetadata``) lays its requests
    out; returns the output, shaped like ``query``."""
    import torch
    from vllm import _custom_ops as ops

    out = torch.empty_like(query)
    ops.cpu_attention_with_kv_cache(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        output=out,
        query_start_loc=md.query_start_loc,
        seq_lens=md.seq_lens,
        scale=scale,
        causal=md.causal,
        alibi_slopes=None,
        sliding_window=-1,
        block_table=md.block_table,
        softcap=0,
        scheduler_metadata=md.scheduler_metadata,
        s_aux=None,
    )
    return out
