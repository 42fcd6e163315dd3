"""Capacity: ``posix_capacity_gb`` garbage-collects least recently used blocks while serving (hits refresh recency),
safely under concurrent readers and several instances sharing the directory."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.faults.helpers import block_files, block_path, run_ucm
from tests.helpers import assert_same_output
from tests.store.blocks import make_blocks, make_keys, poisoned
from ucm.store.posix import HEADER_NBYTES, PosixStore

BLOCK_FILE_NBYTES = 131072 + HEADER_NBYTES  # the tiny model's block: 2 layers x K,V x 128 x 2 heads x 32 x fp32


@pytest.mark.engine
def test_engine_keeps_the_store_within_capacity_lru_first(tiny_model, fault_prompts, baseline, filled_store, tmp_path):
    """Capacity of 8 blocks; prompts p0 p1 p2, p0 again (a hit: refreshes its blocks), p3, p4 (12 blocks written).
    The store ends within capacity, p1 (never hit) is gone and p0 (hit after p1 was written) is kept."""
    keys = filled_store[1]
    store = tmp_path / "store"
    capacity = 8 * BLOCK_FILE_NBYTES
    order = [0, 1, 2, 0, 3, 4]
    results, stderr = run_ucm(
        tiny_model,
        store,
        [fault_prompts[i] for i in order],
        store_pipeline="Posix",
        posix_capacity_gb=capacity / 2**30,
    )
    for got, i in zip(results, order, strict=True):
        assert_same_output(got, baseline[i])
    assert results[3].hit_external == 2
    files = block_files(store)
    assert sum(f.stat().st_size for f in files) <= capacity
    assert len(files) >= 6
    assert not any(block_path(store, k).exists() for k in keys[1])
    assert all(block_path(store, k).exists() for k in keys[0])
    assert all(block_path(store, k).exists() for k in keys[4])
    assert [ln for ln in stderr.splitlines() if "over the capacity" in ln]


def test_collection_under_concurrent_readers_and_two_instances(tmp_path):
    """Two store instances on one directory, each with a capacity of 20 blocks, write 120 blocks while readers
    load random earlier blocks: every load returns the exact bytes or a miss, never other bytes, and the stopped
    stores leave the directory within capacity."""
    nbytes = 4096
    capacity = 20 * (nbytes + HEADER_NBYTES)
    keys = make_keys(120, seed=80)
    data = make_blocks(120, nbytes, seed=81)
    stores = [PosixStore(str(tmp_path), capacity_bytes=capacity, gc_interval_s=0.05) for _ in range(2)]
    done = threading.Event()
    wrong: list[int] = []
    hits = [0]

    def write(store: PosixStore, start: int) -> None:
        for i in range(start, len(keys), 2):
            store.wait(store.dump([keys[i]], data[i : i + 1]))

    def read(store: PosixStore, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        while not done.is_set():
            i = int(torch.randint(0, len(keys), (1,), generator=gen))
            dst = poisoned(1, nbytes)
            if store.wait(store.load([keys[i]], dst)).ok:
                hits[0] += 1
                if not torch.equal(dst, data[i : i + 1]):
                    wrong.append(i)

    readers = [threading.Thread(target=read, args=(s, n)) for n, s in enumerate(stores)]
    writers = [threading.Thread(target=write, args=(s, n)) for n, s in enumerate(stores)]
    for t in readers + writers:
        t.start()
    for t in writers:
        t.join()
    done.set()
    for t in readers:
        t.join()
    for s in stores:
        s.close()
    assert not wrong
    assert hits[0] > 0
    files = block_files(tmp_path)
    assert sum(f.stat().st_size for f in files) <= capacity
    assert files, "collection removed everything"
