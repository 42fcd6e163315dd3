"""Fixtures shared by the store tests."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.store.helpers import STORE_MODE_PARAMS, Closer
from ucm.store.posix import PosixStore


@pytest.fixture(params=STORE_MODE_PARAMS)
def store(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[PosixStore]:
    """A store on a temp directory (ext4 here), for each engine and I/O mode."""
    io_engine, io_direct = request.param
    s = PosixStore(str(tmp_path / "kv"), io_direct=io_direct, io_engine=io_engine)
    yield s
    s.close()


@pytest.fixture
def close_after() -> Iterator[Closer]:
    """``close_after(store)``: the store, closed when the test ends, even when it fails (see :class:`Closer`)."""
    closer = Closer()
    yield closer
    closer.close_all()


@pytest.fixture
def ucm_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Capture UCM's log records (the ``ucm`` logger does not propagate to the root logger)."""
    ucm_logger = logging.getLogger("ucm")
    ucm_logger.addHandler(caplog.handler)
    caplog.set_level(logging.DEBUG, logger="ucm")
    yield caplog
    ucm_logger.removeHandler(caplog.handler)
