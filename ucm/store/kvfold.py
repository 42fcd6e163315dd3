"""KVfold: the block codec of the ``Compress`` stage (bytes in, bytes out; no I/O).

A canonical bf16 block (see :mod:`ucm.kernels.layouts`) is cut into *sections* and each section encoded on its own,
so that each has its own statistics (K and V of a layer differ) and blocks encode and decode independently, in
parallel (zstandard and numpy release the GIL). With the model's geometry known, a section is one layer's K or one
layer's V: ``block_size * num_kv_heads * head_dim`` values; otherwise the whole block is one section.

Modes (all stored in a self-describing container, so a block is decoded the same whatever the reader's settings):

- ``lossless`` (mode 1): the block's values are split into an exponent plane and a sign+mantissa plane
  (:mod:`ucm.kernels.kvfold`, bf16 planes). The exponent plane is entropy-coded with zstandard at level 1 with a minimum
  match of 7 and tiny match tables (``LOSSLESS_ZSTD_PARAMS``): on KV, matches are rare, and these settings leave
  zstd's Huffman literal coder doing nearly all the work, faster and with a better ratio than plain zstd-1 (figures:
  "KVfold codec" in ``benchmarks/RESULTS.md``). It is one zstd frame per block, ended into one zstd block per section
  (``COMPRESSOBJ_FLUSH_BLOCK``), so each section gets its own Huffman table while the whole plane decodes in one
  call. The sign+mantissa plane (about 8 bits of entropy per value) is stored raw. When zstd would not shrink the
  exponent plane, it is stored raw too. Bit-exact for all 65,536 bf16 bit patterns.
- ``int8`` (mode 2, fixed rate, **lossy**): :mod:`ucm.kernels.kvfold` (int8 groups), one bf16 scale per ``group`` values
  (``head_dim``: per (token, head)); ``8 + 16 / group`` bits per value. A block holding inf or NaN is encoded
  lossless instead, so non-finite values are never quantized.

Container (version 2; version 1 is still read), little-endian; the Posix stage stores it as a block file of codec
``CODEC_KVFOLD``:

======  ======================  ===========================================================
offset  size                    field
======  ======================  ===========================================================
0       1                       container version (u8, 2)
1       1                       mode (u8): 1 lossless, 2 int8
2       1                       dtype code (u8): 0 = bf16 (the only one encoded; other dtypes are stored raw)
3       1                       reserved, 0
4       4                       raw block size in bytes (u32)
8       4                       number of sections S (u32); the raw block divides into S equal sections
12      4                       int8: values per scale (u32); lossless: 0
16      ..                      the body, by mode
======  ======================  ===========================================================

Lossless body, for the block's ``N`` values: ``u32 c`` (size of the exponent plane as stored), the exponent plane of
all ``N`` values (a zstd frame, one zstd block per section, when ``c < N``; raw when ``c == N``), then the ``N``
sign+mantissa bytes. int8 body: ``4 * S`` bytes of section sizes (u32 each), then each section of ``n = N / S``
values: its ``n / group`` bf16 scales, then its ``n`` int8 values.

Version 1 (written by UCM before the one-frame layout; decoded, never written) has the int8 body above for both
modes; a version-1 lossless section of ``n`` values is ``u32 c``, its exponent plane (a zstd frame when ``c < n``,
raw when ``c == n``), then its ``n`` sign+mantissa bytes. Decoding it costs a few Python calls per section instead of
per block: slower, and holding the GIL long enough that more threads hardly help (figures: "KVfold codec" in
``benchmarks/RESULTS.md``).

Decoding validates every size against the container and the expected raw block size; anything inconsistent raises
:class:`~ucm.store.base.BlockCorruptedError` (a miss for the caller), never returns wrong bytes. Integrity of the
stored bytes themselves is the Posix stage's checksum.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import zstandard

from ucm.kernels.kvfold import (
    all_finite,
    dequantize_int8_groups,
    merge_planes_np,
    quantize_int8_groups,
    split_bf16_planes,
)
from ucm.store.base import BlockCorruptedError

CONTAINER_VERSION = 2  # written
READ_VERSIONS = (1, 2)  # decoded
MODE_LOSSLESS = 1
MODE_INT8 = 2
DTYPE_BF16 = 0
DEFAULT_GROUP = 64  # values per scale when the geometry (head_dim) is not known
CONTAINER = struct.Struct("<BBBBIII")  # version, mode, dtype, reserved, block nbytes, sections, group
PLANE_SIZE = struct.Struct("<I")  # lossless: the exponent plane's stored size

# zstd on the exponent plane: level 1, matches of 7+ bytes only, small tables (see the module docstring).
LOSSLESS_ZSTD_PARAMS = {
    "compression_level": 1,
    "window_log": 17,
    "hash_log": 6,
    "chain_log": 6,
    "search_log": 1,
    "min_match": 7,
    "strategy": zstandard.STRATEGY_FAST,
}

Mode = Literal["lossless", "int8"]


@dataclass(frozen=True)
class KVGeometry:
    """The geometry of a canonical block (one rank's shard of the model's KV).

    Attributes:
        num_layers, block_size, num_kv_heads, head_dim: as in vLLM; dtype: the KV dtype.
    """

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def section_values(self) -> int:
        """Values in one layer's K (or V): ``block_size * num_kv_heads * head_dim``."""
        return self.block_size * self.num_kv_heads * self.head_dim

    @property
    def block_nbytes(self) -> int:
        """Bytes of one canonical block: ``num_layers * 2 * section_values * element size``."""
        return self.num_layers * 2 * self.section_values * torch.empty((), dtype=self.dtype).element_size()


_local = threading.local()


def _compressor() -> zstandard.ZstdCompressor:
    c = getattr(_local, "cctx", None)
    if c is None:
        params = zstandard.ZstdCompressionParameters(**LOSSLESS_ZSTD_PARAMS)
        c = _local.cctx = zstandard.ZstdCompressor(compression_params=params)
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


def sections_of(block_nbytes: int, geometry: KVGeometry | None) -> int:
    """Number of sections a bf16 block of ``block_nbytes`` is cut into: ``2 * num_layers`` when ``geometry``
    describes this block size, else 1."""
    if geometry is not None and geometry.dtype == torch.bfloat16 and geometry.block_nbytes == block_nbytes:
        return 2 * geometry.num_layers
    return 1


def encode_block(block: torch.Tensor, mode: Mode, geometry: KVGeometry | None = None) -> tuple[bytes, list[int], Mode]:
    """Encode one canonical bf16 block.

    Args:
        block: contiguous CPU uint8 ``[block_nbytes]`` (the block's bytes; bf16 values, even size, < 4 GiB).
        mode: ``"lossless"`` or ``"int8"`` (lossy, fixed rate).
        geometry: the model's block geometry, for sections (K / V per layer) and the int8 group (``head_dim``).

    Returns:
        ``(container, section sizes in bytes, mode used)``; the mode used is ``"lossless"`` when ``"int8"`` was
        asked for a block holding inf/NaN or whose sections do not divide into groups.

    Raises:
        ValueError: odd or empty block size, or an unknown mode.
    """
    n_bytes = block.numel()
    if n_bytes == 0 or n_bytes % 2 or n_bytes >= 1 << 32:
        raise ValueError(f"a bf16 block must have an even, non-zero size below 4 GiB, got {n_bytes} bytes")
    if mode not in ("lossless", "int8"):
        raise ValueError(f"mode must be 'lossless' or 'int8', got {mode!r}")
    num_sections = sections_of(n_bytes, geometry)
    values = block.view(torch.bfloat16).reshape(num_sections, -1)  # [S, n]
    n = values.shape[1]
    group = geometry.head_dim if geometry is not None and num_sections > 1 else DEFAULT_GROUP
    if mode == "int8" and (n % group or not all_finite(values)):
        mode = "lossless"
    mode_code = MODE_INT8 if mode == "int8" else MODE_LOSSLESS
    if mode == "int8":
        parts: list[bytes] = []
        for s in range(num_sections):
            q, scale = quantize_int8_groups(values[s], group)
            parts.append(scale.view(torch.uint8).numpy().tobytes() + q.view(torch.uint8).numpy().tobytes())
        sizes = [len(p) for p in parts]
        body = [struct.pack(f"<{num_sections}I", *sizes), *parts]
    else:
        group = 0
        body, sizes = _encode_lossless(values)
    header = CONTAINER.pack(CONTAINER_VERSION, mode_code, DTYPE_BF16, 0, n_bytes, num_sections, group)
    return b"".join([header, *body]), sizes, mode


def _encode_lossless(values: torch.Tensor) -> tuple[list[bytes], list[int]]:
    """The lossless body (see the module docstring) of bf16 ``values`` ``[S, n]``, and each section's stored bytes
    (its exponent bytes in the plane as stored, plus its ``n`` sign+mantissa bytes)."""
    num_sections, n = values.shape
    total = num_sections * n
    exp, sm = split_bf16_planes(values.reshape(-1))
    exp_np = exp.numpy()
    packer = _compressor().compressobj(size=total)
    chunks: list[bytes] = []
    sizes: list[int] = []
    for s in range(num_sections):
        chunk = packer.compress(exp_np[s * n : (s + 1) * n].data) + packer.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)
        chunks.append(chunk)
        sizes.append(len(chunk) + n)
    chunks.append(packer.flush())
    plane = b"".join(chunks)
    if len(plane) >= total:
        plane = exp_np.tobytes()
        sizes = [2 * n] * num_sections
    return [PLANE_SIZE.pack(len(plane)), plane, sm.numpy().tobytes()], sizes


def container_mode(payload: bytes | bytearray | memoryview) -> Mode:
    """The mode a container was written with (``"lossless"`` or ``"int8"``).

    Raises:
        BlockCorruptedError: too short or an unknown version or mode.
    """
    if len(payload) < CONTAINER.size:
        raise BlockCorruptedError(f"KVfold container of {len(payload)} bytes is shorter than its header")
    version, mode_code = payload[0], payload[1]
    if version not in READ_VERSIONS or mode_code not in (MODE_LOSSLESS, MODE_INT8):
        raise BlockCorruptedError(f"KVfold container version {version} mode {mode_code}: unknown")
    return "int8" if mode_code == MODE_INT8 else "lossless"


@dataclass(frozen=True)
class ContainerHeader:
    """The fixed header of a KVfold container (the first ``CONTAINER.size`` bytes), not checked against a block.

    Attributes:
        version: container version (u8); mode_code: 1 lossless, 2 int8; dtype_code: 0 bf16;
        block_nbytes: the raw block size the container decodes to, in bytes; num_sections: sections S.
    """

    version: int
    mode_code: int
    dtype_code: int
    block_nbytes: int
    num_sections: int

    @property
    def known(self) -> bool:
        """True when this version decodes such a container (its version, mode and dtype); a container that is not
        known was written by another (newer) UCM, not damaged."""
        return (
            self.version in READ_VERSIONS
            and self.mode_code in (MODE_LOSSLESS, MODE_INT8)
            and self.dtype_code == DTYPE_BF16
        )


def read_container_header(payload: bytes | bytearray | memoryview) -> ContainerHeader:
    """The header of the container ``payload`` (no other check: :func:`decode_block` validates the rest).

    Raises:
        BlockCorruptedError: ``payload`` is shorter than the container header (16 bytes).
    """
    mv = memoryview(payload).cast("B")
    if len(mv) < CONTAINER.size:
        raise BlockCorruptedError(f"KVfold container of {len(mv)} bytes is shorter than its header")
    version, mode_code, dtype_code, _, n_bytes, num_sections, _ = CONTAINER.unpack_from(mv, 0)
    return ContainerHeader(version, mode_code, dtype_code, n_bytes, num_sections)


def decode_block(payload: bytes | bytearray | memoryview, dst: torch.Tensor) -> Mode:
    """Decode a container from :func:`encode_block` into ``dst``.

    Args:
        payload: the container bytes.
        dst: contiguous CPU uint8 ``[block_nbytes]``, the expected raw block size; written in full on success,
            unspecified on error.

    Returns:
        The mode the block was stored with (``"int8"`` means the values carry quantization error).

    Raises:
        BlockCorruptedError: the container does not describe a bf16 block of ``dst``'s size, or any size or zstd
            frame inside it is inconsistent.
    """
    mv = memoryview(payload).cast("B")
    mode = container_mode(mv)
    _, _, dtype_code, _, n_bytes, num_sections, group = CONTAINER.unpack_from(mv, 0)
    if dtype_code != DTYPE_BF16 or n_bytes != dst.numel() or num_sections == 0 or n_bytes % (2 * num_sections):
        raise BlockCorruptedError(
            f"KVfold container for {n_bytes} bytes in {num_sections} sections (dtype {dtype_code}) does not fit "
            f"a {dst.numel()}-byte bf16 block"
        )
    words = dst.numpy().view(np.uint16)
    if mode == "lossless" and mv[0] >= 2:
        _decode_planes(mv, CONTAINER.size, len(mv), words, "lossless body")
        return mode
    # int8 (either version) and version-1 lossless: a table of section sizes, then the sections.
    n = n_bytes // 2 // num_sections
    table_end = CONTAINER.size + 4 * num_sections
    if len(mv) < table_end:
        raise BlockCorruptedError("KVfold container is shorter than its section table")
    sizes = struct.unpack_from(f"<{num_sections}I", mv, CONTAINER.size)
    if table_end + sum(sizes) != len(mv):
        raise BlockCorruptedError(
            f"KVfold sections total {sum(sizes)} bytes; the container holds {len(mv) - table_end}"
        )
    off = table_end
    if mode == "int8":
        out = dst.view(torch.bfloat16).reshape(num_sections, n)
        if group == 0 or n % group:
            raise BlockCorruptedError(f"KVfold int8 group {group} does not divide a {n}-value section")
        n_scales = n // group
        for s, size in enumerate(sizes):
            if size != 2 * n_scales + n:
                raise BlockCorruptedError(f"KVfold int8 section {s} is {size} bytes, expected {2 * n_scales + n}")
            raw = np.frombuffer(mv[off : off + size], dtype=np.uint8)
            scale = torch.from_numpy(raw[: 2 * n_scales].view(np.int16).copy()).view(torch.bfloat16)
            q = torch.from_numpy(raw[2 * n_scales :].view(np.int8).copy())
            dequantize_int8_groups(q, scale, out=out[s])
            off += size
        return mode
    for s, size in enumerate(sizes):
        _decode_planes(mv, off, off + size, words[s * n : (s + 1) * n], f"section {s}")
        off += size
    return mode


def _decode_planes(mv: memoryview, start: int, end: int, words: np.ndarray, what: str) -> None:
    """Decode ``mv[start:end]`` = ``u32 c``, an exponent plane of ``c`` bytes (zstd frame, or raw when ``c`` is the
    value count), the sign+mantissa plane, into ``words`` (uint16 ``[n]``). Raises BlockCorruptedError."""
    n = words.shape[0]
    if end - start < PLANE_SIZE.size:
        raise BlockCorruptedError(f"KVfold {what} is {end - start} bytes, shorter than its header")
    (c,) = PLANE_SIZE.unpack_from(mv, start)
    if c > n or end - start != PLANE_SIZE.size + c + n:
        raise BlockCorruptedError(f"KVfold {what}: {end - start} bytes with a {c}-byte exponent plane of {n}")
    packed = mv[start + PLANE_SIZE.size : start + PLANE_SIZE.size + c]
    if c == n:
        exp_bytes: bytes | memoryview = packed
    else:
        try:
            exp_bytes = _decompressor().decompress(packed, max_output_size=n)
        except zstandard.ZstdError as exc:
            raise BlockCorruptedError(f"KVfold {what}: bad zstd frame: {exc}") from None
        if len(exp_bytes) != n:
            raise BlockCorruptedError(f"KVfold {what}: exponent plane of {len(exp_bytes)} values, not {n}")
    merge_planes_np(np.frombuffer(exp_bytes, dtype=np.uint8), np.frombuffer(mv[end - n : end], dtype=np.uint8), words)
