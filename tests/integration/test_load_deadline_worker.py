"""The worker's deadline (``load_timeout_ms``) without an engine, on a real hung store: a Posix store on a FUSE
passthrough mount (``ucm.testing.fusefs``) whose daemon is stopped with SIGSTOP, so every ``open`` blocks as on a
dead NFS server. Real paged tensors, filled with NaN so that any block the worker writes shows.

- A load past the deadline returns (blockwise: ``start_load_kv``; layerwise: ``wait_for_layer_load``, once for the
  whole load) within the deadline plus a margin; every block is reported through
  ``get_block_ids_with_load_errors`` and as a failed key to the scheduler; nothing is written into the paged KV,
  also after the daemon resumes and the late reads land (they land in the abandoned staging buffer); the next load
  uses a new staging buffer and writes the right bytes.
- A durable dump past the deadline returns too, keeps its staging buffer until the store is done, and the blocks are
  stored once the daemon resumes.

The engine-level test (outputs identical, vLLM recomputing) is ``tests/faults/test_stalled_mount.py``.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.integration.helpers import paged_caches
from ucm.integration.vllm.engine_info import KVSpec
from ucm.integration.vllm.metadata import BlockTransfer, UCMConnectorMetadata
from ucm.integration.vllm.worker import UCMWorker
from ucm.kernels.layouts import KVLayout
from ucm.store.observe import Observation, Recorder
from ucm.store.posix import PosixStore
from ucm.testing import fusefs

pytestmark = pytest.mark.skipif(
    not os.path.exists("/dev/fuse"), reason="/dev/fuse is absent: no FUSE mount can be made"
)

LAYERS = ("l0", "l1", "l2")
BLOCK_SIZE, HEADS, DIM, NUM_BLOCKS = 16, 2, 8, 8
SPEC = KVSpec(LAYERS, BLOCK_SIZE, HEADS, DIM, torch.bfloat16)
KEYS = [bytes([i + 1]) * 16 for i in range(3)]
SOURCE_IDS, TARGET_IDS = [1, 4, 6], [7, 0, 3]
TIMEOUT_S = 0.5
MARGIN_S = 2.0


def _caches(seed: int | None) -> dict[str, torch.Tensor]:
    return paged_caches(SPEC, NUM_BLOCKS, seed)


def _worker(store: PosixStore, caches: dict[str, torch.Tensor], layerwise: bool, buffer_blocks: int = 4) -> UCMWorker:
    worker = UCMWorker(
        SPEC,
        store,
        lambda _c: KVLayout.CPU_ATTN,
        layerwise=layerwise,
        load_buffer_blocks=buffer_blocks,
        load_timeout_s=TIMEOUT_S,
    )
    worker.register_kv_caches(caches)
    return worker


def _untouched(caches: dict[str, torch.Tensor]) -> bool:
    return all(bool(caches[n][TARGET_IDS].isnan().all()) for n in LAYERS)


def _written(caches: dict[str, torch.Tensor], source: dict[str, torch.Tensor]) -> bool:
    return all(
        torch.equal(caches[n][TARGET_IDS].view(torch.int16), source[n][SOURCE_IDS].view(torch.int16)) for n in LAYERS
    )


@pytest.fixture
def hung(tmp_path: Path) -> Iterator[tuple[PosixStore, dict[str, torch.Tensor], int]]:
    """A Posix store on a FUSE mount holding the 3 source blocks; yields it, the source caches and the daemon's pid.
    The daemon is resumed and the mount removed whatever the test did."""
    reason = fusefs.unavailable_reason()
    if reason is not None:
        pytest.fail(f"/dev/fuse exists but FUSE cannot be used: {reason} (make setup installs it)")
    (tmp_path / "source").mkdir()
    with fusefs.mount(tmp_path / "source", tmp_path / "mnt", attr_timeout_s=600) as daemon:
        store = PosixStore(str(tmp_path / "mnt"), lookup_timeout_s=TIMEOUT_S)  # as the connector builds it
        try:
            source = _caches(seed=1)
            writer = _worker(store, source, layerwise=False)
            writer.wait_for_save(UCMConnectorMetadata(dumps=[BlockTransfer("r0", KEYS, SOURCE_IDS)]))
            writer.shutdown()
            assert store.lookup(KEYS) == len(KEYS)
            yield store, source, daemon.pid
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
            store.close()


@pytest.mark.parametrize("layerwise", [False, True], ids=["blockwise", "layerwise"])
def test_load_past_the_deadline_fails_every_block_and_never_writes_late(hung, ucm_lines, layerwise) -> None:
    store, source, pid = hung
    caches = _caches(seed=None)
    worker = _worker(store, caches, layerwise)
    seen: list[Observation] = []
    worker.recorder = Recorder()
    worker.recorder.add_sink(seen.append)
    first_buffer = worker._load_buffer
    meta = UCMConnectorMetadata(loads=[BlockTransfer("r1", KEYS, TARGET_IDS)])
    with fusefs.stopped(pid):
        t0 = time.monotonic()
        worker.start_load_kv(meta)
        for n in LAYERS:  # layerwise: the first layer waits out the deadline, the others return at once
            worker.wait_for_layer_load(n)
        worker.wait_for_save(meta)
        assert TIMEOUT_S <= time.monotonic() - t0 < TIMEOUT_S + MARGIN_S
        assert worker.get_block_ids_with_load_errors() == set(TARGET_IDS)
        worker_meta = worker.take_worker_meta()
        assert worker_meta is not None and worker_meta.failed_keys == KEYS
        assert _untouched(caches)
        assert worker._load_buffer is not first_buffer  # left to the late reads
        timeouts = [ln for ln in ucm_lines if "did not finish within load_timeout_ms" in ln]
        assert len(timeouts) == 1 and timeouts[0].startswith("WARNING load of 3 blocks"), ucm_lines
        assert f"({TIMEOUT_S * 1e3:.0f} ms)" in timeouts[0]
        # vllm:ucm_load_failures_total{tier="all", cause="timeout"} counts them
        assert [o for o in seen if o.op == "load_failure"] == [
            Observation("load_failure", "all", len(KEYS), cause="timeout", requests=("r1",))
        ]
    # The late reads land in the abandoned buffer, never in the paged KV.
    assert first_buffer is not None
    want = torch.empty(len(KEYS), SPEC.block_nbytes, dtype=torch.uint8)
    assert store.load(KEYS, want).result(10).ok  # the stored canonical blocks
    late = first_buffer[: len(KEYS)].view(torch.uint8).view(len(KEYS), -1)
    deadline = time.monotonic() + 10
    while not torch.equal(late, want):
        assert time.monotonic() < deadline, "the late reads never landed in the abandoned buffer"
        time.sleep(0.05)
    assert _untouched(caches)
    # The next load reads into a fresh buffer and writes the right bytes.
    worker.start_load_kv(meta)
    for n in LAYERS:
        worker.wait_for_layer_load(n)
    worker.wait_for_save(meta)
    assert worker.get_block_ids_with_load_errors() == set()
    assert _written(caches, source)
    worker.shutdown()


def test_durable_dump_past_the_deadline_returns_and_stores_later(hung, ucm_lines, tmp_path) -> None:
    store, _source, pid = hung
    caches = _caches(seed=2)
    worker = _worker(store, caches, layerwise=False)
    keys = [bytes([0xA0 + i]) * 16 for i in range(2)]
    meta = UCMConnectorMetadata(dumps=[BlockTransfer("p1", keys, [2, 5], durable=True)])
    with fusefs.stopped(pid):
        t0 = time.monotonic()
        worker.wait_for_save(meta)
        assert TIMEOUT_S <= time.monotonic() - t0 < TIMEOUT_S + MARGIN_S
        timeouts = [ln for ln in ucm_lines if "durable dump of 2 blocks did not finish within load_timeout_ms" in ln]
        assert len(timeouts) == 1, ucm_lines
        assert len(worker._pending_dumps) == 1  # its staging buffer stays with the store's task
    worker.shutdown()  # waits for the pending dump
    assert store.lookup(keys) == 2


def test_a_load_in_rounds_past_the_deadline_fails_every_block(hung, ucm_lines) -> None:
    """Blockwise, a load larger than the load buffer runs in rounds: the deadline bounds them all together, and a
    round past it fails its blocks and every later round's."""
    store, source, pid = hung
    caches = _caches(seed=None)
    worker = _worker(store, caches, layerwise=False, buffer_blocks=2)  # 3 blocks: two rounds
    meta = UCMConnectorMetadata(loads=[BlockTransfer("r1", KEYS, TARGET_IDS)])
    with fusefs.stopped(pid):
        t0 = time.monotonic()
        worker.start_load_kv(meta)
        assert TIMEOUT_S <= time.monotonic() - t0 < TIMEOUT_S + MARGIN_S
        assert worker.get_block_ids_with_load_errors() == set(TARGET_IDS)
        assert _untouched(caches)
        timeouts = [ln for ln in ucm_lines if "did not finish within load_timeout_ms" in ln]
        assert len(timeouts) == 1 and timeouts[0].startswith("WARNING load of 3 blocks"), ucm_lines
    worker.start_load_kv(meta)
    assert worker.get_block_ids_with_load_errors() == set()
    assert _written(caches, source)
    assert worker._load_buffer is not None and worker._load_buffer.shape[0] == 2  # not grown to the load's size
    worker.shutdown()
