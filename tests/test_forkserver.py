"""The tests' engine fork server (``ucm/testing/forkserver.py``): a forked run gets its own environment, its errors
and exit code come back, a run past its timeout is killed without taking the server down (and one that cannot be
killed, stuck in the kernel on a hung mount, fails after a bounded wait), and runs from two threads are alive at the
same time (a test's "concurrent second instance" stays concurrent)."""

from __future__ import annotations

import os
import re
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest

from ucm.testing import forkserver, fusefs
from ucm.testing.engine import run_engine

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not forkserver.enabled(), reason="UCM_ENGINE_FORKSERVER is not 1"),
]


def _spec(model: Path, before_cmd: str) -> dict:
    return {"model": str(model), "dtype": "float32", "max_model_len": 512,
            "requests": [{"prompt": "one two three", "max_tokens": 1, "before_cmd": before_cmd}]}  # fmt: skip


def test_only_lazy_keys_may_differ_within_one_server() -> None:
    base = {"PATH": "/bin", "VLLM_CPU_KVCACHE_SPACE": "1"}
    assert forkserver.import_key(base) == forkserver.import_key({**base, "VLLM_CPU_KVCACHE_SPACE": "2"})
    assert forkserver.import_key(base) != forkserver.import_key({**base, "PYTHONPATH": "/x"})


def test_a_failed_run_reports_its_error_and_exit_code() -> None:
    with pytest.raises(RuntimeError, match=r"exit 1\)[\s\S]*KeyError: 'model'"):
        run_engine({"requests": []})


def test_two_threads_run_at_once_and_each_child_has_its_environment(tiny_model: Path, tmp_path: Path) -> None:
    # Each child marks its arrival, then waits up to 60 s for the other's mark: run one after the other, the first
    # would fail. The lazy VLLM_CPU_KVCACHE_SPACE differs, so both fork from one server, each with its own value.
    errors: list[BaseException] = []

    def run(me: str, other: str, gib: str) -> None:
        wait = f"for i in $(seq 600); do [ -e {tmp_path / other} ] && break; sleep 0.1; done; [ -e {tmp_path / other} ]"
        cmd = f'[ "$VLLM_CPU_KVCACHE_SPACE" = {gib} ] && touch {tmp_path / me} && {wait}'
        try:
            run_engine(_spec(tiny_model, cmd), env={"VLLM_CPU_KVCACHE_SPACE": gib})
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=args) for args in (("a", "b", "1"), ("b", "a", "2"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_a_run_past_its_timeout_is_killed_and_the_server_goes_on(tiny_model: Path, tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    with pytest.raises(RuntimeError, match=r"ran past 20 s and was killed"):
        run_engine(_spec(tiny_model, "echo before-sleep >&2; sleep 600"), timeout_s=20, log_path=log)
    assert "before-sleep" in log.read_text()  # what the killed child wrote is kept
    results, _ = run_engine(_spec(tiny_model, "true"))
    assert len(results) == 1 and len(results[0].token_ids) == 1


@pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="/dev/fuse is absent: no FUSE mount can be made")
@pytest.mark.parametrize("path", ["forked", "plain"])
def test_a_killed_run_stuck_in_the_kernel_fails_after_a_bounded_wait(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    # The model lies on a real FUSE mount whose daemon takes 120 s to answer each read. The child's read of
    # config.json is in the daemon's hands, so SIGKILL does not end the child until the answer comes (the kernel waits
    # out a request its daemon has read): the run fails once the kill wait is over instead of waiting for it.
    # "plain": a wrapper command (which always gets a plain process) reads the file before it would start the engine.
    reason = fusefs.unavailable_reason()
    if reason is not None:
        pytest.fail(f"FUSE is available but its user-space part is not: {reason} (make setup installs it)")
    monkeypatch.setattr(forkserver, "KILL_WAIT_S", 2.0)
    source, mountpoint = tmp_path / "source", tmp_path / "mnt"
    shutil.copytree(tiny_model, source)
    config = mountpoint / "config.json"
    wrapper = [sys.executable, "-c", "import sys; open(sys.argv[1], 'rb').read()", str(config)]
    with fusefs.mount(source, mountpoint, read_delay_ms=120_000) as daemon:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"ran past 5 s and did not end within 2.0 s of SIGKILL") as err:
            run_engine(_spec(mountpoint, "true"), timeout_s=5, wrapper=wrapper if path == "plain" else ())
        elapsed_s = time.monotonic() - t0
        named = re.search(r"engine (?:child|process) (\d+)", str(err.value))
        assert named is not None, err.value
        stuck_pid = int(named.group(1))
        assert Path(f"/proc/{stuck_pid}/stat").read_text().split(") ")[1][0] == "D"  # uninterruptible, killed or not
        assert daemon.poll() is None
    # the run ended within its timeout plus the kill wait (plus a margin for starting the child), not the 120 s read
    assert elapsed_s < 60, elapsed_s
