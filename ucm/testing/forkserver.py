"""A fork server for :func:`ucm.testing.engine.run_engine`: one process imports vLLM once, then forks a fresh child
for every engine run.

Importing vLLM (with torch, inductor and transformers) is a large share of a small engine's start, and the test suite
starts many engine processes (figures: benchmarks/RESULTS.md, "Test suite duration"). The server imports what every
engine child imports (``vllm``, ``vllm.LLM``, ``vllm.SamplingParams``) and nothing of UCM but :mod:`ucm.testing.engine`
(stdlib only at import), then waits. For each run it forks; the child takes the run's environment, working directory,
stdout and stderr, runs the spec like ``python -m ucm.testing.engine`` and ends with a normal interpreter exit (threads
joined, ``atexit`` handlers run), so each run is still a new process in which nothing survives but files and the
server's imports. UCM's plugin, connector and stores are imported in the child, after the fork.

Import-time state must match:
- A run forks from a server started with the same environment, where "the same" ignores :data:`LAZY_KEYS`
  (variables that vLLM and UCM read only after the fork).
- A run whose environment differs elsewhere (``PYTHONPATH``, a fault-injection ``sitecustomize``, a logging level)
  gets a server of its own; at most :data:`MAX_SERVERS` run at a time, the least recently used one is closed for a
  new one.
- A server that finds a Python thread besides its own after the imports refuses (a fork would copy a lock the thread
  may hold), and its runs get plain processes. The native threads that numpy's and torch's BLAS libraries start at
  import are parked and re-made after a fork (their ``pthread_atfork`` handlers), as when vLLM forks its own
  engine-core and worker processes after the same imports.

Switched on by ``UCM_ENGINE_FORKSERVER=1`` (the test suite's ``conftest.py``); off, every run is
``python -m ucm.testing.engine``.

Protocol on a Unix socket pair, each message a 4-byte big-endian length and a JSON object:
- the server sends ``{"python_threads": n}`` once ready;
- a request ``{"spec", "env", "cwd"}`` carries three file descriptors (``SCM_RIGHTS``): the child's stdout and
  stderr, and one end of the run's own socket pair;
- on that pair the server answers ``{"pid": p}`` at the fork and ``{"returncode": r}`` when the child has ended
  (negative: killed by that signal, as :mod:`subprocess` reports it). Runs from several threads go on at once.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

ENABLE_ENV = "UCM_ENGINE_FORKSERVER"
# Read only after the fork (vLLM's envs are evaluated lazily at engine start; UCM's config at connector start;
# pytest rewrites PYTEST_CURRENT_TEST for every test).
LAZY_KEYS = frozenset(
    {
        "VLLM_CPU_KVCACHE_SPACE",
        "VLLM_PLUGINS",
        "VLLM_ENABLE_V1_MULTIPROCESSING",
        "VLLM_CPU_OMP_THREADS_BIND",
        "VLLM_HOST_IP",
        "VLLM_SERVER_DEV_MODE",
        "UCM_CONFIG_FILE",
        "UC_LOGGER_LEVEL",
        "PYTEST_CURRENT_TEST",
    }
)
MAX_SERVERS = 3
READY_TIMEOUT_S = 300.0  # a server not ready by then (its imports hung) is killed; its runs get plain processes
# A child killed (SIGKILL) for running past its timeout and not reaped by then is stuck in the kernel: the run fails
# instead of waiting for it without bound.
KILL_WAIT_S = 60.0
TAIL_BYTES = 8000  # of a killed child's stdout and stderr, in the errors raised
_HEADER = struct.Struct(">I")


def _send(sock: socket.socket, obj: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(obj).encode()
    payload = _HEADER.pack(len(data)) + data
    if fds:
        socket.send_fds(sock, [payload], fds)
    else:
        sock.sendall(payload)


def _recv_exact(sock: socket.socket, n: int, fds: list[int]) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk, got, _, _ = socket.recv_fds(sock, n - len(buf), 4)
        fds.extend(got)
        if not chunk:
            return None
        buf += chunk
    return buf


def _recv(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    fds: list[int] = []
    head = _recv_exact(sock, _HEADER.size, fds)
    if head is None:
        return None, fds
    body = _recv_exact(sock, _HEADER.unpack(head)[0], fds)
    return (json.loads(body) if body is not None else None), fds


def _tail(f: Any) -> str:
    """The last :data:`TAIL_BYTES` written to the temporary file ``f`` (a child's stdout or stderr)."""
    f.seek(0, os.SEEK_END)
    f.seek(max(0, f.tell() - TAIL_BYTES))
    return f.read().decode(errors="replace")


def stuck_error(what: str, timeout_s: float, stderr: str) -> RuntimeError:
    """The error of a run whose child ``what`` (e.g. ``"engine child 123"``) was killed past ``timeout_s`` s and did
    not end within :data:`KILL_WAIT_S` s (``stderr``: what it wrote, or ``""``)."""
    return RuntimeError(
        f"{what} ran past {timeout_s} s and did not end within {KILL_WAIT_S} s of SIGKILL: a thread of it is in an "
        f"uninterruptible wait in the kernel (a hung FUSE or NFS mount answers nothing); its stderr so far:\n{stderr}"
    )


def import_key(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The part of ``env`` that import-time state may depend on: everything but :data:`LAZY_KEYS`."""
    return tuple(sorted((k, v) for k, v in env.items() if k not in LAZY_KEYS))


class ForkServer:
    """One server process (started with ``env``) and the parent's end of its socket."""

    def __init__(self, env: dict[str, str]) -> None:
        self.key = import_key(env)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ucm.testing.forkserver", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            # Import warnings only; a server that fails to start leaves its runs to plain processes.
            stderr=subprocess.DEVNULL,
        )
        theirs.close()
        self.sock = ours
        self._lock = threading.Lock()
        ours.settimeout(READY_TIMEOUT_S)
        try:
            ready, _ = _recv(ours)
        except TimeoutError:
            ready = None
            self.proc.kill()
        ours.settimeout(None)
        self.usable = ready is not None and ready.get("python_threads") == 1

    def run(self, spec: dict[str, Any], env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess[str]:
        """Run ``spec`` in a child forked with ``env``; like ``subprocess.run(..., capture_output=True, text=True)``.
        Runs from several threads go on at once (each has its own socket pair for its child's pid and exit code).

        Raises:
            subprocess.TimeoutExpired: the child ran past ``timeout_s`` (it is killed first; ``stdout`` and
                ``stderr`` hold the tails of what it wrote).
            RuntimeError: the server went away, or the killed child did not end within :data:`KILL_WAIT_S` s.
        """
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with ours, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            with theirs, self._lock:
                _send(
                    self.sock,
                    {"spec": spec, "env": env, "cwd": os.getcwd()},
                    [out.fileno(), err.fileno(), theirs.fileno()],
                )
            started, _ = _recv(ours)
            if started is None:
                raise RuntimeError("the engine fork server exited")
            ours.settimeout(timeout_s)
            try:
                ended, _ = _recv(ours)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(started["pid"], signal.SIGKILL)
                ours.settimeout(KILL_WAIT_S)
                try:
                    _recv(ours)  # the server reaped it
                except TimeoutError:
                    raise stuck_error(f"engine child {started['pid']}", timeout_s, _tail(err)) from None
                raise subprocess.TimeoutExpired(
                    "ucm.testing.engine (forked)", timeout_s, output=_tail(out), stderr=_tail(err)
                ) from None
            if ended is None:
                raise RuntimeError("the engine fork server exited")
            out.seek(0)
            err.seek(0)
            stdout = out.read().decode(errors="replace")
            stderr = err.read().decode(errors="replace")
        return subprocess.CompletedProcess(["ucm.testing.engine"], ended["returncode"], stdout, stderr)

    def close(self) -> None:
        """Close the server's socket: it exits once its children have ended (a run still going finishes)."""
        self.sock.close()


_servers: list[ForkServer] = []
_servers_lock = threading.Lock()


def enabled() -> bool:
    """Whether :func:`ucm.testing.engine.run_engine` forks its runs from a server (``UCM_ENGINE_FORKSERVER=1``)."""
    return os.environ.get(ENABLE_ENV) == "1"


def server_for(env: dict[str, str]) -> ForkServer | None:
    """The server whose import-time environment is ``env``'s (started now if there is none), or ``None`` (it could
    not start or refused): run a plain process."""
    key = import_key(env)
    with _servers_lock:
        for s in _servers:
            if s.key == key:
                _servers.remove(s)  # most recently used last
                _servers.append(s)
                return s if s.usable and s.proc.poll() is None else None
        if len(_servers) >= MAX_SERVERS:  # the least recently used goes (starting one costs about one plain run)
            _servers.pop(0).close()
        server = ForkServer(env)
        _servers.append(server)
        return server if server.usable else None


def _close_all() -> None:
    with _servers_lock:
        for s in _servers:
            s.close()
        _servers.clear()


atexit.register(_close_all)


def _serve(sock: socket.socket) -> dict[str, Any] | None:
    """The server's loop. Returns ``None`` in the server once the parent has gone and every child has ended, and the
    request in a forked child."""
    import vllm  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401

    import ucm.testing.engine  # noqa: F401

    threads = threading.active_count()
    _send(sock, {"python_threads": threads})
    if threads != 1:
        return None
    running: dict[int, socket.socket] = {}  # child pid -> the run's socket
    parent_alive = True
    while parent_alive or running:
        if parent_alive and select.select([sock], [], [], 0.1)[0]:
            request, fds = _recv(sock)
            if request is None:
                parent_alive = False
            else:
                out, err, run_fd = fds
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    sock.close()
                    for other in running.values():
                        other.close()
                    os.close(run_fd)
                    os.dup2(out, 1)
                    os.dup2(err, 2)
                    os.close(out)
                    os.close(err)
                    os.environ.clear()
                    os.environ.update(request["env"])
                    os.chdir(request["cwd"])
                    return request
                os.close(out)
                os.close(err)
                run_sock = socket.socket(fileno=run_fd)
                with contextlib.suppress(OSError):
                    _send(run_sock, {"pid": pid})
                running[pid] = run_sock
        elif not parent_alive:
            time.sleep(0.1)
        while running:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            run_sock = running.pop(pid)
            with contextlib.suppress(OSError):
                _send(run_sock, {"returncode": os.waitstatus_to_exitcode(status)})
            run_sock.close()
    return None


if __name__ == "__main__":
    _request = _serve(socket.socket(fileno=int(sys.argv[1])))
    if _request is not None:  # a forked child: run like ``python -m ucm.testing.engine``, then exit normally
        from ucm.testing.engine import run_child

        run_child(_request["spec"])
