"""numba kernels of the block copy's CPU path for CPU_ATTN and CPU_ATTN_AMX (``ucm.kernels.block_copy.cpu``;
imported on first use: numba is slow to load).

Every kernel takes the layer tensors as an ``int64`` array of addresses plus each layer's length, and the staging
side as an ``int64`` array of byte addresses, one per canonical block (its ``[num_layers, *shard]`` row: rows of one
staging tensor, or blocks anywhere in memory, such as the DRAM tier's slots), plus the length one row spans; lengths
and strides in *words*: the unit the caller chose (8-byte ``uint64`` where every size and
address allows, else the element's own integer type); ``like`` is an empty array of that word type, so numba
compiles one version per word type. Each call does the ``(block, layer, head)`` work items ``start:stop`` with the
GIL released; ``block_copy.cpu`` runs slices of one copy on plain Python threads. numba's own parallel layers are
not used: they change the calling thread's OpenMP state, and vLLM's CPU attention aborts when its OpenMP thread count
changes between scheduling and the kernel (``Check failed: thread_num``, seen in tests/integration); and with
``parallel=True``, a slice assignment into a ``carray`` inside ``prange`` was dropped by numba 0.65's parfor pass
(a scatter wrote nothing).

CPU_ATTN's K is stored transposed ``[head_dim, block_size]`` per block and head; canonical wants ``[block_size,
head_dim]``. For 2-byte dtypes (bf16, fp16), ``cpu_attn_words`` moves 4x4 element tiles as four ``uint64`` words
transposed with shifts and masks (a tile transpose is its own inverse, so scatter uses the same code): faster than an
element loop, which numba/LLVM do not vectorize.

``cpu_attn_tiles`` is the fast path for 2-byte dtypes where ``block_size`` and ``head_dim`` are multiples of 16 (every
real CPU_ATTN cache): one work item is one ``(block, layer)`` shard, which is contiguous on both sides (the paged
``[H, bs, 2*D]`` of one block, the canonical ``[2, bs, H, D]``). It copies the shard's source into a scratch buffer
in one sequential pass (a prefetch-friendly read from memory into cache), then writes the destination from that
buffer: K through ``tile x tile`` element transposes done in vector registers (``_tile_intrinsic``: LLVM
``shufflevector`` rounds of interleaves, lowered to the target's permutes), V as row copies. Where the destination is
aligned to the tile's row (``2 * tile`` bytes) the stores are non-temporal (``!nontemporal``), so written lines go
to memory without first being read into cache; a fence at the end orders them before the caller hands the buffer
on. Each of the three steps (vector tiles, the sequential pre-read, non-temporal stores on large copies) made the
copies faster in a scratch benchmark; without the pre-read, with tiles walked head by head, the kernel stayed well
below a plain copy's speed however the tiles were sized (8, 16, 32) or ordered. How close to a plain copy the
result runs: the kernel figures in benchmarks/RESULTS.md.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
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
    indexed form of the same copy ran slower, and numba's slice assignment slower still)."""
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
    block_addrs: np.ndarray,  # int64 [n]: byte address of canonical block i's staging row [num_layers, *shard]
    block_len: int,  # words one staging row spans
    like: np.ndarray,
    ids: np.ndarray,
    s_layer: int,  # staging stride between layers, words
    heads: int,
    dim: int,  # head_dim, elements
    bs: int,  # block_size
    gather: bool,
    start: int,
    stop: int,
) -> None:
    """CPU_ATTN, any element width, work items ``start:stop`` of ``(block, layer, head)``: K by an element-wise
    transpose (the inner loop walks the written side contiguously), V by row copies."""
    num_layers = addrs.shape[0]
    row = heads * dim  # canonical row: one token, all heads
    for u in range(start, stop):
        i = u // (num_layers * heads)
        layer_i = (u // heads) % num_layers
        h = u % heads
        layer = _array(addrs[layer_i], layer_len, like)
        kb = (ids[i] * heads + h) * 2 * bs * dim  # K^T [dim, bs]
        vb = kb + bs * dim  # V [bs, dim]
        staging = _array(block_addrs[i], block_len, like)
        so = layer_i * s_layer + h * dim
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
    block_addrs: np.ndarray,  # int64 [n]: byte address of canonical block i's staging row [num_layers, *shard]
    block_len: int,  # words one staging row spans
    like: np.ndarray,  # empty uint64 array
    ids: np.ndarray,
    s_layer: int,  # staging stride between layers, words
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
    LLVM vectorizes (several times faster than the tile-at-a-time loop, which wrote one word per canonical row).
    Scatter keeps the tile-at-a-time loop, whose writes into K^T rows are contiguous already: there the strip form
    was slower."""
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
        staging = _array(block_addrs[i], block_len, like)
        so = layer_i * s_layer
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


# -- vector tile kernels (2-byte dtypes) ------------------------------------------------------------------------------

_I32 = ir.IntType(32)
_I64 = ir.IntType(64)


def _mask(lanes: list[int]) -> ir.Constant:
    return ir.Constant(ir.VectorType(_I32, len(lanes)), [ir.Constant(_I32, v) for v in lanes])


def _store(builder: Any, value: Any, addr: Any, nontemporal: bool) -> None:
    """Store vector ``value`` at byte address ``addr``: aligned to its size and non-temporal, or unaligned."""
    size = value.type.count * value.type.element.width // 8
    store = builder.store(value, builder.inttoptr(addr, value.type.as_pointer()), align=size if nontemporal else 1)
    if nontemporal:
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(_I32, 1)]))


def _tile_intrinsic(n: int, nontemporal: bool, bits: int = 16) -> Any:
    """An intrinsic ``tile(src, src_stride, dst, dst_stride)`` (int64 byte addresses and row strides): the ``n x n``
    tile of ``bits``-bit elements at ``src`` is written transposed at ``dst``. The ``n`` rows are loaded as
    ``<n x i{bits}>`` vectors and transposed by log2(n) rounds of lane interleaves (``out[2k], out[2k+1] =
    interleave of the low / high halves of rows k and k + n/2``; after log2(n) rounds row j holds column j), which
    LLVM lowers to the target's permutes (``vpermt2w`` / ``vpermt2d`` with AVX-512). Non-temporal stores need
    ``dst`` and ``dst_stride`` aligned to a row (``n * bits / 8`` bytes); the caller checks."""
    half = n // 2
    lo = _mask([x for i in range(half) for x in (i, n + i)])
    hi = _mask([x for i in range(half, n) for x in (i, n + i)])

    @intrinsic
    def tile(typingctx: Any, src: Any, src_stride: Any, dst: Any, dst_stride: Any) -> Any:
        sig = types.void(types.int64, types.int64, types.int64, types.int64)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            src, src_stride, dst, dst_stride = args
            ptr = ir.VectorType(ir.IntType(bits), n).as_pointer()
            rows = []
            for r in range(n):
                addr = builder.add(src, builder.mul(src_stride, ir.Constant(_I64, r)))
                rows.append(builder.load(builder.inttoptr(addr, ptr), align=1))
            for _ in range(n.bit_length() - 1):
                pairs = [(rows[k], rows[k + half]) for k in range(half)]
                rows = [
                    v for a, b in pairs for v in (builder.shuffle_vector(a, b, lo), builder.shuffle_vector(a, b, hi))
                ]
            for j, row in enumerate(rows):
                _store(builder, row, builder.add(dst, builder.mul(dst_stride, ir.Constant(_I64, j))), nontemporal)
            return context.get_dummy_value()

        return sig, codegen

    return tile


def _row_intrinsic(n: int, nontemporal: bool) -> Any:
    """An intrinsic ``row(dst, src)``: copies ``2 * n`` bytes as one vector (alignment as ``_tile_intrinsic``)."""

    @intrinsic
    def row(typingctx: Any, dst: Any, src: Any) -> Any:
        sig = types.void(types.int64, types.int64)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            vec = ir.VectorType(ir.IntType(16), n)
            value = builder.load(builder.inttoptr(args[1], vec.as_pointer()), align=1)
            _store(builder, value, args[0], nontemporal)
            return context.get_dummy_value()

        return sig, codegen

    return row


@intrinsic
def _memcpy(typingctx: Any, dst: Any, src: Any, nbytes: Any) -> Any:
    """``memcpy(dst, src, nbytes)`` on int64 byte addresses (LLVM's ``llvm.memcpy``: libc's copy)."""
    sig = types.void(types.int64, types.int64, types.int64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i8p = ir.IntType(8).as_pointer()
        fn = builder.module.declare_intrinsic("llvm.memcpy", [i8p, i8p, _I64])
        dst, src = builder.inttoptr(args[0], i8p), builder.inttoptr(args[1], i8p)
        builder.call(fn, [dst, src, args[2], ir.Constant(ir.IntType(1), 0)])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _fence(typingctx: Any) -> Any:
    """A sequentially consistent fence (``mfence`` on x86): orders the non-temporal stores before what follows."""
    sig = types.void()

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return sig, codegen


_tile32, _tile32_nt = _tile_intrinsic(32, False), _tile_intrinsic(32, True)
_tile16, _tile16_nt = _tile_intrinsic(16, False), _tile_intrinsic(16, True)
_row32, _row32_nt = _row_intrinsic(32, False), _row_intrinsic(32, True)
_row16, _row16_nt = _row_intrinsic(16, False), _row_intrinsic(16, True)


@numba.njit(inline="always")
def _tile(n: int, nt: bool, src: int, src_stride: int, dst: int, dst_stride: int) -> None:
    if n == 32:
        if nt:
            _tile32_nt(src, src_stride, dst, dst_stride)
        else:
            _tile32(src, src_stride, dst, dst_stride)
    elif nt:
        _tile16_nt(src, src_stride, dst, dst_stride)
    else:
        _tile16(src, src_stride, dst, dst_stride)


@numba.njit(inline="always")
def _row(n: int, nt: bool, dst: int, src: int) -> None:
    if n == 32:
        if nt:
            _row32_nt(dst, src)
        else:
            _row32(dst, src)
    elif nt:
        _row16_nt(dst, src)
    else:
        _row16(dst, src)


@numba.njit(cache=True, nogil=True)
def cpu_attn_tiles(
    addrs: np.ndarray,  # int64 [num_layers]: byte address of each layer tensor
    block_addrs: np.ndarray,  # int64 [n]: byte address of canonical block i's staging row [num_layers, *shard]
    ids: np.ndarray,
    s_layer: int,  # staging stride between layers, bytes
    heads: int,
    dim: int,  # head_dim, elements
    bs: int,  # block_size, elements
    n: int,  # tile: 32 or 16, dividing dim and bs
    nt: bool,  # non-temporal stores (destination aligned to 2 * n bytes)
    gather: bool,
    start: int,
    stop: int,
) -> None:
    """CPU_ATTN for 2-byte dtypes, work items ``start:stop`` of ``(block, layer)``, through a scratch copy of each
    source shard and ``n x n`` vector tile transposes (see the module docstring)."""
    num_layers = addrs.shape[0]
    row = heads * dim * 2  # canonical row (one token, all heads), bytes
    kbytes = bs * dim * 2  # one head's K^T (and its V), bytes
    chunk = 2 * heads * kbytes  # one (block, layer) shard, bytes, on either side
    scratch = np.empty(chunk + 64, np.uint8)
    sp = (scratch.ctypes.data + 63) // 64 * 64
    for u in range(start, stop):
        i = u // num_layers
        paged = addrs[u % num_layers] + ids[i] * chunk
        stage = block_addrs[i] + (u % num_layers) * s_layer
        if gather:
            _memcpy(sp, paged, chunk)
            for t0 in range(0, bs, n):  # canonical K rows t0:t0+n, written in address order
                for h in range(heads):
                    kt, ck = sp + h * 2 * kbytes + 2 * t0, stage + t0 * row + 2 * h * dim  # K^T[h][:, t0], K[t0, h]
                    for d0 in range(0, dim, n):
                        _tile(n, nt, kt + 2 * d0 * bs, 2 * bs, ck + 2 * d0, row)
            for t in range(bs):
                for h in range(heads):
                    v, cv = sp + h * 2 * kbytes + kbytes + 2 * t * dim, stage + (bs + t) * row + 2 * h * dim
                    for d0 in range(0, dim, n):
                        _row(n, nt, cv + 2 * d0, v + 2 * d0)
        else:
            _memcpy(sp, stage, chunk)
            for h in range(heads):
                kt, ck = paged + h * 2 * kbytes, sp + 2 * h * dim  # K^T[h], K[:, h]
                for d0 in range(0, dim, n):  # K^T rows d0:d0+n of head h
                    for t0 in range(0, bs, n):
                        _tile(n, nt, ck + t0 * row + 2 * d0, row, kt + 2 * (d0 * bs + t0), 2 * bs)
                v, cv = kt + kbytes, sp + bs * row + 2 * h * dim  # V[h], canonical V[:, h]
                for t in range(bs):
                    for d0 in range(0, dim, n):
                        _row(n, nt, v + 2 * (t * dim + d0), cv + t * row + 2 * d0)
    if nt:
        _fence()


# -- CPU_ATTN_AMX (vLLM's ``amx`` kernel variant) ---------------------------------------------------------------------
#
# Per (block, kv head) the K region is 16-token tiles ``[head_dim / 2 words, 16 tokens]`` of 32-bit words (a word is
# two consecutive dims of one token), so K moves as 16 x 16 word tile transposes (``_tile_intrinsic(16, ..., 32)``).
# The V region is 16-dim tiles ``[block_size / 2, 16 dims, 2 tokens]``: 64 bytes hold 16 dims of a token pair,
# interleaved. V moves by ``_vnni_split`` (gather: two such 64-byte runs, dim tiles ``a`` and ``a + 1``, give 32 dims
# of the pair's even token and 32 of its odd token: one 64-byte canonical run each) and its inverse ``_vnni_join``.
# Unlike CPU_ATTN's kernel, the gather reads the paged shard directly: its K tiles are 1 KiB runs and its V runs 64
# bytes, and a scratch pre-read made the gather slower at every size measured. The scatter reads the canonical
# shard's rows 2 KiB and more apart, and there the pre-read pays for copies of tens of MiB, so scatters use it (the
# figures behind both choices: "CPU kernel design figures" in benchmarks/RESULTS.md).

_EVEN = _mask(list(range(0, 64, 2)))  # of two <32 x i16> vectors concatenated: lanes 0, 2, ..., 62
_ODD = _mask(list(range(1, 64, 2)))
_JOIN_LO = _mask([x for i in range(16) for x in (i, 32 + i)])  # interleave lanes 0..15 of two <32 x i16>
_JOIN_HI = _mask([x for i in range(16, 32) for x in (i, 32 + i)])


def _vnni_intrinsic(split: bool, nontemporal: bool) -> Any:
    """An intrinsic ``f(a, b, c, d)`` on int64 byte addresses, each a run of 32 16-bit elements (64 bytes).

    ``split``: reads runs ``a`` and ``b`` (each 16 pairs ``(x[i], y[i])``; ``a`` holds ``i`` in 0..15, ``b`` in
    16..31), writes ``x[0..31]`` to ``c`` and ``y[0..31]`` to ``d``. Otherwise the inverse: reads ``x`` at ``c`` and
    ``y`` at ``d``, writes the pairs to ``a`` and ``b``. Non-temporal stores need the written addresses aligned to
    64 bytes; the caller checks."""

    @intrinsic
    def vnni(typingctx: Any, a: Any, b: Any, c: Any, d: Any) -> Any:
        sig = types.void(types.int64, types.int64, types.int64, types.int64)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            ptr = ir.VectorType(ir.IntType(16), 32).as_pointer()
            a, b, c, d = args
            if split:
                va = builder.load(builder.inttoptr(a, ptr), align=1)
                vb = builder.load(builder.inttoptr(b, ptr), align=1)
                _store(builder, builder.shuffle_vector(va, vb, _EVEN), c, nontemporal)
                _store(builder, builder.shuffle_vector(va, vb, _ODD), d, nontemporal)
            else:
                vx = builder.load(builder.inttoptr(c, ptr), align=1)
                vy = builder.load(builder.inttoptr(d, ptr), align=1)
                _store(builder, builder.shuffle_vector(vx, vy, _JOIN_LO), a, nontemporal)
                _store(builder, builder.shuffle_vector(vx, vy, _JOIN_HI), b, nontemporal)
            return context.get_dummy_value()

        return sig, codegen

    return vnni


_wtile16, _wtile16_nt = _tile_intrinsic(16, False, 32), _tile_intrinsic(16, True, 32)
_split, _split_nt = _vnni_intrinsic(True, False), _vnni_intrinsic(True, True)
_join, _join_nt = _vnni_intrinsic(False, False), _vnni_intrinsic(False, True)


@numba.njit(inline="always")
def _word_tile(nt: bool, src: int, src_stride: int, dst: int, dst_stride: int) -> None:
    if nt:
        _wtile16_nt(src, src_stride, dst, dst_stride)
    else:
        _wtile16(src, src_stride, dst, dst_stride)


@numba.njit(inline="always")
def _vnni(split: bool, nt: bool, a: int, b: int, c: int, d: int) -> None:
    if split:
        if nt:
            _split_nt(a, b, c, d)
        else:
            _split(a, b, c, d)
    elif nt:
        _join_nt(a, b, c, d)
    else:
        _join(a, b, c, d)


@numba.njit(cache=True, nogil=True)
def cpu_attn_amx_tiles(
    addrs: np.ndarray,  # int64 [num_layers]: byte address of each layer tensor
    block_addrs: np.ndarray,  # int64 [n]: byte address of canonical block i's staging row [num_layers, *shard]
    ids: np.ndarray,
    s_layer: int,  # staging stride between layers, bytes
    heads: int,
    dim: int,  # head_dim, elements, a multiple of 32
    bs: int,  # block_size, elements, a multiple of 32
    nt: bool,  # non-temporal stores (destination aligned to 64 bytes)
    pre_read: bool,  # copy each source shard into a scratch buffer first
    gather: bool,
    start: int,
    stop: int,
) -> None:
    """CPU_ATTN_AMX (2-byte elements), work items ``start:stop`` of ``(block, layer)``: K moves by 16 x 16 word tile
    transposes and V by VNNI splits or joins (see above), written in the destination's address order; with
    ``pre_read`` the source shard is first copied into a scratch buffer in one sequential pass."""
    num_layers = addrs.shape[0]
    row = heads * dim * 2  # canonical row (one token, all heads), bytes
    region = bs * dim * 2  # one head's K region (and its V region), bytes
    chunk = 2 * heads * region  # one (block, layer) shard, bytes, on either side
    kt_row = 64  # bytes of one K tile row: 16 tokens x one word
    k_group = dim * 32  # bytes of one 16-token K tile group: dim / 2 words x 16 tokens x 4 bytes
    v_tile = bs * 32  # bytes of one 16-dim V tile: bs / 2 pairs x 64 bytes
    scratch = np.empty(chunk + 64 if pre_read else 0, np.uint8)
    sp = (scratch.ctypes.data + 63) // 64 * 64
    for u in range(start, stop):
        i = u // num_layers
        paged = addrs[u % num_layers] + ids[i] * chunk
        stage = block_addrs[i] + (u % num_layers) * s_layer
        if gather:
            src = paged
            if pre_read:
                _memcpy(sp, paged, chunk)
                src = sp
            for g in range(bs // 16):  # canonical K rows 16g .. 16g + 15
                for h in range(heads):
                    kr = src + h * 2 * region + g * k_group  # this head's tile group g
                    ck = stage + 16 * g * row + 2 * h * dim  # K[16g, h, 0]
                    for w0 in range(0, dim // 2, 16):
                        _word_tile(nt, kr + w0 * kt_row, kt_row, ck + 4 * w0, row)
            for p in range(bs // 2):  # canonical V rows 2p, 2p + 1
                for h in range(heads):
                    vr = src + h * 2 * region + region + 64 * p  # this head's V, dim tile 0, token pair p
                    cv = stage + (bs + 2 * p) * row + 2 * h * dim  # V[2p, h, 0]
                    for a in range(0, dim // 16, 2):  # dim tiles a, a + 1: dims 16a .. 16a + 31
                        va = vr + a * v_tile
                        _vnni(True, nt, va, va + v_tile, cv + 32 * a, cv + row + 32 * a)
        else:
            src = stage
            if pre_read:
                _memcpy(sp, stage, chunk)
                src = sp
            for h in range(heads):
                kr = paged + h * 2 * region
                for g in range(bs // 16):
                    ck = src + 16 * g * row + 2 * h * dim
                    for w0 in range(0, dim // 2, 16):
                        _word_tile(nt, ck + 4 * w0, row, kr + g * k_group + w0 * kt_row, kt_row)
                vr = kr + region
                for a in range(0, dim // 16, 2):
                    for p in range(bs // 2):
                        va = vr + a * v_tile + 64 * p
                        cv = src + (bs + 2 * p) * row + 2 * h * dim + 32 * a
                        _vnni(False, nt, va, va + v_tile, cv, cv + row)
    if nt:
        _fence()
