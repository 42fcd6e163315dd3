"""UCM's KV events on a real ``vllm serve`` with ``--kv-events-config``, read by a real ZMQ subscriber on 127.0.0.1
(decoded with vLLM's own event classes, as a router does).

One server, prefix caching on, a DRAM tier of a few blocks over a storage directory: prompt A's blocks reach UCM's
DRAM tier (``medium`` ``CPU``) and storage (``STORAGE``) under the same block hashes as vLLM's own events (``GPU``);
prompt B then evicts A's blocks from the DRAM tier (``BlockRemoved``, ``CPU``); a reset of the external caches (POST
``/reset_prefix_cache?reset_external=true``, storage kept) follows vLLM's ``AllBlocksCleared`` with the stored blocks
published again (``STORAGE``). With ``enable_metrics: false``, ``/metrics`` has vLLM's series and none of UCM's.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from ucm.testing.engine import ucm_transfer_config
from ucm.testing.server import VllmServer, free_port
from ucm.testing.texts import prompt_of_tokens

pytestmark = pytest.mark.engine

BLOCK_SIZE = 32
FULL_BLOCKS = 6
PROMPT_TOKENS = FULL_BLOCKS * BLOCK_SIZE + 10  # + a partial block (never stored)
DRAM_BLOCKS = 8  # UCM's DRAM tier holds this many blocks: B's 6 evict A's
EVENT_TIMEOUT_S = 60.0


class Subscriber:
    """A ZMQ SUB socket bound at vLLM's KV-event endpoint (a host:port endpoint makes vLLM's publisher connect to
    it; only ``*`` endpoints make it bind); keeps every event received, in order."""

    def __init__(self, endpoint: str, topic: str) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sock.bind(endpoint)
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.events: list[Any] = []

    def poll(self, timeout_s: float) -> None:
        """Receive what arrives within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not self._sock.poll(int(left * 1000)):
                return
            _topic, _seq, payload = self._sock.recv_multipart()
            self.events.extend(self._decoder.decode(payload).events)

    def until(self, done: Any, step: Any) -> list[Any]:
        """Receive until ``done(events)``, calling ``step()`` (a request: events are published at engine steps)
        between polls; the events so far."""
        deadline = time.monotonic() + EVENT_TIMEOUT_S
        while not done(self.events) and time.monotonic() < deadline:
            step()
            self.poll(1.0)
        return self.events

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()


def stored(events: list[Any], medium: str) -> set[Any]:
    return {h for e in events if isinstance(e, BlockStored) and e.medium == medium for h in e.block_hashes}


def removed(events: list[Any], medium: str) -> set[Any]:
    return {h for e in events if isinstance(e, BlockRemoved) and e.medium == medium for h in e.block_hashes}


def complete(server: VllmServer, prompt: list[int], max_tokens: int = 4) -> list[int]:
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    body["return_token_ids"] = True
    request = urllib.request.Request(
        f"{server.url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as r:
        return json.loads(r.read())["choices"][0]["token_ids"]


def block_nbytes(model: Path) -> int:
    """Bytes of one canonical block of ``model`` (float32 K and V of every layer)."""
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * BLOCK_SIZE * 4


def test_tiers_publish_kv_events_under_vllms_block_hashes(tiny_model: Path, tokenizer: Any, tmp_path: Path) -> None:
    ids = tokenizer.encode(prompt_of_tokens(tokenizer, 3 * PROMPT_TOKENS + 10), add_special_tokens=False)
    prompt_a, prompt_b = ids[:PROMPT_TOKENS], ids[PROMPT_TOKENS : 2 * PROMPT_TOKENS]
    filler = ids[2 * PROMPT_TOKENS : 2 * PROMPT_TOKENS + 8]  # shorter than a block: stores nothing, makes a step
    store = tmp_path / "store"
    config_file = tmp_path / "ucm_config.yaml"
    capacity_gb = DRAM_BLOCKS * block_nbytes(tiny_model) / 2**30
    config_file.write_text(
        yaml.safe_dump(
            {
                "ucm_connectors": [
                    {"ucm_connector_config": {"storage_backends": str(store), "cache_buffer_capacity_gb": capacity_gb}}
                ],
                "enable_metrics": False,  # events do not need UCM's metrics
            }
        )
    )
    endpoint, topic = f"tcp://127.0.0.1:{free_port()}", "kv-events"
    events_config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": topic}
    server = VllmServer(
        tiny_model,
        tmp_path / "server.log",
        ucm_transfer_config({"UCM_CONFIG_FILE": str(config_file)}),
        max_model_len=1024,
        dtype="float32",
        env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1"},  # dev mode: /reset_prefix_cache
        extra_args=["--block-size", str(BLOCK_SIZE), "--kv-events-config", json.dumps(events_config)],
    )
    subscriber = Subscriber(endpoint, topic)
    try:
        server.wait_ready()
        subscriber.poll(1.0)  # the publisher's connection is up before the first event (ZMQ drops what comes before)

        def step() -> None:
            complete(server, filler, max_tokens=1)

        first = complete(server, prompt_a)
        events = subscriber.until(lambda ev: len(stored(ev, "GPU")) >= FULL_BLOCKS, step)
        hashes_a = stored(events, "GPU")
        assert len(hashes_a) >= FULL_BLOCKS, events
        events = subscriber.until(lambda ev: hashes_a <= stored(ev, "CPU") and hashes_a <= stored(ev, "STORAGE"), step)
        assert hashes_a <= stored(events, "CPU"), "UCM's DRAM tier did not publish A's blocks under vLLM's hashes"
        assert hashes_a <= stored(events, "STORAGE"), "storage did not publish A's blocks under vLLM's hashes"
        a_event = next(e for e in events if isinstance(e, BlockStored) and e.medium == "CPU")
        assert a_event.block_size == BLOCK_SIZE and len(a_event.token_ids) == BLOCK_SIZE
        assert a_event.token_ids == prompt_a[:BLOCK_SIZE] or a_event.parent_block_hash in hashes_a

        complete(server, prompt_b)
        events = subscriber.until(lambda ev: removed(ev, "CPU") and len(stored(ev, "STORAGE")) >= 2 * FULL_BLOCKS, step)
        evicted = removed(events, "CPU")
        assert evicted and evicted <= hashes_a, "B's blocks must evict (only) A's from the DRAM tier"
        hashes_b = stored(events, "GPU") - hashes_a
        assert hashes_b <= stored(events, "STORAGE")
        assert not removed(events, "STORAGE"), "nothing was deleted from storage"

        # Reset of the external caches: vLLM clears all; UCM keeps storage and says so again.
        before = len(subscriber.events)
        with urllib.request.urlopen(
            urllib.request.Request(f"{server.url}/reset_prefix_cache?reset_external=true", method="POST"), timeout=60
        ) as r:
            assert r.status == 200
        events = subscriber.until(
            lambda ev: (
                any(isinstance(e, AllBlocksCleared) for e in ev[before:])
                and (hashes_a | hashes_b) <= stored(ev[before:], "STORAGE")
            ),
            step,
        )
        after = events[before:]
        cleared = next(i for i, e in enumerate(after) if isinstance(e, AllBlocksCleared))
        assert (hashes_a | hashes_b) <= stored(after[cleared:], "STORAGE")
        assert not stored(after, "CPU"), "the DRAM tier was emptied by the reset"

        # The store still serves A (storage hits), with the same output.
        assert complete(server, prompt_a) == first
        with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as r:
            metrics = r.read().decode()
        assert "vllm:num_requests_running" in metrics and "vllm:ucm_" not in metrics  # enable_metrics: false
    finally:
        subscriber.close()
        server.stop()
