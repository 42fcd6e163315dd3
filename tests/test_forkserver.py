"""The tests' engine fork server (``ucm/testing/forkserver.py``): a forked run gets its own environment, its errors
and exit code come back, a run past its timeout is killed without taking the server down, and runs from two threads
are alive at the same time (a test's "concurrent second instance" stays concurrent)."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import pytest

from ucm.testing import forkserver
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


def test_a_run_past_its_timeout_is_killed_and_the_server_goes_on(tiny_model: Path) -> None:
    with pytest.raises(subprocess.TimeoutExpired):
        run_engine(_spec(tiny_model, "sleep 600"), timeout_s=20)
    results, _ = run_engine(_spec(tiny_model, "true"))
    assert len(results) == 1 and len(results[0].token_ids) == 1
