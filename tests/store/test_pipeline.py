"""Store pipelines: build_store stacks the stages; shared_store shares one pipeline per config, reference counted."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.store.blocks import make_blocks, make_keys, poisoned
from tests.store.helpers import Closer
from ucm.config import UcmPipelineStoreConfig, parse_config
from ucm.store import pipeline
from ucm.store.cache import CacheStore
from ucm.store.compress import CompressStore
from ucm.store.pipeline import build_store, release_shared_store, shared_store
from ucm.store.posix import PosixStore

NBYTES = 4099  # odd block size


def store_config(
    tmp_path: Path, pipeline_spec: str = "Cache|Posix", dirs: str = "kv", **extra: object
) -> UcmPipelineStoreConfig:
    backends = ":".join(str(tmp_path / d) for d in dirs.split(":"))
    cfg = parse_config(
        {
            "ucm_connectors": [
                {"ucm_connector_config": {"store_pipeline": pipeline_spec, "storage_backends": backends, **extra}}
            ]
        }
    )
    return cfg.store


@pytest.fixture(autouse=True)
def no_leftover_shared_stores() -> Iterator[None]:
    """Each test starts and ends with no shared pipeline (a leak would make later tests share a store)."""
    assert not pipeline._shared
    yield
    leftovers = list(pipeline._shared.values())
    pipeline._shared.clear()
    for store, _ in leftovers:
        store.close()
    assert not leftovers, "a test did not release its shared stores"


# -- build_store -----------------------------------------------------------------------------------------------------


def test_build_cache_over_posix(tmp_path: Path) -> None:
    cfg = store_config(tmp_path, "Cache|Posix", dirs="a:b", cache_buffer_capacity_gb=0.25, posix_io_threads=2)
    store = build_store(cfg)
    try:
        assert isinstance(store, CacheStore)
        assert store.capacity_bytes == (1 << 30) // 4
        inner = store._inner
        assert isinstance(inner, PosixStore)
        assert inner.dirs == [str(tmp_path / "a"), str(tmp_path / "b")]
        assert (tmp_path / "a").is_dir() and (tmp_path / "b").is_dir()
    finally:
        store.close()


def test_build_posix_only(tmp_path: Path) -> None:
    store = build_store(store_config(tmp_path, "Posix"))
    try:
        assert isinstance(store, PosixStore)
        assert store.dirs == [str(tmp_path / "kv")]
    finally:
        store.close()


@pytest.mark.parametrize("spec", ["Cache|Compress|Posix", "Compress|Posix"])
def test_build_compress_pipelines_round_trip_across_restart(tmp_path: Path, spec: str) -> None:
    cfg = store_config(tmp_path, spec, compress_mode="fixed_rate", compress_ratio=16, decompress_thread_num=2)
    keys = make_keys(3, seed=21)
    # bf16 values of a normal distribution (random bytes would hold NaNs: stored lossless)
    blocks = torch.randn(3, 2048, generator=torch.Generator().manual_seed(21)).to(torch.bfloat16).view(torch.uint8)
    store = build_store(cfg)
    try:
        compress = store._inner if spec.startswith("Cache") else store  # type: ignore[attr-defined]
        assert isinstance(compress, CompressStore)
        assert isinstance(compress.inner, PosixStore)
        assert store.wait(store.dump(keys, blocks)).ok
        store.flush()
    finally:
        store.close()
    # A restart with the default (lossless) settings reads the fixed-rate blocks as they were stored.
    again = build_store(store_config(tmp_path, spec))
    try:
        dst = poisoned(3, blocks.shape[1])
        assert again.wait(again.load(keys, dst)).ok
        x, y = blocks.view(torch.bfloat16).float(), dst.view(torch.bfloat16).float()
        assert not torch.equal(x, y)
        assert float(((x - y).pow(2).mean() / x.pow(2).mean()).sqrt()) < 0.015
    finally:
        again.close()


def test_build_refuses_an_unknown_pipeline(tmp_path: Path) -> None:
    # The schema refuses it first; build_store checks again for configs built without validation.
    cfg = UcmPipelineStoreConfig.model_construct(store_pipeline="Cache|Disk", storage_backends=str(tmp_path))
    with pytest.raises(ValueError, match=re.escape("Cache|Disk")):
        build_store(cfg)


# -- stacking through the contract: what may sit below Compress ------------------------------------------------------


@pytest.mark.parametrize("spec", [s for s in pipeline.ENCODED_PAYLOAD_PIPELINES if "Mooncake" not in s])
def test_pipelines_named_as_holding_encoded_payloads_do(tmp_path: Path, spec: str, close_after: Closer) -> None:
    """The list the stacking error names is what the stages answer: Posix stores encoded payloads itself, a Cache over
    it passes them through to it (uncached). (The Mooncake entries need a master: tests/store/mooncake_cases.py,
    case pipelines_from_config.)"""
    store = close_after(build_store(store_config(tmp_path, spec)))
    below = store._inner if isinstance(store, CacheStore) else store
    assert isinstance(below, PosixStore)
    assert store.encoded_store() is below


def test_stages_keeping_canonical_blocks_hold_no_encoded_payloads(tmp_path: Path, close_after: Closer) -> None:
    assert close_after(CacheStore(None, 1 << 20)).encoded_store() is None  # DRAM only: nothing below to pass to
    assert close_after(build_store(store_config(tmp_path, "Compress|Posix"))).encoded_store() is None


def test_compress_over_a_stage_without_encoded_payloads_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stacking the schema does not list yet (here Compress over a DRAM-only Cache) is checked through the
    contract when the pipeline is built: the error names the stages below and the ones allowed there."""
    monkeypatch.setattr(pipeline, "SUPPORTED_PIPELINES", ("Compress|Cache",))
    cfg = store_config(tmp_path, "Posix").model_copy(update={"store_pipeline": "Compress|Cache"})
    message = (
        "store_pipeline 'Compress|Cache': the Compress stage stores encoded payloads in the stage below it, and "
        "'Cache' there cannot hold them; allowed below Compress: 'Posix', 'Cache|Posix', 'Mooncake|Posix', 'Mooncake'"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        build_store(cfg)


def test_compress_stacks_over_cache_over_posix_without_class_checks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, close_after: Closer
) -> None:
    """Compress|Cache|Posix (not a supported pipeline, but allowed by the contract): the Cache passes the encoded
    payloads through to the Posix stage, uncached, and blocks round-trip bit-exact."""
    monkeypatch.setattr(pipeline, "SUPPORTED_PIPELINES", ("Compress|Cache|Posix",))
    cfg = store_config(tmp_path, "Cache|Compress|Posix").model_copy(update={"store_pipeline": "Compress|Cache|Posix"})
    store = close_after(build_store(cfg))
    assert isinstance(store, CompressStore) and isinstance(store.inner, CacheStore)
    keys = make_keys(3, seed=31)
    blocks = torch.randn(3, 2048, generator=torch.Generator().manual_seed(31)).to(torch.bfloat16).view(torch.uint8)
    assert store.wait(store.dump(keys, blocks)).ok
    assert store.inner.cached_keys() == []  # passed through, not cached
    dst = poisoned(3, blocks.shape[1])
    assert store.wait(store.load(keys, dst)).ok and torch.equal(dst, blocks)
    assert store.lookup(keys) == 3


def test_build_each_call_is_a_new_pipeline(tmp_path: Path) -> None:
    cfg = store_config(tmp_path)
    a, b = build_store(cfg), build_store(cfg)
    try:
        assert a is not b
    finally:
        a.close()
        b.close()


# -- shared_store ----------------------------------------------------------------------------------------------------


def test_shared_store_same_object_for_equal_configs(tmp_path: Path) -> None:
    cfg_a = store_config(tmp_path)
    cfg_b = store_config(tmp_path)  # equal, not the same object
    assert cfg_a is not cfg_b and cfg_a == cfg_b
    a = shared_store(cfg_a)
    b = shared_store(cfg_b)
    try:
        assert a is b
    finally:
        release_shared_store(cfg_a)
        release_shared_store(cfg_b)


def test_shared_store_differs_for_other_dirs(tmp_path: Path) -> None:
    cfg_a = store_config(tmp_path, dirs="one")
    cfg_b = store_config(tmp_path, dirs="two")
    a = shared_store(cfg_a)
    b = shared_store(cfg_b)
    try:
        assert a is not b
        assert a._inner.dirs != b._inner.dirs  # type: ignore[attr-defined]
    finally:
        release_shared_store(cfg_a)
        release_shared_store(cfg_b)


def test_shared_store_differs_for_other_pipeline(tmp_path: Path) -> None:
    cfg_a = store_config(tmp_path, "Cache|Posix")
    cfg_b = store_config(tmp_path, "Posix")
    a = shared_store(cfg_a)
    b = shared_store(cfg_b)
    try:
        assert a is not b
        assert isinstance(a, CacheStore) and isinstance(b, PosixStore)
    finally:
        release_shared_store(cfg_a)
        release_shared_store(cfg_b)


def test_release_closes_after_the_last_reference(tmp_path: Path) -> None:
    cfg = store_config(tmp_path)
    first = shared_store(cfg)
    assert shared_store(cfg) is first
    keys = make_keys(1, 0)

    release_shared_store(cfg)  # one reference left: still open
    first.lookup(keys)
    assert first.wait(first.dump(keys, make_blocks(1, NBYTES, 0))).ok

    release_shared_store(cfg)  # last reference: closed
    with pytest.raises(RuntimeError, match="closed"):
        first.dump(keys, make_blocks(1, NBYTES, 0))

    again = shared_store(cfg)  # a later call builds a new pipeline
    try:
        assert again is not first
        assert again.lookup(keys) == 1  # ... over the same files
    finally:
        release_shared_store(cfg)


def test_release_without_shared_store_is_a_no_op(tmp_path: Path) -> None:
    release_shared_store(store_config(tmp_path))


# -- data through the pipeline ---------------------------------------------------------------------------------------


def test_cache_posix_round_trip_then_fresh_posix_store(tmp_path: Path) -> None:
    cfg = store_config(tmp_path, "Cache|Posix", dirs="a:b")
    keys = make_keys(5, 1)
    src = make_blocks(5, NBYTES, 1)
    store = shared_store(cfg)
    try:
        assert store.lookup(keys) == 0
        task = store.dump(keys, src)
        assert store.wait(task).ok
        assert store.lookup(keys) == 5
        dst = poisoned(5, NBYTES)
        assert store.wait(store.load(keys, dst)).ok
        assert torch.equal(dst, src)
    finally:
        release_shared_store(cfg)  # flushes write-backs and closes

    # Another process's view: a plain PosixStore over the same directories reads every written-back block.
    posix = PosixStore(cfg.storage_dirs, io_threads=2)
    try:
        assert posix.lookup(keys) == 5
        dst = poisoned(5, NBYTES)
        result = posix.wait(posix.load(keys, dst))
        assert result.ok, result.failed
        assert torch.equal(dst, src)
    finally:
        posix.close()


def test_posix_pipeline_round_trip(tmp_path: Path) -> None:
    cfg = store_config(tmp_path, "Posix")
    keys = make_keys(3, 2)
    src = make_blocks(3, NBYTES, 2)
    store = shared_store(cfg)
    try:
        assert store.wait(store.dump(keys, src)).ok
        dst = poisoned(3, NBYTES)
        assert store.wait(store.load(keys, dst)).ok
        assert torch.equal(dst, src)
    finally:
        release_shared_store(cfg)
