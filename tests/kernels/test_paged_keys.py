"""paged_keys (the keys of a paged KV cache, read in place) and its helpers: bit-exact against vLLM's captured amx
writes (``fixtures/cpu_attn_amx``: runs on every machine), the CPU_ATTN view against the layout's formula, both
forms (plain and tiled) of the same keys giving the same blocks, and the errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ucm.kernels.layouts import KVLayout, cpu_attn_kv_views, int_view
from ucm.kernels.paged_keys import block_keys, key_geometry, key_tiling, paged_keys, tiled_keys

FIXTURES = Path(__file__).parent / "fixtures" / "cpu_attn_amx"
CASES = json.loads((FIXTURES / "index.json").read_text())
# (num_blocks, num_kv_heads, block_size, head_dim) for the CPU layouts (CPU_ATTN_AMX: multiples of 32).
SHAPES = [(5, 3, 32, 64), (3, 2, 96, 32), (2, 1, 64, 128)]
CPU_LAYOUTS = [KVLayout.CPU_ATTN, KVLayout.CPU_ATTN_AMX]


def case_id(case: dict) -> str:
    return f"bs{case['block_size']}-d{case['head_dim']}-h{case['num_kv_heads']}"


def shape_id(s: tuple[int, int, int, int]) -> str:
    return f"nb{s[0]}-h{s[1]}-bs{s[2]}-d{s[3]}"


def cache_holding(keys: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """A CPU layer tensor ``[nb, H, bs, 2D]`` in ``layout`` whose K is ``keys`` (plain ``[nb, H, bs, D]``), written
    through ``cpu_attn_kv_views``; V left at a NaN pattern."""
    nb, h, bs, d = keys.shape
    cache = torch.full((nb, h, bs, 2 * d), float("nan"), dtype=keys.dtype)
    k, _ = cpu_attn_kv_views(cache, layout)
    k.copy_(keys.transpose(1, 2).reshape(nb, *k.shape[1:]))
    return cache


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_amx_keys_are_what_vllm_wrote(case: dict) -> None:
    """``paged_keys`` on the cache vLLM's ``amx`` write produced gives back each written token's key at its slot, bit
    for bit (NaN payloads, -0, inf included), through ``block_keys``; unwritten slots keep the fill pattern."""
    t = load_file(FIXTURES / case["file"])
    cache = t["cache_after"].view(torch.bfloat16)
    nb, h, bs, d = int(case["num_blocks"]), int(case["num_kv_heads"]), int(case["block_size"]), int(case["head_dim"])
    keys = paged_keys(cache, KVLayout.CPU_ATTN_AMX)
    assert keys.dim() == 6 and keys.data_ptr() == cache.data_ptr()  # a view of the cache, no copy
    assert key_geometry(keys) == (nb, h, bs, d)
    every = int_view(block_keys(keys, torch.arange(nb)))  # [nb, H, bs, D] int16
    slots = t["slot_mapping"]
    written = slots >= 0
    assert int(written.sum()) == len(set(slots[written].tolist()))  # distinct slots: no write overwrites another
    b, tok = slots[written] // bs, slots[written] % bs
    assert torch.equal(every[b, :, tok, :], t["key"][written])  # [n, H, D]
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    untouched[slots[written]] = False
    assert (every.transpose(1, 2).reshape(nb * bs, h, d)[untouched] == 0x7FC1).all()


def test_cpu_attn_view_reads_the_transposed_layout() -> None:
    """``paged_keys`` on CPU_ATTN: K stored transposed ``[head_dim, block_size]`` per (block, head), as a plain view."""
    bs, h, d = 32, 2, 8
    cache = torch.arange(4 * h * bs * 2 * d, dtype=torch.float32).view(4, h, bs, 2 * d)
    keys = paged_keys(cache, KVLayout.CPU_ATTN)
    flat = cache.view(4, h, 2 * bs * d)
    assert keys.shape == (4, h, bs, d) and keys.stride()[2:] == (1, bs)
    b, hh, t, dd = 3, 1, 5, 6
    assert keys[b, hh, t, dd] == flat[b, hh, dd * bs + t]


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("layout", CPU_LAYOUTS, ids=lambda lay: lay.value)
def test_both_forms_address_the_same_keys(layout: KVLayout, shape: tuple[int, int, int, int]) -> None:
    """The same keys in either CPU layout: ``block_keys`` gives them back; the tiled offsets of ``key_tiling`` (what
    every kernel computes) point at them; ``tiled_keys`` of plain keys is a view with one tile of each kind."""
    nb, h, bs, d = shape
    g = torch.Generator().manual_seed(0)
    want = torch.randn(shape, generator=g).to(torch.bfloat16)
    keys = paged_keys(cache_holding(want, layout), layout)
    ids = torch.tensor([nb - 1, 0, nb - 1])
    assert torch.equal(int_view(block_keys(keys, ids)), int_view(want[ids]))
    assert torch.equal(int_view(block_keys(keys, ids.tolist())), int_view(want[ids]))
    (s0, s1, s2, s3, s4, s5), tt, td = key_tiling(keys)
    assert (tt, td) == ((16, 2) if layout == KVLayout.CPU_ATTN_AMX else (bs, d))
    base = tiled_keys(keys)
    flat = base.as_strided((base.untyped_storage().nbytes() // 2 - base.storage_offset(),), (1,))
    for b, hh, t, c in [(0, 0, 0, 0), (nb - 1, h - 1, bs - 1, d - 1), (nb // 2, h // 2, 17, 3)]:
        off = b * s0 + hh * s1 + (t // tt) * s2 + (t % tt) * s3 + (c // td) * s4 + (c % td) * s5
        assert int_view(flat[off]) == int_view(want[b, hh, t, c])
    if layout == KVLayout.CPU_ATTN:
        tiled = tiled_keys(keys)
        assert tiled.shape == (nb, h, 1, bs, 1, d) and tiled.data_ptr() == keys.data_ptr()
        assert key_geometry(tiled) == key_geometry(keys) == shape


def test_errors_name_the_bad_value() -> None:
    with pytest.raises(ValueError, match="layout 'mla' is not supported"):
        paged_keys(torch.zeros((4, 16, 64)), KVLayout.MLA)
    with pytest.raises(ValueError, match=r"head_dim multiples of 32, got block_size=32, head_dim=40"):
        paged_keys(torch.zeros((4, 2, 32, 80), dtype=torch.bfloat16), KVLayout.CPU_ATTN_AMX)
    with pytest.raises(ValueError, match="element size must be 2 bytes"):
        paged_keys(torch.zeros((4, 2, 32, 128)), KVLayout.CPU_ATTN_AMX)
    with pytest.raises(ValueError, match=r"got 5-D \(2, 3, 4, 5, 6\)"):
        key_geometry(torch.zeros((2, 3, 4, 5, 6)))
    with pytest.raises(ValueError, match="keys must be plain"):
        block_keys(torch.zeros((2, 3, 4)), [0])
