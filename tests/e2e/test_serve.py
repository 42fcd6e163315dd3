"""`vllm serve` (the OpenAI API server) with UCMConnector configured from a YAML file, on the real model.

A server answers a chat request on a long real text and is stopped (SIGTERM, as an operator would); a new server
on the same store answers the same request from the stored KV: same answer, and UCM's log shows the hit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ucm.testing.engine import failed_loads, ucm_transfer_config
from ucm.testing.server import VllmServer, http_json
from ucm.testing.texts import prompt_of_tokens

pytestmark = pytest.mark.engine

DOC_TOKENS = 1000
QUESTION = "What is this document? Answer in one sentence."


class Server(VllmServer):
    """The real model served with UCMConnector configured by ``config_file``, ready on construction."""

    def __init__(self, model: Path, config_file: Path, log: Path) -> None:
        super().__init__(model, log, ucm_transfer_config({"UCM_CONFIG_FILE": str(config_file)}))
        self.wait_ready()  # ucm.testing.server.STARTUP_TIMEOUT_S: 600 s, for loaded machines

    def chat(self, content: str) -> dict:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 32,
            "temperature": 0.0,
            "logprobs": True,
        }
        status, answer = http_json(f"{self.url}/v1/chat/completions", body, timeout_s=300)
        assert status == 200, answer
        return answer


def _answer(response: dict) -> tuple[str, list[str]]:
    choice = response["choices"][0]
    return choice["message"]["content"], [t["token"] for t in choice["logprobs"]["content"]]


def test_serve_restart_answers_from_store(real_model, tmp_path):
    from transformers import AutoTokenizer

    store = tmp_path / "store"
    config_file = tmp_path / "ucm_config.yaml"
    config_file.write_text(
        yaml.safe_dump(
            {
                "ucm_connectors": [
                    {
                        "ucm_connector_name": "UcmPipelineStore",
                        "ucm_connector_config": {"store_pipeline": "Cache|Posix", "storage_backends": str(store)},
                    }
                ],
                "use_layerwise": False,
            }
        )
    )
    tokenizer = AutoTokenizer.from_pretrained(str(real_model))
    content = f"{prompt_of_tokens(tokenizer, DOC_TOKENS)}\n\n{QUESTION}"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    full_blocks = len(tokenizer.encode(prompt, add_special_tokens=False)) // 128

    first = Server(real_model, config_file, tmp_path / "server1.log")
    try:
        cold_text, cold_tokens = _answer(first.chat(content))
    finally:
        log1 = first.stop()
    assert "[UC][I] Using UCM with config:" in log1
    assert "hit external: 0" in log1
    stored = list(store.rglob("*.ucmb"))
    assert len(stored) == full_blocks  # every full block of the prompt

    second = Server(real_model, config_file, tmp_path / "server2.log")
    try:
        warm_text, warm_tokens = _answer(second.chat(content))
    finally:
        log2 = second.stop()
    assert f"hit hbm: 0, hit external: {len(stored)}" in log2, log2[-3000:]
    assert failed_loads(log2) == 0, log2[-3000:]
    assert warm_tokens == cold_tokens
    assert warm_text == cold_text
    assert len(cold_text) > 20  # a real answer, not an empty one
