"""``ucm_sparse_config`` with UCMConnector inside vLLM's MultiConnector.

MultiConnector builds each child from a copy of the engine config holding the child's own transfer config, so the
child UCMConnector applies its ``ucm_sparse_config`` (ReRoPE's stored KV gets ReRoPE's namespace); the attention
layers read the engine's config, and must find the same method there (``sparse_config_of``). Unit tests of that
lookup, then the real engine: ReRoPE through MultiConnector gives UCMConnector-alone's tokens, and its stored
blocks, loaded by UCMConnector alone, give them again."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.config import KVTransferConfig

from ucm.config import UcmConfigError, UcmSparseConfig
from ucm.integration.vllm.sparse_backend import sparse_config_of
from ucm.integration.vllm.ucm_connector import _check_layers_config

REROPE = {"ucm_sparse_config": {"ReRoPE": {"window": 128}}}


def _ucm(extra: dict[str, Any]) -> dict[str, Any]:
    return {"kv_connector": "UCMConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


def _example(path: Path) -> dict[str, Any]:
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(path)},
    }


def _multi(*children: dict[str, Any]) -> dict[str, Any]:
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",  # children's own policies do not reach the scheduler
        "kv_connector_extra_config": {"connectors": list(children)},
    }


def _of(transfer: dict[str, Any]) -> UcmSparseConfig | None:
    return sparse_config_of(SimpleNamespace(kv_transfer_config=KVTransferConfig(**transfer)))


def test_found_in_multi_connector_children_at_any_depth(tmp_path: Path) -> None:
    alone = _of(_ucm(REROPE))
    assert alone is not None and alone.ReRoPE is not None and alone.ReRoPE.window == 128
    assert _of(_multi(_ucm(REROPE), _example(tmp_path))) == alone
    assert _of(_multi(_example(tmp_path), _multi(_ucm(REROPE)))) == alone
    assert _of(_multi(_ucm(REROPE), _ucm(REROPE))) == alone  # equal configs: one method


def test_none_without_ucm_connector_or_sparse_config(tmp_path: Path) -> None:
    assert _of(_example(tmp_path)) is None
    assert _of(_multi(_example(tmp_path))) is None
    assert _of(_multi(_ucm({}), _example(tmp_path))) is None
    assert sparse_config_of(SimpleNamespace(kv_transfer_config=None)) is None


def test_differing_children_are_refused() -> None:
    gsa = {"ucm_sparse_config": {"GSA": {}}}
    with pytest.raises(UcmConfigError, match=r"2 UCMConnectors with different ucm_sparse_config.*ReRoPE.*GSA"):
        _of(_multi(_ucm(REROPE), _ucm(gsa)))
    with pytest.raises(UcmConfigError, match=r"different ucm_sparse_config \(\[.*ReRoPE.*None\]\)"):
        _of(_multi(_ucm(REROPE), _ucm({})))  # the second would store ReRoPE's KV as dense


def test_connector_refuses_layers_built_with_another_config() -> None:
    from ucm.integration.vllm import sparse_backend

    rerope = _of(_ucm(REROPE))
    saved = sparse_backend._LayersBuilt.count, sparse_backend._LayersBuilt.config
    try:
        sparse_backend._LayersBuilt.count, sparse_backend._LayersBuilt.config = 0, None
        _check_layers_config(rerope)  # no layer built in this process (a scheduler, a unit test): nothing to check
        sparse_backend._LayersBuilt.count = 30
        with pytest.raises(UcmConfigError, match=r"is \{'ReRoPE': \{'window': 128.*layers apply None"):
            _check_layers_config(rerope)
        sparse_backend._LayersBuilt.config = rerope
        _check_layers_config(rerope)
        with pytest.raises(UcmConfigError, match=r"is None, but the model's attention layers apply \{'ReRoPE'"):
            _check_layers_config(None)
    finally:
        sparse_backend._LayersBuilt.count, sparse_backend._LayersBuilt.config = saved


@pytest.mark.engine
def test_rerope_through_multi_connector_equals_ucm_connector_alone(tmp_path: Path) -> None:
    """Recall prompts of 1024 tokens (4x the recall model's trained length, where dense attention fails and ReRoPE
    answers), ReRoPE window 128: UCMConnector alone, then MultiConnector(UCMConnector, ExampleConnector) on another
    store, give the same tokens and log-probs; then UCMConnector alone on the MultiConnector engine's store loads
    every full block and gives them again (the blocks hold ReRoPE's KV, as their namespace says)."""
    from ucm.quality import RECALL_MODEL_DIR
    from ucm.quality.harness import build_items, model_max_len
    from ucm.testing.engine import run_engine, ucm_transfer_config

    items = build_items(RECALL_MODEL_DIR, "recall", [1024], short=True, seed=3)[:3]

    def extra(store: str) -> dict[str, Any]:
        return {
            "ucm_connectors": [
                {
                    "ucm_connector_name": "UcmPipelineStore",
                    "ucm_connector_config": {"store_pipeline": "Posix", "storage_backends": str(tmp_path / store)},
                }
            ],
            **REROPE,
        }

    def spec(connector: dict[str, Any]) -> dict[str, Any]:
        return {
            "model": str(RECALL_MODEL_DIR),
            "max_model_len": model_max_len(RECALL_MODEL_DIR),
            "kvcache_gib": 1,
            "connector": connector,
            "requests": [
                {"prompt": it.prompt, "max_tokens": it.max_tokens, "reset_prefix_cache": True} for it in items
            ],
        }

    alone, _ = run_engine(spec(ucm_transfer_config(extra("alone"))))
    multi, log = run_engine(spec(_multi(ucm_transfer_config(extra("multi")), _example(tmp_path / "example"))))
    assert "reused the values and far keys a request kept" in log  # the layers applied ReRoPE
    loaded, _ = run_engine(spec(ucm_transfer_config(extra("multi"))))
    assert sum(it.answer in r.text for it, r in zip(items, alone, strict=True)) >= 2  # ReRoPE answers at 4x
    for a, m, warm in zip(alone, multi, loaded, strict=True):
        assert m.hit_external == 0 and warm.hit_external == warm.num_prompt_tokens // 128 >= 7
        assert m.token_ids == a.token_ids and warm.token_ids == a.token_ids
        assert max(abs(x - y) for x, y in zip(m.logprobs, a.logprobs, strict=True)) < 1e-3
