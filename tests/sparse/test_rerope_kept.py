"""ReRoPE's running-request KV kept between steps (``KeptRequestKV``) and the block allocations that void it
(``BlockAllocations``), without an engine: an entry is handed back only to the request whose block-table prefix holds
its values, only while none of those blocks was allocated again, within the layer's byte budget, and only for the
step after the one that kept it. The engine test (``test_rerope_engine.py``) runs the same through vLLM."""

from __future__ import annotations

import torch

from ucm.integration.vllm.sparse_backend import BlockAllocations, KeptRequestKV
from ucm.kernels.rerope.torch import RequestKV

BLOCK = 128


def _entry(tokens: int) -> RequestKV:
    kv = RequestKV()
    kv.append_values(torch.zeros((2, tokens, 8)))
    kv.append_far_keys(torch.zeros((2, max(0, tokens - 64), 8)))
    return kv


def _row(*blocks: int) -> torch.Tensor:
    return torch.tensor([*blocks, 0, 0], dtype=torch.int32)  # vLLM pads block-table rows


def _kept_after_one_step(*blocks: int) -> tuple[BlockAllocations, KeptRequestKV, RequestKV]:
    """A step that allocated ``blocks`` to a request of 300 tokens and kept its entry."""
    allocations = BlockAllocations()
    allocations.note(list(blocks))
    kept = KeptRequestKV(1 << 20, allocations)
    kv = _entry(300)
    kept.put(kv, _row(*blocks), 300, BLOCK)
    kept.end_step()
    return allocations, kept, kv


def test_nothing_is_kept_before_allocations_are_reported_or_without_a_budget() -> None:
    allocations = BlockAllocations()
    assert KeptRequestKV(1 << 20, allocations).take(_row(3, 4), 200, BLOCK) is None  # step 0: nothing reported
    allocations.note([3, 4])
    assert KeptRequestKV(0, allocations).take(_row(3, 4), 200, BLOCK) is None
    assert isinstance(KeptRequestKV(1 << 20, allocations).take(_row(3, 4), 200, BLOCK), RequestKV)


def test_an_entry_comes_back_to_its_request_at_the_next_step() -> None:
    allocations, kept, kv = _kept_after_one_step(5, 6, 7)
    allocations.note([])
    assert kept.take(_row(5, 6, 7), 300, BLOCK) is kv  # decode: the token before the query is in block 7
    # A request sharing the first blocks but not the block of the last token, or other blocks: not it.
    assert kept.take(_row(5, 6, 9), 300, BLOCK) is not kv
    assert kept.take(_row(5, 8, 7), 300, BLOCK) is not kv
    assert kept.take(_row(5, 6, 7), 0, BLOCK) is not kv  # a step from position 0 keeps nothing of before
    # Speculative tokens rejected: the step starts before the entry's end, in a block it holds; the kernel
    # truncates it (tests/kernels/test_rerope_paged.py).
    kept.put(kv, _row(5, 6, 7), 300, BLOCK)
    kept.end_step()
    assert kept.take(_row(5, 6, 7), 290, BLOCK) is kv


def test_a_block_allocated_again_voids_the_entries_that_hold_it() -> None:
    allocations, kept, kv = _kept_after_one_step(1, 2, 3)
    # The request finished; the next step gives its blocks, in the same order, to a request whose KV the connector
    # loads (no slot_mapping writes): the same block-table row, other tokens.
    allocations.note([1, 2, 3])
    assert kept.take(_row(1, 2, 3), 300, BLOCK) is not kv
    # Blocks allocated to others (or this request's new tail block) do not void it.
    kept.put(kv, _row(1, 2, 3), 300, BLOCK)
    kept.end_step()
    allocations.note([4, 1000])
    assert kept.take(_row(1, 2, 3, 4), 300, BLOCK) is kv


def test_only_the_entries_put_this_step_and_within_the_budget_are_kept() -> None:
    allocations = BlockAllocations()
    allocations.note([1, 2, 3, 4, 5, 6])
    small, large = _entry(200), _entry(300)
    kept = KeptRequestKV(small.nbytes + large.nbytes - 1, allocations)
    kept.put(small, _row(1, 2), 200, BLOCK)
    kept.put(large, _row(3, 4, 5), 300, BLOCK)  # over the budget with the first one: not kept
    kept.end_step()
    assert kept.take(_row(1, 2), 200, BLOCK) is small
    assert kept.take(_row(3, 4, 5), 300, BLOCK) is not large
    kept.end_step()  # a step that ran neither request
    assert kept.take(_row(1, 2), 200, BLOCK) is not small


def test_allocations_grow_with_block_ids() -> None:
    allocations = BlockAllocations()
    allocations.note([2])
    allocations.note([5000])
    assert allocations.step == 2
    assert allocations.unchanged_since(torch.tensor([2, 4999]), 1)
    assert not allocations.unchanged_since(torch.tensor([2, 5000]), 1)
    assert allocations.unchanged_since(torch.tensor([2, 5000, 9999]), 2)  # never allocated: unchanged
