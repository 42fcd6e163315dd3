"""Residency of block keys (what each tier starts and stops holding) as the real store stages record it, and its
translation into vLLM's KV events for real vLLM requests (``ucm.integration.vllm.events``). The events on a real
server's ZMQ stream: ``test_serve_kv_events.py``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash
from vllm.v1.request import Request

from tests.store.blocks import make_blocks, make_keys
from ucm.integration.vllm.events import KVEventTranslator, ResidencyBuffer
from ucm.integration.vllm.metadata import UCMWorkerMetadata
from ucm.store.cache import CacheStore
from ucm.store.observe import Recorder, Residency
from ucm.store.posix import PosixStore

NBYTES = 4096
BLOCK_SIZE = 16


def recording(store: CacheStore | PosixStore) -> list[Residency]:
    """Give ``store`` a recorder with a key sink; the list it fills."""
    seen: list[Residency] = []
    recorder = Recorder()
    recorder.add_key_sink(seen.append)
    store.set_recorder(recorder)
    return seen


def changes(seen: list[Residency]) -> list[tuple[bool, str, set[bytes]]]:
    out = [(r.stored, r.tier, set(r.keys)) for r in seen]
    seen.clear()
    return out


def test_cache_and_posix_record_what_each_tier_holds(tmp_path: Path) -> None:
    posix = PosixStore(str(tmp_path / "store"), io_threads=2)
    cache = CacheStore(posix, capacity_bytes=2 * NBYTES)
    try:
        seen = recording(cache)
        k = make_keys(3, seed=1)
        cache.wait(cache.dump(k, make_blocks(3, NBYTES, seed=1)))
        got = changes(seen)
        # The DRAM tier keeps the first two (the third does not fit while they are written back); storage all three.
        assert (True, "dram", {k[0], k[1]}) in got
        assert {key for stored, tier, keys in got if stored and tier == "storage" for key in keys} == set(k)
        assert not [c for c in got if not c[0]]

        cache.wait(cache.load([k[2]], make_blocks(1, NBYTES, seed=9)))  # a storage hit, promoted: evicts k[0]
        cache.flush()
        assert changes(seen) == [(False, "dram", {k[0]}), (True, "dram", {k[2]})]

        assert cache.drop_cached() == 2
        assert changes(seen) == [(False, "dram", {k[1], k[2]})]

        path = posix.block_path(k[0])
        with open(path, "r+b") as f:  # damage the payload: the load finds it, removes the file
            f.seek(os.path.getsize(path) - 1)
            f.write(b"\xff" if f.read(1) != b"\xff" else b"\x00")
        result = cache.wait(cache.load([k[0]], make_blocks(1, NBYTES, seed=9)))
        assert result.failed == {0}
        assert (False, "storage", {k[0]}) in changes(seen)

        cache.remove_stored(keys=[k[1]])
        assert changes(seen) == [(False, "storage", {k[1]})]
    finally:
        cache.close()


def test_garbage_collection_records_the_deleted_blocks(tmp_path: Path) -> None:
    posix = PosixStore(str(tmp_path / "store"), io_threads=2, capacity_bytes=3 * NBYTES)
    seen = recording(posix)
    k = make_keys(6, seed=2)
    try:
        posix.wait(posix.dump(k, make_blocks(6, NBYTES, seed=2)))
        assert posix.collect_garbage().block_bytes > 0  # the maintenance thread may collect too, meanwhile
    finally:
        posix.close()  # stops that thread
    got = changes(seen)
    assert (True, "storage", set(k)) in got
    deleted = {key for stored, tier, keys in got if not stored and tier == "storage" for key in keys}
    assert deleted and deleted == {key for key in k if not os.path.exists(posix.block_path(key))}


def test_stages_skip_keys_without_a_key_sink(tmp_path: Path) -> None:
    recorder = Recorder()
    assert not recorder.tracks_keys
    recorder.record_keys(True, "dram", make_keys(1, seed=3))  # no sink: nothing to do, no error


def request(tokens: list[int], rid: str = "r") -> Request:
    """A real vLLM request with vLLM's block hashes at ``BLOCK_SIZE``."""
    init_none_hash(sha256)
    return Request(
        rid,
        tokens,
        SamplingParams(max_tokens=1),
        None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )


def test_translator_names_blocks_by_vllms_hashes() -> None:
    req = request(list(range(3 * BLOCK_SIZE + 5)))
    keys = make_keys(3, seed=4)
    translator = KVEventTranslator(BLOCK_SIZE)
    translator.note_blocks(req, 0, keys[:2])
    translator.note_blocks(req, 2, keys[2:])
    hashes = [maybe_convert_block_hash(h) for h in req.block_hashes]

    other = make_keys(1, seed=5)  # a key this instance never loaded or dumped: not published
    translator.add_tier_events([(True, "dram", keys), (True, "storage", keys[:1] + other)])
    events = translator.take_events()
    assert [(e.medium, e.block_hashes) for e in events] == [("CPU", [h]) for h in hashes] + [("STORAGE", hashes[:1])]
    first, second = events[0], events[1]
    assert isinstance(first, BlockStored) and first.parent_block_hash is None
    assert first.token_ids == list(range(BLOCK_SIZE)) and first.block_size == BLOCK_SIZE
    assert isinstance(second, BlockStored) and second.parent_block_hash == hashes[0]

    translator.add_tier_events([(True, "dram", keys[:1])])  # already there: nothing new
    translator.add_tier_events([(False, "dram", keys[1:]), (False, "dram", keys[1:])])
    events = translator.take_events()
    assert len(events) == 1 and isinstance(events[0], BlockRemoved)
    assert (events[0].medium, events[0].block_hashes) == ("CPU", hashes[1:])

    translator.reset(clears_storage=False)  # vLLM clears all; UCM says again what storage holds
    assert [(type(e), e.medium, e.block_hashes) for e in translator.take_events()] == [
        (BlockStored, "STORAGE", hashes[:1])
    ]
    translator.reset(clears_storage=True)
    assert [type(e) for e in translator.take_events()] == [AllBlocksCleared]
    translator.add_tier_events([(False, "storage", keys)])  # forgotten: nothing to remove
    assert translator.take_events() == []


def test_translator_skips_requests_without_block_hashes(caplog: pytest.LogCaptureFixture) -> None:
    req = Request("r", list(range(2 * BLOCK_SIZE)), SamplingParams(max_tokens=1), None)  # no hasher: prefix caching off
    translator = KVEventTranslator(BLOCK_SIZE)
    translator.note_blocks(req, 0, make_keys(2, seed=6))
    translator.add_tier_events([(True, "dram", make_keys(2, seed=6))])
    assert translator.take_events() == []


def test_translator_keeps_a_bounded_number_of_blocks() -> None:
    req = request(list(range(4 * BLOCK_SIZE)))
    keys = make_keys(4, seed=7)
    translator = KVEventTranslator(BLOCK_SIZE, capacity=2)
    translator.note_blocks(req, 0, keys)
    translator.add_tier_events([(True, "storage", keys)])
    assert [e.block_hashes for e in translator.take_events()] == [
        [maybe_convert_block_hash(h)] for h in req.block_hashes[2:]
    ]


def test_worker_buffer_and_metadata_carry_tier_events_of_every_rank() -> None:
    buffer = ResidencyBuffer()
    k = make_keys(2, seed=8)
    buffer.add(Residency(True, "dram", (k[0],)))
    buffer.add(Residency(True, "compress", (k[1],)))  # no medium of its own: the stage below reports
    assert buffer.take() == [(True, "dram", [k[0]])] and buffer.take() == []
    a = UCMWorkerMetadata(tier_events=[(True, "dram", [k[0]])])
    b = UCMWorkerMetadata(tier_events=[(False, "storage", [k[1]])])
    merged = a.aggregate(b)
    assert isinstance(merged, UCMWorkerMetadata)
    assert merged.tier_events == [(True, "dram", [k[0]]), (False, "storage", [k[1]])]
