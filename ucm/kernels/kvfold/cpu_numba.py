"""numba kernels of the bf16 planes' CPU fast path (``ucm.kernels.kvfold.cpu``; imported on first use: numba is slow
to load).

Single-threaded element loops that LLVM vectorizes (many times faster than numpy's multi-pass version), compiled
with ``nogil=True`` so that the Compress stage's threads run them in parallel. Not ``parallel=True``: numba's
threading layer changes the calling thread's OpenMP state, which vLLM's CPU attention does not tolerate (see
``ucm.kernels.block_copy.cpu_numba``).
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(nogil=True, cache=True)
def split_planes(words: np.ndarray, exp: np.ndarray, sm: np.ndarray) -> None:  # pragma: no cover - compiled
    """``words``: uint16 ``[n]`` -> ``exp``, ``sm``: uint8 ``[n]`` (see ``ucm.kernels.kvfold.ops``)."""
    for i in range(words.shape[0]):
        v = words[i]
        exp[i] = np.uint8((v >> np.uint16(7)) & np.uint16(0xFF))
        sm[i] = np.uint8(((v >> np.uint16(8)) & np.uint16(0x80)) | (v & np.uint16(0x7F)))


@numba.njit(nogil=True, cache=True)
def merge_planes(exp: np.ndarray, sm: np.ndarray, words: np.ndarray) -> None:  # pragma: no cover - compiled
    """``exp``, ``sm``: uint8 ``[n]`` -> ``words``: uint16 ``[n]`` (see ``ucm.kernels.kvfold.ops``)."""
    for i in range(exp.shape[0]):
        s = np.uint16(sm[i])
        words[i] = (np.uint16(exp[i]) << np.uint16(7)) | ((s & np.uint16(0x80)) << np.uint16(8)) | (s & np.uint16(0x7F))
