"""Helpers of the store tests (plain constants and functions; the fixtures are in ``tests/store/conftest.py``)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TypeVar

import pytest
import torch

from tests.helpers import needs_aio
from ucm.store.base import Task, TaskResult, UcmKVStoreBase, check_keys_and_buffer
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


class DictStore(UcmKVStoreBase):
    """Fault-injection stage below: blocks in a dict; ``dump`` blocks until ``release`` is set."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, torch.Tensor] = {}
        self.release = threading.Event()
        self.release.set()
        self.dump_started = threading.Event()
        self.dumped: list[bytes] = []
        self.closed = False

    def lookup(self, keys: Sequence[bytes]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.blocks:
            n += 1
        return n

    def load(self, keys: Sequence[bytes], dst: torch.Tensor) -> Task:
        check_keys_and_buffer(keys, dst, "dst")
        failed = set()
        for i, key in enumerate(keys):
            if key in self.blocks and self.blocks[key].numel() == dst.shape[1]:
                dst[i].copy_(self.blocks[key])
            else:
                failed.add(i)
        return Task.completed(TaskResult(len(keys), frozenset(failed)))

    def dump(self, keys: Sequence[bytes], src: torch.Tensor) -> Task:
        check_keys_and_buffer(keys, src, "src")
        self.dump_started.set()
        assert self.release.wait(timeout=10), "test did not release the blocked dump"
        for i, key in enumerate(keys):
            self.blocks[key] = src[i].clone()
            self.dumped.append(key)
        return Task.completed(TaskResult(len(keys)))

    def close(self) -> None:
        self.closed = True
