"""Plain helpers of the PD tests: completions through real servers, their comparison, UCM's per-request lines."""

from __future__ import annotations

from pathlib import Path

from tests.helpers import LOGPROB_TOL
from ucm.testing.engine import HIT_RE
from ucm.testing.server import http_json

MAX_TOKENS = 12


def complete(url: str, model: str, prompt: str, **extra) -> dict:
    """A greedy ``/v1/completions`` answer with log-probs (``MAX_TOKENS`` tokens); fails the test on an error."""
    status, body = http_json(
        f"{url}/v1/completions",
        {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": 1, **extra},
    )
    assert status == 200, body
    return body


def assert_same(got: dict, want: dict) -> None:
    """Greedy tokens identical, log-probs within LOGPROB_TOL (as tests.helpers.assert_same_output)."""
    g, w = got["choices"][0], want["choices"][0]
    assert g["logprobs"]["tokens"] == w["logprobs"]["tokens"]
    assert g["text"] == w["text"]
    pairs = zip(g["logprobs"]["token_logprobs"], w["logprobs"]["token_logprobs"], strict=True)
    diff = max(abs(a - b) for a, b in pairs)
    assert diff < LOGPROB_TOL, f"log-probs differ by {diff}"


def hits(log: str | Path) -> dict[str, tuple[int, int, int]]:
    """UCM's per-request lines in a server log (its text or its path): request id -> (total blocks, hit hbm, hit
    external)."""
    text = log.read_text() if isinstance(log, Path) else log
    return {m[0]: (int(m[1]), int(m[2]), int(m[3])) for m in HIT_RE.findall(text)}
