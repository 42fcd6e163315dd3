"""SparQ (Ribar et al. 2024), steps 1-2, for GSA's ``sparq`` scoring: the query step (``sparq_query``) and the
per-block log-sum-exp of the logits approximated from a few key components (``sparq_block_lse``).

Modules, as in flash-linear-attention's ``fla/ops/<op>/``: ``ops`` (the public ops: validation and dispatch by
``impl``), ``naive`` (the references, the test oracles), ``triton`` (the Triton kernel), ``cpu`` (the CPU fast path)
and ``cpu_numba`` (its numba kernels, imported on first use), ``torch`` (torch ops).
"""

from ucm.kernels.sparq.cpu import cpu_applies, key_words
from ucm.kernels.sparq.naive import sparq_block_lse_reference, sparq_query_reference
from ucm.kernels.sparq.ops import sparq_block_lse, sparq_query

__all__ = [
    "cpu_applies",
    "key_words",
    "sparq_block_lse",
    "sparq_block_lse_reference",
    "sparq_query",
    "sparq_query_reference",
]
