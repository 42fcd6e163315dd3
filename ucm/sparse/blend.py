"""CacheBlend's plain parts: the chunks of a prompt and the run a blend fills.

CacheBlend (Yao et al., "CacheBlend: Fast Large Language Model Serving for RAG with Cached Knowledge Fusion",
EuroSys 2025, arXiv 2405.16444) reuses the KV of a chunk computed on its own wherever the chunk appears in a later
prompt, and recomputes only the tokens whose KV deviates most. The engine-side pass that does it is
``ucm.integration.vllm.blend``; the RoPE delta and deviation kernels are in ``ucm.kernels.blend``.
"""

from __future__ import annotations

from collections.abc import Sequence


def chunk_spans(token_ids: Sequence[int], chunk_end_token_id: int) -> list[tuple[int, int]]:
    """The chunks of a prompt: ``[start, end)`` runs that each end with ``chunk_end_token_id`` (included), in order,
    covering ``[0, end of the last chunk)``. Tokens after the last chunk-end token belong to no chunk (the prompt's
    suffix, e.g. the question). No chunk-end token: ``[]``."""
    spans: list[tuple[int, int]] = []
    start = 0
    for i, token in enumerate(token_ids):
        if token == chunk_end_token_id:
            spans.append((start, i + 1))
            start = i + 1
    return spans


def blend_end(spans: Sequence[tuple[int, int]], num_prompt_tokens: int) -> int:
    """Where the blended run of a prompt with chunks ``spans`` ends: at the prompt's last token (the blend also
    computes the tokens after the last chunk but that one, e.g. the question; vLLM computes the last token, whose
    logits it samples, so its own pass is one token). No chunk: 0."""
    return num_prompt_tokens - 1 if spans else 0
