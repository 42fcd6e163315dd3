"""Training-free sparse attention methods on plain torch tensors (no vLLM import).

``base`` says what a method provides (per-block summaries, a per-request, per-layer block selection at decode, its
config) and holds the shared bookkeeping; ``gsa`` is the first method (block scores from SparQ, Quest's key bounds
or measured attention; top-k blocks), ``selection`` its keep rule (torch, numba and reference implementations); its
kernels are in ``ucm.kernels.sparq`` and ``ucm.kernels.key_bounds``. The vLLM attention-backend wrapper that applies
a method lives in ``ucm.integration.vllm.sparse_backend``.
"""

from __future__ import annotations

from ucm.config import UcmSparseConfig
from ucm.kernels.utils import Impl
from ucm.sparse.base import BlockSummaries, Selection, SparseMethod, compact_block_table, invalidate_blocks
from ucm.sparse.gsa import GSA, KeyBounds

__all__ = [
    "GSA",
    "BlockSummaries",
    "KeyBounds",
    "Selection",
    "SparseMethod",
    "compact_block_table",
    "invalidate_blocks",
    "make_method",
]


def make_method(cfg: UcmSparseConfig | None, impl: Impl = "auto") -> SparseMethod | None:
    """The sparse method ``ucm_sparse_config`` switches on, or ``None`` (dense attention)."""
    if cfg is None or cfg.GSA is None:
        return None
    return GSA(cfg.GSA, impl=impl)
