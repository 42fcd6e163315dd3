"""Observations recorded by the real store stages (real files in a temp directory): what each tier reports for
dumps, DRAM hits, storage hits after a restart, missing and damaged blocks, evictions and KVfold dumps, and the
request ids carried into background write-backs."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.store.blocks import make_blocks, make_keys
from ucm.store.base import UcmKVStoreBase
from ucm.store.cache import CacheStore
from ucm.store.compress import CompressStore
from ucm.store.observe import Observation, Recorder, current_requests, requests_of
from ucm.store.posix import PosixStore

NBYTES = 4096 + 64  # not a power of two
NUM_BLOCKS = 5


def _recorded(store: UcmKVStoreBase) -> list[Observation]:
    seen: list[Observation] = []
    recorder = Recorder()
    recorder.add_sink(seen.append)
    store.set_recorder(recorder)
    return seen


def _fields(o: Observation) -> tuple[int, int, int, tuple[str, ...]]:
    return o.blocks, o.ok, o.nbytes, o.requests


def _only(seen: list[Observation], op: str, tier: str) -> list[Observation]:
    return [o for o in seen if o.op == op and o.tier == tier]


def test_requests_context() -> None:
    assert current_requests() == ()
    with requests_of(["a", "b", "a"]):
        assert current_requests() == ("a", "b")
        with requests_of(["c"]):
            assert current_requests() == ("c",)
        assert current_requests() == ("a", "b")
    assert current_requests() == ()


def test_cache_posix_dump_hit_restart_and_failures(tmp_path: Path) -> None:
    keys = make_keys(NUM_BLOCKS, seed=1)
    src = make_blocks(NUM_BLOCKS, NBYTES, seed=2)
    store = CacheStore(PosixStore(str(tmp_path / "kv")), capacity_bytes=64 * NBYTES)
    seen = _recorded(store)
    try:
        with requests_of(["cold"]):
            task = store.dump(keys, src)
        assert store.wait(task).ok
        store.flush()
        (dram,) = _only(seen, "dump", "dram")
        assert (dram.blocks, dram.ok, dram.nbytes, dram.requests) == (
            NUM_BLOCKS,
            NUM_BLOCKS,
            NUM_BLOCKS * NBYTES,
            ("cold",),
        )
        (disk,) = _only(seen, "dump", "storage")  # the background write-back names the dump's request
        assert (disk.blocks, disk.ok, disk.nbytes, disk.requests) == (
            NUM_BLOCKS,
            NUM_BLOCKS,
            NUM_BLOCKS * NBYTES,
            ("cold",),
        )
        assert disk.seconds > 0

        seen.clear()
        dst = torch.empty_like(src)
        with requests_of(["warm"]):
            assert store.wait(store.load(keys, dst)).ok
        assert torch.equal(dst, src)
        (hit,) = _only(seen, "load", "dram")
        assert (hit.blocks, hit.ok, hit.nbytes, hit.requests) == (
            NUM_BLOCKS,
            NUM_BLOCKS,
            NUM_BLOCKS * NBYTES,
            ("warm",),
        )
        assert not _only(seen, "load", "storage")
        gauges = store.gauges()
        assert gauges["dram:used_bytes"] == NUM_BLOCKS * NBYTES
        assert gauges["dram:capacity_bytes"] == 64 * NBYTES
        assert gauges["storage:used_bytes"] >= NUM_BLOCKS * NBYTES  # block files with their headers
    finally:
        store.close()

    # A restart: an empty DRAM tier over the same files; one block damaged, one removed.
    restarted = CacheStore(PosixStore(str(tmp_path / "kv")), capacity_bytes=64 * NBYTES)
    seen = _recorded(restarted)
    inner = restarted._inner
    assert isinstance(inner, PosixStore)
    damaged, missing = Path(inner.block_path(keys[1])), Path(inner.block_path(keys[3]))
    raw = bytearray(damaged.read_bytes())
    raw[-1] ^= 0xFF
    damaged.write_bytes(bytes(raw))
    missing.unlink()
    try:
        dst = torch.empty_like(src)
        with requests_of(["restart"]):
            result = restarted.wait(restarted.load(keys, dst))
        assert result.failed == {1, 3}
        (dram,) = _only(seen, "load", "dram")
        assert (dram.blocks, dram.ok) == (NUM_BLOCKS, 0)
        storage = _only(seen, "load", "storage")  # one call per DRAM miss
        assert sum(o.blocks for o in storage) == NUM_BLOCKS and sum(o.ok for o in storage) == NUM_BLOCKS - 2
        assert sum(o.nbytes for o in storage) == (NUM_BLOCKS - 2) * NBYTES
        assert all(o.requests == ("restart",) for o in storage)
        failures = {o.cause: o.key for o in _only(seen, "load_failure", "storage")}
        assert failures == {"damaged": keys[1].hex(), "missing": keys[3].hex()}
    finally:
        restarted.close()


def test_evictions_are_counted(tmp_path: Path) -> None:
    keys = make_keys(4, seed=3)
    src = make_blocks(4, NBYTES, seed=4)
    store = CacheStore(PosixStore(str(tmp_path / "kv")), capacity_bytes=2 * NBYTES)
    _recorded(store)
    try:
        for part in (slice(0, 2), slice(2, 4)):
            assert store.wait(store.dump(keys[part], src[part])).ok
            store.flush()
        gauges = store.gauges()
        assert gauges["dram:evicted_blocks_total"] == 2
        assert gauges["dram:evicted_bytes_total"] == 2 * NBYTES
        assert gauges["dram:used_bytes"] == 2 * NBYTES
    finally:
        store.close()


def test_compress_dump_and_load(tmp_path: Path) -> None:
    keys = make_keys(3, seed=5)
    src = (torch.randn(3, NBYTES // 2, generator=torch.Generator().manual_seed(6)) * 0.1).to(torch.bfloat16)
    rows = src.view(torch.uint8)
    store = CompressStore(PosixStore(str(tmp_path / "kv")), mode="lossless")
    seen = _recorded(store)
    try:
        with requests_of(["r"]):
            assert store.wait(store.dump(keys, rows)).ok
        (dump,) = _only(seen, "dump", "compress")
        assert (dump.blocks, dump.ok, dump.nbytes, dump.requests) == (3, 3, 3 * NBYTES, ("r",))
        assert 0 < dump.stored_nbytes < dump.nbytes  # KVfold shrinks bf16 values
        (disk,) = _only(seen, "dump", "storage")
        assert disk.nbytes == dump.stored_nbytes and disk.requests == ("r",)
        dst = torch.empty_like(rows)
        assert store.wait(store.load(keys, dst)).ok
        assert torch.equal(dst, rows)
        (load,) = _only(seen, "load", "compress")
        assert (load.ok, load.nbytes, load.stored_nbytes) == (3, 3 * NBYTES, dump.stored_nbytes)
        (read,) = _only(seen, "load", "storage")
        assert (read.ok, read.nbytes) == (3, dump.stored_nbytes)
    finally:
        store.close()


def test_no_recorder_records_nothing(tmp_path: Path) -> None:
    store = CacheStore(PosixStore(str(tmp_path / "kv")), capacity_bytes=8 * NBYTES)
    try:
        keys, src = make_keys(2, seed=7), make_blocks(2, NBYTES, seed=8)
        assert store.wait(store.dump(keys, src)).ok  # no recorder: nothing to check but that it works
    finally:
        store.close()


def test_layerwise_load_is_observed(tmp_path: Path) -> None:
    """A sharded (layerwise) load: DRAM hits and the misses read shard by shard from storage are both recorded."""
    keys = make_keys(4, seed=9)
    src = make_blocks(4, NBYTES, seed=10)
    writer = PosixStore(str(tmp_path / "kv"))
    try:
        assert writer.wait(writer.dump(keys[2:], src[2:])).ok  # on storage only
    finally:
        writer.close()
    store = CacheStore(PosixStore(str(tmp_path / "kv")), capacity_bytes=64 * NBYTES)
    seen = _recorded(store)
    try:
        assert store.wait(store.dump(keys[:2], src[:2])).ok  # in DRAM too
        store.flush()
        seen.clear()
        dst = torch.empty_like(src)
        with requests_of(["layerwise"]):
            task = store.load_sharded(keys, dst, num_shards=4)
        assert store.wait(task).ok and torch.equal(dst, src)
        (dram,) = _only(seen, "load", "dram")
        assert _fields(dram) == (4, 2, 2 * NBYTES, ("layerwise",))
        (disk,) = _only(seen, "load", "storage")
        assert _fields(disk) == (2, 2, 2 * NBYTES, ("layerwise",))
    finally:
        store.close()
