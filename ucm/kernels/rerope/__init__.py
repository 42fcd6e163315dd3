"""ReRoPE (rectified rotary position embedding): the references that are its test oracles (``naive``); the
kernels and the attention method that use them come with issue 32's plugin."""

from ucm.kernels.rerope.naive import rectified_distance, rerope_attention_reference, rope_reference

__all__ = ["rectified_distance", "rerope_attention_reference", "rope_reference"]
