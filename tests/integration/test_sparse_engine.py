"""GSA through the real vLLM engine (CPU build): the plugin is a pass-through when off, and keeping every block
reproduces dense attention exactly while running the whole sparse path (selection, replaced block table, lengths and
scheduler metadata).

The tiny float32 model, one request at a time, 32-token blocks (a 700-token prompt spans 22 blocks, well above
``min_blocks``). Equality is exact (``==`` on log-probs), not within a tolerance: the same kernel over the same
blocks in the same order must give the same bits. The plugin comes in through the ``vllm.general_plugins`` entry
point (``ucm.testing.plugin.plugin_env`` declares it where the installed metadata predates it); ``VLLM_PLUGINS``
naming nothing keeps it out for the no-plugin baseline.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import ucm_extra_config
from ucm.testing.engine import RequestResult, run_engine, ucm_transfer_config
from ucm.testing.plugin import plugin_env
from ucm.testing.texts import prompt_of_tokens

pytestmark = pytest.mark.engine

PROMPT_TOKENS = 700
BLOCK_SIZE = 32
MAX_TOKENS = 8
NO_PLUGINS = {"VLLM_PLUGINS": "ucm_test_no_plugin"}  # an allow-list that matches no plugin
SMALL_CACHE = {"VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB: plenty for one 700-token request of the tiny model


@pytest.fixture(scope="module")
def prompt(tokenizer) -> str:
    return prompt_of_tokens(tokenizer, PROMPT_TOKENS)


def _run(model: Path, store: Path, prompt: str, sparse: dict | None, env: dict[str, str]) -> tuple[RequestResult, str]:
    extra = ucm_extra_config(store, "Posix")
    if sparse is not None:
        extra["ucm_sparse_config"] = sparse
    spec = {
        "model": str(model),
        "dtype": "float32",
        "max_model_len": 2048,
        "engine_args": {"block_size": BLOCK_SIZE},
        "connector": ucm_transfer_config(extra),
        "reset_prefix_cache": True,
        "requests": [{"prompt": prompt, "max_tokens": MAX_TOKENS}],
    }
    results, stderr = run_engine(spec, env={**SMALL_CACHE, **env})
    return results[0], stderr


@pytest.fixture(scope="module")
def runs(tiny_model, prompt, tmp_path_factory) -> dict[str, tuple[RequestResult, str]]:
    # kv_role kv_both with an empty store each time: every run computes the prompt (no loads).
    out = {}
    for name, sparse, env in [
        ("no_plugin", None, NO_PLUGINS),
        ("plugin_off", None, plugin_env()),
        ("key_bounds_all_blocks", {"GSA": {"sparse_ratio": 1.0, "block_scoring": "key_bounds"}}, plugin_env()),
        ("key_bounds_0.3", {"GSA": {"sparse_ratio": 0.3, "block_scoring": "key_bounds"}}, plugin_env()),
        ("attention_all_blocks", {"GSA": {"sparse_ratio": 1.0, "block_scoring": "attention"}}, plugin_env()),
        ("attention_0.3", {"GSA": {"sparse_ratio": 0.3, "block_scoring": "attention"}}, plugin_env()),
        # block_scoring left out: the default, sparq.
        ("sparq_all_blocks", {"GSA": {"sparse_ratio": 1.0}}, plugin_env()),
        ("sparq_0.3", {"GSA": {"sparse_ratio": 0.3}}, plugin_env()),
    ]:
        out[name] = _run(tiny_model, tmp_path_factory.mktemp(name), prompt, sparse, env)
    return out


def test_plugin_off_is_byte_identical(runs) -> None:
    base, plugin = runs["no_plugin"][0], runs["plugin_off"][0]
    assert plugin.token_ids == base.token_ids
    assert plugin.logprobs == base.logprobs
    assert "sparse attention" not in runs["plugin_off"][1]


@pytest.mark.parametrize(
    "name",
    ["key_bounds_all_blocks", "attention_all_blocks", "sparq_all_blocks"],
    ids=["key_bounds", "attention", "sparq"],
)
def test_all_blocks_equals_dense_exactly(runs, name) -> None:
    dense, sparse = runs["plugin_off"][0], runs[name][0]
    total = -(-PROMPT_TOKENS // BLOCK_SIZE)
    assert f"sparse attention GSA: first decode selection kept {total} of {total} blocks" in runs[name][1]
    assert sparse.token_ids == dense.token_ids
    assert sparse.logprobs == dense.logprobs


@pytest.mark.parametrize(
    "name", ["key_bounds_0.3", "attention_0.3", "sparq_0.3"], ids=["key_bounds", "attention", "sparq"]
)
def test_sparse_reads_fewer_blocks(runs, name) -> None:
    total = -(-PROMPT_TOKENS // BLOCK_SIZE)  # 22 blocks: ceil(0.3 * 22) = 7 kept
    assert f"sparse attention GSA: first decode selection kept 7 of {total} blocks" in runs[name][1]
    assert len(runs[name][0].token_ids) == MAX_TOKENS


def test_sparse_config_without_plugin_is_refused(tiny_model, prompt, tmp_path) -> None:
    with pytest.raises(RuntimeError, match="UCM's attention plugin is not loaded"):
        _run(tiny_model, tmp_path, prompt, {"GSA": {"sparse_ratio": 0.5}}, NO_PLUGINS)
