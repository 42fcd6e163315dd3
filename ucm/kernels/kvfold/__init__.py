"""KVfold: the codec kernels of ``ucm.store.kvfold``: bf16 planes (lossless: exponent plane + sign/mantissa plane)
and int8 groups (lossy fixed rate: int8 values, one bf16 scale per group).

Modules, as in flash-linear-attention's ``fla/ops/<op>/``: ``ops`` (the public ops: validation and dispatch by
``impl``, and both formats), ``naive`` (the references, the test oracles), ``triton`` (the Triton kernels), ``cpu``
(the CPU fast path) and ``cpu_numba`` (its numba kernels, imported on first use), ``torch`` (torch arithmetic).
"""

from ucm.kernels.kvfold.cpu import merge_planes_np, split_planes_np
from ucm.kernels.kvfold.naive import (
    dequantize_int8_groups_reference,
    merge_bf16_planes_reference,
    quantize_int8_groups_reference,
    split_bf16_planes_reference,
)
from ucm.kernels.kvfold.ops import (
    all_finite,
    dequantize_int8_groups,
    merge_bf16_planes,
    quantize_int8_groups,
    split_bf16_planes,
)

__all__ = [
    "all_finite",
    "dequantize_int8_groups",
    "dequantize_int8_groups_reference",
    "merge_bf16_planes",
    "merge_bf16_planes_reference",
    "merge_planes_np",
    "quantize_int8_groups",
    "quantize_int8_groups_reference",
    "split_bf16_planes",
    "split_bf16_planes_reference",
    "split_planes_np",
]
