"""The transfer trace (``enable_record_traces: true``): one JSON line per lookup, load and dump, bounded in size.

A :class:`TraceWriter` is a sink of a :class:`~ucm.store.observe.Recorder`: it writes each
:class:`~ucm.store.observe.Observation` as one line, e.g.::

    {"ts": 1764876543.123, "op": "load", "tier": "storage", "requests": ["chatcmpl-1"], "blocks": 15, "ok": 15,
     "bytes": 44236800, "ms": 41.7}

Keys: ``ts`` (Unix time, seconds), ``op``, ``tier``, ``requests``, ``blocks``, ``ok``, ``bytes``, ``ms``, plus
``stored_bytes`` (compress), ``tokens`` (lookup), ``cause`` and ``key`` (load_failure) where they apply.

Each process and connector role writes its own file, ``ucm-trace-<host>-<pid>-<role>.jsonl`` in the trace directory,
line-buffered (every line reaches the file when written). Size bound: when a file reaches ``max_bytes``, it is
renamed to ``<name>.1`` (replacing the previous one) and a new file is started, so one process and role keeps at most
``2 * max_bytes`` on disk.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from typing import IO, Any

from ucm.logger import init_logger
from ucm.store.observe import Observation

logger = init_logger(__name__)

TRACE_FILE_MODE = 0o600
TRACE_DIR_MODE = 0o700


def trace_file_name(role: str) -> str:
    """``ucm-trace-<host>-<pid>-<role>.jsonl``: unique per process on a shared directory."""
    return f"ucm-trace-{socket.gethostname()}-{os.getpid()}-{role}.jsonl"


def observation_record(obs: Observation, ts: float) -> dict[str, Any]:
    """The JSON object of one trace line (see the module docstring)."""
    record: dict[str, Any] = {
        "ts": round(ts, 6),
        "op": obs.op,
        "tier": obs.tier,
        "requests": list(obs.requests),
        "blocks": obs.blocks,
        "ok": obs.ok,
        "bytes": obs.nbytes,
        "ms": round(obs.seconds * 1e3, 3),
    }
    if obs.stored_nbytes:
        record["stored_bytes"] = obs.stored_nbytes
    if obs.op == "lookup":
        record["tokens"] = obs.tokens
    if obs.cause is not None:
        record["cause"] = obs.cause
    if obs.key is not None:
        record["key"] = obs.key
    return record


class TraceWriter:
    """Writes observations as JSON lines to ``<directory>/<trace_file_name(role)>``, rotating at ``max_bytes``.

    Thread-safe (observations arrive from the stages' threads). A write that fails (disk full, directory removed) is
    logged once as a warning and the trace stops; serving goes on.

    Args:
        directory: where the trace file goes; created (mode 0700) if missing.
        max_bytes: size at which the file is rotated (>= 1024).
        role: ``scheduler`` or ``worker`` (part of the file name).

    Raises:
        ValueError: ``max_bytes`` < 1024, or ``directory`` cannot be created or written (naming it and why).
    """

    def __init__(self, directory: str, max_bytes: int, role: str) -> None:
        if max_bytes < 1024:
            raise ValueError(f"trace size bound must be at least 1024 bytes, got {max_bytes}")
        try:
            os.makedirs(directory, mode=TRACE_DIR_MODE, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"trace directory {directory!r} cannot be created: {exc.strerror or exc}") from None
        self.path = os.path.join(directory, trace_file_name(role))
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._file: IO[str] | None = None
        self._size = 0
        try:
            self._open()
        except OSError as exc:
            raise ValueError(f"trace file {self.path!r} cannot be written: {exc.strerror or exc}") from None
        logger.info("recording traces to %s (rotated at %.1f MiB)", self.path, max_bytes / 2**20)

    def _open(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, TRACE_FILE_MODE)
        self._file = open(fd, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - kept open, closed in close()
        self._size = os.fstat(fd).st_size

    def write(self, obs: Observation) -> None:
        """Append ``obs`` as one line (a :class:`~ucm.store.observe.Recorder` sink). Never raises."""
        line = json.dumps(observation_record(obs, time.time()), separators=(",", ":")) + "\n"
        with self._lock:
            if self._file is None:
                return
            try:
                if self._size + len(line) > self._max_bytes and self._size > 0:
                    self._file.close()
                    os.replace(self.path, self.path + ".1")
                    self._open()
                self._file.write(line)
                self._size += len(line)
            except OSError as exc:
                logger.warning("trace %s: cannot write: %s; traces stop for this process", self.path, exc)
                self._close_locked()

    def close(self) -> None:
        """Close the file. Idempotent; later observations are dropped."""
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
