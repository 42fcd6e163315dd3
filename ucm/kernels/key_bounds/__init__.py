"""Key bounds (Quest): per-block key min/max read from the paged cache (``block_summaries``) and the upper bounds
of ``q . k`` per block they give (``block_scores``), for GSA's ``key_bounds`` scoring.

Modules, as in flash-linear-attention's ``fla/ops/<op>/``: ``ops`` (the public ops: validation and dispatch by
``impl``), ``naive`` (the references, the test oracles), ``triton`` (the Triton kernels), ``torch`` (the torch code,
also the CPU path).
"""

from ucm.kernels.key_bounds.naive import block_scores_reference, block_summaries_reference
from ucm.kernels.key_bounds.ops import block_scores, block_summaries

__all__ = ["block_scores", "block_scores_reference", "block_summaries", "block_summaries_reference"]
