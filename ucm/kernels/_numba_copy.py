"""numba kernels of the CPU_ATTN fast path for ``ucm.kernels._block_copy`` (imported on first use: numba is slow
to load).

Every kernel takes the layer tensors as an ``int64`` array of addresses plus each layer's length, and the staging
buffer as an address and length, all in *words*: the unit the caller chose (8-byte ``uint64`` where every size and
address allows, else the element's own integer type); ``like`` is an empty array of that word type, so numba
compiles one version per word type. Each call does the ``(block, layer, head)`` work items ``start:stop`` with the
GIL released; ``_block_copy`` runs slices of one copy on plain Python threads. numba's own parallel layers are not
used: they change the calling thread's OpenMP state, and vLLM's CPU attention aborts when its OpenMP thread count
changes between scheduling and the kernel (``Check failed: thread_num``, seen in tests/integration); and with
``parallel=True``, a slice assignment into a ``carray`` inside ``prange`` was dropped by numba 0.65's parfor pass
(a scatter wrote nothing).

CPU_ATTN's K is stored transposed ``[head_dim, block_size]`` per block and head; canonical wants ``[block_size,
head_dim]``. For 2-byte dtypes (bf16, fp16), ``cpu_attn_words`` moves 4x4 element tiles as four ``uint64`` words
transposed with shifts and masks (a tile transpose is its own inverse, so scatter uses the same code); on the
SmolLM2 shape this is ~4x faster than an element loop, which numba/LLVM do not vectorize.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic


@intrinsic
def _pointer(typingctx: Any, addr: Any, like: Any) -> Any:
    """``addr`` (int64) as a pointer to ``like``'s dtype."""
    sig = types.CPointer(like.dtype)(addr, like)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return sig, codegen


@numba.njit(inline="always")
def _array(addr: int, length: int, like: np.ndarray) -> np.ndarray:
    return numba.carray(_pointer(addr, like), (length,))


_M16 = np.uint64(0x0000FFFF0000FFFF)
_M32 = np.uint64(0x00000000FFFFFFFF)
_S16 = np.uint64(16)
_S32 = np.uint64(32)


@numba.njit(inline="always")
def _copy_row(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[:] = src`` for two 1-D word arrays of one length, as an explicit loop (vectorized by LLVM; a 2-D
    indexed form of the same copy ran at half the speed, and numba's slice assignment slower still)."""
    for d in range(dst.shape[0]):
        dst[d] = src[d]


@numba.njit(inline="always")
def _transpose4x4(a: Any, b: Any, c: Any, e: Any) -> tuple[Any, Any, Any, Any]:
    """Four uint64 words, each four 16-bit lanes (lane 0 in the low bits) of one row, -> the four columns."""
    ab_lo = (a & _M16) | ((b & _M16) << _S16)  # a0 b0 a2 b2
    ab_hi = ((a >> _S16) & _M16) | (b & ~_M16)  # a1 b1 a3 b3
    ce_lo = (c & _M16) | ((e & _M16) << _S16)  # c0 e0 c2 e2
    ce_hi = ((c >> _S16) & _M16) | (e & ~_M16)  # c1 e1 c3 e3
    return (
        (ab_lo & _M32) | (ce_lo << _S32),  # a0 b0 c0 e0
        (ab_hi & _M32) | (ce_hi << _S32),  # a1 b1 c1 e1
        (ab_lo >> _S32) | (ce_lo & ~_M32),  # a2 b2 c2 e2
        (ab_hi >> _S32) | (ce_hi & ~_M32),  # a3 b3 c3 e3
    )


@numba.njit(cache=True, nogil=True)
def cpu_attn_elements(
    addrs: np.ndarray,
    layer_len: int,
    staging_addr: int,
    staging_len: int,
    like: np.ndarray,
    ids: np.ndarray,
    s_block: int,
    s_layer: int,
    heads: int,
    dim: int,  # head_dim, elements
    bs: int,  # block_size
    gather: bool,
    start: int,
    stop: int,
) -> None:
    """CPU_ATTN, any element width, work items ``start:stop`` of ``(block, layer, head)``: K by an element-wise
    transpose (the inner loop walks the written side contiguously), V by row copies."""
    staging = _array(staging_addr, staging_len, like)
    num_layers = addrs.shape[0]
    row = heads * dim  # canonical row: one token, all heads
    for u in range(start, stop):
        i = u // (num_layers * heads)
        layer_i = (u // heads) % num_layers
        h = u % heads
        layer = _array(addrs[layer_i], layer_len, like)
        kb = (ids[i] * heads + h) * 2 * bs * dim  # K^T [dim, bs]
        vb = kb + bs * dim  # V [bs, dim]
        so = i * s_block + layer_i * s_layer + h * dim
        sv = so + bs * row
        if gather:
            for t in range(bs):
                for d in range(dim):
                    staging[so + t * row + d] = layer[kb + d * bs + t]
            for t in range(bs):
                for d in range(dim):
                    staging[sv + t * row + d] = layer[vb + t * dim + d]
        else:
            for d in range(dim):
                for t in range(bs):
                    layer[kb + d * bs + t] = staging[so + t * row + d]
            for t in range(bs):
                for d in range(dim):
                    layer[vb + t * dim + d] = staging[sv + t * row + d]


@numba.njit(cache=True, nogil=True)
def cpu_attn_words(
    addrs: np.ndarray,
    layer_len: int,
    staging_addr: int,
    staging_len: int,
    like: np.ndarray,  # empty uint64 array
    ids: np.ndarray,
    s_block: int,
    s_layer: int,
    heads: int,
    dim4: int,  # head_dim / 4: words per V row
    bs4: int,  # block_size / 4: words per K^T row
    gather: bool,
    start: int,
    stop: int,
) -> None:
    """CPU_ATTN for 2-byte dtypes in uint64 words of 4 elements, work items ``start:stop`` of ``(block, layer,
    head)``: K by 4x4 tile transposes, V by row copies.

    Gather runs K one strip of tiles at a time: the strip's words are read (strided) into four local arrays, then
    transposed lane-wise into four contiguous canonical rows; those transposes run over contiguous arrays, which
    LLVM vectorizes (Llama-8B shape, one thread, K and V: 8.3-9.7 GB/s against 2.9 for the tile-at-a-time loop,
    which wrote one word per canonical row). Scatter keeps the tile-at-a-time loop, whose writes into K^T rows are
    contiguous already: the strip form measured 3.8-5.8 GB/s against its 6.5."""
    staging = _array(staging_addr, staging_len, like)
    num_layers = addrs.shape[0]
    row = heads * dim4  # canonical row (one token, all heads), words
    bs = 4 * bs4
    strip = np.empty((4, dim4), like.dtype)  # one strip of gathered K^T words
    a, b, c, e = strip[0], strip[1], strip[2], strip[3]
    for u in range(start, stop):
        i = u // (num_layers * heads)
        layer_i = (u // heads) % num_layers
        h = u % heads
        layer = _array(addrs[layer_i], layer_len, like)
        kb = (ids[i] * heads + h) * 8 * bs4 * dim4
        kt = layer[kb : kb + 4 * dim4 * bs4].reshape(4 * dim4, bs4)  # K^T [head_dim, bs4 words]
        v = layer[kb + 4 * dim4 * bs4 : kb + 8 * dim4 * bs4].reshape(bs, dim4)  # V [bs, dim4 words]
        so = i * s_block + layer_i * s_layer
        ck = staging[so : so + bs * row].reshape(bs, row)  # canonical K [bs, heads*dim4 words]
        cv = staging[so + bs * row : so + 2 * bs * row].reshape(bs, row)
        c0 = h * dim4
        if gather:  # strip tq: K^T words (4dq + j, tq) -> canonical rows 4tq + j, words c0 + dq
            for tq in range(bs4):
                for dq in range(dim4):
                    a[dq], b[dq] = kt[4 * dq, tq], kt[4 * dq + 1, tq]
                    c[dq], e[dq] = kt[4 * dq + 2, tq], kt[4 * dq + 3, tq]
                o0, o1 = ck[4 * tq, c0 : c0 + dim4], ck[4 * tq + 1, c0 : c0 + dim4]
                o2, o3 = ck[4 * tq + 2, c0 : c0 + dim4], ck[4 * tq + 3, c0 : c0 + dim4]
                for dq in range(dim4):
                    o0[dq], o1[dq], o2[dq], o3[dq] = _transpose4x4(a[dq], b[dq], c[dq], e[dq])
            for t in range(bs):  # V rows through 1-D row views: LLVM vectorizes these, not the 2-D indexing
                _copy_row(cv[t, c0 : c0 + dim4], v[t])
        else:  # tile by tile: canonical words (4tq + j, c0 + dq) -> K^T words (4dq + j, tq)
            for dq in range(dim4):
                for tq in range(bs4):
                    r0, r1, r2, r3 = _transpose4x4(
                        ck[4 * tq, c0 + dq], ck[4 * tq + 1, c0 + dq], ck[4 * tq + 2, c0 + dq], ck[4 * tq + 3, c0 + dq]
                    )
                    kt[4 * dq, tq] = r0
                    kt[4 * dq + 1, tq] = r1
                    kt[4 * dq + 2, tq] = r2
                    kt[4 * dq + 3, tq] = r3
            for t in range(bs):
                _copy_row(v[t], cv[t, c0 : c0 + dim4])
