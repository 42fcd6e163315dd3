"""GSA: block-sparse decode attention (training-free): score the request's KV blocks against the decode query, attend
to the best ones plus sink and recent blocks.

Three scorings (``block_scoring``): ``sparq``, the default (the current query's attention mass approximated from a
few key components, every step; described last below), ``key_bounds`` (Quest's bounds, described first: the base
of the method and the cheapest) and ``attention`` (measured attention, refreshed once per block).

Summaries (``key_bounds``). Per KV block and KV head, the element-wise min and max of the block's (post-RoPE) keys,
as in Quest (Tang et al., 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference"). Chosen over
the mean key because it gives a true upper bound of ``q . k`` for every key in the block (a block with one strongly
matching key, a "needle", cannot hide behind its average), costs two vectors per block and head, and is exact to
update (min and max do not round). Computed by ``ucm.kernels.key_bounds.block_summaries``.

Selection at decode, per request and layer (one block set for all heads of the layer, since a paged-attention
kernel takes one block table per request):
1. ``ub[j, w]``: Quest's upper bound of ``q_j . k`` over block ``w``, for every query head ``j`` against its KV
   head's bounds (grouped-query heads share them) -- ``ucm.kernels.key_bounds.block_scores``;
2. per head, ``p[j, :] = softmax(scale * ub[j, :])`` over the request's blocks: an estimate of the share of head
   ``j``'s attention each block would get; the block score is ``sum_j p[j, w]``, the estimated attention mass over
   all heads of the layer (normalizing per head first keeps one head with large logits from deciding alone);
3. keep ``k = clamp(ceil(sparse_ratio * n), init_window_sz + local_window_sz, n)`` blocks: the first
   ``init_window_sz`` (attention sinks), the last ``local_window_sz`` (recent context; the last holds the current
   token), and the best-scoring others. Requests with fewer than ``min_blocks`` blocks stay dense, as does prefill
   (the wrapper only hands one-query rows to :meth:`GSA.select`). Steps 2-3 are ``ucm.sparse.selection``.

Scoring ``block_scoring: attention`` replaces steps 1-2 by measured attention: the exact attention mass each
block got (softmax over all the request's keys, summed over the layer's query heads and over the queries), from
the prompt's last ``observation_window`` queries at prefill (:meth:`GSA.observe`; the observation window of
SnapKV, Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation"), kept for the request's
decode steps and recomputed from the current query whenever the request starts a new block (once per
``block_size`` generated tokens, or at the first step of a request whose prefill left no scores, e.g. a storage
hit that computes one token). Scores are kept per request under the vLLM block id of its last block (the one
being written: never shared with another running request), checked against the request's first block id, and
dropped when that block is (re)started or loaded from the store (:class:`AttentionMass`). Why: a 128-token block's
key bounds are loose (every channel's extreme over 128 keys), and on the harness's multi-document questions they
kept the wrong document's block far more often than measured attention did (``benchmarks/sparse_policies.py``).
Cost: one pass of q.k over the request's keys per layer per ``block_size`` decode steps, and over the last
``observation_window`` prompt queries at prefill.

Scoring ``block_scoring: sparq`` (the default) replaces steps 1-2 by the current query's attention mass,
approximated at every step from ``score_channels`` of the ``head_dim`` key components per KV head (those where the
query heads sharing the KV head have the largest ``|q|``), with the softmax temperature corrected for the dropped
components: steps 1-2 of SparQ Attention (Ribar et al. 2024, "SparQ Attention: Bandwidth-Efficient LLM Inference"),
summed per block (:func:`sparq_scores`; the kernels are ``ucm.kernels.sparq``). Nothing is precomputed
(:class:`KeyChannels`). Why: on the harness's multi-document questions, only a ranking from each step's own query
matched dense at 70% of blocks skipped (at 32-token blocks; at 128-token blocks it matched the exact-mass oracle,
and key bounds lost most answers); scores reused for 4 or more steps, or taken from the prompt's last queries, lost
answers (``benchmarks/sparse_policies.py``). Cost: every step and layer reads ``score_channels / head_dim`` of every
key of the request (on top of the kept blocks' full K and V). On CPU (bf16/fp32 keys in vLLM's CPU layouts, CPU_ATTN
and CPU_ATTN_AMX: ``ucm.kernels.sparq.cpu_applies``) the whole selection of a step is three numba calls
(:func:`sparq_select`: the CPU paths of ``ucm.kernels.sparq`` and ``ucm.sparse.selection``); elsewhere, or with
``impl="torch"``, torch ops (:func:`sparq_scores`, then ``ucm.sparse.selection``'s ``aggregate_scores``,
``keep_mask`` and ``compact_block_table``), which are also the fast path's test oracles.

Keys: every function takes the layer's paged keys in either form of ``ucm.kernels.paged_keys`` (plain ``[num_blocks,
num_kv_heads, block_size, head_dim]``, or tiled for CPU_ATTN_AMX) and reads them through its helpers.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ucm.config import GSAConfig
from ucm.kernels.key_bounds import block_scores, block_summaries
from ucm.kernels.layouts import KVLayout
from ucm.kernels.paged_keys import block_keys, key_geometry, key_tiling, paged_keys
from ucm.kernels.sparq import cpu_applies, key_words, sparq_block_lse, sparq_query
from ucm.kernels.sparq.cpu import raise_bad_block_ids, sparq_lse, tile_blocks
from ucm.kernels.utils import IMPLS, Impl
from ucm.sparse.base import BlockSummaries, Selection, SparseMethod, compact_block_table
from ucm.sparse.selection import aggregate_scores, keep_blocks, keep_mask
from ucm.sparse.selection.cpu import keep_blocks_numpy


class KeyBounds(BlockSummaries):
    """Per-block key bounds of one layer: ``kmin``/``kmax`` float32 ``[num_blocks, num_kv_heads, head_dim]``."""

    def __init__(self, num_blocks: int, num_kv_heads: int, head_dim: int, device: torch.device, impl: Impl) -> None:
        super().__init__(num_blocks, device)
        self.impl: Impl = impl
        self.kmin = torch.zeros((num_blocks, num_kv_heads, head_dim), dtype=torch.float32, device=device)
        self.kmax = torch.zeros_like(self.kmin)

    def _compute(self, keys: torch.Tensor, block_ids: torch.Tensor, counts: torch.Tensor) -> None:
        block_summaries(keys, block_ids, counts, self.kmin, self.kmax, impl=self.impl)


class AttentionMass(BlockSummaries):
    """One layer's measured block scores (``block_scoring: attention``), one entry per running request.

    ``entries[last]``: ``(first, mass)`` for the request whose last block (the one it is writing) has vLLM id
    ``last`` and whose first block has id ``first``; ``mass`` float32 ``[n]`` scores its first ``n`` blocks. An
    entry is dropped when its block is started again (a write at the block's first slot: vLLM gave the block to a
    request anew) or loaded from the store (:func:`~ucm.sparse.base.invalidate_blocks`). The per-block ``fill`` of
    the base class is unused.
    """

    def __init__(self, num_blocks: int, device: torch.device) -> None:
        super().__init__(num_blocks, device)
        self.entries: dict[int, tuple[int, torch.Tensor]] = {}

    def invalidate(self, block_ids: torch.Tensor) -> None:
        """Drop the entries of ``block_ids`` (their contents changed behind the attention layer)."""
        if self.entries:
            for b in block_ids.tolist():
                self.entries.pop(int(b), None)

    def invalidate_slots(self, slot_mapping: torch.Tensor, block_size: int) -> None:
        """Drop the entries of blocks written at their first slot this step (started anew)."""
        if not self.entries:
            return
        slots = slot_mapping[slot_mapping >= 0]
        self.invalidate(torch.div(slots[slots % block_size == 0], block_size, rounding_mode="floor"))

    def _compute(self, keys: torch.Tensor, block_ids: torch.Tensor, counts: torch.Tensor) -> None:
        """Unused: entries are computed by :meth:`GSA.observe` / :meth:`GSA.select`."""


class KeyChannels(BlockSummaries):
    """``block_scoring: sparq``: nothing is precomputed. Each step reads ``score_channels`` components of the
    request's paged keys directly (:func:`sparq_scores`); vLLM's CPU layouts store a block's keys by component (one
    contiguous run per component in CPU_ATTN, one 16-value run per component and 16-token tile in CPU_ATTN_AMX). The
    base class's ``fill`` is unused, so invalidation is a no-op; the table keeps the numba path's view of the layer's
    paged keys (:meth:`key_words`)."""

    def __init__(self, num_blocks: int, device: torch.device) -> None:
        super().__init__(num_blocks, device)
        self._words: tuple[tuple[int, int, tuple[int, ...], tuple[int, ...]], tuple[np.ndarray, np.uint32]] | None
        self._words = None

    def invalidate(self, block_ids: torch.Tensor) -> None:
        """Nothing to invalidate: every step reads the keys themselves."""

    def invalidate_slots(self, slot_mapping: torch.Tensor, block_size: int) -> None:
        """Nothing to invalidate: every step reads the keys themselves."""

    def key_words(self, keys: torch.Tensor) -> tuple[np.ndarray, np.uint32]:
        """``ucm.kernels.sparq.key_words(keys)``, kept while ``keys`` is the same view of the same memory
        (the layer's paged cache: one per engine)."""
        ident = (keys.data_ptr(), id(keys.dtype), tuple(keys.shape), tuple(keys.stride()))
        if self._words is None or self._words[0] != ident:
            self._words = (ident, key_words(keys))
        return self._words[1]

    def _compute(self, keys: torch.Tensor, block_ids: torch.Tensor, counts: torch.Tensor) -> None:
        """Unused: there is nothing to precompute."""


def attention_mass(
    query: torch.Tensor, keys: torch.Tensor, block_ids: torch.Tensor, seq_len: int, scale: float
) -> torch.Tensor:
    """The attention mass each block gets, float32 ``[n]``: the causal softmax of each query (over the request's
    ``seq_len`` keys) summed over the queries, the query heads and the block's tokens.

    Args:
        query: ``[W, num_heads, head_dim]`` at token positions ``seq_len - W`` .. ``seq_len - 1``.
        keys: paged keys, plain or tiled (``ucm.kernels.paged_keys``).
        block_ids: int ``[n]`` the request's blocks in token order, ``n = ceil(seq_len / block_size)``.
        seq_len: the request's length in tokens.
        scale: softmax scale.
    """
    w, hq, d = query.shape
    _, h, bs, _ = key_geometry(keys)
    n = block_ids.numel()
    k = block_keys(keys, block_ids.long()).float().permute(1, 0, 2, 3).reshape(h, n * bs, d)  # [KVH, L, D]
    q = query.float().reshape(w, h, hq // h, d)
    logits = torch.einsum("wkgd,kld->wkgl", q, k) * scale  # [W, KVH, group, L]
    pos_q = torch.arange(seq_len - w, seq_len, device=query.device)
    future = torch.arange(n * bs, device=query.device)[None, :] > pos_q[:, None]  # [W, L]: later or past the end
    logits.masked_fill_(future[:, None, None, :], float("-inf"))
    mass = torch.softmax(logits, dim=-1).sum(dim=(0, 1, 2))  # [L]
    return mass.view(n, bs).sum(dim=1)


def sparq_scores(
    query: torch.Tensor,
    keys: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    channels: int,
    impl: Impl = "auto",
    *,
    per_head: bool = False,
) -> torch.Tensor:
    """Approximate attention mass each block gets from each row's decode query, float32 ``[R, W]`` (``-inf`` past
    a row's blocks), reading only ``channels`` of the ``head_dim`` key components per KV head (steps 1-2 of SparQ
    Attention: ``ucm.kernels.sparq``'s ``sparq_query`` (torch path), then ``sparq_block_lse``): per query head, the
    softmax over the request's ``seq_len`` keys, summed over each block's tokens and over the query heads.

    Args:
        query: ``[R, num_heads, head_dim]``, row ``r``'s query at position ``seq_lens[r] - 1``.
        keys: paged keys, plain or tiled (``ucm.kernels.paged_keys``).
        block_table: int ``[R, W]`` the requests' blocks in token order; seq_lens: int ``[R]`` tokens per row.
        scale: the attention's softmax scale; channels: key components read per KV head (``head_dim``: exact).
        impl: ``sparq_block_lse``'s: ``"auto"``, ``"triton"``, ``"cpu"``, ``"torch"`` or ``"reference"`` (the
            kernel's test oracle).
        per_head: return the per-head scores before the sum instead, float32 ``[R, num_heads, W]``: each block's
            log-sum-exp of the head's logits (the log of its mass up to a per-head constant).

    Raises:
        ValueError: bad shapes, dtypes or devices, or an unknown ``impl`` (from ``sparq_block_lse``).
    """
    q_r, idx = sparq_query(query, key_geometry(keys)[1], channels, scale, impl="torch")
    lse = sparq_block_lse(q_r, idx, keys, block_table, seq_lens, impl=impl)
    return lse if per_head else aggregate_scores(lse, 1.0)  # softmax over blocks of the per-block log-sum-exp


def sparq_mass(
    query: torch.Tensor, keys: torch.Tensor, block_ids: torch.Tensor, seq_len: int, scale: float, channels: int
) -> torch.Tensor:
    """:func:`sparq_scores` of one row: float32 ``[n]`` for ``query`` ``[num_heads, head_dim]`` at position
    ``seq_len - 1`` and its blocks ``block_ids`` int ``[n]``, ``n = ceil(seq_len / block_size)`` (torch path)."""
    lens = torch.tensor([seq_len], device=query.device)
    return sparq_scores(query[None], keys, block_ids[None], lens, scale, channels, impl="torch")[0]


def _drop_entries_of(summaries: AttentionMass, block_ids: torch.Tensor, first: int) -> None:
    """Drop the entries under ``block_ids`` that belong to the request whose first block is ``first``."""
    for b in block_ids.tolist():
        entry = summaries.entries.get(int(b))
        if entry is not None and entry[0] == first:
            del summaries.entries[int(b)]


def sparq_select(
    query: torch.Tensor,
    keys: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    cfg: GSAConfig,
    words: tuple[np.ndarray, np.uint32] | None = None,
) -> Selection:
    """GSA's whole ``block_scoring: sparq`` selection as numba calls (CPU, bf16/fp32 keys in vLLM's CPU layouts:
    ``ucm.kernels.sparq.cpu_applies``): the per-head scores of :func:`sparq_scores` (``ucm.kernels.sparq.cpu``'s
    ``sparq_lse``) then ``ucm.sparse.selection``'s ``keep_blocks`` (CPU path) for the rows of at least
    ``min_blocks`` blocks (the others keep every block). Same blocks as the torch path up to fp32 rounding.

    Args:
        query: ``[R, num_heads, head_dim]`` decode queries (any float dtype); keys: paged keys as in
            :func:`sparq_scores`; block_table: int ``[R, W]``; seq_lens: int ``[R]``; scale: softmax scale;
            cfg: GSA's config; words: ``ucm.kernels.sparq.key_words(keys)`` if the caller keeps it.

    Raises:
        ValueError: a selecting row names a block outside the cache.
    """
    nb, h, bs, _ = key_geometry(keys)
    strides, tile_tokens, tile_dims = key_tiling(keys)
    key_storage, shift = key_words(keys) if words is None else words
    query_np, table_np, lens_np = query.float().contiguous().numpy(), block_table.contiguous().numpy(), seq_lens.numpy()
    status, lse, score_row = sparq_lse(
        query_np,
        h,
        cfg.score_channels,
        scale,
        key_storage,
        shift,
        strides,
        tile_tokens,
        tile_dims,
        nb,
        tile_blocks(bs),
        table_np,
        lens_np.astype(np.int64, copy=False),
        bs,
        cfg.min_blocks,
    )
    if status:
        raise_bad_block_ids(block_table, seq_lens, bs, nb)
    return keep_blocks_numpy(lse, score_row, 1.0, block_table, seq_lens, bs, cfg)


class GSA(SparseMethod):
    """GSA block selection (see the module doc).

    Args:
        cfg: ``ucm_sparse_config.GSA``.
        impl: kernel implementation for summaries, scores and the selection, in ``ucm.kernels.utils``' vocabulary:
            ``"auto"`` (Triton on CUDA; on CPU the numba paths of the ``sparq`` scoring and of the selection where
            they apply, torch otherwise), ``"triton"``, ``"cpu"`` (the numba paths; the ``key_bounds`` kernels then
            run their torch code), ``"torch"``, or ``"reference"`` (the kernels' test oracles; the selection runs
            its torch code).

    Raises:
        ValueError: ``impl`` is not one of ``ucm.kernels.utils.IMPLS``.
    """

    name = "GSA"

    def __init__(self, cfg: GSAConfig, impl: Impl = "auto") -> None:
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {list(IMPLS)}, got {impl!r}")
        self.cfg = cfg
        self.impl: Impl = impl
        self._bounds_impl: Impl = "torch" if impl in ("cpu", "reference") else impl  # block_summaries' impl

    def new_summaries(self, num_blocks: int, num_kv_heads: int, head_dim: int, device: torch.device) -> BlockSummaries:
        """An all-stale table for ``num_blocks`` blocks: :class:`KeyBounds`, :class:`AttentionMass` with
        ``block_scoring: attention``, :class:`KeyChannels` with ``block_scoring: sparq``."""
        if self.cfg.block_scoring == "attention":
            return AttentionMass(num_blocks, device)
        if self.cfg.block_scoring == "sparq":
            return KeyChannels(num_blocks, device)
        return KeyBounds(num_blocks, num_kv_heads, head_dim, device, self._bounds_impl)

    def observe(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        summaries: BlockSummaries,
        block_table: torch.Tensor,
        seq_len: int,
        scale: float,
    ) -> None:
        """With ``block_scoring: attention``, score the request's blocks by the attention of its last
        ``observation_window`` queries of this prefill step (see :meth:`SparseMethod.observe`); else nothing."""
        if not isinstance(summaries, AttentionMass):
            return
        block_size = key_geometry(keys)[2]
        n = -(-seq_len // block_size)
        if n < self.cfg.min_blocks:  # stays dense
            return
        ids = block_table[:n]
        window = query[-self.cfg.observation_window :]
        first = int(ids[0])
        _drop_entries_of(summaries, ids[:-1], first)  # an earlier chunk's
        summaries.entries[int(ids[-1])] = (first, attention_mass(window, keys, ids, seq_len, scale))

    def select(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        summaries: BlockSummaries,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> Selection:
        """See :meth:`SparseMethod.select`. Rows with fewer than ``min_blocks`` blocks keep all of them.

        Raises:
            TypeError: ``summaries`` is not a :class:`KeyBounds`, :class:`AttentionMass` or :class:`KeyChannels`.
        """
        if not isinstance(summaries, (KeyBounds, AttentionMass, KeyChannels)):
            raise TypeError(
                f"GSA needs KeyBounds, AttentionMass or KeyChannels summaries, got {type(summaries).__name__}"
            )
        if isinstance(summaries, KeyChannels) and self._cpu_select(block_table) and cpu_applies(keys):
            return sparq_select(query, keys, block_table, seq_lens, scale, self.cfg, summaries.key_words(keys))
        block_size = key_geometry(keys)[2]
        n = torch.div(seq_lens.long() + block_size - 1, block_size, rounding_mode="floor")
        sparse = n >= self.cfg.min_blocks
        rows = sparse.nonzero().flatten()
        if rows.numel() == 0:
            keep = torch.ones(block_table.shape, dtype=torch.bool, device=block_table.device)
            return compact_block_table(block_table, seq_lens, keep, block_size)
        table, nb, lens = block_table[rows], n[rows], seq_lens[rows].long()
        if isinstance(summaries, AttentionMass):
            head, temperature = self._measured_scores(query[rows], keys, summaries, table, nb, lens, scale), None
        elif isinstance(summaries, KeyChannels):
            channels = self.cfg.score_channels
            head = sparq_scores(query[rows], keys, table, lens, scale, channels, self.impl, per_head=True)
            temperature = 1.0
        else:
            cols = torch.arange(table.shape[1], device=table.device)[None, :]
            inside = cols < nb[:, None]
            counts = torch.where(cols == (nb - 1)[:, None], lens[:, None] - (nb - 1)[:, None] * block_size, block_size)
            summaries.refresh(keys, table[inside].long(), counts[inside])
            scores_impl: Impl = "reference" if self.impl == "reference" else self._bounds_impl
            head = block_scores(query[rows], summaries.kmin, summaries.kmax, table, nb, impl=scores_impl)
            temperature = scale
        if temperature is None:  # measured block scores: no per-head softmax, the torch rule
            keep = torch.ones(block_table.shape, dtype=torch.bool, device=block_table.device)
            keep[rows] = keep_mask(head, nb, self.cfg)
            return compact_block_table(block_table, seq_lens, keep, block_size)
        select_impl: Impl = "cpu" if self._cpu_select(block_table) else "torch"
        return keep_blocks(head, temperature, rows, block_table, seq_lens, block_size, self.cfg, impl=select_impl)

    def warm_up(self, dtype: torch.dtype, device: torch.device, layout: KVLayout) -> None:
        """With ``sparq`` on the numba path: one selection on a tiny synthetic cache of ``dtype`` in ``layout`` (a
        CPU layout) with an int32 block table (vLLM's), which compiles the kernels for exactly the engine's argument
        types, or loads them from numba's on-disk cache (seconds for a fresh install, much less after: the engine
        logs the time, see "Cost" under sparse attention in benchmarks/RESULTS.md). The kernels take CPU_ATTN and
        CPU_ATTN_AMX keys with the same argument types, so either layout's warm-up covers both.

        Raises:
            ValueError: ``layout`` is CPU_ATTN_AMX and ``dtype`` is not 2 bytes wide (from ``paged_keys``).
        """
        if self.cfg.block_scoring != "sparq" or self.impl not in ("auto", "cpu") or device.type != "cpu":
            return
        if layout not in (KVLayout.CPU_ATTN, KVLayout.CPU_ATTN_AMX):
            return  # no numba path for the other layouts
        num_blocks, h, d, bs = self.cfg.min_blocks + 1, 1, 32, 32  # 32: the least CPU_ATTN_AMX allows
        keys = paged_keys(torch.zeros((num_blocks, h, bs, 2 * d), dtype=dtype), layout)
        if not cpu_applies(keys):
            return
        table = torch.arange(num_blocks, dtype=torch.int32)[None]
        lens = torch.tensor([num_blocks * bs], dtype=torch.int32)
        summaries = self.new_summaries(num_blocks, h, d, device)
        self.select(torch.ones((1, h, d), dtype=dtype), keys, summaries, table, lens, d**-0.5)

    def _cpu_select(self, block_table: torch.Tensor) -> bool:
        """Whether the selection runs as one numba call (``keep_blocks``' CPU path): ``impl`` ``"auto"`` or
        ``"cpu"`` on CPU."""
        return self.impl in ("auto", "cpu") and block_table.device.type == "cpu"

    @staticmethod
    def _measured_scores(
        query: torch.Tensor,
        keys: torch.Tensor,
        summaries: AttentionMass,
        table: torch.Tensor,
        nb: torch.Tensor,
        lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Scores ``[R, W]`` from each row's entry (blocks past the entry's: 0; only the forced last block can
        be); a row without a valid entry gets one from its current query."""
        scores = torch.full(table.shape, float("-inf"), dtype=torch.float32, device=table.device)
        for r in range(table.shape[0]):
            n = int(nb[r])
            ids = table[r, :n]
            last, first = int(ids[-1]), int(ids[0])
            entry = summaries.entries.get(last)
            if entry is None or entry[0] != first or entry[1].numel() > n:
                entry = (first, attention_mass(query[r][None], keys, ids, int(lens[r]), scale))
                _drop_entries_of(summaries, ids[-2:-1], first)  # the request's previous last block
                summaries.entries[last] = entry
            mass = entry[1]
            scores[r, :n] = 0.0
            scores[r, : mass.numel()] = mass
        return scores


def select_reference(
    query: torch.Tensor,
    keys: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    cfg: GSAConfig,
) -> list[list[int]]:
    """Test oracle: for each row, the kept vLLM block ids in token order, computed one row at a time from the keys
    (no summary table, no kernels): bounds by ``amin``/``amax``, per-head softmax, sum, sort."""
    _, h, block_size, _ = key_geometry(keys)
    out: list[list[int]] = []
    for r in range(block_table.shape[0]):
        length = int(seq_lens[r])
        n = math.ceil(length / block_size)
        ids = [int(b) for b in block_table[r, :n]]
        if n < cfg.min_blocks:
            out.append(ids)
            continue
        blocks = block_keys(keys, ids)  # [n, H, bs, D]
        group = query.shape[1] // h
        mass = torch.zeros(n, dtype=torch.float32)
        for j in range(query.shape[1]):
            q = query[r, j].float()
            ub = torch.empty(n, dtype=torch.float32)
            for w in range(n):
                c = block_size if w < n - 1 else length - (n - 1) * block_size
                k = blocks[w, j // group, :c].float()  # [c, D]
                ub[w] = torch.maximum(q * k.amin(0), q * k.amax(0)).sum()
            mass += torch.softmax(ub * scale, dim=0)
        k_keep = min(max(math.ceil(n * cfg.sparse_ratio - 1e-9), cfg.init_window_sz + cfg.local_window_sz), n)
        forced = set(range(min(cfg.init_window_sz, n))) | set(range(max(0, n - cfg.local_window_sz), n))
        others = sorted((w for w in range(n) if w not in forced), key=lambda w: (-float(mass[w]), w))
        chosen = sorted(forced | set(others[: k_keep - len(forced)]))
        out.append([ids[w] for w in chosen])
    return out
