"""The ReRoPE oracle (``ucm.kernels.rerope.naive``) against independent computations: dense RoPE attention where the
rectification changes nothing, a hand-rotated score where it does, invariance to a shift of all positions, and
grouped-query heads."""

from __future__ import annotations

import math

import pytest
import torch

from ucm.kernels.rerope import rectified_distance, rerope_attention_reference, rope_reference

NQ, NK, HEADS, KV_HEADS, D = 5, 12, 4, 2, 16


def qkv(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn((NQ, HEADS, D), generator=g, dtype=torch.float64),
        torch.randn((NK, KV_HEADS, D), generator=g, dtype=torch.float64),
        torch.randn((NK, KV_HEADS, D), generator=g, dtype=torch.float64),
    )


def dense_rope_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    neox: bool = True,
    rotary_dim: int = D,
) -> torch.Tensor:
    """Textbook causal attention over RoPE-rotated q and k (absolute positions), float64."""
    qr = rope_reference(q, q_pos, rotary_dim, 10000.0, neox)
    kr = rope_reference(k, k_pos, rotary_dim, 10000.0, neox).repeat_interleave(HEADS // KV_HEADS, dim=1)
    vv = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", qr, kr) * D**-0.5
    scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), vv)


Q_POS = torch.arange(NK - NQ, NK)  # the last 5 of 12 positions: a prefill chunk over a cached prefix
K_POS = torch.arange(NK)


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("rotary_dim", [D, D // 2])
def test_a_window_past_every_distance_is_rope(neox: bool, rotary_dim: int) -> None:
    q, k, v = qkv(1)
    got = rerope_attention_reference(
        q, k, v, Q_POS, K_POS, window=NK, rotary_dim=rotary_dim, neox=neox
    )  # fmt: skip
    want = dense_rope_attention(q, k, v, Q_POS, K_POS, neox, rotary_dim)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_leaky_factor_one_is_rope_for_any_window() -> None:
    q, k, v = qkv(2)
    got = rerope_attention_reference(q, k, v, Q_POS, K_POS, window=2, leaky_factor=1.0)
    torch.testing.assert_close(got, dense_rope_attention(q, k, v, Q_POS, K_POS), rtol=1e-12, atol=1e-12)


def test_distances_past_the_window_are_read_as_the_window() -> None:
    """One query at position 10, keys at 9 (distance 1, inside a window of 3) and 2 (distance 8: read as 3, or as
    3 + 5 / 2 leaky): the output matches attention computed with those relative positions by hand."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn((1, 1, D), generator=g, dtype=torch.float64)
    k = torch.randn((2, 1, D), generator=g, dtype=torch.float64)
    v = torch.randn((2, 1, D), generator=g, dtype=torch.float64)
    for leaky, far in ((math.inf, 3.0), (2.0, 5.5)):
        got = rerope_attention_reference(
            q, k, v, torch.tensor([10]), torch.tensor([9, 2]), window=3, leaky_factor=leaky
        )  # fmt: skip
        rotated = [rope_reference(q, torch.tensor([r]), D, 10000.0)[0, 0] for r in (1.0, far)]
        scores = torch.stack([rotated[j] @ k[j, 0] for j in range(2)]) * D**-0.5
        want = torch.softmax(scores, dim=0) @ v[:, 0]
        torch.testing.assert_close(got[0, 0], want, rtol=1e-12, atol=1e-12)


def test_only_distances_matter() -> None:
    q, k, v = qkv(4)
    a = rerope_attention_reference(q, k, v, Q_POS, K_POS, window=4, leaky_factor=3.0)
    b = rerope_attention_reference(q, k, v, Q_POS + 1000, K_POS + 1000, window=4, leaky_factor=3.0)
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_rerope_differs_from_rope_past_the_window() -> None:
    q, k, v = qkv(5)
    rerope = rerope_attention_reference(q, k, v, Q_POS, K_POS, window=4)
    rope = dense_rope_attention(q, k, v, Q_POS, K_POS)
    assert (rerope - rope).abs().max() > 1e-3


def test_grouped_query_heads_share_their_kv_head() -> None:
    q, k, v = qkv(6)
    got = rerope_attention_reference(q, k, v, Q_POS, K_POS, window=4)
    for h in range(HEADS):
        alone = rerope_attention_reference(
            q[:, h : h + 1], k[:, h // 2 : h // 2 + 1], v[:, h // 2 : h // 2 + 1], Q_POS, K_POS, window=4
        )
        torch.testing.assert_close(got[:, h : h + 1], alone, rtol=0, atol=0)


def test_rectified_distance() -> None:
    d = torch.tensor([0.0, 3.0, 4.0, 10.0])
    assert rectified_distance(d, 4, math.inf).tolist() == [0.0, 3.0, 4.0, 4.0]
    assert rectified_distance(d, 4, 2.0).tolist() == [0.0, 3.0, 4.0, 7.0]
    assert rectified_distance(d, 4, 1.0).tolist() == d.tolist()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"window": 0}, "window"), ({"window": 4, "leaky_factor": 0.5}, "leaky_factor"),
     ({"window": 4, "rotary_dim": 3}, "rotary_dim")],
)  # fmt: skip
def test_bad_arguments_are_refused(kwargs: dict, match: str) -> None:
    q, k, v = qkv(7)
    with pytest.raises(ValueError, match=match):
        rerope_attention_reference(q, k, v, Q_POS, K_POS, **kwargs)
