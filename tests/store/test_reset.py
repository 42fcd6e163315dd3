"""Emptying the stores for a cache reset: ``drop_cached`` (the ``Cache`` stage's DRAM tier) and ``remove_stored``
(block files, by key or by model namespace), also while loads and dumps are in flight.

Races are made deterministic with injected barriers (a copy held on an event, a read from below whose completion
the test releases), never with sleeps. What a reset must never do: hand a load bytes other than the block's, or cache
a block read or copied in before the reset after it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

import ucm.store.cache as cache_module
from tests.store.blocks import make_blocks, make_keys, poisoned
from tests.store.helpers import Closer, DictStore
from ucm.config import SUPPORTED_PIPELINES, UcmPipelineStoreConfig
from ucm.store.base import Task, TaskResult, UcmKVStoreBase, check_keys_and_buffer
from ucm.store.cache import CacheStore
from ucm.store.pipeline import build_store
from ucm.store.posix import PosixStore

NBYTES = 256
NAMESPACE_A = bytes(range(1, 17))
NAMESPACE_B = bytes(range(101, 117))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _block_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.ucmb") if not p.name.startswith("."))


class HeldLoadStore(DictStore):
    """Stage below whose loads complete when the test calls :meth:`finish` (a slow read, held deterministically)."""

    def __init__(self, blocks: dict[bytes, torch.Tensor]) -> None:
        super().__init__()
        self.blocks = blocks
        self.held: list[tuple[list[bytes], torch.Tensor, Future[TaskResult]]] = []

    def load(self, keys: Sequence[bytes], dst: torch.Tensor) -> Task:
        check_keys_and_buffer(keys, dst, "dst")
        future: Future[TaskResult] = Future()
        self.held.append((list(keys), dst, future))
        return Task(future)

    def finish(self) -> None:
        """Complete every held load: copy the blocks in, then resolve the tasks."""
        for keys, dst, future in self.held:
            for i, key in enumerate(keys):
                dst[i].copy_(self.blocks[key])
            future.set_result(TaskResult(len(keys)))
        self.held = []


# ------------------------------------------------------------------------------------------------ drop_cached
def test_drop_cached_empties_dram_and_storage_still_serves(tmp_path: Path, close_after: Closer) -> None:
    cache = close_after(CacheStore(PosixStore(str(tmp_path / "kv")), capacity_bytes=10 * NBYTES))
    keys, blocks = make_keys(3, seed=1), make_blocks(3, NBYTES, seed=1)
    assert cache.wait(cache.dump(keys, blocks)).ok
    assert cache.cached_keys() == keys
    assert cache.drop_cached() == 3
    assert cache.cached_keys() == [] and cache.used_bytes == 0
    assert cache.slot_bytes == 3 * NBYTES  # the slots stay allocated, free for the blocks to come
    assert cache.lookup(keys) == 3  # the files are still there
    dst = poisoned(3, NBYTES)
    assert cache.wait(cache.load(keys, dst)).ok
    assert _same(dst, blocks)
    cache.flush()
    assert cache.cached_keys() == keys  # read through into DRAM again
    assert cache.drop_cached() == 3


def test_drop_cached_without_a_stage_below_loses_the_blocks(close_after: Closer) -> None:
    cache = close_after(CacheStore(None, capacity_bytes=10 * NBYTES))
    keys = make_keys(2, seed=2)
    assert cache.wait(cache.dump(keys, make_blocks(2, NBYTES, seed=2))).ok
    assert cache.drop_cached() == 2
    assert cache.drop_cached() == 0
    assert cache.lookup(keys) == 0
    assert cache.wait(cache.load(keys, poisoned(2, NBYTES))).failed == {0, 1}


def test_block_being_read_out_at_the_drop_keeps_its_bytes(close_after: Closer, monkeypatch) -> None:
    """A load copying a DRAM hit out when the tier is emptied: the slot it copies from is not handed to the next
    block (a full cache would otherwise reuse it at once), so the load still gets the block's own bytes."""
    cache = close_after(CacheStore(None, capacity_bytes=2 * NBYTES))  # room for 2 blocks only
    keys, blocks = make_keys(4, seed=3), make_blocks(4, NBYTES, seed=3)
    assert cache.wait(cache.dump(keys[:2], blocks[:2])).ok
    copying, resume = threading.Event(), threading.Event()
    real_copy = cache_module._copy_row

    def held_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        if threading.current_thread().name == "reader":
            copying.set()
            assert resume.wait(10)
        real_copy(dst, src)

    monkeypatch.setattr(cache_module, "_copy_row", held_copy)
    dst = poisoned(1, NBYTES)
    results: list[TaskResult] = []
    reader = threading.Thread(target=lambda: results.append(cache.wait(cache.load(keys[:1], dst))), name="reader")
    reader.start()
    assert copying.wait(10)  # the hit is pinned, its copy under way
    assert cache.drop_cached() == 2
    assert cache.wait(cache.dump(keys[2:], blocks[2:])).ok  # two new blocks: none may take the pinned slot
    resume.set()
    reader.join(10)
    assert results and results[0].ok
    assert _same(dst[0], blocks[0])
    got = poisoned(2, NBYTES)
    assert cache.wait(cache.load(keys[2:], got)).ok and _same(got, blocks[2:])


def test_read_from_below_started_before_the_drop_is_not_cached(close_after: Closer) -> None:
    keys, blocks = make_keys(2, seed=4), make_blocks(2, NBYTES, seed=4)
    below = HeldLoadStore({k: blocks[i].clone() for i, k in enumerate(keys)})
    cache = close_after(CacheStore(below, capacity_bytes=10 * NBYTES))
    dst = poisoned(1, NBYTES)
    task = cache.load(keys[:1], dst)  # a miss: read from below, held
    assert cache.drop_cached() == 0
    below.finish()
    assert cache.wait(task).ok and _same(dst[0], blocks[0])  # the load itself is served
    cache.flush()
    assert cache.cached_keys() == []  # but not cached after the reset
    task = cache.load(keys[1:], poisoned(1, NBYTES))  # a read started after it is
    below.finish()
    assert cache.wait(task).ok
    cache.flush()
    assert cache.cached_keys() == keys[1:]


def test_read_from_below_of_a_sharded_load_before_the_drop_is_not_cached(
    tmp_path: Path, close_after: Closer, monkeypatch
) -> None:
    posix = PosixStore(str(tmp_path / "kv"))
    keys, blocks = make_keys(2, seed=5), make_blocks(2, NBYTES, seed=5)
    assert posix.wait(posix.dump(keys, blocks)).ok
    cache = close_after(CacheStore(posix, capacity_bytes=10 * NBYTES))
    dropped: list[int] = []
    real_insert = cache._insert_copy

    def insert_after_a_reset(key: bytes, row: torch.Tensor, generation: int) -> None:
        # The reset lands between the read's start and the promotion of its rows (on the I/O threads).
        dropped.append(cache.drop_cached())
        real_insert(key, row, generation)

    monkeypatch.setattr(cache, "_insert_copy", insert_after_a_reset)
    dst = poisoned(2, NBYTES)
    assert cache.wait(cache.load_sharded(keys, dst, num_shards=4)).ok and _same(dst, blocks)
    assert dropped == [0, 0]
    assert cache.cached_keys() == []


def test_dump_copying_in_at_the_drop_is_written_back_not_cached(close_after: Closer, monkeypatch) -> None:
    below = HeldLoadStore({})
    cache = close_after(CacheStore(below, capacity_bytes=10 * NBYTES))
    keys, blocks = make_keys(2, seed=6), make_blocks(2, NBYTES, seed=6)
    copying, resume = threading.Event(), threading.Event()
    real_copy = cache_module._copy_row

    def held_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        if threading.current_thread().name == "dumper":
            copying.set()
            assert resume.wait(10)
        real_copy(dst, src)

    monkeypatch.setattr(cache_module, "_copy_row", held_copy)
    results: list[TaskResult] = []
    dumper = threading.Thread(target=lambda: results.append(cache.wait(cache.dump(keys, blocks))), name="dumper")
    dumper.start()
    assert copying.wait(10)
    assert cache.drop_cached() == 0
    resume.set()
    dumper.join(10)
    assert results and results[0].ok  # stored: below
    assert cache.cached_keys() == []  # not in DRAM after the reset
    assert all(_same(below.blocks[k], blocks[i]) for i, k in enumerate(keys))


# ---------------------------------------------------------------------------------------------- remove_stored
def _dump_tagged(store: UcmKVStoreBase, namespace: bytes, keys: list[bytes], blocks: torch.Tensor) -> None:
    store.set_namespace(namespace, {"model": namespace.hex()})
    assert store.wait(store.dump(keys, blocks)).ok
    store.flush()


def test_remove_stored_by_namespace_keeps_other_files(tmp_path: Path, close_after: Closer) -> None:
    dirs = [tmp_path / "a", tmp_path / "b"]
    store = close_after(PosixStore(":".join(map(str, dirs))))
    mine, theirs = make_keys(5, seed=7), make_keys(3, seed=8)
    _dump_tagged(store, NAMESPACE_A, mine, make_blocks(5, NBYTES, seed=7))
    _dump_tagged(store, NAMESPACE_B, theirs, make_blocks(3, NBYTES, seed=8))
    untagged = tmp_path / "a" / "untouched.txt"
    untagged.write_text("not a block")
    removal = store.remove_stored(namespace=NAMESPACE_A)
    assert (removal.blocks, removal.errors) == (5, [])
    assert removal.nbytes == 5 * Path(store.block_path(theirs[0])).stat().st_size  # blocks of one size
    assert store.lookup(mine[:1]) == 0 and store.lookup(theirs) == 3
    assert len(_block_files(tmp_path)) == 3
    assert untagged.exists() and (tmp_path / "a" / "namespaces").is_dir()
    assert store.remove_stored(namespace=NAMESPACE_A).blocks == 0


def test_remove_stored_by_keys(tmp_path: Path, close_after: Closer) -> None:
    store = close_after(PosixStore(str(tmp_path / "kv")))
    keys = make_keys(4, seed=9)
    _dump_tagged(store, NAMESPACE_A, keys, make_blocks(4, NBYTES, seed=9))
    absent = make_keys(1, seed=10)
    removal = store.remove_stored(keys=[keys[1], keys[3], *absent])  # an absent key is not an error
    assert (removal.blocks, removal.errors) == (2, [])
    assert [store.lookup([k]) for k in keys] == [1, 0, 1, 0]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({}, ValueError, "exactly one of keys= (the blocks to delete) or namespace="),
        ({"keys": [], "namespace": NAMESPACE_A}, ValueError, "exactly one of keys="),
        ({"namespace": b"abc"}, ValueError, "namespace digest must have at least 4 bytes, got 3"),
        ({"namespace": "abcd"}, TypeError, "namespace must be bytes (a namespace digest), got str"),
        ({"keys": [b"short"]}, ValueError, "block keys must be 16 bytes, got 5"),
    ],
    ids=["neither", "both", "short-namespace", "str-namespace", "short-key"],
)
def test_remove_stored_arguments_are_checked(
    tmp_path: Path, close_after: Closer, kwargs: dict, error: type[Exception], message: str
) -> None:
    for store in (close_after(PosixStore(str(tmp_path / "kv"))), close_after(CacheStore(None, NBYTES))):
        with pytest.raises(error) as info:
            store.remove_stored(**kwargs)
        assert message in str(info.value)


# Pipelines with a Mooncake stage need a master: tests/store/mooncake_cases.py (case pipelines_from_config).
@pytest.mark.parametrize("pipeline", [p for p in SUPPORTED_PIPELINES if "Mooncake" not in p])
def test_every_pipeline_passes_the_reset_down(tmp_path: Path, close_after: Closer, pipeline: str) -> None:
    config = UcmPipelineStoreConfig.model_validate({"store_pipeline": pipeline, "storage_backends": str(tmp_path)})
    store = close_after(build_store(config))
    keys = make_keys(3, seed=11)
    _dump_tagged(store, NAMESPACE_A, keys, make_blocks(3, NBYTES, seed=11))
    assert store.drop_cached() == (3 if pipeline.startswith("Cache") else 0)
    assert store.lookup(keys) == 3
    assert store.remove_stored(namespace=NAMESPACE_A).blocks == 3
    assert store.lookup(keys) == 0 and _block_files(tmp_path) == []
