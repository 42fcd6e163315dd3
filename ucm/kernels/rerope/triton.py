"""ReRoPE attention over vLLM's paged KV cache in Triton: FlashAttention's layout (``KVLayout.FLASH_NHD``), the
semantics of the CPU path ``ucm.kernels.rerope.torch`` (its module docstring; the oracle is ``naive``).

ReRoPE (Su Jianlin, "Rectified Rotary Position Embeddings", 2023; bojone/rerope): a query at position ``i`` and a
key at ``j`` with ``d = i - j`` score ``q_i . k_j`` as cached when ``d < window``, else ``(R(a_i) q_i) . (R(b_j)
k_j)`` with ``b_j = j / leaky_factor - j`` and ``a_i = window - window / leaky_factor + i / leaky_factor - i``
(``1 / leaky_factor`` is 0 for plain ReRoPE): the pair's rotation is then the rectified distance ``window + (d -
window) / leaky_factor``.

One program per (query block, request, KV head): its rows are ``BLOCK_Q`` query tokens times the ``GROUP`` query
heads of the KV head (grouped-query attention reads each key once per group), an online softmax (FlashAttention's)
over the request's key blocks read through ``block_table``. The key blocks fall in three runs: blocks every row of
the program sees beyond the window (far scores only), blocks that mix (both scores, selected by ``d < window``), and
blocks every row sees within the window (near scores only, the ordinary causal mask).

Angles: the far rotations depend on ``j`` alone (keys) and on ``i`` alone (queries), so their cos/sin come from
tables computed on the host in float64 (``angle_tables``), not from ``cos``/``sin`` of float32 angles in the
kernel (a position near 1e5 times a frequency near 1 rounds to ~4e-3 rad in float32). A position ``p`` is split as
``p = hi * ANGLE_TILE + lo`` and its angle read as the sum of two table rows (a coarse one per ``hi``, a fine one
per ``lo``), combined in float32 by the angle-addition formulas: the tables stay small (``max_pos / ANGLE_TILE +
ANGLE_TILE`` rows) and each cos/sin carries a few float32 roundings, not the angle's.

Scores and the softmax are float32. With a 16-bit cache the matrix products take 16-bit operands (the query, the
re-rotated query and key, the probabilities rounded to the cache's dtype, as FlashAttention does) with float32
accumulation; with a float32 cache they run in IEEE float32.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ucm.kernels.layouts import KVLayout, paged_shape
from ucm.kernels.rerope.torch import check_rerope_args, rope_cos_sin
from ucm.kernels.utils import launchable, num_warps

# Positions per fine table (the ``lo`` of ``p = hi * ANGLE_TILE + lo``): a power of two.
ANGLE_TILE = 256
# Rows of a program (query tokens times query heads of one KV head) aimed at; at least 16 (tl.dot's minimum).
BLOCK_ROWS = 64
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _angles(coarse_ptr, fine_ptr, pos, m_pos, o_f, m_rot, HALF: tl.constexpr, TABLE_T: tl.constexpr):
    """cos and sin ``[rows, BD]`` of the angles at ``pos`` (int64 ``[rows]``, valid where ``m_pos``) for channel
    frequencies ``o_f`` (``[BD]``, valid where ``m_rot``): coarse row ``pos // TABLE_T`` plus fine row ``pos %
    TABLE_T`` (tables ``[rows, 2, HALF]``: cos then sin). Outside the masks: cos 1, sin 0 (no rotation)."""
    m = m_pos[:, None] & m_rot[None, :]
    p_c = coarse_ptr + (pos // TABLE_T)[:, None] * (2 * HALF) + o_f[None, :]  # [rows, BD]
    p_f = fine_ptr + (pos % TABLE_T)[:, None] * (2 * HALF) + o_f[None, :]
    cos_c = tl.load(p_c, mask=m, other=1.0)
    sin_c = tl.load(p_c + HALF, mask=m, other=0.0)
    cos_f = tl.load(p_f, mask=m, other=1.0)
    sin_f = tl.load(p_f + HALF, mask=m, other=0.0)
    return cos_c * cos_f - sin_c * sin_f, sin_c * cos_f + cos_c * sin_f


@triton.jit
def _operand(x, DTYPE: tl.constexpr, DOT_F32: tl.constexpr):
    """``x`` as a matrix-product operand: rounded to ``DTYPE`` (the cache's), then float32 where ``DOT_F32``."""
    x = x.to(DTYPE)
    if DOT_F32:
        x = x.to(tl.float32)
    return x


@triton.jit
def _attend_block(
    acc,  # [BM, BD] float32
    m_i,  # [BM] float32 running max (log2 units)
    l_i,  # [BM] float32 running sum
    b_q,  # [BM, BD] queries as cached, as a matrix-product operand (_operand)
    b_qf,  # [BM, BD] queries re-rotated by a_i, as an operand
    pos_q,  # [BM] int64 query positions
    kb,  # key block index in the request
    r,
    h,
    seq_len,
    window,
    qk_scale,
    kv_ptr,
    table_ptr,
    coarse_ptr,
    fine_ptr,
    stride_table,
    stride_kv,
    stride_kb,
    stride_kt,
    stride_kh,
    o_d,
    o_pair,
    o_f,
    sign,
    m_d,
    m_rot,
    HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TABLE_T: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
    NEAR: tl.constexpr,  # some pair of this block is within the window
    FAR: tl.constexpr,  # some pair is beyond it
):
    """One key block's step of the online softmax: returns the updated ``(acc, m_i, l_i)``."""
    dtype = kv_ptr.dtype.element_ty
    b = tl.load(table_ptr + r * stride_table + kb).to(tl.int64)
    o_t = tl.arange(0, BLOCK_N).to(tl.int64)
    pos_k = kb * BLOCK_SIZE + o_t  # [BN]
    m_k = (o_t < BLOCK_SIZE) & (pos_k < seq_len)  # the block's tail past the request is never read
    p_k = kv_ptr + b * stride_kb + o_t[:, None] * stride_kt + h * stride_kh  # [BN, 1]
    b_k = tl.load(p_k + o_d[None, :], mask=m_k[:, None] & m_d[None, :], other=0.0)  # [BN, BD]
    b_v = tl.load(p_k + stride_kv + o_d[None, :], mask=m_k[:, None] & m_d[None, :], other=0.0)  # [BN, BD]
    d = pos_q[:, None] - pos_k[None, :]  # [BM, BN]
    if NEAR:
        s = tl.dot(b_q, tl.trans(_operand(b_k, dtype, DOT_F32)), input_precision=PRECISION)
    if FAR:
        b_kp = tl.load(p_k + o_pair[None, :], mask=m_k[:, None] & m_rot[None, :], other=0.0).to(tl.float32)
        cos, sin = _angles(coarse_ptr, fine_ptr, pos_k, m_k, o_f, m_rot, HALF, TABLE_T)  # [BN, BD] at b_j
        b_kf = b_k.to(tl.float32) * cos + sign[None, :] * b_kp * sin
        s_far = tl.dot(b_qf, tl.trans(_operand(b_kf, dtype, DOT_F32)), input_precision=PRECISION)
        s = tl.where(d < window, s, s_far) if NEAR else s_far  # a constexpr choice: s exists only where NEAR
    s = tl.where((d >= 0) & m_k[None, :], s * qk_scale, float("-inf"))  # [BM, BN] causal, log2 units
    # Every row sees key 0 in the first block it processes, so m_new is finite from then on: no -inf - -inf.
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    pv = tl.dot(_operand(p, dtype, DOT_F32), _operand(b_v, dtype, DOT_F32), input_precision=PRECISION)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def rerope_attention_kernel(
    q_ptr,  # [num_tokens, HQ, HEAD_DIM], last dim contiguous
    kv_ptr,  # FLASH_NHD [2, num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM], last dim contiguous
    table_ptr,  # [R, W] block ids
    lens_ptr,  # [R] seq_lens
    starts_ptr,  # [R + 1] query_start_loc
    fine_ptr,  # [TABLE_T, 2, HALF] float32: cos, sin of lo * (1/leaky_factor - 1) * freq
    k_coarse_ptr,  # [NC, 2, HALF] float32: of hi * TABLE_T * (1/leaky_factor - 1) * freq
    q_coarse_ptr,  # [NC, 2, HALF] float32: of (window * (1 - 1/leaky_factor) + hi * TABLE_T * (...)) * freq
    out_ptr,  # [num_tokens, HQ, HEAD_DIM], last dim contiguous
    stride_qt,
    stride_qh,
    stride_kv,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_ot,
    stride_oh,
    stride_table,
    window,
    qk_scale,  # scale * log2(e)
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,  # rotary_dim / 2
    NEOX: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # next power of two >= GROUP
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_N: tl.constexpr,  # next power of two >= BLOCK_SIZE, >= 16
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM, >= 16
    TABLE_T: tl.constexpr,
    DOT_F32: tl.constexpr,  # matrix products on float32 operands (a float32 cache; bf16 in the interpreter)
    PRECISION: tl.constexpr,  # tl.dot's input_precision: "ieee" for float32 operands
):
    qb = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    q_start = tl.load(starts_ptr + r).to(tl.int64)
    nq = tl.load(starts_ptr + r + 1).to(tl.int64) - q_start
    if qb * BLOCK_Q >= nq:
        return
    seq_len = tl.load(lens_ptr + r).to(tl.int64)
    ctx = seq_len - nq  # the request's queries are its last nq tokens: query t sits at ctx + t

    # Rows: query token m // BLOCK_G of the block, query head h * GROUP + m % BLOCK_G.
    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_G
    o_m = tl.arange(0, BLOCK_M).to(tl.int64)
    o_tok = qb * BLOCK_Q + o_m // BLOCK_G  # [BM] query index in the request
    o_g = o_m % BLOCK_G
    m_row = (o_tok < nq) & (o_g < GROUP)
    pos_q = ctx + o_tok  # [BM]
    heads = h * GROUP + o_g

    # Channels: each rotated channel's partner, sign and frequency (NeoX: the two halves; GPT-J: neighbours).
    o_d = tl.arange(0, BLOCK_D).to(tl.int64)
    m_d = o_d < HEAD_DIM
    m_rot = o_d < 2 * HALF
    if NEOX:
        first = o_d < HALF
        o_pair = tl.where(first, o_d + HALF, o_d - HALF)
        o_f = tl.where(first, o_d, o_d - HALF)
    else:
        first = o_d % 2 == 0
        o_pair = tl.where(first, o_d + 1, o_d - 1)
        o_f = o_d // 2
    sign = tl.where(first, -1.0, 1.0)  # rotate-half: x * cos + sign * x[pair] * sin

    p_q = q_ptr + (q_start + o_tok)[:, None] * stride_qt + heads[:, None] * stride_qh  # [BM, 1]
    b_q = tl.load(p_q + o_d[None, :], mask=m_row[:, None] & m_d[None, :], other=0.0)  # [BM, BD]
    b_qp = tl.load(p_q + o_pair[None, :], mask=m_row[:, None] & m_rot[None, :], other=0.0).to(tl.float32)
    cos, sin = _angles(q_coarse_ptr, fine_ptr, pos_q, m_row, o_f, m_rot, HALF, TABLE_T)  # [BM, BD] at a_i
    b_qf = b_q.to(tl.float32) * cos + sign[None, :] * b_qp * sin  # [BM, BD]
    b_q = _operand(b_q, kv_ptr.dtype.element_ty, DOT_F32)  # both converted once for every key block
    b_qf = _operand(b_qf, kv_ptr.dtype.element_ty, DOT_F32)

    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    i_min = ctx + qb * BLOCK_Q  # the program's first and last query positions
    i_max = ctx + tl.minimum(nq, (qb + 1) * BLOCK_Q) - 1
    n_blocks = i_max // BLOCK_SIZE + 1
    # Blocks [0, n_far): every pair beyond the window; [n_near, n_blocks): every pair within it (both clamped).
    n_far = tl.maximum(i_min - window + 1, 0) // BLOCK_SIZE
    n_near = tl.maximum(tl.minimum(tl.cdiv(tl.maximum(i_max - window + 1, 0), BLOCK_SIZE), n_blocks), n_far)
    for kb in range(0, n_far):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, b_q, b_qf, pos_q, kb, r, h, seq_len, window, qk_scale, kv_ptr, table_ptr, k_coarse_ptr,
            fine_ptr, stride_table, stride_kv, stride_kb, stride_kt, stride_kh, o_d, o_pair, o_f, sign, m_d, m_rot,
            HALF, BLOCK_SIZE, BLOCK_N, TABLE_T, DOT_F32, PRECISION, NEAR=False, FAR=True,
        )  # fmt: skip
    for kb in range(n_far, n_near):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, b_q, b_qf, pos_q, kb, r, h, seq_len, window, qk_scale, kv_ptr, table_ptr, k_coarse_ptr,
            fine_ptr, stride_table, stride_kv, stride_kb, stride_kt, stride_kh, o_d, o_pair, o_f, sign, m_d, m_rot,
            HALF, BLOCK_SIZE, BLOCK_N, TABLE_T, DOT_F32, PRECISION, NEAR=True, FAR=True,
        )  # fmt: skip
    for kb in range(n_near, n_blocks):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, b_q, b_qf, pos_q, kb, r, h, seq_len, window, qk_scale, kv_ptr, table_ptr, k_coarse_ptr,
            fine_ptr, stride_table, stride_kv, stride_kb, stride_kt, stride_kh, o_d, o_pair, o_f, sign, m_d, m_rot,
            HALF, BLOCK_SIZE, BLOCK_N, TABLE_T, DOT_F32, PRECISION, NEAR=True, FAR=False,
        )  # fmt: skip
    b_o = acc / l_i[:, None]
    p_o = out_ptr + (q_start + o_tok)[:, None] * stride_ot + heads[:, None] * stride_oh + o_d[None, :]
    tl.store(p_o, b_o.to(out_ptr.dtype.element_ty), mask=m_row[:, None] & m_d[None, :])


# (device, rotary_dim, base, 1 / leaky_factor, window, ANGLE_TILE) -> (fine, k_coarse, q_coarse) tables.
_TABLES: dict[tuple[str, int, float, float, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def angle_tables(
    num_positions: int, rotary_dim: int, base: float, inv_k: float, window: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's cos/sin tables for positions below ``num_positions``, float32 ``[rows, 2, rotary_dim / 2]``
    (cos then sin), computed in float64 and kept per process (grown by doubling): ``fine`` (``ANGLE_TILE`` rows:
    ``lo * (inv_k - 1)``), ``k_coarse`` (``hi * ANGLE_TILE * (inv_k - 1)``) and ``q_coarse`` (``window * (1 -
    inv_k)`` plus that), each position times RoPE's inverse frequencies. The far keys' angle at ``j`` is ``k_coarse[j
    // ANGLE_TILE] + fine[j % ANGLE_TILE]``, the queries' at ``i`` ``q_coarse[i // ANGLE_TILE] + fine[i %
    ANGLE_TILE]``."""
    key = (str(device), rotary_dim, base, inv_k, window, ANGLE_TILE)
    rows = max(1, -(-num_positions // ANGLE_TILE))
    tables = _TABLES.get(key)
    if tables is None or tables[1].shape[0] < rows:
        size = max(rows, 2 * tables[1].shape[0] if tables is not None else 16)
        step = inv_k - 1.0

        def table(positions: torch.Tensor) -> torch.Tensor:
            cos, sin = rope_cos_sin(positions, rotary_dim, base)  # [n, 1, half] each
            return torch.cat((cos, sin), dim=1).to(device)

        hi = torch.arange(size, dtype=torch.float64) * ANGLE_TILE * step
        fine = table(torch.arange(ANGLE_TILE, dtype=torch.float64) * step)
        tables = (fine, table(hi), table(window * (1.0 - inv_k) + hi))
        _TABLES[key] = tables
    return tables


def rerope_kernel_meta(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    rotary_dim: int,
    neox: bool,
    max_query_len: int,
    dtype: torch.dtype,
    interpreted: bool = False,
) -> dict[str, int | bool | str]:
    """The constexprs of ``rerope_attention_kernel`` chosen from the shape (also used by the sm_90 compile test).
    ``interpreted``: the launch runs in the Triton interpreter, whose ``tl.dot`` multiplies bf16 operands as their
    raw 16-bit integers; there bf16 operands are rounded to bf16 and multiplied as float32."""
    group = num_heads // num_kv_heads
    block_g = triton.next_power_of_2(group)
    rows = max(16, min(BLOCK_ROWS, triton.next_power_of_2(max_query_len * block_g)))
    dot_f32 = dtype == torch.float32 or (interpreted and dtype == torch.bfloat16)
    return {
        "HEAD_DIM": head_dim,
        "HALF": rotary_dim // 2,
        "NEOX": neox,
        "GROUP": group,
        "BLOCK_G": block_g,
        "BLOCK_Q": max(1, rows // block_g),
        "BLOCK_SIZE": block_size,
        "BLOCK_N": max(16, triton.next_power_of_2(block_size)),
        "BLOCK_D": max(16, triton.next_power_of_2(head_dim)),
        "TABLE_T": ANGLE_TILE,
        "DOT_F32": dot_f32,
        "PRECISION": "ieee" if dot_f32 else "tf32",
    }


def _check_index(name: str, t: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    if t.dtype not in (torch.int32, torch.int64) or t.dim() != len(shape) or t.device != device:
        raise ValueError(
            f"{name} must be an int32/int64 tensor of {len(shape)} dims on {device}, got {t.dtype} "
            f"{tuple(t.shape)} on {t.device}"
        )
    if any(want >= 0 and got != want for got, want in zip(t.shape, shape, strict=True)):
        dims = ", ".join(str(n) if n >= 0 else "*" for n in shape)
        raise ValueError(f"{name} must be [{dims}], got {list(t.shape)}")


def rerope_paged_attention_triton(
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
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Causal ReRoPE attention (Su Jianlin, "Rectified Rotary Position Embeddings", 2023; bojone/rerope) of a step's
    queries over one layer's paged KV in FlashAttention's layout (see the module docstring; the semantics of
    ``ucm.kernels.rerope.torch.rerope_paged_attention``). On CPU tensors the kernel runs in the Triton interpreter
    (tests only: slow). The angle tables of a configuration are built on its first call (:func:`angle_tables`; call
    once before capturing a CUDA graph).

    Args:
        query: ``[num_tokens, num_heads, head_dim]`` float16, bfloat16 or float32 (the cache's dtype), rotated by
            their absolute positions (as vLLM's attention receives them), last dim contiguous; request ``r``'s are
            rows ``query_start_loc[r] .. query_start_loc[r + 1]``, the last tokens of its ``seq_lens[r]`` (a prefill
            chunk, or one token for a decode).
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (``layout`` must be FLASH_NHD),
            contiguous, keys rotated by their absolute positions, this step's already written.
        block_table: int32/int64 ``[num_reqs, max_blocks]``; seq_lens: int32/int64 ``[num_reqs]``;
            query_start_loc: int32/int64 ``[num_reqs + 1]``; on ``query``'s device.
        window: ReRoPE's window (>= 1); leaky_factor: >= 1 (``inf``: plain ReRoPE).
        rotary_dim: rotated channels (None: head_dim); base: ``rope_theta``; neox: GPT-NeoX rotation (else GPT-J).
        scale: score scale (None: ``head_dim ** -0.5``).
        out: ``[num_tokens, num_heads, head_dim]`` in ``query``'s dtype and device, last dim contiguous, written in
            place when given.
        max_query_len: the largest ``query_start_loc[r + 1] - query_start_loc[r]`` when the caller knows it (vLLM's
            metadata does); None: read from ``query_start_loc`` (a device-to-host copy on a GPU).

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``query``'s dtype (``out`` when given); rows past
        ``query_start_loc[-1]`` are not written.

    Raises:
        ValueError: a layout other than FLASH_NHD, a cache that does not fit it, a dtype other than float16,
            bfloat16, float32 or one that differs between ``query`` and the cache, tensors on other devices,
            mismatched shapes of ``query``, ``out`` or the index tensors, ``window`` < 1, ``leaky_factor`` < 1, a bad
            ``rotary_dim``, or heads that do not group (num_heads % num_kv_heads).
    """
    if layout != KVLayout.FLASH_NHD:
        raise ValueError(f"layout must be {KVLayout.FLASH_NHD.value}, got {layout!r}")
    _, block_size, num_kv_heads, head_dim = paged_shape(layout, kv_cache)
    if query.dim() != 3 or query.shape[2] != head_dim:
        raise ValueError(f"query must be [num_tokens, num_heads, {head_dim}], got {tuple(query.shape)}")
    num_tokens, num_heads, _ = query.shape
    if kv_cache.dtype not in DTYPES or query.dtype != kv_cache.dtype:
        raise ValueError(
            f"query and kv_cache must share one dtype of {[str(t) for t in DTYPES]}, got {query.dtype} and "
            f"{kv_cache.dtype}"
        )
    if query.device != kv_cache.device:
        raise ValueError(f"query is on {query.device}, kv_cache on {kv_cache.device}: they must share a device")
    rotary_dim = check_rerope_args(num_heads, num_kv_heads, head_dim, window, leaky_factor, rotary_dim)
    num_reqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    _check_index("seq_lens", seq_lens, (-1,), query.device)
    _check_index("block_table", block_table, (num_reqs, -1), query.device)
    _check_index("query_start_loc", query_start_loc, (num_reqs + 1,), query.device)
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    elif out.shape != query.shape or out.dtype != query.dtype or out.device != query.device or out.stride(2) != 1:
        raise ValueError(
            f"out must be {tuple(query.shape)} {query.dtype} on {query.device} with a contiguous last dim, got "
            f"{tuple(out.shape)} {out.dtype} on {out.device} strides {out.stride()}"
        )
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if num_reqs else 0
    if max_query_len <= 0 or num_tokens == 0:
        return out
    if query.stride(2) != 1:
        query = query.contiguous()
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    scale = head_dim**-0.5 if scale is None else scale
    inv_k = 0.0 if math.isinf(leaky_factor) else 1.0 / leaky_factor
    fine, k_coarse, q_coarse = angle_tables(
        block_table.shape[1] * block_size, rotary_dim, base, inv_k, window, query.device
    )
    meta = rerope_kernel_meta(
        num_heads, num_kv_heads, head_dim, block_size, rotary_dim, neox, max_query_len, query.dtype,
        interpreted=query.device.type == "cpu",
    )  # fmt: skip
    grid = (triton.cdiv(max_query_len, int(meta["BLOCK_Q"])), num_reqs, num_kv_heads)
    launchable(rerope_attention_kernel, query.device)[grid](
        query,
        kv_cache,
        block_table,
        seq_lens,
        query_start_loc,
        fine,
        k_coarse,
        q_coarse,
        out,
        query.stride(0),
        query.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        out.stride(0),
        out.stride(1),
        block_table.stride(0),
        window,
        scale * math.log2(math.e),
        num_warps=num_warps(),
        **meta,
    )
    return out
