"""CacheBlend (Yao et al., EuroSys 2025, arXiv 2405.16444): re-aligning stored keys to new positions
(``rope_delta_``), the per-token deviation of recomputed from stored KV (``kv_deviation``), the attention a
prompt's question pays to each token (``question_attention``) and the tokens to recompute (``select_recompute``),
on one layer's K/V of a run of tokens, ``[num_tokens, num_kv_heads, head_dim]``.

Modules, as in flash-linear-attention's ``fla/ops/<op>/``: ``ops`` (the public ops: validation and dispatch by
``impl``), ``naive`` (the references, the test oracles), ``triton`` (the Triton kernels), ``torch`` (the torch code,
also the CPU path).
"""

from ucm.kernels.blend.naive import (
    kv_deviation_reference,
    question_attention_reference,
    recompute_count,
    rope_delta_reference,
    select_recompute_reference,
)
from ucm.kernels.blend.ops import kv_deviation, question_attention, rope_delta_, select_recompute

__all__ = [
    "kv_deviation",
    "kv_deviation_reference",
    "question_attention",
    "question_attention_reference",
    "recompute_count",
    "rope_delta_",
    "rope_delta_reference",
    "select_recompute",
    "select_recompute_reference",
]
