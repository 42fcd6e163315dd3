"""scatter_blocks (canonical blocks -> paged KV): bit-exact against the naive reference, round trips with gather.

Same conventions as the gather tests (see ``kv_data.py``): data written through integer views (NaN payloads, -0.0,
+-inf, subnormals), every comparison ``torch.equal`` on integer views, and destination caches that start as NaN bit
patterns so that an element the kernel forgot to write, or wrote to the wrong block, fails the test.
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
    NUM_BLOCKS,
    NUM_KV_HEADS,
    NUM_LAYERS,
    bits_equal,
    dtype_params,
    every_kv_shape,
    layout_params,
    paged_shape,
    poisoned,
    random_caches,
    random_kv,
)
from ucm.kernels import (
    KVLayout,
    canonical_block_shape,
    gather_blocks,
    gather_blocks_reference,
    scatter_blocks,
    scatter_blocks_reference,
)
from ucm.kernels.layouts import int_view


def poisoned_caches(
    layout: KVLayout,
    dtype: torch.dtype,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    num_layers: int = NUM_LAYERS,
    num_blocks: int = NUM_BLOCKS,
) -> list[torch.Tensor]:
    shape = paged_shape(layout, num_blocks, block_size, num_kv_heads, head_dim)
    return [poisoned(shape, dtype) for _ in range(num_layers)]


def random_blocks(
    n: int, dtype: torch.dtype, block_size: int, num_kv_heads: int, head_dim: int, seed: int, num_layers: int = 2
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return random_kv((n, *canonical_block_shape(num_layers, block_size, num_kv_heads, head_dim)), dtype, gen)


def caches_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(bits_equal(x, y) for x, y in zip(a, b, strict=True))


def block_of(cache: torch.Tensor, layout: KVLayout, block: int) -> torch.Tensor:
    """The paged storage of ``block`` (all its bytes, in the paged layout), as an integer view."""
    c = int_view(cache)
    return c[block] if layout == KVLayout.CPU_ATTN else c[:, block]


def clone_caches(caches: list[torch.Tensor]) -> list[torch.Tensor]:
    return [c.clone() for c in caches]


@every_kv_shape
def test_scatter_matches_reference(
    layout: KVLayout, dtype: torch.dtype, block_size: int, head_dim: int, num_kv_heads: int
) -> None:
    blocks = random_blocks(len(BLOCK_IDS), dtype, block_size, num_kv_heads, head_dim, seed=0)
    blocks_before = blocks.clone()
    ids = torch.tensor(BLOCK_IDS, dtype=torch.int64)

    fast = poisoned_caches(layout, dtype, block_size, num_kv_heads, head_dim)
    ref = poisoned_caches(layout, dtype, block_size, num_kv_heads, head_dim)
    scatter_blocks(blocks, fast, ids, layout)
    scatter_blocks_reference(blocks, ref, ids, layout)
    assert caches_equal(fast, ref)
    assert bits_equal(blocks, blocks_before)  # the source is read-only

    # Every element of the written blocks came from `blocks` (reading back through the reference gather) ...
    assert bits_equal(gather_blocks_reference(fast, ids, layout), blocks)
    # ... and the other blocks still hold the poison.
    untouched = poisoned_caches(layout, dtype, block_size, num_kv_heads, head_dim, num_layers=1)[0]
    for cache in fast:
        for b in sorted(set(range(NUM_BLOCKS)) - set(BLOCK_IDS)):
            assert torch.equal(block_of(cache, layout, b), block_of(untouched, layout, b))


@pytest.mark.parametrize("num_kv_heads", NUM_KV_HEADS, ids=lambda h: f"h{h}")
@pytest.mark.parametrize("head_dim", [80, 576], ids=lambda d: f"d{d}")
@dtype_params
@layout_params
def test_round_trip_restores_chosen_blocks_only(
    layout: KVLayout, dtype: torch.dtype, head_dim: int, num_kv_heads: int
) -> None:
    block_size = 32
    src = random_caches(layout, dtype, block_size, num_kv_heads, head_dim, seed=1)
    src_before = clone_caches(src)
    dst = random_caches(layout, dtype, block_size, num_kv_heads, head_dim, seed=2)
    dst_before = clone_caches(dst)
    src_ids = torch.tensor([6, 1, 4], dtype=torch.int32)
    dst_ids = torch.tensor([0, 5, 2], dtype=torch.int64)  # a different, unsorted placement

    blocks = gather_blocks(src, src_ids, layout)
    scatter_blocks(blocks, dst, dst_ids, layout)

    assert caches_equal(src, src_before)  # gather reads only
    for s, d in zip(src_ids.tolist(), dst_ids.tolist(), strict=True):
        for layer in range(NUM_LAYERS):
            assert torch.equal(block_of(dst[layer], layout, d), block_of(src[layer], layout, s))
    for b in sorted(set(range(NUM_BLOCKS)) - set(dst_ids.tolist())):
        for layer in range(NUM_LAYERS):
            assert torch.equal(block_of(dst[layer], layout, b), block_of(dst_before[layer], layout, b))


@layout_params
def test_round_trip_in_place(layout: KVLayout) -> None:
    # Gather blocks, wipe them with poison, scatter back: the cache equals its clone again.
    caches = random_caches(layout, torch.bfloat16, 16, 3, 128, seed=3)
    before = clone_caches(caches)
    ids = torch.tensor([3, 0, 6])
    blocks = gather_blocks(caches, ids, layout)
    for cache in caches:
        for b in ids.tolist():
            block_of(cache, layout, b).fill_(-1)
    assert not caches_equal(caches, before)
    scatter_blocks(blocks, caches, ids, layout)
    assert caches_equal(caches, before)


@layout_params
def test_scatter_int32_and_strided_ids(layout: KVLayout) -> None:
    blocks = random_blocks(3, torch.float16, 16, 3, 80, seed=4)
    ids = torch.tensor([6, 99, 1, 99, 4], dtype=torch.int32)[::2]  # non-contiguous view [6, 1, 4]
    assert not ids.is_contiguous()
    fast = poisoned_caches(layout, torch.float16, 16, 3, 80)
    ref = poisoned_caches(layout, torch.float16, 16, 3, 80)
    scatter_blocks(blocks, fast, ids, layout)
    scatter_blocks_reference(blocks, ref, torch.tensor([6, 1, 4]), layout)
    assert caches_equal(fast, ref)


@layout_params
def test_scatter_non_contiguous_blocks(layout: KVLayout) -> None:
    # A strided source (every other block of a larger batch) is read correctly.
    batch = random_blocks(6, torch.bfloat16, 16, 3, 64, seed=5)
    blocks = batch[::2]
    assert not blocks.is_contiguous()
    ids = torch.tensor([2, 0, 4])
    fast = poisoned_caches(layout, torch.bfloat16, 16, 3, 64)
    ref = poisoned_caches(layout, torch.bfloat16, 16, 3, 64)
    scatter_blocks(blocks, fast, ids, layout)
    scatter_blocks_reference(blocks.contiguous(), ref, ids, layout)
    assert caches_equal(fast, ref)


@layout_params
def test_scatter_empty_ids_changes_nothing(layout: KVLayout) -> None:
    caches = random_caches(layout, torch.float32, 16, 3, 64, seed=6)
    before = clone_caches(caches)
    blocks = torch.empty((0, *canonical_block_shape(NUM_LAYERS, 16, 3, 64)), dtype=torch.float32)
    ids = torch.tensor([], dtype=torch.int64)
    scatter_blocks(blocks, caches, ids, layout)
    scatter_blocks_reference(blocks, caches, ids, layout)
    assert caches_equal(caches, before)


# -- validation: errors name the bad value ---------------------------------------------------------------------------


@layout_params
def test_scatter_repeated_ids(layout: KVLayout) -> None:
    caches = random_caches(layout, torch.bfloat16, 16, 3, 64, seed=7)
    before = clone_caches(caches)
    blocks = random_blocks(3, torch.bfloat16, 16, 3, 64, seed=8)
    for fn in (scatter_blocks, scatter_blocks_reference):
        with pytest.raises(ValueError, match="distinct") as info:
            fn(blocks, caches, torch.tensor([4, 1, 4]), layout)
        assert "[4, 1, 4]" in str(info.value)
    assert caches_equal(caches, before)  # refused before writing anything


@pytest.mark.parametrize("bad", [-1, NUM_BLOCKS, 2**40], ids=["negative", "num_blocks", "huge"])
@layout_params
def test_scatter_out_of_range_id(layout: KVLayout, bad: int) -> None:
    caches = random_caches(layout, torch.bfloat16, 16, 1, 64, seed=9)
    before = clone_caches(caches)
    blocks = random_blocks(2, torch.bfloat16, 16, 1, 64, seed=10)
    for fn in (scatter_blocks, scatter_blocks_reference):
        with pytest.raises(ValueError, match=rf"\[0, {NUM_BLOCKS}\)") as info:
            fn(blocks, caches, torch.tensor([0, bad]), layout)
        assert str(bad) in str(info.value)
    assert caches_equal(caches, before)


def test_scatter_ids_must_be_int32_or_int64() -> None:
    caches = random_caches(KVLayout.FLASH_NHD, torch.bfloat16, 16, 1, 64, seed=11)
    blocks = random_blocks(2, torch.bfloat16, 16, 1, 64, seed=12)
    with pytest.raises(TypeError, match="int32/int64"):
        scatter_blocks(blocks, caches, torch.tensor([0.0, 1.0]), KVLayout.FLASH_NHD)


@pytest.mark.parametrize(
    ("n", "dtype", "head_dim"),
    [(3, torch.bfloat16, 64), (2, torch.float16, 64), (2, torch.bfloat16, 80)],
    ids=["count", "dtype", "head-dim"],
)
@layout_params
def test_scatter_wrong_blocks(layout: KVLayout, n: int, dtype: torch.dtype, head_dim: int) -> None:
    caches = random_caches(layout, torch.bfloat16, 16, 3, 64, seed=13)
    before = clone_caches(caches)
    blocks = random_blocks(n, dtype, 16, 3, head_dim, seed=14)
    with pytest.raises(ValueError, match=r"blocks must be \(2, 2, 2, 16, 3, 64\) torch.bfloat16") as info:
        scatter_blocks(blocks, caches, torch.tensor([1, 2]), layout)
    assert str(tuple(blocks.shape)) in str(info.value)
    assert str(dtype) in str(info.value)
    assert caches_equal(caches, before)


def test_scatter_blocks_with_wrong_layer_count() -> None:
    caches = random_caches(KVLayout.FLASH_NHD, torch.bfloat16, 16, 3, 64, seed=15)
    blocks = random_blocks(2, torch.bfloat16, 16, 3, 64, seed=16, num_layers=3)
    with pytest.raises(ValueError, match="blocks must be"):
        scatter_blocks(blocks, caches, torch.tensor([1, 2]), KVLayout.FLASH_NHD)


@layout_params
def test_scatter_non_contiguous_cache(layout: KVLayout) -> None:
    caches = random_caches(layout, torch.bfloat16, 16, 3, 64, seed=17, num_blocks=2 * NUM_BLOCKS)
    strided = [c[::2] if layout == KVLayout.CPU_ATTN else c[:, ::2] for c in caches]
    blocks = random_blocks(1, torch.bfloat16, 16, 3, 64, seed=18)
    with pytest.raises(ValueError, match="contiguous") as info:
        scatter_blocks(blocks, strided, torch.tensor([0]), layout)
    assert layout.value in str(info.value)


@pytest.mark.parametrize("what", ["shape", "dtype"])
@layout_params
def test_scatter_mismatched_layers(layout: KVLayout, what: str) -> None:
    caches = random_caches(layout, torch.bfloat16, 16, 3, 64, seed=19)
    if what == "shape":
        caches[1] = random_caches(layout, torch.bfloat16, 16, 3, 64, seed=20, num_layers=1, num_blocks=9)[0]
    else:
        caches[1] = caches[1].to(torch.float16)
    blocks = random_blocks(1, torch.bfloat16, 16, 3, 64, seed=21)
    with pytest.raises(ValueError, match="layer 1") as info:
        scatter_blocks(blocks, caches, torch.tensor([0]), layout)
    assert ("torch.float16" if what == "dtype" else "9") in str(info.value)


# -- offsets past 2**31 ----------------------------------------------------------------------------------------------

# A cache of BIG_NUM_BLOCKS blocks (see kv_data.py) whose last block lies past 2**31 bytes, allocated lazily.


@layout_params
def test_scatter_offsets_past_2_31(layout: KVLayout) -> None:
    dtype = torch.float8_e4m3fn
    cache = torch.empty(paged_shape(layout, BIG_NUM_BLOCKS, BIG_BLOCK_SIZE, BIG_HEADS, BIG_HEAD_DIM), dtype=dtype)
    assert cache.numel() * cache.element_size() > 2**31
    last = BIG_NUM_BLOCKS - 1
    neighbour = block_of(cache, layout, last - 1)
    neighbour.fill_(0x5A)
    ids = torch.tensor([last], dtype=torch.int32)
    tail = block_of(cache, layout, last)[-1] if layout == KVLayout.FLASH_NHD else block_of(cache, layout, last)
    assert tail.data_ptr() - cache.data_ptr() >= 2**31

    one = random_blocks(1, dtype, BIG_BLOCK_SIZE, BIG_HEADS, BIG_HEAD_DIM, seed=22, num_layers=1)
    scatter_blocks(one, [cache], ids, layout)
    assert bits_equal(gather_blocks_reference([cache], ids, layout), one)

    two = random_blocks(1, dtype, BIG_BLOCK_SIZE, BIG_HEADS, BIG_HEAD_DIM, seed=23, num_layers=1)
    scatter_blocks_reference(two, [cache], ids, layout)
    assert bits_equal(gather_blocks([cache], ids, layout), two)

    if layout == KVLayout.FLASH_NHD:
        assert torch.equal(int_view(cache[1, last]), int_view(two[0, 0, 1]))  # the V half, past 2**31
    assert bool((block_of(cache, layout, last - 1) == 0x5A).all())  # the neighbour block is untouched
