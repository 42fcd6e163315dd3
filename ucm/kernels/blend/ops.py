"""CacheBlend's kernels (Yao et al., "CacheBlend: Fast Large Language Model Serving for RAG with Cached Knowledge
Fusion", EuroSys 2025, arXiv 2405.16444): re-aligning the keys of a stored chunk to its new positions
(:func:`rope_delta_`), the per-token KV deviation between recomputed and stored KV (:func:`kv_deviation`), the
attention that the prompt's question pays to each stored token (:func:`question_attention`, an alternative score)
and the choice of the tokens to recompute from a score (:func:`select_recompute`); validation, then dispatch by
``impl``.

CacheBlend reuses the KV of text chunks cached on their own (each from position 0, or wherever it was first seen)
inside a new prompt where they sit elsewhere and after other chunks. Two corrections make the reused KV usable:

- Positions. Keys are cached after RoPE, rotated by their old positions; RoPE rotations compose (``R(a) R(b) =
  R(a + b)``), so rotating a stored key by ``delta = new position - old position`` gives the key RoPE would give
  at the new position, with no need of the key before RoPE. Values carry no position.
- Cross-attention. A chunk's KV, computed without the chunks before it, misses their attention. CacheBlend
  recomputes, layer by layer, the KV of a few tokens, those whose KV deviates most from what a full prefill would
  give (the "high-KV-deviation" tokens), and reuses the stored KV of the rest. The deviation of token ``t`` at a
  layer is measured here as ``sum_{h, c} (K_new - K_old)[t, h, c]^2 + (V_new - V_old)[t, h, c]^2`` between the KV
  recomputed at that layer and the stored KV; the tokens kept for recomputation at the next layers are those of
  highest deviation, a ``ratio`` of the chunk's tokens.

All three ops work on one layer's K or V of a run of tokens in the canonical token-major form ``[num_tokens,
num_kv_heads, head_dim]`` (any strides; float32, bfloat16 or float16).

RoPE conventions are vLLM's ``RotaryEmbedding``: inverse frequencies ``base ** (-2 i / rotary_dim)`` for ``i <
rotary_dim / 2``; GPT-NeoX style (``neox=True``) rotates the pairs ``(c, c + rotary_dim / 2)`` of the first
``rotary_dim`` channels, GPT-J style the pairs ``(2 c, 2 c + 1)``; channels past ``rotary_dim`` are not touched.
Angles ``delta * inv_freq`` are computed on the host in float64 (they reach thousands of radians) and rounded once
to float32 cos/sin; the rotation is float32 arithmetic, rounded to the key dtype (to nearest even).

Implementations (``impl=``, the vocabulary of ``ucm.kernels.utils``):

- ``"triton"``: ``blend.triton`` (:func:`rope_delta_`, :func:`kv_deviation`: one program per block of tokens); the
  default on CUDA; the interpreter on CPU tensors (tests only). :func:`rope_delta_` agrees with ``"torch"`` bit for
  bit (same cos/sin tables, same float32 operations, no FMA). :func:`select_recompute` has no Triton kernel (a
  ``torch.topk`` and a few masks): ``"auto"`` on CUDA runs its torch code.
- ``"cpu"`` and ``"torch"``: the torch code of ``blend.torch`` (no faster CPU code exists, so ``"cpu"``, the default
  on CPU, runs it too).
- ``"reference"``: ``blend.naive`` (float64; the test oracles). :func:`rope_delta_` writes the float64 rotation
  rounded to float32, then to the key dtype.

The sums of :func:`kv_deviation` are float32 reductions whose order differs between implementations; results agree
to float32 rounding (tests use a tolerance), not bit for bit. :func:`select_recompute` gives the same indices from
every implementation (ties are broken by index).
"""

from __future__ import annotations

import torch

from ucm.kernels.blend.naive import (
    kv_deviation_reference,
    question_attention_reference,
    rope_delta_reference,
    select_recompute_reference,
)
from ucm.kernels.blend.torch import (
    delta_cos_sin,
    kv_deviation_torch,
    question_attention_torch,
    rope_delta_torch,
    select_recompute_torch,
)
from ucm.kernels.blend.triton import kv_deviation_triton, rope_delta_triton
from ucm.kernels.utils import Impl, resolve_impl

KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rope_delta_(
    keys: torch.Tensor,
    delta: torch.Tensor,
    *,
    rotary_dim: int | None = None,
    base: float = 10000.0,
    neox: bool = True,
    impl: Impl = "auto",
) -> torch.Tensor:
    """Rotate, in place, key ``t`` by RoPE at position ``delta[t]``: a key cached rotated at position ``p`` becomes
    the key rotated at ``p + delta[t]`` (see the module doc). Tokens whose delta is 0 are not written (their bits,
    NaN payloads and signed zeros included, stay as they are).

    Args:
        keys: ``[num_tokens, num_kv_heads, head_dim]`` float32/bfloat16/float16 keys after RoPE, any strides
            without overlap; modified in place.
        delta: int64 ``[num_tokens]`` position shifts (new position minus cached position), any sign; on ``keys``'
            device or on the CPU (the cos/sin tables are computed on the host either way; a CUDA ``delta`` is
            copied there first).
        rotary_dim: channels rotated, even, in ``[2, head_dim]`` (None: ``head_dim``).
        base: RoPE's base (``rope_theta``), > 0.
        neox: GPT-NeoX rotation (halves; Llama's) or GPT-J's (interleaved pairs).
        impl: ``"auto"`` (Triton on CUDA, torch code otherwise), ``"triton"``, ``"cpu"``, ``"torch"`` or
            ``"reference"`` (see the module doc).

    Returns:
        ``keys``.

    Raises:
        ValueError: ``keys`` not 3-D or of another dtype, ``delta`` not int64 ``[num_tokens]`` or on a third device,
            a bad ``rotary_dim`` or ``base``, or unknown ``impl``.
    """
    which = resolve_impl(impl, keys.device, op="rope_delta_")
    if keys.dim() != 3 or keys.dtype not in KV_DTYPES:
        raise ValueError(
            f"keys must be float32/bfloat16/float16 [num_tokens, num_kv_heads, head_dim], got {keys.dtype} "
            f"{tuple(keys.shape)}"
        )
    n, _, head_dim = keys.shape
    if tuple(delta.shape) != (n,) or delta.dtype != torch.int64:
        raise ValueError(f"delta must be int64 [{n}] (one per token), got {delta.dtype} {tuple(delta.shape)}")
    if delta.device not in (keys.device, torch.device("cpu")):
        raise ValueError(f"delta is on {delta.device}, keys on {keys.device}: delta must be on keys' device or the CPU")
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim must be even, >= 2 and <= head_dim ({head_dim}), got {rotary_dim}")
    if not 0.0 < base < float("inf"):
        raise ValueError(f"base must be a finite number > 0, got {base}")
    if n == 0:
        return keys
    if which == "triton":
        cos, sin = delta_cos_sin(delta, rotary_dim, base, keys.device)
        rope_delta_triton(keys, delta.to(keys.device).contiguous(), cos, sin, rotary_dim, neox)
    elif which == "reference":
        rows = torch.nonzero(delta.cpu() != 0).flatten()
        want = rope_delta_reference(keys, delta, rotary_dim=rotary_dim, base=base, neox=neox)
        want = want[rows, :, :rotary_dim].to(torch.float32).to(device=keys.device, dtype=keys.dtype)
        keys[:, :, :rotary_dim].index_copy_(0, rows.to(keys.device), want)
    else:  # "cpu" and "torch": the torch code
        rope_delta_torch(keys, delta, rotary_dim, base, neox)
    return keys


def kv_deviation(
    k_new: torch.Tensor, v_new: torch.Tensor, k_old: torch.Tensor, v_old: torch.Tensor, *, impl: Impl = "auto"
) -> torch.Tensor:
    """Per token, how far recomputed KV lies from stored KV: ``sum_{h, c} (k_new - k_old)[t, h, c]^2 + (v_new -
    v_old)[t, h, c]^2`` (squared units of the KV values), accumulated in float32 (``"reference"``: float64, then
    rounded).

    Args:
        k_new, v_new: ``[num_tokens, num_kv_heads, head_dim]`` the KV recomputed at one layer.
        k_old, v_old: the stored KV of the same tokens and layer; all four of one shape, one dtype
            (float32/bfloat16/float16) and one device, any strides.
        impl: ``"auto"`` (Triton on CUDA, torch code otherwise), ``"triton"``, ``"cpu"``, ``"torch"`` or
            ``"reference"`` (see the module doc).

    Returns:
        float32 ``[num_tokens]`` on the inputs' device.

    Raises:
        ValueError: inputs not 3-D, of different shapes, dtypes or devices, of another dtype, or unknown ``impl``.
    """
    which = resolve_impl(impl, k_new.device, op="kv_deviation")
    named = (("k_new", k_new), ("v_new", v_new), ("k_old", k_old), ("v_old", v_old))
    if k_new.dim() != 3 or k_new.dtype not in KV_DTYPES:
        raise ValueError(
            f"k_new must be float32/bfloat16/float16 [num_tokens, num_kv_heads, head_dim], got {k_new.dtype} "
            f"{tuple(k_new.shape)}"
        )
    for name, t in named[1:]:
        if t.shape != k_new.shape or t.dtype != k_new.dtype or t.device != k_new.device:
            raise ValueError(
                f"{name} must match k_new ({k_new.dtype} {tuple(k_new.shape)} on {k_new.device}), got {t.dtype} "
                f"{tuple(t.shape)} on {t.device}"
            )
    n = k_new.shape[0]
    if which == "triton":
        out = torch.empty(n, dtype=torch.float32, device=k_new.device)
        if n:
            kv_deviation_triton(k_new, v_new, k_old, v_old, out)
        return out
    if which == "reference":
        return kv_deviation_reference(k_new, v_new, k_old, v_old).to(device=k_new.device, dtype=torch.float32)
    return kv_deviation_torch(k_new, v_new, k_old, v_old)  # "cpu" and "torch": the torch code


def select_recompute(
    deviation: torch.Tensor, ratio: float, *, always: torch.Tensor | None = None, impl: Impl = "auto"
) -> torch.Tensor:
    """The tokens to recompute: the ``ceil(ratio * num_tokens)`` tokens of highest ``deviation`` (equal deviations
    taken in ascending index order, so the choice is deterministic; NaN ranks as ``+inf``), together with the tokens
    of ``always``. ``ratio`` is read as the decimal it prints as (``ucm.kernels.blend.naive.recompute_count``: 0.07
    of 100 tokens is 7); 1 picks every token, 0 only ``always``'s.

    Args:
        deviation: float ``[num_tokens]`` per-token deviation (:func:`kv_deviation`).
        ratio: share of the tokens to pick by deviation, in ``[0, 1]``.
        always: bool ``[num_tokens]`` on ``deviation``'s device, or None: tokens recomputed whatever their
            deviation (e.g. tokens with no stored KV).
        impl: ``"auto"`` (torch code on every device: a ``torch.topk`` and a few masks, no Triton kernel),
            ``"cpu"``, ``"torch"`` or ``"reference"`` (a Python sort).

    Returns:
        int64 ``[m]`` token indices, distinct, in ascending order, on ``deviation``'s device.

    Raises:
        ValueError: ``ratio`` not a real number in ``[0, 1]``, ``deviation`` not a 1-D float tensor, ``always`` not
            bool ``[num_tokens]`` on its device, or unknown ``impl`` (``"triton"`` included).
    """
    which = resolve_impl(impl, deviation.device, available=("cpu", "torch", "reference"), op="select_recompute")
    if deviation.dim() != 1 or not deviation.is_floating_point():
        raise ValueError(
            f"deviation must be a float [num_tokens] tensor, got {deviation.dtype} {tuple(deviation.shape)}"
        )
    n = deviation.shape[0]
    if always is not None and (
        always.dtype != torch.bool or tuple(always.shape) != (n,) or always.device != deviation.device
    ):
        raise ValueError(
            f"always must be bool [{n}] on {deviation.device} (deviation's device), got {always.dtype} "
            f"{tuple(always.shape)} on {always.device}"
        )
    if which == "reference":
        return select_recompute_reference(deviation, ratio, always=always).to(deviation.device)
    return select_recompute_torch(deviation, ratio, always)  # "cpu" and "torch": the torch code


def question_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *, scale: float, impl: Impl = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal softmax attention of a prompt's last ``m`` tokens over the sequence, and how much attention each
    token of the sequence receives from them: CacheBlend's ``question`` score (``ucm.integration.vllm.blend``), the
    attention of the prompt's question over the naive KV, summed over a range of layers.

    Query row ``r`` sits at position ``S - m + r`` and sees the keys ``0 .. S - m + r`` (the sequence's own last
    ``m`` rows are the query tokens' K and V). Query head ``h`` reads KV head ``h // (num_heads / num_kv_heads)``
    (grouped-query attention). Logits, softmax and sums in float32 (``"reference"``: float64).

    Args:
        query: ``[m, num_heads, head_dim]`` post-RoPE queries of the last ``m`` tokens.
        keys, values: ``[S, num_kv_heads, head_dim]``, ``S >= m``, post-RoPE keys at positions ``0 .. S - 1``; all
            three of one dtype (float32/bfloat16/float16) and device; ``num_heads`` a multiple of ``num_kv_heads``.
        scale: the logits' scale (``head_dim ** -0.5`` in most models).
        impl: ``"auto"`` (torch code on every device: no Triton kernel), ``"cpu"``, ``"torch"`` or ``"reference"``.

    Returns:
        The attention output ``[m, num_heads, head_dim]`` in ``query``'s dtype, and float32 ``[S]``: per key, its
        attention probabilities summed over the query rows and heads (the whole sums to ``m * num_heads``).

    Raises:
        ValueError: shapes, dtypes or devices that do not fit, or unknown ``impl`` (``"triton"`` included).
    """
    which = resolve_impl(impl, query.device, available=("cpu", "torch", "reference"), op="question_attention")
    if query.dim() != 3 or query.dtype not in KV_DTYPES:
        raise ValueError(
            f"query must be float32/bfloat16/float16 [m, num_heads, head_dim], got {query.dtype} {tuple(query.shape)}"
        )
    m, num_heads, head_dim = query.shape
    for name, t in (("keys", keys), ("values", values)):
        if (
            t.dim() != 3
            or t.shape[0] < m
            or t.shape[2] != head_dim
            or t.shape != keys.shape
            or t.shape[1] == 0
            or num_heads % t.shape[1]
            or t.dtype != query.dtype
            or t.device != query.device
        ):
            raise ValueError(
                f"{name} must be {query.dtype} [S >= {m}, num_kv_heads dividing {num_heads}, {head_dim}] on "
                f"{query.device} (keys and values alike), got {t.dtype} {tuple(t.shape)} on {t.device}"
            )
    if which == "reference":
        out, received = question_attention_reference(query, keys, values, scale)
        return out.to(query.device), received.to(device=query.device, dtype=torch.float32)
    return question_attention_torch(query, keys, values, scale)
