"""Compress (KVfold) stage on real temp directories: round trips, files readable across settings, damage is a miss."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from tests.helpers import needs_aio
from tests.store.blocks import make_keys, poisoned
from tests.store.helpers import STORE_MODE_PARAMS, Closer
from ucm.store.base import (
    FOREIGN,
    EncodedBlock,
    EncodedStore,
    PayloadDecoder,
    Task,
    TaskResult,
    UcmKVStoreBase,
)
from ucm.store.cache import CacheStore
from ucm.store.compress import CompressStore
from ucm.store.kvfold import CONTAINER, KVGeometry
from ucm.store.posix import CODEC_KVFOLD, CODEC_RAW, HEADER, HEADER_NBYTES, PosixStore, psync

# A small model's block: 3 layers, block_size 16, 2 KV heads, head_dim 32 -> 12 KiB per block.
GEOMETRY = KVGeometry(num_layers=3, block_size=16, num_kv_heads=2, head_dim=32, dtype=torch.bfloat16)
NAMESPACE_INFO = {
    "kv_dtype": "bfloat16",
    "num_layers": GEOMETRY.num_layers,
    "block_size": GEOMETRY.block_size,
    "num_kv_heads": GEOMETRY.num_kv_heads,
    "head_dim": GEOMETRY.head_dim,
}
TAG = b"\x01\x02\x03\x04" + bytes(12)


def kv_blocks(n: int, seed: int, geometry: KVGeometry = GEOMETRY) -> torch.Tensor:
    """``n`` KV-like bf16 blocks (normal values with a per-channel scale, as K has) as uint8 ``[n, block_nbytes]``."""
    gen = torch.Generator().manual_seed(seed)
    shape = (n, geometry.num_layers, 2, geometry.block_size, geometry.num_kv_heads, geometry.head_dim)
    scale = torch.rand((1, geometry.num_layers, 2, 1, geometry.num_kv_heads, geometry.head_dim), generator=gen) * 4
    x = (torch.randn(shape, generator=gen) * scale).to(torch.bfloat16)
    return x.view(torch.uint8).reshape(n, -1).contiguous()


def all_bf16_patterns() -> torch.Tensor:
    """One block of all 65,536 bf16 bit patterns (NaN payloads, infinities, -0.0, subnormals), as uint8 [1, 128 KiB]."""
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.uint8).reshape(1, -1)


def stored_codec(store: PosixStore, key: bytes) -> tuple[int, int]:
    """(codec, file size) of ``key``'s block file."""
    path = store.block_path(key)
    with open(path, "rb") as f:
        header = f.read(HEADER_NBYTES)
    return HEADER.unpack(header)[2], os.path.getsize(path)


def compress_store(root: Path, **kw: object) -> CompressStore:
    store = CompressStore(PosixStore(str(root)), **kw)  # type: ignore[arg-type]
    store.set_namespace(TAG, NAMESPACE_INFO)
    return store


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "kv"


def load_all(store: CompressStore | PosixStore, keys: list[bytes], nbytes: int) -> tuple[torch.Tensor, set[int]]:
    dst = poisoned(len(keys), nbytes)
    result = store.wait(store.load(keys, dst))
    return dst, set(result.failed)


@pytest.fixture(params=STORE_MODE_PARAMS)
def store(root: Path, request: pytest.FixtureRequest) -> Iterator[CompressStore]:
    """A lossless Compress stage over a Posix stage in each engine and I/O mode."""
    io_engine, io_direct = request.param
    s = CompressStore(PosixStore(str(root), io_engine=io_engine, io_direct=io_direct))
    s.set_namespace(TAG, NAMESPACE_INFO)
    yield s
    s.close()


def test_lossless_round_trip_is_bit_exact_and_smaller(store: CompressStore) -> None:
    blocks = kv_blocks(5, seed=1)
    keys = make_keys(5, seed=1)
    assert store.wait(store.dump(keys, blocks)).ok
    assert store.lookup(keys) == 5
    for key in keys:
        codec, size = stored_codec(store.inner, key)
        assert codec == CODEC_KVFOLD
        assert size < 0.85 * blocks.shape[1]  # exponent plane of normal values: about 3 of 8 bits
    dst, failed = load_all(store, keys, blocks.shape[1])
    assert not failed
    assert torch.equal(dst, blocks)


def test_all_bf16_patterns_round_trip(root: Path) -> None:
    block = all_bf16_patterns()
    keys = make_keys(1, seed=2)
    store = CompressStore(PosixStore(str(root)))  # no geometry: the block is one section
    try:
        assert store.wait(store.dump(keys, block)).ok
        assert stored_codec(store.inner, keys[0])[0] == CODEC_KVFOLD
        dst, failed = load_all(store, keys, block.shape[1])
        assert not failed
        assert torch.equal(dst, block)
    finally:
        store.close()


def test_fixed_rate_is_smaller_and_close(root: Path) -> None:
    blocks = kv_blocks(3, seed=3)
    keys = make_keys(3, seed=3)
    store = compress_store(root, mode="fixed_rate", compress_ratio=16)
    try:
        assert store.wait(store.dump(keys, blocks)).ok
        values = blocks.shape[1] // 2
        # 8 bits per value + one bf16 scale per head_dim values + headers
        limit = HEADER_NBYTES + values * (1 + 2 / GEOMETRY.head_dim) + 64 + 8 * 2 * GEOMETRY.num_layers
        for key in keys:
            codec, size = stored_codec(store.inner, key)
            assert codec == CODEC_KVFOLD and size <= limit
        dst, failed = load_all(store, keys, blocks.shape[1])
        assert not failed
        x = blocks.view(torch.bfloat16).float()
        y = dst.view(torch.bfloat16).float()
        assert not torch.equal(x, y)  # lossy
        rel = ((x - y).pow(2).mean() / x.pow(2).mean()).sqrt()
        assert rel < 0.015
    finally:
        store.close()


def test_fixed_rate_keeps_non_finite_blocks_exact(root: Path) -> None:
    block = all_bf16_patterns()  # holds inf and NaN: stored lossless
    keys = make_keys(1, seed=4)
    store = CompressStore(PosixStore(str(root)), mode="fixed_rate", compress_ratio=16)
    try:
        assert store.wait(store.dump(keys, block)).ok
        dst, failed = load_all(store, keys, block.shape[1])
        assert not failed and torch.equal(dst, block)
    finally:
        store.close()


@pytest.mark.parametrize(
    ("writer", "reader"),
    [
        ({"mode": "lossless"}, {"mode": "off"}),
        ({"mode": "lossless"}, {"mode": "fixed_rate", "compress_ratio": 16}),
        ({"mode": "off"}, {"mode": "lossless"}),
        ({"mode": "fixed_rate", "compress_ratio": 16}, {"mode": "lossless"}),
    ],
    ids=["lossless-by-off", "lossless-by-fixed", "off-by-lossless", "fixed-by-lossless"],
)
def test_read_under_other_settings(
    root: Path, writer: dict[str, object], reader: dict[str, object], close_after: Closer
) -> None:
    blocks = kv_blocks(2, seed=5)
    keys = make_keys(2, seed=5)
    w = close_after(compress_store(root, **writer))
    assert w.wait(w.dump(keys, blocks)).ok
    expected, failed = load_all(w, keys, blocks.shape[1])  # what the writer itself reads back
    assert not failed
    w.close()
    r = compress_store(root, **reader)
    try:
        dst, failed = load_all(r, keys, blocks.shape[1])
        assert not failed
        assert torch.equal(dst, expected)
        if writer["mode"] != "fixed_rate":
            assert torch.equal(dst, blocks)
    finally:
        r.close()


def test_plain_posix_files_are_read_by_compress(root: Path, close_after: Closer) -> None:
    blocks = kv_blocks(2, seed=6)
    keys = make_keys(2, seed=6)
    plain = close_after(PosixStore(str(root)))
    assert plain.wait(plain.dump(keys, blocks)).ok
    plain.close()
    store = compress_store(root)
    try:
        assert stored_codec(store.inner, keys[0])[0] == CODEC_RAW
        dst, failed = load_all(store, keys, blocks.shape[1])
        assert not failed and torch.equal(dst, blocks)
    finally:
        store.close()


def test_compressed_files_are_read_by_plain_posix(root: Path, close_after: Closer) -> None:
    """The other way round (``Cache|Posix`` after ``Cache|Compress|Posix``); every engine, mode and damage case is in
    ``tests/store/test_posix_decode.py``."""
    blocks = kv_blocks(2, seed=7)
    keys = make_keys(2, seed=7)
    store = close_after(compress_store(root))
    assert store.wait(store.dump(keys, blocks)).ok
    store.close()
    plain = PosixStore(str(root))
    try:
        assert stored_codec(plain, keys[0])[0] == CODEC_KVFOLD
        dst, failed = load_all(plain, keys, blocks.shape[1])
        assert not failed and torch.equal(dst, blocks)
    finally:
        plain.close()


def flip_byte(path: str, offset_from_end: int) -> None:
    with open(path, "r+b") as f:
        f.seek(-offset_from_end, os.SEEK_END)
        b = f.read(1)
        f.seek(-offset_from_end, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x40]))


@pytest.mark.parametrize("damage", ["flip-sm-plane", "flip-zstd-frame", "truncate"])
def test_damaged_compressed_block_is_a_miss(store: CompressStore, damage: str) -> None:
    blocks = kv_blocks(3, seed=8)
    keys = make_keys(3, seed=8)
    assert store.wait(store.dump(keys, blocks)).ok
    path = store.inner.block_path(keys[1])
    size = os.path.getsize(path)
    if damage == "flip-sm-plane":
        flip_byte(path, 1)  # last byte: the raw sign+mantissa plane of the last section
    elif damage == "flip-zstd-frame":
        flip_byte(path, size - HEADER_NBYTES - CONTAINER.size - 4 - 10)  # inside the exponent plane's zstd frame
    else:
        os.truncate(path, size - 100)
    dst, failed = load_all(store, keys, blocks.shape[1])
    assert failed == {1}
    assert torch.equal(dst[0], blocks[0]) and torch.equal(dst[2], blocks[2])
    assert not os.path.exists(path)  # damaged: removed, so the block is recomputed and stored again
    assert store.lookup(keys) == 1


def test_other_kv_dtype_is_stored_raw(root: Path, ucm_log: pytest.LogCaptureFixture) -> None:
    store = CompressStore(PosixStore(str(root)))
    store.set_namespace(TAG, {**NAMESPACE_INFO, "kv_dtype": "float16"})
    try:
        blocks = kv_blocks(2, seed=9)
        keys = make_keys(2, seed=9)
        assert store.wait(store.dump(keys, blocks)).ok
        assert stored_codec(store.inner, keys[0]) == (CODEC_RAW, HEADER_NBYTES + blocks.shape[1])
        dst, failed = load_all(store, keys, blocks.shape[1])
        assert not failed and torch.equal(dst, blocks)
        assert any("float16" in r.getMessage() and "uncompressed" in r.getMessage() for r in ucm_log.records)
    finally:
        store.close()


def test_odd_block_size_is_stored_raw(root: Path) -> None:
    blocks = torch.randint(0, 256, (2, 4099), dtype=torch.uint8, generator=torch.Generator().manual_seed(10))
    keys = make_keys(2, seed=10)
    store = CompressStore(PosixStore(str(root)))
    try:
        assert store.wait(store.dump(keys, blocks)).ok
        assert stored_codec(store.inner, keys[0])[0] == CODEC_RAW
        dst, failed = load_all(store, keys, 4099)
        assert not failed and torch.equal(dst, blocks)
    finally:
        store.close()


def test_debug_log_lines(store: CompressStore, ucm_log: pytest.LogCaptureFixture) -> None:
    blocks = kv_blocks(2, seed=11)
    keys = make_keys(2, seed=11)
    assert store.wait(store.dump(keys, blocks)).ok
    assert store.wait(store.load(keys, poisoned(2, blocks.shape[1]))).ok
    messages = [r.getMessage() for r in ucm_log.records]
    for prefix in ("COMPRESS DUMP START | ", "COMPRESS DUMP END | ", "COMPRESS LOAD START | ", "COMPRESS LOAD END | "):
        assert any(m.startswith(prefix) for m in messages), prefix
    shard_lines = [m for m in messages if m.startswith("COMPRESS DUMP | ") and "shard sizes" in m]
    assert len(shard_lines) == 2
    assert shard_lines[0].count(",") == 2 * GEOMETRY.num_layers - 1  # one size per layer K and V
    assert sum(m.startswith("COMPRESS LOAD | ") for m in messages) == 2


def test_dump_skips_blocks_already_stored(store: CompressStore, ucm_log: pytest.LogCaptureFixture) -> None:
    blocks = kv_blocks(2, seed=12)
    keys = make_keys(2, seed=12)
    assert store.wait(store.dump(keys[:1], blocks[:1])).ok
    ucm_log.clear()
    assert store.wait(store.dump(keys, blocks)).ok
    assert sum(m.getMessage().startswith("COMPRESS DUMP | ") for m in ucm_log.records) == 1


def test_bad_settings_are_refused(root: Path) -> None:
    posix = PosixStore(str(root))
    try:
        with pytest.raises(ValueError, match=r"compress_mode 'zip'.*'lossless'"):
            CompressStore(posix, mode="zip")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"compress_ratio 16 .*compress_mode: fixed_rate"):
            CompressStore(posix, mode="lossless", compress_ratio=16)
        with pytest.raises(ValueError, match=r"compress_ratio 20 .*\[16\]"):
            CompressStore(posix, mode="fixed_rate", compress_ratio=20)
        with pytest.raises(ValueError, match=r"data_type 3 .*allowed: 0"):
            CompressStore(posix, data_type=3)
    finally:
        posix.close()


class BytesStore(UcmKVStoreBase, EncodedStore):
    """A stage below that stores bytes in a dict (as a DRAM pool stage would): the encoded-payload verbs and the
    contract's plain ones, on the calling thread. A damaged answer from the decoder drops the block."""

    def __init__(self) -> None:
        self.payloads: dict[bytes, tuple[int, bytes]] = {}

    def encoded_store(self) -> EncodedStore:
        return self

    def lookup(self, keys: Sequence[bytes]) -> int:
        return next((i for i, key in enumerate(keys) if key not in self.payloads), len(keys))

    def load(self, keys: Sequence[bytes], dst: torch.Tensor) -> Task:
        failed = [i for i, key in enumerate(keys) if self.payloads.get(key, (-1, b""))[0] != CODEC_RAW]
        for i, key in enumerate(keys):
            if i not in failed:
                dst[i] = torch.frombuffer(bytearray(self.payloads[key][1]), dtype=torch.uint8)
        return Task.completed(TaskResult(len(keys), frozenset(failed)))

    def dump(self, keys: Sequence[bytes], src: torch.Tensor) -> Task:
        return self.dump_encoded(keys, [row.numpy().tobytes() for row in src], [CODEC_RAW] * len(keys))

    def dump_encoded(
        self, keys: Sequence[bytes], payloads: Sequence[bytes | bytearray | memoryview], codecs: Sequence[int]
    ) -> Task:
        for key, payload, codec in zip(keys, payloads, codecs, strict=True):
            self.payloads.setdefault(key, (codec, bytes(payload)))
        return Task.completed(TaskResult(len(keys)))

    def load_encoded(self, keys: Sequence[bytes], max_nbytes: int, consume: PayloadDecoder) -> Task:
        failed = set()
        for i, key in enumerate(keys):
            codec, payload = self.payloads.get(key, (-1, b""))
            reason = "missing" if codec < 0 or len(payload) > max_nbytes else None
            if reason is None:
                reason = consume(i, EncodedBlock(codec, memoryview(payload)))
                if reason is not None and not reason.startswith(FOREIGN):
                    del self.payloads[key]
            if reason is not None:
                failed.add(i)
        return Task.completed(TaskResult(len(keys), frozenset(failed)))


def test_compress_stacks_over_any_stage_that_stores_bytes(close_after: Closer) -> None:
    """No class check: any stage whose ``encoded_store()`` holds encoded payloads takes the Compress stage, lossless
    blocks round-trip bit-exact through it, and a raw block dumped below is read through it."""
    below = BytesStore()
    store = close_after(CompressStore(below))
    store.set_namespace(TAG, NAMESPACE_INFO)
    keys, blocks = make_keys(4, seed=16), kv_blocks(4, seed=16)
    assert store.wait(store.dump(keys[:3], blocks[:3])).ok
    assert {below.payloads[k][0] for k in keys[:3]} == {CODEC_KVFOLD}
    assert all(len(below.payloads[k][1]) < blocks.shape[1] for k in keys[:3])
    assert below.wait(below.dump(keys[3:], blocks[3:])).ok  # raw, as Cache|Posix writes
    dst, failed = load_all(store, keys, blocks.shape[1])
    assert not failed and torch.equal(dst, blocks)
    below.payloads[keys[0]] = (CODEC_KVFOLD, b"\x02" + below.payloads[keys[0]][1][1:16])  # truncated: damaged
    below.payloads[keys[1]] = (7, below.payloads[keys[1]][1])  # a codec this version does not know: foreign
    _, failed = load_all(store, keys, blocks.shape[1])
    assert failed == {0, 1}
    assert keys[0] not in below.payloads and keys[1] in below.payloads  # the damaged one dropped, the foreign kept


def test_compress_refuses_a_stage_without_encoded_payloads(close_after: Closer) -> None:
    below = close_after(CacheStore(None, 1 << 20))  # DRAM only: canonical blocks, nothing to pass payloads to
    with pytest.raises(TypeError, match="needs a stage below it that holds encoded payloads; CacheStore does not"):
        CompressStore(below)


def test_closed_store_refuses_work(root: Path, close_after: Closer) -> None:
    store = close_after(compress_store(root))
    store.close()
    store.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        store.dump(make_keys(1, seed=13), kv_blocks(1, seed=13))


def test_cli_verify_checks_compressed_files(store: CompressStore) -> None:
    from ucm.store.cli import verify_file

    blocks = kv_blocks(2, seed=14)
    keys = make_keys(2, seed=14)
    assert store.wait(store.dump(keys, blocks)).ok
    good, bad = (store.inner.block_path(k) for k in keys)
    flip_byte(bad, 3)
    assert verify_file(good)[0] is None
    assert verify_file(bad)[0] == "checksum mismatch"


def test_decoding_starts_while_later_blocks_are_still_read(
    store: CompressStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block is decoded as soon as its file is read: with the read of the last block held, the others are already
    decoded into ``dst``; once it is released, every block is there, bit-exact."""
    keys, blocks = make_keys(3, seed=11), kv_blocks(3, seed=11)
    assert not store.wait(store.dump(keys, blocks)).failed
    gate, decoded = threading.Event(), threading.Semaphore(0)
    read_one = psync.load_encoded_one

    def held_read(files: object, key: bytes, *args: object) -> bool:
        if key == keys[2]:
            assert gate.wait(30), "the held read was never released"
        ok = read_one(files, key, *args)  # type: ignore[arg-type]
        decoded.release()
        return ok

    monkeypatch.setattr(psync, "load_encoded_one", held_read)
    dst = poisoned(3, blocks.shape[1])
    task = store.load(keys, dst)
    try:
        assert decoded.acquire(timeout=30) and decoded.acquire(timeout=30), "blocks 0 and 1 were not decoded"
        assert torch.equal(dst[:2], blocks[:2])
        assert not torch.equal(dst[2], blocks[2])  # still poisoned: its read is held
    finally:
        gate.set()
    assert not store.wait(task).failed
    assert torch.equal(dst, blocks)


def test_single_block_loads_run_as_wide_as_the_posix_io_threads(
    root: Path, monkeypatch: pytest.MonkeyPatch, close_after: Closer
) -> None:
    """The Cache stage loads its misses one block per call: six such loads are all read at once on the Posix stage's
    eight I/O threads (no coordinator thread per load capping them at COORDINATORS = 4)."""
    from ucm.store.compress import COORDINATORS

    n = COORDINATORS + 2
    store = close_after(CompressStore(PosixStore(str(root), io_threads=8)))
    store.set_namespace(TAG, NAMESPACE_INFO)
    keys, blocks = make_keys(n, seed=15), kv_blocks(n, seed=15)
    assert not store.wait(store.dump(keys, blocks)).failed
    all_reading = threading.Barrier(n, timeout=30)  # broken (an error in the reads) unless n reads run at once
    read_one = psync.load_encoded_one

    def read_together(files: object, key: bytes, *args: object) -> bool:
        all_reading.wait()
        return read_one(files, key, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(psync, "load_encoded_one", read_together)
    dst = poisoned(n, blocks.shape[1])
    tasks = [store.load(keys[i : i + 1], dst[i : i + 1]) for i in range(n)]
    assert all(store.wait(t).ok for t in tasks)
    assert torch.equal(dst, blocks)


@pytest.mark.parametrize(
    "io", [("psync", False), pytest.param(("aio", True), marks=needs_aio)], ids=["psync", "aio-direct"]
)
def test_load_encoded_hands_each_block_to_the_consumer(root: Path, io: tuple[str, bool]) -> None:
    """``consume(i, block)`` runs once per block read and checked (not for a missing one), on the I/O thread, with
    a view of that thread's reused buffer; its reason fails the key (a foreign one keeps the file, others remove
    it), and so does an exception."""
    posix = PosixStore(str(root), io_threads=1, io_engine=io[0], io_direct=io[1])
    try:
        keys, blocks = make_keys(5, seed=12), kv_blocks(5, seed=12)
        assert not posix.wait(posix.dump(keys[:4], blocks[:4])).failed
        seen: dict[int, bytes] = {}
        buffers: set[int] = set()

        def consume(i: int, block: EncodedBlock) -> str | None:
            assert block.codec == CODEC_RAW and isinstance(block.payload, memoryview)
            seen[i] = bytes(block.payload)
            buffers.add(id(block.payload.obj))
            if i == 1:
                return "foreign: not for this consumer"
            if i == 2:
                return "does not decode"
            if i == 3:
                raise RuntimeError("consumer failed")
            return None

        result = posix.wait(posix.load_encoded(keys, 1 << 20, consume))
        assert sorted(seen) == [0, 1, 2, 3]
        assert all(seen[i] == blocks[i].numpy().tobytes() for i in seen)
        assert len(buffers) == 1  # one I/O thread: one buffer, reused for every block
        assert set(result.failed) == {1, 2, 3, 4}  # 1, 2: the consumer's reasons; 3: it raised; 4: never stored
        assert os.path.exists(posix.block_path(keys[1]))  # foreign: kept
        assert not os.path.exists(posix.block_path(keys[2]))  # damaged: removed
        assert os.path.exists(posix.block_path(keys[0]))
    finally:
        posix.close()
