"""paged_keys: one layer's keys read in place from vLLM's paged KV cache (a strided view, no copy), and the helpers
every reader of such keys uses (GSA: ``ucm.kernels.key_bounds``, ``ucm.kernels.sparq``, ``ucm.sparse.gsa``).

Paged keys come in two forms, both views of the cache's memory with any strides:

- plain: ``[num_blocks, num_kv_heads, block_size, head_dim]`` (CPU_ATTN: K stored transposed, so the last two dims
  have strides ``(1, block_size)``; FLASH_NHD: ``(num_kv_heads * head_dim, 1)``; tests also pass plain tensors);
- tiled: ``[num_blocks, num_kv_heads, block_size / TT, TT, head_dim / TD, TD]``: token ``t`` is token ``t % TT``
  of token tile ``t // TT`` and component ``c`` is ``c % TD`` of component group ``c // TD``. CPU_ATTN_AMX has only
  this form (``TT = 16``, ``TD = 2``: each 16-token tile is ``[head_dim / 2, 16 tokens, 2 components]``, see
  ``ucm.kernels.layouts``): its token and component strides change inside a block, which no 4-D view can express.

A plain view is a tiled one with one tile of each kind (:func:`tiled_keys`: ``keys[:, :, None, :, None, :]``,
``TT = block_size``, ``TD = head_dim``), so the kernels take either form and address the tiled one: element
``(b, h, t, c)`` at::

    b * s0 + h * s1 + (t // TT) * s2 + (t % TT) * s3 + (c // TD) * s4 + (c % TD) * s5      (s: its strides)

Readers take sizes from :func:`key_geometry` and copies of whole blocks in plain order from :func:`block_keys`, never
from ``keys.shape`` or by indexing ``keys`` directly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ucm.kernels.layouts import KVLayout, cpu_attn_kv_views, paged_shape

KEY_LAYOUTS = (KVLayout.CPU_ATTN, KVLayout.CPU_ATTN_AMX, KVLayout.FLASH_NHD)  # layouts with per-head keys

Strides6 = tuple[int, int, int, int, int, int]


def paged_keys(cache: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """The keys of one layer's paged KV tensor ``cache`` as a view of its memory (no copy): plain ``[num_blocks,
    num_kv_heads, block_size, head_dim]`` for CPU_ATTN and FLASH_NHD, tiled ``[num_blocks, num_kv_heads,
    block_size / 16, 16, head_dim / 2, 2]`` for CPU_ATTN_AMX (see the module doc). Same dtype as ``cache``.

    Raises:
        ValueError: ``layout`` is MLA (a latent has no per-head keys) or ``cache`` does not fit ``layout``.
    """
    if layout not in KEY_LAYOUTS:
        raise ValueError(
            f"GSA reads per-head keys; layout {layout.value!r} is not supported; allowed: "
            f"{[lay.value for lay in KEY_LAYOUTS]}"
        )
    paged_shape(layout, cache)
    if layout == KVLayout.FLASH_NHD:
        return cache[0].permute(0, 2, 1, 3)  # [nb, bs, H, D] -> [nb, H, bs, D]
    k, _ = cpu_attn_kv_views(cache, layout)
    if layout == KVLayout.CPU_ATTN:
        return k.transpose(1, 2)  # [nb, bs, H, D] -> [nb, H, bs, D]
    return k.permute(0, 3, 1, 2, 4, 5)  # [nb, bs/16, 16, H, D/2, 2] -> [nb, H, bs/16, 16, D/2, 2]


def key_geometry(keys: torch.Tensor) -> tuple[int, int, int, int]:
    """``(num_blocks, num_kv_heads, block_size, head_dim)`` of plain or tiled paged keys.

    Raises:
        ValueError: ``keys`` is neither 4-D (plain) nor 6-D (tiled).
    """
    if keys.dim() == 4:
        nb, h, bs, d = keys.shape
        return nb, h, bs, d
    if keys.dim() == 6:
        nb, h, tiles, tt, groups, td = keys.shape
        return nb, h, tiles * tt, groups * td
    raise ValueError(
        "keys must be plain [num_blocks, num_kv_heads, block_size, head_dim] or tiled [num_blocks, num_kv_heads, "
        f"block_size / TT, TT, head_dim / TD, TD], got {keys.dim()}-D {tuple(keys.shape)}"
    )


def tiled_keys(keys: torch.Tensor) -> torch.Tensor:
    """``keys`` in the tiled form ``[num_blocks, num_kv_heads, block_size / TT, TT, head_dim / TD, TD]``, a view
    (no copy): tiled keys as they are, plain ones as ``keys[:, :, None, :, None, :]`` (one tile of each kind).

    Raises:
        ValueError: as :func:`key_geometry`.
    """
    key_geometry(keys)
    return keys if keys.dim() == 6 else keys[:, :, None, :, None, :]


def key_tiling(keys: torch.Tensor) -> tuple[Strides6, int, int]:
    """``(strides, TT, TD)`` of the tiled form of ``keys``: its six strides in elements (``s0`` .. ``s5`` of the
    module doc), tokens per token tile and components per component group: what a kernel needs to address element
    ``(b, h, t, c)``.

    Raises:
        ValueError: as :func:`key_geometry`.
    """
    tiled = tiled_keys(keys)
    s0, s1, s2, s3, s4, s5 = tiled.stride()
    return (s0, s1, s2, s3, s4, s5), tiled.shape[3], tiled.shape[5]


def block_keys(keys: torch.Tensor, block_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """The keys of blocks ``block_ids`` (int ``[n]``, on ``keys``' device or a list), a copy in plain order
    ``[n, num_kv_heads, block_size, head_dim]`` of ``keys``' dtype.

    Raises:
        ValueError: as :func:`key_geometry`.
        IndexError: a block id outside ``[-num_blocks, num_blocks)``.
    """
    _, h, bs, d = key_geometry(keys)
    ids = torch.as_tensor(block_ids, dtype=torch.int64, device=keys.device)
    return keys[ids].reshape(ids.numel(), h, bs, d)
