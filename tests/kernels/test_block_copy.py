"""The block-copy package (``ucm.kernels.block_copy``) through every implementation and op.

- Triton under the interpreter on CPU tensors (``TRITON_INTERPRET=1`` semantics; small shapes, it is slow) and
  natively on CUDA when present; the numba CPU path and the torch path; all bit-exact against the naive references
  on integer views, into NaN-poisoned outputs.
- Every layout including MLA, for the blockwise ops (``gather_blocks``/``scatter_blocks``) and the layerwise
  staging ops (``gather_layers``/``scatter_layers``).
- Each Triton kernel variant compiled for sm_90 on this CPU, so lowering errors show without a GPU.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from tests.kernels.kv_data import (
    BIG_BLOCK_SIZE,
    BIG_HEAD_DIM,
    BIG_HEADS,
    BIG_NUM_BLOCKS,
    DTYPE_IDS,
    DTYPES,
    bits_equal,
    poisoned,
    random_kv,
    separate_blocks,
)
from tests.kernels.sm90 import compile_for_sm90
from ucm.kernels import (
    KVLayout,
    gather_blocks,
    gather_blocks_reference,
    gather_layers,
    gather_layers_reference,
    scatter_blocks,
    scatter_blocks_reference,
    scatter_layers,
    scatter_layers_reference,
)
from ucm.kernels.block_copy import cpu as block_copy_cpu
from ucm.kernels.block_copy.triton import block_copy_kernel, kernel_meta
from ucm.kernels.layouts import int_view

ALL_LAYOUTS = [KVLayout.CPU_ATTN, KVLayout.FLASH_NHD, KVLayout.MLA]
# (block_size, num_kv_heads, head_dim) kept small for the interpreter; odd head dims and both block sizes.
SHAPES = [(16, 3, 80), (16, 1, 64), (128, 2, 128), (16, 1, 576)]
CPU_IMPLS = ["cpu", "torch", "triton", "reference"]  # "triton" on CPU tensors = the Triton interpreter
NUM_LAYERS, NUM_BLOCKS = 3, 9
IDS = [7, 0, 4, 8]

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device: native Triton runs only where a GPU exists")


def make_caches(layout: KVLayout, dtype: torch.dtype, shape: tuple[int, int, int], device: str = "cpu", seed: int = 0):
    block_size, heads, dim = shape
    heads = 1 if layout == KVLayout.MLA else heads
    gen = torch.Generator().manual_seed(seed)
    if layout == KVLayout.CPU_ATTN:
        one = (NUM_BLOCKS, heads, block_size, 2 * dim)
    elif layout == KVLayout.FLASH_NHD:
        one = (2, NUM_BLOCKS, block_size, heads, dim)
    else:
        one = (NUM_BLOCKS, block_size, dim)
    return [random_kv(one, dtype, gen).to(device) for _ in range(NUM_LAYERS)]


def poisoned_like(caches: list[torch.Tensor]) -> list[torch.Tensor]:
    return [poisoned(tuple(c.shape), c.dtype).to(c.device) for c in caches]


def shape_id(s: tuple[int, int, int]) -> str:
    return f"bs{s[0]}-h{s[1]}-d{s[2]}"


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=[DTYPE_IDS[d] for d in DTYPES])
@pytest.mark.parametrize("layout", ALL_LAYOUTS, ids=[lay.value for lay in ALL_LAYOUTS])
@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_every_impl_matches_reference(impl: str, layout: KVLayout, dtype: torch.dtype, shape: tuple) -> None:
    check_all_ops(make_caches(layout, dtype, shape), layout, impl)


def check_all_ops(caches: list[torch.Tensor], layout: KVLayout, impl: str) -> None:
    """gather/scatter, blocks/layers: each bit-exact against its reference, outputs NaN-poisoned."""
    dev = caches[0].device
    ids = torch.tensor(IDS, dtype=torch.int64, device=dev)
    ref_cpu = gather_blocks_reference([c.cpu() for c in caches], ids.cpu(), layout)

    blocks = poisoned(tuple(ref_cpu.shape), ref_cpu.dtype).to(dev)
    assert gather_blocks(caches, ids, layout, out=blocks, impl=impl) is blocks  # type: ignore[arg-type]
    assert bits_equal(blocks.cpu(), ref_cpu)

    layers = gather_layers(caches, ids.to(torch.int32), layout, impl=impl)  # type: ignore[arg-type]
    assert bits_equal(layers.cpu(), gather_layers_reference([c.cpu() for c in caches], ids.cpu(), layout))

    dst, want = poisoned_like(caches), [poisoned(tuple(c.shape), c.dtype) for c in caches]
    scatter_blocks(blocks, dst, ids, layout, impl=impl)  # type: ignore[arg-type]
    scatter_blocks_reference(ref_cpu, want, ids.cpu(), layout)
    assert all(bits_equal(a.cpu(), b) for a, b in zip(dst, want, strict=True))

    dst = poisoned_like(caches)
    scatter_layers(layers, dst, ids, layout, impl=impl)  # type: ignore[arg-type]
    assert all(bits_equal(a.cpu(), b) for a, b in zip(dst, want, strict=True))

    dst = poisoned_like(caches)
    scatter_blocks(separate_blocks(blocks), dst, ids, layout, impl=impl)  # type: ignore[arg-type]
    assert all(bits_equal(a.cpu(), b) for a, b in zip(dst, want, strict=True))

    one = poisoned_like(caches[:1])
    scatter_layers(layers[1:2], one, ids, layout, impl=impl)  # type: ignore[arg-type]
    scatter_layers_reference(layers[1:2].cpu(), want[:1], ids.cpu(), layout)
    assert bits_equal(one[0].cpu(), want[0])


@pytest.mark.parametrize(
    ("shape", "tile"),
    [((128, 2, 128), 32), ((128, 3, 64), 32), ((16, 3, 80), 16), ((32, 1, 48), 16), ((20, 2, 24), 0)],
    ids=lambda v: shape_id(v) if isinstance(v, tuple) else f"tile{v}",
)
@pytest.mark.parametrize("nontemporal", [True, False], ids=["nontemporal", "cached"])
def test_cpu_attn_tile_kernel(shape: tuple, tile: int, nontemporal: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU_ATTN tile kernel at tile 32 and 16, with non-temporal and with ordinary stores (the size threshold for
    non-temporal stores set to 0 or out of reach, so both run on small data), bit-exact through every op into
    poisoned outputs; shapes no tile divides (block_size 20) take the word kernels; a gather into a staging buffer one
    element off alignment takes ordinary stores."""
    monkeypatch.setattr(block_copy_cpu, "_NONTEMPORAL_MIN_BYTES", 0 if nontemporal else 1 << 62)
    plans: list[tuple[int, bool]] = []
    real_plan = block_copy_cpu.cpu_attn_plan
    monkeypatch.setattr(block_copy_cpu, "cpu_attn_plan", lambda *a: plans.append(real_plan(*a)) or plans[-1])
    caches = make_caches(KVLayout.CPU_ATTN, torch.bfloat16, shape)
    check_all_ops(caches, KVLayout.CPU_ATTN, "cpu")
    assert plans and set(plans) == {(tile, nontemporal and tile > 0 and block_copy_cpu._NONTEMPORAL)}, plans

    ids = torch.tensor(IDS)
    ref = gather_blocks_reference(caches, ids, KVLayout.CPU_ATTN)
    flat = poisoned((ref.numel() + 1,), ref.dtype)
    out = flat[1:].view(ref.shape)  # contiguous, 2 bytes past an aligned address
    plans.clear()
    assert bits_equal(gather_blocks(caches, ids, KVLayout.CPU_ATTN, out=out, impl="cpu"), ref)
    assert plans == [(tile, False)]
    assert bits_equal(flat[:1], poisoned((1,), ref.dtype))  # nothing written before the buffer


SPLIT_SHAPES = {  # one layer's paged shape: 10 blocks, block_size 128, 2 KV heads of head_dim 128 (MLA: 576)
    KVLayout.CPU_ATTN: (10, 2, 128, 2 * 128),
    KVLayout.FLASH_NHD: (2, 10, 128, 2, 128),
    KVLayout.MLA: (10, 128, 576),
}


@pytest.mark.parametrize("layout", ALL_LAYOUTS, ids=[lay.value for lay in ALL_LAYOUTS])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_cpu_path_split_over_threads(layout: KVLayout, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU path splits a copy of several MiB over ``torch.get_num_threads()`` threads (3 here: an uneven split
    of the work items); every op stays bit-exact into poisoned outputs."""
    pools: list[int] = []
    real_pool = block_copy_cpu._cpu_pool
    monkeypatch.setattr(block_copy_cpu, "_cpu_pool", lambda workers: pools.append(workers) or real_pool(workers))
    gen = torch.Generator().manual_seed(5)
    caches = [random_kv(SPLIT_SHAPES[layout], dtype, gen) for _ in range(7)]  # 7 layers
    ids = torch.tensor([8, 1, 3, 0, 5, 9, 2, 6])
    torch.set_num_threads(3)  # the module fixture restores the count
    ref = gather_blocks_reference(caches, ids, layout)
    blocks = gather_blocks(caches, ids, layout, out=poisoned(tuple(ref.shape), dtype), impl="cpu")
    assert bits_equal(blocks, ref)
    assert bits_equal(gather_layers(caches, ids, layout, impl="cpu"), gather_layers_reference(caches, ids, layout))
    want = [poisoned(tuple(c.shape), dtype) for c in caches]
    scatter_blocks_reference(ref, want, ids, layout)
    stagings = (
        (scatter_blocks, blocks),
        (scatter_layers, blocks.transpose(0, 1)),
        (scatter_blocks, separate_blocks(blocks)),
    )
    for fn, staging in stagings:
        dst = poisoned_like(caches)
        fn(staging, dst, ids, layout, impl="cpu")  # type: ignore[operator]
        assert all(bits_equal(a, b) for a, b in zip(dst, want, strict=True))
    assert pools == [2, 2, 2, 2, 2], pools  # every op: the calling thread and 2 pool threads


@pytest.mark.parametrize("layout", ALL_LAYOUTS, ids=[lay.value for lay in ALL_LAYOUTS])
@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_repeated_ids(impl: str, layout: KVLayout) -> None:
    caches = make_caches(layout, torch.float16, (16, 2, 64), seed=1)
    ids = torch.tensor([3, 5, 3, 3])
    got = gather_blocks(caches, ids, layout, impl=impl)  # type: ignore[arg-type]
    assert bits_equal(got, gather_blocks_reference(caches, ids, layout))
    assert bits_equal(got[0], got[2]) and bits_equal(got[0], got[3])
    before = [c.clone() for c in caches]
    for fn, staging in ((scatter_blocks, got), (scatter_layers, got.transpose(0, 1))):
        with pytest.raises(ValueError, match=r"distinct.*\[3, 5, 3, 3\]"):
            fn(staging, caches, ids, layout, impl=impl)  # type: ignore[operator]
    assert all(bits_equal(a, b) for a, b in zip(caches, before, strict=True))


def test_layer_tensors_in_any_address_order() -> None:
    """Layers allocated out of address order (the offset table is relative to the lowest address)."""
    caches = make_caches(KVLayout.FLASH_NHD, torch.bfloat16, (16, 2, 64), seed=2)[::-1]
    ids = torch.tensor(IDS)
    ref = gather_blocks_reference(caches, ids, KVLayout.FLASH_NHD)
    for impl in CPU_IMPLS:
        assert bits_equal(gather_blocks(caches, ids, KVLayout.FLASH_NHD, impl=impl), ref)  # type: ignore[arg-type]


def test_separate_blocks_are_checked_before_anything_is_written() -> None:
    """A list of blocks with a wrong count, shape, dtype or a non-contiguous block: a ValueError naming it, and the
    paged KV unchanged."""
    caches = make_caches(KVLayout.CPU_ATTN, torch.bfloat16, (16, 2, 64), seed=3)
    ids = torch.tensor(IDS)
    blocks = separate_blocks(gather_blocks(caches, ids, KVLayout.CPU_ATTN))
    before = [c.clone() for c in caches]
    bad = [
        (blocks[:3], r"3 blocks for 4 block ids"),
        ([*blocks[:3], blocks[3][:2]], r"blocks\[3\] must be a contiguous \(3, 2, 16, 2, 64\) torch.bfloat16 on cpu"),
        ([*blocks[:3], blocks[3].float()], r"blocks\[3\] must be .* got \(3, 2, 16, 2, 64\) torch.float32"),
        ([blocks[0].transpose(2, 3).contiguous().transpose(2, 3), *blocks[1:]], r"blocks\[0\] .*\(not contiguous\)"),
    ]
    for staging, match in bad:
        for impl in ("cpu", "torch"):
            with pytest.raises(ValueError, match=match):
                scatter_blocks(staging, caches, ids, KVLayout.CPU_ATTN, impl=impl)  # type: ignore[arg-type]
    assert all(bits_equal(a, b) for a, b in zip(caches, before, strict=True))


def test_bad_impl_and_mla_heads() -> None:
    caches = make_caches(KVLayout.MLA, torch.bfloat16, (16, 1, 64))
    with pytest.raises(
        ValueError, match=r"impl must be one of \['auto', 'triton', 'cpu', 'torch', 'reference'\], got 'fast'"
    ):
        gather_blocks(caches, torch.tensor([0]), KVLayout.MLA, impl="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"impl must be one of .*'numba'"):  # "cpu" names the CPU path
        shards = gather_layers(caches, torch.tensor([0]), KVLayout.MLA)
        scatter_layers(shards, caches, torch.tensor([0]), KVLayout.MLA, impl="numba")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="MLA KV must be"):
        gather_blocks([torch.zeros(2, 16, 1, 64)], torch.tensor([0]), KVLayout.MLA)
    from ucm.kernels import canonical_block_shape

    with pytest.raises(ValueError, match="num_kv_heads must be 1, got 8"):
        canonical_block_shape(2, 16, 8, 64, KVLayout.MLA)
    assert canonical_block_shape(2, 16, 1, 576, KVLayout.MLA) == (2, 16, 576)
    assert canonical_block_shape(2, 16, 8, 64) == (2, 2, 16, 8, 64)


@pytest.mark.parametrize("layout", [KVLayout.CPU_ATTN, KVLayout.FLASH_NHD], ids=["cpu_attn", "flash_nhd"])
@pytest.mark.parametrize("impl", ["cpu", "torch"])
def test_cpu_paths_offsets_past_2_31(impl: str, layout: KVLayout) -> None:
    """One lazily allocated layer whose last block lies past 2**31 bytes (see kv_data.py); bf16 so the numba path
    takes its word kernels. The interpreter copies whole argument storages, which would commit the 2 GiB."""
    dtype = torch.bfloat16
    num_blocks = BIG_NUM_BLOCKS // 2 + 1  # 2 bytes per element: past 2**31 with half the blocks
    if layout == KVLayout.CPU_ATTN:
        cache = torch.empty((num_blocks, BIG_HEADS, BIG_BLOCK_SIZE, 2 * BIG_HEAD_DIM), dtype=dtype)
    else:
        cache = torch.empty((2, num_blocks, BIG_BLOCK_SIZE, BIG_HEADS, BIG_HEAD_DIM), dtype=dtype)
    last = num_blocks - 1
    ids = torch.tensor([last])
    shard = (1, 1, 2, BIG_BLOCK_SIZE, BIG_HEADS, BIG_HEAD_DIM)
    one = random_kv(shard, dtype, torch.Generator().manual_seed(3))
    scatter_blocks(one, [cache], ids, layout, impl=impl)  # type: ignore[arg-type]
    assert bits_equal(gather_blocks_reference([cache], ids, layout), one)
    out = poisoned(shard, dtype)
    assert bits_equal(gather_blocks([cache], ids, layout, out=out, impl=impl), one)  # type: ignore[arg-type]
    tail = cache[1, last] if layout == KVLayout.FLASH_NHD else cache[last]
    assert tail.data_ptr() - cache.data_ptr() >= 2**31
    assert torch.equal(int_view(tail).reshape(-1)[-8:], int_view(one).reshape(-1)[-8:]) or (layout == KVLayout.CPU_ATTN)


# -- native CUDA -----------------------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("shape", [*SHAPES, (128, 8, 128)], ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=[DTYPE_IDS[d] for d in DTYPES])
@pytest.mark.parametrize("layout", ALL_LAYOUTS, ids=[lay.value for lay in ALL_LAYOUTS])
def test_cuda_triton_matches_reference(layout: KVLayout, dtype: torch.dtype, shape: tuple) -> None:
    check_all_ops(make_caches(layout, dtype, shape, device="cuda"), layout, "triton")


@needs_cuda
@pytest.mark.parametrize("layout", [KVLayout.FLASH_NHD, KVLayout.CPU_ATTN], ids=["flash_nhd", "cpu_attn"])
def test_cuda_offsets_past_2_31(layout: KVLayout) -> None:
    dtype = torch.float8_e4m3fn
    if layout == KVLayout.CPU_ATTN:
        cache = torch.zeros((BIG_NUM_BLOCKS, BIG_HEADS, BIG_BLOCK_SIZE, 2 * BIG_HEAD_DIM), dtype=dtype, device="cuda")
    else:
        cache = torch.zeros((2, BIG_NUM_BLOCKS, BIG_BLOCK_SIZE, BIG_HEADS, BIG_HEAD_DIM), dtype=dtype, device="cuda")
    ids = torch.tensor([BIG_NUM_BLOCKS - 1], device="cuda")
    one = random_kv((1, 1, 2, BIG_BLOCK_SIZE, BIG_HEADS, BIG_HEAD_DIM), dtype, torch.Generator().manual_seed(4))
    scatter_blocks(one.cuda(), [cache], ids, layout)
    assert bits_equal(gather_blocks_reference([cache.cpu()], ids.cpu(), layout), one)
    assert bits_equal(gather_blocks([cache], ids, layout).cpu(), one)


# -- lowering for sm_90 without a GPU ---------------------------------------------------------------------------------

KERNEL_CASES = [
    *((lay, dtype, gather) for lay in ALL_LAYOUTS for dtype in ("i16", "u8", "i32") for gather in (True, False)),
    *((KVLayout.CPU_ATTN_AMX, "i16", gather) for gather in (True, False)),  # bf16 only
]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 replaces @triton.jit")
@pytest.mark.parametrize(
    ("layout", "word", "gather"),
    KERNEL_CASES,
    ids=[f"{lay.value}-{w}-{'gather' if g else 'scatter'}" for lay, w, g in KERNEL_CASES],
)
def test_kernel_compiles_for_sm90(layout: KVLayout, word: str, gather: bool) -> None:
    """``triton.compile`` down to PTX and cubin (ptxas ships with triton) for an H100/H200 target; the FLASH_NHD
    and MLA chunk copies must come out as 16-byte vector loads (the LAYER_ALIGN hint at work)."""
    block_size, heads, dim = (128, 1, 576) if layout == KVLayout.MLA else (128, 8, 128)
    const = {
        "NUM_LAYERS": 4,
        "NUM_PARTS": 1 if layout == KVLayout.MLA else 2,
        "BLOCK_SIZE": block_size,
        "NUM_HEADS": heads,
        "HEAD_DIM": dim,
        "GATHER": gather,
        "LAYER_ALIGN": 16,
        **kernel_meta(layout, block_size, heads, dim),
    }
    sig = {
        "base_ptr": f"*{word}",
        "layer_offs_ptr": "*i64",
        "ids_ptr": "*i64",
        "staging_ptr": f"*{word}",
        "stride_block": "i64",
        "stride_layer": "i64",
        "stride_part": "i64",
        **dict.fromkeys(const, "constexpr"),
    }
    # What a launch with 16-byte aligned tensors and strides divisible by 16 specializes to.
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(7)}
    asm = compile_for_sm90(block_copy_kernel, sig, const, attrs=aligned)
    if layout not in (KVLayout.CPU_ATTN, KVLayout.CPU_ATTN_AMX):
        assert "ld.global.v4" in asm["ptx"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_cpu_path_split_works_in_a_forked_child() -> None:
    """A process that used the copy threads and then forks (vLLM forks its engine core) copies in the child too:
    the child makes its own threads instead of queueing work for the parent's, which it does not have."""
    gen = torch.Generator().manual_seed(7)
    caches = [random_kv(SPLIT_SHAPES[KVLayout.FLASH_NHD], torch.bfloat16, gen) for _ in range(7)]  # 8.75 MiB
    ids = torch.tensor([0, 2, 4, 6, 8, 9, 7, 5, 3, 1])
    torch.set_num_threads(2)  # the module fixture restores the count
    want = gather_blocks_reference(caches, ids, KVLayout.FLASH_NHD)
    assert bits_equal(gather_blocks(caches, ids, KVLayout.FLASH_NHD, impl="cpu"), want)  # the parent's pool exists
    want_bytes = int_view(want).numpy().tobytes()
    pid = os.fork()
    if pid == 0:  # child: exit 0 only if the split copy completes and is right
        code = 1
        try:  # compared with numpy: torch's own parallel ops (torch.equal) can hang in a forked child
            got = gather_blocks(caches, ids, KVLayout.FLASH_NHD, impl="cpu")
            code = 0 if int_view(got).numpy().tobytes() == want_bytes else 3
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the copy in the forked child hung (it queued work for the parent's threads)")
