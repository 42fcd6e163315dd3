"""The quality harness end to end, as CI runs it: ``python -m ucm.quality --short`` on the trained recall model
with a UCM ``Cache|Posix`` config, through the real vLLM engine (CPU build) and the real connector.

UCM's prefix caching is lossless, so on the float32 model the cold pass and the warm pass (every full block loaded
from UCM's store) must reproduce the dense baseline exactly: the same greedy tokens for every prompt, log-probs equal
within ``LOGPROB_TOL``, the same accuracy in every cell. The shipped model must also still solve its task at its
training length (a broken asset or tokenizer fails here).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import LOGPROB_TOL
from ucm.quality import RECALL_MODEL_DIR
from ucm.quality.recall import RecallSpec

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("quality")
    config = work / "ucm.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "ucm_connectors": [
                    {
                        "ucm_connector_name": "UcmPipelineStore",
                        "ucm_connector_config": {"store_pipeline": "Cache|Posix", "storage_backends": "unused"},
                    }
                ]
            }
        )
    )
    proc = subprocess.run(
        [sys.executable, "-m", "ucm.quality", "--model", "recall", "--config", str(config), "--short"],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_report_shape(report):
    assert set(report["runs"]) == {"dense", "cold", "warm"}
    assert report["suite"] == "recall" and report["short"] is True
    assert all(run["perplexity"] is not None for run in report["runs"].values())


def test_trained_model_solves_recall_at_training_length(report):
    train_len = RecallSpec.load(RECALL_MODEL_DIR).train_len
    assert report["runs"]["dense"]["accuracy"]["recall"][str(train_len)] >= 0.9


def test_warm_pass_is_served_by_ucm(report):
    vs = report["runs"]["warm"]["vs_dense"]
    generate_prompts = sum(1 for k in report["prompt_tokens"] if not k.startswith("perplexity"))
    assert vs["hit_blocks"] >= generate_prompts  # every prompt (>= 234 tokens, blocks of 128) loads >= 1 block


@pytest.mark.parametrize("run", ["cold", "warm"])
def test_ucm_prefix_caching_equals_dense(report, run):
    dense, got = report["runs"]["dense"], report["runs"][run]
    vs = got["vs_dense"]
    assert vs["exact_match_rate"] == 1.0, vs["mismatched"]
    assert vs["max_abs_logprob_diff"] < LOGPROB_TOL
    assert got["accuracy"] == dense["accuracy"]
    assert got["answers"] == dense["answers"]
    assert vs["perplexity_mean_abs_logprob_diff"] < LOGPROB_TOL


def test_max_model_len_past_the_trained_length_raises_max_position_embeddings() -> None:
    """``--max-model-len`` above the model's ``max_position_embeddings`` (1024 for the recall model) raises that value
    through vLLM's ``hf_overrides`` and lets prompts up to it be built; at or below it nothing is overridden."""
    from ucm.quality.harness import build_items, engine_spec

    longer = engine_spec(RECALL_MODEL_DIR, "auto", None, 2048)
    assert longer["max_model_len"] == 2048
    assert longer["engine_args"] == {"hf_overrides": {"max_position_embeddings": 2048}}
    assert engine_spec(RECALL_MODEL_DIR, "auto", 32, None) == {
        **longer,
        "max_model_len": 1024,
        "engine_args": {"block_size": 32},
    }
    items = build_items(RECALL_MODEL_DIR, "recall", [2048], True, 0, 2048)
    assert {it.length for it in items if it.task == "recall"} == {2048}
    with pytest.raises(ValueError, match=r"length 2048 must be in 64\.\.1024"):
        build_items(RECALL_MODEL_DIR, "recall", [2048], True, 0)
