"""KVfold container: bit-exact on real KV, self-describing, and every inconsistency a BlockCorruptedError."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch
import zstandard

from tests.store.test_compress import all_bf16_patterns
from ucm.kernels.kvfold import split_bf16_planes
from ucm.store.base import BlockCorruptedError
from ucm.store.kvfold import (
    CONTAINER,
    CONTAINER_VERSION,
    LOSSLESS_ZSTD_PARAMS,
    KVGeometry,
    container_mode,
    decode_block,
    encode_block,
)

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
    assert sizes == [2048 + 2048]
    assert len(container) == CONTAINER.size + 4 + 4096  # both planes raw
    out = torch.empty_like(raw)
    decode_block(container, out)
    assert torch.equal(out, raw)


def corruptions(container: bytes) -> dict[str, bytes]:
    body = CONTAINER.size  # lossless body: u32 exponent plane size, the plane (a zstd frame), the sign+mantissa plane
    b = bytearray(container)
    cases = {}

    def patched(offset: int, value: bytes) -> bytes:
        c = bytearray(b)
        c[offset : offset + len(value)] = value
        return bytes(c)

    (plane,) = struct.unpack_from("<I", b, body)
    cases["version"] = patched(0, b"\x09")
    cases["mode"] = patched(1, b"\x07")
    cases["dtype"] = patched(2, b"\x05")
    cases["block-size"] = patched(4, struct.pack("<I", len(container)))
    cases["sections-zero"] = patched(8, struct.pack("<I", 0))
    cases["sections-odd"] = patched(8, struct.pack("<I", 3))
    cases["plane-size"] = patched(body, struct.pack("<I", 7))
    cases["plane-size-over"] = patched(body, struct.pack("<I", plane + 1))
    cases["zstd-magic"] = patched(body + 4, b"\x00\x00\x00\x00")
    cases["zstd-content-size"] = patched(body + 4 + 5, b"\x01")  # the frame header's content size (2 bytes here)
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
        "plane-size",
        "plane-size-over",
        "zstd-magic",
        "zstd-content-size",
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


def version1_container(raw: torch.Tensor, sections: int) -> bytes:
    """A lossless container in the version-1 layout (module docstring of ucm.store.kvfold), built here from the
    planes: what UCM wrote before version 2, which stores keep."""
    cctx = zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters(**LOSSLESS_ZSTD_PARAMS))
    parts = []
    for values in raw.view(torch.bfloat16).reshape(sections, -1):
        exp, sm = split_bf16_planes(values)
        packed = cctx.compress(exp.numpy().tobytes())
        if len(packed) >= exp.numel():
            packed = exp.numpy().tobytes()
        parts.append(struct.pack("<I", len(packed)) + packed + sm.numpy().tobytes())
    head = CONTAINER.pack(1, 1, 0, 0, raw.numel(), sections, 0)
    return head + struct.pack(f"<{sections}I", *map(len, parts)) + b"".join(parts)


@pytest.mark.parametrize("which", ["kv", "all-bf16-patterns"])
def test_version1_containers_still_decode(which: str) -> None:
    """Stores written before the one-frame layout stay readable, bit-exact; damaged ones still raise."""
    if which == "kv":
        raw, sections = kv_block(6), 2 * GEOMETRY.num_layers
    else:
        raw, sections = all_bf16_patterns()[0], 4
    container = version1_container(raw, sections)
    assert container[0] == 1 and CONTAINER_VERSION == 2
    out = torch.full_like(raw, 0xA5)
    assert decode_block(container, out) == "lossless"
    assert torch.equal(out, raw)
    for bad in (
        container[:-1],
        container[: CONTAINER.size + 4 * sections + 6] + b"\x00" * 4 + container[CONTAINER.size + 4 * sections + 10 :],
    ):
        with pytest.raises(BlockCorruptedError):
            decode_block(bad, torch.empty_like(raw))


def test_int8_version1_container_still_decodes() -> None:
    """The int8 body did not change: a version-1 int8 container is the version-2 one with its version byte 1."""
    raw = kv_block(7)
    container, _, _ = encode_block(raw, "int8", GEOMETRY)
    expected = torch.empty_like(raw)
    decode_block(container, expected)
    out = torch.full_like(raw, 0xA5)
    assert decode_block(b"\x01" + container[1:], out) == "int8"
    assert torch.equal(out, expected)


def test_lossless_frame_has_one_zstd_block_per_section() -> None:
    """The exponent plane is one frame whose blocks end at section boundaries: each section's reported size is its
    share of the frame plus its sign+mantissa bytes, and they add up to the body."""
    container, sizes, _ = encode_block(kv_block(8), "lossless", GEOMETRY)
    (plane,) = struct.unpack_from("<I", container, CONTAINER.size)
    n = GEOMETRY.section_values
    assert len(sizes) == 2 * GEOMETRY.num_layers
    assert all(size > n for size in sizes)
    frame_overhead = plane - sum(size - n for size in sizes)  # frame header and the empty last block
    assert 0 < frame_overhead <= 32
    assert len(container) == CONTAINER.size + 4 + plane + 2 * GEOMETRY.num_layers * n


def test_decode_after_warm_up_compiles_nothing(tmp_path: Path) -> None:
    """The Compress stage's warm-up compiles the numba specialization every real decode uses: payloads from ``bytes``
    (read-only) and from the Posix stage's reused read buffer (a writable ``bytearray``), and the tensor API's
    planes. A second specialization compiled on the first storage hit of a process (as one did before) costs ~0.1 s
    with every decoding thread waiting on numba's compiler lock."""
    from ucm.kernels.kvfold import cpu_numba as _numba_planes
    from ucm.kernels.kvfold import merge_bf16_planes
    from ucm.store.compress import CompressStore
    from ucm.store.posix import PosixStore

    CompressStore(PosixStore(str(tmp_path)), threads=1).close()  # its constructor warms the codec up
    before = {name: list(getattr(_numba_planes, name).signatures) for name in ("split_planes", "merge_planes")}
    block = torch.randn(4096).bfloat16().view(torch.uint8)
    container, _, _ = encode_block(block, "lossless")
    for payload in (container, bytearray(container), memoryview(bytearray(container))):
        out = torch.empty_like(block)
        decode_block(payload, out)
        assert torch.equal(out, block)
    exp, sm = split_bf16_planes(block.view(torch.bfloat16))
    assert torch.equal(merge_bf16_planes(exp, sm).view(torch.uint8), block)
    after = {name: list(getattr(_numba_planes, name).signatures) for name in ("split_planes", "merge_planes")}
    assert after == before
