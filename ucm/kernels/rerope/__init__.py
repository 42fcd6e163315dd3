"""ReRoPE (rectified rotary position embedding): the references that are the test oracles (``naive``) and attention
over vLLM's paged CPU KV by re-rotating keys on the fly (``torch``: the CPU path); the attention method that uses
them comes with issue 32's plugin."""

from ucm.kernels.rerope.naive import rectified_distance, rerope_attention_reference, rope_reference
from ucm.kernels.rerope.torch import rerope_paged_attention

__all__ = ["rectified_distance", "rerope_attention_reference", "rerope_paged_attention", "rope_reference"]
