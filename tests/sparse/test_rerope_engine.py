"""ReRoPE switched on from the UCM config, through the real engine (CPU build) and the real connector: the quality
harness on the trained recall model (trained at 256 tokens), dense against ReRoPE (window 128), at 64, 256 and 1024
tokens. Dense fails at 4x its training length; ReRoPE answers there as it does at 1x; a prompt shorter than the
window gives dense's tokens exactly; the warm pass (every full block served by UCM's store) answers as the cold one;
the store keeps ReRoPE's blocks under a namespace of their own."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.engine

WINDOW = 128


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[dict, Path]:
    work = tmp_path_factory.mktemp("rerope")
    config = work / "ucm.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "ucm_connectors": [
                    {
                        "ucm_connector_name": "UcmPipelineStore",
                        "ucm_connector_config": {"store_pipeline": "Cache|Posix"},
                    }
                ],
                "ucm_sparse_config": {"ReRoPE": {"window": WINDOW}},
            }
        )
    )
    proc = subprocess.run(
        [sys.executable, "-m", "ucm.quality", "--model", "recall", "--config", str(config), "--short",
         "--lengths", "64,256,1024", "--work-dir", str(work / "work")],
        capture_output=True, text=True, timeout=1200, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), work / "work"


def test_rerope_answers_at_four_times_the_trained_length(run) -> None:
    report, _ = run
    dense = report["runs"]["dense"]["accuracy"]["recall"]
    assert dense["256"] == 1.0 and dense["1024"] <= 0.5, dense  # dense collapses at 4x
    for name in ("cold", "warm"):
        acc = report["runs"][name]["accuracy"]["recall"]
        assert acc["1024"] >= 0.9 * acc["256"] and acc["256"] == 1.0, (name, acc)


def test_prompts_shorter_than_the_window_are_dense(run) -> None:
    report, _ = run
    for name in ("cold", "warm"):
        mismatched = report["runs"][name]["vs_dense"]["mismatched"]
        assert not [item for item in mismatched if item.startswith("recall-L64-")], mismatched


def test_rerope_blocks_have_a_namespace_of_their_own(run) -> None:
    _, work = run
    (described,) = [json.loads(p.read_text()) for p in (work / "ucm_store" / "namespaces").glob("*.json")]
    assert described["attention"] == f"rerope(window={WINDOW},leaky_factor=None)"
    external = [int(m) for m in re.findall(r"hit external: (\d+)", (work / "ucm.log").read_text())]
    assert 0 in external and max(external) >= 1024 // 128 - 1  # cold misses; warm: the 1024-token prompts' blocks


def test_a_restart_hit_gives_the_same_answers(tmp_path: Path) -> None:
    """ReRoPE on, 1024-token recall prompts (8 windows): a second engine process on the same store (a restart) loads
    every full block from storage and gives the first process's tokens, with its log-probs to float rounding."""
    from ucm.quality import RECALL_MODEL_DIR
    from ucm.quality.harness import build_items, model_max_len
    from ucm.testing.engine import run_engine, ucm_transfer_config

    items = build_items(RECALL_MODEL_DIR, "recall", [1024], short=True, seed=3)[:3]
    extra = {
        "ucm_connectors": [
            {
                "ucm_connector_name": "UcmPipelineStore",
                "ucm_connector_config": {"store_pipeline": "Cache|Posix", "storage_backends": str(tmp_path / "s")},
            }
        ],
        "ucm_sparse_config": {"ReRoPE": {"window": WINDOW}},
    }
    spec = {
        "model": str(RECALL_MODEL_DIR),
        "max_model_len": model_max_len(RECALL_MODEL_DIR),
        "kvcache_gib": 1,
        "connector": ucm_transfer_config(extra),
        "requests": [{"prompt": it.prompt, "max_tokens": it.max_tokens, "reset_prefix_cache": True} for it in items],
    }
    cold, _ = run_engine(spec)
    restart, _ = run_engine(spec)
    for first, again in zip(cold, restart, strict=True):
        assert first.hit_external == 0 and again.hit_external == again.num_prompt_tokens // 128 >= 7
        assert again.token_ids == first.token_ids
        assert max(abs(a - b) for a, b in zip(first.logprobs, again.logprobs, strict=True)) < 1e-3


def test_kept_request_kv_gives_the_tokens_of_recomputing_every_step(tmp_path: Path) -> None:
    """Six recall prompts of about 620 and 980 tokens batched on a KV cache of 17 blocks of 128 tokens (up to three
    requests at once, others wait; a request that needs a block preempts another, recomputed later on other blocks):
    with the running requests' values and far keys kept from step to step (the default ``decode_cache_gb``) and
    with nothing kept (0), the same tokens and log-probs, bit for bit (the kernel gives a kept entry's result
    exactly). A block allocated again under an unchanged block-table row, which no schedule here produces, is
    covered by ``test_rerope_kept.py``."""
    from ucm.quality import RECALL_MODEL_DIR
    from ucm.quality.harness import build_items, model_max_len
    from ucm.testing.engine import run_engine, ucm_transfer_config

    items = [it for length in (640, 1000) for it in build_items(RECALL_MODEL_DIR, "recall", [length], True, 5)[:3]]
    results, logs = [], []
    for keep_gb in (1.0, 0.0):
        extra = {
            "ucm_connectors": [
                {
                    "ucm_connector_name": "UcmPipelineStore",
                    "ucm_connector_config": {"store_pipeline": "Posix", "storage_backends": str(tmp_path / "s")},
                }
            ],
            "ucm_sparse_config": {"ReRoPE": {"window": WINDOW, "decode_cache_gb": keep_gb}},
        }
        spec = {
            "model": str(RECALL_MODEL_DIR),
            "max_model_len": model_max_len(RECALL_MODEL_DIR),
            "enable_prefix_caching": False,
            "engine_args": {"num_gpu_blocks_override": 17, "block_size": 128},
            "connector": ucm_transfer_config(extra, kv_role="kv_consumer"),  # an empty store: no loads, no dumps
            "batch": True,
            "requests": [{"prompt": it.prompt, "max_tokens": 48} for it in items],
        }
        out, log = run_engine(spec)
        results.append(out)
        logs.append(log)
    kept, recomputed = results
    assert "reused the values and far keys a request kept" in logs[0]
    assert "reused the values and far keys a request kept" not in logs[1]
    for a, b in zip(kept, recomputed, strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert sum(it.answer in r.text for it, r in zip(items, kept, strict=True)) >= 5  # ReRoPE answers at 4x
