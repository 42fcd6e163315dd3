"""The proxy's command line and its answers when no instance is up (no vLLM needed: nothing listens)."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from ucm.testing.server import ProxyProcess, free_port, http_json


def _proxy_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ucm.pd.proxy", *args], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prefiller-ports", "1", "--decoder-ports", "2", "--policy", "random"], "--policy 'random' is not known"),
        (
            ["--prefiller-ports", "1", "--decoder-ports", "2", "3", "--decoder-hosts", "a", "b", "c"],
            "--decoder-hosts has 3 entries and --decoder-ports 2",
        ),
        (["--prefiller-ports", "0", "--decoder-ports", "2"], "--prefiller-ports: 0 is not a TCP port"),
        (["--decoder-ports", "2"], "the following arguments are required: --prefiller-ports"),
    ],
)
def test_bad_arguments_are_refused(args, message):
    proc = _proxy_cli(*args)
    assert proc.returncode == 2
    assert message in proc.stderr, proc.stderr


def test_no_instance_up_gives_clear_errors(tmp_path):
    dead_p, dead_d = free_port(), free_port()  # nothing listens there
    proxy = ProxyProcess([dead_p], [dead_d], tmp_path / "proxy.log").wait_ready()
    try:
        status, body = http_json(f"{proxy.url}/health")
        assert status == 503
        assert [i["healthy"] for i in body["prefill"] + body["decode"]] == [False, False]
        status, body = http_json(f"{proxy.url}/v1/completions", {"model": "m", "prompt": "hello", "max_tokens": 2})
        assert status == 502
        assert f"no prefill instance could answer: 127.0.0.1:{dead_p}" in body["error"]["message"]
        assert "Connect" in body["error"]["message"]  # why: the connection was refused
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(urllib.request.Request(f"{proxy.url}/v1/completions", data=b"not json"), timeout=30)
        assert err.value.code == 400
        assert "request body is not JSON" in err.value.read().decode()
    finally:
        log = proxy.stop()
    assert f"prefill instance 127.0.0.1:{dead_p} is down" in log


def test_seed_guide_flags(tmp_path):
    """The seed guide's proxy command line (2P2D, one host per port, --host): every instance is taken, in order."""
    ports = [free_port() for _ in range(5)]  # nothing listens on the instances' ports
    log = tmp_path / "proxy.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "ucm.pd.proxy",
                "--port", str(ports[4]),
                "--host", "127.0.0.1",
                "--prefiller-hosts", "127.0.0.1", "127.0.0.1",
                "--prefiller-ports", str(ports[0]), str(ports[1]),
                "--decoder-hosts", "127.0.0.1", "127.0.0.1",
                "--decoder-ports", str(ports[2]), str(ports[3]),
            ],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, log.read_text()
                try:
                    status, body = http_json(f"http://127.0.0.1:{ports[4]}/status", timeout_s=5)
                    break
                except OSError:
                    assert time.monotonic() < deadline, log.read_text()
                    time.sleep(0.5)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    assert status == 200, body
    assert [i["instance"] for i in body["prefill"]] == [f"127.0.0.1:{p}" for p in ports[:2]], body
    assert [i["instance"] for i in body["decode"]] == [f"127.0.0.1:{p}" for p in ports[2:4]], body
