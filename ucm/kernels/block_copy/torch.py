"""The block copy in plain torch ops (``impl="torch"``): strided copies on integer views, any device (the default on
devices other than CPU and CUDA). :func:`copy_torch` takes the arguments of
:func:`ucm.kernels.block_copy.ops.copy_blocks`."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ucm.kernels.layouts import CPU_LAYOUTS, KVLayout, cpu_attn_kv_views, int_view


def copy_torch(
    kv_caches: Sequence[torch.Tensor], ids: torch.Tensor, layout: KVLayout, staging: torch.Tensor, gather: bool
) -> None:
    """Move every layer's shard of blocks ``ids`` between ``kv_caches`` and ``staging`` (``gather``: paged ->
    staging): one strided copy per layer and part, through advanced indexing (gather) or ``index_copy_`` (scatter)."""
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
