"""GSA's keep rule: which blocks a row keeps given per-head block scores, and its compacted block table
(``keep_blocks``), with the torch pieces the other scorings reuse (``kept_blocks``, ``aggregate_scores``,
``keep_mask``).

Modules as in ``ucm.kernels``' packages: ``ops`` (the op: dispatch by ``impl``), ``naive`` (the rule one row at a
time, the test oracle), ``cpu`` (one numba call) and ``cpu_numba`` (its kernel, imported on first use), ``torch``
(torch ops).
"""

from ucm.sparse.selection.naive import keep_mask_reference
from ucm.sparse.selection.ops import keep_blocks
from ucm.sparse.selection.torch import aggregate_scores, keep_mask, kept_blocks

__all__ = ["aggregate_scores", "keep_blocks", "keep_mask", "keep_mask_reference", "kept_blocks"]
