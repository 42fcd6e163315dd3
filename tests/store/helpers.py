"""Helpers of the store tests (plain constants and functions; the fixtures are in ``tests/store/conftest.py``)."""

from __future__ import annotations

from typing import TypeVar

import pytest

from tests.helpers import needs_aio
from ucm.store.base import UcmKVStoreBase
from ucm.store.posix import aio_unusable_reason

S = TypeVar("S", bound=UcmKVStoreBase)

STORE_MODES = [("psync", False), ("psync", True), ("aio", False), ("aio", True)]
STORE_MODE_IDS = ["psync-buffered", "psync-direct", "aio-buffered", "aio-direct"]
# The modes as fixture parameters: the aio ones marked needs_aio.
STORE_MODE_PARAMS = [
    pytest.param(mode, id=name, marks=needs_aio if mode[0] == "aio" else ())
    for mode, name in zip(STORE_MODES, STORE_MODE_IDS, strict=True)
]


def usable_store_modes() -> list[tuple[str, bool]]:
    """The modes that can start on this machine (every one, or the psync ones where aio cannot start)."""
    return [mode for mode in STORE_MODES if mode[0] == "psync" or aio_unusable_reason() is None]


class Closer:
    """What the ``close_after`` fixture hands a test: ``close_after(store)`` returns ``store`` and closes it when the
    test ends, passed or failed, latest opened first (stores close idempotently, so a test may still close one
    itself, e.g. to check what ``close`` does)."""

    def __init__(self) -> None:
        self.opened: list[UcmKVStoreBase] = []

    def __call__(self, store: S) -> S:
        self.opened.append(store)
        return store

    def close_all(self) -> None:
        """Close every store handed to this closer, latest first; all are closed even if one ``close`` raises."""
        errors: list[BaseException] = []
        while self.opened:
            try:
                self.opened.pop().close()
            except BaseException as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
