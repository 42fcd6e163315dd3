"""The SparQ ops' CPU fast path (``impl="cpu"``): the numba kernels of ``ucm.kernels.sparq.cpu_numba`` on numpy
views of CPU tensors, for bf16/fp32 keys in vLLM's CPU layouts (:func:`cpu_applies`). numba is imported on the first
call (GSA's ``warm_up`` makes it at start).
"""

from __future__ import annotations

import numpy as np
import torch

from ucm.kernels.paged_keys import key_geometry, key_tiling

_LINE_BYTES = 64  # bytes per cache line


def cpu_applies(keys: torch.Tensor) -> bool:
    """Whether the CPU fast path (the numba kernel) takes ``keys`` (plain or tiled): on CPU, bf16 or fp32,
    non-negative strides, and each token tile's run of one component either contiguous (token stride 1: CPU_ATTN,
    one tile of ``block_size`` tokens) or within one cache line (CPU_ATTN_AMX: 16 tokens at stride 2, 64 bytes in
    bf16)."""
    if keys.device.type != "cpu" or keys.dtype not in (torch.bfloat16, torch.float32):
        return False
    strides, tile_tokens, _ = key_tiling(keys)
    token_stride = strides[3]
    if min(strides) < 0 or token_stride < 1:
        return False
    return token_stride == 1 or (tile_tokens - 1) * token_stride * keys.element_size() < _LINE_BYTES


def key_words(keys: torch.Tensor) -> tuple[np.ndarray, np.uint32]:
    """The storage of bf16/fp32 ``keys`` (plain or tiled) from their first element as a 1-D numpy array of
    ``uint16`` (bf16) or ``uint32`` (fp32), no copy, and the left shift that widens a word to fp32 bits (16 or 0):
    the numba kernel's view of the paged cache (key ``(b, h, t, c)`` at the tiled offset of
    ``ucm.kernels.paged_keys``, in words)."""
    span = sum((size - 1) * stride for size, stride in zip(keys.shape, keys.stride(), strict=True)) + 1
    flat = keys.as_strided((span,), (1,))
    if keys.dtype == torch.bfloat16:
        return flat.view(torch.int16).numpy().view(np.uint16), np.uint32(16)
    return flat.view(torch.int32).numpy().view(np.uint32), np.uint32(0)


def raise_bad_block_ids(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int, num_blocks: int) -> None:
    """Raise the ValueError for a table naming a block outside the cache (the numba kernel found one)."""
    n = torch.div(seq_lens.long() + block_size - 1, block_size, rounding_mode="floor")
    used = block_table[torch.arange(block_table.shape[1])[None, :] < n[:, None]]
    raise ValueError(
        f"block_table names blocks in [{int(used.min())}, {int(used.max())}]; the cache has {num_blocks} "
        f"(ids 0..{num_blocks - 1})"
    )


_TILE_TOKENS = 256  # tokens per tile of the numba kernel: its scratch (H * C + heads per KV head) * 1 KiB stays in L2


def tile_blocks(block_size: int) -> int:
    """Blocks per tile of the numba kernel."""
    return max(1, _TILE_TOKENS // block_size)


def lse_cpu(
    q: torch.Tensor, channels: torch.Tensor, keys: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor
) -> torch.Tensor:
    """:func:`ucm.kernels.sparq.sparq_block_lse` on keys :func:`cpu_applies` takes: the numba kernel's one fused
    pass; float32 ``[R, num_heads, W]`` on CPU.

    Raises:
        ValueError: a row names a block outside the cache (checked before any key is read).
    """
    from ucm.kernels.sparq import cpu_numba  # numba is slow to import: only when the CPU path first runs

    nb, _, bs, _ = key_geometry(keys)
    out = torch.full((q.shape[0], q.shape[1], block_table.shape[1]), float("-inf"), dtype=torch.float32)
    if out.numel() == 0:
        return out
    strides, tile_tokens, tile_dims = key_tiling(keys)
    words, shift = key_words(keys)
    keys_args = (words, shift, *strides, tile_tokens, tile_dims)  # block_lse_kernel's view of the paged keys
    rows_args = (block_table.contiguous().numpy(), seq_lens.long().numpy(), bs, nb, tile_blocks(bs))
    status = cpu_numba.block_lse_kernel(
        q.contiguous().numpy(), channels.contiguous().numpy(), *keys_args, *rows_args, out.numpy()
    )
    if status:
        raise_bad_block_ids(block_table, seq_lens, bs, nb)
    return out


def sparq_query_cpu(
    query: torch.Tensor, num_kv_heads: int, channels: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ucm.kernels.sparq.sparq_query` in the numba kernel (CPU tensors): ``(q_r, idx)``, float32 ``[R,
    num_heads, C]`` and int64 ``[R, num_kv_heads, C]``; components of equal ``|q|`` in ascending order."""
    from ucm.kernels.sparq.cpu_numba import sparq_query_kernel

    r, hq, d = query.shape
    c = max(1, min(channels, d))
    q_r = np.empty((r, hq, c), np.float32)
    idx = np.empty((r, num_kv_heads, c), np.int64)
    sparq_query_kernel(query.float().contiguous().numpy(), num_kv_heads, scale, q_r, idx)
    return torch.from_numpy(q_r), torch.from_numpy(idx)


def sparq_lse(
    query: np.ndarray,
    num_kv_heads: int,
    score_channels: int,
    scale: float,
    words: np.ndarray,
    shift: np.uint32,
    strides: tuple[int, int, int, int, int, int],
    tile_tokens: int,
    tile_dims: int,
    cache_blocks: int,
    tile_blocks: int,
    block_table: np.ndarray,
    seq_lens: np.ndarray,
    block_size: int,
    min_blocks: int,
) -> tuple[int, np.ndarray, np.ndarray]:
    """SparQ's query step then the per-block log-sum-exps (:func:`ucm.kernels.sparq.sparq_query` then
    :func:`ucm.kernels.sparq.sparq_block_lse`, CPU path) on numpy arrays, for the rows of at least ``min_blocks``
    blocks: the per-head block scores of GSA's fused ``sparq`` selection (``ucm.sparse.gsa.sparq_select``). Two
    compiled calls and a few numpy ops: one compiled function calling the others took numba about twice as long to
    compile.

    Args:
        query: float32 ``[R, HQ, D]``: each row's decode query.
        num_kv_heads, score_channels, scale: as ``ucm.kernels.sparq.sparq_query``'s ``num_kv_heads``,
            ``channels``, ``scale``.
        words, shift, cache_blocks, tile_blocks: the paged keys, as ``cpu_numba.block_lse_kernel``; strides,
            tile_tokens, tile_dims: the six strides (in words) and the tile sizes of the keys' tiled form
            (``ucm.kernels.paged_keys.key_tiling``), as ``block_lse_kernel``'s ``s0`` .. ``s5``, ``tile_tokens``,
            ``tile_dims``.
        block_table: int ``[R, W]``; seq_lens: int64 ``[R]``; block_size: tokens per block; min_blocks: GSA's.

    Returns:
        ``(status, lse, score_row)``: status 0, or -1 when a selecting row names a block outside ``[0,
        cache_blocks)``; lse float32 ``[S, HQ, W]`` the selecting rows' per-block log-sum-exps; score_row int64
        ``[R]`` each row's index in ``lse`` or -1: the inputs of ``ucm.sparse.selection.cpu.keep_blocks_numpy``.
    """
    from ucm.kernels.sparq.cpu_numba import block_lse_kernel, sparq_query_kernel

    selecting = np.flatnonzero((seq_lens + block_size - 1) // block_size >= min_blocks)
    score_row = np.full(query.shape[0], -1, np.int64)
    score_row[selecting] = np.arange(selecting.size)
    if selecting.size == query.shape[0]:
        rows_query, table, lens = query, block_table, seq_lens
    else:
        rows_query, table, lens = query[selecting], block_table[selecting], seq_lens[selecting]
    nc = min(max(score_channels, 1), query.shape[2])
    q_r = np.empty((table.shape[0], query.shape[1], nc), np.float32)
    channels = np.empty((table.shape[0], num_kv_heads, nc), np.int64)
    sparq_query_kernel(rows_query, num_kv_heads, scale, q_r, channels)
    lse = np.full((table.shape[0], query.shape[1], table.shape[1]), -np.inf, np.float32)
    keys_args = (words, shift, *strides, tile_tokens, tile_dims)  # block_lse_kernel's view of the paged keys
    status = block_lse_kernel(q_r, channels, *keys_args, table, lens, block_size, cache_blocks, tile_blocks, lse)
    return status, lse, score_row
