"""numba kernel of GSA's keep rule on CPU (``ucm.sparse.selection.cpu``; imported on first use: numba is slow to
load).

:func:`keep_blocks_kernel` does in one call what :func:`ucm.sparse.selection.aggregate_scores`,
:func:`ucm.sparse.selection.keep_mask` and :func:`ucm.sparse.base.compact_block_table` do in about 40 small torch ops:
per row, the per-head softmax over blocks summed over the heads, the forced sink and recent blocks, the top-k of the
others by a stable sort (ties go to the earlier block), and the compacted block table and length. Same rules and the
same output layout as the torch functions; the softmax's fp32 rounding differs, so blocks whose scores tie to
rounding may be ranked differently. With ``ucm.kernels.sparq``'s CPU kernels it makes GSA's whole ``sparq``
selection of a step three compiled calls per layer (``ucm.sparse.gsa.sparq_select``).

Single-threaded, ``nogil=True`` (see ``ucm.kernels.block_copy.cpu_numba`` for why not ``parallel=True``).
"""

from __future__ import annotations

import math

import numba
import numpy as np


@numba.njit(nogil=True, cache=True)
def keep_blocks_kernel(  # pragma: no cover - compiled
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
