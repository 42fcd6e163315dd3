"""ReRoPE (rectified rotary position embedding): the references that are the test oracles (``naive``), attention
over vLLM's paged CPU KV by re-rotating keys on the fly (``torch``: the CPU path) and the same over FlashAttention's
paged KV in Triton (``triton``); the attention method that uses them comes with issue 32's plugin."""

from ucm.kernels.rerope.naive import rectified_distance, rerope_attention_reference, rope_reference
from ucm.kernels.rerope.torch import rerope_paged_attention
from ucm.kernels.rerope.triton import rerope_paged_attention_triton

__all__ = [
    "rectified_distance",
    "rerope_attention_reference",
    "rerope_paged_attention",
    "rerope_paged_attention_triton",
    "rope_reference",
]
