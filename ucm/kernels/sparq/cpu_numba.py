"""numba kernels of the SparQ ops' CPU fast path (``ucm.kernels.sparq.cpu``; imported on first use: numba is slow to
load).

:func:`sparq_query_kernel` is SparQ's query step (``ucm.kernels.sparq.ops.sparq_query``). :func:`block_lse_kernel`
computes, for each request, KV head and block of its table, the log-sum-exp over the block's tokens of the logits
from ``C`` key components (``ucm.kernels.sparq.ops.sparq_block_lse``), in one pass over the keys with no intermediate
tensor. It first checks every block id against the cache (it reads memory unchecked), then per request sorts the
blocks by id and walks them in that (memory) order, a tile of blocks at a time:

1. gather: for each block of the tile, KV head and chosen component, the component's keys are widened to fp32
   (bf16: a 16-bit shift) into a scratch tile ``[num_kv_heads, C, tile tokens]``, while the same keys of the next
   block are prefetched (LLVM's ``llvm.prefetch``). The keys are addressed in the tiled form of
   ``ucm.kernels.paged_keys`` (token tiles of ``TT`` tokens, component groups of ``TD``): per token tile, one run
   of ``TT`` values at the token stride, copied by one of three loop nests chosen once per call
   (:func:`_gather_runs`, :func:`_gather_pairs`, :func:`_gather_strided`; choosing inside the loops made the copies
   much slower). In vLLM's CPU_ATTN layout (plain keys: one tile of ``block_size`` tokens) the run is
   contiguous; in CPU_ATTN_AMX it is 16 values at stride 2 (one 64-byte cache line in bf16: the component and its
   pair partner), one run per 16-token tile, ``16 * head_dim`` values apart, read as 32-bit words of which one half
   is kept. The runs are scattered (16 of 64 components is 16 separate cache lines per block and head at
   32-token blocks), so without the prefetch the loop waits on one line at a time; a prefetch one block ahead (48
   runs for SmolLM2's 3 KV heads at 16 components) made the gather much faster in a scratch benchmark, and faster
   than torch's ``index_select`` of the same runs ("Selection kernel design figures" in benchmarks/RESULTS.md);
2. logits: for each query head, ``sum_c q[c] * K[c, :]`` over the tile's tokens, one long vectorized loop per
   component;
3. log-sum-exp per block and query head: one max over the tile, ``exp(x - max)`` over the tile in one vectorized
   loop, a sum per block; a block whose sum underflows (its logits all below the tile's max by more than ~69) is
   redone with its own max, as is the row's last block (its tokens past ``seq_lens`` masked).

``exp`` is evaluated in the loop as ``2^n * p(r)`` (``n = round(x / ln 2)``, ``r = x - n ln 2`` in two parts, ``p`` a
degree-5 polynomial fitted by least squares to ``exp`` on ``[-ln2/2, ln2/2]`` for this file: relative error
1.1e-7, at the level of fp32 rounding), because numba's ``np.exp`` is a scalar libm call that LLVM does not
vectorize. Inputs to ``exp`` are ``<= 0`` and clamped at ``-87`` (so ``2^n`` stays a normal float). Results agree
with the torch path to fp32 rounding, not bit for bit (the component sums and ``exp`` differ), as between the torch
and Triton paths.

Single-threaded, ``nogil=True``; not ``parallel=True`` (see ``ucm.kernels.block_copy.cpu_numba``: numba's threading
layer disturbs vLLM's OpenMP state).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693145751953125)  # ln 2 = _LN2_HI + _LN2_LO; n * _LN2_HI is exact for |n| < 2^10
_LN2_LO = np.float32(1.4286068202862268e-06)
_FLOOR = np.float32(-87.0)  # exp(-87) ~ 1.6e-38: still a normal float
_TINY = np.float32(1e-30)  # a block sum below this is redone with the block's own max
# exp(r) ~ sum_k _P[k] r^k on [-ln2/2, ln2/2]: least-squares fit at 2000 Chebyshev nodes (numpy polyfit, float64).
_P0 = np.float32(1.0000001192092896)
_P1 = np.float32(1.0)
_P2 = np.float32(0.4999886751174927)
_P3 = np.float32(0.16666415333747864)
_P4 = np.float32(0.04191756993532181)
_P5 = np.float32(0.008375135250389576)
_LINE = 64  # bytes per cache line
# The intrinsic's name carries its pointer type: ``p0`` since LLVM 15's opaque pointers, ``p0i8`` before.
_PREFETCH = "llvm.prefetch.p0" if llvm.llvm_version_info[0] >= 15 else "llvm.prefetch.p0i8"


@intrinsic
def _prefetch(typingctx: Any, arr: Any, index: Any) -> Any:
    """Hint the CPU to fetch ``arr[index]``'s cache line for reading (``llvm.prefetch``, locality 3); no effect on
    results, and no fault for any index (a prefetch never traps)."""
    sig = types.void(arr, index)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]], wraparound=False)
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, _PREFETCH)
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(fastmath=True, nogil=True, cache=True)
def _exp_shifted(x: np.ndarray, m: np.float32, e: np.ndarray, e_bits: np.ndarray) -> None:  # pragma: no cover
    """``e[t] = exp(max(x[t] - m, -87))`` for every ``t``; ``e_bits`` is ``e`` viewed as int32 (two loops: the
    polynomial, then ``2^n`` added to the exponent bits, both vectorized)."""
    for t in range(x.shape[0]):
        v = max(x[t] - m, _FLOOR)
        n = np.floor(v * _LOG2E + np.float32(0.5))
        r = (v - n * _LN2_HI) - n * _LN2_LO
        e[t] = ((((_P5 * r + _P4) * r + _P3) * r + _P2) * r + _P1) * r + _P0
    for t in range(x.shape[0]):
        v = max(x[t] - m, _FLOOR)
        e_bits[t] += np.int32(np.floor(v * _LOG2E + np.float32(0.5))) << 23


@numba.njit(fastmath=True, nogil=True, cache=True)
def _lse_own_max(x: np.ndarray, e: np.ndarray, e_bits: np.ndarray) -> np.float32:  # pragma: no cover
    """``log(sum(exp(x)))`` over all of ``x`` (non-empty), shifted by its own max; ``e``/``e_bits``: scratch of
    ``x``'s length."""
    m = x[0]
    for t in range(1, x.shape[0]):
        m = max(m, x[t])
    _exp_shifted(x, m, e, e_bits)
    s = np.float32(0.0)
    for t in range(x.shape[0]):
        s += e[t]
    return m + np.log(s)


@numba.njit(nogil=True, cache=True)
def sparq_query_kernel(  # pragma: no cover - compiled
    query: np.ndarray, num_kv_heads: int, scale: float, q_r: np.ndarray, channels: np.ndarray
) -> None:
    """``ucm.kernels.sparq.sparq_query`` (SparQ step 1 with its temperature) for float32 ``query`` ``[R, HQ, D]``: per
    row and KV head, the ``C`` components of largest ``|q|`` summed over the KV head's query heads into
    ``channels`` (int64 ``[R, H, C]``; ties to the lower component), and each query head's values there times
    ``scale / sqrt(|q_r|_1 / |q|_1)`` into ``q_r`` (float32 ``[R, HQ, C]``)."""
    nr, hq, d = query.shape
    nc = channels.shape[2]
    group = hq // num_kv_heads
    mag = np.empty(d, np.float32)
    for i in range(nr):
        for h in range(num_kv_heads):
            mag[:] = 0.0
            for g in range(group):
                for x in range(d):
                    mag[x] += abs(query[i, h * group + g, x])
            order = np.argsort(-mag, kind="mergesort")
            for c in range(nc):
                channels[i, h, c] = order[c]
            for g in range(group):
                j = h * group + g
                total = np.float32(0.0)
                for x in range(d):
                    total += abs(query[i, j, x])
                kept = np.float32(0.0)
                for c in range(nc):
                    kept += abs(query[i, j, order[c]])
                share = max(kept / max(total, np.float32(1e-30)), np.float32(1e-30))
                factor = np.float32(scale) / np.sqrt(share)
                for c in range(nc):
                    q_r[i, j, c] = query[i, j, order[c]] * factor


@numba.njit(fastmath=True, nogil=True, cache=True)
def _gather_runs(  # pragma: no cover - compiled
    words: np.ndarray,
    words32: np.ndarray,
    shift: np.uint32,
    ids: np.ndarray,
    k0: int,
    kn: int,
    s0: int,
    s2: int,
    s3: int,
    chan_off: np.ndarray,
    block_size: int,
    tile_tokens: int,
    tile_bits: np.ndarray,
) -> None:
    """Step 1 of :func:`block_lse_kernel` for keys whose component is one contiguous run of ``block_size`` values per
    block (CPU_ATTN): ``tile_bits[(h * C + c) * span + kk * block_size + t]`` (``span = tile_bits.size / (H * C)``) gets
    the fp32 bits of key ``(ids[k0 + kk], h, t, channels[c])`` for ``kk < kn``, the run at ``ids[k0 + kk] * s0 +
    chan_off[h, c]`` in ``words``; the same run of block ``ids[k0 + kk + 1]`` is prefetched. ``words32``, ``s2``,
    ``s3``, ``tile_tokens``: unused (the shared signature)."""
    nh, nc = chan_off.shape
    span = tile_bits.shape[0] // (nh * nc)
    per_line = max(1, _LINE // words.itemsize)
    nb = ids.shape[0]
    for kk in range(kn):
        base = ids[k0 + kk] * s0
        ahead = k0 + kk + 1 < nb
        nxt = ids[min(k0 + kk + 1, nb - 1)] * s0
        for h in range(nh):
            for c in range(nc):
                off = chan_off[h, c]
                if ahead:
                    for p in range(0, block_size, per_line):
                        _prefetch(words, nxt + off + p)
                src = words[base + off : base + off + block_size]
                lo = (h * nc + c) * span + kk * block_size
                dst = tile_bits[lo : lo + block_size]
                for t in range(block_size):
                    dst[t] = np.uint32(src[t]) << shift


@numba.njit(fastmath=True, nogil=True, cache=True)
def _gather_pairs(  # pragma: no cover - compiled
    words: np.ndarray,
    words32: np.ndarray,
    shift: np.uint32,
    ids: np.ndarray,
    k0: int,
    kn: int,
    s0: int,
    s2: int,
    s3: int,
    chan_off: np.ndarray,
    block_size: int,
    tile_tokens: int,
    tile_bits: np.ndarray,
) -> None:
    """:func:`_gather_runs` for bf16 keys in token tiles of ``tile_tokens`` values at stride 2, ``s2`` apart
    (CPU_ATTN_AMX: 16 tokens, one 64-byte line per tile and component pair): read as ``words32``, the same storage
    as 32-bit words (value ``2k`` in the low half of word ``k``, ``2k + 1`` in the high half), keeping one half: a
    loop over consecutive words, much faster than a stride-2 loop over 16-bit values. ``s2`` and ``words.size``
    must be even."""
    nh, nc = chan_off.shape
    span = tile_bits.shape[0] // (nh * nc)
    per_line = max(1, _LINE // words.itemsize)
    run = (tile_tokens - 1) * s3 + 1  # values one tile's run spans
    nb = ids.shape[0]
    for kk in range(kn):
        base = ids[k0 + kk] * s0
        ahead = k0 + kk + 1 < nb
        nxt = ids[min(k0 + kk + 1, nb - 1)] * s0
        for h in range(nh):
            for c in range(nc):
                off = chan_off[h, c]
                first = base + off
                half = np.uint32(0) if first & 1 else np.uint32(16)  # a high half is in place already
                lo = (h * nc + c) * span + kk * block_size
                for j in range(block_size // tile_tokens):
                    if ahead:
                        for p in range(0, run, per_line):
                            _prefetch(words, nxt + off + j * s2 + p)
                    w0 = (first >> 1) + j * (s2 >> 1)
                    src32 = words32[w0 : w0 + tile_tokens]
                    dst = tile_bits[lo + j * tile_tokens : lo + (j + 1) * tile_tokens]
                    for t in range(tile_tokens):
                        dst[t] = (src32[t] << half) & np.uint32(0xFFFF0000)


@numba.njit(fastmath=True, nogil=True, cache=True)
def _gather_strided(  # pragma: no cover - compiled
    words: np.ndarray,
    words32: np.ndarray,
    shift: np.uint32,
    ids: np.ndarray,
    k0: int,
    kn: int,
    s0: int,
    s2: int,
    s3: int,
    chan_off: np.ndarray,
    block_size: int,
    tile_tokens: int,
    tile_bits: np.ndarray,
) -> None:
    """:func:`_gather_runs` for keys in token tiles of ``tile_tokens`` values at any stride ``s3``, ``s2`` apart
    (the general case; not a vLLM layout)."""
    nh, nc = chan_off.shape
    span = tile_bits.shape[0] // (nh * nc)
    per_line = max(1, _LINE // words.itemsize)
    run = (tile_tokens - 1) * s3 + 1
    nb = ids.shape[0]
    for kk in range(kn):
        base = ids[k0 + kk] * s0
        ahead = k0 + kk + 1 < nb
        nxt = ids[min(k0 + kk + 1, nb - 1)] * s0
        for h in range(nh):
            for c in range(nc):
                off = chan_off[h, c]
                lo = (h * nc + c) * span + kk * block_size
                for j in range(block_size // tile_tokens):
                    at = off + j * s2
                    if ahead:
                        for p in range(0, run, per_line):
                            _prefetch(words, nxt + at + p)
                    src = words[base + at : base + at + run : s3]
                    dst = tile_bits[lo + j * tile_tokens : lo + (j + 1) * tile_tokens]
                    for t in range(tile_tokens):
                        dst[t] = np.uint32(src[t]) << shift


@numba.njit(fastmath=True, nogil=True, cache=True)
def block_lse_kernel(  # pragma: no cover - compiled
    q: np.ndarray,
    channels: np.ndarray,
    words: np.ndarray,
    shift: np.uint32,
    s0: int,
    s1: int,
    s2: int,
    s3: int,
    s4: int,
    s5: int,
    tile_tokens: int,
    tile_dims: int,
    block_table: np.ndarray,
    seq_lens: np.ndarray,
    block_size: int,
    cache_blocks: int,
    tile_blocks: int,
    out: np.ndarray,
) -> int:
    """Fill ``out[r, j, w]`` for each row's blocks ``w < ceil(seq_lens[r] / block_size)`` (the log-sum-exps of
    ``ucm.kernels.sparq.ops.sparq_block_lse``; steps in the module doc);
    other entries untouched. Returns 0, or -1 without reading any key when a row names a block outside
    ``[0, cache_blocks)``.

    Args:
        q: float32 ``[R, HQ, C]``; channels: int64 ``[R, H, C]``.
        words: the keys' storage from their first element, 1-D, as ``uint16`` (bf16, ``shift`` 16) or ``uint32``
            (fp32, ``shift`` 0); key ``(b, h, t, c)`` is ``words[b * s0 + h * s1 + (t // tile_tokens) * s2 + (t %
            tile_tokens) * s3 + (c // tile_dims) * s4 + (c % tile_dims) * s5]`` (the tiled form of
            ``ucm.kernels.paged_keys``; all strides non-negative, ``tile_tokens`` divides ``block_size``).
        block_table: int32/int64 ``[R, W]``; seq_lens: int64 ``[R]``; block_size: tokens per block;
        cache_blocks: blocks in the paged cache; tile_blocks: blocks per tile.
        out: float32 ``[R, HQ, W]``.
    """
    nr = q.shape[0]
    for i in range(nr):
        for w in range((seq_lens[i] + block_size - 1) // block_size):
            if block_table[i, w] < 0 or block_table[i, w] >= cache_blocks:
                return -1
    hq, nc = q.shape[1], q.shape[2]
    nh = channels.shape[1]
    group = hq // nh
    span = tile_blocks * block_size
    tile_bits = np.empty(nh * nc * span, np.uint32)
    tile = tile_bits.view(np.float32)
    logits = np.empty(group * span, np.float32)
    e = np.empty(span, np.float32)
    e_bits = e.view(np.int32)
    contiguous = s3 == 1 and tile_tokens == block_size  # one run per block and component: CPU_ATTN
    pairs = s3 == 2 and s2 % 2 == 0 and words.itemsize == 2 and words.shape[0] % 2 == 0  # CPU_ATTN_AMX
    words32 = words[: words.shape[0] - words.shape[0] % 2].view(np.uint32)  # read by _gather_pairs only
    chan_off = np.empty((nh, nc), np.int64)
    for i in range(nr):
        nb = (seq_lens[i] + block_size - 1) // block_size
        cols = np.argsort(block_table[i, :nb])  # ascending block id (memory) order
        ids = np.empty(nb, np.int64)
        for k in range(nb):
            ids[k] = block_table[i, cols[k]]
        last_col = nb - 1
        for h in range(nh):  # each (head, component)'s offset inside a block, once per row: no division below
            for c in range(nc):
                ch = channels[i, h, c]
                chan_off[h, c] = h * s1 + (ch // tile_dims) * s4 + (ch % tile_dims) * s5
        for k0 in range(0, nb, tile_blocks):
            kn = min(tile_blocks, nb - k0)
            tl = kn * block_size
            # 1. gather the tile's keys, prefetching the next block's (one loop nest per storage kind)
            if contiguous:
                _gather_runs(
                    words, words32, shift, ids, k0, kn, s0, s2, s3, chan_off, block_size, tile_tokens, tile_bits
                )
            elif pairs:
                _gather_pairs(
                    words, words32, shift, ids, k0, kn, s0, s2, s3, chan_off, block_size, tile_tokens, tile_bits
                )
            else:
                _gather_strided(
                    words, words32, shift, ids, k0, kn, s0, s2, s3, chan_off, block_size, tile_tokens, tile_bits
                )
            for h in range(nh):
                # 2. logits of the KV head's query heads over the tile
                for g in range(group):
                    acc = logits[g * span : g * span + tl]
                    qv = q[i, h * group + g, 0]
                    kv = tile[h * nc * span : h * nc * span + tl]
                    for t in range(tl):
                        acc[t] = qv * kv[t]
                    for c in range(1, nc):
                        qv = q[i, h * group + g, c]
                        kv = tile[(h * nc + c) * span : (h * nc + c) * span + tl]
                        for t in range(tl):
                            acc[t] += qv * kv[t]
                # 3. log-sum-exp per block
                for g in range(group):
                    acc = logits[g * span : g * span + tl]
                    top = np.float32(-3.0e38)  # the max over the tile's full blocks (the last is redone alone)
                    for kk in range(kn):
                        if cols[k0 + kk] != last_col:
                            for t in range(kk * block_size, (kk + 1) * block_size):
                                top = max(top, acc[t])
                    _exp_shifted(acc, top, e[:tl], e_bits[:tl])
                    for kk in range(kn):
                        col = cols[k0 + kk]
                        lo = kk * block_size
                        if col == last_col:
                            count = seq_lens[i] - col * block_size
                            lse = _lse_own_max(acc[lo : lo + count], e[lo : lo + count], e_bits[lo : lo + count])
                        else:
                            s = np.float32(0.0)
                            for t in range(lo, lo + block_size):
                                s += e[t]
                            if s < _TINY:
                                lse = _lse_own_max(
                                    acc[lo : lo + block_size], e[lo : lo + block_size], e_bits[lo : lo + block_size]
                                )
                            else:
                                lse = top + np.log(s)
                        out[i, h * group + g, col] = lse
    return 0
