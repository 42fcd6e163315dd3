"""sparq_scores: per-block log-sum-exp of decode-query logits approximated from a few key components (SparQ).

For request ``r``, query head ``j`` (KV head ``h = j // (num_heads / num_kv_heads)``) and the ``w``-th block of its
block table (``b = block_table[r, w]``), over the block's tokens ``t`` inside the request
(``w * block_size + t < seq_lens[r]``)::

    s[t]           = sum_c q[r, j, c] * K[b, h, t, channels[r, h, c]]
    lse[r, j, w]   = log(sum_t exp(s[t]))                  (-inf for a block with no such token)

``q`` holds only the chosen components of each query head (already multiplied by the head's softmax scale), so
``s`` is step 2 of SparQ Attention (Ribar et al. 2024, "SparQ Attention: Bandwidth-Efficient LLM Inference"): an
approximation of the attention logits that reads ``C`` of the ``head_dim`` components of every key. The share of
head ``j``'s attention block ``w`` would get is then ``softmax_w(lse[r, j, :])`` (``ucm.sparse.gsa.sparq_scores``);
returning per-block log-sum-exps rather than per-token logits keeps the output ``block_size`` times smaller and
lets a GPU program finish a block in one pass.

Keys are read in place from vLLM's paged cache, in either form of ``ucm.kernels.paged_keys`` (plain ``[num_blocks,
num_kv_heads, block_size, head_dim]`` strided view, or tiled ``[num_blocks, num_kv_heads, block_size / TT, TT,
head_dim / TD, TD]``). In the CPU_ATTN layout a block's keys are stored transposed, so one component of one block is
one contiguous run of ``block_size`` values; in CPU_ATTN_AMX it is one run of 16 values at stride 2 per 16-token tile
(one 64-byte cache line in bf16). The CPU paths read exactly those runs, in ascending block id order.

The sum over components is an fp32 reduction whose order differs between implementations; results agree to fp32
rounding (tests use a tolerance), not bit for bit.

Implementations (``impl=``): ``"triton"`` (one program per (request, KV head, block), all query heads of the KV head
at once; the default on CUDA; the interpreter on CPU tensors, tests only), ``"numba"`` (one fused pass: gather with
prefetch, logits and log-sum-exp per tile of blocks, see ``ucm.kernels._numba_sparq``; the default on CPU for
bf16/fp32 keys in vLLM's CPU layouts, :func:`numba_applies`) and ``"torch"`` (gather + batched matmul +
``logsumexp``: any other CPU case); :func:`sparq_block_lse_reference` is the oracle (loops over requests, heads and
blocks).
"""

from __future__ import annotations

import os

import numpy as np
import torch
import triton
import triton.language as tl

from ucm.kernels._block_copy import _interpreted
from ucm.kernels.paged_keys import block_keys, key_geometry, key_tiling, tiled_keys

IMPLS = ("auto", "triton", "numba", "torch")


def _check(
    q: torch.Tensor, channels: torch.Tensor, keys: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor
) -> None:
    _, h, bs, d = key_geometry(keys)
    if keys.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"keys must be float16/bfloat16/float32, got {keys.dtype}")
    if q.dim() != 3 or q.dtype != torch.float32:
        raise ValueError(f"q must be float32 [R, num_heads, C], got {q.dtype} {tuple(q.shape)}")
    r, hq, c = q.shape
    if hq % h:
        raise ValueError(f"num_heads ({hq}) must be a multiple of num_kv_heads ({h})")
    if tuple(channels.shape) != (r, h, c) or channels.dtype != torch.int64:
        raise ValueError(f"channels must be int64 [{r}, {h}, {c}], got {channels.dtype} {tuple(channels.shape)}")
    if channels.numel() and (int(channels.min()) < 0 or int(channels.max()) >= d):
        raise ValueError(
            f"channels must lie in [0, {d}) (head_dim), got values in [{int(channels.min())}, {int(channels.max())}]"
        )
    if block_table.dim() != 2 or block_table.shape[0] != r or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"block_table must be int32/int64 [{r}, W], got {block_table.dtype} {tuple(block_table.shape)}"
        )
    w = block_table.shape[1]
    if tuple(seq_lens.shape) != (r,) or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seq_lens must be int32/int64 [{r}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    if r and (int(seq_lens.min()) < 0 or int(seq_lens.max()) > w * bs):
        raise ValueError(f"seq_lens must lie in [0, {w * bs}] (block table width {w} x block_size {bs})")
    for name, t in (("channels", channels), ("keys", keys), ("block_table", block_table), ("seq_lens", seq_lens)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}: must be on one device")


def sparq_block_lse(
    q: torch.Tensor,
    channels: torch.Tensor,
    keys: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    impl: str = "auto",
) -> torch.Tensor:
    """Per-block log-sum-exp of the approximate logits (see the module doc): float32 ``[R, num_heads, W]``.

    Args:
        q: float32 ``[R, num_heads, C]``, each query head's components at its KV head's ``channels``, times the
            head's softmax scale.
        channels: int64 ``[R, num_kv_heads, C]``, the key components read per row and KV head, in ``[0, head_dim)``.
        keys: paged keys (``ucm.kernels.paged_keys.paged_keys``), plain ``[num_blocks, num_kv_heads, block_size,
            head_dim]`` or tiled ``[num_blocks, num_kv_heads, block_size / TT, TT, head_dim / TD, TD]``, any strides,
            float16/bfloat16/float32.
        block_table: int32/int64 ``[R, W]`` vLLM block ids of each request, in token order; entries past a row's
            ``ceil(seq_lens / block_size)`` blocks are not read.
        seq_lens: int32/int64 ``[R]`` tokens per request, in ``[0, W * block_size]``.
        impl: ``"auto"`` (Triton on CUDA; on CPU numba where it applies, else torch), ``"triton"``, ``"numba"`` or
            ``"torch"``.

    Raises:
        ValueError: bad shapes (keys neither plain nor tiled), dtypes, devices or channel indices, unknown
            ``impl``, or ``"numba"`` for keys it does not take (:func:`numba_applies`).
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {list(IMPLS)}, got {impl!r}")
    _check(q, channels, keys, block_table, seq_lens)
    if impl == "auto":
        impl = "triton" if q.device.type == "cuda" else "numba" if numba_applies(keys) else "torch"
    if impl == "numba":
        if not numba_applies(keys):
            raise ValueError(
                "impl='numba' takes CPU keys of dtype bfloat16 or float32 whose tokens are contiguous (stride 1, as "
                "in CPU_ATTN) or in tiles whose run of one component fits a cache line (as in CPU_ATTN_AMX), got "
                f"{keys.dtype} on {keys.device} of shape {tuple(keys.shape)} with strides {tuple(keys.stride())}"
            )
        return _lse_numba(q, channels, keys, block_table, seq_lens)
    if impl == "triton":
        out = torch.empty((q.shape[0], q.shape[1], block_table.shape[1]), dtype=torch.float32, device=q.device)
        if out.numel():
            _lse_triton(q, channels, keys, block_table, seq_lens, out)
        return out
    return _lse_torch(q, channels, keys, block_table, seq_lens)


def sparq_block_lse_reference(
    q: torch.Tensor, channels: torch.Tensor, keys: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor
) -> torch.Tensor:
    """Test oracle: the same ``[R, num_heads, W]`` log-sum-exps, one request, head and block at a time (``keys``
    plain or tiled, as :func:`sparq_block_lse`)."""
    r, hq, _ = q.shape
    _, h, bs, _ = key_geometry(keys)
    group = hq // h
    out = torch.full((r, hq, block_table.shape[1]), float("-inf"), dtype=torch.float32)
    for i in range(r):
        length = int(seq_lens[i])
        for w in range(-(-length // bs)):
            count = min(bs, length - w * bs)
            block = block_keys(keys, [int(block_table[i, w])])[0]  # [H, bs, D]
            for j in range(hq):
                k = block[j // group, :count][:, channels[i, j // group]].float()  # [count, C]
                out[i, j, w] = torch.logsumexp(k @ q[i, j], dim=0)
    return out


def _key_rows(keys: torch.Tensor) -> torch.Tensor | None:
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


_LINE_BYTES = 64  # bytes per cache line


def numba_applies(keys: torch.Tensor) -> bool:
    """Whether the numba kernel takes ``keys`` (plain or tiled): on CPU, bf16 or fp32, non-negative strides, and
    each token tile's run of one component either contiguous (token stride 1: CPU_ATTN, one tile of
    ``block_size`` tokens) or within one cache line (CPU_ATTN_AMX: 16 tokens at stride 2, 64 bytes in bf16)."""
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


def numba_tile_blocks(block_size: int) -> int:
    """Blocks per tile of the numba kernel."""
    return max(1, _TILE_TOKENS // block_size)


def _lse_numba(
    q: torch.Tensor, channels: torch.Tensor, keys: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor
) -> torch.Tensor:
    from ucm.kernels import _numba_sparq  # numba is slow to import: only when the CPU path first runs

    nb, _, bs, _ = key_geometry(keys)
    out = torch.full((q.shape[0], q.shape[1], block_table.shape[1]), float("-inf"), dtype=torch.float32)
    if out.numel() == 0:
        return out
    (s0, s1, s2, s3, s4, s5), tile_tokens, tile_dims = key_tiling(keys)
    words, shift = key_words(keys)
    lens = seq_lens.long()
    status = _numba_sparq.block_lse(
        q.contiguous().numpy(),
        channels.contiguous().numpy(),
        words,
        shift,
        s0,
        s1,
        s2,
        s3,
        s4,
        s5,
        tile_tokens,
        tile_dims,
        block_table.contiguous().numpy(),
        lens.numpy(),
        bs,
        nb,
        numba_tile_blocks(bs),
        out.numpy(),
    )
    if status:
        raise_bad_block_ids(block_table, seq_lens, bs, nb)
    return out


def _lse_torch(
    q: torch.Tensor, channels: torch.Tensor, keys: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor
) -> torch.Tensor:
    r, hq, c = q.shape
    _, h, bs, _ = key_geometry(keys)
    w = block_table.shape[1]
    cols = torch.arange(w, device=q.device)
    n = torch.div(seq_lens.long() + bs - 1, bs, rounding_mode="floor")
    inside = cols[None, :] < n[:, None]  # [R, W]
    ids = torch.where(inside, block_table.long(), 0)  # unused entries may hold anything; read block 0 instead
    # Gather in ascending block id (memory) order: the hardware prefetchers then follow the reads (a shuffled
    # table, as a long-running engine's, otherwise makes every run a cache miss: ~3x slower here). ``pos[r, w]``:
    # where block ``w`` of row ``r`` lands in that order.
    order = ids.argsort(dim=1)
    ids = ids.gather(1, order)
    pos = torch.empty_like(order).scatter_(1, order, cols.expand(r, w).contiguous())
    heads = torch.arange(h, device=q.device)
    rows = _key_rows(keys)
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


@triton.jit
def _sparq_lse_kernel(
    q_ptr,  # [R, HQ, C] float32 contiguous
    ch_ptr,  # [R, NUM_KV_HEADS, C] int64 contiguous
    k_ptr,  # paged keys, tiled: (b, h, t, c) at b*stride_kb + h*stride_kh + (t // TILE_T)*stride_ktt
    #         + (t % TILE_T)*stride_kt + (c // TILE_D)*stride_kdd + (c % TILE_D)*stride_kd
    table_ptr,  # [R, W] block ids
    lens_ptr,  # [R] tokens per request
    out_ptr,  # [R, HQ, W] float32
    stride_kb,
    stride_kh,
    stride_ktt,
    stride_kt,
    stride_kdd,
    stride_kd,
    stride_table,
    W,
    C: tl.constexpr,  # components per KV head: a constexpr, so the loop over them has a static bound
    HQ: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_T: tl.constexpr,  # tokens per token tile (block_size for plain keys)
    TILE_D: tl.constexpr,  # components per component group (head_dim for plain keys)
    BLOCK_G: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    w = tl.program_id(2).to(tl.int64)
    group: tl.constexpr = HQ // NUM_KV_HEADS
    count = tl.load(lens_ptr + r).to(tl.int64) - w * BLOCK_SIZE  # tokens of this block inside the request
    o_g = tl.arange(0, BLOCK_G).to(tl.int64)
    o_t = tl.arange(0, BLOCK_T).to(tl.int64)
    m_g = o_g < group
    m_t = (o_t < BLOCK_SIZE) & (o_t < count)
    b = tl.load(table_ptr + r * stride_table + w, mask=count > 0, other=0).to(tl.int64)
    heads = r * HQ + h * group + o_g  # [BG] rows of q and out
    p_t = k_ptr + b * stride_kb + h * stride_kh + (o_t // TILE_T) * stride_ktt + (o_t % TILE_T) * stride_kt  # [BT]
    s = tl.zeros((BLOCK_G, BLOCK_T), dtype=tl.float32)
    for i in range(C):
        c = tl.load(ch_ptr + (r * NUM_KV_HEADS + h) * C + i).to(tl.int64)
        o_c = (c // TILE_D) * stride_kdd + (c % TILE_D) * stride_kd
        k = tl.load(p_t + o_c, mask=m_t, other=0.0).to(tl.float32)  # [BT]: one key component
        qc = tl.load(q_ptr + heads * C + i, mask=m_g, other=0.0)  # [BG]
        s += qc[:, None] * k[None, :]
    s = tl.where(m_t[None, :], s, float("-inf"))
    m = tl.max(s, axis=1)  # [BG]; -inf for a block past the request
    m_safe = tl.where(m > float("-inf"), m, 0.0)
    lse = m_safe + tl.log(tl.sum(tl.exp(s - m_safe[:, None]), axis=1))  # log(0) = -inf past the request
    tl.store(out_ptr + heads * W + w, lse, mask=m_g)


def sparq_kernel_meta(
    num_heads: int, num_kv_heads: int, block_size: int, tile_tokens: int, tile_dims: int, num_channels: int
) -> dict[str, int]:
    """The constexprs of ``_sparq_lse_kernel`` chosen from the shape, the keys' tiling (``TT``, ``TD`` of
    ``ucm.kernels.paged_keys.key_tiling``) and the components read per KV head (also used by the sm_90 compile
    test). The component count is a constexpr (one compilation per ``score_channels``): with a runtime bound, the
    Triton interpreter converts a 1-element array to an int, which numpy 2.5 refuses."""
    return {
        "C": num_channels,
        "HQ": num_heads,
        "NUM_KV_HEADS": num_kv_heads,
        "BLOCK_SIZE": block_size,
        "TILE_T": tile_tokens,
        "TILE_D": tile_dims,
        "BLOCK_G": triton.next_power_of_2(num_heads // num_kv_heads),
        "BLOCK_T": triton.next_power_of_2(block_size),
    }


def _lse_triton(
    q: torch.Tensor,
    channels: torch.Tensor,
    keys: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
) -> None:
    r, hq, c = q.shape
    _, h, bs, _ = key_geometry(keys)
    strides, tile_tokens, tile_dims = key_tiling(keys)
    w = block_table.shape[1]
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    kernel = _interpreted(_sparq_lse_kernel) if q.device.type == "cpu" else _sparq_lse_kernel
    kernel[(r, h, w)](
        q.contiguous(),
        channels.contiguous(),
        keys,
        block_table,
        seq_lens,
        out,
        *strides,
        block_table.stride(0),
        w,
        num_warps=1 if os.environ.get("TRITON_INTERPRET") == "1" else 4,
        **sparq_kernel_meta(hq, h, bs, tile_tokens, tile_dims, c),
    )
