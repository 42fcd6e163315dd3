"""GSA's keep rule on CPU (``impl="cpu"``): one call of the numba kernel ``ucm.sparse.selection.cpu_numba`` per
step and layer, in place of about 40 small torch ops, whatever the context length. Same rules and the same output
layout as the torch path (the softmax's fp32 rounding differs, so blocks whose scores tie to rounding may be ranked
differently). numba is imported on the first call.
"""

from __future__ import annotations

import numpy as np
import torch

from ucm.config import GSAConfig
from ucm.sparse.base import Selection


def keep_blocks_numpy(
    head_scores: np.ndarray,
    score_row: np.ndarray,
    temperature: float,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    cfg: GSAConfig,
) -> Selection:
    """:func:`ucm.sparse.selection.keep_blocks` in one numba call, on numpy scores: ``head_scores`` float32 ``[S, HQ,
    W]``, ``score_row`` int64 ``[R]`` each row's index in it or -1 (a row that keeps every block); the other
    arguments as there (CPU tensors)."""
    from ucm.sparse.selection.cpu_numba import keep_blocks_kernel  # numba is slow to import: on the first call

    table = torch.empty_like(block_table)
    counts = torch.empty((3, block_table.shape[0]), dtype=torch.int64)  # lengths, kept, num_blocks
    keep_blocks_kernel(
        head_scores,
        score_row,
        float(temperature),
        block_table.contiguous().numpy(),
        seq_lens.long().numpy(),
        block_size,
        cfg.sparse_ratio,
        cfg.init_window_sz,
        cfg.local_window_sz,
        cfg.min_blocks,
        table.numpy(),
        counts[0].numpy(),
        counts[1].numpy(),
        counts[2].numpy(),
    )
    return Selection(block_table=table, seq_lens=counts[0].to(seq_lens.dtype), kept=counts[1], num_blocks=counts[2])
