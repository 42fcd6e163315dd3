"""CacheBlend's chosen rows through vLLM's CPU attention kernel: scattered query rows of one sequence, grouped into
one request per run of consecutive positions (``row_requests``), attend exactly as causal attention over the tokens
up to each row's own position.

No engine: a paged cache filled by vLLM's own ``cpu_attn_reshape_and_cache`` (the real in-block layout of the kernel
variant vLLM picks here: ``vec`` for fp32; ``amx`` for bf16 on a CPU with AMX tiles, ``vec`` elsewhere), the
metadata built by ``cpu_attention_metadata`` as the blend's pass builds it, then ``cpu_attention_with_kv_cache``.
The reference attends in float64, so a wrong sequence length or query offset in a request fails it. Also the
buffers the blend keeps from request to request (``Blender._kept``).
"""

from __future__ import annotations

import math

import pytest
import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from tests.helpers import cpu_attention
from ucm.integration.vllm.blend import cpu_attention_metadata, row_requests

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 32  # SmolLM2's attention shape, vLLM's smallest CPU block
SEQ_LEN = 500
SCALE = HEAD_DIM**-0.5
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
if torch.cpu._is_amx_tile_supported():  # vLLM's amx kernel needs the process to have asked Linux for AMX tiles
    torch.cpu._init_amx()


def test_row_requests_are_runs_of_consecutive_positions() -> None:
    qsl, seq_lens = row_requests(torch.tensor([3, 4, 5, 9, 11, 12, 20]))
    assert qsl.dtype == seq_lens.dtype == torch.int32
    assert qsl.tolist() == [0, 3, 4, 6, 7]
    assert seq_lens.tolist() == [6, 10, 13, 21]
    qsl, seq_lens = row_requests(torch.arange(100, 228))  # every row of a run: one prefill request
    assert qsl.tolist() == [0, 128] and seq_lens.tolist() == [228]
    qsl, seq_lens = row_requests(torch.tensor([7]))
    assert qsl.tolist() == [0, 1] and seq_lens.tolist() == [8]


def _rows(g: torch.Generator) -> torch.Tensor:
    """Scattered rows: single ones, runs, a run across a block boundary, the first and the last position."""
    picked = torch.rand(SEQ_LEN, generator=g) < 0.12
    picked[0] = picked[SEQ_LEN - 1] = True
    picked[60:75] = True  # a run over the boundary of blocks 1 and 2
    picked[200:203] = True
    return picked.nonzero().flatten()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_runs_of_rows_attend_causally_up_to_their_positions(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    num_blocks = math.ceil(SEQ_LEN / BLOCK_SIZE)
    block_ids = torch.randperm(num_blocks + 5, generator=g)[:num_blocks]  # scattered blocks, as vLLM's
    k = torch.randn((SEQ_LEN, KV_HEADS, HEAD_DIM), generator=g).to(dtype)
    v = torch.randn((SEQ_LEN, KV_HEADS, HEAD_DIM), generator=g).to(dtype)
    pos = torch.arange(SEQ_LEN)
    slots = block_ids[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    isa = _get_attn_isa(dtype, BLOCK_SIZE, HEAD_DIM)
    kv_cache = torch.zeros((num_blocks + 5, KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM), dtype=dtype)
    key_cache, value_cache = kv_cache.view(num_blocks + 5, KV_HEADS, 2 * BLOCK_SIZE, HEAD_DIM).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa, kv_cache_dtype="auto")

    rows = _rows(g)
    query = (torch.randn((rows.shape[0], HEADS, HEAD_DIM), generator=g) * 2).to(dtype)
    qsl, seq_lens = row_requests(rows)
    assert qsl.shape[0] - 1 < rows.shape[0]  # some runs hold several rows
    table = block_ids.to(torch.int32)[None, :].expand(seq_lens.shape[0], -1).contiguous()
    md = cpu_attention_metadata(
        qsl, seq_lens, table, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=dtype, isa=isa
    )
    out = cpu_attention(md, query, key_cache, value_cache, SCALE)

    group = HEADS // KV_HEADS
    kk, vv = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)  # [S, Hq, D]
    logits = torch.einsum("qhd,shd->hqs", query.double(), kk) * SCALE
    logits = logits.masked_fill(pos[None, None, :] > rows[None, :, None], float("-inf"))
    want = torch.einsum("hqs,shd->qhd", torch.softmax(logits, dim=-1), vv)
    torch.testing.assert_close(out.double(), want, atol=TOL[dtype], rtol=TOL[dtype])


def test_blend_buffers_are_kept_up_to_their_cap(monkeypatch) -> None:
    """The blend's buffers (``Blender._kept``): a name's tensors up to ``BLEND_BUFFER_BYTES`` are views of one
    buffer kept from blend to blend (grown when a blend needs more); each name has its own; a larger tensor is fresh
    and not kept."""
    import ucm.integration.vllm.blend as blend_module
    from ucm.config import BlendConfig
    from ucm.integration.vllm.blend import Blender
    from ucm.integration.vllm.engine_info import KVSpec

    spec = KVSpec(("l0", "l1"), BLOCK_SIZE, KV_HEADS, HEAD_DIM, torch.bfloat16)
    blender = Blender(BlendConfig(chunk_end_token_id=5), None, spec, None, 1.0)  # type: ignore[arg-type]
    small = blender._kept("kv", (2, 2, 10, KV_HEADS, HEAD_DIM))
    again = blender._kept("kv", (2, 2, 7, KV_HEADS, HEAD_DIM))
    assert small.dtype == torch.bfloat16 and small.shape == (2, 2, 10, KV_HEADS, HEAD_DIM)
    assert again.data_ptr() == small.data_ptr() and again.is_contiguous()
    assert blender._kept("chunk", (2, 2, 10, KV_HEADS, HEAD_DIM)).data_ptr() != small.data_ptr()
    grown = blender._kept("kv", (2, 2, 40, KV_HEADS, HEAD_DIM))
    assert grown.shape[2] == 40 and blender._kept("kv", (2, 2, 40, KV_HEADS, HEAD_DIM)).data_ptr() == grown.data_ptr()
    monkeypatch.setattr(blend_module, "BLEND_BUFFER_BYTES", 2 * 2 * 40 * KV_HEADS * HEAD_DIM * 2)
    big = blender._kept("kv", (2, 2, 41, KV_HEADS, HEAD_DIM))
    assert big.data_ptr() != grown.data_ptr()
    assert blender._kept("kv", (2, 2, 40, KV_HEADS, HEAD_DIM)).data_ptr() == grown.data_ptr()  # the kept buffer
