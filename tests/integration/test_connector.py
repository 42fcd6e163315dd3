"""UCMConnector in the real vLLM engine (CPU build), each engine a fresh process, the store real files on disk.

One cold engine fills the store; a restarted engine and a concurrent second instance on the same directory load
it. The tiny float32 model keeps runs fast and bit-stable (bf16 on CPU is not batch-invariant); greedy tokens are
compared exactly. Hit counts come from UCM's per-request log line.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import assert_same_output, ucm_extra_config
from ucm.testing.engine import RequestResult, failed_loads, run_engine, ucm_transfer_config
from ucm.testing.texts import prompt_of_tokens

pytestmark = pytest.mark.engine

BLOCK_SIZE = 128  # vLLM's CPU default
P1_TOKENS = 600  # 4 full blocks + a partial one
P2_EXTRA_TOKENS = 200  # P2 = P1 + more text: 800 tokens, 6 full blocks, the first 4 shared with P1
MAX_TOKENS = 12
PREFAULT_GB = 0.01  # cache_prefault_gb of the restarted engine


@pytest.fixture(scope="module")
def prompts(tokenizer) -> dict[str, str]:
    long = prompt_of_tokens(tokenizer, P1_TOKENS + P2_EXTRA_TOKENS)
    ids = tokenizer.encode(long, add_special_tokens=False)
    p1 = tokenizer.decode(ids[:P1_TOKENS])
    p2 = tokenizer.decode(ids[: P1_TOKENS + P2_EXTRA_TOKENS])
    assert p2.startswith(p1)
    return {"p1": p1, "p2": p2}


def _spec(model: Path, store: Path, requests: list[dict], kv_role: str = "kv_both") -> dict:
    return {
        "model": str(model),
        "dtype": "float32",
        "max_model_len": 2048,
        "connector": ucm_transfer_config(ucm_extra_config(store), kv_role),
        "requests": [{"max_tokens": MAX_TOKENS, **r} for r in requests],
    }


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ucm_store")


@pytest.fixture(scope="module")
def cold(tiny_model, store, prompts) -> list[RequestResult]:
    """First engine: P1, P1 under another cache_salt, and P2 under a salt (its recompute baseline)."""
    results, _ = run_engine(
        _spec(
            tiny_model,
            store,
            [
                {"prompt": prompts["p1"]},
                {"prompt": prompts["p1"], "cache_salt": "tenant-b"},
                {"prompt": prompts["p2"], "cache_salt": "baseline"},
            ],
        )
    )
    return results


@pytest.fixture(scope="module")
def restarted(tiny_model, store, prompts, cold) -> tuple[list[RequestResult], list[RequestResult], str, str]:
    """A restarted engine (in vLLM's own process layout) and, at the same time, a second instance (UCM's defaults),
    both on the cold engine's store: the results of both and the stderr of both."""
    second: dict[str, Any] = {}

    def run_second() -> None:
        second["results"], second["stderr"] = run_engine(_spec(tiny_model, store, [{"prompt": prompts["p1"]}]))
        assert failed_loads(second["stderr"]) == 0

    thread = threading.Thread(target=run_second)
    thread.start()
    spec = _spec(
        tiny_model,
        store,
        [
            {"prompt": prompts["p1"]},
            {"prompt": prompts["p2"], "reset_prefix_cache": True},
            {"prompt": prompts["p1"], "cache_salt": "tenant-b", "reset_prefix_cache": True},
            {"prompt": prompts["p1"], "cache_salt": "tenant-c", "reset_prefix_cache": True},
        ],
    )
    # vLLM's own process layout (a separate engine-core process, as LLM(...) and `vllm serve` run by default);
    # the other engines here run it in-process (ucm.testing.engine), so outputs are also compared across the two.
    spec["engine_core_process"] = True
    # Its Cache stage prefaults slots at start: the restart's hits are promoted into those.
    spec["connector"]["kv_connector_extra_config"]["ucm_connectors"][0]["ucm_connector_config"]["cache_prefault_gb"] = (
        PREFAULT_GB
    )
    results, stderr = run_engine(spec)
    thread.join()
    return results, second["results"], stderr, second["stderr"]


def test_cold_engine_misses_and_fills_store(cold, store):
    assert [r.hit_external for r in cold] == [0, 0, 0]
    assert [r.total_blocks for r in cold] == [4, 4, 6]
    files = list(store.rglob("*.ucmb"))
    # P1 (4 blocks), P1 salted (4), P2 salted (6): distinct keys, all written back to disk.
    assert len(files) == 14
    assert not list(store.rglob("*.tmp"))


def test_restart_loads_prefix_and_output_is_identical(cold, restarted):
    results, _, stderr, _ = restarted
    assert failed_loads(stderr) == 0  # the hits below were really loaded, not recomputed after a failed load
    assert results[0].hit_external == 4 and results[0].hit_hbm == 0
    assert_same_output(results[0], cold[0])
    prefaulted = re.findall(r"Cache stage: prefaulted (\d+) slots of (\d+) bytes", stderr)
    assert len(prefaulted) == 1, stderr[-3000:]  # the worker's store only (the scheduler's is not prepared)
    count, nbytes = int(prefaulted[0][0]), int(prefaulted[0][1])
    assert count == int(PREFAULT_GB * 2**30) // nbytes > -(-2048 // BLOCK_SIZE)  # more than one request's blocks
    # The load buffer was paged in at start, sized for one request of max_model_len (2048) tokens, and so was the
    # dumps' staging arena, of twice those blocks: all the host memory dumps in flight hold.
    registered = re.findall(
        r"block (\d+) tokens, ([\d.]+) MiB per block, .* load buffer of (\d+) blocks, .* dump staging arena of "
        r"(\d+) blocks, (\d+) MiB",
        stderr,
    )
    assert len(registered) == 1, stderr[-3000:]
    block_size, block_mib, load_blocks, dump_blocks, arena_mib = registered[0]
    request_blocks = -(-2048 // int(block_size))
    assert int(load_blocks) == request_blocks
    assert int(dump_blocks) == 2 * request_blocks
    assert int(arena_mib) == round(int(dump_blocks) * float(block_mib))
    if len(os.sched_getaffinity(0)) > 1:  # vLLM binds the worker's main thread to one core; UCM's threads are not
        assert "[UC][I] UCM threads run on CPUs 0-" in stderr


def test_partial_prefix_hit(cold, restarted):
    results, _, _, _ = restarted
    p2 = results[1]
    assert (p2.total_blocks, p2.hit_hbm, p2.hit_external) == (6, 0, 4)
    assert_same_output(p2, cold[2])  # same tokens as P2 recomputed from scratch (salted, no hit)


def test_cache_salt_isolates(cold, restarted):
    results, _, _, _ = restarted
    assert results[2].hit_external == 4  # same salt as a cold request: hits its blocks
    assert_same_output(results[2], cold[1])
    assert results[3].hit_external == 0  # a salt never seen: no hit, though the tokens are P1's


def test_second_instance_on_same_directory_hits(cold, restarted):
    _, second, _, stderr = restarted
    assert second[0].hit_external == 4
    assert_same_output(second[0], cold[0])
    # Without cache_prefault_gb, the Cache stage still pages in DRAM slots for one request's blocks at start (the
    # load buffer's count: max_model_len tokens), so the first blocks cached copy into memory already paged in.
    load_buffer = re.findall(r"load buffer of (\d+) blocks", stderr)
    prefaulted = re.findall(r"Cache stage: prefaulted (\d+) slots of (\d+) bytes", stderr)
    assert len(load_buffer) == 1 and len(prefaulted) == 1, stderr[-3000:]
    assert int(prefaulted[0][0]) == int(load_buffer[0]) == -(-2048 // BLOCK_SIZE)


def test_damaged_blocks_are_recomputed(tiny_model, store, prompts, cold, restarted, tmp_path):
    """Flip a payload byte in every block file of a copy of the store: lookups hit, every load fails its
    checksum, vLLM recomputes, and the output is still the cold engine's."""
    damaged = tmp_path / "damaged"
    shutil.copytree(store, damaged)
    for f in damaged.rglob("*.ucmb"):
        data = bytearray(f.read_bytes())
        data[-100] ^= 0x40
        f.write_bytes(bytes(data))
    results, stderr = run_engine(_spec(tiny_model, damaged, [{"prompt": prompts["p1"]}]))
    assert results[0].hit_external == 4  # the lookup found the files...
    assert failed_loads(stderr) == 4  # ...the loads failed verification...
    assert_same_output(results[0], cold[0])  # ...and the output is still right.


def test_producer_dumps_and_consumer_loads_without_dumping(tiny_model, prompts, tmp_path):
    store = tmp_path / "pd"
    produced, _ = run_engine(_spec(tiny_model, store, [{"prompt": prompts["p1"]}], kv_role="kv_producer"))
    assert produced[0].hit_external == 0
    assert len(list(store.rglob("*.ucmb"))) == 4
    consumed, stderr = run_engine(
        _spec(
            tiny_model,
            store,
            [{"prompt": prompts["p1"]}, {"prompt": prompts["p2"], "reset_prefix_cache": True}],
            kv_role="kv_consumer",
        )
    )
    assert consumed[0].hit_external == 4
    assert failed_loads(stderr) == 0
    assert_same_output(consumed[0], produced[0])
    assert consumed[1].hit_external == 4
    assert len(list(store.rglob("*.ucmb"))) == 4  # the consumer wrote nothing (P2's 2 new blocks not dumped)


def test_same_process_repeat_is_served_from_dram(tiny_model, prompts, tmp_path):
    """vLLM's own prefix cache off: a repeat in the same engine is served from UCM's DRAM tier. The scheduler runs in
    another process than the worker's DRAM cache; it knows the blocks are there because the worker reports them.
    To show that no storage read is involved, every shard directory name of the store is taken by a regular file:
    write-backs fail (a real ENOTDIR, warned once), so the blocks exist only in DRAM."""
    store = tmp_path / "store"
    store.mkdir()
    for i in range(256):
        (store / f"{i:02x}").write_bytes(b"")
    spec = _spec(tiny_model, store, [{"prompt": prompts["p1"]}, {"prompt": prompts["p1"]}])
    spec["enable_prefix_caching"] = False
    results, stderr = run_engine(spec)
    assert not list(store.rglob("*.ucmb"))
    assert "[UC][W]" in stderr  # the failed write-back is reported
    assert [(r.hit_hbm, r.hit_external) for r in results] == [(0, 0), (0, 4)]
    assert failed_loads(stderr) == 0
    assert_same_output(results[1], results[0])


def test_chunked_prefill_dumps_every_block_and_restart_hits(tiny_model, prompts, tmp_path):
    """A prompt prefilled in 256-token chunks: blocks become full over several steps (the request's later block ids
    arrive as a running request's new blocks). Every full block is dumped once, and a restart loads them all."""
    store = tmp_path / "store"
    chunked = _spec(tiny_model, store, [{"prompt": prompts["p2"]}])
    chunked["engine_args"] = {"max_num_batched_tokens": 256}
    cold, _ = run_engine(chunked)
    assert cold[0].hit_external == 0
    assert len(list(store.rglob("*.ucmb"))) == 6
    warm, stderr = run_engine(_spec(tiny_model, store, [{"prompt": prompts["p2"]}]))
    assert (warm[0].total_blocks, warm[0].hit_external) == (6, 6)
    assert failed_loads(stderr) == 0
    assert_same_output(warm[0], cold[0])


def test_direct_io_store_restart_hits(tiny_model, prompts, tmp_path):
    """``io_direct: true`` (O_DIRECT files): a restart loads every block and the output is identical; the files are
    the same format a buffered store reads."""
    store = tmp_path / "store"
    spec = _spec(tiny_model, store, [{"prompt": prompts["p2"]}])
    spec["connector"]["kv_connector_extra_config"]["ucm_connectors"][0]["ucm_connector_config"]["io_direct"] = True
    cold, _ = run_engine(spec)
    assert len(list(store.rglob("*.ucmb"))) == 6
    warm, stderr = run_engine(spec)
    assert (warm[0].hit_external, failed_loads(stderr)) == (6, 0)
    assert_same_output(warm[0], cold[0])
    assert "'io_direct': True" in stderr
