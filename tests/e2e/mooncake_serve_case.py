"""Two `vllm serve` instances sharing their DRAM through a real Mooncake master, run by
``tests/e2e/test_mooncake_serve.py`` inside a loopback-only network namespace (Mooncake's client listens on every
interface): ``python -m tests.e2e.mooncake_serve_case MODEL_DIR TMP_DIR``.

Both instances are configured as users of the seeds' Mooncake guide configure them: a ``mooncake.json`` named by
``MOONCAKE_CONFIG_PATH``, and a UCM YAML with ``store_pipeline: Cache|Mooncake`` (no storage tier: instance B can
find instance A's blocks only in the pool). The scenario fails by raising; its last line is ``scenario ok``.

1. A answers a document question cold (hit external 0); B, which never saw it, answers it from A's blocks read
   through the pool (every full block an external hit, no failed load, counted on B's /metrics as tier ``pool``):
   the same tokens.
2. A answers two more documents, then is SIGKILLed (the instance whose segment holds their blocks). B answers the
   first: the pool may still list the blocks while their holder is gone, so B's load fails and vLLM recomputes, or
   B misses: the same tokens as A's, never other ones.
3. The master is killed. B answers the second document: lookups and loads stay bounded, the answer is A's.
"""

from __future__ import annotations

import sys
import time
import urllib.request
from pathlib import Path

import yaml

from ucm.testing.engine import HIT_RE, failed_loads, ucm_transfer_config
from ucm.testing.mooncake import MooncakeMaster, write_mooncake_json
from ucm.testing.server import VllmServer, http_json
from ucm.testing.texts import prompt_of_tokens, source_texts

DOC_TOKENS = 700
BLOCK_SIZE = 128  # vLLM's CPU default
QUESTION = "What is this document about? Answer in one sentence."


def chat(server: VllmServer, content: str) -> list[str]:
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 16,
        "temperature": 0.0,
        "logprobs": True,
    }
    status, answer = http_json(f"{server.url}/v1/chat/completions", body, timeout_s=300)
    assert status == 200, answer
    return [t["token"] for t in answer["choices"][0]["logprobs"]["content"]]


def last_hit(server: VllmServer) -> tuple[int, int]:
    """(hit hbm, hit external) of the last request the server's UCM logged."""
    hits = HIT_RE.findall(server.read_log())
    assert hits, server.read_log()[-3000:]
    return int(hits[-1][2]), int(hits[-1][3])


def main(model: Path, tmp: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    texts = source_texts()
    docs = [f"{prompt_of_tokens(tokenizer, DOC_TOKENS, texts[i % len(texts)])}\n\n{QUESTION}" for i in range(3)]
    assert len(set(docs)) == 3
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": docs[0]}], tokenize=False, add_generation_prompt=True
    )
    full_blocks = len(tokenizer.encode(prompt, add_special_tokens=False)) // BLOCK_SIZE

    master = MooncakeMaster(tmp / "master.log")
    mooncake_json = write_mooncake_json(tmp / "mooncake.json", master.address, 256 << 20)
    config = tmp / "ucm.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "ucm_connectors": [
                    {
                        "ucm_connector_name": "UcmPipelineStore",
                        "ucm_connector_config": {"store_pipeline": "Cache|Mooncake", "cache_buffer_capacity_gb": 0.5},
                    }
                ]
            }
        )
    )
    transfer = ucm_transfer_config({"UCM_CONFIG_FILE": str(config)})
    env = {"MOONCAKE_CONFIG_PATH": str(mooncake_json)}
    a = VllmServer(model, tmp / "a.log", transfer, max_model_len=2048, env=env)
    b = VllmServer(model, tmp / "b.log", transfer, max_model_len=2048, env=env)
    try:
        a.wait_ready()
        b.wait_ready()
        for server in (a, b):
            assert "Mooncake stage: joined the pool of master" in server.read_log(), server.read_log()[-3000:]

        # 1. A stores, B hits A's blocks through the pool.
        cold = chat(a, docs[0])
        assert last_hit(a) == (0, 0)
        shared = chat(b, docs[0])
        assert last_hit(b) == (0, full_blocks), (last_hit(b), full_blocks)
        assert failed_loads(b.read_log()) == 0
        assert shared == cold, (shared, cold)
        print(f"B hit {full_blocks} blocks of A through the pool: same {len(cold)} tokens", flush=True)
        metrics = urllib.request.urlopen(f"{b.url}/metrics", timeout=30).read().decode()
        served = [
            line
            for line in metrics.splitlines()
            if line.startswith("vllm:ucm_hit_blocks_total{") and 'tier="pool"' in line
        ]
        assert served and float(served[0].rsplit(" ", 1)[1]) == full_blocks, served

        # 2. The holder killed.
        answers = [chat(a, doc) for doc in docs[1:]]
        a.kill()
        t0 = time.monotonic()
        after_kill = chat(b, docs[1])
        hit, failed = last_hit(b)[1], failed_loads(b.read_log())
        print(f"A killed: B's answer in {time.monotonic() - t0:.1f} s, hit external {hit}, failed loads {failed}")
        assert after_kill == answers[0], (after_kill, answers[0])
        assert hit == 0 or failed > 0, (hit, failed)  # A's segment is gone: whatever B found there failed

        # 3. The master killed.
        master.kill()
        t0 = time.monotonic()
        after_master = chat(b, docs[2])
        took = time.monotonic() - t0
        print(f"master killed: B's answer in {took:.1f} s, hit external {last_hit(b)[1]}", flush=True)
        assert after_master == answers[1], (after_master, answers[1])
        assert last_hit(b)[1] == 0
        assert "Mooncake pool" in b.read_log()  # the warning of the lookup that found no master
        assert took < 120, took
    finally:
        log_a, log_b = a.kill(), b.stop()
        master.kill()
    for name, log in (("A", log_a), ("B", log_b)):
        serving = log.split("[shutdown]")[0]  # vLLM's own shutdown may log an EngineDeadError once SIGTERMed
        assert "Traceback" not in serving and "[UC][E]" not in serving, f"{name}: {serving[-4000:]}"
    print("scenario ok", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
