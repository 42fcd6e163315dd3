"""Build a store pipeline from its config string (``Cache|Posix``, ``Cache|Compress|Posix``, ``Cache|Mooncake|Posix``,
... :data:`~ucm.config.SUPPORTED_PIPELINES`), top stage first.

Within one process, every caller with the same config gets the same pipeline object (:func:`shared_store`), so
vLLM's scheduler-side lookups see the DRAM cache that the worker in the same process fills.

Stacking is checked through the store contract, not by stage class: ``Compress`` stores encoded (variable-size)
payloads in the stage below it, so that stage must hold them (its
:meth:`~ucm.store.base.UcmKVStoreBase.encoded_store` is not ``None``); otherwise the build fails with a config error
naming the stage below and the ones allowed there.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any

from ucm.config import SUPPORTED_PIPELINES, UcmPipelineStoreConfig
from ucm.logger import init_logger
from ucm.store.base import UcmKVStoreBase
from ucm.store.cache import CacheStore
from ucm.store.compress import CompressStore
from ucm.store.mooncake import MooncakeMasterUnreachable, MooncakeStore, connect
from ucm.store.posix import PosixStore

logger = init_logger(__name__)

# What may sit directly below Compress: pipelines whose top stage holds encoded payloads (Posix stores them; Cache
# passes them through to its stage below). Named in the error of a stage below Compress that cannot;
# tests/store/test_pipeline.py checks each against the stages' encoded_store().
ENCODED_PAYLOAD_PIPELINES = ("Posix", "Cache|Posix", "Mooncake|Posix", "Mooncake")
# Most seconds a Mooncake lookup waits for the pool when the connector gives no bound.
MOONCAKE_LOOKUP_TIMEOUT_S = 5.0


def _warn_if_larger_than_memory(capacity_bytes: int) -> None:
    """Warn when the DRAM cache may grow beyond the machine's memory (it fills lazily, so start-up succeeds)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: nothing to compare with
        return
    if capacity_bytes > total:
        logger.warning(
            "cache_buffer_capacity_gb=%.1f is more than this machine's memory (%.1f GiB); the DRAM cache fills "
            "as blocks arrive and may run the process out of memory",
            capacity_bytes / 2**30,
            total / 2**30,
        )


def build_store(
    config: UcmPipelineStoreConfig,
    require_writable: bool = True,
    lookup_timeout_s: float | None = None,
    mount_segment: bool = True,
) -> UcmKVStoreBase:
    """A new pipeline for ``config.store_pipeline``, built bottom-up.

    ``require_writable=False`` (a ``kv_consumer``, which only loads) accepts read-only storage directories.
    ``lookup_timeout_s``: the Posix and Mooncake stages' bound on one lookup (``load_timeout_ms``; ``None``: Posix
    unbounded, see :class:`~ucm.store.posix.PosixStore`; Mooncake :data:`MOONCAKE_LOOKUP_TIMEOUT_S`).
    ``mount_segment``: the Mooncake stage's client mounts ``global_segment_size`` bytes into the pool (the worker's
    pipeline); False: none (the scheduler's, which only looks up).

    Raises:
        ValueError: an unknown stage name (the config schema already refuses these), a stage below ``Compress`` that
            cannot hold encoded payloads, or a bad storage path.
        UcmMooncakeError: the Mooncake stage's client is not installed or its setup failed (no master answering is
            not an error: the stage joins the pool when one does, see :mod:`ucm.store.mooncake`).
    """
    stages = config.store_pipeline.split("|")
    if config.store_pipeline not in SUPPORTED_PIPELINES:
        raise ValueError(f"store_pipeline {config.store_pipeline!r}: allowed {list(SUPPORTED_PIPELINES)}")
    store: UcmKVStoreBase | None = None
    for index in range(len(stages) - 1, -1, -1):
        stage = stages[index]
        if stage == "Posix":
            store = PosixStore(
                config.storage_dirs,
                io_threads=config.posix_io_threads,
                capacity_bytes=config.posix_capacity_bytes,
                io_direct=config.io_direct,
                io_engine=config.posix_io_engine,
                require_writable=require_writable,
                lookup_timeout_s=lookup_timeout_s,
            )
        elif stage == "Compress":
            store = CompressStore(
                _holding_encoded_payloads(config.store_pipeline, stages[index + 1 :], store),
                mode=config.compress_mode,
                compress_ratio=config.compress_ratio,
                data_type=config.data_type,
                threads=config.decompress_thread_num,
            )
        elif stage == "Mooncake":
            assert config.mooncake is not None  # the schema requires it with a Mooncake stage
            rejoin = functools.partial(_mooncake_client, config, mount_segment)
            try:
                client = rejoin()
            except MooncakeMasterUnreachable as exc:
                logger.warning("Mooncake stage starts without the pool, joining it once the master answers: %s", exc)
                client = None
            except Exception:
                if store is not None:
                    store.close()
                raise
            store = MooncakeStore(
                client,
                store,
                timeout_s=lookup_timeout_s or MOONCAKE_LOOKUP_TIMEOUT_S,
                # This instance's blocks in its own segment while it has room (others read them from there).
                prefer_own_segment=mount_segment and config.mooncake.global_segment_size > 0,
                rejoin=rejoin,
            )
        elif stage == "Cache":
            _warn_if_larger_than_memory(config.cache_buffer_capacity_bytes)
            store = CacheStore(store, config.cache_buffer_capacity_bytes, config.cache_prefault_bytes)
        else:  # pragma: no cover - refused by the schema
            raise ValueError(f"unknown store stage {stage!r}; allowed: Cache, Compress, Mooncake, Posix")
    assert store is not None
    return store


def _mooncake_client(config: UcmPipelineStoreConfig, mount_segment: bool) -> Any:
    """A set-up Mooncake client for the stage (one info line says where it joined the pool)."""
    mc = config.mooncake
    assert mc is not None
    segment = mc.global_segment_size if mount_segment else 0
    client = connect(
        mc.master_server_address,
        local_hostname=mc.hostname,
        metadata_server=mc.metadata_server,
        protocol=mc.protocol,
        device_name=mc.device_name,
        global_segment_size=segment,
        local_buffer_size=mc.local_buffer_size,
    )
    logger.info(
        "Mooncake stage: joined the pool of master %s as %s (%s, segment %.2f GiB of this process's DRAM)",
        mc.master_server_address,
        mc.hostname,
        mc.protocol,
        segment / 2**30,
    )
    return client


def _holding_encoded_payloads(pipeline: str, below: list[str], store: UcmKVStoreBase | None) -> UcmKVStoreBase:
    """``store`` (the stages ``below`` of ``pipeline``, already built) when it can hold the encoded payloads of a
    ``Compress`` stage above it.

    Raises:
        ValueError: it cannot (its ``encoded_store()`` is ``None``) or there is nothing below; the stages built are
            closed first. The message names the stages below and the pipelines allowed there.
    """
    if store is not None and store.encoded_store() is not None:
        return store
    if store is not None:
        store.close()
    found = repr("|".join(below)) if below else "nothing"
    raise ValueError(
        f"store_pipeline {pipeline!r}: the Compress stage stores encoded payloads in the stage below it, and {found} "
        f"there cannot hold them; allowed below Compress: {', '.join(map(repr, ENCODED_PAYLOAD_PIPELINES))}"
    )


_shared: dict[str, tuple[UcmKVStoreBase, int]] = {}
_shared_lock = threading.Lock()


def _shared_key(config: UcmPipelineStoreConfig, require_writable: bool) -> str:
    return f"{config.model_dump_json()}|{require_writable}"


def shared_store(
    config: UcmPipelineStoreConfig,
    require_writable: bool = True,
    lookup_timeout_s: float | None = None,
    mount_segment: bool = True,
) -> UcmKVStoreBase:
    """The process-wide pipeline for ``config`` (built on first use; reference counted); ``require_writable``,
    ``lookup_timeout_s`` and ``mount_segment`` as in :func:`build_store` (the first caller's hold: the connector's
    two roles in one process pass the same timeout, and vLLM builds the worker's connector, which mounts the
    segment, before the scheduler's).

    Pair each call with :func:`release_shared_store`; the last release closes the pipeline (flushing write-backs).
    """
    key = _shared_key(config, require_writable)
    with _shared_lock:
        store, refs = _shared.get(key, (None, 0))
        if store is None:
            store = build_store(config, require_writable, lookup_timeout_s, mount_segment)
        _shared[key] = (store, refs + 1)
        return store


def release_shared_store(config: UcmPipelineStoreConfig, require_writable: bool = True) -> None:
    """Drop one reference taken by :func:`shared_store`; close the pipeline when none is left."""
    key = _shared_key(config, require_writable)
    with _shared_lock:
        if key not in _shared:
            return
        store, refs = _shared[key]
        if refs > 1:
            _shared[key] = (store, refs - 1)
            return
        del _shared[key]
    store.close()
