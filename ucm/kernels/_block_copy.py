"""The block copy shared by gather/scatter_blocks and gather/scatter_layers: Triton kernel, CPU fast path, torch path.

Gather (paged -> staging) and scatter (staging -> paged) are the same address map walked in opposite directions, so
each implementation exists once here with a ``gather`` flag; the op modules (``gather_blocks.py``,
``scatter_blocks.py``, ``gather_layers.py``, ``scatter_layers.py``) hold validation, the dispatcher and the naive
reference. (One module per op would duplicate every kernel; this is the one place the codebase departs from it.)

The staging side is always handed over as a view ``staging[n, num_layers, *shard]`` whose shard dims are contiguous
and whose first two strides are free: block-major ``[n, L, ...]`` for blockwise transfers, a transposed
``[L, n, ...]`` buffer for layerwise ones. ``shard`` is ``[2, block_size, num_kv_heads, head_dim]`` (MLA
``[block_size, latent_dim]``); every element moves through a same-width integer view, so copies are bit-exact.

Address map of one (block ``b``, layer ``l``) shard, in elements of the KV dtype:

- FLASH_NHD ``[2, num_blocks, bs, H, D]``: part ``p`` (K=0, V=1) is one contiguous run of ``bs*H*D`` elements at
  ``p*num_blocks*bs*H*D + b*bs*H*D``; MLA ``[num_blocks, bs, D]``: one run of ``bs*D`` at ``b*bs*D``. Both are
  plain chunk copies.
- CPU_ATTN: per head ``h`` at ``(b*H + h)*2*bs*D``: K transposed ``[D, bs]``, then V ``[bs, D]``; canonical wants
  ``[bs, H, D]`` per part, so K is a transpose and V a strided row copy.
- CPU_ATTN_AMX: the same K and V regions per head, each in VNNI tiles (``ucm.kernels.layouts.amx_offsets``): K a
  transpose of 32-bit words (two dims of a token) within 16-token tiles, V a de-interleave of token pairs.

Several layer tensors in one launch: the kernels take the lowest-address layer as base pointer and a table of
per-layer element offsets from it (``layer_offsets``). That is plain pointer arithmetic (no pointer is loaded from
memory and dereferenced), so the same kernel runs natively and in the Triton interpreter, which cannot dereference
loaded pointers (the CPU path takes the layer addresses directly). Layers whose byte distance is not a multiple of
the element size (never seen with torch allocations) fall back to one launch per layer.
"""

from __future__ import annotations

import functools
import itertools
import os
import platform
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import torch
import triton
import triton.language as tl

from ucm.affinity import thread_pool
from ucm.kernels.layouts import CPU_LAYOUTS, KVLayout, cpu_attn_kv_views, int_view

Impl = Literal["auto", "triton", "cpu", "torch"]
IMPLS = ("auto", "triton", "cpu", "torch")


def resolve_impl(impl: str, device: torch.device) -> str:
    """The implementation ``impl`` names for tensors on ``device`` (any layout).

    ``auto`` is Triton on CUDA and the torch path on other non-CPU devices. On CPU it is the CPU fast path
    (memmove runs; numba tile transposes for CPU_ATTN and CPU_ATTN_AMX, on up to ``torch.get_num_threads()``
    threads). ``triton``
    on CPU tensors runs the Triton interpreter.

    Raises:
        ValueError: ``impl`` is not one of ``IMPLS``, or ``cpu`` for a non-CPU tensor.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {list(IMPLS)}, got {impl!r}")
    if impl == "auto":
        if device.type == "cpu":
            return "cpu"
        return "triton" if device.type == "cuda" else "torch"
    if impl == "cpu" and device.type != "cpu":
        raise ValueError(f"impl='cpu' needs CPU tensors, got device {device}")
    return impl


def copy_blocks(
    kv_caches: Sequence[torch.Tensor],
    ids: torch.Tensor,
    layout: KVLayout,
    staging: torch.Tensor,
    gather: bool,
    impl: str,
) -> None:
    """Move every layer's shard of blocks ``ids`` between ``kv_caches`` and ``staging`` (already validated).

    Args:
        kv_caches: per-layer paged KV tensors (contiguous, same shape/dtype/device).
        ids: int64 ``[n]`` block ids on the caches' device, in range (distinct when scattering).
        staging: ``[n, num_layers, *shard]`` view, same dtype and device, shard dims contiguous.
        gather: True: paged -> staging; False: staging -> paged.
        impl: a resolved implementation (``triton``, ``cpu`` or ``torch``).
    """
    if ids.numel() == 0:
        return
    if impl == "triton":
        _copy_triton(kv_caches, ids, layout, staging, gather)
    elif impl == "cpu":
        _copy_cpu(kv_caches, ids, layout, staging, gather)
    else:
        _copy_torch(kv_caches, ids, layout, staging, gather)


def _geometry(cache: torch.Tensor, layout: KVLayout) -> tuple[int, int, int, int]:
    """``(num_blocks, block_size, num_kv_heads, head_dim)`` of a validated layer tensor."""
    if layout in CPU_LAYOUTS:
        nb, h, bs, two_d = cache.shape
        return nb, bs, h, two_d // 2
    if layout == KVLayout.FLASH_NHD:
        _, nb, bs, h, d = cache.shape
        return nb, bs, h, d
    nb, bs, d = cache.shape
    return nb, bs, 1, d


def _layer_offsets(kv_caches: Sequence[torch.Tensor]) -> tuple[int, list[int]] | None:
    """``(index of the lowest-address layer, element offset of every layer from it)``, or None when a distance is
    not a whole number of elements."""
    size = kv_caches[0].element_size()
    ptrs = [c.data_ptr() for c in kv_caches]
    low = min(range(len(ptrs)), key=ptrs.__getitem__)
    deltas = [p - ptrs[low] for p in ptrs]
    if any(d % size for d in deltas):
        return None
    return low, [d // size for d in deltas]


# -- torch path: any device -----------------------------------------------------------------------------------------


def _copy_torch(
    kv_caches: Sequence[torch.Tensor], ids: torch.Tensor, layout: KVLayout, staging: torch.Tensor, gather: bool
) -> None:
    """One strided copy per layer and part through advanced indexing (gather) or ``index_copy_`` (scatter)."""
    s = int_view(staging)  # [n, L, *shard]
    n = ids.numel()
    for layer, cache in enumerate(kv_caches):
        c = int_view(cache)
        if layout in CPU_LAYOUTS:
            # Views of the paged K and V whose dims read in canonical order ([nb, bs, H, D], split where tiled).
            for part, paged in enumerate(cpu_attn_kv_views(c, layout)):
                canonical = s[:, layer, part].view(n, *paged.shape[1:])  # [n, bs, H, D], split the same way
                if gather:
                    canonical.copy_(paged[ids])
                else:
                    paged.index_copy_(0, ids, canonical)
        elif layout == KVLayout.FLASH_NHD:  # [2, nb, bs, H, D]
            if gather:
                s[:, layer].copy_(c[:, ids].transpose(0, 1))
            else:
                c.index_copy_(1, ids, s[:, layer].transpose(0, 1))
        else:  # MLA [nb, bs, D]
            if gather:
                s[:, layer].copy_(c[ids])
            else:
                c.index_copy_(0, ids, s[:, layer])


# -- Triton ---------------------------------------------------------------------------------------------------------

# Values of the LAYOUT constexpr: contiguous chunks (FLASH_NHD, MLA), CPU_ATTN, CPU_ATTN_AMX.
_CHUNK, _CPU_ATTN, _CPU_ATTN_AMX = 0, 1, 2


@triton.jit
def _block_copy_kernel(
    base_ptr,  # int view of the lowest-address layer; layer l starts at base_ptr + layer_offs[l]
    layer_offs_ptr,  # [NUM_LAYERS] int64 element offsets, >= 0
    ids_ptr,  # [n] int64 vLLM block ids
    staging_ptr,  # int view; shard (i, l) at i*stride_block + l*stride_layer, shard dims contiguous
    stride_block,  # elements between blocks i and i+1 of staging
    stride_layer,  # elements between layers l and l+1 of staging
    stride_part,  # FLASH_NHD: elements between K and V halves of a layer (num_blocks*bs*H*D); else 0
    NUM_LAYERS: tl.constexpr,
    NUM_PARTS: tl.constexpr,  # 2 (K, V) or 1 (MLA)
    LAYOUT: tl.constexpr,  # _CHUNK, _CPU_ATTN or _CPU_ATTN_AMX
    BLOCK_SIZE: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GATHER: tl.constexpr,  # True: paged -> staging; False: staging -> paged
    TILE: tl.constexpr,  # _CHUNK: elements per program
    TILE_T: tl.constexpr,  # _CPU_ATTN(_AMX): tokens per program
    TILE_D: tl.constexpr,  # _CPU_ATTN(_AMX): next power of two >= HEAD_DIM
    LAYER_ALIGN: tl.constexpr,  # every layer offset is a multiple of this (vectorization hint)
):
    # Grid: (n * NUM_LAYERS * NUM_PARTS [* NUM_HEADS for the CPU layouts], tiles of one part). All offsets int64.
    pid = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1).to(tl.int64)
    PART: tl.constexpr = BLOCK_SIZE * NUM_HEADS * HEAD_DIM  # elements of one part (K or V) of a shard
    if LAYOUT == 0:  # FLASH_NHD / MLA: part p of block b is one contiguous run of PART elements
        i = pid // (NUM_LAYERS * NUM_PARTS)
        lay = (pid // NUM_PARTS) % NUM_LAYERS
        p = pid % NUM_PARTS
        b = tl.load(ids_ptr + i).to(tl.int64)  # the grid covers exactly n blocks
        o_layer = tl.multiple_of(tl.load(layer_offs_ptr + lay), LAYER_ALIGN)
        o_t = tile * TILE + tl.arange(0, TILE).to(tl.int64)  # [TILE]
        m_t = o_t < PART
        p_paged = base_ptr + o_layer + p * stride_part + b * PART + o_t
        p_stage = staging_ptr + i * stride_block + lay * stride_layer + p * PART + o_t
        if GATHER:
            tl.store(p_stage, tl.load(p_paged, mask=m_t), mask=m_t)
        else:
            tl.store(p_paged, tl.load(p_stage, mask=m_t), mask=m_t)
    else:  # CPU layouts: per (block, head) a K region then a V region of bs*D elements; canonical part [bs, H, D]
        i = pid // (NUM_LAYERS * NUM_HEADS * 2)
        lay = (pid // (NUM_HEADS * 2)) % NUM_LAYERS
        h = (pid // 2) % NUM_HEADS
        p = pid % 2
        b = tl.load(ids_ptr + i).to(tl.int64)
        o_layer = tl.multiple_of(tl.load(layer_offs_ptr + lay), LAYER_ALIGN)
        o_tok = tile * TILE_T + tl.arange(0, TILE_T).to(tl.int64)[:, None]  # [TILE_T, 1]
        o_dim = tl.arange(0, TILE_D).to(tl.int64)[None, :]  # [1, TILE_D]
        m_td = (o_tok < BLOCK_SIZE) & (o_dim < HEAD_DIM)  # [TILE_T, TILE_D]
        p_head = base_ptr + o_layer + (b * NUM_HEADS + h) * (2 * BLOCK_SIZE * HEAD_DIM)
        # [TILE_T, TILE_D] canonical addresses: row t of part p, columns of head h
        p_stage = (
            staging_ptr
            + i * stride_block
            + lay * stride_layer
            + p * PART
            + o_tok * (NUM_HEADS * HEAD_DIM)
            + h * HEAD_DIM
            + o_dim
        )
        if p == 0:
            if LAYOUT == 1:  # CPU_ATTN: K^T, [TILE_T, TILE_D] addresses, stride 1 along tokens
                p_k = p_head + o_dim * BLOCK_SIZE + o_tok
            else:  # CPU_ATTN_AMX: 16-token tiles of dim pairs (ucm.kernels.layouts.amx_offsets)
                p_k = p_head + (o_tok // 16) * (16 * HEAD_DIM) + (o_dim // 2) * 32 + (o_tok % 16) * 2 + o_dim % 2
            if GATHER:
                tl.store(p_stage, tl.load(p_k, mask=m_td), mask=m_td)
            else:
                tl.store(p_k, tl.load(p_stage, mask=m_td), mask=m_td)
        else:
            if LAYOUT == 1:  # CPU_ATTN: V rows of HEAD_DIM
                p_v = p_head + BLOCK_SIZE * HEAD_DIM + o_tok * HEAD_DIM + o_dim
            else:  # CPU_ATTN_AMX: 16-dim tiles of token pairs
                p_v = (
                    p_head
                    + BLOCK_SIZE * HEAD_DIM
                    + (o_dim // 16) * (16 * BLOCK_SIZE)
                    + (o_tok // 2) * 32
                    + (o_dim % 16) * 2
                    + o_tok % 2
                )
            if GATHER:
                tl.store(p_stage, tl.load(p_v, mask=m_td), mask=m_td)
            else:
                tl.store(p_v, tl.load(p_stage, mask=m_td), mask=m_td)


@functools.cache
def _interpreted(fn: Any) -> Any:
    """The Triton interpreter's version of a ``@triton.jit`` kernel, for CPU tensors (what ``TRITON_INTERPRET=1``
    makes of every kernel at import; built here so CPU and CUDA tensors can use one process)."""
    from triton.runtime.interpreter import InterpretedFunction

    return fn if isinstance(fn, InterpretedFunction) else InterpretedFunction(fn.fn)


def kernel_meta(layout: KVLayout, block_size: int, num_kv_heads: int, head_dim: int) -> dict[str, int]:
    """The tile constexprs of ``_block_copy_kernel`` for one shape (one config, no autotuning)."""
    part = block_size * num_kv_heads * head_dim
    tile_d = triton.next_power_of_2(head_dim)
    return {
        "LAYOUT": {KVLayout.CPU_ATTN: _CPU_ATTN, KVLayout.CPU_ATTN_AMX: _CPU_ATTN_AMX}.get(layout, _CHUNK),
        "TILE": min(4096, triton.next_power_of_2(part)),
        "TILE_T": min(triton.next_power_of_2(block_size), max(1, 4096 // tile_d)),
        "TILE_D": tile_d,
    }


def _copy_triton(
    kv_caches: Sequence[torch.Tensor], ids: torch.Tensor, layout: KVLayout, staging: torch.Tensor, gather: bool
) -> None:
    """Launch ``_block_copy_kernel`` once for all layers (per layer if the offset table cannot express them)."""
    table = _layer_offsets(kv_caches)
    if table is None:
        for layer, cache in enumerate(kv_caches):
            _copy_triton([cache], ids, layout, staging[:, layer : layer + 1], gather)
        return
    low, offsets = table
    base = int_view(kv_caches[low])
    num_blocks, block_size, num_kv_heads, head_dim = _geometry(base, layout)
    meta = kernel_meta(layout, block_size, num_kv_heads, head_dim)
    parts = 1 if layout == KVLayout.MLA else 2
    num_layers, n = len(kv_caches), ids.numel()
    part = block_size * num_kv_heads * head_dim
    if layout in CPU_LAYOUTS:
        grid = (n * num_layers * num_kv_heads * 2, triton.cdiv(block_size, meta["TILE_T"]))
    else:
        grid = (n * num_layers * parts, triton.cdiv(part, meta["TILE"]))
    if grid[0] >= 2**31 or grid[1] >= 2**16:
        raise ValueError(f"transfer too large for one launch (grid {grid}); split block_ids")
    align = 16 if all(o % 16 == 0 for o in offsets) else 1
    kernel = _interpreted(_block_copy_kernel) if base.device.type == "cpu" else _block_copy_kernel
    kernel[grid](
        base,
        torch.tensor(offsets, dtype=torch.int64, device=base.device),
        ids,
        int_view(staging),
        staging.stride(0),
        staging.stride(1),
        num_blocks * part if layout == KVLayout.FLASH_NHD else 0,
        NUM_LAYERS=num_layers,
        NUM_PARTS=parts,
        BLOCK_SIZE=block_size,
        NUM_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        GATHER=gather,
        LAYER_ALIGN=align,
        **meta,
    )


# -- CPU fast path: numba -------------------------------------------------------------------------------------------


@functools.cache
def _numba_kernels() -> Any:
    """Compile-on-first-use numba kernels (numba is imported only when the CPU path first runs)."""
    from ucm.kernels import _numba_copy

    return _numba_copy


def _copy_cpu(
    kv_caches: Sequence[torch.Tensor], ids: torch.Tensor, layout: KVLayout, staging: torch.Tensor, gather: bool
) -> None:
    """CPU fast path. FLASH_NHD / MLA: one ``memmove`` per contiguous run. CPU_ATTN and CPU_ATTN_AMX: numba
    kernels (see ``_numba_copy``) per (block, layer) shard, with vector tiles: CPU_ATTN K by tile transposes out of
    a scratch copy of the source shard (``cpu_attn_tiles``, 2-byte dtypes; 4x4 word tiles where no tile divides
    ``block_size`` and ``head_dim``; element loops for other dtypes), CPU_ATTN_AMX by 16 x 16 word transposes
    for K and VNNI splits or joins for V (``cpu_attn_amx_tiles``; a scratch copy for scatters only). Either is
    split over up to ``torch.get_num_threads()`` threads, one per MiB moved (:func:`_run_split`); see
    :func:`cpu_attn_plan` for when the stores are non-temporal."""
    num_blocks, block_size, num_kv_heads, head_dim = _geometry(kv_caches[0], layout)
    esize = kv_caches[0].element_size()
    addrs = [c.data_ptr() for c in kv_caches]
    part = block_size * num_kv_heads * head_dim
    if layout not in CPU_LAYOUTS:
        _copy_chunks_memmove(addrs, ids.tolist(), staging, layout, num_blocks * part, part, esize, gather)
        return
    import numpy as np

    nk = _numba_kernels()
    s0, s1 = staging.stride(0), staging.stride(1)
    items = ids.numel() * len(kv_caches)  # (block, layer) work items
    nbytes = items * 2 * block_size * num_kv_heads * head_dim * esize
    dst = [staging.data_ptr(), s0 * esize, s1 * esize] if gather else addrs  # where the stores go
    tile, nt = cpu_attn_plan(layout, esize, block_size, head_dim, nbytes, dst)
    if layout == KVLayout.CPU_ATTN_AMX:  # validated: 2-byte elements, block_size and head_dim multiples of 32
        amx_args = (np.array(addrs, dtype=np.int64), staging.data_ptr(), ids.numpy(), s0 * esize, s1 * esize)
        amx_geometry = (num_kv_heads, head_dim, block_size, nt, not gather, gather)  # pre-read: scatter only
        _run_split(items, nbytes, lambda lo, hi: nk.cpu_attn_amx_tiles(*amx_args, *amx_geometry, lo, hi))
        return
    if tile:
        tile_args = (np.array(addrs, dtype=np.int64), staging.data_ptr(), ids.numpy(), s0 * esize, s1 * esize)
        geometry = (num_kv_heads, head_dim, block_size, tile, nt, gather)
        _run_split(items, nbytes, lambda lo, hi: nk.cpu_attn_tiles(*tile_args, *geometry, lo, hi))
        return
    # Elements from staging[0, 0] to one past its last element.
    span = 1 + sum((d - 1) * st for d, st in zip(staging.shape, staging.stride(), strict=True))
    words = (
        esize == 2
        and block_size % 4 == 0
        and head_dim % 4 == 0
        and all(x * esize % 8 == 0 for x in (s0, s1, span))
        and all(a % 8 == 0 for a in [*addrs, staging.data_ptr()])
    )
    w = 4 if words else 1  # elements per word
    word = np.dtype(np.uint64) if words else np.dtype({1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[esize])
    fn: Callable[..., None] = nk.cpu_attn_words if words else nk.cpu_attn_elements
    args = (
        np.array(addrs, dtype=np.int64),
        kv_caches[0].numel() // w,
        staging.data_ptr(),
        span // w,
        np.empty(0, dtype=word),
        ids.numpy(),
        s0 // w,
        s1 // w,
        num_kv_heads,
        head_dim // w,
        block_size // w,
        gather,
    )
    _run_split(items * num_kv_heads, nbytes, lambda lo, hi: fn(*args, lo, hi))  # (block, layer, head) items


# Non-temporal stores in the tile kernels: x86-64 only (elsewhere their lowering and the fence's cost are unmeasured),
# and only for copies of at least _NONTEMPORAL_MIN_BYTES. Smaller ones may fit the last-level cache, where the next
# reader (attention after a scatter, the store after a gather) finds them; measured on this repo's machine, an 8 MiB
# gather ran at 18-36 GB/s with ordinary stores against 22 with non-temporal ones, a 256 MiB one at 16-18 against
# 21-24.
_NONTEMPORAL = platform.machine().lower() in ("x86_64", "amd64")
_NONTEMPORAL_MIN_BYTES = 16 << 20


def cpu_attn_plan(
    layout: KVLayout, esize: int, block_size: int, head_dim: int, nbytes: int, addresses: Sequence[int]
) -> tuple[int, bool]:
    """How the CPU path moves a CPU_ATTN or CPU_ATTN_AMX copy of ``nbytes`` bytes: ``(tile, nontemporal)``.

    ``tile`` is the K transpose tile in elements: for CPU_ATTN that of ``cpu_attn_tiles`` (32 or 16, dividing both
    ``block_size`` and ``head_dim``; 2-byte dtypes), or 0 where that kernel does not apply (then the word or element
    kernels run); for CPU_ATTN_AMX 32 (``cpu_attn_amx_tiles``' 16 x 16 tiles of 32-bit words: 64-byte rows).
    ``nontemporal``: the stores bypass the cache, which needs x86-64, at least ``_NONTEMPORAL_MIN_BYTES`` moved, and
    every destination address and stride (``addresses``, bytes: the staging buffer's address and first two strides
    for a gather, the layer tensors' addresses for a scatter) aligned to a tile row (``2 * tile`` bytes)."""
    if layout == KVLayout.CPU_ATTN_AMX:
        tile = 32
    else:
        tile = next((t for t in (32, 16) if esize == 2 and block_size % t == 0 and head_dim % t == 0), 0)
    nontemporal = (
        tile > 0 and _NONTEMPORAL and nbytes >= _NONTEMPORAL_MIN_BYTES and all(a % (2 * tile) == 0 for a in addresses)
    )
    return tile, nontemporal


def _run_split(items: int, nbytes: int, run: Callable[[int, int], None]) -> None:
    """``run(lo, hi)`` over ``[0, items)`` in contiguous slices on up to ``torch.get_num_threads()`` threads, one
    per ``_CPU_BYTES_PER_THREAD`` of the ``nbytes`` moved; the calling thread does the first slice. ``run`` must
    release the GIL for its bulk work (numba ``nogil`` kernels, ctypes' ``memmove``)."""
    workers = min(torch.get_num_threads(), items, max(1, nbytes // _CPU_BYTES_PER_THREAD))
    if workers <= 1:
        run(0, items)
        return
    slices = list(itertools.pairwise(items * k // workers for k in range(workers + 1)))
    pool = _cpu_pool(workers - 1)
    futures = [pool.submit(run, lo, hi) for lo, hi in slices[1:]]
    run(*slices[0])
    for f in futures:
        f.result()


# Bytes below which a CPU copy runs on the calling thread only (thread hand-off costs ~50-100 us).
_CPU_BYTES_PER_THREAD = 1 << 20
_pool: ThreadPoolExecutor | None = None
_pool_size = 0  # threads of _pool
_pool_lock = threading.Lock()


def _forget_pool_after_fork() -> None:
    """In a forked child (vLLM forks its engine core), the parent's pool threads do not exist: a new pool is made on
    first use instead of queueing work that no thread would run."""
    global _pool, _pool_size, _pool_lock
    _pool, _pool_size, _pool_lock = None, 0, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool_after_fork)


def _cpu_pool(workers: int) -> ThreadPoolExecutor:
    """The process-wide pool running CPU copy slices besides the calling thread's (see :func:`_run_split`), grown
    to ``workers`` threads. Plain threads, not numba's parallel layers: those change the calling
    thread's OpenMP state, which vLLM's CPU attention checks (see ``_numba_copy``)."""
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < workers:
            old, _pool, _pool_size = _pool, thread_pool(workers, "ucm-kernel"), workers
            if old is not None:
                old.shutdown(wait=False)
        return _pool


def _copy_chunks_memmove(
    addrs: list[int],
    ids: list[int],
    staging: torch.Tensor,
    layout: KVLayout,
    stride_part: int,
    part: int,
    esize: int,
    gather: bool,
) -> None:
    """FLASH_NHD / MLA on CPU: every (block, layer, part) is one contiguous run on both sides, so each is one
    ``memmove`` (libc's copy, ~2x the numba word loop, which LLVM does not vectorize across two raw pointers); the
    blocks are split over threads as in :func:`_run_split` (ctypes releases the GIL around each ``memmove``)."""
    import ctypes

    parts = 1 if layout == KVLayout.MLA else 2
    nbytes = part * esize
    base, s0, s1 = staging.data_ptr(), staging.stride(0) * esize, staging.stride(1) * esize
    memmove = ctypes.memmove

    def run(lo: int, hi: int) -> None:
        for i in range(lo, hi):
            b = ids[i]
            for layer, addr in enumerate(addrs):
                for p in range(parts):
                    paged = addr + (p * stride_part + b * part) * esize
                    stage = base + i * s0 + layer * s1 + p * nbytes
                    if gather:
                        memmove(stage, paged, nbytes)
                    else:
                        memmove(paged, stage, nbytes)

    _run_split(len(ids), len(ids) * len(addrs) * parts * nbytes, run)
