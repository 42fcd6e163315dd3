"""The Mooncake stage's scenarios, each run by ``tests/store/test_mooncake.py`` in its own loopback-only network
namespace (Mooncake's client listens on every interface) with a real ``mooncake_master`` and real clients: other
processes where a scenario needs "another instance" (its own segment) or one to kill.

Run one by hand: ``unshare --net sh -c 'ip link set lo up && exec python -m tests.store.mooncake_cases CASE DIR'``.
A scenario fails by raising (the process exits non-zero with the traceback).
"""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ucm.store.codecs import CODEC_KVFOLD
from ucm.store.compress import CompressStore
from ucm.store.mooncake import MooncakeStore, UcmMooncakeError, connect
from ucm.store.posix import PosixStore
from ucm.store.posix.format import pack_header
from ucm.testing.mooncake import MooncakeMaster

ROW = 64 * 1024  # block bytes
SEGMENT = 64 << 20


def keys_of(n: int, tag: str) -> list[bytes]:
    return [hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=16).digest() for i in range(n)]


def rows_of(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n, ROW), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def stage(address: str, inner: PosixStore | None = None, segment: int = SEGMENT) -> MooncakeStore:
    client = connect(address, global_segment_size=segment, local_buffer_size=16 << 20)
    return MooncakeStore(client, inner, timeout_s=2.0)


def load(store: MooncakeStore, keys: list[bytes]) -> tuple[torch.Tensor, frozenset[int]]:
    dst = torch.zeros((len(keys), ROW), dtype=torch.uint8)
    return dst, store.load(keys, dst).result(60).failed


def put_raw(store: MooncakeStore, key: bytes, header: bytes, payload: np.ndarray) -> None:
    """Put an object under ``key``'s name with any header and payload (a damaged or foreign object)."""
    head = np.frombuffer(header, dtype=np.uint8).copy()
    status = store._client.batch_put_from_multi_buffers(
        [store._name(key)], [[head.ctypes.data, payload.ctypes.data]], [[head.nbytes, payload.nbytes]]
    )
    assert status == [0], status


# -- helper processes ------------------------------------------------------------------------------------------


def reader(address: str) -> None:
    """Another instance (its own segment): finds and loads the blocks case_shared_across_processes dumped."""
    store = stage(address)
    keys = keys_of(8, "shared")
    assert store.lookup([*keys, *keys_of(1, "absent")]) == 8
    dst, failed = load(store, keys)
    assert failed == frozenset(), failed
    assert torch.equal(dst, rows_of(8, 1))
    store.close()
    print("reader ok", flush=True)


def holder(address: str) -> None:
    """An instance that dumps blocks into its own segment, says so, and waits to be killed."""
    store = stage(address)
    assert store.dump(keys_of(8, "held"), rows_of(8, 2)).result(60).ok
    print("stored", flush=True)
    time.sleep(600)


# -- scenarios -------------------------------------------------------------------------------------------------


def case_shared_across_processes(tmp: Path) -> None:
    """Blocks dumped by one process are found and loaded bit-exact by another, through the pool."""
    with MooncakeMaster(tmp / "master.log") as master:
        store = stage(master.address)
        assert store.dump(keys_of(8, "shared"), rows_of(8, 1)).result(60).ok
        child = subprocess.run(
            [sys.executable, "-m", "tests.store.mooncake_cases", "reader", master.address],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert child.returncode == 0 and "reader ok" in child.stdout, child.stdout + child.stderr[-3000:]
        store.close()


def case_holder_killed(tmp: Path) -> None:
    """The process whose segment holds the blocks is SIGKILLed: loading them fails (misses) within a bounded time,
    and the rows are never reported loaded."""
    with MooncakeMaster(tmp / "master.log") as master:
        child = subprocess.Popen(
            [sys.executable, "-m", "tests.store.mooncake_cases", "holder", master.address],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None and child.stdout.readline().strip() == "stored"
        store = stage(master.address, segment=0)  # no segment of its own: every object is in the holder's
        keys = keys_of(8, "held")
        dst, failed = load(store, keys)
        assert failed == frozenset() and torch.equal(dst, rows_of(8, 2))
        child.send_signal(signal.SIGKILL)
        child.wait()
        t0 = time.monotonic()
        dst, failed = load(store, keys)
        took = time.monotonic() - t0
        assert failed == frozenset(range(8)), failed
        print(f"load after the holder was killed: {took:.2f} s, all failed", flush=True)
        t0 = time.monotonic()
        found = store.lookup(keys)
        print(f"lookup after the holder was killed: {found} in {time.monotonic() - t0:.2f} s", flush=True)
        store.close()


def case_damaged_objects_are_misses(tmp: Path) -> None:
    """An object with a wrong checksum or holding another key is a miss and is removed, so the next dump replaces
    it; one of another size is a miss; the blocks around them load bit-exact."""
    with MooncakeMaster(tmp / "master.log") as master:
        store = stage(master.address)
        keys, rows = keys_of(4, "damage"), rows_of(4, 3)
        assert store.dump([keys[0]], rows[:1]).result(60).ok
        good = rows[1].numpy()
        bad = good.copy()
        bad[100] ^= 1
        put_raw(store, keys[1], pack_header(0, 0, keys[1], memoryview(good)), bad)  # checksum of other bytes
        put_raw(store, keys[2], pack_header(0, 0, keys[3], memoryview(rows[2].numpy())), rows[2].numpy())  # key
        short = rows[3].numpy()[: ROW // 2].copy()
        put_raw(store, keys[3], pack_header(0, 0, keys[3], memoryview(short)), short)  # another size
        assert store.lookup(keys) == 4
        dst, failed = load(store, keys)
        assert failed == {1, 2, 3}, failed
        assert torch.equal(dst[0], rows[0])
        assert store._client.batch_is_exist([store._name(k) for k in keys]) == [1, 0, 0, 1]  # damaged: removed
        assert store.dump(keys[1:3], rows[1:3]).result(60).ok  # replaced
        dst, failed = load(store, keys[:3])
        assert failed == frozenset() and torch.equal(dst, rows[:3])
        store.close()


def case_tiers_over_posix(tmp: Path) -> None:
    """``Mooncake|Posix``: a dump lands in both; a block gone from the pool is read from Posix and one gone from
    Posix from the pool; removing a namespace empties both; a load Posix refuses to start (closed) fails its rows
    without hanging."""
    with MooncakeMaster(tmp / "master.log") as master:
        posix = PosixStore(str(tmp / "kv"))
        store = stage(master.address, inner=posix)
        store.set_namespace(b"\x01\x02\x03\x04" * 4, {"model": "test"})
        keys, rows = keys_of(6, "tiers"), rows_of(6, 4)
        assert store.dump(keys, rows).result(60).ok
        store.flush()
        assert posix.lookup(keys) == 6
        assert store._client.batch_is_exist([store._name(k) for k in keys]) == [1] * 6
        store._client.batch_remove([store._name(k) for k in keys[1:3]], True)  # gone from the pool
        assert posix.remove_stored(keys=keys[4:5]).blocks == 1  # gone from Posix
        assert store.lookup(keys) == 6
        dst, failed = load(store, keys)
        assert failed == frozenset() and torch.equal(dst, rows)
        # Rows anywhere in memory (a Cache stage's slots): one batch from the pool, the rest from Posix, one task
        # per row; a key in neither tier fails its row only.
        scattered = [torch.zeros((1, ROW), dtype=torch.uint8) for _ in range(7)]
        tasks = store.load_rows([*keys, keys_of(1, "nowhere")[0]], scattered)
        assert [t.result(60).failed for t in tasks] == [frozenset()] * 6 + [frozenset({0})]
        assert all(torch.equal(scattered[i][0], rows[i]) for i in range(6))
        removal = store.remove_stored(namespace=b"\x01\x02\x03\x04" * 4)
        assert removal.blocks == 5, removal
        assert store.lookup(keys) == 0
        posix.close()  # the stage below refuses loads now: the pool's misses fail, the load still completes
        _, failed = load(store, keys)
        assert failed == frozenset(range(6)), failed
        store.close()


def case_pool_full(tmp: Path) -> None:
    """A pool without room (one 16 MiB segment): the blocks that do not fit are not put (one warning); alone, the
    stage reports them not stored; over Posix, the dump is stored there and loads back bit-exact."""
    with MooncakeMaster(tmp / "master.log") as master:
        keys, rows = keys_of(512, "full"), rows_of(512, 5)  # 32 MiB of blocks
        alone = stage(master.address, segment=16 << 20)  # Mooncake's least segment
        result = alone.dump(keys, rows).result(60)
        assert 0 < len(result.failed) < 512, result
        alone.close()
        tiered = stage(master.address, inner=PosixStore(str(tmp / "kv")), segment=0)
        assert tiered.dump(keys, rows).result(60).ok
        tiered.flush()
        dst, failed = load(tiered, keys)
        assert failed == frozenset() and torch.equal(dst, rows)
        tiered.close()


def case_master_down(tmp: Path) -> None:
    """The master killed while serving: lookups count only the stage below's blocks within the stage's timeout,
    loads are read from below (alone: misses), dumps are stored below; nothing hangs."""
    with MooncakeMaster(tmp / "master.log") as master:
        posix = PosixStore(str(tmp / "kv"))
        tiered = stage(master.address, inner=posix)
        alone = stage(master.address, segment=0)
        keys, rows = keys_of(4, "down"), rows_of(4, 6)
        assert tiered.dump(keys[:2], rows[:2]).result(60).ok
        tiered.flush()
        master.kill()
        t0 = time.monotonic()
        assert tiered.lookup(keys) == 2
        assert alone.lookup(keys) == 0
        dst, failed = load(tiered, keys[:2])
        assert failed == frozenset() and torch.equal(dst, rows[:2])
        _, failed = load(alone, keys[:2])
        assert failed == {0, 1}
        assert tiered.dump(keys[2:], rows[2:]).result(60).ok
        assert not alone.dump(keys[2:], rows[2:]).result(60).ok
        took = time.monotonic() - t0
        print(f"master down: lookups, loads and dumps took {took:.2f} s in all", flush=True)
        assert took < 60, took
        tiered.flush()
        assert posix.lookup(keys) == 4
        tiered.close()
        alone.close()


def case_compress_over_the_pool(tmp: Path) -> None:
    """``Compress|Mooncake`` and ``Compress|Mooncake|Posix``: KVfold payloads (smaller than the blocks) stored as
    objects, loaded back bit-exact from the pool, and from Posix once gone from the pool; a damaged payload object
    is a miss and is removed."""
    from tests.store.test_compress import NAMESPACE_INFO, TAG, kv_blocks

    with MooncakeMaster(tmp / "master.log") as master:
        blocks, keys = kv_blocks(6, seed=7), keys_of(6, "compress")
        for inner in (None, PosixStore(str(tmp / "kv"))):
            pool = stage(master.address, inner=inner)
            store = CompressStore(pool)
            store.set_namespace(TAG, NAMESPACE_INFO)
            assert pool.encoded_store() is pool
            assert store.dump(keys, blocks).result(60).ok
            store.flush()
            names = [pool._name(k) for k in keys]
            sizes = [pool._client.get_size(n) for n in names]
            assert all(44 < size < 44 + blocks.shape[1] for size in sizes), sizes  # encoded: smaller than a block
            dst = torch.zeros_like(blocks)
            assert store.load(keys, dst).result(60).ok and torch.equal(dst, blocks)
            pool._client.batch_remove(names[:2], True)
            dst.zero_()
            failed = store.load(keys, dst).result(60).failed
            if inner is None:
                assert failed == {0, 1}
                assert torch.equal(dst[2:], blocks[2:])
                payload, other = np.zeros(sizes[2] - 44, dtype=np.uint8), np.ones(sizes[2] - 44, dtype=np.uint8)
                pool._client.batch_remove(names[2:3], True)
                put_raw(pool, keys[2], pack_header(CODEC_KVFOLD, 0, keys[2], memoryview(other)), payload)
                assert store.load(keys[2:3], dst[2:3]).result(60).failed == {0}  # checksum of other bytes
                assert pool._client.batch_is_exist(names[2:3]) == [0]  # removed
            else:  # read from Posix
                assert failed == frozenset() and torch.equal(dst, blocks)
            pool._client.batch_remove(names, True)
            store.close()
            keys = keys_of(6, "compress-posix")


def case_pipelines_from_config(tmp: Path) -> None:
    """Every supported pipeline with a Mooncake stage, built from the config as the connector builds it: blocks
    round-trip bit-exact; the stage sits where the pipeline names it and holds encoded payloads where
    ENCODED_PAYLOAD_PIPELINES says; a pipeline built without a segment (the scheduler's) only reads others'."""
    from ucm.config import SUPPORTED_PIPELINES, parse_config
    from ucm.store.cache import CacheStore
    from ucm.store.pipeline import ENCODED_PAYLOAD_PIPELINES, build_store

    with MooncakeMaster(tmp / "master.log") as master:
        mooncake = {"master_server_address": master.address, "global_segment_size": "64MB"}
        for n, spec in enumerate(p for p in SUPPORTED_PIPELINES if "Mooncake" in p):
            entry = {"store_pipeline": spec, "storage_backends": str(tmp / f"kv{n}"), "mooncake": mooncake}
            config = parse_config({"ucm_connectors": [{"ucm_connector_config": entry}]}).store
            store = build_store(config, lookup_timeout_s=2.0)
            store.set_namespace(bytes([n + 1]) * 16, {"kv_dtype": "torch.float32"})
            top = spec.split("|")[0]
            assert type(store).__name__ == {"Cache": "CacheStore", "Compress": "CompressStore"}.get(
                top, "MooncakeStore"
            ), (spec, store)
            pool = store
            while not isinstance(pool, MooncakeStore):
                pool = pool._inner if isinstance(pool, CacheStore) else pool.inner
            if spec in ENCODED_PAYLOAD_PIPELINES:
                assert store.encoded_store() is not None, spec
            keys, rows = keys_of(4, spec), rows_of(4, n)
            assert store.dump(keys, rows).result(60).ok, spec
            store.flush()
            assert pool._client.batch_is_exist([pool._name(k) for k in keys]) == [1] * 4, spec
            reader = build_store(config, lookup_timeout_s=2.0, mount_segment=False)
            reader.set_namespace(bytes([n + 1]) * 16, {"kv_dtype": "torch.float32"})
            assert reader.lookup(keys) == 4, spec
            dst = torch.zeros_like(rows)
            assert reader.load(keys, dst).result(60).ok and torch.equal(dst, rows), spec
            reader.close()
            # vLLM's reset of external caches: the DRAM tier dropped, then the namespace removed from every tier.
            assert store.drop_cached() == (4 if spec.startswith("Cache") else 0), spec
            assert store.lookup(keys) == 4, spec
            store.remove_stored(namespace=bytes([n + 1]) * 16)
            assert store.lookup(keys) == 0, spec
            store.close()
            print(f"pipeline {spec}: stored, found and loaded by a client without a segment, reset", flush=True)
        # A client without a segment, alone in the pool: nowhere to put objects (a warning, not stored).
        alone = build_store(
            parse_config(
                {"ucm_connectors": [{"ucm_connector_config": {"store_pipeline": "Mooncake", "mooncake": mooncake}}]}
            ).store,
            mount_segment=False,
        )
        assert not alone.dump(keys_of(2, "alone"), rows_of(2, 9)).result(60).ok
        alone.close()


def case_blocks_stay_in_the_dumping_instance(tmp: Path) -> None:
    """Two instances' pipelines (segments mounted, as the workers build them): each one's dumps are placed in its own
    segment (Mooncake's preferred_segment), so the other reads them from the first one's DRAM."""
    from ucm.config import parse_config
    from ucm.store.pipeline import build_store

    def endpoints(store: MooncakeStore, keys: list[bytes]) -> set[str]:
        descs = [store._client.get_replica_desc(store._name(k))[0] for k in keys]
        return {d.get_memory_descriptor().buffer_descriptor.transport_endpoint for d in descs}

    with MooncakeMaster(tmp / "master.log") as master:
        mooncake = {"master_server_address": master.address, "global_segment_size": "64MB"}
        entry = {"store_pipeline": "Mooncake", "mooncake": mooncake}
        config = parse_config({"ucm_connectors": [{"ucm_connector_config": entry}]}).store
        a, b = build_store(config), build_store(config)
        assert isinstance(a, MooncakeStore) and isinstance(b, MooncakeStore)
        keys_a, keys_b = keys_of(16, "a"), keys_of(16, "b")
        assert a.dump(keys_a, rows_of(16, 1)).result(60).ok and b.dump(keys_b, rows_of(16, 2)).result(60).ok
        where_a, where_b = endpoints(a, keys_a), endpoints(b, keys_b)
        assert len(where_a) == 1 and len(where_b) == 1 and where_a != where_b, (where_a, where_b)
        dst = torch.zeros((16, ROW), dtype=torch.uint8)
        assert b.load(keys_a, dst).result(60).ok and torch.equal(dst, rows_of(16, 1))
        a.close()
        b.close()


def case_master_absent_at_start(tmp: Path) -> None:
    """``Mooncake|Posix`` built while no master answers: it starts (one warning) and serves from Posix; once a
    master answers on the configured address the stage joins the pool by itself and puts blocks there."""
    from ucm.config import parse_config
    from ucm.store.pipeline import build_store

    master = MooncakeMaster(tmp / "master.log")
    master.kill()  # its address is in the config; nothing answers there yet
    entry = {
        "store_pipeline": "Mooncake|Posix",
        "storage_backends": str(tmp / "kv"),
        "mooncake": {"master_server_address": master.address, "global_segment_size": "64MB"},
    }
    t0 = time.monotonic()
    store = build_store(parse_config({"ucm_connectors": [{"ucm_connector_config": entry}]}).store, lookup_timeout_s=2)
    assert isinstance(store, MooncakeStore) and time.monotonic() - t0 < 30
    keys, rows = keys_of(4, "absent"), rows_of(4, 11)
    assert store.dump(keys[:2], rows[:2]).result(60).ok  # into Posix only
    store.flush()
    assert store.lookup(keys) == 2
    dst, failed = load(store, keys[:2])
    assert failed == frozenset() and torch.equal(dst, rows[:2])
    master.start()
    deadline = time.monotonic() + 60
    while store._client is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert store._client is not None, "the stage did not join the pool within 60 s of the master's start"
    print(f"joined the pool {time.monotonic() - t0:.1f} s after start", flush=True)
    assert store.dump(keys[2:], rows[2:]).result(60).ok
    assert store._client.batch_is_exist([store._name(k) for k in keys[2:]]) == [1, 1]
    store.close()
    master.kill()


def case_no_master(tmp: Path) -> None:
    """No master at the address: the stage is refused at start with an error naming the address."""
    t0 = time.monotonic()
    try:
        connect("127.0.0.1:9", global_segment_size=0, timeout_s=10)
    except UcmMooncakeError as exc:
        assert "127.0.0.1:9" in str(exc) and "start mooncake_master there" in str(exc), exc
    else:
        raise AssertionError("connect to a port without a master succeeded")
    print(f"refused in {time.monotonic() - t0:.2f} s", flush=True)


CASES: dict[str, Callable[[Path], None]] = {
    name.removeprefix("case_"): fn for name, fn in globals().items() if name.startswith("case_")
}


def main() -> None:
    role, arg = sys.argv[1], sys.argv[2]
    if role == "reader":
        reader(arg)
    elif role == "holder":
        holder(arg)
    else:
        CASES[role](Path(arg))
        print(f"case {role} ok", flush=True)


if __name__ == "__main__":
    main()
