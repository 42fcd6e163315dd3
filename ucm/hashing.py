"""Block keys: request tokens -> chained 16-byte keys, equal across processes, machines and hash seeds.

``key[i] = BLAKE2b-128(key[i-1] || CBOR(block extras) || token_ids of block i as little-endian uint32)``, with
``key[-1]`` the request's seed ``BLAKE2b-128(namespace || CBOR({cache_salt, lora}))``. Only full blocks get keys.

The namespace (:class:`KVNamespace`) digests everything that makes stored KV differ besides the tokens: model,
KV dtype, block_size, number of layers, num_kv_heads, head_dim, tensor-parallel size and rank, and the canonical
block format version. The chain makes a key name its whole prefix, as vLLM's own prefix-cache hash does
(``vllm/v1/core/kv_cache_utils.py``); unlike vLLM's, it never uses Python's ``hash()`` or pickle, so it is stable
across processes and ``PYTHONHASHSEED`` values. BLAKE2b (hashlib) is used rather than a non-cryptographic hash
because keys decide which tenant's KV a request reads: forging a collision must be infeasible.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import cbor2
import numpy as np

KEY_NBYTES = 16
# Version of the canonical block format (ucm.kernels.layouts); part of every key.
CANONICAL_FORMAT_VERSION = 1


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_NBYTES)
    for part in parts:
        h.update(part)
    return h.digest()


@dataclass(frozen=True)
class KVNamespace:
    """What makes stored KV differ besides the tokens. Two engines share blocks only if these are all equal.

    Attributes:
        model: model identity (name or path as given to vLLM, plus revision if any).
        kv_dtype: KV cache dtype name, e.g. ``"bfloat16"``.
        block_size: tokens per block.
        num_layers: attention layers with KV.
        num_kv_heads: KV heads per rank.
        head_dim: elements per head.
        tp_size: tensor-parallel size.
        tp_rank: this rank, or -1 when all ranks hold the same KV (MLA).
        format_version: canonical block format version.
        attention: how the KV was computed, when not by dense attention (e.g. ReRoPE's window past which later
            layers' KV differs from dense): ``"dense"`` is left out of the digest, so dense stores keep their keys.
    """

    model: str
    kv_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_size: int = 1
    tp_rank: int = 0
    format_version: int = CANONICAL_FORMAT_VERSION
    attention: str = "dense"

    def digest(self) -> bytes:
        """16-byte digest of the namespace (canonical CBOR of the fields, ``attention`` only when not dense, then
        BLAKE2b-128)."""
        fields = asdict(self)
        if fields["attention"] == "dense":
            del fields["attention"]
        return _digest(b"ucm-namespace", cbor2.dumps(fields, canonical=True))


def request_seed(namespace_digest: bytes, cache_salt: str | None = None, lora_name: str | None = None) -> bytes:
    """The chain's seed for one request: namespace plus what isolates requests (cache_salt, LoRA adapter).

    Raises:
        ValueError: ``namespace_digest`` is not 16 bytes.
    """
    if len(namespace_digest) != KEY_NBYTES:
        raise ValueError(f"namespace_digest must be {KEY_NBYTES} bytes, got {len(namespace_digest)}")
    extras = cbor2.dumps({"cache_salt": cache_salt, "lora": lora_name}, canonical=True)
    return _digest(b"ucm-request", namespace_digest, extras)


def _uint32_tokens(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """``token_ids`` as an int64 array, checked: 1-D, integers, each in ``[0, 2**32)`` (empty is fine).

    Raises:
        ValueError: not a 1-D integer sequence, or a token id outside uint32.
    """
    # No dtype forced here: a forced int64 conversion would truncate floats and overflow (OverflowError) on huge ints.
    tokens = np.asarray(token_ids)
    if tokens.ndim != 1 or (tokens.size and tokens.dtype.kind not in "iu"):
        raise ValueError(f"token ids must be a 1-D sequence of integers, got {tokens.ndim}-D {tokens.dtype}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 1 << 32):
        raise ValueError("token ids must be in [0, 2**32)")
    return tokens.astype(np.int64)


def block_keys(
    seed: bytes,
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    block_extras: Sequence[Sequence[str]] | None = None,
    start_parent: bytes | None = None,
    start_block: int = 0,
) -> list[bytes]:
    """Chained keys of the full blocks of ``token_ids``.

    Args:
        seed: the request seed (:func:`request_seed`).
        token_ids: the request's token ids (ints in [0, 2**32)); a trailing partial block gets no key.
        block_size: tokens per block (> 0).
        block_extras: optional per-block strings hashed with block ``i`` (e.g. the identifiers of multimodal
            inputs overlapping it); ``block_extras[i]`` for block ``i``.
        start_parent / start_block: resume a chain: compute keys of blocks ``start_block..`` given the key of
            block ``start_block - 1`` (``None`` when ``start_block == 0``).

    Returns:
        ``len(token_ids) // block_size - start_block`` keys of 16 bytes.

    Raises:
        ValueError: ``block_size`` <= 0, token ids not a 1-D integer sequence in uint32, ``block_extras`` shorter
            than the number of full blocks, or an inconsistent resume point.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    if (start_block == 0) != (start_parent is None):
        raise ValueError("start_parent must be given exactly when start_block > 0")
    if start_parent is not None and len(start_parent) != KEY_NBYTES:
        raise ValueError(f"start_parent must be a {KEY_NBYTES}-byte key, got {len(start_parent)} bytes")
    tokens = _uint32_tokens(token_ids)
    num_full = tokens.size // block_size
    if not 0 <= start_block <= num_full:
        raise ValueError(f"start_block must be in [0, {num_full}] (the number of full blocks), got {start_block}")
    if block_extras and len(block_extras) < num_full:
        raise ValueError(f"block_extras has {len(block_extras)} entries, fewer than the {num_full} full blocks")
    raw = tokens[: num_full * block_size].astype("<u4").tobytes()
    row = block_size * 4
    parent = seed if start_parent is None else start_parent
    keys: list[bytes] = []
    for i in range(start_block, num_full):
        extras = cbor2.dumps(list(block_extras[i]), canonical=True) if block_extras else b"\x80"
        parent = _digest(parent, extras, raw[i * row : (i + 1) * row])
        keys.append(parent)
    return keys


def partial_block_key(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The key of a trailing partial block: ``token_ids`` (fewer than a block's tokens) after the full block whose key
    is ``parent`` (the request seed when there is none). ``BLAKE2b-128(parent || token_ids as little-endian
    uint32)`` personalized ``ucm-partial``: a hash function of its own, so a partial block's key never equals a full
    block's. Only CacheBlend stores partial blocks (a chunk's tail, ``ucm.integration.vllm.blend``); prefix caching
    stores full blocks only.

    Raises:
        ValueError: ``parent`` is not 16 bytes, ``token_ids`` is empty, or a token id is not in ``[0, 2**32)``.
    """
    if len(parent) != KEY_NBYTES:
        raise ValueError(f"parent must be a {KEY_NBYTES}-byte key, got {len(parent)} bytes")
    tokens = _uint32_tokens(token_ids)
    if not tokens.size:
        raise ValueError("token ids must be a non-empty 1-D sequence of integers, got none")
    h = hashlib.blake2b(digest_size=KEY_NBYTES, person=b"ucm-partial")
    h.update(parent)
    h.update(tokens.astype("<u4").tobytes())
    return h.digest()


def rank_keys(keys: Sequence[bytes], tp_rank: int, tp_size: int) -> list[bytes]:
    """Keys of one tensor-parallel rank's shards: the request keys themselves with one rank, else
    ``BLAKE2b-128(key || rank as u32 little-endian)``, so each rank's shard of a block is stored under its own key.

    Raises:
        ValueError: ``tp_rank`` is not in ``[0, tp_size)``.
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
    if tp_size == 1:
        return list(keys)
    suffix = tp_rank.to_bytes(4, "little")
    return [_digest(k, suffix) for k in keys]
