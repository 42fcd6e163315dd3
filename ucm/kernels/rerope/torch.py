"""ReRoPE attention over vLLM's paged KV cache, in torch (the CPU path; the oracle is ``naive``).

vLLM caches keys already rotated by their absolute positions, and the model hands attention queries rotated by
theirs. ReRoPE (Su Jianlin, "Rectified Rotary Position Embeddings", 2023; bojone/rerope) needs, for a query at
position ``i`` and a key at position ``j`` with ``d = i - j >= window``, the score at the relative position
``r = window + (d - window) / leaky_factor`` (``window`` for plain ReRoPE) instead of ``d``. Rotations compose
(``R(a) R(b) = R(a + b)``), so this is re-rotation on the fly, with no second key copy in memory:

- near keys (``d < window``): ``q_i . k_j`` as cached (ordinary RoPE attention);
- far keys: ``(R(a_i) q_i) . (R(b_j) k_j)`` with ``b_j = j / leaky_factor - j`` and ``a_i = window - window /
  leaky_factor + i / leaky_factor - i``, so that ``a_i + i - (b_j + j) = r`` (plain ReRoPE: ``b_j = -j``, the key
  back at position 0, and ``a_i = window - i``).

The two score matrices are merged by the mask ``d < window`` before one softmax. Queries are scored in chunks of
:data:`QUERY_CHUNK`; a chunk whose last query is at position ``p`` reads only keys ``0..p`` (causal), the near
scores only over the band of keys within ``window`` of one of its queries, and the far scores only over the keys at
least ``window`` before its last query, so a prefill does about half the score work of the full square and a decode
step scores ``window`` near keys instead of all of them. Rotation angles are computed in float64 (positions times
inverse frequencies reach thousands of radians), the rotated vectors, scores and softmax in float32, the output in
the query's dtype.

Layouts: the CPU kernel variants' ``KVLayout.CPU_ATTN`` (``vec``, ``vec16``) and ``KVLayout.CPU_ATTN_AMX`` (``amx``),
read through ``ucm.kernels.layouts.cpu_attn_kv_views`` (gathered per request into head-major float32 ``[num_kv_heads,
tokens, head_dim]``, the order the score and output matmuls read).
"""

from __future__ import annotations

import math

import torch

from ucm.kernels.layouts import KVLayout, cpu_attn_kv_views

# Queries scored at once per request (bounds the [chunk, heads, keys] score matrices).
QUERY_CHUNK = 256


def check_rerope_args(
    num_heads: int, num_kv_heads: int, head_dim: int, window: int, leaky_factor: float, rotary_dim: int | None
) -> int:
    """Check ReRoPE's attention arguments shared by every implementation; return ``rotary_dim`` (None: head_dim).

    Raises:
        ValueError: heads that do not group (``num_heads % num_kv_heads``), ``window`` < 1, ``leaky_factor`` < 1, or a
            ``rotary_dim`` odd, < 2 or above ``head_dim``.
    """
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if not leaky_factor >= 1:
        raise ValueError(f"leaky_factor must be >= 1 (inf: plain ReRoPE, 1: RoPE), got {leaky_factor}")
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim must be even, >= 2 and <= head_dim ({head_dim}), got {rotary_dim}")
    return rotary_dim


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of RoPE's angles at ``positions`` (float64 ``[n]``, any real values), computed in float64:
    float32 ``[n, 1, rotary_dim / 2]`` each."""
    half = rotary_dim // 2
    inv_freq = base ** (-torch.arange(half, dtype=torch.float64) * 2 / rotary_dim)
    angles = positions[:, None] * inv_freq[None, :]
    return angles.cos().to(torch.float32)[:, None, :], angles.sin().to(torch.float32)[:, None, :]


class _KeyAngles:
    """cos/sin of the far keys' re-rotation ``b_j = j * inv_k - j`` for ``j < n``, grown on demand and kept per
    (rotary_dim, base, inv_k): a decode step then re-rotates its keys without computing a trigonometric function."""

    def __init__(self) -> None:
        self._tables: dict[tuple[int, float, float], tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, n: int, rotary_dim: int, base: float, inv_k: float) -> tuple[torch.Tensor, torch.Tensor]:
        key = (rotary_dim, base, inv_k)
        table = self._tables.get(key)
        if table is None or table[0].shape[0] < n:
            size = max(n, 2 * table[0].shape[0] if table is not None else 1024)
            j = torch.arange(size, dtype=torch.float64)
            table = rope_cos_sin(j * inv_k - j, rotary_dim, base)
            self._tables[key] = table
        return table[0][:n], table[1][:n]


_KEY_ANGLES = _KeyAngles()


def rotate_by(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, base: float, neox: bool) -> torch.Tensor:
    """``x`` (``[n, heads, head_dim]``) rotated by RoPE at ``positions`` (float64 ``[n]``, any real values, e.g.
    negative or fractional), the angles in float64, the result float32 ``[n, heads, head_dim]``."""
    return rotate_with(x, *rope_cos_sin(positions, rotary_dim, base), rotary_dim, neox)


def rotate_with(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, neox: bool) -> torch.Tensor:
    """``x`` (``[n, heads, head_dim]``) rotated by the angles whose cos and sin are given (float32 ``[n, 1,
    rotary_dim / 2]``, :func:`rope_cos_sin`); float32 ``[n, heads, head_dim]``. Written as ``x * cos + rotate_half(x)
    * sin`` over the rotated channels (the pairs are the two halves for NeoX, neighbours for GPT-J)."""
    x = x.to(torch.float32)
    rot = x[..., :rotary_dim]
    if neox:
        first, second = rot.chunk(2, dim=-1)
        turned = torch.cat((-second, first), dim=-1)
        cos_full, sin_full = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    else:
        pairs = rot.unflatten(-1, (-1, 2))
        turned = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
        cos_full, sin_full = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    rotated = rot * cos_full + turned * sin_full
    return rotated if rotary_dim == x.shape[-1] else torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


def _request_kv(
    kv_cache: torch.Tensor, layout: KVLayout, block_ids: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``seq_len`` tokens' K and V of a request whose blocks are ``block_ids``, head-major: float32
    ``[num_kv_heads, seq_len, head_dim]`` each (rows contiguous). Two passes over the data: the request's blocks are
    gathered whole, then each of K and V is copied once out of :func:`cpu_attn_kv_views` of them (whose dims, in
    order, are the canonical ``[block, token, head, dim]`` with the token and dim axes split where the layout tiles
    them) into the head-major buffer."""
    _, num_kv_heads, block_size, two_d = kv_cache.shape
    head_dim = two_d // 2
    n = -(-seq_len // block_size)
    blocks = kv_cache[block_ids[:n].long()]  # [n, num_kv_heads, block_size, 2 * head_dim]
    head_axis = 2 if layout == KVLayout.CPU_ATTN else 3  # after the block axis and the (split) token axes
    out = []
    for part in cpu_attn_kv_views(blocks, layout):
        shape = part.shape
        head_major = torch.empty((num_kv_heads, n * block_size, head_dim), dtype=torch.float32)
        dst = head_major.view(num_kv_heads, n, *shape[1:head_axis], *shape[head_axis + 1 :])
        dst.copy_(part.movedim(head_axis, 0))
        out.append(head_major[:, :seq_len])
    return out[0], out[1]


def _head_major(q: torch.Tensor, num_kv_heads: int, group: int) -> torch.Tensor:
    """Queries ``[n, num_kv_heads * group, head_dim]`` as the rows each KV head scores: ``[num_kv_heads, group * n,
    head_dim]`` (row ``g * n + i`` is query ``i``'s head ``h * group + g``)."""
    n, _, head_dim = q.shape
    return q.view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(num_kv_heads, group * n, head_dim)


def rerope_paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layout: KVLayout,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    window: int,
    leaky_factor: float = math.inf,
    rotary_dim: int | None = None,
    base: float = 10000.0,
    neox: bool = True,
    scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal ReRoPE attention of a step's queries over one layer's paged KV (see the module docstring).

    Args:
        query: ``[num_tokens, num_heads, head_dim]`` queries rotated by their absolute positions (as vLLM's
            attention receives them); request ``r``'s are rows ``query_start_loc[r] .. query_start_loc[r + 1]``,
            the last tokens of its ``seq_lens[r]``.
        kv_cache: ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]`` in ``layout`` (CPU_ATTN or
            CPU_ATTN_AMX), keys rotated by their absolute positions, this step's already written.
        block_table: int ``[num_reqs, max_blocks]``; seq_lens: int ``[num_reqs]``; query_start_loc: int
            ``[num_reqs + 1]``.
        window: ReRoPE's window (>= 1); leaky_factor: >= 1 (``inf``: plain ReRoPE).
        rotary_dim: rotated channels (None: head_dim); base: ``rope_theta``; neox: GPT-NeoX rotation.
        scale: score scale (None: ``head_dim ** -0.5``).
        out: ``[num_tokens, num_heads, head_dim]`` written in place when given.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``query``'s dtype (``out`` when given).

    Raises:
        ValueError: a layout other than CPU_ATTN / CPU_ATTN_AMX, a cache that does not fit it, ``window`` < 1,
            ``leaky_factor`` < 1, a bad ``rotary_dim``, or heads that do not group (num_heads % num_kv_heads).
    """
    _, num_heads, head_dim = query.shape
    cpu_attn_kv_views(kv_cache, layout)  # checks the layout and that the cache fits it (ValueError)
    num_kv_heads = kv_cache.shape[1]
    rotary_dim = check_rerope_args(num_heads, num_kv_heads, head_dim, window, leaky_factor, rotary_dim)
    scale = head_dim**-0.5 if scale is None else scale
    group = num_heads // num_kv_heads
    inv_k = 0.0 if math.isinf(leaky_factor) else 1.0 / leaky_factor
    result = torch.empty_like(query) if out is None else out
    for r in range(seq_lens.shape[0]):
        q0, q1 = int(query_start_loc[r]), int(query_start_loc[r + 1])
        if q1 == q0:
            continue
        seq_len = int(seq_lens[r])
        keys, values = _request_kv(kv_cache, layout, block_table[r], seq_len)  # [Hkv, L, D] each
        far_keys = None
        if seq_len - 1 >= window:  # some query-key distance reaches the window: keys 0..L-1-window are far for one
            n_far = seq_len - window
            cos, sin = _KEY_ANGLES.get(n_far, rotary_dim, base, inv_k)  # [n_far, 1, rotary_dim / 2]
            far_keys = rotate_with(keys[:, :n_far], cos.view(1, n_far, -1), sin.view(1, n_far, -1), rotary_dim, neox)
        for c0 in range(q0, q1, QUERY_CHUNK):
            c1 = min(q1, c0 + QUERY_CHUNK)
            n = c1 - c0
            p0, p1 = seq_len - (q1 - c0), seq_len - (q1 - c1)  # the chunk's query positions: p0 .. p1 - 1
            q_pos = torch.arange(p0, p1, dtype=torch.float64)
            # Keys 0..p1-1 (causal); near: band_start..p1-1 (distance < window for some query); far: 0..far_end-1
            # (distance >= window for some query). Between band_start and far_end a key is near for some queries and
            # far for others.
            band_start, far_end = max(0, p0 - window + 1), max(0, p1 - window)
            # Grouped-query heads: query head h reads KV head h // group; rows of KV head h: (g, query) g-major.
            q = _head_major(query[c0:c1].to(torch.float32), num_kv_heads, group)  # [Hkv, G * n, D]
            near = torch.matmul(q, keys[:, band_start:p1].transpose(1, 2)).view(num_kv_heads, group, n, -1)
            if far_end == 0:
                scores = near
            else:
                assert far_keys is not None
                q_far = rotate_by(query[c0:c1], window * (1 - inv_k) + q_pos * inv_k - q_pos, rotary_dim, base, neox)
                far = torch.matmul(_head_major(q_far, num_kv_heads, group), far_keys[:, :far_end].transpose(1, 2))
                far = far.view(num_kv_heads, group, n, far_end)
                scores = torch.empty((num_kv_heads, group, n, p1), dtype=torch.float32)
                scores[..., :band_start] = far[..., :band_start]
                scores[..., band_start:] = near
                if far_end > band_start:  # the keys both near and far: each query takes the one its distance picks
                    d = q_pos[:, None] - torch.arange(band_start, far_end, dtype=torch.float64)[None, :]
                    scores[..., band_start:far_end] = torch.where(
                        d < window, scores[..., band_start:far_end], far[..., band_start:far_end]
                    )
            d = q_pos[:, None] - torch.arange(band_start, p1, dtype=torch.float64)[None, :]  # [n, p1 - band_start]
            scores.mul_(scale)
            scores[..., band_start:].masked_fill_(d < 0, float("-inf"))
            probs = torch.softmax(scores, dim=-1).view(num_kv_heads, group * n, p1)
            out_rows = torch.matmul(probs, values[:, :p1]).view(num_kv_heads, group, n, head_dim)
            result[c0:c1] = out_rows.permute(2, 0, 1, 3).reshape(n, num_heads, head_dim).to(result.dtype)
    return result
