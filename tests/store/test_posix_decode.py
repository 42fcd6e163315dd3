"""A plain Posix stage (``Cache|Posix``, ``Posix``) reads the KVfold files a ``Compress`` stage wrote.

Checked, in every engine and I/O mode, through ``load`` and ``load_sharded``: lossless blocks come back bit-exact,
fixed-rate (lossy int8) blocks exactly as the Compress stage itself decodes them; raw and KVfold files mix in one
load; a sharded load reports no shard of a KVfold row before the decoded bytes are in it; damaged KVfold files
(flipped byte, truncated, a container that passes the checksum but does not decode) are misses and removed; a
container of another block size or of an unknown container version is a miss and kept; one debug line per load
says how many blocks were decoded.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.store.blocks import make_blocks, make_keys, poisoned
from tests.store.helpers import STORE_MODE_PARAMS
from tests.store.test_compress import GEOMETRY, NAMESPACE_INFO, TAG, kv_blocks, stored_codec
from ucm.store.base import ShardProgress
from ucm.store.compress import CompressStore
from ucm.store.kvfold import CONTAINER, CONTAINER_VERSION, encode_block
from ucm.store.posix import CODEC_KVFOLD, CODEC_RAW, HEADER_NBYTES, PosixStore
from ucm.store.posix import store as posix_module

NBYTES = GEOMETRY.block_nbytes  # 12 KiB
SHARDS = GEOMETRY.num_layers  # one shard per layer, as the layerwise connector loads
WRITERS = {
    "lossless": {"mode": "lossless"},
    "fixed_rate": {"mode": "fixed_rate", "compress_ratio": 16},
}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "kv"


@pytest.fixture(params=STORE_MODE_PARAMS)
def posix(root: Path, request: pytest.FixtureRequest) -> Iterator[PosixStore]:
    """A plain Posix stage (no Compress stage above it) in each engine and I/O mode."""
    io_engine, io_direct = request.param
    s = PosixStore(str(root), io_engine=io_engine, io_direct=io_direct)
    yield s
    s.close()


def write_compressed(root: Path, keys: list[bytes], blocks: torch.Tensor, writer: dict[str, object]) -> torch.Tensor:
    """Dump ``blocks`` through a ``Compress|Posix`` store; return what that store itself loads back."""
    store = CompressStore(PosixStore(str(root)), **writer)  # type: ignore[arg-type]
    try:
        store.set_namespace(TAG, NAMESPACE_INFO)
        assert store.wait(store.dump(keys, blocks)).ok
        for key in keys:
            assert stored_codec(store.inner, key)[0] == CODEC_KVFOLD
        expected = poisoned(len(keys), blocks.shape[1])
        assert store.wait(store.load(keys, expected)).ok
        return expected
    finally:
        store.close()


def load(store: PosixStore, keys: list[bytes], sharded: bool) -> tuple[torch.Tensor, set[int]]:
    dst = poisoned(len(keys), NBYTES)
    task = store.load_sharded(keys, dst, SHARDS) if sharded else store.load(keys, dst)
    return dst, set(store.wait(task).failed)


@pytest.mark.parametrize("sharded", [False, True], ids=["load", "load_sharded"])
@pytest.mark.parametrize("writer", list(WRITERS), ids=list(WRITERS))
def test_plain_posix_reads_compressed_files(
    posix: PosixStore, root: Path, writer: str, sharded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(posix_module, "SHARDED_READ_BYTES", 1)  # one run per shard: several runs per key
    blocks = kv_blocks(4, seed=21)
    keys = make_keys(4, seed=21)
    expected = write_compressed(root, keys[1:], blocks[1:], WRITERS[writer])
    assert posix.wait(posix.dump(keys[:1], blocks[:1])).ok  # a raw file in the same load
    assert stored_codec(posix, keys[0])[0] == CODEC_RAW
    dst, failed = load(posix, keys, sharded)
    assert not failed
    assert torch.equal(dst[0], blocks[0])
    assert torch.equal(dst[1:], expected)  # what the Compress stage itself decodes
    if writer == "lossless":
        assert torch.equal(dst, blocks)  # bit-exact
    else:
        assert not torch.equal(dst[1:], blocks[1:])  # lossy values, as stored
    assert all(os.path.exists(posix.block_path(k)) for k in keys)


def test_sharded_load_reports_kvfold_shards_only_once_decoded(posix: PosixStore, root: Path, monkeypatch) -> None:
    """Each shard, as soon as it is reported ready, already holds its final bytes (the layerwise connector scatters
    it then and never again for a row reported valid)."""
    monkeypatch.setattr(posix_module, "SHARDED_READ_BYTES", 1)
    blocks = kv_blocks(3, seed=22)
    keys = make_keys(3, seed=22)
    write_compressed(root, keys[:2], blocks[:2], WRITERS["lossless"])
    assert posix.wait(posix.dump(keys[2:], blocks[2:])).ok
    dst = poisoned(3, NBYTES)
    progress = ShardProgress(SHARDS, 3)
    task = posix.load_sharded(keys, dst, SHARDS, progress)
    shard_nbytes = NBYTES // SHARDS
    seen = []
    for s in range(SHARDS):
        task.wait_shard(s)
        seen.append(dst[:, s * shard_nbytes : (s + 1) * shard_nbytes].clone())
    assert posix.wait(task).ok
    assert torch.equal(torch.cat(seen, dim=1), blocks)


def test_container_of_the_raw_size_in_a_sharded_load_is_a_kept_miss(posix: PosixStore, monkeypatch) -> None:
    """A KVfold file exactly as large as a raw one is read as raw by the sharded reads (the header comes with shard
    0, after other shards may have been reported): it must be a miss, and ``load`` still decodes it."""
    monkeypatch.setattr(posix_module, "SHARDED_READ_BYTES", 1)
    block, container = equal_size_container()
    keys = make_keys(1, seed=23)
    assert posix.wait(posix.dump_encoded(keys, [container], [CODEC_KVFOLD])).ok
    assert os.path.getsize(posix.block_path(keys[0])) == HEADER_NBYTES + NBYTES
    _, failed = load(posix, keys, sharded=True)
    assert failed == {0}
    assert os.path.exists(posix.block_path(keys[0]))
    dst, failed = load(posix, keys, sharded=False)
    assert not failed and torch.equal(dst[0], block)


def equal_size_container() -> tuple[torch.Tensor, bytes]:
    """A bf16 block of ``GEOMETRY`` and its lossless container of exactly the block's size: random values except
    that the first ``k`` exponents of section 0 take 4 values (compressible), ``k`` searched so that section 0's
    saving pays for the container's headers exactly."""
    n = NBYTES // 2
    for k in range(250, 450):
        rng = np.random.default_rng(0)
        words = rng.integers(0, 65536, n, dtype=np.uint32).astype(np.uint16)
        exps = rng.integers(0, 4, k).astype(np.uint16) + 0x70
        words[:k] = (words[:k] & 0x807F) | (exps << 7)
        block = torch.from_numpy(words.view(np.uint8).copy())
        container, _, mode = encode_block(block, "lossless", GEOMETRY)
        if len(container) == NBYTES and mode == "lossless":
            return block, container
    raise AssertionError("no equal-size container found in the searched range (codec or zstd changed?)")


def _flip_payload(path: str) -> None:
    data = bytearray(Path(path).read_bytes())
    data[HEADER_NBYTES + (len(data) - HEADER_NBYTES) // 2] ^= 0x10
    Path(path).write_bytes(bytes(data))


def _truncate(path: str) -> None:
    os.truncate(path, os.path.getsize(path) - 100)


DAMAGES = {"flip-payload": _flip_payload, "truncate": _truncate}


@pytest.mark.parametrize("sharded", [False, True], ids=["load", "load_sharded"])
@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damaged_compressed_file_is_a_removed_miss(
    posix: PosixStore, root: Path, damage: str, sharded: bool, ucm_log: pytest.LogCaptureFixture
) -> None:
    blocks = kv_blocks(3, seed=24)
    keys = make_keys(3, seed=24)
    expected = write_compressed(root, keys, blocks, WRITERS["lossless"])
    path = posix.block_path(keys[1])
    DAMAGES[damage](path)
    dst, failed = load(posix, keys, sharded)
    assert failed == {1}
    assert torch.equal(dst[0], expected[0]) and torch.equal(dst[2], expected[2])
    assert not os.path.exists(path)  # damaged: removed, so the block is stored again
    warnings = [r.getMessage() for r in ucm_log.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and path in warnings[0] and "removed" in warnings[0]


def _garbage_container() -> bytes:
    """Passes the checksum (written as is), has a valid container header for a ``NBYTES`` block, then garbage."""
    head = CONTAINER.pack(CONTAINER_VERSION, 1, 0, 0, NBYTES, 2 * GEOMETRY.num_layers, 0)
    return head + make_blocks(1, 5000, seed=25)[0].numpy().tobytes()


def _random_bytes() -> bytes:
    """Not a container this version knows (version byte 9)."""
    return b"\x09" + make_blocks(1, 4999, seed=26)[0].numpy().tobytes()


def _other_block_size() -> bytes:
    """A valid lossless container of a block half the size (another model or block_size)."""
    container, _, _ = encode_block(kv_blocks(1, seed=27)[0][: NBYTES // 2].contiguous(), "lossless")
    return container


def _short() -> bytes:
    return b"\x01\x01\x00"  # shorter than a container header


CRAFTED = {
    "garbage-container": (_garbage_container, False),
    "shorter-than-container-header": (_short, False),
    "unknown-container-version": (_random_bytes, True),
    "other-block-size": (_other_block_size, True),
}


@pytest.mark.parametrize("sharded", [False, True], ids=["load", "load_sharded"])
@pytest.mark.parametrize("crafted", list(CRAFTED))
def test_checksummed_container_that_does_not_decode_is_a_miss(
    posix: PosixStore, crafted: str, sharded: bool, ucm_log: pytest.LogCaptureFixture
) -> None:
    """Containers written through ``dump_encoded`` with codec 1 (so the checksum passes): one that does not decode
    is damaged (removed); one of another block size or an unknown container version is foreign (kept)."""
    make, kept = CRAFTED[crafted]
    blocks = make_blocks(3, NBYTES, seed=28)
    keys = make_keys(3, seed=28)
    assert posix.wait(posix.dump(keys, blocks)).ok
    bad = make_keys(1, seed=29)
    assert posix.wait(posix.dump_encoded(bad, [make()], [CODEC_KVFOLD])).ok
    order = [keys[0], bad[0], keys[1], keys[2]]
    dst, failed = load(posix, order, sharded)
    assert failed == {1}
    assert torch.equal(dst[[0, 2, 3]], blocks)
    assert os.path.exists(posix.block_path(bad[0])) == kept
    warnings = [r.getMessage() for r in ucm_log.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and ("file kept" in warnings[0]) == kept, warnings


def test_unknown_codec_stays_a_kept_miss(posix: PosixStore) -> None:
    keys = make_keys(1, seed=30)
    assert posix.wait(posix.dump_encoded(keys, [bytes(NBYTES)], [7])).ok
    for sharded in (False, True):
        _, failed = load(posix, keys, sharded)
        assert failed == {0}
    assert os.path.exists(posix.block_path(keys[0]))


def test_debug_line_counts_decoded_blocks_and_lossy_is_logged_once(
    posix: PosixStore, root: Path, ucm_log: pytest.LogCaptureFixture
) -> None:
    blocks = kv_blocks(3, seed=31)
    keys = make_keys(3, seed=31)
    write_compressed(root, keys[:2], blocks[:2], WRITERS["fixed_rate"])
    assert posix.wait(posix.dump(keys[2:], blocks[2:])).ok
    ucm_log.clear()
    for sharded in (False, True):
        _, failed = load(posix, keys, sharded)
        assert not failed
    lines = [r.getMessage() for r in ucm_log.records if r.levelno == logging.DEBUG and "KVfold" in r.getMessage()]
    assert len(lines) == 2, lines  # one per load
    assert all("load of 3 blocks: 2 KVfold blocks decoded (2 lossy int8), 0 not decodable" in m for m in lines)
    assert all(f"-> {2 * NBYTES} bytes" in m for m in lines)
    lossy = [r for r in ucm_log.records if r.levelno == logging.INFO and "lossy" in r.getMessage()]
    assert len(lossy) == 1
    ucm_log.clear()
    assert posix.wait(posix.load(keys[2:], poisoned(1, NBYTES))).ok  # raw files only: no decode line
    assert not [r for r in ucm_log.records if "KVfold" in r.getMessage()]


def test_container_header_layout_is_what_the_crafted_files_assume() -> None:
    """Guards the crafted containers above: version, mode, dtype, reserved, block bytes, sections, group."""
    container, _, _ = encode_block(kv_blocks(1, seed=32)[0], "lossless", GEOMETRY)
    assert CONTAINER.unpack_from(container, 0) == (CONTAINER_VERSION, 1, 0, 0, NBYTES, 2 * GEOMETRY.num_layers, 0)
    assert struct.calcsize("<BBBBIII") == CONTAINER.size == 16
