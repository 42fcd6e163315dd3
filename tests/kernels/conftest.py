"""Fixtures for the KV kernel tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_cpu_thread() -> Iterator[None]:
    """Run these small copies on one thread: on a loaded machine, torch's OpenMP workers spin-wait and a
    millisecond copy takes most of a second."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
