"""A real Mooncake master for tests and benchmarks, and a loopback-only network namespace to run its clients in.

Mooncake's client listens on every interface (its transfer engine's RPC port), so whatever builds a client (a test's
scenario, an engine with the ``Mooncake`` stage) runs inside a network namespace with only ``lo``:
:func:`loopback_netns_argv` prefixes a command with ``unshare --net`` and brings ``lo`` up. The master runs in the
same namespace (started by the scenario with :class:`MooncakeMaster`), bound to 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from ucm.testing.server import free_port


def master_binary() -> str | None:
    """Path of ``mooncake_master``: beside this Python (the venv's bin), on PATH, or in the ``mooncake`` package."""
    beside = Path(sys.executable).parent / "mooncake_master"
    if beside.exists():
        return str(beside)
    found = shutil.which("mooncake_master")
    if found:
        return found
    try:
        import mooncake
    except ImportError:
        return None
    packaged = Path(mooncake.__file__).parent / "mooncake_master"
    return str(packaged) if packaged.exists() else None


def loopback_netns_argv(argv: list[str]) -> list[str]:
    """``argv`` run in a new network namespace whose only interface is ``lo``, up (needs root or user namespaces)."""
    return ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *argv]


def netns_unusable_reason() -> str | None:
    """Why :func:`loopback_netns_argv` cannot run here, or None when it can."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "unshare or ip (util-linux, iproute2) not found"
    probe = subprocess.run(loopback_netns_argv(["true"]), capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"cannot make a network namespace: {probe.stderr.strip()[:200]}"
    return None


def write_mooncake_json(path: str | os.PathLike[str], master_address: str, segment_bytes: int) -> Path:
    """Write a client config as the seeds' Mooncake guide has users write it (``mooncake.json``: P2PHANDSHAKE, tcp,
    the master's address, ``global_segment_size`` bytes), for ``MOONCAKE_CONFIG_PATH``; returns its path.

    Raises:
        OSError: ``path`` cannot be written.
    """
    config = {
        "metadata_server": "P2PHANDSHAKE",
        "protocol": "tcp",
        "device_name": "",
        "master_server_address": master_address,
        "global_segment_size": segment_bytes,
    }
    out = Path(path)
    out.write_text(json.dumps(config, indent=2))
    return out


class MooncakeMaster:
    """A ``mooncake_master`` process on 127.0.0.1 (RPC and metrics ports chosen free), its log in ``log_path``.

    Args:
        log_path: where its stdout and stderr go.
        extra_args: more flags (e.g. ``--default_kv_lease_ttl=1000``).

    Raises:
        RuntimeError: no ``mooncake_master`` binary, or it did not accept connections within 20 s.
    """

    def __init__(self, log_path: str | os.PathLike[str], extra_args: tuple[str, ...] = ()) -> None:
        binary = master_binary()
        if binary is None:
            raise RuntimeError("mooncake_master not found: pip install mooncake-transfer-engine-non-cuda")
        self.port = free_port()
        self.metrics_port = free_port()
        self._argv = [
            binary,
            "--rpc_address=127.0.0.1",
            f"--rpc_port={self.port}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={self.metrics_port}",
            *extra_args,
        ]
        self._log_path = str(log_path)
        self._process: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def address(self) -> str:
        """``host:port`` for ``master_server_address``."""
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start it (again, on the same ports, after :meth:`kill`) and wait until it accepts connections."""
        log = open(self._log_path, "ab")  # noqa: SIM115 - the child keeps it
        self._process = subprocess.Popen(self._argv, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self._process.returncode}; see {self._log_path}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"mooncake_master did not listen on port {self.port} within 20 s; see {self._log_path}")

    def kill(self) -> None:
        """SIGKILL it (every key it indexed is lost) and wait for it."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    def __enter__(self) -> MooncakeMaster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
