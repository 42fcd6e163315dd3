"""UCM's CPU KV layouts against vLLM itself: the live KV write op, layout detection, and the engine on this CPU.

- vLLM's own ``cpu_attn_reshape_and_cache`` writes random tokens in each kernel variant this machine's vLLM build
  can run (``vec`` on every x86 build; ``amx`` needs the AVX512-BF16 build, else skipped with vLLM's refusal as the
  reason); gather gives the tokens back and scatter reproduces vLLM's bytes, for every implementation. (On every
  machine, ``tests/kernels/test_cpu_attn_amx.py`` checks ``amx`` against writes captured on an AMX Xeon.)
- ``detect_layout`` maps each kernel variant vLLM picks to its layout, refuses unknown variants, fp8 KV in the
  ``amx`` variant and MLA models with errors naming the value and the allowed ones.
- The real engine (SmolLM2, bf16): the worker registers the layout vLLM's variant implies on this CPU (``amx`` on a
  CPU with AMX tiles), and a restarted engine answers from the store with identical output. On a CPU without AMX
  the ``amx`` case is skipped, saying so.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from tests.helpers import ucm_extra_config
from tests.kernels.kv_data import bits_equal, poisoned, random_kv
from ucm.integration.vllm.engine_info import CPU_ISA_LAYOUTS, KVSpec, UnsupportedEngineError, detect_layout
from ucm.kernels import KVLayout, gather_blocks, gather_blocks_reference, scatter_blocks, scatter_blocks_reference
from ucm.testing.engine import failed_loads, run_engine, ucm_transfer_config
from ucm.testing.texts import prompt_of_tokens

HAS_AMX = torch.cpu._is_amx_tile_supported()
NO_AMX = "no AMX tiles on this CPU: vLLM picks 'vec' for bf16 here (amx is checked against captured writes)"
# (isa, dtype, block_size, num_kv_heads, head_dim): odd head counts, several block sizes, head_dim 80 for vec16.
LIVE_CASES = [
    ("vec", torch.bfloat16, 32, 3, 64),
    ("vec", torch.float32, 64, 2, 128),
    ("vec16", torch.float16, 32, 2, 80),
    ("amx", torch.bfloat16, 32, 3, 64),
    ("amx", torch.bfloat16, 96, 2, 128),
    ("amx", torch.bfloat16, 128, 1, 256),
]
IMPLS = ["cpu", "torch", "triton"]
NUM_BLOCKS = 6


def live_write(isa: str, dtype: torch.dtype, block_size: int, heads: int, head_dim: int, seed: int = 0):
    """vLLM's ``cpu_attn_reshape_and_cache`` writes random tokens (a shuffled, partly padded slot mapping) into a
    poisoned layer tensor; returns ``(cache, key, value, slots)`` with padding dropped from the last three."""
    gen = torch.Generator().manual_seed(seed)
    n = NUM_BLOCKS * block_size - 5
    key = random_kv((n, heads, head_dim), dtype, gen)
    value = random_kv((n, heads, head_dim), dtype, gen)
    slots = torch.randperm(NUM_BLOCKS * block_size, generator=gen)[:n]
    slots[::17] = -1  # padding: vLLM skips these tokens
    cache = poisoned((NUM_BLOCKS, heads, block_size, 2 * head_dim), dtype)
    k_cache, v_cache = cache.view(NUM_BLOCKS, heads, 2 * block_size, head_dim).chunk(2, dim=2)
    try:
        ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, slots, isa)
    except RuntimeError as exc:  # e.g. the AVX2 build has no amx write
        pytest.skip(f"vLLM's build here cannot write the {isa!r} layout: {str(exc).splitlines()[0][:200]}")
    keep = slots >= 0
    return cache, key[keep], value[keep], slots[keep]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "case", LIVE_CASES, ids=[f"{c[0]}-{str(c[1])[6:]}-bs{c[2]}-h{c[3]}-d{c[4]}" for c in LIVE_CASES]
)
def test_live_vllm_write_round_trips(case: tuple, impl: str) -> None:
    isa, dtype, block_size = case[:3]
    layout = CPU_ISA_LAYOUTS[isa]
    cache, key, value, slots = live_write(*case)
    ids = torch.arange(NUM_BLOCKS)
    blocks = gather_blocks([cache], ids, layout, impl=impl)  # type: ignore[arg-type]
    assert bits_equal(blocks, gather_blocks_reference([cache], ids, layout))
    b, t = slots // block_size, slots % block_size
    assert bits_equal(blocks[b, 0, 0, t], key) and bits_equal(blocks[b, 0, 1, t], value)
    back = poisoned(tuple(cache.shape), dtype)
    scatter_blocks(blocks, [back], ids, layout, impl=impl)  # type: ignore[arg-type]
    assert bits_equal(back, cache)  # vLLM's bytes, every one (the slots vLLM skipped keep the poison)
    ref = poisoned(tuple(cache.shape), dtype)
    scatter_blocks_reference(blocks, [ref], ids, layout)
    assert bits_equal(ref, cache)


# -- detect_layout ----------------------------------------------------------------------------------------------------


def fake_config(use_mla: bool = False, cache_dtype: str = "auto") -> SimpleNamespace:
    """The two parts of a ``VllmConfig`` that ``detect_layout`` reads."""
    return SimpleNamespace(
        model_config=SimpleNamespace(use_mla=use_mla, model="some/model"),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype),
    )


def spec_of(dtype: torch.dtype, block_size: int = 128, heads: int = 2, head_dim: int = 64) -> KVSpec:
    return KVSpec(("l0",), block_size, heads, head_dim, dtype)


@pytest.mark.parametrize(
    ("dtype", "head_dim"),
    [(torch.bfloat16, 64), (torch.bfloat16, 80), (torch.float32, 64), (torch.float16, 128)],
    ids=["bf16-d64", "bf16-d80", "fp32-d64", "fp16-d128"],
)
def test_detect_layout_follows_vllms_kernel_variant(dtype: torch.dtype, head_dim: int) -> None:
    spec = spec_of(dtype, head_dim=head_dim)
    cache = torch.zeros((4, 2, 128, 2 * head_dim), dtype=dtype)
    isa = _get_attn_isa(dtype, 128, head_dim)
    assert detect_layout(fake_config(), spec, cache) == CPU_ISA_LAYOUTS[isa]  # type: ignore[arg-type]
    if dtype == torch.bfloat16 and head_dim % 32 == 0:
        assert (isa == "amx") == HAS_AMX


def test_detect_layout_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = spec_of(torch.bfloat16)
    cache = torch.zeros((4, 2, 128, 128), dtype=torch.bfloat16)
    with pytest.raises(UnsupportedEngineError, match=r"multi-head latent attention .*AMX_MLA or CPU_MLA"):
        detect_layout(fake_config(use_mla=True), spec, cache)  # type: ignore[arg-type]
    import vllm.v1.attention.backends.cpu_attn as cpu_attn

    # A variant vLLM picks on other CPUs (Arm): refused, never guessed.
    monkeypatch.setattr(cpu_attn, "_get_attn_isa", lambda *a: "neon")
    with pytest.raises(UnsupportedEngineError, match=r"variant 'neon' .* \['vec', 'vec16', 'amx'\] only"):
        detect_layout(fake_config(), spec, cache)  # type: ignore[arg-type]
    monkeypatch.setattr(cpu_attn, "_get_attn_isa", lambda *a: "amx")
    with pytest.raises(UnsupportedEngineError, match=r"'amx' with kv_cache_dtype 'fp8'.*allowed: 'auto'"):
        detect_layout(fake_config(cache_dtype="fp8"), spec, cache)  # type: ignore[arg-type]
    with pytest.raises(UnsupportedEngineError, match=r"does not match layout cpu_attn_amx"):
        detect_layout(fake_config(), spec, torch.zeros((4, 2, 64, 128), dtype=torch.bfloat16))  # type: ignore[arg-type]


# -- the engine -------------------------------------------------------------------------------------------------------

PROMPT_TOKENS = 300  # 2 full blocks of 128
_LAYOUT_RE = re.compile(r"registered \d+ KV layers, layout (\S+),")


@pytest.mark.engine
@pytest.mark.parametrize(
    ("dtype", "layout"),
    [
        pytest.param("bfloat16", KVLayout.CPU_ATTN_AMX, marks=pytest.mark.skipif(not HAS_AMX, reason=NO_AMX)),
        pytest.param("float32", KVLayout.CPU_ATTN),
    ],
    ids=["bf16-amx", "fp32-vec"],
)
def test_engine_restart_answers_from_store_in_the_cpus_layout(
    real_model: Path, tmp_path: Path, dtype: str, layout: KVLayout
) -> None:
    """SmolLM2 in the engine: the worker registers ``layout``, the restarted engine hits every stored block, loads
    them without a failure and answers exactly as the cold engine did."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(real_model))
    prompt = prompt_of_tokens(tok, PROMPT_TOKENS)
    spec = {
        "model": str(real_model),
        "dtype": dtype,
        "max_model_len": 1024,
        "connector": ucm_transfer_config(ucm_extra_config(tmp_path / "store")),
        "requests": [{"prompt": prompt, "max_tokens": 12}],
    }
    (cold,), log1 = run_engine(spec)
    (warm,), log2 = run_engine(spec)
    assert _LAYOUT_RE.findall(log1) == [layout.value], log1[-3000:]
    assert cold.hit_external == 0 and warm.hit_external == cold.total_blocks >= PROMPT_TOKENS // 128
    assert failed_loads(log2) == 0, log2[-3000:]
    assert warm.token_ids == cold.token_ids, (warm.text, cold.text)
