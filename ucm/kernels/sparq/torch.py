"""The SparQ ops in torch (``impl="torch"``, any device; the CPU path for keys the numba kernel does not take)."""

from __future__ import annotations

import torch

from ucm.kernels.paged_keys import key_geometry, key_tiling, tiled_keys


def sparq_query_torch(
    query: torch.Tensor, num_kv_heads: int, channels: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ucm.kernels.sparq.sparq_query` in torch ops, any device."""
    r, hq, d = query.shape
    group = hq // num_kv_heads
    q = query.float().view(r, num_kv_heads, group, d)
    c = max(1, min(channels, d))
    idx = q.abs().sum(2).topk(c, dim=-1).indices  # [R, KVH, C]
    q_r = q.gather(3, idx[:, :, None, :].expand(-1, -1, group, -1))  # [R, KVH, group, C]
    share = q_r.abs().sum(-1) / q.abs().sum(-1).clamp_min(1e-30)  # [R, KVH, group]: the |q| the components keep
    q_r = q_r * (scale / share.clamp_min(1e-30).sqrt())[..., None]
    return q_r.reshape(r, hq, c), idx


def key_rows(keys: torch.Tensor) -> torch.Tensor | None:
    """``keys`` as rows of ``block_size`` contiguous values, one per (block, KV head, component): a 2-D view
    ``[rows, block_size]`` whose row ``(b * s0 + h * s1 + c * sc) / sc`` is block ``b``'s keys of head ``h`` at
    component ``c`` (``s0``, ``s1``: the block and head strides, ``sc`` the component's); ``None`` where the layout
    has no such view (tokens not contiguous or in several tiles, components in groups, or block/head strides not
    multiples of the component's). CPU_ATTN has one; CPU_ATTN_AMX and FLASH_NHD do not."""
    nb, h, bs, d = key_geometry(keys)
    (s0, s1, _, st, _, sc), tile_tokens, tile_dims = key_tiling(keys)
    if tile_tokens != bs or tile_dims != d or st != 1 or sc < 1 or s0 % sc or s1 % sc:
        return None
    rows = ((nb - 1) * s0 + (h - 1) * s1 + (d - 1) * sc) // sc + 1
    return keys.as_strided((rows, bs), (sc, 1))


def lse_torch(
    q: torch.Tensor, channels: torch.Tensor, keys: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor
) -> torch.Tensor:
    """:func:`ucm.kernels.sparq.sparq_block_lse` as a gather, a batched matmul and ``logsumexp``; float32 ``[R,
    num_heads, W]`` on ``q``'s device."""
    r, hq, c = q.shape
    _, h, bs, _ = key_geometry(keys)
    w = block_table.shape[1]
    cols = torch.arange(w, device=q.device)
    n = torch.div(seq_lens.long() + bs - 1, bs, rounding_mode="floor")
    inside = cols[None, :] < n[:, None]  # [R, W]
    ids = torch.where(inside, block_table.long(), 0)  # unused entries may hold anything; read block 0 instead
    # Gather in ascending block id (memory) order: the hardware prefetchers then follow the reads (a shuffled
    # table, as a long-running engine's, otherwise makes every run a cache miss: much slower). ``pos[r, w]``:
    # where block ``w`` of row ``r`` lands in that order.
    order = ids.argsort(dim=1)
    ids = ids.gather(1, order)
    pos = torch.empty_like(order).scatter_(1, order, cols.expand(r, w).contiguous())
    heads = torch.arange(h, device=q.device)
    rows = key_rows(keys)
    if rows is not None:
        # Row ids ordered (request, KV head, component, block): the gathered runs form [R, H, C, W * block_size].
        (s0, s1, _, _, _, sc), _, _ = key_tiling(keys)
        row_ids = (ids[:, None, None, :] * (s0 // sc) + heads[None, :, None, None] * (s1 // sc)) + channels[..., None]
        k = rows.index_select(0, row_ids.flatten()).view(r, h, c, w * bs)
    else:  # any other layout, on the tiled form: advanced indexing gives [R, H, C, W, tiles, tile tokens]
        tile_dims = key_tiling(keys)[2]
        group, within = (channels // tile_dims)[..., None], (channels % tile_dims)[..., None]
        k = tiled_keys(keys)[ids[:, None, None, :], heads[None, :, None, None], :, :, group, within]
        k = k.reshape(r, h, c, w * bs)
    logits = torch.matmul(q.view(r, h, hq // h, c), k.float()).view(r, hq, w, bs)  # blocks in gather order
    lse = torch.logsumexp(logits, dim=-1)  # [R, HQ, W]
    # Only a row's last block can hold tokens past its length: redo that block with them masked.
    every = torch.arange(r, device=q.device)
    last = (n - 1).clamp(min=0)
    col = pos.gather(1, last[:, None])[:, 0]  # [R]: the last block's place in gather order
    tail = logits[every, :, col]  # [R, HQ, block_size]
    past = torch.arange(bs, device=q.device)[None, :] >= (seq_lens.long() - last * bs)[:, None]  # [R, bs]
    lse[every, :, col] = torch.logsumexp(tail.masked_fill(past[:, None, :], float("-inf")), dim=-1)
    out = lse.gather(2, pos[:, None, :].expand(r, hq, w))  # back to block table order
    return out.masked_fill_(~inside[:, None, :], float("-inf"))
