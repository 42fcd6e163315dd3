"""The block copy's CPU fast path (``impl="cpu"``): one ``memmove`` per contiguous run for FLASH_NHD and MLA, the
numba kernels of ``ucm.kernels.block_copy.cpu_numba`` for CPU_ATTN and CPU_ATTN_AMX, split over up to
``torch.get_num_threads()`` plain threads.

:func:`copy_cpu` takes the arguments of :func:`ucm.kernels.block_copy.ops.copy_blocks` (validated: the layer
tensors, int64 block ids on CPU, the staging view ``[n, num_layers, *shard]`` with contiguous shard dims). numba is
imported on the first CPU_ATTN / CPU_ATTN_AMX copy (``warm_up`` makes that call at start).
"""

from __future__ import annotations

import functools
import itertools
import os
import platform
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ucm.affinity import thread_pool
from ucm.kernels.layouts import CPU_LAYOUTS, KVLayout, paged_dims


@functools.cache
def _numba_kernels() -> Any:
    """Compile-on-first-use numba kernels (numba is imported only when the CPU path first runs)."""
    from ucm.kernels.block_copy import cpu_numba

    return cpu_numba


def copy_cpu(
    kv_caches: Sequence[torch.Tensor],
    ids: torch.Tensor,
    layout: KVLayout,
    staging: torch.Tensor | Sequence[torch.Tensor],
    gather: bool,
) -> None:
    """Move every layer's shard of blocks ``ids`` between ``kv_caches`` and ``staging`` (``gather``: paged ->
    staging). ``staging`` is one ``[n, num_layers, *shard]`` view, or ``n`` separate ``[num_layers, *shard]``
    blocks (anywhere in memory, the same strides; shard dims contiguous in both forms): the kernels take one address
    per canonical block, so blocks held elsewhere (the DRAM tier's slots) need no copy into one buffer first.

    FLASH_NHD / MLA: one ``memmove`` per contiguous run. CPU_ATTN and CPU_ATTN_AMX: numba
    kernels (see ``cpu_numba``) per (block, layer) shard, with vector tiles: CPU_ATTN K by tile transposes out of
    a scratch copy of the source shard (``cpu_attn_tiles``, 2-byte dtypes; 4x4 word tiles where no tile divides
    ``block_size`` and ``head_dim``; element loops for other dtypes), CPU_ATTN_AMX by 16 x 16 word transposes
    for K and VNNI splits or joins for V (``cpu_attn_amx_tiles``; a scratch copy for scatters only). Either is
    split over up to ``torch.get_num_threads()`` threads, one per MiB moved (:func:`_run_split`); see
    :func:`cpu_attn_plan` for when the stores are non-temporal."""
    num_blocks, block_size, num_kv_heads, head_dim = paged_dims(kv_caches[0], layout)
    esize = kv_caches[0].element_size()
    addrs = [c.data_ptr() for c in kv_caches]
    part = block_size * num_kv_heads * head_dim
    block_addrs, s1, span = staging_rows(staging, esize)
    if layout not in CPU_LAYOUTS:
        _copy_chunks_memmove(
            addrs, ids.tolist(), block_addrs, s1 * esize, layout, num_blocks * part, part, esize, gather
        )
        return
    import numpy as np

    nk = _numba_kernels()
    items = ids.numel() * len(kv_caches)  # (block, layer) work items
    nbytes = items * 2 * block_size * num_kv_heads * head_dim * esize
    dst = [*block_addrs.tolist(), s1 * esize] if gather else addrs  # where the stores go
    tile, nt = cpu_attn_plan(layout, esize, block_size, head_dim, nbytes, dst)
    if layout == KVLayout.CPU_ATTN_AMX:  # validated: 2-byte elements, block_size and head_dim multiples of 32
        amx_args = (np.array(addrs, dtype=np.int64), block_addrs, ids.numpy(), s1 * esize)
        amx_geometry = (num_kv_heads, head_dim, block_size, nt, not gather, gather)  # pre-read: scatter only
        _run_split(items, nbytes, lambda lo, hi: nk.cpu_attn_amx_tiles(*amx_args, *amx_geometry, lo, hi))
        return
    if tile:
        tile_args = (np.array(addrs, dtype=np.int64), block_addrs, ids.numpy(), s1 * esize)
        geometry = (num_kv_heads, head_dim, block_size, tile, nt, gather)
        _run_split(items, nbytes, lambda lo, hi: nk.cpu_attn_tiles(*tile_args, *geometry, lo, hi))
        return
    words = (
        esize == 2
        and block_size % 4 == 0
        and head_dim % 4 == 0
        and all(x * esize % 8 == 0 for x in (s1, span))
        and all(a % 8 == 0 for a in [*addrs, *block_addrs.tolist()])
    )
    w = 4 if words else 1  # elements per word
    word = np.dtype(np.uint64) if words else np.dtype({1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[esize])
    fn: Callable[..., None] = nk.cpu_attn_words if words else nk.cpu_attn_elements
    args = (
        np.array(addrs, dtype=np.int64),
        kv_caches[0].numel() // w,
        block_addrs,
        span // w,
        np.empty(0, dtype=word),
        ids.numpy(),
        s1 // w,
        num_kv_heads,
        head_dim // w,
        block_size // w,
        gather,
    )
    _run_split(items * num_kv_heads, nbytes, lambda lo, hi: fn(*args, lo, hi))  # (block, layer, head) items


def staging_rows(staging: torch.Tensor | Sequence[torch.Tensor], esize: int) -> tuple[Any, int, int]:
    """The staging side of a copy as the kernels take it: ``(block_addrs, s_layer, span)``: int64 numpy ``[n]``
    byte addresses of each canonical block's ``[num_layers, *shard]`` row, the stride between its layers and the
    elements from a row's first element to one past its last (``staging``: a ``[n, num_layers, *shard]`` view or
    ``n`` blocks ``[num_layers, *shard]`` of equal strides, as ``ops`` validates them; shard dims contiguous;
    ``esize``: bytes per element)."""
    import numpy as np

    if isinstance(staging, torch.Tensor):
        rows = staging.shape[0]
        block_addrs = staging.data_ptr() + np.arange(rows, dtype=np.int64) * (staging.stride(0) * esize)
        shape, strides = staging.shape[1:], staging.stride()[1:]
    else:
        shape, strides = staging[0].shape, staging[0].stride()
        block_addrs = np.array([b.data_ptr() for b in staging], dtype=np.int64)
    span = 1 + sum((d - 1) * st for d, st in zip(shape, strides, strict=True))
    return block_addrs, strides[0], span


# Non-temporal stores in the tile kernels: x86-64 only (elsewhere their lowering and the fence's cost are unmeasured),
# and only for copies of at least _NONTEMPORAL_MIN_BYTES. Smaller ones may fit the last-level cache, where the next
# reader (attention after a scatter, the store after a gather) finds them: there ordinary stores were as fast or
# faster, on large copies non-temporal ones faster ("CPU kernel design figures" in benchmarks/RESULTS.md).
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


# Bytes below which a CPU copy runs on the calling thread only (handing work to a thread costs more than copying
# less than this).
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
    thread's OpenMP state, which vLLM's CPU attention checks (see ``cpu_numba``)."""
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
    block_addrs: Any,
    s_layer: int,
    layout: KVLayout,
    stride_part: int,
    part: int,
    esize: int,
    gather: bool,
) -> None:
    """FLASH_NHD / MLA on CPU: every (block, layer, part) is one contiguous run on both sides, so each is one
    ``memmove`` (libc's copy, faster than a numba word loop, which LLVM does not vectorize across two raw pointers); the
    blocks are split over threads as in :func:`_run_split` (ctypes releases the GIL around each ``memmove``)."""
    import ctypes

    parts = 1 if layout == KVLayout.MLA else 2
    nbytes = part * esize
    rows = block_addrs.tolist()  # byte address of each canonical block's staging row
    memmove = ctypes.memmove

    def run(lo: int, hi: int) -> None:
        for i in range(lo, hi):
            b = ids[i]
            for layer, addr in enumerate(addrs):
                for p in range(parts):
                    paged = addr + (p * stride_part + b * part) * esize
                    stage = rows[i] + layer * s_layer + p * nbytes
                    if gather:
                        memmove(stage, paged, nbytes)
                    else:
                        memmove(paged, stage, nbytes)

    _run_split(len(ids), len(ids) * len(addrs) * parts * nbytes, run)
