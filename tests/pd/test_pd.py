"""Prefill/decode disaggregation through the shared store: real vLLM servers and the proxy, all on loopback.

One module-wide set of servers on the real model: a plain single instance (no connector, the baseline), two
prefill instances (``kv_producer``) and two decode instances (``kv_consumer``) sharing one store directory. Proxies
in front of a subset of them give 1P1D and 2P2D. Prompts are distinct real texts (no shared prefix), so a decode
instance's only source of KV is the store.

The model runs in float32: in bf16 the CPU backend's results depend on how a prompt is split into computed chunks
(a prompt computed whole and one whose last partial block is computed after a prefix hit, from vLLM's own prefix
cache as much as from UCM, differed by 0.04 in a log-prob and flipped a near-tied greedy token), which would make
the comparison with the single instance test bf16 noise rather than the disaggregation.
"""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.helpers import ucm_extra_config
from tests.pd.helpers import MAX_TOKENS, assert_same, complete, hits
from ucm.testing.engine import ucm_transfer_config
from ucm.testing.server import ProxyProcess, VllmServer, http_json, stream_completion
from ucm.testing.texts import real_text

pytestmark = pytest.mark.engine

BLOCK_SIZE = 128  # the CPU backend's default
PUBLISH_DELAY_S = 1.5
INJECT_DIR = Path(__file__).resolve().parent.parent / "faults" / "inject"


class Cluster:
    """The servers of this module and the prompts' source."""

    def __init__(self, tmp: Path, model: Path) -> None:
        from transformers import AutoTokenizer

        self.tmp = tmp
        self.model = str(model)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model)
        self._ids = self.tokenizer.encode(real_text(100_000), add_special_tokens=False)
        self._next_doc = 0
        self.store = tmp / "store"
        config = tmp / "ucm.yaml"
        config.write_text(yaml.safe_dump(ucm_extra_config(self.store)))
        extra = {"UCM_CONFIG_FILE": str(config)}
        env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
        kw = {"dtype": "float32", "env": env}
        self.single = VllmServer(model, tmp / "single.log", None, **kw)
        # The second prefill instance publishes each block file 1.5 s late (a slow shared filesystem): its answers
        # must still wait for the blocks, or the decode instance would miss them.
        slow = {
            **env,
            "UCM_TEST_FAULTS": json.dumps({"publish_delay_s": PUBLISH_DELAY_S}),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(INJECT_DIR), os.environ.get("PYTHONPATH")])),
        }
        self.prefill = [
            VllmServer(model, tmp / "prefill0.log", ucm_transfer_config(extra, "kv_producer"), **kw),
            VllmServer(model, tmp / "prefill1.log", ucm_transfer_config(extra, "kv_producer"), **{**kw, "env": slow}),
        ]
        self.decode = [
            VllmServer(model, tmp / f"decode{i}.log", ucm_transfer_config(extra, "kv_consumer"), **kw) for i in range(2)
        ]
        self.servers = [self.single, *self.prefill, *self.decode]
        try:
            for s in self.servers:
                s.wait_ready()
        except BaseException:  # one did not start: stop the others, or they outlive the test session
            self.stop()
            raise

    def prompt(self, n_tokens: int) -> str:
        """A new real-text prompt of about ``n_tokens`` tokens that shares no prefix with earlier ones."""
        start = self._next_doc
        self._next_doc += n_tokens + 200
        assert self._next_doc < len(self._ids), "not enough real text for the prompts"
        doc = self.tokenizer.decode(self._ids[start : start + n_tokens])
        return f"{doc}\n\nQuestion: what is the text above about? Answer:"

    def stop(self) -> None:
        for s in self.servers:
            s.stop()


@pytest.fixture(scope="module")
def cluster(real_model, tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("pd"), real_model)
    yield c
    c.stop()


def _hits(server: VllmServer) -> dict[str, tuple[int, int, int]]:
    """UCM's per-request lines of a server: request id -> (total blocks, hit hbm, hit external)."""
    return hits(server.read_log())


def _new_hits(server: VllmServer, before: dict) -> list[tuple[int, int, int]]:
    return [v for k, v in _hits(server).items() if k not in before]


def _run_pd(cluster: Cluster, proxy: ProxyProcess, lengths: list[int]) -> list[int]:
    """Send one prompt per length through ``proxy`` and to the single instance; check outputs and decode hits.

    Returns the number of requests each decode instance served (in ``cluster.decode`` order)."""
    served = [0] * len(cluster.decode)
    for n in lengths:
        prompt = cluster.prompt(n)
        before = [_hits(d) for d in cluster.decode]
        got = complete(proxy.url, cluster.model, prompt)
        want = complete(cluster.single.url, cluster.model, prompt)
        assert_same(got, want)
        full_blocks = got["usage"]["prompt_tokens"] // BLOCK_SIZE
        lines = [_new_hits(d, b) for d, b in zip(cluster.decode, before, strict=True)]
        (line,) = [x for per in lines for x in per]  # exactly one decode instance served it
        served[next(i for i, per in enumerate(lines) if per)] += 1
        total, hbm, external = line
        assert (total, hbm, external) == (full_blocks, 0, full_blocks), (line, full_blocks)
    return served


def test_1p1d_same_output_as_single_instance(cluster, tmp_path):
    proxy = ProxyProcess([cluster.prefill[0].port], [cluster.decode[0].port], tmp_path / "proxy.log").wait_ready()
    try:
        _run_pd(cluster, proxy, [300, 700, 1100])

        # Streaming passes through: the same text as the single instance's answer.
        prompt = cluster.prompt(500)
        body = {"model": cluster.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0}
        text, ttft, total = stream_completion(f"{proxy.url}/v1/completions", body)
        want = complete(cluster.single.url, cluster.model, prompt)
        assert text == want["choices"][0]["text"]
        assert 0 < ttft <= total

        # Chat completions: the chat template is applied on both instances alike.
        chat = {
            "model": cluster.model,
            "messages": [{"role": "user", "content": cluster.prompt(400)}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
        }
        before = _hits(cluster.decode[0])
        status, got = http_json(f"{proxy.url}/v1/chat/completions", chat)
        assert status == 200, got
        status, want = http_json(f"{cluster.single.url}/v1/chat/completions", chat)
        assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
        ((total_blocks, hbm, external),) = _new_hits(cluster.decode[0], before)
        assert external == total_blocks == got["usage"]["prompt_tokens"] // BLOCK_SIZE and hbm == 0
    finally:
        log = proxy.stop()
    assert "[UC][I] PD proxy on" in log


def test_2p2d_same_output_and_both_instances_used(cluster, tmp_path):
    """2P2D, one request at a time: each instance serves its share, and requests prefilled by the instance with a
    slow store (``PUBLISH_DELAY_S``) still find every block on the decode side."""
    proxy = ProxyProcess(
        [p.port for p in cluster.prefill],
        [d.port for d in cluster.decode],
        tmp_path / "proxy.log",
        policy="least_outstanding",
    ).wait_ready()
    try:
        prefill_before = [len(_hits(p)) for p in cluster.prefill]
        served = _run_pd(cluster, proxy, [400, 600, 800, 1000])
        prefill_served = [len(_hits(p)) - b for p, b in zip(cluster.prefill, prefill_before, strict=True)]
    finally:
        proxy.stop()
    assert served == [2, 2], served  # one request at a time: least_outstanding ties go round robin
    assert prefill_served == [2, 2], prefill_served


def test_decode_instance_without_kv_recomputes(cluster):
    """A decode instance asked for a prompt no prefill instance stored: a miss, the same answer (slower)."""
    decode = cluster.decode[1]
    prompt = cluster.prompt(600)
    before = _hits(decode)
    # As the proxy would pass it on from a prefill answer that claimed 4 stored blocks.
    got = complete(decode.url, cluster.model, prompt, kv_transfer_params={"ucm_prefill_blocks": 4})
    want = complete(cluster.single.url, cluster.model, prompt)
    assert_same(got, want)
    ((_, hbm, external),) = _new_hits(decode, before)
    assert (hbm, external) == (0, 0)
    assert "the prefill instance stored 4 blocks, the store has the first 0; recomputing the rest" in decode.read_log()


def test_proxy_retries_when_a_prefill_instance_dies(cluster, tmp_path):
    """SIGKILL one prefill instance while the proxy still counts it healthy: its requests go to the other one; with
    both gone, the client gets a clear error naming them. (Runs last: it kills the prefill instances.)"""
    victim, survivor = cluster.prefill
    proxy = ProxyProcess(
        [victim.port, survivor.port], [cluster.decode[0].port], tmp_path / "proxy.log", health_interval_s=3600
    ).wait_ready()
    try:
        victim.kill()
        for n in (350, 450):  # round robin: one of the two is first sent to the dead instance
            prompt = cluster.prompt(n)
            want = complete(cluster.single.url, cluster.model, prompt)
            assert_same(complete(proxy.url, cluster.model, prompt), want)
        with urllib.request.urlopen(f"{proxy.url}/status", timeout=10) as r:
            status = json.loads(r.read())
        assert [p["healthy"] for p in status["prefill"]] == [False, True], status

        survivor.kill()
        code, body = http_json(
            f"{proxy.url}/v1/completions", {"model": cluster.model, "prompt": cluster.prompt(200), "max_tokens": 4}
        )
        assert code in (502, 503), body
        message = body["error"]["message"]
        assert f"127.0.0.1:{victim.port}" in message and f"127.0.0.1:{survivor.port}" in message, message
    finally:
        log = proxy.stop()
    assert f"prefill on 127.0.0.1:{victim.port} failed" in log, log[-3000:]
