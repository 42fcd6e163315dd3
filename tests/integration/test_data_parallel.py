"""Data parallelism with one shared store: ``vllm serve --data-parallel-size 2`` (vLLM's internal load balancing)
with UCMConnector, each DP rank an engine of its own with its own DRAM tier (``Cache``) over one ``Posix``
directory. A prefix stored through rank 0 is a hit on rank 1 (read from the file rank 0 wrote), with the same output.

The other form the seeds use, one server per rank (``--data-parallel-rank R --data-parallel-address ...
--data-parallel-rpc-port P``, vLLM's external load balancing), does not run on vLLM 0.32's CPU build: a dense model
is refused at start ("Non-MoE models do not support external data parallel mode"), and an MoE model fails at its
first forward pass (the CPU communicator has no ``all_gatherv``, which the MoE dispatch across DP ranks needs); see
``docs/operations.md``, "Data parallelism". Each of those ranks would be an engine like the ones here.

CPU threads: vLLM binds each DP rank's OpenMP threads to the cores its slice of ``VLLM_CPU_OMP_THREADS_BIND``
names (one ``|``-separated list per rank). One list for both ranks leaves rank 1 without one (vLLM refuses to
start); ``auto`` binds both ranks to every core (one NUMA node), twice as many spinning OpenMP threads as cores.
Here each rank gets its own half of the cores (``0|1`` on 2 cores), the same thread count on both ranks, so the
float32 outputs of the two ranks are comparable to the bit.
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from tests.helpers import LOGPROB_TOL, ucm_extra_config
from tests.integration.helpers import NAMESPACE, SPEC, LogRecords, make_request, tokens
from ucm.config import config_from_extra_config
from ucm.integration.vllm.engine_info import data_parallel_rank
from ucm.integration.vllm.scheduler import UCMScheduler
from ucm.store.pipeline import build_store
from ucm.testing.engine import DP_HIT_RE, HIT_RE, failed_loads, ucm_transfer_config
from ucm.testing.server import VllmServer
from ucm.testing.texts import prompt_of_tokens

DP_SIZE = 2
BLOCK_SIZE = 32  # small blocks: short prompts with several full blocks
PROMPT_TOKENS = 6 * BLOCK_SIZE + 20  # 6 full blocks + a partial one
MAX_TOKENS = 8


def omp_threads_bind(dp_size: int, num_cpus: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` giving each of ``dp_size`` ranks its own equal slice of ``num_cpus`` cores."""
    per_rank = num_cpus // dp_size
    if per_rank < 1:
        raise ValueError(f"{num_cpus} CPUs cannot give each of {dp_size} DP ranks a core of its own")
    slices = [(r * per_rank, (r + 1) * per_rank - 1) for r in range(dp_size)]
    return "|".join(str(first) if first == last else f"{first}-{last}" for first, last in slices)


# ------------------------------------------------------------------------------------------ without an engine
def test_omp_threads_bind_gives_each_rank_its_cores() -> None:
    assert omp_threads_bind(2, 2) == "0|1"
    assert omp_threads_bind(2, 7) == "0-2|3-5"
    with pytest.raises(ValueError, match="1 CPUs cannot give each of 2 DP ranks"):
        omp_threads_bind(2, 1)


def _config(parallel: Any, engine_id: str | None) -> Any:
    transfer = None if engine_id is None else SimpleNamespace(engine_id=engine_id)
    return SimpleNamespace(parallel_config=parallel, kv_transfer_config=transfer)


@pytest.mark.parametrize("rank", [0, 1])
def test_data_parallel_rank_of_an_independent_dense_rank(rank: int) -> None:
    """vLLM's engine core turns each DP rank of a dense model into an engine of DP size 1 (its own
    ``reconfigure_for_independent_dp_rank``) and suffixes the connector's engine_id with ``_dp<rank>``."""
    from vllm.config import ParallelConfig

    parallel = ParallelConfig(data_parallel_size=DP_SIZE, data_parallel_rank=rank)
    parallel.reconfigure_for_independent_dp_rank()
    assert (parallel.data_parallel_size, parallel.data_parallel_rank) == (1, 0)
    assert data_parallel_rank(_config(parallel, f"4f2c_dp{rank}")) == rank


def test_data_parallel_rank_of_other_engines() -> None:
    from vllm.config import ParallelConfig

    assert data_parallel_rank(_config(ParallelConfig(), "4f2c")) is None  # not data parallel
    assert data_parallel_rank(_config(ParallelConfig(), None)) is None
    assert data_parallel_rank(_config(ParallelConfig(), "4f2c_dp1")) is None  # a suffix naming another rank
    moe_rank = ParallelConfig(data_parallel_size=DP_SIZE, data_parallel_rank=1)  # MoE ranks keep their DP size
    assert data_parallel_rank(_config(moe_rank, "4f2c")) == 1


def test_request_line_names_the_dp_rank(tmp_path: Path) -> None:
    config = config_from_extra_config(ucm_extra_config(tmp_path / "store"))
    store = build_store(config.store)
    logger = logging.getLogger("ucm.integration.vllm.scheduler")
    records, level = LogRecords(), logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    try:
        for dp_rank in (None, 1):
            sched = UCMScheduler(config, SPEC, NAMESPACE, store, load=True, dump=True, dp_rank=dp_rank)
            sched.get_num_new_matched_tokens(make_request(f"r{dp_rank}", tokens(2 * SPEC.block_size + 3)), 0)
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
        store.close()
    plain, ranked = records.messages(logging.INFO)
    assert plain == "request_id: rNone, total_blocks_num: 2, hit hbm: 0, hit external: 0"
    assert ranked == plain.replace("rNone", "r1") + ", dp rank: 1"
    assert HIT_RE.search(ranked) is not None  # parsers of the plain line still read it
    match = DP_HIT_RE.search(ranked)
    assert match is not None and match.groups() == ("r1", "2", "0", "0", "1")


# ------------------------------------------------------------------------------------- one DP server, 2 ranks
@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dp_store")


@pytest.fixture(scope="module")
def server(tiny_model: Path, store_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """The tiny float32 model served by 2 DP ranks (vLLM's internal load balancing), UCM ``Cache|Posix`` over
    ``store_dir``, each rank's OpenMP threads on cores of its own."""
    num_cpus = os.cpu_count() or 1
    if num_cpus < DP_SIZE:
        pytest.skip(f"{num_cpus} CPU: each of {DP_SIZE} DP ranks needs a core of its own")
    tmp = tmp_path_factory.mktemp("dp_server")
    config_file = tmp / "ucm_config.yaml"
    store = {"store_pipeline": "Cache|Posix", "storage_backends": str(store_dir), "cache_buffer_capacity_gb": 0.25}
    config_file.write_text(yaml.safe_dump({"ucm_connectors": [{"ucm_connector_config": store}]}))
    env = {"VLLM_CPU_OMP_THREADS_BIND": omp_threads_bind(DP_SIZE, num_cpus), "VLLM_CPU_KVCACHE_SPACE": "1"}
    srv = VllmServer(
        tiny_model,
        tmp / "server.log",
        ucm_transfer_config({"UCM_CONFIG_FILE": str(config_file)}),
        max_model_len=1024,
        dtype="float32",
        env=env,
        extra_args=["--data-parallel-size", str(DP_SIZE), "--block-size", str(BLOCK_SIZE)],
    )
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def prompt_ids(tokenizer: Any) -> dict[str, list[int]]:
    """Two different real-text prompts of ``PROMPT_TOKENS`` token ids."""
    ids = tokenizer.encode(prompt_of_tokens(tokenizer, 2 * PROMPT_TOKENS), add_special_tokens=False)
    return {"a": ids[:PROMPT_TOKENS], "b": ids[PROMPT_TOKENS : 2 * PROMPT_TOKENS]}


def complete(server: VllmServer, prompt: list[int], rank: int) -> dict[str, Any]:
    """A greedy completion of ``prompt`` on DP rank ``rank`` (vLLM's ``X-data-parallel-rank`` header): its token
    ids and their log-probs, and UCM's log line for it as ``(total, hit hbm, hit external, dp rank)``."""
    body = {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "logprobs": 1,
        "return_token_ids": True,
    }
    request = urllib.request.Request(
        f"{server.url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "X-data-parallel-rank": str(rank)},
    )
    with urllib.request.urlopen(request, timeout=300) as r:
        answer = json.loads(r.read())
    choice = answer["choices"][0]
    lines = [m for m in DP_HIT_RE.findall(server.read_log()) if m[0].startswith(answer["id"] + "-")]
    assert len(lines) == 1, (answer["id"], server.read_log()[-3000:])
    _, total, hbm, external, dp_rank = lines[0]
    return {
        "token_ids": choice["token_ids"],
        "logprobs": choice["logprobs"]["token_logprobs"],
        "hit": (int(total), int(hbm), int(external), int(dp_rank)),
    }


def wait_for_blocks(store_dir: Path, n: int, timeout_s: float = 60.0) -> list[Path]:
    """The store's block files once there are ``n`` (written back in the background after the request)."""
    deadline = time.monotonic() + timeout_s
    while True:
        files = sorted(store_dir.rglob("*.ucmb"))
        if len(files) >= n or time.monotonic() > deadline:
            return files
        time.sleep(0.2)


def assert_same_output(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["token_ids"] == want["token_ids"]
    diff = max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True))
    assert diff < LOGPROB_TOL, f"log-probs differ by {diff}"


@pytest.mark.engine
def test_prefix_stored_through_rank0_hits_on_rank1(server, store_dir, prompt_ids):
    full_blocks = PROMPT_TOKENS // BLOCK_SIZE
    first = complete(server, prompt_ids["a"], rank=0)
    assert first["hit"] == (full_blocks, 0, 0, 0)
    assert len(wait_for_blocks(store_dir, full_blocks)) == full_blocks  # rank 0 wrote every full block

    # Rank 1's engine is another process: its DRAM tier and vLLM prefix cache are empty, the directory is shared.
    second = complete(server, prompt_ids["a"], rank=1)
    assert second["hit"] == (full_blocks, 0, full_blocks, 1)
    assert_same_output(second, first)
    assert failed_loads(server.read_log()) == 0


@pytest.mark.engine
def test_rank1_finds_only_what_is_in_the_directory(server, store_dir, prompt_ids):
    """Rank 0's DRAM tier holds the blocks it stored, but rank 1 sees only the files: with them removed, rank 1
    recomputes (same output), while rank 0 still serves the prompt from its own prefix cache."""
    full_blocks = PROMPT_TOKENS // BLOCK_SIZE
    before = set(store_dir.rglob("*.ucmb"))
    first = complete(server, prompt_ids["b"], rank=0)
    assert first["hit"] == (full_blocks, 0, 0, 0)
    files = wait_for_blocks(store_dir, len(before) + full_blocks)
    for path in set(files) - before:
        path.unlink()

    second = complete(server, prompt_ids["b"], rank=1)
    assert second["hit"] == (full_blocks, 0, 0, 1)
    assert_same_output(second, first)
    again = complete(server, prompt_ids["b"], rank=0)
    assert again["hit"] == (full_blocks, full_blocks, 0, 0)
    assert_same_output(again, first)
