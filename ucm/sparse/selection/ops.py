"""GSA's keep rule as one op (:func:`keep_blocks`): from per-head block scores to the compacted block table of each
row (``ucm.sparse.gsa``'s module doc, steps 2-3), dispatched by ``impl`` (the vocabulary of ``ucm.kernels.utils``):

- ``"cpu"``: one numba call, rule and compaction (``selection.cpu``, ``selection.cpu_numba``); the default on CPU.
- ``"torch"``: ``compact_block_table(keep_mask(aggregate_scores(...)))`` (``selection.torch``), any device; the
  default elsewhere (no Triton kernel: a handful of small torch ops).
- ``"reference"``: the rule one row at a time (``selection.naive``, the test oracle), then ``compact_block_table``.
"""

from __future__ import annotations

import torch

from ucm.config import GSAConfig
from ucm.kernels.utils import Impl, resolve_impl
from ucm.sparse.base import Selection, compact_block_table
from ucm.sparse.selection.cpu import keep_blocks_numpy
from ucm.sparse.selection.naive import keep_mask_reference
from ucm.sparse.selection.torch import aggregate_scores, keep_mask


def keep_blocks(
    head_scores: torch.Tensor,
    temperature: float,
    rows: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    cfg: GSAConfig,
    *,
    impl: Impl = "auto",
) -> Selection:
    """GSA's selection from per-head scores for ``rows`` (the others keep every block): per row, the per-head softmax
    over blocks of ``temperature * head_scores`` summed over heads, then ``keep_mask``'s rule (sink and recent
    windows forced, the best others up to ``kept_blocks``; ties go to the earlier block) and the compacted table.
    The implementations agree up to fp32 rounding of the softmax (blocks whose scores tie to rounding may be ranked
    differently).

    Args:
        head_scores: float32 ``[len(rows), num_heads, W]`` log-domain scores of the selecting rows' blocks (``-inf``
            past a row's blocks).
        temperature: multiplies ``head_scores`` before the per-head softmax over blocks.
        rows: int64 ``[S]`` the selecting rows; block_table: int ``[R, W]``; seq_lens: int ``[R]`` tokens per row.
        block_size: tokens per block; cfg: GSA's config.
        impl: ``"auto"``, ``"cpu"``, ``"torch"`` or ``"reference"`` (see the module doc).

    Returns:
        The :class:`~ucm.sparse.base.Selection`: each row's kept blocks first (in order), then the others.

    Raises:
        ValueError: unknown ``impl``, one this op lacks (``"triton"``), or ``"cpu"`` for non-CPU tensors.
    """
    which = resolve_impl(impl, block_table.device, available=("cpu", "torch", "reference"), op="keep_blocks")
    if which == "cpu":
        score_row = torch.full((block_table.shape[0],), -1, dtype=torch.int64)
        score_row[rows] = torch.arange(rows.numel())
        head = head_scores.float().contiguous().numpy()
        return keep_blocks_numpy(head, score_row.numpy(), temperature, block_table, seq_lens, block_size, cfg)
    n = torch.div(seq_lens.long() + block_size - 1, block_size, rounding_mode="floor")
    keep = torch.ones(block_table.shape, dtype=torch.bool, device=block_table.device)
    if which == "reference":
        keep[rows] = keep_mask_reference(head_scores, temperature, n[rows], cfg).to(keep.device)
    else:
        keep[rows] = keep_mask(aggregate_scores(head_scores, temperature), n[rows], cfg)
    return compact_block_table(block_table, seq_lens, keep, block_size)
