"""gather_blocks (paged KV -> canonical blocks): bit-exact against the naive reference, for every layout and dtype.

Data is written through integer views, so NaN payloads, -0.0, +-inf and subnormals travel through the copy; every
comparison is ``torch.equal`` on integer views (a float compare would call NaN != NaN and -0.0 == 0.0). Outputs
start as NaN bit patterns, so an element the kernel forgot to write fails the test.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from ucm.kernels import KVLayout, canonical_block_shape, gather_blocks, gather_blocks_reference
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


def _signed(bits: int, nbytes: int) -> int:
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
    specials = torch.tensor([_signed(b, nbytes) for b in SPECIAL_BITS[dtype]], dtype=iv.dtype)
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
    if layout == KVLayout.CPU_ATTN:
        return (num_blocks, num_kv_heads, block_size, 2 * head_dim)
    return (2, num_blocks, block_size, num_kv_heads, head_dim)


def make_caches(
    layout: KVLayout,
    dtype: torch.dtype,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    seed: int = 0,
    num_layers: int = NUM_LAYERS,
    num_blocks: int = NUM_BLOCKS,
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = paged_shape(layout, num_blocks, block_size, num_kv_heads, head_dim)
    return [random_kv(shape, dtype, gen) for _ in range(num_layers)]


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(int_view(a), int_view(b))


def block_kv_direct(cache: torch.Tensor, layout: KVLayout, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of ``block`` as ``[block_size, num_kv_heads, head_dim]`` integer views, read straight from the
    layout description in ``ucm.kernels.layouts`` (independent of both implementations)."""
    c = int_view(cache)
    if layout == KVLayout.CPU_ATTN:
        _, h, bs, two_d = c.shape
        d = two_d // 2
        per_head = c[block].reshape(h, 2 * bs * d)
        k = per_head[:, : bs * d].reshape(h, d, bs).permute(2, 0, 1)  # K^T [H, D, bs] -> [bs, H, D]
        v = per_head[:, bs * d :].reshape(h, bs, d).permute(1, 0, 2)  # V [H, bs, D] -> [bs, H, D]
        return k, v
    return c[0, block], c[1, block]


@pytest.fixture(autouse=True, scope="module")
def one_cpu_thread() -> Iterator[None]:
    """Run these small copies on one thread: on a loaded machine, torch's OpenMP workers spin-wait and a
    millisecond copy takes most of a second."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


layout_params = pytest.mark.parametrize("layout", LAYOUTS, ids=[lay.value for lay in LAYOUTS])
dtype_params = pytest.mark.parametrize("dtype", DTYPES, ids=[DTYPE_IDS[d] for d in DTYPES])


def test_random_kv_holds_the_special_values() -> None:
    gen = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        t = random_kv((4, 64), dtype, gen)
        present = set(int_view(t).reshape(-1).tolist())
        want = {_signed(b, t.element_size()) for b in SPECIAL_BITS[dtype]}
        assert want <= present, DTYPE_IDS[dtype]


@pytest.mark.parametrize("num_kv_heads", NUM_KV_HEADS, ids=lambda h: f"h{h}")
@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda d: f"d{d}")
@pytest.mark.parametrize("block_size", BLOCK_SIZES, ids=lambda b: f"bs{b}")
@dtype_params
@layout_params
def test_gather_matches_reference(
    layout: KVLayout, dtype: torch.dtype, block_size: int, head_dim: int, num_kv_heads: int
) -> None:
    caches = make_caches(layout, dtype, block_size, num_kv_heads, head_dim)
    ids = torch.tensor(BLOCK_IDS, dtype=torch.int64)
    want_shape = (len(BLOCK_IDS), *canonical_block_shape(NUM_LAYERS, block_size, num_kv_heads, head_dim))

    ref = gather_blocks_reference(caches, ids, layout)
    assert ref.shape == want_shape and ref.dtype == dtype

    out = poisoned(want_shape, dtype)
    got = gather_blocks(caches, ids, layout, out=out)
    assert got is out
    assert bits_equal(got, ref)
    assert bits_equal(gather_blocks(caches, ids, layout), ref)  # allocating form

    # The reference against the layout description itself.
    for i, b in enumerate(BLOCK_IDS):
        for layer, cache in enumerate(caches):
            k, v = block_kv_direct(cache, layout, b)
            assert torch.equal(int_view(ref[i, layer, 0]), k)
            assert torch.equal(int_view(ref[i, layer, 1]), v)


@layout_params
def test_gather_int32_and_strided_ids(layout: KVLayout) -> None:
    caches = make_caches(layout, torch.bfloat16, 16, 3, 80, seed=1)
    base = torch.tensor([6, 99, 1, 99, 4, 99, 2], dtype=torch.int32)
    ids = base[::2]  # non-contiguous view [6, 1, 4, 2]
    assert not ids.is_contiguous()
    ref = gather_blocks_reference(caches, torch.tensor([6, 1, 4, 2]), layout)
    out = poisoned(tuple(ref.shape), torch.bfloat16)
    assert bits_equal(gather_blocks(caches, ids, layout, out=out), ref)


@dtype_params
@layout_params
def test_gather_repeated_ids(layout: KVLayout, dtype: torch.dtype) -> None:
    caches = make_caches(layout, dtype, 16, 3, 64, seed=2)
    ids = torch.tensor([2, 5, 2, 2])
    got = gather_blocks(caches, ids, layout, out=poisoned((4, *canonical_block_shape(NUM_LAYERS, 16, 3, 64)), dtype))
    assert bits_equal(got[0], got[2]) and bits_equal(got[0], got[3])
    assert bits_equal(got, gather_blocks_reference(caches, ids, layout))


@layout_params
def test_gather_empty_ids(layout: KVLayout) -> None:
    caches = make_caches(layout, torch.float16, 16, 3, 64, seed=3)
    ids = torch.tensor([], dtype=torch.int64)
    want = (0, *canonical_block_shape(NUM_LAYERS, 16, 3, 64))
    assert gather_blocks(caches, ids, layout).shape == want
    out = torch.empty(want, dtype=torch.float16)
    assert gather_blocks(caches, ids, layout, out=out) is out
    assert gather_blocks_reference(caches, ids, layout).shape == want


def test_gather_single_block_single_layer() -> None:
    caches = make_caches(KVLayout.CPU_ATTN, torch.float32, 16, 1, 64, seed=4, num_layers=1, num_blocks=1)
    ids = torch.tensor([0])
    assert bits_equal(
        gather_blocks(caches, ids, KVLayout.CPU_ATTN), gather_blocks_reference(caches, ids, KVLayout.CPU_ATTN)
    )


# -- validation: errors name the bad value ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, NUM_BLOCKS, 2**40], ids=["negative", "num_blocks", "huge"])
@layout_params
def test_gather_out_of_range_id(layout: KVLayout, bad: int) -> None:
    caches = make_caches(layout, torch.bfloat16, 16, 1, 64)
    ids = torch.tensor([0, bad, 3])
    for fn in (gather_blocks, gather_blocks_reference):
        with pytest.raises(ValueError, match=rf"\[0, {NUM_BLOCKS}\)") as info:
            fn(caches, ids, layout)
        assert str(bad) in str(info.value)


@pytest.mark.parametrize(
    "ids",
    [torch.tensor([0.0, 1.0]), torch.tensor([0, 1], dtype=torch.int16), [0, 1]],
    ids=["float", "int16", "list"],
)
def test_gather_ids_must_be_int32_or_int64(ids: object) -> None:
    caches = make_caches(KVLayout.FLASH_NHD, torch.bfloat16, 16, 1, 64)
    with pytest.raises(TypeError, match="int32/int64"):
        gather_blocks(caches, ids, KVLayout.FLASH_NHD)  # type: ignore[arg-type]


def test_gather_ids_must_be_1d() -> None:
    caches = make_caches(KVLayout.FLASH_NHD, torch.bfloat16, 16, 1, 64)
    with pytest.raises(ValueError, match=r"1-D.*\(2, 2\)"):
        gather_blocks(caches, torch.tensor([[0, 1], [2, 3]]), KVLayout.FLASH_NHD)


@layout_params
def test_gather_wrong_out_shape(layout: KVLayout) -> None:
    caches = make_caches(layout, torch.bfloat16, 16, 3, 64)
    ids = torch.tensor([1, 2])
    bad = (3, *canonical_block_shape(NUM_LAYERS, 16, 3, 64))
    with pytest.raises(ValueError, match=r"out must be \(2, 2, 2, 16, 3, 64\)") as info:
        gather_blocks(caches, ids, layout, out=torch.empty(bad, dtype=torch.bfloat16))
    assert str(bad) in str(info.value)


def test_gather_wrong_out_dtype() -> None:
    caches = make_caches(KVLayout.FLASH_NHD, torch.bfloat16, 16, 3, 64)
    ids = torch.tensor([1, 2])
    shape = (2, *canonical_block_shape(NUM_LAYERS, 16, 3, 64))
    # Same element size, other dtype: a byte copy would "work" but reinterpret the values.
    with pytest.raises(ValueError, match=r"torch\.float16"):
        gather_blocks(caches, ids, KVLayout.FLASH_NHD, out=torch.empty(shape, dtype=torch.float16))


def test_gather_non_contiguous_out() -> None:
    caches = make_caches(KVLayout.FLASH_NHD, torch.bfloat16, 16, 3, 64)
    shape = (2, *canonical_block_shape(NUM_LAYERS, 16, 3, 64))
    out = torch.empty((*shape[:-1], 2 * shape[-1]), dtype=torch.bfloat16)[..., ::2]
    with pytest.raises(ValueError, match="contiguous"):
        gather_blocks(caches, torch.tensor([1, 2]), KVLayout.FLASH_NHD, out=out)


@layout_params
def test_gather_non_contiguous_cache(layout: KVLayout) -> None:
    caches = make_caches(layout, torch.bfloat16, 16, 3, 64, num_blocks=2 * NUM_BLOCKS)
    strided = [c[::2] if layout == KVLayout.CPU_ATTN else c[:, ::2] for c in caches]
    with pytest.raises(ValueError, match="contiguous") as info:
        gather_blocks(strided, torch.tensor([0]), layout)
    assert layout.value in str(info.value)


@pytest.mark.parametrize("what", ["shape", "dtype"])
@layout_params
def test_gather_mismatched_layers(layout: KVLayout, what: str) -> None:
    caches = make_caches(layout, torch.bfloat16, 16, 3, 64)
    if what == "shape":
        caches[1] = make_caches(layout, torch.bfloat16, 16, 3, 64, num_layers=1, num_blocks=NUM_BLOCKS + 1)[0]
    else:
        caches[1] = caches[1].to(torch.float16)
    with pytest.raises(ValueError, match="layer 1") as info:
        gather_blocks(caches, torch.tensor([0]), layout)
    assert ("torch.float16" if what == "dtype" else str(NUM_BLOCKS + 1)) in str(info.value)


def test_gather_no_layers() -> None:
    with pytest.raises(ValueError, match="empty"):
        gather_blocks([], torch.tensor([0]), KVLayout.FLASH_NHD)


@pytest.mark.parametrize(
    ("layout", "shape"),
    [
        (KVLayout.CPU_ATTN, (NUM_BLOCKS, 3, 16, 2, 64)),  # FLASH-like rank
        (KVLayout.CPU_ATTN, (NUM_BLOCKS, 3, 16, 127)),  # odd last dim: no K/V halves
        (KVLayout.FLASH_NHD, (NUM_BLOCKS, 3, 16, 128)),  # CPU_ATTN shape
        (KVLayout.FLASH_NHD, (3, NUM_BLOCKS, 16, 3, 64)),  # leading dim must be 2
    ],
    ids=["cpu-5d", "cpu-odd", "flash-4d", "flash-lead3"],
)
def test_gather_wrong_layout_shape(layout: KVLayout, shape: tuple[int, ...]) -> None:
    caches = [torch.zeros(shape, dtype=torch.bfloat16)]
    with pytest.raises(ValueError, match=layout.name) as info:
        gather_blocks(caches, torch.tensor([0]), layout)
    assert str(shape) in str(info.value)


# -- offsets past 2**31 ----------------------------------------------------------------------------------------------

# One layer of 8193 blocks of [128 tokens x 8 heads x 128] fp8 K and V = 2**31 + 2**18 bytes: the last block's bytes
# (CPU_ATTN: the whole block; FLASH_NHD: its V half) lie beyond 2**31, so a kernel computing offsets in int32 would
# wrap. torch.empty leaves the pages untouched (the allocator maps them lazily); only the blocks used are written,
# so this runs in well under a second and commits well under 1 MB.
BIG_BLOCK_SIZE, BIG_HEADS, BIG_HEAD_DIM = 128, 8, 128
BIG_NUM_BLOCKS = (1 << 13) + 1


@layout_params
def test_gather_offsets_past_2_31(layout: KVLayout) -> None:
    dtype = torch.float8_e4m3fn
    shape = paged_shape(layout, BIG_NUM_BLOCKS, BIG_BLOCK_SIZE, BIG_HEADS, BIG_HEAD_DIM)
    cache = torch.empty(shape, dtype=dtype)
    assert cache.numel() * cache.element_size() > 2**31
    gen = torch.Generator().manual_seed(5)
    last = BIG_NUM_BLOCKS - 1
    for b in (0, last):
        blk = cache[b] if layout == KVLayout.CPU_ATTN else cache[:, b]
        blk.copy_(random_kv(tuple(blk.shape), dtype, gen))
    k_last, v_last = block_kv_direct(cache, layout, last)
    start = (v_last if layout == KVLayout.FLASH_NHD else k_last).data_ptr() - cache.data_ptr()
    assert start >= 2**31

    ids = torch.tensor([last, 0, last], dtype=torch.int32)
    ref = gather_blocks_reference([cache], ids, layout)
    out = poisoned((3, *canonical_block_shape(1, BIG_BLOCK_SIZE, BIG_HEADS, BIG_HEAD_DIM)), dtype)
    got = gather_blocks([cache], ids, layout, out=out)
    assert bits_equal(got, ref)
    assert torch.equal(int_view(got[0, 0, 0]), k_last)
    assert torch.equal(int_view(got[0, 0, 1]), v_last)
    assert bits_equal(got[2], got[0])
