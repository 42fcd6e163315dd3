"""UCM's logging: one ``ucm`` logger tree, formatted ``[UC][I] message``.

The level comes from the environment variable ``UC_LOGGER_LEVEL`` (``debug``, ``info``, ``warning``, ``error``;
default ``info``). vLLM configures its own loggers only; UCM's logger writes to stderr through its own handler so
its lines look the same in the API server, the engine core and the workers.
"""

from __future__ import annotations

import logging
import os
import sys

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
_LETTER = {
    logging.DEBUG: "D",
    logging.INFO: "I",
    logging.WARNING: "W",
    logging.ERROR: "E",
    logging.CRITICAL: "E",
}


class _UCFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        record.uc_letter = _LETTER.get(record.levelno, "I")
        return super().format(record)


def _level_from_env() -> int:
    value = os.environ.get("UC_LOGGER_LEVEL", "info").strip().lower()
    if value not in _LEVELS:
        raise ValueError(f"UC_LOGGER_LEVEL={value!r} is not a log level; allowed: {sorted(_LEVELS)}")
    return _LEVELS[value]


def init_logger(name: str) -> logging.Logger:
    """Return the logger ``name`` (a module's ``__name__`` under ``ucm``), setting up the ``ucm`` root once.

    Raises:
        ValueError: ``UC_LOGGER_LEVEL`` holds something other than debug/info/warning/error.
    """
    root = logging.getLogger("ucm")
    if not getattr(root, "_uc_configured", False):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_UCFormatter("[UC][%(uc_letter)s] %(message)s"))
        root.addHandler(handler)
        root.setLevel(_level_from_env())
        root.propagate = False
        root._uc_configured = True  # type: ignore[attr-defined]
    return logging.getLogger(name)
