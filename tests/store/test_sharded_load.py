"""Sharded loads (``load_sharded``, the layerwise load's store verb) on real temp directories.

Checked: every engine and I/O mode returns the dumped bytes shard by shard; shard 0 is handed out while later
shards are still being read (the point of layerwise loading); validation still runs on the whole block, so a damaged
block is reported failed even after its shards were handed out; each row is settled (``on_row``) as soon as it is
validated, before the task completes; the Cache stage serves hits whole, reads misses through with the same progress
and caches each one as soon as it is validated, while other rows are still being read; stages without shard reads
(Compress) fall back to whole blocks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.store.blocks import make_blocks, make_keys, poisoned
from tests.store.helpers import Closer
from ucm.store.base import ShardProgress, TaskResult
from ucm.store.cache import CacheStore
from ucm.store.compress import CompressStore
from ucm.store.posix import HEADER_NBYTES, PosixStore
from ucm.store.posix import store as posix_module

SHARDS = 6
SHARD_NBYTES = 4099  # odd: shard ranges straddle O_DIRECT's 4 KiB units
NBYTES = SHARDS * SHARD_NBYTES


@pytest.fixture(autouse=True)
def one_shard_per_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Read shard by shard (the default groups small shards into 512 KiB reads: these shards would be one read)."""
    monkeypatch.setattr(posix_module, "SHARDED_READ_BYTES", 1)


def _shard(t: torch.Tensor, s: int) -> torch.Tensor:
    return t[:, s * SHARD_NBYTES : (s + 1) * SHARD_NBYTES]


class _HeldReads:
    """Holds the shard reads of a PosixStore for which ``hold(key, first, stop)`` is true until :meth:`release`
    (ordering control: a slow disk). Defaults to every read of shard >= 1."""

    def __init__(
        self,
        store: PosixStore,
        monkeypatch: pytest.MonkeyPatch,
        hold: Callable[[bytes, int, int], bool] = lambda key, first, stop: first >= 1,
    ) -> None:
        self.gate = threading.Event()
        real = store._load_shards

        def held(read, first, stop, shard_nbytes, progress):  # type: ignore[no-untyped-def]
            if hold(read.key, first, stop):
                self.gate.wait(30)
            return real(read, first, stop, shard_nbytes, progress)

        monkeypatch.setattr(store, "_load_shards", held)

    def release(self) -> None:
        self.gate.set()


def _held_last_shard(store: PosixStore, key: bytes, monkeypatch: pytest.MonkeyPatch) -> _HeldReads:
    """Holds the read of ``key``'s last shard (its row stays unsettled while the others finish; one I/O thread
    waits)."""
    return _HeldReads(store, monkeypatch, lambda k, first, stop: k == key and stop == SHARDS)


class _Rows:
    """An ``on_row`` hook that records ``(row, ok)`` and lets a test wait for a number of rows."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, bool]] = []
        self._cond = threading.Condition()

    def __call__(self, row: int, ok: bool) -> None:
        with self._cond:
            self.calls.append((row, ok))
            self._cond.notify_all()

    def wait_for(self, n: int) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.calls) >= n, timeout=30), self.calls


@pytest.mark.parametrize("read_bytes", [1, 3 * SHARD_NBYTES + 1, NBYTES], ids=["1", "4+2", "all"])
def test_round_trip_shard_by_shard(store: PosixStore, monkeypatch, read_bytes: int) -> None:
    """Shards read one per read, four then two per read (an uneven last run), and all six in one read."""
    monkeypatch.setattr(posix_module, "SHARDED_READ_BYTES", read_bytes)
    keys = make_keys(20, seed=1)
    src = make_blocks(20, NBYTES, seed=2)
    assert store.wait(store.dump(keys, src)).ok
    dst = poisoned(20, NBYTES)
    task = store.load_sharded(keys, dst, SHARDS)
    for s in range(SHARDS):
        task.wait_shard(s)
        assert torch.equal(_shard(dst, s), _shard(src, s)), s
    assert task.result() == TaskResult(20)
    assert torch.equal(dst, src)


def test_shard_zero_is_handed_out_while_later_shards_are_read(store: PosixStore, monkeypatch) -> None:
    keys = make_keys(4, seed=3)
    src = make_blocks(4, NBYTES, seed=4)
    assert store.wait(store.dump(keys, src)).ok
    held = _HeldReads(store, monkeypatch)
    dst = poisoned(4, NBYTES)
    task = store.load_sharded(keys, dst, SHARDS)
    task.wait_shard(0)
    assert torch.equal(_shard(dst, 0), _shard(src, 0))
    assert not task.done()  # shards 1.. are still held
    held.release()
    assert store.wait(task).ok and torch.equal(dst, src)


def test_damaged_block_fails_after_its_shards_were_handed_out(store: PosixStore) -> None:
    keys = make_keys(3, seed=5)
    src = make_blocks(3, NBYTES, seed=6)
    assert store.wait(store.dump(keys, src)).ok
    path = Path(store.block_path(keys[1]))
    data = bytearray(path.read_bytes())
    data[HEADER_NBYTES + NBYTES - 1] ^= 0x01  # last shard's last byte: only the whole-block checksum sees it
    path.write_bytes(bytes(data))
    dst = poisoned(3, NBYTES)
    task = store.load_sharded(keys, dst, SHARDS)
    for s in range(SHARDS):
        task.wait_shard(s)  # every shard is handed out, the damaged row's too
    assert task.result().failed == {1}
    assert torch.equal(dst[0], src[0]) and torch.equal(dst[2], src[2])
    assert not path.exists()  # removed as damaged, as a plain load does


def test_missing_and_truncated_blocks_fail_without_hanging(store: PosixStore) -> None:
    keys = make_keys(4, seed=7)
    src = make_blocks(4, NBYTES, seed=8)
    assert store.wait(store.dump(keys[:3], src[:3])).ok  # keys[3] never stored
    path = Path(store.block_path(keys[0]))
    path.write_bytes(path.read_bytes()[: HEADER_NBYTES + 2 * SHARD_NBYTES])  # shards 2.. gone
    dst = poisoned(4, NBYTES)
    assert store.wait(store.load_sharded(keys, dst, SHARDS)).failed == {0, 3}
    assert torch.equal(dst[1:3], src[1:3])


def test_bad_shard_arguments(store: PosixStore) -> None:
    keys = make_keys(1, seed=9)
    with pytest.raises(ValueError, match=r"num_shards must be an int >= 1 dividing the row size 24594 bytes, got 7"):
        store.load_sharded(keys, poisoned(1, NBYTES), 7)
    with pytest.raises(ValueError, match="got 0"):
        store.load_sharded(keys, poisoned(1, NBYTES), 0)
    store.wait(store.dump(keys, make_blocks(1, NBYTES, seed=10)))
    task = store.load_sharded(keys, poisoned(1, NBYTES), SHARDS)
    with pytest.raises(IndexError, match=r"shard 6 out of range \[0, 6\)"):
        task.wait_shard(SHARDS)
    assert store.wait(task).ok


def test_cache_serves_hits_whole_and_reads_misses_through(tmp_path: Path, monkeypatch, close_after: Closer) -> None:
    posix = PosixStore(str(tmp_path / "kv"))
    cache = close_after(CacheStore(posix, capacity_bytes=64 * NBYTES))
    keys = make_keys(6, seed=11)
    src = make_blocks(6, NBYTES, seed=12)
    assert posix.wait(posix.dump(keys, src)).ok  # on disk only
    assert cache.wait(cache.dump(keys[:2], src[:2])).ok  # rows 0, 1 also in DRAM
    held = _HeldReads(posix, monkeypatch)
    dst = poisoned(7, NBYTES)
    task = cache.load_sharded([*keys[:3], make_keys(1, seed=99)[0], *keys[3:]], dst, SHARDS)
    task.wait_shard(0)
    assert not task.done()
    assert torch.equal(dst[:2], src[:2])  # hits: whole rows at once
    assert torch.equal(_shard(dst[[2, 4, 5, 6]], 0), _shard(src[2:], 0))  # misses: shard 0 through from disk
    held.release()
    assert cache.wait(task).failed == {3}
    assert torch.equal(dst[[0, 1, 2, 4, 5, 6]], src)
    # The misses read from disk were promoted into DRAM (the absent key was not).
    assert set(cache.cached_keys()) == set(keys)


def test_cache_without_stage_below_fails_misses(tmp_path: Path, close_after: Closer) -> None:
    cache = close_after(CacheStore(None, capacity_bytes=8 * NBYTES))
    keys = make_keys(2, seed=13)
    src = make_blocks(1, NBYTES, seed=14)
    assert cache.wait(cache.dump(keys[:1], src)).ok
    dst = poisoned(2, NBYTES)
    task = cache.load_sharded(keys, dst, SHARDS)
    task.wait_shard(SHARDS - 1)
    assert task.result().failed == {1} and torch.equal(dst[0], src[0])


def test_stage_without_shard_reads_loads_whole_blocks(tmp_path: Path, close_after: Closer) -> None:
    """Compress decodes whole blocks: the base class's load_sharded serves them, every shard ready at the end."""
    store = close_after(CompressStore(PosixStore(str(tmp_path / "kv"))))
    keys = make_keys(3, seed=15)
    src = make_blocks(3, NBYTES, seed=16)
    assert store.wait(store.dump(keys, src)).ok
    dst = poisoned(3, NBYTES)
    task = store.load_sharded(keys, dst, SHARDS)
    task.wait_shard(0)
    assert task.done() and torch.equal(dst, src)
    # Reporting into a caller's progress (as a stage above does): every shard of its rows, once.
    progress = ShardProgress(SHARDS, 5)
    progress.done_all(2)  # the caller's own 2 rows
    task = store.load_sharded(keys, poisoned(3, NBYTES), SHARDS, progress)
    assert store.wait(task).ok
    assert all(progress.ready(s) for s in range(SHARDS))


def test_each_row_is_settled_as_soon_as_it_is_validated(store: PosixStore, monkeypatch) -> None:
    """on_row reports every row once, a row whose reads are done before the others' at once, all rows before the
    task completes, and a missing row as failed."""
    keys = make_keys(4, seed=17)
    src = make_blocks(4, NBYTES, seed=18)
    assert store.wait(store.dump(keys[:3], src[:3])).ok  # keys[3] never stored
    held = _held_last_shard(store, keys[2], monkeypatch)
    rows = _Rows()
    dst = poisoned(3, NBYTES)
    task = store.load_sharded(keys[:3], dst, SHARDS, on_row=rows)
    rows.wait_for(2)
    assert sorted(rows.calls) == [(0, True), (1, True)]
    assert not task.done()  # row 2 is still being read
    held.release()
    assert store.wait(task).ok
    assert sorted(rows.calls) == [(0, True), (1, True), (2, True)]
    assert torch.equal(dst, src[:3])
    rows = _Rows()
    assert store.wait(store.load_sharded(keys[1:], poisoned(3, NBYTES), SHARDS, on_row=rows)).failed == {2}
    assert sorted(rows.calls) == [(0, True), (1, True), (2, False)]


def test_a_raising_on_row_hook_does_not_hang_the_load(store: PosixStore) -> None:
    keys = make_keys(2, seed=19)
    src = make_blocks(2, NBYTES, seed=20)
    assert store.wait(store.dump(keys, src)).ok

    def broken(row: int, ok: bool) -> None:
        raise RuntimeError("a bug in the caller's hook")

    dst = poisoned(2, NBYTES)
    assert store.wait(store.load_sharded(keys, dst, SHARDS, on_row=broken)).ok
    assert torch.equal(dst, src)


def test_cache_caches_each_miss_as_soon_as_it_is_validated(tmp_path: Path, monkeypatch, close_after: Closer) -> None:
    """Read-through promotion runs row by row, while the stage below still reads the other rows, not all at the
    end; hits are settled before load_sharded returns."""
    posix = PosixStore(str(tmp_path / "kv"))
    cache = close_after(CacheStore(posix, capacity_bytes=64 * NBYTES))
    keys = make_keys(4, seed=21)
    src = make_blocks(4, NBYTES, seed=22)
    assert posix.wait(posix.dump(keys, src)).ok
    assert cache.wait(cache.dump(keys[:1], src[:1])).ok  # row 0 is a DRAM hit
    held = _held_last_shard(posix, keys[3], monkeypatch)
    rows = _Rows()
    dst = poisoned(4, NBYTES)
    task = cache.load_sharded(keys, dst, SHARDS, on_row=rows)
    assert rows.calls[:1] == [(0, True)]
    rows.wait_for(3)
    assert not task.done()
    assert set(cache.cached_keys()) == set(keys[:3])  # rows 1 and 2 promoted while row 3 is still being read
    held.release()
    assert cache.wait(task).ok
    assert sorted(rows.calls) == [(i, True) for i in range(4)]
    assert set(cache.cached_keys()) == set(keys)
    out = poisoned(4, NBYTES)
    assert cache.wait(cache.load(keys, out)).ok and torch.equal(out, src)  # the promoted copies are the blocks


def test_stage_without_shard_reads_settles_rows_at_the_end(tmp_path: Path, close_after: Closer) -> None:
    store = close_after(CompressStore(PosixStore(str(tmp_path / "kv"))))
    keys = make_keys(3, seed=23)
    src = make_blocks(3, NBYTES, seed=24)
    assert store.wait(store.dump(keys[:2], src[:2])).ok
    rows = _Rows()
    assert store.wait(store.load_sharded(keys, poisoned(3, NBYTES), SHARDS, on_row=rows)).failed == {2}
    assert sorted(rows.calls) == [(0, True), (1, True), (2, False)]
