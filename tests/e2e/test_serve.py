"""`vllm serve` (the OpenAI API server) with UCMConnector configured from a YAML file, on the real model.

A server answers a chat request on a long real text and is stopped (SIGTERM, as an operator would); a new server
on the same store answers the same request from the stored KV: same answer, and UCM's log shows the hit.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from ucm.testing.engine import engine_env, failed_loads, ucm_transfer_config
from ucm.testing.texts import prompt_of_tokens

pytestmark = pytest.mark.engine

DOC_TOKENS = 1000
QUESTION = "What is this document? Answer in one sentence."
STARTUP_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `python -m vllm.entrypoints.openai.api_server` process on loopback, its log in a file."""

    def __init__(self, model: Path, config_file: Path, log: Path) -> None:
        self.port = _free_port()
        self.model = str(model)
        self.log = log
        transfer = ucm_transfer_config({"UCM_CONFIG_FILE": str(config_file)})
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model, "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "bfloat16", "--max-model-len", "4096", "--enforce-eager",
            "--kv-transfer-config", json.dumps(transfer),
        ]  # fmt: skip
        self._log_file = log.open("w")
        self.proc = subprocess.Popen(
            cmd, stdout=self._log_file, stderr=subprocess.STDOUT, env=engine_env(), start_new_session=True
        )
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{log.read_text()[-5000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(1)
        self.stop()
        raise RuntimeError(f"server not ready in {STARTUP_TIMEOUT_S} s:\n{log.read_text()[-5000:]}")

    def chat(self, content: str) -> dict:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 32,
            "temperature": 0.0,
            "logprobs": True,
        }
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())

    def stop(self) -> str:
        """SIGTERM the server's process group (a graceful shutdown), wait, and return its log."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log_file.close()
        return self.log.read_text()


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
