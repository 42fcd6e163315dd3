"""Block keys: 16 bytes, chained, resumable, isolated by namespace/salt/LoRA/extras, stable across processes."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import cbor2
import numpy as np
import pytest

from ucm.hashing import (
    CANONICAL_FORMAT_VERSION,
    KEY_NBYTES,
    KVNamespace,
    block_keys,
    partial_block_key,
    rank_keys,
    request_seed,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
BLOCK_SIZES = [1, 3, 16]
HASH_SEEDS = ["0", "1", "random"]

NAMESPACE = KVNamespace(
    model="Qwen/Qwen3-0.6B@main",
    kv_dtype="bfloat16",
    block_size=4,
    num_layers=28,
    num_kv_heads=8,
    head_dim=128,
    tp_size=2,
    tp_rank=1,
)
SALT = "tenant-a"
LORA = "sql-lora"
# Covers 0, the uint32 maximum and values around 2**16; 13 tokens = 3 full blocks of 4 and a partial tail.
GOLDEN_TOKENS = [0, 1, 2, 3, 151643, 2**32 - 1, 7, 42, 65535, 65536, 9, 10, 11]
# Keys of GOLDEN_TOKENS under NAMESPACE / SALT / LORA, computed once and frozen. If this test fails, the key
# format changed: stored blocks written by earlier versions become unreachable (or worse, are read under a
# different meaning). Such a change must bump CANONICAL_FORMAT_VERSION (ucm.hashing) and then update these values.
GOLDEN_KEYS_HEX = [
    "4b24aa6ba8fc882e5841a3edc070bc14",
    "4bd3c2843e42daaceeec02abb6675fc1",
    "dae834e43b5ff4ae7afb77278959b1aa",
]
GOLDEN_FORMAT_VERSION = 1


def golden_keys_hex() -> list[str]:
    seed = request_seed(NAMESPACE.digest(), cache_salt=SALT, lora_name=LORA)
    return [k.hex() for k in block_keys(seed, GOLDEN_TOKENS, NAMESPACE.block_size)]


def make_tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 2**32, size=n, dtype=np.int64).tolist()


def seed_for(ns: KVNamespace = NAMESPACE, salt: str | None = None, lora: str | None = None) -> bytes:
    return request_seed(ns.digest(), cache_salt=salt, lora_name=lora)


SEED = seed_for()


# -- shape of the result ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", BLOCK_SIZES, ids=lambda b: f"bs{b}")
@pytest.mark.parametrize("num_tokens", [0, 1, 15, 16, 17, 50], ids=lambda n: f"tokens{n}")
def test_one_key_per_full_block(block_size: int, num_tokens: int) -> None:
    keys = block_keys(SEED, make_tokens(num_tokens, 0), block_size)
    assert len(keys) == num_tokens // block_size
    assert all(isinstance(k, bytes) and len(k) == KEY_NBYTES == 16 for k in keys)
    assert len(set(keys)) == len(keys)


def test_partial_tail_is_ignored() -> None:
    tokens = make_tokens(35, 1)
    assert block_keys(SEED, tokens, 16) == block_keys(SEED, tokens[:32], 16)
    assert block_keys(SEED, [*tokens[:32], 5, 6], 16) == block_keys(SEED, tokens[:32], 16)


def test_input_types_agree() -> None:
    tokens = make_tokens(48, 2)
    want = block_keys(SEED, tokens, 16)
    assert block_keys(SEED, tuple(tokens), 16) == want
    assert block_keys(SEED, np.array(tokens, dtype=np.int64), 16) == want
    assert block_keys(SEED, np.array(tokens, dtype=np.uint32), 16) == want


def test_matches_the_documented_formula() -> None:
    # key[i] = BLAKE2b-128(key[i-1] || CBOR(extras) || tokens as little-endian uint32), key[-1] = seed.
    tokens = make_tokens(8, 3)
    parent = SEED
    want = []
    for i in range(2):
        h = hashlib.blake2b(digest_size=16)
        h.update(parent)
        h.update(cbor2.dumps([], canonical=True))
        h.update(np.array(tokens[i * 4 : (i + 1) * 4], dtype="<u4").tobytes())
        parent = h.digest()
        want.append(parent)
    assert block_keys(SEED, tokens, 4) == want


# -- chaining and resume ---------------------------------------------------------------------------------------------


def test_change_in_block_0_changes_every_key() -> None:
    tokens = make_tokens(5 * 16, 4)
    base = block_keys(SEED, tokens, 16)
    changed = list(tokens)
    changed[3] ^= 1
    other = block_keys(SEED, changed, 16)
    assert all(a != b for a, b in zip(base, other, strict=True))


def test_change_in_block_2_keeps_earlier_keys() -> None:
    tokens = make_tokens(5 * 16, 5)
    base = block_keys(SEED, tokens, 16)
    changed = list(tokens)
    changed[2 * 16 + 7] = (changed[2 * 16 + 7] + 1) % 2**32
    other = block_keys(SEED, changed, 16)
    assert other[:2] == base[:2]
    assert all(a != b for a, b in zip(base[2:], other[2:], strict=True))


def test_token_order_matters_within_a_block() -> None:
    assert block_keys(SEED, [1, 2, 3, 4], 4) != block_keys(SEED, [2, 1, 3, 4], 4)


def test_block_boundaries_matter() -> None:
    tokens = make_tokens(12, 6)
    assert block_keys(SEED, tokens, 4)[-1] != block_keys(SEED, tokens, 6)[-1]


@pytest.mark.parametrize("start_block", [1, 2, 4, 5], ids=lambda s: f"from{s}")
def test_resume_equals_full(start_block: int) -> None:
    tokens = make_tokens(5 * 16 + 3, 7)
    extras = [[f"img-{i}"] if i % 2 else [] for i in range(5)]
    full = block_keys(SEED, tokens, 16, extras)
    resumed = block_keys(SEED, tokens, 16, extras, start_parent=full[start_block - 1], start_block=start_block)
    assert resumed == full[start_block:]


# -- what isolates keys ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("salt", "lora"),
    [("tenant-b", None), (None, "lora-a"), ("", None), (None, "")],
    ids=["salt", "lora", "empty-salt", "empty-lora"],
)
def test_salt_and_lora_change_keys(salt: str | None, lora: str | None) -> None:
    tokens = make_tokens(32, 8)
    assert block_keys(seed_for(salt=salt, lora=lora), tokens, 16) != block_keys(SEED, tokens, 16)
    assert block_keys(seed_for(salt=salt, lora=lora), tokens, 16)[0] != block_keys(SEED, tokens, 16)[0]


def test_salt_and_lora_are_not_interchangeable() -> None:
    assert seed_for(salt="x") != seed_for(lora="x")


# One changed value per KVNamespace field; the test below checks that the list covers every field.
NAMESPACE_CHANGES = {
    "model": "Qwen/Qwen3-0.6B@other",
    "kv_dtype": "float16",
    "block_size": 16,
    "num_layers": 27,
    "num_kv_heads": 4,
    "head_dim": 64,
    "tp_size": 4,
    "tp_rank": -1,
    "format_version": CANONICAL_FORMAT_VERSION + 1,
    "attention": "rerope(window=128,leaky_factor=None)",
}


def test_dense_attention_keeps_the_digest_of_namespaces_without_the_field() -> None:
    """``attention`` joined the namespace later: a dense engine's namespace digest is the one computed before the
    field existed (pinned here), so stores keep serving their blocks."""
    assert NAMESPACE.attention == "dense"
    assert NAMESPACE.digest().hex() == "9e31c04edea23480999b932990abfb76"


def test_namespace_changes_cover_every_field() -> None:
    assert set(NAMESPACE_CHANGES) == {f.name for f in dataclasses.fields(KVNamespace)}


@pytest.mark.parametrize(("field", "value"), list(NAMESPACE_CHANGES.items()), ids=list(NAMESPACE_CHANGES))
def test_namespace_field_changes_keys(field: str, value: object) -> None:
    ns = dataclasses.replace(NAMESPACE, **{field: value})
    assert ns.digest() != NAMESPACE.digest()
    assert len(ns.digest()) == KEY_NBYTES
    tokens = make_tokens(32, 9)
    ours, theirs = block_keys(SEED, tokens, 16), block_keys(seed_for(ns), tokens, 16)
    assert all(a != b for a, b in zip(ours, theirs, strict=True))


@pytest.mark.parametrize("at", [0, 2, 4], ids=lambda b: f"block{b}")
def test_block_extras_change_blocks_from_theirs_on(at: int) -> None:
    tokens = make_tokens(5 * 16, 10)
    base = block_keys(SEED, tokens, 16)
    extras: list[list[str]] = [[] for _ in range(5)]
    extras[at] = ["mm-hash-0123"]
    keyed = block_keys(SEED, tokens, 16, extras)
    assert keyed[:at] == base[:at]
    assert all(a != b for a, b in zip(base[at:], keyed[at:], strict=True))


def test_block_extras_empty_lists_equal_no_extras() -> None:
    tokens = make_tokens(48, 11)
    assert block_keys(SEED, tokens, 16, [[], [], []]) == block_keys(SEED, tokens, 16)


def test_block_extras_values_and_order_matter() -> None:
    tokens = make_tokens(16, 12)
    a = block_keys(SEED, tokens, 16, [["x", "y"]])
    assert a != block_keys(SEED, tokens, 16, [["y", "x"]])
    assert a != block_keys(SEED, tokens, 16, [["xy"]])


# -- bad inputs ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [0, -4], ids=["zero", "negative"])
def test_bad_block_size(block_size: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_keys(SEED, [1, 2, 3, 4], block_size)


@pytest.mark.parametrize(
    "bad",
    [-1, 2**32, 2**40, 2**63, 2**64],
    ids=["negative", "2**32", "2**40", "2**63", "2**64"],
)
def test_token_outside_uint32(bad: int) -> None:
    with pytest.raises(ValueError, match="token"):
        block_keys(SEED, [1, 2, bad, 4], 4)


def test_token_outside_uint32_in_partial_tail() -> None:
    # Even a token that gets no key is validated: it means the caller passed garbage.
    with pytest.raises(ValueError, match="token"):
        block_keys(SEED, [1, 2, 3, 4, -5], 4)


@pytest.mark.parametrize(
    "tokens",
    [[1.5, 2.0, 3.0, 4.0], np.ones((2, 4), dtype=np.int64)],
    ids=["floats", "two-dim"],
)
def test_tokens_must_be_a_flat_integer_sequence(tokens: object) -> None:
    with pytest.raises(ValueError, match="token"):
        block_keys(SEED, tokens, 4)  # type: ignore[arg-type]


def test_inconsistent_resume() -> None:
    tokens = make_tokens(48, 13)
    keys = block_keys(SEED, tokens, 16)
    with pytest.raises(ValueError, match="start_parent"):
        block_keys(SEED, tokens, 16, start_block=1)  # no parent
    with pytest.raises(ValueError, match="start_parent"):
        block_keys(SEED, tokens, 16, start_parent=keys[0], start_block=0)  # parent for block 0
    with pytest.raises(ValueError, match="start_block"):
        block_keys(SEED, tokens, 16, start_parent=keys[0], start_block=-1)
    with pytest.raises(ValueError, match="start_block"):
        block_keys(SEED, tokens, 16, start_parent=keys[2], start_block=4)  # past the last full block (3)
    with pytest.raises(ValueError, match="start_parent"):
        block_keys(SEED, tokens, 16, start_parent=keys[0][:8], start_block=1)  # not a key


def test_resume_at_the_end_gives_no_keys() -> None:
    tokens = make_tokens(48, 14)
    keys = block_keys(SEED, tokens, 16)
    assert block_keys(SEED, tokens, 16, start_parent=keys[-1], start_block=3) == []


def test_block_extras_must_cover_every_full_block() -> None:
    with pytest.raises(ValueError, match="block_extras"):
        block_keys(SEED, make_tokens(48, 15), 16, [["a"], []])


def test_request_seed_needs_a_16_byte_digest() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        request_seed(b"\x00" * 15)


# -- stability -------------------------------------------------------------------------------------------------------


def test_golden_keys() -> None:
    assert CANONICAL_FORMAT_VERSION == GOLDEN_FORMAT_VERSION, "format version bumped: recompute GOLDEN_KEYS_HEX"
    assert golden_keys_hex() == GOLDEN_KEYS_HEX


_SUBPROCESS_SCRIPT = """
import json
from ucm.hashing import KVNamespace, block_keys, request_seed
ns = KVNamespace(**json.loads({ns!r}))
seed = request_seed(ns.digest(), cache_salt={salt!r}, lora_name={lora!r})
print(json.dumps([k.hex() for k in block_keys(seed, {tokens!r}, ns.block_size)]))
"""


@pytest.mark.parametrize("hash_seed", HASH_SEEDS, ids=lambda s: f"PYTHONHASHSEED={s}")
def test_same_keys_in_another_process(hash_seed: str) -> None:
    script = _SUBPROCESS_SCRIPT.format(
        ns=json.dumps(dataclasses.asdict(NAMESPACE)), salt=SALT, lora=LORA, tokens=GOLDEN_TOKENS
    )
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == golden_keys_hex() == GOLDEN_KEYS_HEX


def test_rank_keys_one_rank_is_identity_and_ranks_differ() -> None:
    """With TP each rank stores its shard under its own key; the scheduler checks rank 0's."""
    keys = [bytes([i]) * 16 for i in range(3)]
    assert rank_keys(keys, 0, 1) == keys
    r0, r1 = rank_keys(keys, 0, 2), rank_keys(keys, 1, 2)
    assert len({*r0, *r1, *keys}) == 9 and all(len(k) == 16 for k in r0 + r1)
    assert rank_keys(keys, 1, 2) == r1  # deterministic
    with pytest.raises(ValueError, match="tp_rank"):
        rank_keys(keys, 2, 2)


# -- partial blocks (CacheBlend's chunk tails) ------------------------------------------------------------------------


def test_partial_block_key_matches_the_documented_formula() -> None:
    tokens = GOLDEN_TOKENS[12:]
    parent = block_keys(SEED, GOLDEN_TOKENS, 4)[-1]
    h = hashlib.blake2b(digest_size=16, person=b"ucm-partial")
    h.update(parent + np.asarray(tokens, dtype="<u4").tobytes())
    assert partial_block_key(parent, tokens) == h.digest()
    assert partial_block_key(parent, np.asarray(tokens, dtype=np.int64)) == h.digest()


def test_partial_block_key_names_its_parent_and_tokens_and_is_not_a_full_blocks() -> None:
    tokens = make_tokens(7, 3)  # one full block of 4, a tail of 3
    k0, k1 = block_keys(SEED, [*tokens, 1], 4)  # the tail completed to a full block
    key = partial_block_key(k0, tokens[4:])
    assert key != partial_block_key(SEED, tokens[4:])  # another parent
    assert key != partial_block_key(k0, tokens[4:6]) and key != partial_block_key(k0, tokens[4:][::-1])
    assert key not in (k0, k1)  # a full block's key is never a partial block's
    assert partial_block_key(k0, tokens[4:]) == key  # deterministic


@pytest.mark.parametrize(
    ("parent", "tokens", "match"),
    [(b"short", [1], "16-byte"), (SEED, [], "non-empty"), (SEED, [2**32], "in \\[0"), (SEED, [-1], "in \\[0")],
    ids=["short-parent", "no-tokens", "too-big", "negative"],
)
def test_partial_block_key_refuses_bad_input(parent: bytes, tokens: list[int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        partial_block_key(parent, tokens)
