"""UCMConnector inside vLLM's MultiConnector, paired with vLLM's ExampleConnector (as the seeds pair UCM with
another connector): both store what the engine computes, UCM serves a shared prefix after a restart, and the
output is the engine's own."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import assert_same_output, ucm_extra_config
from ucm.testing.engine import failed_loads, run_engine, ucm_transfer_config
from ucm.testing.texts import prompt_of_tokens

pytestmark = pytest.mark.engine

MAX_TOKENS = 12


def _multi(store: Path, example_dir: Path) -> dict:
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        # MultiConnector gives each child its own copy of the transfer config: the policy UCM sets on its copy does
        # not reach the scheduler, so it is set here (see docs/configuration.md, "With vLLM's MultiConnector").
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "connectors": [
                ucm_transfer_config(ucm_extra_config(store)),
                {
                    "kv_connector": "ExampleConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"shared_storage_path": str(example_dir)},
                },
            ]
        },
    }


def test_multi_connector_with_example_connector(tiny_model, tokenizer, tmp_path):
    long = prompt_of_tokens(tokenizer, 800)
    ids = tokenizer.encode(long, add_special_tokens=False)
    p1, p2 = tokenizer.decode(ids[:600]), tokenizer.decode(ids[:800])  # p2 starts with p1's 4 full blocks
    store, example_dir = tmp_path / "ucm", tmp_path / "example"

    def spec(connector: dict | None, prompt: str) -> dict:
        return {
            "model": str(tiny_model),
            "dtype": "float32",
            "max_model_len": 2048,
            "connector": connector,
            "requests": [{"prompt": prompt, "max_tokens": MAX_TOKENS}],
        }

    (baseline,), _ = run_engine(spec(None, p2))
    (cold,), _ = run_engine(spec(_multi(store, example_dir), p1))
    assert (cold.total_blocks, cold.hit_external) == (4, 0)
    assert len(list(store.rglob("*.ucmb"))) == 4  # UCM stored the prompt's full blocks
    assert any(example_dir.rglob("*.safetensors"))  # and so did the other connector

    (warm,), warm_log = run_engine(spec(_multi(store, example_dir), p2))
    # ExampleConnector matches whole prompts only; UCM serves the shared prefix.
    assert (warm.total_blocks, warm.hit_hbm, warm.hit_external) == (6, 0, 4), warm_log[-3000:]
    assert failed_loads(warm_log) == 0
    assert_same_output(warm, baseline)
