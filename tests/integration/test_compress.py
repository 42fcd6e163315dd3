"""Cache|Compress|Posix (KVfold) in the real vLLM engine with the real bf16 model (SmolLM2-135M) on real text.

Lossless: a cold engine fills the store with compressed block files; a restarted engine loads them and its greedy
output is identical to the no-UCM run; a damaged compressed file is a miss (recomputed, output still identical).
Switching back to ``Cache|Posix`` (blockwise and layerwise) on that store: every block hits, the Posix stage decodes
the compressed files, and the output is still identical.
Fixed rate (lossy int8): a restarted engine loads the lossy blocks; the token agreement with the no-UCM run is
reported (printed), not asserted beyond the first token, since it is lossy by design.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.faults.helpers import block_path, request_block_keys
from tests.helpers import ucm_extra_config
from ucm.store.posix import CODEC_KVFOLD, HEADER, HEADER_NBYTES
from ucm.testing.engine import RequestResult, failed_loads, run_engine, ucm_transfer_config

pytestmark = pytest.mark.engine

BLOCK_SIZE = 128
PROMPT_TOKENS = 300  # 2 full blocks each
MAX_TOKENS = 16
# SmolLM2-135M: 30 layers x K,V x 128 tokens x 3 KV heads x 64 x 2 bytes
RAW_BLOCK_NBYTES = 30 * 2 * BLOCK_SIZE * 3 * 64 * 2


@pytest.fixture(scope="module")
def prompts(real_model: Path) -> list[str]:
    from transformers import AutoTokenizer

    from ucm.testing.texts import prompt_of_tokens

    tok = AutoTokenizer.from_pretrained(str(real_model))
    ids = tok.encode(prompt_of_tokens(tok, 2 * PROMPT_TOKENS + 20), add_special_tokens=False)
    return [tok.decode(ids[i * PROMPT_TOKENS : (i + 1) * PROMPT_TOKENS]) for i in range(2)]


def spec(
    model: Path, store: Path | None, prompts: list[str], use_layerwise: bool = False, **store_config: Any
) -> dict[str, Any]:
    s: dict[str, Any] = {
        "model": str(model),
        "dtype": "bfloat16",
        "max_model_len": 2048,
        "requests": [{"prompt": p, "max_tokens": MAX_TOKENS, "reset_prefix_cache": True} for p in prompts],
    }
    if store is not None:
        extra = ucm_extra_config(store, store_config.pop("store_pipeline", "Cache|Compress|Posix"))
        extra["ucm_connectors"][0]["ucm_connector_config"].update(store_config)
        extra["use_layerwise"] = use_layerwise
        s["connector"] = ucm_transfer_config(extra)
    return s


def run(
    model: Path, store: Path | None, prompts: list[str], use_layerwise: bool = False, **cfg: Any
) -> tuple[list[RequestResult], str]:
    return run_engine(spec(model, store, prompts, use_layerwise, **cfg), env={"UC_LOGGER_LEVEL": "DEBUG"})


@pytest.fixture(scope="module")
def baseline(real_model: Path, prompts: list[str]) -> list[RequestResult]:
    results, _ = run(real_model, None, prompts)
    return results


def codec_and_size(path: Path) -> tuple[int, int]:
    with open(path, "rb") as f:
        return HEADER.unpack(f.read(HEADER_NBYTES))[2], os.path.getsize(path)


def test_lossless_restart_damage_and_switch_back_to_cache_posix(
    real_model: Path, prompts: list[str], baseline: list[RequestResult], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    cold, log = run(real_model, store, prompts)
    assert [r.hit_external for r in cold] == [0, 0]
    assert [r.token_ids for r in cold] == [r.token_ids for r in baseline]
    assert "COMPRESS DUMP START | " in log and "COMPRESS DUMP END | " in log
    keys = request_block_keys(log)
    assert [len(k) for k in keys] == [2, 2]
    for k in keys[0] + keys[1]:
        codec, size = codec_and_size(block_path(store, k))
        assert codec == CODEC_KVFOLD
        assert size < RAW_BLOCK_NBYTES / 1.4, size  # measured about 1.48x on this model's KV
    # Damage prompt 2's second block (a byte of its compressed payload): a miss, recomputed.
    damaged = block_path(store, keys[1][1])
    data = bytearray(damaged.read_bytes())
    data[HEADER_NBYTES + len(data) // 2] ^= 0x10
    damaged.write_bytes(bytes(data))

    warm, log = run(real_model, store, prompts)
    assert [r.hit_external for r in warm] == [2, 2]  # lookup finds the file; its load fails
    assert failed_loads(log) == 1, log[-3000:]
    assert "COMPRESS LOAD START | " in log and "COMPRESS LOAD END | " in log
    assert [r.token_ids for r in warm] == [r.token_ids for r in baseline]
    assert codec_and_size(damaged)[0] == CODEC_KVFOLD  # removed as damaged, then stored again

    # store_pipeline switched back to Cache|Posix: the compressed files are decoded by the Posix stage.
    for layerwise in (False, True):
        plain, log = run(real_model, store, prompts, use_layerwise=layerwise, store_pipeline="Cache|Posix")
        assert [r.hit_external for r in plain] == [2, 2], layerwise
        assert failed_loads(log) == 0, log[-3000:]
        assert "COMPRESS LOAD START" not in log
        assert "KVfold blocks decoded" in log, log[-3000:]
        assert [r.token_ids for r in plain] == [r.token_ids for r in baseline], layerwise
    assert all(codec_and_size(block_path(store, k))[0] == CODEC_KVFOLD for k in keys[0] + keys[1])


def test_fixed_rate_restart_reports_token_agreement(
    real_model: Path, prompts: list[str], baseline: list[RequestResult], tmp_path: Path
) -> None:
    store = tmp_path / "store_fixed"
    cfg = {"store_pipeline": "Compress|Posix", "compress_mode": "fixed_rate", "compress_ratio": 16}
    cold, log = run(real_model, store, prompts, **cfg)
    assert "is LOSSY" in log and "RMS error" in log
    assert [r.token_ids for r in cold] == [r.token_ids for r in baseline]  # nothing loaded yet
    blocks = [p for p in store.rglob("*.ucmb") if not p.name.startswith(".")]
    assert len(blocks) == 4
    assert all(codec_and_size(p)[1] < RAW_BLOCK_NBYTES / 1.9 for p in blocks)
    warm, log = run(real_model, store, prompts, **cfg)
    assert [r.hit_external for r in warm] == [2, 2]
    assert failed_loads(log) == 0
    same = sum(
        a == b for w, c in zip(warm, baseline, strict=True) for a, b in zip(w.token_ids, c.token_ids, strict=False)
    )
    total = sum(len(c.token_ids) for c in baseline)
    first_equal = [w.token_ids[0] == c.token_ids[0] for w, c in zip(warm, baseline, strict=True)]
    print(f"fixed_rate 16 (int8): {same}/{total} greedy tokens equal to the no-UCM run; first tokens {first_equal}")
    assert all(first_equal)
