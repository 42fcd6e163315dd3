"""gather_blocks (paged KV -> canonical blocks): bit-exact against the naive reference, for every layout and dtype.

Data is written through integer views, so NaN payloads, -0.0, +-inf and subnormals travel through the copy; every
comparison is ``torch.equal`` on integer views (a float compare would call NaN != NaN and -0.0 == 0.0). Outputs
start as NaN bit patterns, so an element the kernel forgot to write fails the test.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.kv_data import (
    BIG_BLOCK_SIZE,
    BIG_HEAD_DIM,
    BIG_HEADS,
    BIG_NUM_BLOCKS,
    BLOCK_IDS,
    DTYPE_IDS,
    DTYPES,
    NUM_BLOCKS,
    NUM_LAYERS,
    SPECIAL_BITS,
    bits_equal,
    dtype_params,
    every_kv_shape,
    layout_params,
    paged_shape,
    poisoned,
    random_caches,
    random_kv,
    signed_bits,
)
from ucm.kernels import KVLayout, canonical_block_shape, gather_blocks, gather_blocks_reference, warm_up
from ucm.kernels.layouts import int_view


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


def test_random_kv_holds_the_special_values() -> None:
    gen = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        t = random_kv((4, 64), dtype, gen)
        present = set(int_view(t).reshape(-1).tolist())
        want = {signed_bits(b, t.element_size()) for b in SPECIAL_BITS[dtype]}
        assert want <= present, DTYPE_IDS[dtype]


@every_kv_shape
def test_gather_matches_reference(
    layout: KVLayout, dtype: torch.dtype, block_size: int, head_dim: int, num_kv_heads: int
) -> None:
    caches = random_caches(layout, dtype, block_size, num_kv_heads, head_dim)
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
    caches = random_caches(layout, torch.bfloat16, 16, 3, 80, seed=1)
    base = torch.tensor([6, 99, 1, 99, 4, 99, 2], dtype=torch.int32)
    ids = base[::2]  # non-contiguous view [6, 1, 4, 2]
    assert not ids.is_contiguous()
    ref = gather_blocks_reference(caches, torch.tensor([6, 1, 4, 2]), layout)
    out = poisoned(tuple(ref.shape), torch.bfloat16)
    assert bits_equal(gather_blocks(caches, ids, layout, out=out), ref)


@pytest.mark.parametrize("impl", ["cpu", "torch"])
@layout_params
def test_gather_one_layer_into_a_strided_staging_slice(layout: KVLayout, impl: str) -> None:
    """The layerwise dump's use: each layer gathered into ``staging[:, l : l + 1]`` of a block-major buffer (leading
    dims strided, shard dims contiguous) gives the all-layers gather, and writes nothing outside its slice."""
    caches = random_caches(layout, torch.bfloat16, 16, 3, 64, seed=5)
    ids = torch.tensor([5, 0, 3])
    staging = poisoned((3, *canonical_block_shape(NUM_LAYERS, 16, 3, 64)), torch.bfloat16)
    for layer in range(NUM_LAYERS):
        gather_blocks([caches[layer]], ids, layout, out=staging[:, layer : layer + 1], impl=impl)  # type: ignore[arg-type]
        untouched = staging[:, layer + 1 :]
        assert bool((int_view(untouched) == -1).all())
    assert bits_equal(staging, gather_blocks_reference(caches, ids, layout))


@dtype_params
@layout_params
def test_gather_repeated_ids(layout: KVLayout, dtype: torch.dtype) -> None:
    caches = random_caches(layout, dtype, 16, 3, 64, seed=2)
    ids = torch.tensor([2, 5, 2, 2])
    got = gather_blocks(caches, ids, layout, out=poisoned((4, *canonical_block_shape(NUM_LAYERS, 16, 3, 64)), dtype))
    assert bits_equal(got[0], got[2]) and bits_equal(got[0], got[3])
    assert bits_equal(got, gather_blocks_reference(caches, ids, layout))


@layout_params
def test_gather_empty_ids(layout: KVLayout) -> None:
    caches = random_caches(layout, torch.float16, 16, 3, 64, seed=3)
    ids = torch.tensor([], dtype=torch.int64)
    want = (0, *canonical_block_shape(NUM_LAYERS, 16, 3, 64))
    assert gather_blocks(caches, ids, layout).shape == want
    out = torch.empty(want, dtype=torch.float16)
    assert gather_blocks(caches, ids, layout, out=out) is out
    assert gather_blocks_reference(caches, ids, layout).shape == want


def test_gather_single_block_single_layer() -> None:
    caches = random_caches(KVLayout.CPU_ATTN, torch.float32, 16, 1, 64, seed=4, num_layers=1, num_blocks=1)
    ids = torch.tensor([0])
    assert bits_equal(
        gather_blocks(caches, ids, KVLayout.CPU_ATTN), gather_blocks_reference(caches, ids, KVLayout.CPU_ATTN)
    )


@layout_params
def test_warm_up_leaves_the_caches_alone_and_checks_them(layout: KVLayout) -> None:
    caches = random_caches(layout, torch.bfloat16, 16, 2, 64, seed=6)
    before = [c.clone() for c in caches]
    warm_up(caches, layout)
    assert all(bits_equal(a, b) for a, b in zip(caches, before, strict=True))
    warm_up([], layout)  # nothing registered: nothing to do
    with pytest.raises(ValueError, match="impl must be one of"):
        warm_up(caches, layout, impl="fast")  # type: ignore[arg-type]


# -- validation: errors name the bad value ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, NUM_BLOCKS, 2**40], ids=["negative", "num_blocks", "huge"])
@layout_params
def test_gather_out_of_range_id(layout: KVLayout, bad: int) -> None:
    caches = random_caches(layout, torch.bfloat16, 16, 1, 64)
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
    caches = random_caches(KVLayout.FLASH_NHD, torch.bfloat16, 16, 1, 64)
    with pytest.raises(TypeError, match="int32/int64"):
        gather_blocks(caches, ids, KVLayout.FLASH_NHD)  # type: ignore[arg-type]


def test_gather_ids_must_be_1d() -> None:
    caches = random_caches(KVLayout.FLASH_NHD, torch.bfloat16, 16, 1, 64)
    with pytest.raises(ValueError, match=r"1-D.*\(2, 2\)"):
        gather_blocks(caches, torch.tensor([[0, 1], [2, 3]]), KVLayout.FLASH_NHD)


@layout_params
def test_gather_wrong_out_shape(layout: KVLayout) -> None:
    caches = random_caches(layout, torch.bfloat16, 16, 3, 64)
    ids = torch.tensor([1, 2])
    bad = (3, *canonical_block_shape(NUM_LAYERS, 16, 3, 64))
    with pytest.raises(ValueError, match=r"out must be \(2, 2, 2, 16, 3, 64\)") as info:
        gather_blocks(caches, ids, layout, out=torch.empty(bad, dtype=torch.bfloat16))
    assert str(bad) in str(info.value)


def test_gather_wrong_out_dtype() -> None:
    caches = random_caches(KVLayout.FLASH_NHD, torch.bfloat16, 16, 3, 64)
    ids = torch.tensor([1, 2])
    shape = (2, *canonical_block_shape(NUM_LAYERS, 16, 3, 64))
    # Same element size, other dtype: a byte copy would "work" but reinterpret the values.
    with pytest.raises(ValueError, match=r"torch\.float16"):
        gather_blocks(caches, ids, KVLayout.FLASH_NHD, out=torch.empty(shape, dtype=torch.float16))


def test_gather_non_contiguous_out() -> None:
    caches = random_caches(KVLayout.FLASH_NHD, torch.bfloat16, 16, 3, 64)
    shape = (2, *canonical_block_shape(NUM_LAYERS, 16, 3, 64))
    out = torch.empty((*shape[:-1], 2 * shape[-1]), dtype=torch.bfloat16)[..., ::2]
    with pytest.raises(ValueError, match="contiguous"):
        gather_blocks(caches, torch.tensor([1, 2]), KVLayout.FLASH_NHD, out=out)


@layout_params
def test_gather_non_contiguous_cache(layout: KVLayout) -> None:
    caches = random_caches(layout, torch.bfloat16, 16, 3, 64, num_blocks=2 * NUM_BLOCKS)
    strided = [c[::2] if layout == KVLayout.CPU_ATTN else c[:, ::2] for c in caches]
    with pytest.raises(ValueError, match="contiguous") as info:
        gather_blocks(strided, torch.tensor([0]), layout)
    assert layout.value in str(info.value)


@pytest.mark.parametrize("what", ["shape", "dtype"])
@layout_params
def test_gather_mismatched_layers(layout: KVLayout, what: str) -> None:
    caches = random_caches(layout, torch.bfloat16, 16, 3, 64)
    if what == "shape":
        caches[1] = random_caches(layout, torch.bfloat16, 16, 3, 64, num_layers=1, num_blocks=NUM_BLOCKS + 1)[0]
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

# A cache of BIG_NUM_BLOCKS blocks (see kv_data.py) whose last block lies past 2**31 bytes, allocated lazily.


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
