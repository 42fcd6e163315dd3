"""CacheBlend's kernels (``ucm.kernels.blend``): ``rope_delta_`` (re-aligning stored keys to new positions) against
the float64 RoPE oracle, with the Triton kernel bit for bit equal to the torch path, delta 0 leaving every bit alone,
``+d`` then ``-d`` returning the keys, and rotation composing with the position the key was cached at;
``kv_deviation`` against its float64 oracle; ``select_recompute`` against its Python-sort oracle and by hand; the
Triton kernels interpreted (in a ``TRITON_INTERPRET=1`` child) and compiled for sm_90."""

from __future__ import annotations

import os

import pytest
import torch

from tests.kernels.interp import INTERPRETED, needs_interpreter, run_interpreted
from tests.kernels.kv_data import int_view, random_kv
from tests.kernels.sm90 import compile_for_sm90
from ucm.kernels.blend import (
    kv_deviation,
    kv_deviation_reference,
    question_attention,
    question_attention_reference,
    recompute_count,
    rope_delta_,
    rope_delta_reference,
    select_recompute,
    select_recompute_reference,
)
from ucm.kernels.blend.torch import CHUNK_TOKENS
from ucm.kernels.blend.triton import (
    deviation_kernel_meta,
    kv_deviation_kernel,
    rope_delta_kernel,
    rope_kernel_meta,
)
from ucm.kernels.rerope import rope_reference

# (num_tokens, num_kv_heads, head_dim): an odd head count and a token count past one program's block, Llama-3-8B's
# heads, one head of a non-power-of-two width (its half-rotation, 10 pairs, too).
SHAPES = [(37, 3, 64), (130, 8, 128), (5, 1, 40)]
SHAPE_IDS = [f"t{t}-h{h}-d{d}" for t, h, d in SHAPES]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]
# (share of head_dim rotated, neox)
ROPES = [(1, True), (1, False), (2, True), (2, False)]
ROPE_IDS = ["neox", "gptj", "neox-half", "gptj-half"]
IMPLS = ["torch", "cpu", "reference", pytest.param("triton", marks=needs_interpreter)]
BASE = 10000.0
# Per-dtype (rtol, atol) for the rotated keys: about two roundings to the dtype (the input's and the output's) of
# values of magnitude up to ~4 (randn), or float32 arithmetic on them.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2**-7, 2**-5), torch.float16: (2**-10, 2**-8)}
DEV_RTOL = 1e-5  # float32 sums of up to 2 * 8 * 128 non-negative terms, reordered


def make_keys(
    shape: tuple[int, int, int], dtype: torch.dtype, seed: int = 0, moves: str = "mixed"
) -> tuple[torch.Tensor, torch.Tensor]:
    """randn keys in ``dtype`` and int64 deltas. ``moves``: ``"mixed"``, every fourth delta 0, then +1, -1, and
    values up to +-100000 (angles of 1e5 radians at the highest frequency); ``"all"``, such values, none 0 (the torch
    path rotates in place); ``"one"``, one delta for every token (a stored chunk moved: one cos/sin row)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(shape, generator=g).to(dtype)
    delta = torch.randint(-100_000, 100_000, (shape[0],), generator=g)
    if moves == "mixed":
        delta[::4] = 0
        delta[1:3] = torch.tensor([1, -1])
    elif moves == "all":
        delta[delta == 0] = 7
    else:
        delta[:] = 1037
    return keys, delta


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(int_view(a), int_view(b))


def check_rotated(got: torch.Tensor, before: torch.Tensor, delta: torch.Tensor, rotary_dim: int, neox: bool) -> None:
    """``got`` is ``before`` rotated by ``delta`` within the dtype's tolerance; tokens with delta 0 and channels
    past ``rotary_dim`` bit for bit as they were."""
    want = rope_delta_reference(before, delta, rotary_dim=rotary_dim, base=BASE, neox=neox)
    rtol, atol = TOL[got.dtype]
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol)
    still = delta == 0
    assert bits_equal(got[still], before[still])
    assert bits_equal(got[:, :, rotary_dim:], before[:, :, rotary_dim:])


# -- rope_delta_ --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize(("share", "neox"), ROPES, ids=ROPE_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("impl", IMPLS)
def test_rope_delta_matches_reference(
    impl: str, dtype: torch.dtype, share: int, neox: bool, shape: tuple[int, int, int]
) -> None:
    keys, delta = make_keys(shape, dtype)
    before = keys.clone()
    rotary_dim = shape[2] // share
    got = rope_delta_(keys, delta, rotary_dim=rotary_dim, base=BASE, neox=neox, impl=impl)  # type: ignore[arg-type]
    assert got is keys
    check_rotated(keys, before, delta, rotary_dim, neox)


@pytest.mark.parametrize("moves", ["all", "one"])
@pytest.mark.parametrize(("share", "neox"), ROPES, ids=ROPE_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rope_delta_moving_every_token_matches_reference(
    dtype: torch.dtype, share: int, neox: bool, moves: str
) -> None:
    """Every token moved (the torch path rotates the keys where they lie), by one delta or by many."""
    keys, delta = make_keys((2 * CHUNK_TOKENS + 5, 2, 64), dtype, moves=moves)  # over several chunks of tokens
    before = keys.clone()
    rope_delta_(keys, delta, rotary_dim=64 // share, base=BASE, neox=neox, impl="cpu")
    check_rotated(keys, before, delta, 64 // share, neox)


@needs_interpreter
@pytest.mark.parametrize("moves", ["mixed", "all", "one"])
@pytest.mark.parametrize(("share", "neox"), ROPES, ids=ROPE_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rope_delta_triton_is_torch_bit_for_bit(dtype: torch.dtype, share: int, neox: bool, moves: str) -> None:
    """Same host cos/sin tables, same float32 operations (no FMA), round to nearest even: the interpreted kernel
    writes the torch path's bits, on head-major (non-contiguous) keys too, whichever path the torch code takes
    (some tokens moved: gathered and scattered; every token: rotated in place, from one cos/sin row or many)."""
    keys, delta = make_keys((130, 8, 128), dtype, seed=1, moves=moves)
    rotary_dim = 128 // share
    want = rope_delta_(keys.clone(), delta, rotary_dim=rotary_dim, neox=neox, impl="torch")
    got = rope_delta_(keys.clone(), delta, rotary_dim=rotary_dim, neox=neox, impl="triton")
    assert bits_equal(got, want)
    head_major = keys.transpose(0, 1).contiguous().transpose(0, 1)  # [T, H, D], token stride D
    rope_delta_(head_major, delta, rotary_dim=rotary_dim, neox=neox, impl="triton")
    assert bits_equal(head_major, want)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy on sNaN
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("impl", IMPLS)
def test_rope_delta_zero_is_identity(impl: str, dtype: torch.dtype) -> None:
    """Delta 0 leaves a token's bits alone, NaN payloads, infinities, signed zeros and subnormals included (rotating
    by 0 would turn ``inf * sin(0)`` into NaN and could flip a zero's sign): all-zero deltas, and zero deltas beside
    nonzero ones."""
    keys = random_kv((37, 3, 64), dtype, torch.Generator().manual_seed(2))
    before = keys.clone()
    rope_delta_(keys, torch.zeros(37, dtype=torch.int64), impl=impl)  # type: ignore[arg-type]
    assert bits_equal(keys, before)
    delta = torch.zeros(37, dtype=torch.int64)
    delta[5::3] = 17
    rope_delta_(keys, delta, impl=impl)  # type: ignore[arg-type]
    assert bits_equal(keys[delta == 0], before[delta == 0])
    assert not bits_equal(keys[delta != 0], before[delta != 0])


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_rope_delta_round_trip(impl: str, dtype: torch.dtype, neox: bool) -> None:
    """Rotating by ``+d`` then ``-d`` gives the keys back within the dtype's tolerance."""
    keys, delta = make_keys((37, 3, 64), dtype, seed=3)
    before = keys.clone()
    rope_delta_(keys, delta, neox=neox, impl=impl)  # type: ignore[arg-type]
    rope_delta_(keys, -delta, neox=neox, impl=impl)  # type: ignore[arg-type]
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(keys.double(), before.double(), rtol=rtol, atol=atol)


@pytest.mark.parametrize(("share", "neox"), ROPES, ids=ROPE_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_rope_delta_composes_with_the_cached_position(impl: str, dtype: torch.dtype, share: int, neox: bool) -> None:
    """A key cached rotated at position ``p``, rotated by ``delta``, is the key rotated at ``p + delta`` (built from
    the unrotated key by the float64 oracle), for chunks moved forward and back."""
    n, h, d = 37, 3, 64
    g = torch.Generator().manual_seed(4)
    raw = torch.randn((n, h, d), generator=g, dtype=torch.float64)
    cached_at = torch.randint(0, 32_000, (n,), generator=g)
    delta = torch.randint(-32_000, 32_000, (n,), generator=g)
    keys = rope_reference(raw, cached_at, d // share, BASE, neox).to(dtype)
    rope_delta_(keys, delta, rotary_dim=d // share, base=BASE, neox=neox, impl=impl)  # type: ignore[arg-type]
    want = rope_reference(raw, cached_at + delta, d // share, BASE, neox)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(keys.double(), want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_rope_delta_of_keys_inside_a_qkv_buffer(impl: str) -> None:
    """Keys as the model's fused QKV output holds them (``[T, (HQ + 2 * H) * D]``, keys a strided view; deltas a
    strided view too): rotated in place like a contiguous copy, bit for bit, and the queries and values around them
    untouched."""
    t, hq, h, d = 37, 6, 2, 64
    qkv = torch.randn((t, (hq + 2 * h) * d), generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    keys = qkv[:, hq * d : (hq + h) * d].view(t, h, d)
    assert not keys.is_contiguous()
    before = qkv.clone()
    delta = make_keys((t, h, d), torch.bfloat16)[1].repeat_interleave(2)[::2]
    assert not delta.is_contiguous()
    want = rope_delta_(keys.clone(), delta, rotary_dim=48, neox=False, impl=impl)  # type: ignore[arg-type]
    rope_delta_(keys, delta, rotary_dim=48, neox=False, impl=impl)  # type: ignore[arg-type]
    assert bits_equal(keys, want)
    others = torch.ones_like(qkv, dtype=torch.bool)
    others[:, hq * d : (hq + h) * d] = False
    assert bits_equal(qkv[others], before[others])


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_offsets_past_2_31(impl: str) -> None:
    """Three tokens 2**30 + 64 float16 elements apart in one lazily allocated buffer (pages committed only where
    written): the last token lies past 2**31 elements, where int32 offsets wrap."""
    stride = 2**30 + 64
    buf = torch.empty(2 * stride + 2 * 64, dtype=torch.float16)
    keys = buf.as_strided((3, 2, 64), (stride, 64, 1))
    assert keys[2].data_ptr() - buf.data_ptr() >= 2**31 * buf.element_size()
    keys.copy_(torch.randn((3, 2, 64), generator=torch.Generator().manual_seed(6)).to(torch.float16))
    before = keys.clone()
    delta = torch.tensor([5, -7, 900])
    rope_delta_(keys, delta, impl=impl)  # type: ignore[arg-type]
    check_rotated(keys, before, delta, 64, True)
    got = kv_deviation(keys, keys, before, torch.zeros_like(before), impl=impl)  # type: ignore[arg-type]
    want = kv_deviation_reference(keys, keys, before, torch.zeros_like(before))
    torch.testing.assert_close(got.double(), want, rtol=DEV_RTOL, atol=0.0)


# -- kv_deviation ---------------------------------------------------------------------------------------------------


def make_kv(shape: tuple[int, int, int], dtype: torch.dtype, seed: int = 7) -> list[torch.Tensor]:
    """``[k_new, v_new, k_old, v_old]``: stored KV, and recomputed KV = stored + noise of a per-token scale from 0
    (tokens 0 and 3: identical KV, deviation exactly 0) to 1."""
    g = torch.Generator().manual_seed(seed)
    k_old, v_old = (torch.randn(shape, generator=g) for _ in range(2))
    scale = torch.rand((shape[0], 1, 1), generator=g)
    scale[[0, 3 % shape[0]]] = 0.0
    k_new, v_new = (x + scale * torch.randn(shape, generator=g) for x in (k_old, v_old))
    return [x.to(dtype) for x in (k_new, v_new, k_old, v_old)]


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("impl", IMPLS)
def test_kv_deviation_matches_reference(impl: str, dtype: torch.dtype, shape: tuple[int, int, int]) -> None:
    kv = make_kv(shape, dtype)
    got = kv_deviation(*kv, impl=impl)  # type: ignore[arg-type]
    want = kv_deviation_reference(*kv)
    assert got.dtype == torch.float32 and got.shape == (shape[0],)
    torch.testing.assert_close(got.double(), want, rtol=DEV_RTOL, atol=0.0)
    assert float(got[0]) == 0.0 and float(got[3 % shape[0]]) == 0.0  # identical KV: exactly 0


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_kv_deviation_of_strided_inputs(impl: str) -> None:
    """New KV as views of a fused QKV output, old keys head-major, old values with strided channels (the Triton
    launcher copies those first): the same deviations as from contiguous copies."""
    t, hq, h, d = 37, 6, 2, 64
    k_new, v_new, k_old, v_old = make_kv((t, h, d), torch.bfloat16)
    qkv = torch.zeros((t, (hq + 2 * h) * d), dtype=torch.bfloat16)
    qkv[:, hq * d :] = torch.cat((k_new, v_new), dim=1).view(t, 2 * h * d)
    k_view = qkv[:, hq * d : (hq + h) * d].view(t, h, d)
    v_view = qkv[:, (hq + h) * d :].view(t, h, d)
    k_head_major = k_old.transpose(0, 1).contiguous().transpose(0, 1)
    v_channel_strided = torch.zeros((t, h, 2 * d), dtype=torch.bfloat16)
    v_channel_strided[..., ::2] = v_old
    strided = (k_view, v_view, k_head_major, v_channel_strided[..., ::2])
    assert not any(x.is_contiguous() for x in strided)
    got = kv_deviation(*strided, impl=impl)  # type: ignore[arg-type]
    want = kv_deviation_reference(k_new, v_new, k_old, v_old)
    torch.testing.assert_close(got.double(), want, rtol=DEV_RTOL, atol=0.0)


# -- select_recompute -----------------------------------------------------------------------------------------------


def deviations(case: str) -> torch.Tensor:
    """float32 ``[50]`` deviations: ``random``; ``ties`` (5 levels, each shared by ~10 tokens); ``special`` (ties
    with NaN, +inf and 0); ``equal`` (all the same)."""
    g = torch.Generator().manual_seed(8)
    if case == "random":
        return torch.rand(50, generator=g)
    if case == "equal":
        return torch.full((50,), 0.25)
    dev = torch.randint(0, 5, (50,), generator=g).float()
    if case == "special":
        dev[[3, 30]] = float("nan")
        dev[[7, 8]] = float("inf")
        dev[10:20] = 0.0
    return dev


RATIOS = [0.0, 0.07, 0.1, 0.15, 0.5, 0.999, 1.0]


@pytest.mark.parametrize("with_always", [False, True], ids=["ratio-only", "with-always"])
@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("case", ["random", "ties", "special", "equal"])
@pytest.mark.parametrize("impl", ["torch", "cpu", "reference"])
def test_select_recompute_matches_reference(impl: str, case: str, ratio: float, with_always: bool) -> None:
    dev = deviations(case)
    always = (torch.arange(50) % 7 == 2) if with_always else None
    got = select_recompute(dev, ratio, always=always, impl=impl)  # type: ignore[arg-type]
    want = select_recompute_reference(dev, ratio, always=always)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert torch.equal(got, got.unique())  # distinct, ascending
    assert got.numel() >= recompute_count(50, ratio)


@pytest.mark.parametrize("impl", ["torch", "reference"])
def test_select_recompute_by_hand(impl: str) -> None:
    """Ties at the threshold go to the lower indices; NaN ranks first; ratio 1 is every token, ratio 0 only
    ``always``'s; ``always`` tokens already picked are not repeated; no tokens, no indices."""

    def pick(dev: list[float], ratio: float, always: list[bool] | None = None) -> list[int]:
        mask = None if always is None else torch.tensor(always)
        return select_recompute(torch.tensor(dev, dtype=torch.float32), ratio, always=mask, impl=impl).tolist()  # type: ignore[arg-type]

    assert pick([1, 5, 5, 5, 2], 0.4) == [1, 2]
    assert pick([0.5] * 10, 0.3) == [0, 1, 2]
    assert pick([1, float("nan"), 3, 2], 0.25) == [1]
    assert pick([1, float("nan"), 3, 2], 0.5) == [1, 2]
    assert pick([4, 3, 2, 1], 1.0) == [0, 1, 2, 3]
    assert pick([4, 3, 2, 1], 0.0, [False, False, True, True]) == [2, 3]
    assert pick([4, 3, 2, 1], 0.0) == []
    assert pick([4, 3, 2, 1], 0.25, [True, False, False, True]) == [0, 3]
    assert pick([], 0.5) == []


@pytest.mark.parametrize(
    ("num_tokens", "ratio", "count"),
    [(10, 0.1, 1), (100, 0.07, 7), (100, 0.15, 15), (3, 0.5, 2), (7, 1.0, 7), (7, 0, 0), (10, 1e-9, 1), (0, 0.5, 0)],
)
def test_recompute_count_is_the_decimal_ceiling(num_tokens: int, ratio: float, count: int) -> None:
    assert recompute_count(num_tokens, ratio) == count


# -- question_attention ---------------------------------------------------------------------------------------------

# (m, S, num_heads, num_kv_heads, head_dim): grouped heads (SmolLM2's 9 over 3), one query token, plain multi-head.
QA_SHAPES = [(5, 40, 9, 3, 64), (1, 17, 4, 2, 32), (3, 3, 2, 2, 16)]
# Per-dtype (rtol, atol) of the output: float32 softmax of inputs rounded to the dtype, output rounded once.
QA_TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (2**-7, 2**-7), torch.float16: (2**-10, 2**-9)}


def make_question(
    shape: tuple[int, int, int, int, int], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m, s, h, hk, d = shape
    g = torch.Generator().manual_seed(1)
    return tuple(torch.randn(shape, generator=g).to(dtype) for shape in ((m, h, d), (s, hk, d), (s, hk, d)))  # type: ignore[return-value]


@pytest.mark.parametrize("shape", QA_SHAPES, ids=[f"m{m}-s{s}-h{h}-kv{hk}" for m, s, h, hk, _ in QA_SHAPES])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("impl", ["torch", "cpu", "reference"])
def test_question_attention_matches_reference(
    impl: str, dtype: torch.dtype, shape: tuple[int, int, int, int, int]
) -> None:
    query, keys, values = make_question(shape, dtype)
    scale = shape[4] ** -0.5
    out, received = question_attention(query, keys, values, scale=scale, impl=impl)  # type: ignore[arg-type]
    want_out, want_received = question_attention_reference(query, keys, values, scale)
    assert out.dtype == dtype and out.shape == query.shape and received.dtype == torch.float32
    rtol, atol = QA_TOL[dtype]
    torch.testing.assert_close(out.double(), want_out.double(), rtol=rtol, atol=atol)
    torch.testing.assert_close(received.double(), want_received, rtol=1e-5, atol=1e-6)


def test_question_attention_by_hand() -> None:
    """Equal keys: each query row spreads its attention evenly over the keys it sees (causal), and its output is
    the mean of those values; a key past a row's position receives nothing from it."""
    m, s, h = 2, 4, 2
    query = torch.randn(m, h, 8)
    keys = torch.ones(s, 1, 8)
    values = torch.arange(s, dtype=torch.float32)[:, None, None].expand(s, 1, 8).contiguous()
    out, received = question_attention(query, keys, values, scale=0.125)
    # row 0 sits at position 2 (sees keys 0-2), row 1 at 3 (all four); 2 heads each
    torch.testing.assert_close(received, torch.tensor([2 / 3 + 2 / 4, 2 / 3 + 2 / 4, 2 / 3 + 2 / 4, 2 / 4]) * 1.0)
    torch.testing.assert_close(out[0], torch.full((h, 8), 1.0))
    torch.testing.assert_close(out[1], torch.full((h, 8), 1.5))
    assert float(received.sum()) == pytest.approx(m * h)


def test_question_attention_errors_name_the_bad_value() -> None:
    query, keys, values = make_question((5, 40, 9, 3, 64), torch.float32)
    with pytest.raises(ValueError, match=r"question_attention has no 'triton' implementation"):
        question_attention(query, keys, values, scale=0.1, impl="triton")
    with pytest.raises(ValueError, match=r"query must be float32/bfloat16/float16 \[m, num_heads, head_dim\], got "):
        question_attention(query[0], keys, values, scale=0.1)
    with pytest.raises(ValueError, match=r"keys must be torch.float32 \[S >= 5, num_kv_heads dividing 9, 64\]"):
        question_attention(query, keys[:, :2], values, scale=0.1)
    with pytest.raises(ValueError, match=r"values must be .* got torch.bfloat16"):
        question_attention(query, keys, values.bfloat16(), scale=0.1)
    with pytest.raises(ValueError, match=r"keys must be .*\[S >= 5,.* got torch.float32 \(4, 3, 64\)"):
        question_attention(query, keys[:4], values[:4], scale=0.1)


# -- errors ---------------------------------------------------------------------------------------------------------


def test_errors_name_the_bad_value() -> None:
    keys, delta = make_keys((37, 3, 64), torch.bfloat16)
    with pytest.raises(ValueError, match=r"impl must be one of .*got 'numba'"):
        rope_delta_(keys, delta, impl="numba")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"keys must be float32/bfloat16/float16 .* got torch.float64 \(37, 3, 64\)"):
        rope_delta_(keys.double(), delta)
    with pytest.raises(ValueError, match=r"delta must be int64 \[37\] \(one per token\), got torch.int32 \(37,\)"):
        rope_delta_(keys, delta.int())
    with pytest.raises(ValueError, match=r"delta must be int64 \[37\] .* got torch.int64 \(36,\)"):
        rope_delta_(keys, delta[:36])
    with pytest.raises(ValueError, match=r"rotary_dim must be even, >= 2 and <= head_dim \(64\), got 33"):
        rope_delta_(keys, delta, rotary_dim=33)
    with pytest.raises(ValueError, match=r"rotary_dim must be .* got 66"):
        rope_delta_(keys, delta, rotary_dim=66)
    with pytest.raises(ValueError, match=r"base must be a finite number > 0, got -1.0"):
        rope_delta_(keys, delta, base=-1.0)
    kv = make_kv((37, 3, 64), torch.bfloat16)
    with pytest.raises(ValueError, match=r"impl must be one of .*got 'numba'"):
        kv_deviation(*kv, impl="numba")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"v_old must match k_new \(torch.bfloat16 \(37, 3, 64\) on cpu\), got "):
        kv_deviation(*kv[:3], kv[3][:36])
    with pytest.raises(ValueError, match=r"k_old must match k_new .* got torch.float16"):
        kv_deviation(kv[0], kv[1], kv[2].half(), kv[3])
    with pytest.raises(ValueError, match=r"k_new must be float32/bfloat16/float16 .* got torch.int32"):
        kv_deviation(*(x.int() for x in kv))
    dev = torch.rand(10)
    for bad in (1.5, -0.1, float("nan"), "0.5"):
        with pytest.raises(ValueError, match=rf"ratio must be a real number in \[0, 1\], got {bad!r}"):
            select_recompute(dev, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"select_recompute has no 'triton' implementation; impl must be one of"):
        select_recompute(dev, 0.5, impl="triton")
    with pytest.raises(ValueError, match=r"always must be bool \[10\] on cpu .* got torch.int64 \(10,\)"):
        select_recompute(dev, 0.5, always=torch.ones(10, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"deviation must be a float \[num_tokens\] tensor, got torch.int64"):
        select_recompute(torch.arange(10), 0.5)


# -- Triton: compiled for sm_90, interpreted, native ------------------------------------------------------------------


def rope_signature(word: str, const: dict[str, int]) -> dict[str, str]:
    """``rope_delta_kernel``'s argument types for ``word`` keys (``"bf16"``, ``"fp16"``) and constexprs ``const``."""
    pointers = {"k_ptr": f"*{word}", "delta_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32"}
    scalars = {"num_tokens": "i32", "stride_t": "i64", "stride_h": "i64", "stride_d": "i64"}
    return {**pointers, **scalars, **dict.fromkeys(const, "constexpr")}


WORDS = {"bf16": torch.bfloat16, "fp16": torch.float16}
NOT_INTERPRETED = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 replaces @triton.jit"
)


@NOT_INTERPRETED
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("word", list(WORDS))
def test_rope_kernel_compile_for_sm90(word: str, neox: bool) -> None:
    # Llama-3-8B's KV heads, full rotation (neox) or a partial one (GPT-J style, as GPT-J's 64 of 256).
    const = rope_kernel_meta(8, 128 if neox else 64, neox, WORDS[word])
    compile_for_sm90(rope_delta_kernel, rope_signature(word, const), const)


@NOT_INTERPRETED
def test_rope_kernel_compile_for_sm90_without_fma() -> None:
    """Launched with ``enable_fp_fusion=False`` (as ``rope_delta_triton`` does), the kernel's PTX multiplies and
    adds with separate roundings, as the torch path does."""
    import triton
    from triton.backends.compiler import GPUTarget

    const = rope_kernel_meta(8, 128, True, torch.bfloat16)
    src = triton.compiler.ASTSource(fn=rope_delta_kernel, signature=rope_signature("bf16", const), constexprs=const)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False}).asm["ptx"]
    assert "mul.rn.f32" in ptx and "fma" not in ptx


@NOT_INTERPRETED
@pytest.mark.parametrize("word", list(WORDS))
def test_deviation_kernel_compile_for_sm90(word: str) -> None:
    const = deviation_kernel_meta(8, 128)
    strides = ["s_kn_t", "s_kn_h", "s_vn_t", "s_vn_h", "s_ko_t", "s_ko_h", "s_vo_t", "s_vo_h"]
    sig = {
        **dict.fromkeys(["kn_ptr", "vn_ptr", "ko_ptr", "vo_ptr"], f"*{word}"),
        "out_ptr": "*fp32",
        "num_tokens": "i32",
        **dict.fromkeys(strides, "i64"),
        **dict.fromkeys(const, "constexpr"),
    }
    compile_for_sm90(kv_deviation_kernel, sig, const)


@pytest.mark.skipif(INTERPRETED, reason="this is the parent of the interpreted run")
def test_triton_cases_interpreted() -> None:
    """This module's Triton cases, in a child pytest under ``TRITON_INTERPRET=1`` (see ``tests.kernels.interp``)."""
    run_interpreted(__file__, "triton and not compile and not interpreted and not native")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: native Triton runs only where a GPU exists")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_native_triton_matches_torch(dtype: torch.dtype) -> None:
    """On the GPU (``auto``: Triton): ``rope_delta_`` bit for bit the torch path on the CPU, ``kv_deviation`` its
    reference within float32 rounding."""
    keys, delta = make_keys((130, 8, 128), dtype)
    want = rope_delta_(keys.clone(), delta, impl="torch")
    got = rope_delta_(keys.cuda(), delta).cpu()
    assert bits_equal(got, want)
    kv = make_kv((130, 8, 128), dtype)
    got_dev = kv_deviation(*(x.cuda() for x in kv)).cpu()
    torch.testing.assert_close(got_dev.double(), kv_deviation_reference(*kv), rtol=DEV_RTOL, atol=0.0)
