"""SparQ (Ribar et al. 2024, "SparQ Attention: Bandwidth-Efficient LLM Inference"), steps 1-2: the query step
(:func:`sparq_query`: which key components to read, and the query values there) and the per-block log-sum-exp of the
approximate logits (:func:`sparq_block_lse`); validation, then dispatch by ``impl``.

:func:`sparq_block_lse`: for request ``r``, query head ``j`` (KV head ``h = j // (num_heads / num_kv_heads)``)
and the ``w``-th block of its block table (``b = block_table[r, w]``), over the block's tokens ``t`` inside the
request (``w * block_size + t < seq_lens[r]``)::

    s[t]           = sum_c q[r, j, c] * K[b, h, t, channels[r, h, c]]
    lse[r, j, w]   = log(sum_t exp(s[t]))                  (-inf for a block with no such token)

``q`` holds only the chosen components of each query head (already multiplied by the head's softmax scale), so
``s`` is step 2 of SparQ Attention: an approximation of the attention logits that reads ``C`` of the ``head_dim``
components of every key. The share of head ``j``'s attention block ``w`` would get is then
``softmax_w(lse[r, j, :])`` (``ucm.sparse.gsa.sparq_scores``); returning per-block log-sum-exps rather than
per-token logits keeps the output ``block_size`` times smaller and lets a GPU program finish a block in one pass.

Keys are read in place from vLLM's paged cache, in either form of ``ucm.kernels.paged_keys`` (plain ``[num_blocks,
num_kv_heads, block_size, head_dim]`` strided view, or tiled ``[num_blocks, num_kv_heads, block_size / TT, TT,
head_dim / TD, TD]``). In the CPU_ATTN layout a block's keys are stored transposed, so one component of one block is
one contiguous run of ``block_size`` values; in CPU_ATTN_AMX it is one run of 16 values at stride 2 per 16-token tile
(one 64-byte cache line in bf16). The CPU paths read exactly those runs, in ascending block id order.

The sum over components is an fp32 reduction whose order differs between implementations; results agree to fp32
rounding (tests use a tolerance), not bit for bit.

Implementations (``impl=``, the vocabulary of ``ucm.kernels.utils``):

- ``"triton"``: ``sparq.triton``, one program per (request, KV head, block), all query heads of the KV head at once;
  the default on CUDA; the interpreter on CPU tensors (tests only). :func:`sparq_query` has no Triton kernel (a few
  small torch ops): ``"auto"`` on CUDA runs its torch code.
- ``"cpu"``: ``sparq.cpu``, the numba kernels of ``sparq.cpu_numba`` (:func:`sparq_block_lse`: one fused pass,
  gather with prefetch, logits and log-sum-exp per tile of blocks); the default on CPU for bf16/fp32 keys in vLLM's
  CPU layouts (:func:`cpu_applies`), torch for other keys.
- ``"torch"``: ``sparq.torch`` (gather + batched matmul + ``logsumexp``), any device.
- ``"reference"``: the loops of ``sparq.naive`` (the test oracles).
"""

from __future__ import annotations

import torch

from ucm.kernels.paged_keys import key_geometry
from ucm.kernels.sparq.cpu import cpu_applies, lse_cpu, sparq_query_cpu
from ucm.kernels.sparq.naive import sparq_block_lse_reference, sparq_query_reference
from ucm.kernels.sparq.torch import lse_torch, sparq_query_torch
from ucm.kernels.sparq.triton import lse_triton
from ucm.kernels.utils import Impl, resolve_impl


def sparq_query(
    query: torch.Tensor, num_kv_heads: int, channels: int, scale: float, *, impl: Impl = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1 of SparQ Attention and its temperature (Ribar et al. 2024, "SparQ Attention: Bandwidth-Efficient LLM
    Inference"), with the components shared by the query heads of one KV head (so each KV head's keys are read
    once): per row and KV head, the ``channels`` components of largest ``|q|`` summed over the KV head's query
    heads, and each query head's values there times ``scale / sqrt(|q_r|_1 / |q|_1)`` (the softmax temperature
    corrected for the dropped components, as in the paper).

    Args:
        query: ``[R, num_heads, head_dim]`` one (post-RoPE) decode query per row, any float dtype.
        num_kv_heads: KV heads (``num_heads`` is a multiple of it); channels: components kept, clamped to
            ``[1, head_dim]``; scale: the attention's softmax scale.
        impl: ``"auto"`` (the CPU path on CPU, torch elsewhere: no Triton kernel for these few small ops),
            ``"cpu"``, ``"torch"`` or ``"reference"``. Components of equal ``|q|`` come in ascending order
            (``"cpu"``, ``"reference"``) or in ``torch.topk``'s order (``"torch"``).

    Returns:
        ``(q_r, idx)``: float32 ``[R, num_heads, C]`` and int64 ``[R, num_kv_heads, C]``, ``C = min(channels,
        head_dim)``: the inputs of :func:`sparq_block_lse`.

    Raises:
        ValueError: ``query`` is not 3-D, ``num_heads`` not a multiple of ``num_kv_heads``, or unknown ``impl``.
    """
    which = resolve_impl(impl, query.device, available=("cpu", "torch", "reference"), op="sparq_query")
    if query.dim() != 3 or num_kv_heads < 1 or query.shape[1] % num_kv_heads:
        raise ValueError(
            f"query must be [R, num_heads, head_dim] with num_heads a multiple of num_kv_heads ({num_kv_heads}), "
            f"got {tuple(query.shape)}"
        )
    if which == "cpu":
        return sparq_query_cpu(query, num_kv_heads, channels, scale)
    if which == "reference":
        q_r, idx = sparq_query_reference(query, num_kv_heads, channels, scale)
        return q_r.to(query.device), idx.to(query.device)
    return sparq_query_torch(query, num_kv_heads, channels, scale)


def sparq_block_lse(
    q: torch.Tensor,
    channels: torch.Tensor,
    keys: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    impl: Impl = "auto",
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
        impl: ``"auto"`` (Triton on CUDA; on CPU the CPU path where :func:`cpu_applies`, else torch),
            ``"triton"``, ``"cpu"``, ``"torch"`` or ``"reference"`` (see the module doc).

    Raises:
        ValueError: bad shapes (keys neither plain nor tiled), dtypes, devices or channel indices, unknown
            ``impl``, ``"cpu"`` for keys the CPU path does not take (:func:`cpu_applies`), or (CPU path) a row
            naming a block outside the cache.
    """
    which = resolve_impl(impl, q.device, op="sparq_block_lse")
    _check(q, channels, keys, block_table, seq_lens)
    if which == "cpu" and not cpu_applies(keys):
        if impl == "auto":
            which = "torch"
        else:
            raise ValueError(
                "impl='cpu' takes CPU keys of dtype bfloat16 or float32 whose tokens are contiguous (stride 1, as "
                "in CPU_ATTN) or in tiles whose run of one component fits a cache line (as in CPU_ATTN_AMX), got "
                f"{keys.dtype} on {keys.device} of shape {tuple(keys.shape)} with strides {tuple(keys.stride())}"
            )
    if which == "cpu":
        return lse_cpu(q, channels, keys, block_table, seq_lens)
    if which == "triton":
        out = torch.empty((q.shape[0], q.shape[1], block_table.shape[1]), dtype=torch.float32, device=q.device)
        if out.numel():
            lse_triton(q, channels, keys, block_table, seq_lens, out)
        return out
    if which == "reference":
        return sparq_block_lse_reference(q, channels, keys, block_table, seq_lens).to(q.device)
    return lse_torch(q, channels, keys, block_table, seq_lens)


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
