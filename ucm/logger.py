"""UCM's logging: one ``ucm`` logger tree, formatted ``[UC][I] message``.

The level comes from the environment variable ``UC_LOGGER_LEVEL`` (``debug``, ``info``, ``warning``, ``error``;
default ``info``). vLLM configures its own loggers only; UCM's logger writes to stderr through its own handler so
its lines look the same in the API server, the engine core and the workers.

A value that is not a level never stops a process from importing UCM (vLLM loads UCM's plugin in every process,
also where UCM is not configured): the level falls back to ``info`` with one warning line. The connector refuses it
at start (:func:`check_level_env`), where UCM is actually in use.
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


def _level_name() -> str:
    """``UC_LOGGER_LEVEL`` lower-cased, ``info`` when unset or empty."""
    return os.environ.get("UC_LOGGER_LEVEL", "").strip().lower() or "info"


def _bad_level_message() -> str | None:
    """What is wrong with ``UC_LOGGER_LEVEL`` (naming the value and the allowed ones), ``None`` when it is a level
    or unset."""
    value = _level_name()
    if value in _LEVELS:
        return None
    return f"UC_LOGGER_LEVEL={value!r} is not a log level; allowed: {sorted(_LEVELS)}"


def check_level_env() -> None:
    """Refuse a ``UC_LOGGER_LEVEL`` that is not a level (for the connector's start; importing UCM only warns).

    Raises:
        ValueError: it holds something other than debug/info/warning/error (any case); the message names the value
            and the allowed ones.
    """
    message = _bad_level_message()
    if message is not None:
        raise ValueError(message)


def init_logger(name: str) -> logging.Logger:
    """Return the logger ``name`` (a module's ``__name__`` under ``ucm``), setting up the ``ucm`` root once. A
    ``UC_LOGGER_LEVEL`` that is not a level is logged once as a warning and ``info`` is used (see the module doc)."""
    root = logging.getLogger("ucm")
    if not getattr(root, "_uc_configured", False):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_UCFormatter("[UC][%(uc_letter)s] %(message)s"))
        root.addHandler(handler)
        message = _bad_level_message()
        level = _LEVELS[_level_name()] if message is None else logging.INFO
        root.setLevel(level)
        root.propagate = False
        root._uc_configured = True  # type: ignore[attr-defined]
        if message is not None:
            root.warning("%s; using info", message)
    return logging.getLogger(name)
