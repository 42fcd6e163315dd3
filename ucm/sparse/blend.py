"""CacheBlend's plain-torch parts: chunks of a prompt, and causal attention of queries at arbitrary positions.

CacheBlend (Yao et al., "CacheBlend: Fast Large Language Model Serving for RAG with Cached Knowledge Fusion",
EuroSys 2025, arXiv 2405.16444) reuses the KV of a chunk computed on its own wherever the chunk appears in a later
prompt, and recomputes only the tokens whose KV deviates most. The engine-side pass that does it is
``ucm.integration.vllm.blend``; the RoPE delta and deviation kernels are in ``ucm.kernels.blend``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Queries scored at once (bounds the [heads, chunk, keys] score matrix).
QUERY_CHUNK = 256


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
    """Where the blended run of a prompt with chunks ``spans`` ends: the end of its last chunk, but at most
    ``num_prompt_tokens - 1`` (vLLM computes at least the prompt's last token, whose logits it samples)."""
    return min(spans[-1][1], num_prompt_tokens - 1) if spans else 0


def attention_by_position(
    query: torch.Tensor,
    q_positions: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    k_positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of queries at arbitrary positions: query ``i`` attends to every key ``j`` with
    ``k_positions[j] <= q_positions[i]`` (positions need not be contiguous or sorted).

    Args:
        query: ``[n, num_heads, head_dim]`` (post-RoPE), any float dtype; q_positions: int64 ``[n]``.
        keys, values: ``[m, num_kv_heads, head_dim]`` (post-RoPE keys); k_positions: int64 ``[m]``.
        scale: score scale (``head_dim ** -0.5`` for most models).

    Returns:
        float32 ``[n, num_heads, head_dim]``; scores and softmax in float32.

    Raises:
        ValueError: ``num_heads`` is not a multiple of ``num_kv_heads``, or a query has no key at or before it.
    """
    n, num_heads, head_dim = query.shape
    num_kv_heads = keys.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    group = num_heads // num_kv_heads
    k = keys.to(torch.float32)
    v = values.to(torch.float32)
    out = torch.empty((n, num_heads, head_dim), dtype=torch.float32, device=query.device)
    for c0 in range(0, n, QUERY_CHUNK):
        c1 = min(n, c0 + QUERY_CHUNK)
        q = query[c0:c1].to(torch.float32).view(c1 - c0, num_kv_heads, group, head_dim)
        scores = torch.einsum("qhgd,khd->hgqk", q, k) * scale  # [Hkv, G, n, m]
        visible = k_positions[None, :] <= q_positions[c0:c1, None]  # [n, m]
        if not bool(visible.any(dim=1).all()):
            raise ValueError("a query has no key at or before its position")
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[c0:c1] = torch.einsum("hgqk,khd->qhgd", probs, v).reshape(c1 - c0, num_heads, head_dim)
    return out
