"""ReRoPE attention over vLLM's paged KV cache, in torch (the CPU path; the oracle is ``naive``).

vLLM caches keys already rotated by their absolute positions, and the model hands attention queries rotated by
theirs. ReRoPE (Su Jianlin, "Rectified Rotary Position Embeddings", 2023; bojone/rerope) needs, for a query at
position ``i`` and a key at position ``j`` with ``d = i - j >= window``, the score at the relative position
``r = window + (d - window) / leaky_factor`` (``window`` for plain ReRoPE) instead of ``d``. Rotations compose
(``R(a) R(b) = R(a + b)``), so this is re-rotation on the fly, with no second key copy in the KV cache:

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

A :class:`RequestKV` passed for a request keeps its values and re-rotated far keys from one call to the next (the
re-rotation of key ``j`` depends on ``j`` only), so a decode step gathers and rotates only its new token and reads
the near band's keys; without one every key is gathered and re-rotated. Both give the same result, bit for bit.

Layouts: the CPU kernel variants' ``KVLayout.CPU_ATTN`` (``vec``, ``vec16``) and ``KVLayout.CPU_ATTN_AMX`` (``amx``),
read through ``ucm.kernels.layouts.cpu_attn_kv_views`` (gathered per request into head-major float32 ``[num_kv_heads,
tokens, head_dim]``, the order the score and output matmuls read).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ucm.kernels.layouts import KVLayout, cpu_attn_kv_views

# Queries scored at once per request (bounds the [chunk, heads, keys] score matrices).
QUERY_CHUNK = 256
# Least rows a kept RequestKV buffer grows by.
GROWTH_TOKENS = 256


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


class _AngleTables:
    """cos/sin of the re-rotations ReRoPE applies at positions ``j < n``: ``offset + j * inv_k - j`` (far keys:
    ``b_j``, offset 0; queries: ``a_i``, offset ``window * (1 - inv_k)``), grown on demand and kept per (rotary_dim,
    base, inv_k, offset): a step then rotates its keys and queries without computing a trigonometric function."""

    def __init__(self) -> None:
        self._tables: dict[tuple[int, float, float, float], tuple[torch.Tensor, torch.Tensor]] = {}

    def get(
        self, lo: int, hi: int, rotary_dim: int, base: float, inv_k: float, offset: float = 0.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``[hi - lo, 1, rotary_dim / 2]`` cos and sin for positions ``lo .. hi - 1``."""
        key = (rotary_dim, base, inv_k, offset)
        table = self._tables.get(key)
        if table is None or table[0].shape[0] < hi:
            size = max(hi, 2 * table[0].shape[0] if table is not None else 1024)
            j = torch.arange(size, dtype=torch.float64)
            table = rope_cos_sin(offset + j * inv_k - j, rotary_dim, base)
            self._tables[key] = table
        return table[0][lo:hi], table[1][lo:hi]


_ANGLES = _AngleTables()


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
    kv_cache: torch.Tensor, layout: KVLayout, block_ids: torch.Tensor, start: int, end: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a request's tokens ``start .. end - 1`` (its blocks are ``block_ids``), head-major: float32
    ``[num_kv_heads, end - start, head_dim]`` each (rows contiguous). Two passes over the data: the blocks holding
    those tokens are gathered whole, then each of K and V is copied once out of :func:`cpu_attn_kv_views` of them
    (whose dims, in order, are the canonical ``[block, token, head, dim]`` with the token and dim axes split where the
    layout tiles them) into the head-major buffer."""
    _, num_kv_heads, block_size, two_d = kv_cache.shape
    head_dim = two_d // 2
    first, last = start // block_size, -(-end // block_size)
    n = last - first
    blocks = kv_cache[block_ids[first:last].long()]  # [n, num_kv_heads, block_size, 2 * head_dim]
    head_axis = 2 if layout == KVLayout.CPU_ATTN else 3  # after the block axis and the (split) token axes
    offset = start - first * block_size
    out = []
    for part in cpu_attn_kv_views(blocks, layout):
        shape = part.shape
        head_major = torch.empty((num_kv_heads, n * block_size, head_dim), dtype=torch.float32)
        dst = head_major.view(num_kv_heads, n, *shape[1:head_axis], *shape[head_axis + 1 :])
        dst.copy_(part.movedim(head_axis, 0))
        out.append(head_major[:, offset : offset + end - start])
    return out[0], out[1]


class RequestKV:
    """One request's values and re-rotated far keys, as ReRoPE's scores read them, kept from one step to the next.

    ``values[:, :num_values]`` are the V of positions ``0 .. num_values - 1`` and ``far_keys[:, :num_far]`` the K of
    positions ``0 .. num_far - 1`` re-rotated by ``b_j`` (see the module docstring), both head-major float32
    ``[num_kv_heads, capacity, head_dim]`` (``num_far <= num_values``). :func:`rerope_paged_attention` extends them
    with the tokens a step adds, so a decode step gathers and rotates only its new tokens (and reads the near band's
    keys) instead of the whole request. It truncates them to the step's first query position first: what a step
    computes from there on is written again (speculative tokens). Bit for bit the same results as a fresh one.

    The caller owns the identity: the entry must belong to the request whose block table is passed with it, and its
    blocks must still hold the tokens they held when it was filled (``ucm.integration.vllm.sparse_backend`` drops
    entries whose blocks vLLM allocated again).
    """

    def __init__(self) -> None:
        self.far_keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.num_far = 0
        self.num_values = 0

    @property
    def nbytes(self) -> int:
        """Bytes held (both buffers' capacity)."""
        return sum(t.numel() * t.element_size() for t in (self.far_keys, self.values) if t is not None)

    def append_values(self, new: torch.Tensor) -> None:
        """Append the values of positions ``num_values ..`` (float32 ``[num_kv_heads, n, head_dim]``)."""
        self.values = _appended(self.values, self.num_values, new)
        self.num_values += new.shape[1]

    def append_far_keys(self, new: torch.Tensor) -> None:
        """Append the re-rotated keys of positions ``num_far ..`` (float32 ``[num_kv_heads, n, head_dim]``)."""
        self.far_keys = _appended(self.far_keys, self.num_far, new)
        self.num_far += new.shape[1]


def _appended(buf: torch.Tensor | None, length: int, new: torch.Tensor) -> torch.Tensor:
    """``buf`` (``[heads, capacity, dim]``, its first ``length`` rows valid) with ``new`` written after them: ``new``
    itself when nothing is kept, else ``buf`` grown when it is too short, by an eighth or :data:`GROWTH_TOKENS`
    rows, whichever is more (a copy every few hundred decode steps, and little spare room against the budget)."""
    if buf is None or length == 0:
        return new
    need = length + new.shape[1]
    if buf.shape[1] < need:
        grown = torch.empty((new.shape[0], need + max(GROWTH_TOKENS, need // 8), new.shape[2]), dtype=new.dtype)
        grown[:, :length] = buf[:, :length]
        buf = grown
    buf[:, length:need] = new
    return buf


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
    request_kv: Sequence[RequestKV | None] | None = None,
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
        request_kv: per request, a :class:`RequestKV` kept from its earlier steps (extended in place here), or None
            (every key gathered and re-rotated this call); None: none for any request.

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
        first_query = seq_len - (q1 - q0)
        n_far = max(0, seq_len - window)  # keys 0..n_far-1 are at least a window before the last query
        entry = (request_kv[r] if request_kv is not None else None) or RequestKV()
        # From the first query on, this step (re)writes the KV; far keys past n_far are not read.
        entry.num_values = min(entry.num_values, first_query)
        entry.num_far = min(entry.num_far, entry.num_values, n_far)
        # Raw keys are read from `start`: the far keys not yet re-rotated, and the near band of the first query.
        start = min(entry.num_far, max(0, first_query - window + 1))
        keys, new_values = _request_kv(kv_cache, layout, block_table[r], start, seq_len)  # [Hkv, seq_len - start, D]
        entry.append_values(new_values[:, entry.num_values - start :])
        if n_far > entry.num_far:
            lo = entry.num_far
            cos, sin = _ANGLES.get(lo, n_far, rotary_dim, base, inv_k)  # [n_far - lo, 1, rotary_dim / 2]
            cos, sin = cos.view(1, n_far - lo, -1), sin.view(1, n_far - lo, -1)  # keys are head-major
            entry.append_far_keys(rotate_with(keys[:, lo - start : n_far - start], cos, sin, rotary_dim, neox))
        far_keys, values = entry.far_keys, entry.values
        assert values is not None
        for c0 in range(q0, q1, QUERY_CHUNK):
            c1 = min(q1, c0 + QUERY_CHUNK)
            n = c1 - c0
            p0, p1 = seq_len - (q1 - c0), seq_len - (q1 - c1)  # the chunk's query positions: p0 .. p1 - 1
            # Keys 0..p1-1 (causal); near: band_start..p1-1 (distance < window for some query); far: 0..far_end-1
            # (distance >= window for some query). Between band_start and far_end a key is near for some queries and
            # far for others. A single query (decode) has no key of both kinds and no key after it.
            band_start, far_end = max(0, p0 - window + 1), max(0, p1 - window)
            # Grouped-query heads: query head h reads KV head h // group; rows of KV head h: (g, query) g-major.
            q = _head_major(query[c0:c1].to(torch.float32), num_kv_heads, group)  # [Hkv, G * n, D]
            near = torch.matmul(q, keys[:, band_start - start : p1 - start].transpose(1, 2))
            near = near.view(num_kv_heads, group, n, p1 - band_start)
            if far_end == 0:
                scores = near
            else:
                assert far_keys is not None
                cos, sin = _ANGLES.get(p0, p1, rotary_dim, base, inv_k, window * (1 - inv_k))  # a_i, see above
                q_far = rotate_with(query[c0:c1], cos, sin, rotary_dim, neox)
                far = torch.matmul(_head_major(q_far, num_kv_heads, group), far_keys[:, :far_end].transpose(1, 2))
                far = far.view(num_kv_heads, group, n, far_end)
                scores = torch.cat((far[..., :band_start], near), dim=-1)  # [Hkv, G, n, p1]
                if far_end > band_start:  # the keys both near and far: each query takes the one its distance picks
                    d = torch.arange(p0, p1)[:, None] - torch.arange(band_start, far_end)[None, :]
                    scores[..., band_start:far_end] = torch.where(
                        d < window, scores[..., band_start:far_end], far[..., band_start:far_end]
                    )
            scores.mul_(scale)
            if n > 1:
                d = torch.arange(p0, p1)[:, None] - torch.arange(band_start, p1)[None, :]  # [n, p1 - band_start]
                scores[..., band_start:].masked_fill_(d < 0, float("-inf"))
            probs = torch.softmax(scores, dim=-1).view(num_kv_heads, group * n, p1)
            out_rows = torch.matmul(probs, values[:, :p1]).view(num_kv_heads, group, n, head_dim)
            result[c0:c1] = out_rows.permute(2, 0, 1, 3).reshape(n, num_heads, head_dim).to(result.dtype)
    return result
