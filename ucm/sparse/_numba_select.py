"""numba fast path of GSA's block selection on CPU (imported on first use: numba is slow to load).

:func:`sparq_lse` then :func:`keep_blocks` are the whole ``block_scoring: sparq`` selection of a decode step:
SparQ's query step (``ucm.kernels._numba_sparq.sparq_query``), the per-block log-sum-exps read from the paged keys
(``ucm.kernels._numba_sparq.block_lse``), then the top-k and compaction: three compiled calls per layer instead of
~60 torch ops.

:func:`keep_blocks` does in one call what :func:`ucm.sparse.gsa.aggregate_scores`, :func:`ucm.sparse.gsa.keep_mask`
and :func:`ucm.sparse.base.compact_block_table` do in about 40 small torch ops (~0.7 ms a layer on this repo's 2-core
AMD EPYC, 1 thread, whatever the context length): per row, the per-head softmax over blocks summed over the heads,
the forced sink and recent blocks, the top-k of the others by a stable sort (ties go to the earlier block), and the
compacted block table and length. Same rules and the same output layout as the torch functions (the test oracles);
the softmax's fp32 rounding differs, so blocks whose scores tie to rounding may be ranked differently.

Single-threaded, ``nogil=True`` (see ``ucm.kernels._numba_copy`` for why not ``parallel=True``).
"""

from __future__ import annotations

import math

import numba
import numpy as np

from ucm.kernels._numba_sparq import block_lse, sparq_query


@numba.njit(nogil=True, cache=True)
def keep_blocks(  # pragma: no cover - compiled
    head_scores: np.ndarray,
    score_row: np.ndarray,
    temperature: float,
    block_table: np.ndarray,
    seq_lens: np.ndarray,
    block_size: int,
    sparse_ratio: float,
    init_window: int,
    local_window: int,
    min_blocks: int,
    out_table: np.ndarray,
    out_lens: np.ndarray,
    kept: np.ndarray,
    num_blocks: np.ndarray,
) -> None:
    """Select each row's blocks (GSA's rule: ``ucm.sparse.gsa``, module doc, steps 2-3) and compact its table.

    Args:
        head_scores: float32 ``[S, HQ, W]``: per query head, each block's score in the log domain (the per-block
            log-sum-exp of ``sparq``, Quest's bound of ``key_bounds``), for the rows that select.
        score_row: int64 ``[R]``: row ``r``'s index into ``head_scores``, or ``-1`` for a row that keeps every block.
        temperature: multiplies ``head_scores`` before the softmax.
        block_table: int32/int64 ``[R, W]``; seq_lens: int64 ``[R]`` tokens per row; block_size: tokens per block.
        sparse_ratio, init_window, local_window, min_blocks: ``GSAConfig``'s ``sparse_ratio``, ``init_window_sz``,
            ``local_window_sz``, ``min_blocks``.
        out_table: like ``block_table``: each row's kept columns first, in order, then the others, in order.
        out_lens: int64 ``[R]`` tokens attended; kept, num_blocks: int64 ``[R]`` blocks kept and blocks in the row.
    """
    nr, width = block_table.shape
    hq = head_scores.shape[1]
    temp = np.float32(temperature)
    score = np.empty(width, np.float32)
    p = np.empty(width, np.float32)
    keep = np.empty(width, np.bool_)
    for r in range(nr):
        n = min((seq_lens[r] + block_size - 1) // block_size, width)
        num_blocks[r] = n
        s = score_row[r]
        if n < min_blocks or s < 0:
            keep[:] = False
            keep[:n] = True
            k = n
        else:
            k = min(max(math.ceil(n * sparse_ratio - 1e-9), init_window + local_window), n)
            score[:n] = 0.0
            for j in range(hq):
                x = head_scores[s, j]
                top = x[0] * temp
                for w in range(1, n):
                    top = max(top, x[w] * temp)
                total = np.float32(0.0)
                for w in range(n):
                    p[w] = np.exp(x[w] * temp - top)
                    total += p[w]
                for w in range(n):
                    score[w] += p[w] / total
            for w in range(n):
                if w < init_window or w >= n - local_window:
                    score[w] = np.inf
            order = np.argsort(-score[:n], kind="mergesort")  # stable: ties keep the earlier block first
            keep[:] = False
            for i in range(k):
                keep[order[i]] = True
        pos = 0
        for w in range(width):
            if keep[w]:
                out_table[r, pos] = block_table[r, w]
                pos += 1
        for w in range(width):
            if not keep[w]:
                out_table[r, pos] = block_table[r, w]
                pos += 1
        kept[r] = k
        out_lens[r] = seq_lens[r] - (n - k) * block_size


def sparq_lse(
    query: np.ndarray,
    num_kv_heads: int,
    score_channels: int,
    scale: float,
    words: np.ndarray,
    shift: np.uint32,
    strides: tuple[int, int, int, int, int, int],
    tile_tokens: int,
    tile_dims: int,
    cache_blocks: int,
    tile_blocks: int,
    block_table: np.ndarray,
    seq_lens: np.ndarray,
    block_size: int,
    min_blocks: int,
) -> tuple[int, np.ndarray, np.ndarray]:
    """The per-head block scores of GSA's ``sparq`` selection for the rows of at least ``min_blocks`` blocks, in two
    compiled calls and a few numpy ops (one compiled function calling the others took numba about twice as long to
    compile: ~20 s instead of ~10 s on this repo's machine with an empty cache).

    Args:
        query: float32 ``[R, HQ, D]``: each row's decode query.
        num_kv_heads, score_channels, scale: as ``ucm.sparse.gsa.sparq_query``.
        words, shift, cache_blocks, tile_blocks: the paged keys, as ``block_lse``; strides, tile_tokens,
            tile_dims: the six strides (in words) and the tile sizes of the keys' tiled form
            (``ucm.kernels.paged_keys.key_tiling``), as ``block_lse``'s ``s0`` .. ``s5``, ``tile_tokens``,
            ``tile_dims``.
        block_table: int ``[R, W]``; seq_lens: int64 ``[R]``; block_size: tokens per block; min_blocks: GSA's.

    Returns:
        ``(status, lse, score_row)``: status 0, or -1 when a selecting row names a block outside ``[0,
        cache_blocks)``; lse float32 ``[S, HQ, W]`` the selecting rows' per-block log-sum-exps; score_row int64
        ``[R]`` each row's index in ``lse`` or -1: the inputs of :func:`keep_blocks`.
    """
    selecting = np.flatnonzero((seq_lens + block_size - 1) // block_size >= min_blocks)
    score_row = np.full(query.shape[0], -1, np.int64)
    score_row[selecting] = np.arange(selecting.size)
    if selecting.size == query.shape[0]:
        rows_query, table, lens = query, block_table, seq_lens
    else:
        rows_query, table, lens = query[selecting], block_table[selecting], seq_lens[selecting]
    nc = min(max(score_channels, 1), query.shape[2])
    q_r = np.empty((table.shape[0], query.shape[1], nc), np.float32)
    channels = np.empty((table.shape[0], num_kv_heads, nc), np.int64)
    sparq_query(rows_query, num_kv_heads, scale, q_r, channels)
    lse = np.full((table.shape[0], query.shape[1], table.shape[1]), -np.inf, np.float32)
    s0, s1, s2, s3, s4, s5 = strides
    status = block_lse(
        q_r,
        channels,
        words,
        shift,
        s0,
        s1,
        s2,
        s3,
        s4,
        s5,
        tile_tokens,
        tile_dims,
        table,
        lens,
        block_size,
        cache_blocks,
        tile_blocks,
        lse,
    )
    return status, lse, score_row
