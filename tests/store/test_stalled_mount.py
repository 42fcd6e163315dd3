"""The Posix stage on a hung mount, without an engine: a FUSE passthrough (``ucm.testing.fusefs``, its own process)
whose daemon is stopped with SIGSTOP, which blocks every access reaching it as a dead NFS server does.

- ``lookup`` with ``lookup_timeout_s``: a ``stat`` that blocks makes it a miss (0) past the bound, with one warning;
  later lookups are misses at once (no thread piles up behind the blocked one) until the daemon answers again, then
  the lookup answers again (logged). A name the kernel still has in its attribute cache is a hit meanwhile.
- The store tasks' bounded waits (``Task.result(timeout)``, ``Task.wait_shard(shard, timeout)``) raise / return False
  on a load whose ``open`` blocks, and the load completes correctly once the daemon resumes.

The engine-level deadline (``load_timeout_ms``) is in ``tests/faults/test_stalled_mount.py``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.store.blocks import make_blocks, make_keys
from ucm.store.posix import PosixStore
from ucm.testing import fusefs

pytestmark = pytest.mark.skipif(
    not os.path.exists("/dev/fuse"), reason="/dev/fuse is absent: no FUSE mount can be made"
)

NBYTES = 3 * 4096 + 52  # not a power of two
NUM_KEYS = 3
TIMEOUT_S = 0.5
MARGIN_S = 2.0


@pytest.fixture
def mounted(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """A FUSE passthrough over ``tmp_path/source`` at ``tmp_path/mnt`` (names cached by the kernel for the test's
    length); yields the mount point and the daemon's pid. Resumed and unmounted whatever the test did."""
    reason = fusefs.unavailable_reason()
    if reason is not None:
        pytest.fail(f"/dev/fuse exists but FUSE cannot be used: {reason} (make setup installs it)")
    source = tmp_path / "source"
    source.mkdir()
    with fusefs.mount(source, tmp_path / "mnt", attr_timeout_s=600) as daemon:
        yield tmp_path / "mnt", daemon.pid
    assert not os.path.ismount(tmp_path / "mnt")


def test_lookup_on_a_hung_mount_is_a_bounded_miss(mounted, close_after, ucm_lines):
    mnt, pid = mounted
    store = close_after(PosixStore(str(mnt), lookup_timeout_s=TIMEOUT_S))
    keys, other = make_keys(NUM_KEYS, seed=1), make_keys(1, seed=2)
    assert store.dump(keys, make_blocks(NUM_KEYS, NBYTES, seed=3)).result(10).ok
    assert store.lookup(keys) == NUM_KEYS  # the kernel now caches these names
    with fusefs.stopped(pid):
        assert store.lookup(keys) == NUM_KEYS  # answered from the kernel's cache, the daemon not asked
        t0 = time.monotonic()
        assert store.lookup(other) == 0  # a name never seen: the stat reaches the stopped daemon
        assert TIMEOUT_S <= time.monotonic() - t0 < TIMEOUT_S + MARGIN_S
        t0 = time.monotonic()
        assert store.lookup(keys) == 0  # the one stat thread is still blocked: a miss at once
        assert time.monotonic() - t0 < 0.1
        warnings = [ln for ln in ucm_lines if ln.startswith("WARNING") and "did not finish within" in ln]
        assert len(warnings) == 1 and "1 blocks" in warnings[0], ucm_lines
    deadline = time.monotonic() + 10
    while store.lookup(keys) != NUM_KEYS:  # the blocked stat returns, then lookups answer again
        assert time.monotonic() < deadline, ucm_lines
        time.sleep(0.05)
    assert any("lookups answer again" in ln for ln in ucm_lines)


def test_unbounded_lookup_without_timeout(mounted, close_after):
    """Without ``lookup_timeout_s`` the stat runs on the caller's thread (no helper thread)."""
    mnt, _pid = mounted
    store = close_after(PosixStore(str(mnt)))
    keys = make_keys(2, seed=4)
    assert store.lookup(keys) == 0
    assert store.dump(keys, make_blocks(2, NBYTES, seed=5)).result(10).ok
    assert store.lookup(keys) == 2


@pytest.mark.parametrize("bad", [0, -1.0])
def test_lookup_timeout_must_be_positive(tmp_path, bad):
    with pytest.raises(ValueError, match=f"lookup_timeout_s must be > 0.*got {bad}"):
        PosixStore(str(tmp_path), lookup_timeout_s=bad)


@pytest.mark.parametrize("sharded", [False, True], ids=["load", "load_sharded"])
def test_task_waits_are_bounded_on_a_hung_load(mounted, close_after, sharded):
    mnt, pid = mounted
    store = close_after(PosixStore(str(mnt)))
    keys = make_keys(NUM_KEYS, seed=6)
    blocks = make_blocks(NUM_KEYS, NBYTES * 4, seed=7)
    assert store.dump(keys, blocks).result(10).ok
    dst = torch.zeros_like(blocks)
    with fusefs.stopped(pid):
        task = store.load_sharded(keys, dst, 4) if sharded else store.load(keys, dst)
        t0 = time.monotonic()
        assert task.wait_shard(0, TIMEOUT_S) is False
        with pytest.raises(TimeoutError):
            task.result(TIMEOUT_S)
        assert 2 * TIMEOUT_S <= time.monotonic() - t0 < 2 * TIMEOUT_S + MARGIN_S
        assert not task.done()
    assert task.result(10).ok  # the late reads land in dst, whole and valid
    assert task.wait_shard(3, 0) is True
    assert torch.equal(dst, blocks)
