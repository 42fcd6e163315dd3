"""The block copy's Triton kernel (``impl="triton"``): one launch moves every layer's shards of ``n`` blocks between
the paged caches and the staging view, for gather (paged -> staging) and scatter alike (the ``GATHER`` constexpr).

The staging side is a view ``staging[n, num_layers, *shard]`` whose shard dims are contiguous and whose first two
strides are free: block-major ``[n, L, ...]`` for blockwise transfers, a transposed ``[L, n, ...]`` buffer for
layerwise ones. Every element moves through a same-width integer view, so copies are bit-exact.

Address map of one (block ``b``, layer ``l``) shard, in elements of the KV dtype:

- FLASH_NHD ``[2, num_blocks, bs, H, D]``: part ``p`` (K=0, V=1) is one contiguous run of ``bs*H*D`` elements at
  ``p*num_blocks*bs*H*D + b*bs*H*D``; MLA ``[num_blocks, bs, D]``: one run of ``bs*D`` at ``b*bs*D``. Both are
  plain chunk copies.
- CPU_ATTN: per head ``h`` at ``(b*H + h)*2*bs*D``: K transposed ``[D, bs]``, then V ``[bs, D]``; canonical wants
  ``[bs, H, D]`` per part, so K is a transpose and V a strided row copy.
- CPU_ATTN_AMX: the same K and V regions per head, each in VNNI tiles (``ucm.kernels.layouts.amx_offsets``): K a
  transpose of 32-bit words (two dims of a token) within 16-token tiles, V a de-interleave of token pairs.

Several layer tensors in one launch: the kernel takes the lowest-address layer as base pointer and a table of
per-layer element offsets from it (``layer_offsets``). That is plain pointer arithmetic (no pointer is loaded from
memory and dereferenced), so the same kernel runs natively and in the Triton interpreter, which cannot dereference
loaded pointers. Layers whose byte distance is not a multiple of the element size (never seen with torch
allocations) fall back to one launch per layer. All offsets are int64; one config, no autotuning.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ucm.kernels.layouts import CPU_LAYOUTS, KVLayout, int_view, paged_dims
from ucm.kernels.utils import launchable


def layer_offsets(kv_caches: Sequence[torch.Tensor]) -> tuple[int, list[int]] | None:
    """``(index of the lowest-address layer, element offset of every layer from it)``, or None when a distance is
    not a whole number of elements."""
    size = kv_caches[0].element_size()
    ptrs = [c.data_ptr() for c in kv_caches]
    low = min(range(len(ptrs)), key=ptrs.__getitem__)
    deltas = [p - ptrs[low] for p in ptrs]
    if any(d % size for d in deltas):
        return None
    return low, [d // size for d in deltas]


# Values of the LAYOUT constexpr: contiguous chunks (FLASH_NHD, MLA), CPU_ATTN, CPU_ATTN_AMX.
_CHUNK, _CPU_ATTN, _CPU_ATTN_AMX = 0, 1, 2


@triton.jit
def block_copy_kernel(
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


def kernel_meta(layout: KVLayout, block_size: int, num_kv_heads: int, head_dim: int) -> dict[str, int]:
    """The tile constexprs of ``block_copy_kernel`` for one shape (one config, no autotuning)."""
    part = block_size * num_kv_heads * head_dim
    tile_d = triton.next_power_of_2(head_dim)
    return {
        "LAYOUT": {KVLayout.CPU_ATTN: _CPU_ATTN, KVLayout.CPU_ATTN_AMX: _CPU_ATTN_AMX}.get(layout, _CHUNK),
        "TILE": min(4096, triton.next_power_of_2(part)),
        "TILE_T": min(triton.next_power_of_2(block_size), max(1, 4096 // tile_d)),
        "TILE_D": tile_d,
    }


def copy_triton(
    kv_caches: Sequence[torch.Tensor], ids: torch.Tensor, layout: KVLayout, staging: torch.Tensor, gather: bool
) -> None:
    """Launch ``block_copy_kernel`` once for all layers (per layer if the offset table cannot express them)."""
    table = layer_offsets(kv_caches)
    if table is None:
        for layer, cache in enumerate(kv_caches):
            copy_triton([cache], ids, layout, staging[:, layer : layer + 1], gather)
        return
    low, offsets = table
    base = int_view(kv_caches[low])
    num_blocks, block_size, num_kv_heads, head_dim = paged_dims(base, layout)
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
    launchable(block_copy_kernel, base.device)[grid](
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
