"""examples/pd/start_pd.sh (the seed guide's centralized PD form) run as 1P1D: the script starts the real `vllm serve`
instances and the proxy; an HTTP client sends completions through the proxy. The decode instance loads what the
prefill instance stored (UCM's line: every full block of the prompt an external hit) and answers as a single
instance does.

The script keeps the guide's ports (7800-7803, proxy 7805) by default; the test passes free ones (PREFILL_PORTS,
DECODE_PORTS, PROXY_PORT). The model runs in float32 (SERVE_ARGS), as in test_pd.py (see its doc), and every
instance eager (``--enforce-eager`` in SERVE_ARGS): the script's decode instances would otherwise compile the model
with torch.compile, which took ~50 s of this test's ~170 s on a 2-core machine and is vLLM's, not UCM's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO, ucm_extra_config
from tests.pd.helpers import assert_same, complete, hits
from ucm.testing.engine import engine_env
from ucm.testing.server import VllmServer, free_port, kill_group
from ucm.testing.texts import real_text

SCRIPTS = sorted((REPO / "examples" / "pd").glob("*.sh"))
BLOCK_SIZE = 128  # the CPU backend's default
PROMPT_TOKENS = (700, 1100)
READY_TIMEOUT_S = 900.0  # three servers start at once on few cores


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_script_parses(script):
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)


class StartPd:
    """``bash examples/pd/start_pd.sh`` in its own process group (1P1D on free ports), its output in ``log``."""

    def __init__(self, tmp: Path, model: Path, config: Path) -> None:
        self.prefill_port, self.decode_port, self.proxy_port = free_port(), free_port(), free_port()
        self.log_dir = tmp / "pd_logs"
        env = engine_env(
            {
                "MODEL": str(model),
                "PREFILL_PORTS": str(self.prefill_port),
                "DECODE_PORTS": str(self.decode_port),
                "PROXY_PORT": str(self.proxy_port),
                "UCM_CONFIG_FILE": str(config),
                "LOG_DIR": str(self.log_dir),
                "SERVE_ARGS": "--dtype float32 --enforce-eager",
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "PYTHON": sys.executable,
            }
        )
        self.log = tmp / "start_pd.log"
        self._log_file = self.log.open("w")
        self.proc = subprocess.Popen(
            ["bash", str(REPO / "examples" / "pd" / "start_pd.sh")],
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    def server_log(self, kind: str) -> Path:
        port = self.prefill_port if kind == "prefill" else self.decode_port
        return self.log_dir / f"{kind}-{port}.log"

    def wait_ready(self) -> None:
        """Until the proxy's /health answers 200 (both instances up)."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"start_pd.sh exited with {self.proc.returncode}:\n{self.log.read_text()}"
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                if r.status == 200:
                    return
            time.sleep(2)
        pytest.fail(f"the proxy was not ready in {READY_TIMEOUT_S:.0f} s:\n{self.log.read_text()}")

    def server_pgids(self) -> list[int]:
        path = self.log_dir / "server_pgids"
        return [int(x) for x in path.read_text().split()] if path.exists() else []

    def stop(self) -> list[int]:
        """SIGTERM the script's group (script and proxy; the script stops the instances), as Ctrl-C would stop it.

        Returns the instances' process groups still alive afterwards (killed here, shared memory removed)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=180)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log_file.close()
        return [g for g in self.server_pgids() if kill_group(g)]


@pytest.mark.engine
def test_start_pd_1p1d_decode_loads_prefill_kv(real_model, tmp_path):
    from transformers import AutoTokenizer

    config = tmp_path / "ucm.yaml"
    config.write_text(yaml.safe_dump(ucm_extra_config(tmp_path / "store")))
    single = VllmServer(real_model, tmp_path / "single.log", None, dtype="float32", env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    pd = StartPd(tmp_path, real_model, config)
    left: list[int] = []
    try:
        single.wait_ready()
        pd.wait_ready()
        tokenizer = AutoTokenizer.from_pretrained(str(real_model))
        ids = tokenizer.encode(real_text(40_000), add_special_tokens=False)
        start = 0
        for n in PROMPT_TOKENS:  # distinct texts: no shared prefix between the prompts
            prompt = tokenizer.decode(ids[start : start + n]) + "\n\nQuestion: what is the text above about? Answer:"
            start += n
            prefill_before, decode_before = hits(pd.server_log("prefill")), hits(pd.server_log("decode"))
            got = complete(pd.url, str(real_model), prompt)
            want = complete(single.url, str(real_model), prompt)
            assert_same(got, want)
            full_blocks = got["usage"]["prompt_tokens"] // BLOCK_SIZE
            prefill = [v for k, v in hits(pd.server_log("prefill")).items() if k not in prefill_before]
            decode = [v for k, v in hits(pd.server_log("decode")).items() if k not in decode_before]
            assert prefill == [(full_blocks, 0, 0)], prefill
            assert decode == [(full_blocks, 0, full_blocks)], decode  # every full block loaded from the store
            assert full_blocks > 0
    finally:
        left = pd.stop()
        single.stop()
    assert not left, f"start_pd.sh left instances running (process groups {left}):\n{pd.log.read_text()[-3000:]}"
    assert "[UC][I] PD proxy on" in pd.log.read_text()  # the proxy ran, and was stopped with the script
