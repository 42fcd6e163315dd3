"""What a block-sparse attention method provides, and the bookkeeping all of them share (plain torch, no vLLM).

A method (:class:`SparseMethod`) has
- its config (a typed section of ``ucm_sparse_config`` in ``ucm.config``);
- per-block summaries (:class:`BlockSummaries`): one table per attention layer, indexed by vLLM block id, kept
  beside the paged KV cache;
- a block selection per request and layer at decode (:meth:`SparseMethod.select`), returned as a replacement block
  table and sequence lengths (:class:`Selection`) that a paged-attention kernel reads instead of the dense ones.
- optionally, what it learns from prefill steps (:meth:`SparseMethod.observe`, e.g. which blocks the prompt's last
  queries attended to).

Freshness of summaries. A summary records how many tokens of its block it covers (``fill``). The attention
wrapper invalidates the blocks of every slot it sees written (``slot_mapping``), and the UCM connector invalidates
the blocks it loads from the store (:func:`invalidate_blocks`, which reaches every live table of this process).
Before selecting, a method recomputes the summaries of the request's blocks that are invalid or cover a different
number of tokens than the request now has in them. So a block's summary is computed once after it fills (plus the
growing last block at every step), prefill pays nothing, and blocks reused by vLLM's prefix cache keep theirs.
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from ucm.kernels.layouts import KVLayout

_LIVE_TABLES: weakref.WeakSet[BlockSummaries] = weakref.WeakSet()


def invalidate_blocks(block_ids: torch.Tensor | list[int]) -> None:
    """Mark the summaries of ``block_ids`` (vLLM block ids) stale in every live summary table of this process.

    Called by whoever writes KV into the paged cache behind the attention layer's back (the UCM connector after a
    load from the store). Cheap when no sparse method is on (no live tables).
    """
    tables = list(_LIVE_TABLES)
    if not tables:
        return
    ids = torch.as_tensor(block_ids, dtype=torch.int64)
    for table in tables:
        table.invalidate(ids)


class BlockSummaries(ABC):
    """One layer's per-block summaries, indexed by vLLM block id, with their freshness.

    Attributes:
        fill: int64 ``[num_blocks]``, tokens of the block the summary covers; ``-1`` = stale / never computed.
    """

    def __init__(self, num_blocks: int, device: torch.device) -> None:
        self.num_blocks = num_blocks
        self.fill = torch.full((num_blocks,), -1, dtype=torch.int64, device=device)
        _LIVE_TABLES.add(self)

    def invalidate(self, block_ids: torch.Tensor) -> None:
        """Mark ``block_ids`` stale (ids outside the table are ignored: another layer group's cache)."""
        ids = block_ids.to(self.fill.device, torch.int64)
        ids = ids[(ids >= 0) & (ids < self.num_blocks)]
        self.fill[ids] = -1

    def invalidate_slots(self, slot_mapping: torch.Tensor, block_size: int) -> None:
        """Mark stale the blocks of the written ``slot_mapping`` entries (negative slots are padding)."""
        slots = slot_mapping[slot_mapping >= 0]
        self.invalidate(torch.div(slots, block_size, rounding_mode="floor"))

    def refresh(self, keys: torch.Tensor, block_ids: torch.Tensor, counts: torch.Tensor) -> int:
        """Recompute the summaries of ``block_ids`` whose ``fill`` differs from ``counts``; return how many.

        Args:
            keys: paged keys of this layer (``ucm.kernels.paged_keys.paged_keys``: plain ``[num_blocks,
                num_kv_heads, block_size, head_dim]`` or tiled ``[num_blocks, num_kv_heads, block_size / TT, TT,
                head_dim / TD, TD]``, strided views of the cache).
            block_ids: int64 ``[n]`` vLLM block ids (duplicates allowed when their counts agree).
            counts: int64 ``[n]`` tokens the request has in each block, in ``[1, block_size]``.
        """
        stale = self.fill[block_ids] != counts
        if not bool(stale.any()):
            return 0
        ids, first = _unique_first(block_ids[stale])
        cnt = counts[stale][first]
        self._compute(keys, ids, cnt)
        self.fill[ids] = cnt
        return int(ids.numel())

    @abstractmethod
    def _compute(self, keys: torch.Tensor, block_ids: torch.Tensor, counts: torch.Tensor) -> None:
        """Overwrite the summaries of distinct ``block_ids`` over their first ``counts`` tokens."""


def _unique_first(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct values of ``ids`` and, for each, the index of one occurrence."""
    uniq, inverse = torch.unique(ids, return_inverse=True)
    first = torch.empty_like(uniq).scatter_(0, inverse, torch.arange(ids.numel(), device=ids.device))
    return uniq, first


@dataclass(frozen=True)
class Selection:
    """The blocks a sparse method keeps, as a replacement for the dense block table.

    Attributes:
        block_table: same dtype and shape as the dense ``[R, W]`` table; row ``r`` names the kept blocks in token
            order in its first ``ceil(seq_lens[r] / block_size)`` entries (later entries are stale, never read).
        seq_lens: same dtype as the dense ``[R]``: tokens attended per row (dense length minus dropped blocks'
            tokens; only full blocks are ever dropped).
        kept: int64 ``[R]`` blocks kept per row; ``num_blocks``: int64 ``[R]`` blocks of the dense row.
    """

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    kept: torch.Tensor
    num_blocks: torch.Tensor


def compact_block_table(
    block_table: torch.Tensor, seq_lens: torch.Tensor, keep: torch.Tensor, block_size: int
) -> Selection:
    """The block table and lengths that attend only to the kept blocks of each row.

    Args:
        block_table: int ``[R, W]`` dense block ids (not modified: vLLM's is a view of a persistent buffer).
        seq_lens: int ``[R]`` dense lengths in tokens.
        keep: bool ``[R, W]``; ``keep[r, w]`` keeps the ``w``-th block of row ``r``. The row's last block (which
            holds the current token and may be partial) must be kept; entries past the row's blocks are ignored.
        block_size: tokens per block.

    Raises:
        ValueError: a row drops its last block.
    """
    r, w = block_table.shape
    n = torch.div(seq_lens.long() + block_size - 1, block_size, rounding_mode="floor")  # [R]
    cols = torch.arange(w, device=block_table.device)
    keep = keep & (cols[None, :] < n[:, None])
    last = (n - 1).clamp(min=0)
    has = n > 0
    if bool((has & ~keep[torch.arange(r, device=keep.device), last]).any()):
        raise ValueError("a selection must keep each row's last block (it holds the current token)")
    kept = keep.sum(dim=1)  # [R]
    # Kept columns first, in token order: sort by (not kept, column).
    order = torch.sort((~keep).long() * w + cols[None, :], dim=1).indices
    table = torch.gather(block_table, 1, order)
    lens = seq_lens.long() - (n - kept) * block_size
    return Selection(block_table=table, seq_lens=lens.to(seq_lens.dtype), kept=kept, num_blocks=n)


class SparseMethod(ABC):
    """A sparse-attention method: per-block summaries and a per-request, per-layer block selection at decode."""

    name: ClassVar[str]

    @abstractmethod
    def new_summaries(self, num_blocks: int, num_kv_heads: int, head_dim: int, device: torch.device) -> BlockSummaries:
        """An empty (all stale) summary table for one layer's paged cache of ``num_blocks`` blocks."""

    @abstractmethod
    def select(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        summaries: BlockSummaries,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> Selection:
        """The blocks each decode row attends to in this layer.

        Args:
            query: ``[R, num_heads, head_dim]``, one (post-RoPE) query per row.
            keys: paged keys of the layer (``ucm.kernels.paged_keys.paged_keys``: plain ``[num_blocks, num_kv_heads,
                block_size, head_dim]`` or tiled for CPU_ATTN_AMX; read them through that module's helpers); the
                current token's key already written.
            summaries: this layer's table from :meth:`new_summaries` (refreshed here as needed).
            block_table: int ``[R, W]`` dense block ids; seq_lens: int ``[R]`` dense lengths (tokens).
            scale: the attention's softmax scale (``1/sqrt(head_dim)`` for most models).
        """

    def warm_up(self, dtype: torch.dtype, device: torch.device, layout: KVLayout) -> None:
        """Compile or load whatever the method's first :meth:`select` on a paged cache of ``dtype`` on ``device`` in
        ``layout`` would (called once per process and KV dtype and layout at engine start, so that the first decode
        step does not wait for it); the default does nothing."""
        return None

    def observe(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        summaries: BlockSummaries,
        block_table: torch.Tensor,
        seq_len: int,
        scale: float,
    ) -> None:
        """Learn from one request's prefill step (a row with more than one query token); the default learns
        nothing.

        Args:
            query: ``[W, num_heads, head_dim]``: the row's last ``W`` (post-RoPE) queries of the step, at token
                positions ``seq_len - W`` .. ``seq_len - 1``.
            keys, summaries, scale: as in :meth:`select`.
            block_table: int ``[W_table]`` the row's dense block ids; seq_len: its length in tokens, this step's
                included.
        """
        return None
