"""The ``impl`` vocabulary (``ucm.kernels.utils``): one set of names for every op, resolved by device, and the same
ValueError, naming the allowed ones, from every op for a name outside it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from ucm.config import GSAConfig
from ucm.kernels import KVLayout, gather_blocks, gather_layers, scatter_blocks, scatter_layers
from ucm.kernels.blend import kv_deviation, rope_delta_, select_recompute
from ucm.kernels.key_bounds import block_scores, block_summaries
from ucm.kernels.kvfold import dequantize_int8_groups, merge_bf16_planes, quantize_int8_groups, split_bf16_planes
from ucm.kernels.paged_keys import paged_keys
from ucm.kernels.sparq import sparq_block_lse, sparq_query
from ucm.kernels.utils import IMPLS, resolve_impl
from ucm.sparse.selection import keep_blocks

ALLOWED = r"impl must be one of \['auto', 'triton', 'cpu', 'torch', 'reference'\], got 'numba'"


def test_auto_picks_by_device() -> None:
    assert IMPLS == ("auto", "triton", "cpu", "torch", "reference")
    assert resolve_impl("auto", torch.device("cpu")) == "cpu"
    assert resolve_impl("auto", torch.device("cuda")) == "triton"
    assert resolve_impl("auto", torch.device("meta")) == "torch"  # any other device
    no_triton = ("cpu", "torch", "reference")
    assert resolve_impl("auto", torch.device("cuda"), no_triton) == "torch"
    assert resolve_impl("reference", torch.device("cuda")) == "reference"
    with pytest.raises(ValueError, match=r"impl='cpu' needs CPU tensors, got device cuda"):
        resolve_impl("cpu", torch.device("cuda"))
    with pytest.raises(ValueError, match=r"keep_blocks has no 'triton' implementation; impl must be one of \['auto', "):
        resolve_impl("triton", torch.device("cpu"), no_triton, op="keep_blocks")


def _ops() -> dict[str, Callable[[str], object]]:
    """Every op, called on small valid CPU inputs with the given ``impl``."""
    caches = [torch.zeros((4, 2, 16, 2 * 32), dtype=torch.bfloat16)]
    ids = torch.tensor([1, 2])
    blocks = torch.zeros((2, 1, 2, 16, 2, 32), dtype=torch.bfloat16)
    keys = paged_keys(caches[0], KVLayout.CPU_ATTN)
    table, lens, counts = torch.tensor([[1, 2]]), torch.tensor([20]), torch.tensor([16, 4])
    bounds = torch.zeros((4, 2, 32))
    q, chans = torch.zeros((1, 4, 8)), torch.zeros((1, 2, 8), dtype=torch.int64)
    u8 = torch.zeros(8, dtype=torch.uint8)
    return {
        "gather_blocks": lambda impl: gather_blocks(caches, ids, KVLayout.CPU_ATTN, impl=impl),  # type: ignore[arg-type]
        "gather_layers": lambda impl: gather_layers(caches, ids, KVLayout.CPU_ATTN, impl=impl),  # type: ignore[arg-type]
        "scatter_blocks": lambda impl: scatter_blocks(blocks, caches, ids, KVLayout.CPU_ATTN, impl=impl),  # type: ignore[arg-type]
        "scatter_layers": lambda impl: scatter_layers(
            blocks.transpose(0, 1), caches, ids, KVLayout.CPU_ATTN, impl=impl
        ),  # type: ignore[arg-type]
        "split_bf16_planes": lambda impl: split_bf16_planes(u8, impl=impl),  # type: ignore[arg-type]
        "merge_bf16_planes": lambda impl: merge_bf16_planes(u8, u8, impl=impl),  # type: ignore[arg-type]
        "quantize_int8_groups": lambda impl: quantize_int8_groups(blocks.reshape(-1), 32, impl=impl),  # type: ignore[arg-type]
        "dequantize_int8_groups": lambda impl: dequantize_int8_groups(
            u8.view(torch.int8), u8[:2].view(torch.bfloat16), impl=impl
        ),  # type: ignore[arg-type]
        "block_summaries": lambda impl: block_summaries(keys, ids, counts, bounds, bounds.clone(), impl=impl),  # type: ignore[arg-type]
        "block_scores": lambda impl: block_scores(
            torch.zeros((1, 4, 32)), bounds, bounds, table, torch.tensor([2]), impl=impl
        ),  # type: ignore[arg-type]
        "sparq_query": lambda impl: sparq_query(torch.zeros((1, 4, 32)), 2, 8, 0.125, impl=impl),  # type: ignore[arg-type]
        "sparq_block_lse": lambda impl: sparq_block_lse(q, chans, keys, table, lens, impl=impl),  # type: ignore[arg-type]
        "rope_delta_": lambda impl: rope_delta_(torch.zeros((2, 2, 8)), torch.tensor([0, 3]), impl=impl),  # type: ignore[arg-type]
        "kv_deviation": lambda impl: kv_deviation(*[torch.zeros((2, 2, 8))] * 4, impl=impl),  # type: ignore[arg-type]
        "select_recompute": lambda impl: select_recompute(torch.zeros(4), 0.5, impl=impl),  # type: ignore[arg-type]
        "keep_blocks": lambda impl: keep_blocks(
            torch.zeros((1, 4, 2)), 1.0, torch.tensor([0]), table, lens, 16, GSAConfig(), impl=impl
        ),  # type: ignore[arg-type]
    }


@pytest.mark.parametrize("op", list(_ops()))
def test_every_op_takes_the_vocabulary(op: str) -> None:
    """An unknown name is the same ValueError from every op; ``"reference"`` and ``"auto"`` run everywhere."""
    call = _ops()[op]
    with pytest.raises(ValueError, match=ALLOWED):
        call("numba")
    call("auto")
    call("reference")
