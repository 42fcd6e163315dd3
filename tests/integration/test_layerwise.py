"""``use_layerwise: true`` in the real vLLM engine (CPU build): layer-by-layer loads and dumps, same bytes as blockwise.

A blockwise engine fills one store and a layerwise engine another, both prefilling in 256-token chunks (so blocks fill
over several steps, and both engines run the same computation: a float32 prefill in one chunk and one in several
differ in the last bit of some K/V on CPUs whose GEMM blocking depends on the row count, e.g. AVX2-only ones, which is
vLLM's numerics, not the transfer's). Then each mode restarts on the other's store. Checked: the two stores hold
the same files with the same bytes; every restart loads every block with output identical to the cold runs; and
blocks damaged on disk, which a layerwise load finds only after their layers were scattered, are reported and
recomputed (the damage fills payloads with 0x7f bytes, ~3e38 as float32, so a block used unnoticed would wreck the
output). The tiny float32 model has 2 layers (2 shards per block).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tests.helpers import assert_same_output, ucm_extra_config
from ucm.store.posix import HEADER_NBYTES, block_file_path
from ucm.testing.engine import failed_loads, run_engine, ucm_transfer_config
from ucm.testing.texts import prompt_of_tokens

pytestmark = pytest.mark.engine

P1_TOKENS = 600  # 4 full blocks of 128
P2_TOKENS = 800  # P1 + 200 tokens: 6 full blocks, the first 4 shared with P1
MAX_TOKENS = 12
DEBUG = {"UC_LOGGER_LEVEL": "debug"}
_KEYS_RE = re.compile(r"request_id: \S+, block keys: ([0-9a-f ]+)")


@pytest.fixture(scope="module")
def prompts(tokenizer) -> dict[str, str]:
    ids = tokenizer.encode(prompt_of_tokens(tokenizer, P2_TOKENS), add_special_tokens=False)
    return {"p1": tokenizer.decode(ids[:P1_TOKENS]), "p2": tokenizer.decode(ids[:P2_TOKENS])}


def _spec(model: Path, store: Path, requests: list[dict], layerwise: bool, chunk: int | None = None) -> dict:
    extra = {**ucm_extra_config(store), "use_layerwise": layerwise}
    spec = {
        "model": str(model),
        "dtype": "float32",
        "max_model_len": 2048,
        "connector": ucm_transfer_config(extra),
        "requests": [{"max_tokens": MAX_TOKENS, **r} for r in requests],
    }
    if chunk is not None:
        spec["engine_args"] = {"max_num_batched_tokens": chunk}
    return spec


def _requests(prompts: dict[str, str]) -> list[dict]:
    """P2 then P1, P1 from an empty vLLM prefix cache (so its hits are UCM's)."""
    return [{"prompt": prompts["p2"]}, {"prompt": prompts["p1"], "reset_prefix_cache": True}]


def _store_bytes(store: Path) -> dict[str, bytes]:
    return {str(f.relative_to(store)): f.read_bytes() for f in store.rglob("*.ucmb")}


@pytest.fixture(scope="module")
def cold(tiny_model, prompts, tmp_path_factory) -> dict:
    """One cold engine per mode, each on its own store, both prefilling in 256-token chunks."""
    out = {}
    for mode, layerwise in (("blockwise", False), ("layerwise", True)):
        store = tmp_path_factory.mktemp(f"store_{mode}")
        results, stderr = run_engine(_spec(tiny_model, store, _requests(prompts), layerwise, 256), env=DEBUG)
        assert [r.hit_external for r in results] == [0, 4]  # P1 is served from P2's blocks in UCM's DRAM tier
        assert failed_loads(stderr) == 0
        out[mode] = {"store": store, "results": results, "stderr": stderr}
    return out


def test_both_modes_write_the_same_bytes(cold):
    blockwise, layerwise = (_store_bytes(cold[m]["store"]) for m in ("blockwise", "layerwise"))
    assert len(blockwise) == 6  # P2's 6 blocks (P1's 4 are P2's first 4)
    assert blockwise == layerwise
    assert "layerwise transfer" in cold["layerwise"]["stderr"]
    assert "blockwise transfer" in cold["blockwise"]["stderr"]
    assert_same_output(cold["layerwise"]["results"][0], cold["blockwise"]["results"][0])


@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise_reads_blockwise", "blockwise_reads_layerwise"])
def test_restart_in_one_mode_loads_the_other_modes_store(tiny_model, prompts, cold, layerwise):
    writer = cold["blockwise" if layerwise else "layerwise"]
    results, stderr = run_engine(_spec(tiny_model, writer["store"], _requests(prompts), layerwise), env=DEBUG)
    assert [(r.hit_hbm, r.hit_external) for r in results] == [(0, 6), (0, 4)]
    assert failed_loads(stderr) == 0
    for got, want in zip(results, writer["results"], strict=True):
        assert_same_output(got, want)
    # The loads really went layer by layer in layerwise mode (one sharded load per request), and not otherwise.
    assert len(re.findall(r"layerwise load of \d+ blocks", stderr)) == (2 if layerwise else 0)


def test_layerwise_damaged_blocks_found_after_scatter_are_recomputed(tiny_model, prompts, cold, tmp_path):
    """P2's third block and every block P1 does not share are damaged in a copy of the store (payload overwritten,
    size kept): the lookup hits, the sharded load scatters the garbage layer by layer, the checksum fails at the end
    of the step, and vLLM, told of the failed blocks, discards that step's output and recomputes them."""
    source = cold["blockwise"]
    keys = [bytes.fromhex(k) for k in _KEYS_RE.findall(source["stderr"])[0].split()]
    assert len(keys) == 6
    store = tmp_path / "damaged"
    shutil.copytree(source["store"], store)
    for key in (keys[2], keys[4], keys[5]):
        path = Path(block_file_path([str(store)], key))
        size = path.stat().st_size
        path.write_bytes(path.read_bytes()[:HEADER_NBYTES] + b"\x7f" * (size - HEADER_NBYTES))
    results, stderr = run_engine(_spec(tiny_model, store, _requests(prompts), True))
    assert results[0].hit_external == 6  # P2 finds all 6 files
    assert failed_loads(stderr) == 3
    assert "found after their layers were used" in stderr
    for got, want in zip(results, source["results"], strict=True):
        assert_same_output(got, want)
    assert results[1].hit_external == 4  # P1: block 2 was stored again once recomputed
