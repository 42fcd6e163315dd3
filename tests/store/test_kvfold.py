"""KVfold container: bit-exact on real KV, self-describing, and every inconsistency a BlockCorruptedError."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch

from ucm.store.base import BlockCorruptedError
from ucm.store.kvfold import CONTAINER, KVGeometry, container_mode, decode_block, encode_block

GEOMETRY = KVGeometry(num_layers=2, block_size=16, num_kv_heads=2, head_dim=32, dtype=torch.bfloat16)


def kv_block(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(GEOMETRY.block_nbytes // 2, generator=gen).to(torch.bfloat16)
    return x.view(torch.uint8)


@pytest.fixture(scope="module")
def real_kv(real_model: Path) -> torch.Tensor:
    """SmolLM2-135M's KV on 256 tokens of real English text: [2 blocks, 30 layers, 2, 128, 3, 64] bf16."""
    from ucm.testing.kv_capture import capture_kv

    return capture_kv(real_model, n_tokens=256, block_size=128)


def test_real_kv_lossless_bit_exact_and_int8_within_bound(real_kv: torch.Tensor) -> None:
    n, layers, _, block_size, heads, head_dim = real_kv.shape
    geometry = KVGeometry(layers, block_size, heads, head_dim, torch.bfloat16)
    for b in range(n):
        raw = real_kv[b].contiguous().view(torch.uint8).reshape(-1)
        container, sizes, used = encode_block(raw, "lossless", geometry)
        assert used == "lossless" and len(sizes) == 2 * layers
        assert len(container) < raw.numel() / 1.3  # real KV: measured about 1.48x (benchmarks/codec.py)
        out = torch.full_like(raw, 0xA5)
        assert decode_block(container, out) == "lossless"
        assert torch.equal(out, raw)
        container, _, used = encode_block(raw, "int8", geometry)
        assert used == "int8" and container_mode(container) == "int8"
        assert decode_block(container, out) == "int8"
        x = raw.view(torch.bfloat16).float().reshape(-1, head_dim)
        y = out.view(torch.bfloat16).float().reshape(-1, head_dim)
        step = x.abs().amax(dim=1, keepdim=True) / 127  # the scale before rounding up to bf16
        assert bool(((x - y).abs() <= step * 0.5 * 1.01 + y.abs() * 2**-8).all())


def test_sections_follow_geometry() -> None:
    raw = kv_block(1)
    _, sizes, _ = encode_block(raw, "lossless", GEOMETRY)
    assert len(sizes) == 2 * GEOMETRY.num_layers
    _, sizes, _ = encode_block(raw, "lossless", None)
    assert len(sizes) == 1
    other = KVGeometry(3, 16, 2, 32, torch.bfloat16)  # does not describe this block size: one section
    assert len(encode_block(raw, "lossless", other)[1]) == 1


def test_incompressible_plane_is_stored_raw() -> None:
    gen = torch.Generator().manual_seed(2)
    raw = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=gen)  # uniform exponents
    container, sizes, _ = encode_block(raw, "lossless")
    assert sizes == [4 + 2048 + 2048]
    out = torch.empty_like(raw)
    decode_block(container, out)
    assert torch.equal(out, raw)


def corruptions(container: bytes) -> dict[str, bytes]:
    header_end = CONTAINER.size + 4 * 2 * GEOMETRY.num_layers
    b = bytearray(container)
    cases = {}

    def patched(offset: int, value: bytes) -> bytes:
        c = bytearray(b)
        c[offset : offset + len(value)] = value
        return bytes(c)

    cases["version"] = patched(0, b"\x09")
    cases["mode"] = patched(1, b"\x07")
    cases["dtype"] = patched(2, b"\x05")
    cases["block-size"] = patched(4, struct.pack("<I", len(container)))
    cases["sections-zero"] = patched(8, struct.pack("<I", 0))
    cases["sections-odd"] = patched(8, struct.pack("<I", 3))
    cases["section-size"] = patched(CONTAINER.size, struct.pack("<I", 5))
    cases["plane-size"] = patched(header_end, struct.pack("<I", 7))
    cases["zstd-magic"] = patched(header_end + 4, b"\x00\x00\x00\x00")
    cases["truncated"] = bytes(b[:-1])
    cases["extended"] = bytes(b) + b"\x00"
    cases["short"] = bytes(b[:10])
    return cases


@pytest.mark.parametrize(
    "case",
    [
        "version",
        "mode",
        "dtype",
        "block-size",
        "sections-zero",
        "sections-odd",
        "section-size",
        "plane-size",
        "zstd-magic",
        "truncated",
        "extended",
        "short",
    ],
)
def test_inconsistent_container_raises(case: str) -> None:
    container, _, _ = encode_block(kv_block(3), "lossless", GEOMETRY)
    bad = corruptions(container)[case]
    with pytest.raises(BlockCorruptedError):
        decode_block(bad, torch.empty(GEOMETRY.block_nbytes, dtype=torch.uint8))


def test_int8_container_checks() -> None:
    container, _, _ = encode_block(kv_block(4), "int8", GEOMETRY)
    b = bytearray(container)
    b[12:16] = struct.pack("<I", 0)  # group 0
    with pytest.raises(BlockCorruptedError, match="group"):
        decode_block(bytes(b), torch.empty(GEOMETRY.block_nbytes, dtype=torch.uint8))
    with pytest.raises(BlockCorruptedError):
        decode_block(container[:-1], torch.empty(GEOMETRY.block_nbytes, dtype=torch.uint8))


def test_wrong_destination_size_raises() -> None:
    container, _, _ = encode_block(kv_block(5), "lossless", GEOMETRY)
    with pytest.raises(BlockCorruptedError, match="does not fit"):
        decode_block(container, torch.empty(GEOMETRY.block_nbytes - 2, dtype=torch.uint8))


def test_bad_encode_arguments() -> None:
    with pytest.raises(ValueError, match="even"):
        encode_block(torch.zeros(5, dtype=torch.uint8), "lossless")
    with pytest.raises(ValueError, match="mode"):
        encode_block(torch.zeros(4, dtype=torch.uint8), "zip")  # type: ignore[arg-type]
