"""KV test data shared by the gather_blocks and scatter_blocks tests: parameter lists, bit patterns, paged caches.

Data is written through integer views, so NaN payloads, -0.0, +-inf and subnormals travel through a copy unchanged;
compare with ``bits_equal`` (or ``torch.equal`` on integer views): a float compare would call NaN != NaN and
-0.0 == 0.0. ``poisoned`` buffers start as NaN bit patterns, so an element a kernel forgot to write stands out.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from ucm.kernels import KVLayout
from ucm.kernels.layouts import int_view

LAYOUTS = [KVLayout.CPU_ATTN, KVLayout.FLASH_NHD]
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn]
BLOCK_SIZES = [16, 32, 128]
HEAD_DIMS = [64, 80, 128, 576]
NUM_KV_HEADS = [1, 3]
NUM_LAYERS = 2
NUM_BLOCKS = 7
BLOCK_IDS = [5, 0, 3, 6]  # unsorted, not a prefix, includes the last block

DTYPE_IDS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float8_e4m3fn: "fp8e4m3"}

layout_params = pytest.mark.parametrize("layout", LAYOUTS, ids=[lay.value for lay in LAYOUTS])
dtype_params = pytest.mark.parametrize("dtype", DTYPES, ids=[DTYPE_IDS[d] for d in DTYPES])


def every_kv_shape(test: Callable[..., None]) -> Callable[..., None]:
    """Parametrize ``test`` over every layout, dtype, block size, head dim and KV head count (ids like
    ``cpu_attn-bf16-bs16-d64-h1``)."""
    for params in (
        layout_params,
        dtype_params,
        pytest.mark.parametrize("block_size", BLOCK_SIZES, ids=lambda b: f"bs{b}"),
        pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda d: f"d{d}"),
        pytest.mark.parametrize("num_kv_heads", NUM_KV_HEADS, ids=lambda h: f"h{h}"),
    ):
        test = params(test)
    return test


# Bit patterns that a float copy could alter: +0, -0, +inf, -inf, quiet NaN, NaN with payload (signalling),
# negative NaN with payload, smallest / largest / negative subnormal. float8_e4m3fn has no inf (0x7F/0xFF are NaN).
SPECIAL_BITS = {
    torch.bfloat16: [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFC1, 0x0001, 0x007F, 0x8001],
    torch.float16: [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFE01, 0x0001, 0x03FF, 0x8001],
    torch.float32: [
        0x00000000,
        0x80000000,
        0x7F800000,
        0xFF800000,
        0x7FC00000,
        0x7F800001,
        0xFFC00001,
        0x00000001,
        0x007FFFFF,
        0x80000001,
    ],
    torch.float8_e4m3fn: [0x00, 0x80, 0x7F, 0xFF, 0x7E, 0xFE, 0x01, 0x07, 0x81],
}

# Offsets past 2**31: one layer of 8193 blocks of [128 tokens x 8 heads x 128] fp8 K and V = 2**31 + 2**18 bytes.
# The last block's bytes (CPU_ATTN: the whole block; FLASH_NHD: its V half) lie beyond 2**31, so a kernel computing
# offsets in int32 would wrap. Make such a cache with torch.empty: the allocator maps pages lazily, so only the
# blocks a test writes are committed, and the test runs in well under a second and commits well under 1 MB.
BIG_BLOCK_SIZE, BIG_HEADS, BIG_HEAD_DIM = 128, 8, 128
BIG_NUM_BLOCKS = (1 << 13) + 1


def signed_bits(bits: int, nbytes: int) -> int:
    """``bits`` as the value of the integer view (signed for 2/4/8 bytes, uint8 for 1 byte)."""
    width = 8 * nbytes
    return bits - (1 << width) if nbytes > 1 and bits >= 1 << (width - 1) else bits


def random_kv(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns of ``dtype`` (through the integer view), with the special values sprinkled in."""
    t = torch.empty(shape, dtype=dtype)
    iv = int_view(t)
    nbytes = t.element_size()
    if nbytes == 1:
        iv.copy_(torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen))
    else:
        half = 1 << (8 * nbytes - 1)
        iv.copy_(torch.randint(-half, half, shape, dtype=torch.int64, generator=gen))
    flat = iv.view(-1)
    specials = torch.tensor([signed_bits(b, nbytes) for b in SPECIAL_BITS[dtype]], dtype=iv.dtype)
    pos = torch.randint(0, flat.numel(), (max(1, flat.numel() // 16),), generator=gen)
    flat[pos] = specials[torch.randint(0, len(specials), pos.shape, generator=gen)]
    n = min(len(specials), flat.numel())
    flat[:n] = specials[:n]  # each special value at least once
    return t


def poisoned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of all-ones bit patterns: NaN in bf16, fp16, fp32 and float8_e4m3fn."""
    t = torch.empty(shape, dtype=dtype)
    int_view(t).fill_(255 if t.element_size() == 1 else -1)
    return t


def paged_shape(layout: KVLayout, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple:
    """The shape of one layer's paged KV cache in ``layout``."""
    if layout == KVLayout.CPU_ATTN:
        return (num_blocks, num_kv_heads, block_size, 2 * head_dim)
    return (2, num_blocks, block_size, num_kv_heads, head_dim)


def random_caches(
    layout: KVLayout,
    dtype: torch.dtype,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    seed: int = 0,
    num_layers: int = NUM_LAYERS,
    num_blocks: int = NUM_BLOCKS,
) -> list[torch.Tensor]:
    """``num_layers`` paged caches of ``random_kv`` data, reproducible from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    shape = paged_shape(layout, num_blocks, block_size, num_kv_heads, head_dim)
    return [random_kv(shape, dtype, gen) for _ in range(num_layers)]


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype and the same bits (NaN payloads and the sign of zero included)."""
    return a.dtype == b.dtype and torch.equal(int_view(a), int_view(b))


def separate_blocks(blocks: torch.Tensor) -> list[torch.Tensor]:
    """Each canonical block of ``blocks`` ``[n, num_layers, *shard]`` copied into its own byte allocation (as the
    DRAM tier's slots hold them: 1-D uint8, viewed as the KV dtype), allocated last block first so that no two
    neighbours sit one row apart."""
    out = []
    for b in reversed(blocks):
        slot = torch.empty(b.numel() * b.element_size(), dtype=torch.uint8, device=b.device)
        out.append(slot.view(b.dtype).view(b.shape))
        out[-1].view(torch.uint8).copy_(b.contiguous().view(torch.uint8))
    return out[::-1]
