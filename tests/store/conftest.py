"""Fixtures shared by the store tests."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import needs_aio
from ucm.store.posix import PosixStore
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


@pytest.fixture(params=STORE_MODE_PARAMS)
def store(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[PosixStore]:
    """A store on a temp directory (ext4 here), for each engine and I/O mode."""
    io_engine, io_direct = request.param
    s = PosixStore(str(tmp_path / "kv"), io_direct=io_direct, io_engine=io_engine)
    yield s
    s.close()


@pytest.fixture
def ucm_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Capture UCM's log records (the ``ucm`` logger does not propagate to the root logger)."""
    ucm_logger = logging.getLogger("ucm")
    ucm_logger.addHandler(caplog.handler)
    caplog.set_level(logging.DEBUG, logger="ucm")
    yield caplog
    ucm_logger.removeHandler(caplog.handler)
