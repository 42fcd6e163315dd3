"""Real vLLM OpenAI API servers and the PD proxy as subprocesses on loopback: for tests, examples and benchmarks.

:class:`VllmServer` starts ``vllm serve`` (the console script beside this Python: vLLM's CLI, as users run it) in its
own process group with its log in a file; :class:`ProxyProcess` starts ``python -m ucm.pd.proxy``. Both start at
construction and are waited for with ``wait_ready()``, so several can start at once. ``stop()`` is SIGTERM (a
graceful shutdown, as an operator would), ``kill()`` is SIGKILL of the whole group (a crash), after which the
shared-memory files that group had mapped (vLLM leaves them in ``/dev/shm``) are removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ucm.testing.engine import engine_env

STARTUP_TIMEOUT_S = 600.0


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def http_json(url: str, body: dict[str, Any] | None = None, timeout_s: float = 600.0) -> tuple[int, Any]:
    """GET (``body`` None) or POST JSON to ``url``; return ``(status, parsed JSON body)`` (also for 4xx/5xx)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except json.JSONDecodeError:
            return e.code, raw.decode(errors="replace")


def sse_chunks(
    url: str, body: dict[str, Any], headers: dict[str, str] | None = None, timeout_s: float = 600.0
) -> Iterator[tuple[float, dict[str, Any]]]:
    """POST a streaming (server-sent events) request; yield ``(seconds since sending, chunk)`` per JSON chunk.

    Raises:
        urllib.error.HTTPError: the server refused the request.
    """
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **(headers or {})}
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            yield time.perf_counter() - t0, json.loads(line[len("data:") :])


def stream_completion(url: str, body: dict[str, Any], timeout_s: float = 600.0) -> tuple[str, float, float]:
    """POST a streaming completion request; return ``(text, ttft_s, total_s)`` (first chunk with text, end).

    Raises:
        urllib.error.HTTPError: the server refused the request.
    """
    t0 = time.perf_counter()
    ttft = 0.0
    parts: list[str] = []
    for elapsed, chunk in sse_chunks(url, {**body, "stream": True}, timeout_s=timeout_s):
        for choice in chunk.get("choices", []):
            text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            if text and not ttft:
                ttft = elapsed
            parts.append(text)
    return "".join(parts), ttft, time.perf_counter() - t0


def _wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}:\n{log.read_text()[-5000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} not ready in {timeout_s:.0f} s:\n{log.read_text()[-5000:]}")


def _group_pids(pgid: int) -> list[int]:
    """Processes of process group ``pgid`` (from /proc), zombies left out."""
    pids: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesized command: state, ppid, pgrp, ...
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry))
    return pids


def _shm_files_of(pids: Sequence[int]) -> set[Path]:
    """/dev/shm files that ``pids`` have mapped or open (vLLM's shared-memory buffers)."""
    found: set[Path] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                if "/dev/shm/" in line:
                    found.add(Path(line[line.index("/dev/shm/") :].split(" (deleted)")[0]))
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("/dev/shm/"):
                        found.add(Path(target))
    return found


def kill_group(pgid: int) -> bool:
    """SIGKILL process group ``pgid`` (a crash, or servers a script left behind) and remove the /dev/shm files its
    processes had mapped or open (vLLM's shared-memory buffers; no other process maps them).

    Returns:
        True if any process of the group was alive (and is now killed), False if none was. A zombie is not alive:
        a process killed and not yet reaped by its parent (e.g. vLLM's engine core after its API server was killed,
        left to an init that reaps late) is stopped, though ``killpg(pgid, 0)`` still finds it.
    """
    pids = _group_pids(pgid)
    if not pids:
        return False
    leaked = _shm_files_of(pids)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _group_pids(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    for path in leaked:
        path.unlink(missing_ok=True)
    return True


class _Process:
    """A subprocess in its own process group, its output in ``log``."""

    def __init__(self, cmd: Sequence[str], log: Path, env: dict[str, str]) -> None:
        self.log = log
        self._log_file = log.open("w")
        self.proc = subprocess.Popen(
            list(cmd), stdout=self._log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def alive(self) -> bool:
        """True while the process runs."""
        return self.proc.poll() is None

    def pids(self) -> list[int]:
        """The process group's processes now (the server and the engine processes it started)."""
        return _group_pids(self.proc.pid)

    def stop(self, timeout_s: float = 60.0) -> str:
        """SIGTERM the process group (graceful), wait (SIGKILL after ``timeout_s``); return the log."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log_file.close()
        return self.log.read_text()

    def kill(self) -> str:
        """SIGKILL the process group (a crash), remove what it leaked in /dev/shm; return the log."""
        if self.proc.poll() is None:
            kill_group(self.proc.pid)
            self.proc.wait()
        self._log_file.close()
        return self.log.read_text()

    def read_log(self) -> str:
        """The log so far."""
        self._log_file.flush()
        return self.log.read_text()


def vllm_cli() -> str:
    """Path of the ``vllm`` console script of this Python's environment (vLLM's CLI).

    Raises:
        FileNotFoundError: there is none beside ``sys.executable``.
    """
    path = Path(sys.executable).parent / "vllm"
    if not path.exists():
        raise FileNotFoundError(f"no vllm console script beside {sys.executable}: is vLLM installed there?")
    return str(path)


class VllmServer(_Process):
    """``vllm serve <model>`` on 127.0.0.1 (started at construction), through the ``vllm`` console script of this
    Python's environment.

    Args:
        model: model directory.
        log: file for the server's stdout and stderr.
        kv_transfer_config: vLLM's ``--kv-transfer-config`` as a dict (None: no connector).
        port: TCP port (None: a free one).
        max_model_len: tokens.
        dtype: the model's dtype (``--dtype``).
        env: more environment (added to :func:`ucm.testing.engine.engine_env`).
        extra_args: more command-line arguments.
    """

    def __init__(
        self,
        model: Path | str,
        log: Path,
        kv_transfer_config: dict[str, Any] | None = None,
        port: int | None = None,
        max_model_len: int = 4096,
        dtype: str = "bfloat16",
        env: dict[str, str] | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.port = port or free_port()
        self.model = str(model)
        cmd = [
            vllm_cli(), "serve", self.model, "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", dtype, "--max-model-len", str(max_model_len), "--enforce-eager",
            "--seed", "0", *extra_args,
        ]  # fmt: skip
        if kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        super().__init__(cmd, log, engine_env(env))

    @property
    def url(self) -> str:
        """``http://127.0.0.1:port``."""
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> VllmServer:
        """Block until ``/health`` answers 200.

        Raises:
            RuntimeError: the server exited or did not get ready in time (its log tail in the message); it is
                stopped first.
        """
        try:
            _wait_http(f"{self.url}/health", self.proc, self.log, timeout_s)
        except RuntimeError:
            self.stop()
            raise
        return self


class ProxyProcess(_Process):
    """``python -m ucm.pd.proxy`` on 127.0.0.1 in front of ``prefill`` and ``decode`` ports."""

    def __init__(
        self,
        prefill_ports: Sequence[int],
        decode_ports: Sequence[int],
        log: Path,
        port: int | None = None,
        policy: str = "round_robin",
        health_interval_s: float = 2.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = port or free_port()
        cmd = [
            sys.executable, "-m", "ucm.pd.proxy", "--port", str(self.port),
            "--prefiller-ports", *map(str, prefill_ports), "--decoder-ports", *map(str, decode_ports),
            "--policy", policy, "--health-interval", str(health_interval_s),
        ]  # fmt: skip
        full_env = dict(os.environ)
        full_env.update(env or {})
        super().__init__(cmd, log, full_env)

    @property
    def url(self) -> str:
        """``http://127.0.0.1:port``."""
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 60.0) -> ProxyProcess:
        """Block until the proxy answers ``/status``.

        Raises:
            RuntimeError: it exited or did not answer in time.
        """
        _wait_http(f"{self.url}/status", self.proc, self.log, timeout_s)
        return self
