"""The CPU_ATTN_AMX layout (vLLM's ``amx`` CPU attention variant) through every block-copy op and implementation.

Runs on every machine: the oracle is what vLLM itself wrote, captured on an AMX Xeon (``fixtures/cpu_attn_amx``):

- gather after vLLM's write gives back each token's K and V at its slot (every impl and the reference);
- scatter of canonical blocks holding those tokens reproduces vLLM's bytes exactly (the whole layer tensor);

then, on random bit patterns (NaN payloads, -0, inf), every implementation against the reference into poisoned
outputs: blockwise and layerwise, the CPU path's non-temporal and cached stores, its split over threads, a strided
staging slice, repeated ids, offsets past 2**31, and the errors for shapes and dtypes the layout cannot hold.
``tests/integration/test_cpu_attn_layouts.py`` checks the same against the live vLLM op where it runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.kernels.kv_data import bits_equal, poisoned, random_kv, separate_blocks
from ucm.kernels import (
    KVLayout,
    gather_blocks,
    gather_blocks_reference,
    gather_layers,
    gather_layers_reference,
    scatter_blocks,
    scatter_blocks_reference,
    scatter_layers,
)
from ucm.kernels.block_copy import cpu as block_copy_cpu
from ucm.kernels.layouts import amx_offsets, cpu_attn_kv_views, int_view

AMX = KVLayout.CPU_ATTN_AMX
FIXTURES = Path(__file__).parent / "fixtures" / "cpu_attn_amx"
CASES = json.loads((FIXTURES / "index.json").read_text())
IMPLS = ["cpu", "torch", "triton", "reference"]  # "triton" on CPU tensors = the Triton interpreter
# (block_size, num_kv_heads, head_dim): vLLM's amx needs both multiples of 32; 512 is MLA-like wide heads.
SHAPES = [(32, 1, 64), (96, 2, 32), (128, 3, 64), (64, 2, 128), (32, 1, 512)]
NUM_LAYERS, NUM_BLOCKS = 3, 9
IDS = [7, 0, 4, 8]


def shape_id(s: tuple[int, int, int]) -> str:
    return f"bs{s[0]}-h{s[1]}-d{s[2]}"


def case_id(case: dict) -> str:
    return f"bs{case['block_size']}-d{case['head_dim']}-h{case['num_kv_heads']}"


def load_case(case: dict) -> dict[str, torch.Tensor]:
    """A captured write: ``key``/``value``/``cache_before``/``cache_after`` as bf16, ``slot_mapping`` int64."""
    t = load_file(FIXTURES / case["file"])
    return {k: v if k == "slot_mapping" else v.view(torch.bfloat16) for k, v in t.items()}


def gather(caches: list[torch.Tensor], ids: torch.Tensor, impl: str) -> torch.Tensor:
    if impl == "reference":  # the naive function itself, and the op's "reference" dispatch (into poisoned out)
        ref = gather_blocks_reference(caches, ids, AMX)
        got = gather_blocks(caches, ids, AMX, out=poisoned(tuple(ref.shape), ref.dtype), impl="reference")
        assert bits_equal(got, ref)
        return ref
    ref = gather_blocks_reference(caches, ids, AMX)
    return gather_blocks(caches, ids, AMX, out=poisoned(tuple(ref.shape), ref.dtype), impl=impl)  # type: ignore[arg-type]


def scatter(blocks: torch.Tensor, caches: list[torch.Tensor], ids: torch.Tensor, impl: str) -> None:
    if impl == "reference":
        scatter_blocks_reference(blocks, caches, ids, AMX)
    else:
        scatter_blocks(blocks, caches, ids, AMX, impl=impl)  # type: ignore[arg-type]


# -- against vLLM's captured writes ------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_gather_gives_back_what_vllm_wrote(case: dict, impl: str) -> None:
    t = load_case(case)
    bs = int(case["block_size"])
    slots = t["slot_mapping"]
    keep = slots >= 0  # -1: padding, which vLLM skips
    slots = slots[keep]
    ids = torch.arange(t["cache_after"].shape[0])
    blocks = gather([t["cache_after"]], ids, impl)  # [nb, 1, 2, bs, H, D]
    assert bits_equal(blocks[slots // bs, 0, 0, slots % bs], t["key"][keep])
    assert bits_equal(blocks[slots // bs, 0, 1, slots % bs], t["value"][keep])
    untouched = torch.ones(blocks.shape[0], bs, dtype=torch.bool)
    untouched[slots // bs, slots % bs] = False
    assert torch.all(int_view(blocks[:, 0, :].transpose(1, 2)[untouched]) == 0x7FC1)  # the fill, where vLLM wrote none


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_scatter_reproduces_vllms_bytes(case: dict, impl: str) -> None:
    t = load_case(case)
    bs = int(case["block_size"])
    after = t["cache_after"]
    slots = t["slot_mapping"]
    keep = slots >= 0
    slots = slots[keep]
    # Canonical blocks built from the captured inputs alone: the fill everywhere, each token's K and V at its slot.
    blocks = torch.empty((after.shape[0], 1, 2, bs, *t["key"].shape[1:]), dtype=torch.bfloat16)
    int_view(blocks).fill_(0x7FC1)
    blocks[slots // bs, 0, 0, slots % bs] = t["key"][keep]
    blocks[slots // bs, 0, 1, slots % bs] = t["value"][keep]
    cache = poisoned(tuple(after.shape), after.dtype)
    scatter(blocks, [cache], torch.arange(after.shape[0]), impl)
    assert bits_equal(cache, after)


def test_offsets_and_views_match_the_captures() -> None:
    """``amx_offsets`` (the layout's formulas) and ``cpu_attn_kv_views`` (strided views) both find each captured
    token where vLLM put it."""
    for case in CASES:
        t = load_case(case)
        bs, d = int(case["block_size"]), int(case["head_dim"])
        after = int_view(t["cache_after"])
        nb, h = after.shape[:2]
        slots = t["slot_mapping"]
        keep = slots >= 0
        b, pos = slots[keep] // bs, slots[keep] % bs
        k_off, v_off = amx_offsets(bs, d)
        regions = after.reshape(nb, h, 2, bs * d)
        rows = torch.arange(b.numel())[:, None]
        for head in range(h):
            assert torch.equal(regions[b, head, 0][rows, k_off[pos]], int_view(t["key"][keep, head]))
            assert torch.equal(regions[b, head, 1][rows, v_off[pos]], int_view(t["value"][keep, head]))
        k, v = cpu_attn_kv_views(after, AMX)
        assert k.data_ptr() == after.data_ptr()  # views, no copy
        assert torch.equal(k.reshape(nb, bs, h, d)[b, pos], int_view(t["key"][keep]))
        assert torch.equal(v.reshape(nb, bs, h, d)[b, pos], int_view(t["value"][keep]))


# -- every implementation against the reference ------------------------------------------------------------------------


def make_caches(shape: tuple[int, int, int], seed: int = 0, num_blocks: int = NUM_BLOCKS) -> list[torch.Tensor]:
    block_size, heads, dim = shape
    gen = torch.Generator().manual_seed(seed)
    return [random_kv((num_blocks, heads, block_size, 2 * dim), torch.bfloat16, gen) for _ in range(NUM_LAYERS)]


def check_all_ops(caches: list[torch.Tensor], impl: str, ids_list: list[int] = IDS) -> None:
    """gather/scatter, blocks/layers, and one layer into a strided staging slice: bit-exact into poisoned outputs."""
    ids = torch.tensor(ids_list)
    ref = gather_blocks_reference(caches, ids, AMX)
    assert bits_equal(gather(caches, ids, impl), ref)
    layers = gather_layers(caches, ids.to(torch.int32), AMX, impl=impl)  # type: ignore[arg-type]
    assert bits_equal(layers, gather_layers_reference(caches, ids, AMX))
    staging = poisoned(tuple(ref.shape), ref.dtype)
    gather_blocks(caches[1:2], ids, AMX, out=staging[:, 1:2], impl=impl)  # type: ignore[arg-type]
    assert bits_equal(staging[:, 1], ref[:, 1])
    assert bits_equal(staging[:, 0], poisoned(tuple(ref[:, 0].shape), ref.dtype))  # other layers untouched

    want = [poisoned(tuple(c.shape), c.dtype) for c in caches]
    scatter_blocks_reference(ref, want, ids, AMX)
    for fn, src in ((scatter_blocks, ref), (scatter_layers, layers), (scatter_blocks, separate_blocks(ref))):
        dst = [poisoned(tuple(c.shape), c.dtype) for c in caches]
        fn(src, dst, ids, AMX, impl=impl)  # type: ignore[operator]
        assert all(bits_equal(a, b) for a, b in zip(dst, want, strict=True))


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("impl", IMPLS)
def test_every_impl_matches_reference(impl: str, shape: tuple[int, int, int]) -> None:
    check_all_ops(make_caches(shape), impl)


@pytest.mark.parametrize("nontemporal", [True, False], ids=["nontemporal", "cached"])
def test_cpu_kernel_with_and_without_nontemporal_stores(nontemporal: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The numba kernel with non-temporal and with ordinary stores (the size threshold set to 0 or out of reach, so
    both run on small data); a gather into a staging buffer one element off alignment takes ordinary stores."""
    monkeypatch.setattr(block_copy_cpu, "_NONTEMPORAL_MIN_BYTES", 0 if nontemporal else 1 << 62)
    plans: list[tuple[int, bool]] = []
    real_plan = block_copy_cpu.cpu_attn_plan
    monkeypatch.setattr(block_copy_cpu, "cpu_attn_plan", lambda *a: plans.append(real_plan(*a)) or plans[-1])
    caches = make_caches((64, 3, 64))
    check_all_ops(caches, "cpu")
    assert plans and set(plans) == {(32, nontemporal and block_copy_cpu._NONTEMPORAL)}, plans

    ids = torch.tensor(IDS)
    ref = gather_blocks_reference(caches, ids, AMX)
    flat = poisoned((ref.numel() + 1,), ref.dtype)
    out = flat[1:].view(ref.shape)  # contiguous, 2 bytes past an aligned address
    plans.clear()
    assert bits_equal(gather_blocks(caches, ids, AMX, out=out, impl="cpu"), ref)
    assert plans == [(32, False)]
    assert bits_equal(flat[:1], poisoned((1,), ref.dtype))  # nothing written before the buffer


def test_cpu_path_split_over_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several MiB split over 3 threads (an uneven split of the (block, layer) items), bit-exact."""
    pools: list[int] = []
    real_pool = block_copy_cpu._cpu_pool
    monkeypatch.setattr(block_copy_cpu, "_cpu_pool", lambda workers: pools.append(workers) or real_pool(workers))
    torch.set_num_threads(3)  # the module fixture restores the count
    caches = make_caches((128, 2, 128), seed=5, num_blocks=10)  # 3 layers x 8 blocks x 128 KiB = 3 MiB a copy
    check_all_ops(caches, "cpu", [8, 1, 3, 0, 5, 9, 2, 6])
    assert pools and set(pools) == {2}, pools


@pytest.mark.parametrize("impl", ["cpu", "torch", "triton"])
def test_repeated_ids(impl: str) -> None:
    caches = make_caches((32, 2, 64), seed=1)
    ids = torch.tensor([3, 5, 3, 3])
    got = gather_blocks(caches, ids, AMX, impl=impl)  # type: ignore[arg-type]
    assert bits_equal(got, gather_blocks_reference(caches, ids, AMX))
    before = [c.clone() for c in caches]
    with pytest.raises(ValueError, match=r"distinct.*\[3, 5, 3, 3\]"):
        scatter_blocks(got, caches, ids, AMX, impl=impl)  # type: ignore[arg-type]
    assert all(bits_equal(a, b) for a, b in zip(caches, before, strict=True))


@pytest.mark.parametrize("impl", ["cpu", "torch"])
def test_offsets_past_2_31(impl: str) -> None:
    """One lazily allocated layer (pages committed only where written) whose last block lies past 2**31 bytes."""
    bs, h, d = 128, 8, 128
    num_blocks = (1 << 31) // (2 * bs * h * 2 * d) + 2
    cache = torch.empty((num_blocks, h, bs, 2 * d), dtype=torch.bfloat16)
    ids = torch.tensor([num_blocks - 1])
    assert cache[num_blocks - 1].data_ptr() - cache.data_ptr() >= 2**31
    one = random_kv((1, 1, 2, bs, h, d), torch.bfloat16, torch.Generator().manual_seed(3))
    scatter_blocks(one, [cache], ids, AMX, impl=impl)  # type: ignore[arg-type]
    assert bits_equal(gather_blocks_reference([cache], ids, AMX), one)
    out = poisoned(tuple(one.shape), one.dtype)
    assert bits_equal(gather_blocks([cache], ids, AMX, out=out, impl=impl), one)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("dtype", "shape", "match"),
    [
        (torch.float16, (4, 2, 32, 128), None),  # fp16 is 2 bytes: the layout holds it (vLLM never writes it)
        (torch.float32, (4, 2, 32, 128), r"element size must be 2 bytes \(bf16\), got 4"),
        (torch.float8_e4m3fn, (4, 2, 32, 128), r"element size must be 2 bytes \(bf16\), got 1"),
        (torch.bfloat16, (4, 2, 16, 128), r"multiples of 32, got block_size=16, head_dim=64"),
        (torch.bfloat16, (4, 2, 32, 160), r"multiples of 32, got block_size=32, head_dim=80"),
        (torch.bfloat16, (4, 2, 32, 127), r"CPU_ATTN_AMX KV must be \[num_blocks, num_kv_heads, block_size"),
    ],
    ids=["fp16", "fp32", "fp8", "bs16", "d80", "odd"],
)
def test_shapes_and_dtypes_it_cannot_hold(dtype: torch.dtype, shape: tuple[int, ...], match: str | None) -> None:
    cache = torch.zeros(shape, dtype=dtype)
    ids = torch.tensor([1])
    if match is None:
        assert gather_blocks([cache], ids, AMX).shape == (1, 1, 2, shape[2], shape[1], shape[3] // 2)
        return
    for call in (
        lambda: gather_blocks([cache], ids, AMX),
        lambda: gather_blocks_reference([cache], ids, AMX),
        lambda: cpu_attn_kv_views(cache, AMX),
    ):
        with pytest.raises(ValueError, match=match):
            call()
    with pytest.raises(ValueError, match="layout must be one of"):
        cpu_attn_kv_views(cache, KVLayout.FLASH_NHD)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: native Triton runs only where a GPU exists")
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_cuda_triton_matches_reference(shape: tuple[int, int, int]) -> None:
    """The Triton kernel's CPU_ATTN_AMX addressing compiled and run natively (the layout lives in host memory in
    vLLM, but the op takes tensors on any device)."""
    caches = make_caches(shape)
    ids = torch.tensor(IDS)
    ref = gather_blocks_reference(caches, ids, AMX)
    dev = [c.cuda() for c in caches]
    got = gather_blocks(dev, ids.cuda(), AMX, out=poisoned(tuple(ref.shape), ref.dtype).cuda())
    assert bits_equal(got.cpu(), ref)
    layers = gather_layers(dev, ids.cuda(), AMX)
    assert bits_equal(layers.cpu(), gather_layers_reference(caches, ids, AMX))
    dst = [poisoned(tuple(c.shape), c.dtype).cuda() for c in caches]
    want = [poisoned(tuple(c.shape), c.dtype) for c in caches]
    scatter_blocks(got, dst, ids.cuda(), AMX)
    scatter_blocks_reference(ref, want, ids, AMX)
    assert all(bits_equal(a.cpu(), b) for a, b in zip(dst, want, strict=True))
