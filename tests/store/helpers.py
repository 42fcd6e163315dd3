"""Helpers of the store tests (plain constants and functions; the fixtures are in ``tests/store/conftest.py``)."""

from __future__ import annotations

import pytest

from tests.helpers import needs_aio
from ucm.store.posix_uring import aio_unusable_reason

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
