"""vLLM's ``POST /reset_prefix_cache?reset_external=true`` on a real ``vllm serve`` with UCMConnector (vLLM's own
process layout: the DRAM tier lives in the worker process, the reset arrives in the engine core's).

vLLM's prefix caching is off, so a repeat of a prompt is served by UCM or recomputed, as UCM's per-request log line
says (``ucm.testing.engine.HIT_RE``). Where a hit comes from is made certain by moving the block files away: a hit
without files is a DRAM hit, a miss after a reset without files proves the DRAM tier was emptied, and a hit after a
reset with the files back is a storage hit. Every answer is the same as the first (greedy, float32).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from ucm.testing.engine import HIT_RE, ucm_transfer_config
from ucm.testing.server import VllmServer, http_json
from ucm.testing.texts import prompt_of_tokens

pytestmark = pytest.mark.engine

PROMPT_TOKENS = 700  # 5 full blocks of 128 tokens, and a partial one
MAX_TOKENS = 8
LOGPROB_TOL = 1e-4  # float32: a load puts back the very KV a recompute gives


class Server(VllmServer):
    """The tiny float32 model with UCM ``Cache|Posix`` over ``store``, vLLM's prefix caching off, vLLM's development
    endpoints on (``VLLM_SERVER_DEV_MODE=1``: ``/reset_prefix_cache`` is one of them)."""

    def __init__(self, model: Path, tmp: Path, store: Path, clears_storage: bool) -> None:
        config = tmp / "ucm.yaml"
        store_config = {"store_pipeline": "Cache|Posix", "storage_backends": str(store)}
        config.write_text(
            yaml.safe_dump(
                {"ucm_connectors": [{"ucm_connector_config": store_config}], "reset_clears_storage": clears_storage}
            )
        )
        super().__init__(
            model,
            tmp / "server.log",
            ucm_transfer_config({"UCM_CONFIG_FILE": str(config)}),
            max_model_len=1024,
            dtype="float32",
            env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1"},
            extra_args=["--no-enable-prefix-caching"],
        )
        self.wait_ready()

    def complete(self, prompt: list[int]) -> dict[str, Any]:
        """A greedy completion of ``prompt`` (token ids): its token ids, their log-probs, and UCM's line for it as
        ``(total blocks, hit hbm, hit external)``."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "logprobs": 1,
            "return_token_ids": True,
        }
        status, answer = http_json(f"{self.url}/v1/completions", body, timeout_s=300)
        assert status == 200, answer
        lines = [m for m in HIT_RE.findall(self.read_log()) if m[0].startswith(answer["id"] + "-")]
        assert len(lines) == 1, (answer["id"], self.read_log()[-3000:])
        choice = answer["choices"][0]
        return {
            "token_ids": choice["token_ids"],
            "logprobs": choice["logprobs"]["token_logprobs"],
            "hit": tuple(int(x) for x in lines[0][1:]),
        }

    def reset_external(self) -> Any:
        """``POST /reset_prefix_cache?reset_external=true``; the answer's JSON."""
        status, answer = http_json(f"{self.url}/reset_prefix_cache?reset_external=true", {}, timeout_s=120)
        assert status == 200, answer
        return answer


def _blocks(store: Path) -> list[Path]:
    return sorted(p for p in store.rglob("*.ucmb") if not p.name.startswith("."))


def _wait_for_blocks(store: Path, n: int, timeout_s: float = 60.0) -> list[Path]:
    """The store's block files once there are ``n`` (written back in the background after a request)."""
    deadline = time.monotonic() + timeout_s
    while len(_blocks(store)) < n and time.monotonic() < deadline:
        time.sleep(0.2)
    return _blocks(store)


def _move_blocks(store: Path, to: Path) -> None:
    """Move the store's block files (shard directories kept) under ``to``."""
    for path in _blocks(store):
        target = to / path.relative_to(store)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(path, target)


def _restore_blocks(store: Path, backup: Path) -> None:
    for path in sorted(backup.rglob("*.ucmb")):
        shutil.move(path, store / path.relative_to(backup))


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["token_ids"] == want["token_ids"]
    diff = max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True))
    assert diff < LOGPROB_TOL, f"log-probs differ by {diff}"


@pytest.fixture(scope="module")
def prompt(tokenizer: Any) -> list[int]:
    ids: list[int] = tokenizer.encode(prompt_of_tokens(tokenizer, PROMPT_TOKENS), add_special_tokens=False)
    return ids[:PROMPT_TOKENS]


def test_reset_empties_the_dram_tier_and_keeps_storage(tiny_model: Path, tmp_path: Path, prompt: list[int]) -> None:
    store, backup = tmp_path / "store", tmp_path / "backup"
    server = Server(tiny_model, tmp_path, store, clears_storage=False)
    try:
        cold = server.complete(prompt)
        total = cold["hit"][0]
        assert total == PROMPT_TOKENS // 128 and cold["hit"] == (total, 0, 0)
        assert len(_wait_for_blocks(store, total)) == total
        _move_blocks(store, backup)  # from here on only the DRAM tier holds the blocks
        dram = server.complete(prompt)
        assert dram["hit"] == (total, 0, total)  # no file: a DRAM hit
        assert server.reset_external() == {"success": True}
        recomputed = server.complete(prompt)
        assert recomputed["hit"] == (total, 0, 0)  # no file and the DRAM tier emptied: recomputed
        log = server.read_log()
        assert "cache reset: forgot" in log and "storage kept (reset_clears_storage: false)" in log
        assert f"cache reset: dropped {total} blocks from the DRAM tier" in log  # the worker, at the next step
        assert len(_wait_for_blocks(store, total)) == total  # the recompute stored them again
        _move_blocks(store, tmp_path / "again")
        _restore_blocks(store, backup)  # the first request's files
        assert server.reset_external() == {"success": True}
        stored = server.complete(prompt)
        assert stored["hit"] == (total, 0, total)  # DRAM emptied by the reset: served from the files
        assert "blocks failed to load" not in server.read_log()
    finally:
        server.stop()
    for answer in (dram, recomputed, stored):
        _assert_same(answer, cold)


def test_reset_with_reset_clears_storage_deletes_the_blocks(
    tiny_model: Path, tmp_path: Path, prompt: list[int]
) -> None:
    store = tmp_path / "store"
    server = Server(tiny_model, tmp_path, store, clears_storage=True)
    try:
        cold = server.complete(prompt)
        total = cold["hit"][0]
        assert len(_wait_for_blocks(store, total)) == total
        warm = server.complete(prompt)
        assert warm["hit"] == (total, 0, total)
        assert server.reset_external() == {"success": True}
        assert _blocks(store) == []  # deleted by the time the endpoint answers
        assert list((store / "namespaces").glob("*.json"))  # only block files go
        recomputed = server.complete(prompt)
        assert recomputed["hit"] == (total, 0, 0)
        log = server.read_log()
        assert f"removed {total} block files" in log and "(reset_clears_storage: true)" in log
        assert "blocks failed to load" not in log
        assert len(_wait_for_blocks(store, total)) == total  # stored again after the reset
    finally:
        server.stop()
    for answer in (warm, recomputed):
        _assert_same(answer, cold)
