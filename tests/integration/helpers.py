"""Plain helpers of ``test_scheduler.py``: real vLLM objects for the scheduler side of UCMConnector, built as vLLM's
engine core builds them, and a model-free engine-core loop (:class:`CoreLoop`) around vLLM's own ``Scheduler``."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from ucm.config import UcmConfig
from ucm.hashing import KVNamespace, block_keys, request_seed
from ucm.integration.vllm.engine_info import KVSpec, kv_spec, namespace
from ucm.integration.vllm.metadata import BlockTransfer, UCMConnectorMetadata, UCMWorkerMetadata
from ucm.store.pipeline import build_store
from ucm.testing.engine import UCM_CONNECTOR, UCM_MODULE

BLOCK_SIZE = 16  # tokens per block; the scheduler side only cuts token ids with it
SPEC = KVSpec(
    layer_names=("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"),
    block_size=BLOCK_SIZE,
    num_kv_heads=2,
    head_dim=8,
    dtype=torch.bfloat16,
)
NAMESPACE = KVNamespace("scheduler-test", "bfloat16", BLOCK_SIZE, 2, 2, 8).digest()


def tokens(n: int, start: int = 1000) -> list[int]:
    """``n`` distinct token ids."""
    return list(range(start, start + n))


def keys_of(token_ids: Sequence[int], salt: str | None = None, lora: str | None = None) -> list[bytes]:
    """The keys ``ucm.hashing`` gives the full blocks of ``token_ids`` under :data:`NAMESPACE`."""
    return block_keys(request_seed(NAMESPACE, salt, lora), token_ids, BLOCK_SIZE)


def make_request(
    req_id: str,
    token_ids: list[int] | None,
    *,
    salt: str | None = None,
    lora: str | None = None,
    params: dict[str, Any] | None = None,
    mm: list[MultiModalFeatureSpec] | None = None,
    prompt_embeds: torch.Tensor | None = None,
    max_tokens: int = 8,
) -> Request:
    """A vLLM ``Request`` as the engine core builds it from a client's request (``kv_transfer_params`` travel in
    the sampling parameters' ``extra_args``)."""
    extra = {"kv_transfer_params": params} if params is not None else None
    return Request(
        req_id,
        token_ids,
        SamplingParams(max_tokens=max_tokens, extra_args=extra),
        None,
        prompt_embeds=prompt_embeds,
        mm_features=mm,
        lora_request=LoRARequest(lora, 1, "adapters/" + lora) if lora else None,
        cache_salt=salt,
    )


def kv_blocks(block_ids: Sequence[int]) -> KVCacheBlocks:
    """What ``KVCacheManager.get_blocks`` returns for one KV cache group."""
    return KVCacheBlocks(([KVCacheBlock(i) for i in block_ids],))


def new_step(request: Request, block_ids: Sequence[int], num_computed: int, num_scheduled: int) -> SchedulerOutput:
    """A step scheduling ``request`` for the first time: all its blocks, ``num_computed`` tokens it already has
    (vLLM's prefix cache plus the connector's), ``num_scheduled`` tokens to compute."""
    request.num_computed_tokens = num_computed
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData.from_request(request, (list(block_ids),))]
    out.num_scheduled_tokens = {request.request_id: num_scheduled}
    out.total_num_scheduled_tokens = num_scheduled
    return out


def cached_step(
    req_id: str, num_computed: int, num_scheduled: int, new_block_ids: Sequence[int] = (), resumed: bool = False
) -> SchedulerOutput:
    """A later step of a running request (``new_block_ids``: blocks allocated this step), or of a preempted one
    that resumes (``resumed``: ``new_block_ids`` are then all its blocks, as vLLM sends them)."""
    out = SchedulerOutput.make_empty()
    out.scheduled_cached_reqs = CachedRequestData(
        req_ids=[req_id],
        resumed_req_ids={req_id} if resumed else set(),
        new_token_ids=[],
        all_token_ids={},
        new_block_ids=[(list(new_block_ids),) if new_block_ids else None],
        num_computed_tokens=[num_computed],
        num_output_tokens=[0],
    )
    out.num_scheduled_tokens = {req_id: num_scheduled}
    out.total_num_scheduled_tokens = num_scheduled
    return out


def transfers(items: list[BlockTransfer]) -> list[tuple[str, list[bytes], list[int], bool]]:
    return [(t.req_id, t.keys, t.block_ids, t.durable) for t in items]


def payload(n: int) -> torch.Tensor:
    """``n`` rows of block bytes (the scheduler never reads them; the store checks their size and checksum)."""
    return torch.randint(0, 256, (n, SPEC.block_nbytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))


def fill_store(config: UcmConfig, keys: Sequence[bytes]) -> None:
    """Write blocks under ``keys`` from another store instance (another process in real life) and close it: the
    blocks are then files on disk, found only through the Posix tier."""
    writer = build_store(config.store)
    try:
        assert writer.wait(writer.dump(list(keys), payload(len(keys)))).ok
    finally:
        writer.close()


class LogRecords(logging.Handler):
    """Keeps the records it is handed (UCM's ``ucm`` logger does not propagate to the root logger that pytest's
    ``caplog`` listens on)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, level: int = logging.DEBUG) -> list[str]:
        """The formatted messages of the records of ``level``."""
        return [r.getMessage() for r in self.records if r.levelno == level]


class Worker:
    """What the scheduler sees of the workers (``UCMWorker``), over a store instance of their own: each step it
    loads the planned keys (a failed one is reported as vLLM block id and as key), dumps the planned keys and
    reports those its store can now serve, as ``UCMConnector.get_block_ids_with_load_errors`` and
    ``build_connector_worker_meta`` do. No tensors: rows of bytes stand for the blocks."""

    def __init__(self, config: UcmConfig) -> None:
        self.store = build_store(config.store)

    def step(self, meta: UCMConnectorMetadata) -> KVConnectorOutput:
        invalid: set[int] = set()
        failed: list[bytes] = []
        stored: list[bytes] = []
        for t in meta.loads:
            rows = torch.empty(len(t.keys), SPEC.block_nbytes, dtype=torch.uint8)
            result = self.store.wait(self.store.load(t.keys, rows))
            invalid |= {t.block_ids[i] for i in result.failed}
            failed += [t.keys[i] for i in sorted(result.failed)]
        for t in meta.dumps:
            self.store.wait(self.store.dump(t.keys, payload(len(t.keys))))
            stored += t.keys[: self.store.lookup(t.keys)]
        worker_meta = UCMWorkerMetadata(stored, failed) if stored or failed else None
        return KVConnectorOutput(invalid_block_ids=invalid, kv_connector_worker_meta=worker_meta)

    def close(self) -> None:
        self.store.close()


class CoreLoop:
    """vLLM's engine-core loop without a model: its ``Scheduler`` with UCMConnector (built by vLLM from
    ``kv_transfer_config``, scheduler role), a KV cache of ``num_blocks`` blocks of :data:`SPEC`'s shape, and
    :class:`Worker` in place of the model runner's connector."""

    def __init__(
        self,
        model: Path,
        config: UcmConfig,
        extra_config: dict[str, Any],
        *,
        kv_role: str = "kv_both",
        num_blocks: int = 32,
        max_num_batched_tokens: int = 256,
    ) -> None:
        transfer = KVTransferConfig(
            kv_connector=UCM_CONNECTOR,
            kv_connector_module_path=UCM_MODULE,
            kv_role=kv_role,
            kv_connector_extra_config=extra_config,
            kv_load_failure_policy="fail",  # vLLM's default; UCM sets "recompute"
        )
        vllm_config = VllmConfig(
            model_config=ModelConfig(model=str(model), dtype="bfloat16", max_model_len=1024),
            cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
            scheduler_config=SchedulerConfig(
                max_num_seqs=8,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=1024,
                enable_chunked_prefill=True,
                is_encoder_decoder=False,
            ),
            kv_transfer_config=transfer,
            device_config=DeviceConfig("cpu"),
        )
        vllm_config.cache_config.num_gpu_blocks = num_blocks
        group = KVCacheGroupSpec(
            list(SPEC.layer_names),
            FullAttentionSpec(
                block_size=BLOCK_SIZE, num_kv_heads=SPEC.num_kv_heads, head_size=SPEC.head_dim, dtype=SPEC.dtype
            ),
        )
        kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[group])
        self.scheduler = Scheduler(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=BLOCK_SIZE,
            log_stats=False,
        )
        # As the engine core does: vLLM's own block hashes, for its prefix cache.
        hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._block_hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
        self.namespace = namespace(vllm_config, kv_spec(kv_cache_config), tp_rank=0).digest()
        self.worker = Worker(config)

    def keys(self, token_ids: Sequence[int]) -> list[bytes]:
        """The keys the connector gives the full blocks of ``token_ids`` (no salt, no LoRA): its namespace is the
        engine's (``engine_info.namespace``: model, KV spec, TP size)."""
        return block_keys(request_seed(self.namespace), token_ids, BLOCK_SIZE)

    def add(self, req_id: str, token_ids: list[int], max_tokens: int = 2, params: dict | None = None) -> None:
        """Hand vLLM's scheduler a new request (``params``: its ``kv_transfer_params``)."""
        extra = {"kv_transfer_params": params} if params is not None else None
        sampling = SamplingParams(max_tokens=max_tokens, extra_args=extra)
        self.scheduler.add_request(Request(req_id, token_ids, sampling, None, block_hasher=self._block_hasher))

    def step(self) -> tuple[SchedulerOutput, UCMConnectorMetadata, list[EngineCoreOutput]]:
        """One engine step: schedule, the workers' transfers, one sampled token per request done with its prompt
        (a prefill chunk samples nothing), then vLLM's update."""
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        assert isinstance(meta, UCMConnectorMetadata)
        kv_output = self.worker.step(meta)
        req_ids = list(out.num_scheduled_tokens)
        requests = self.scheduler.requests
        sampled = [[7] if requests[r].num_computed_tokens >= requests[r].num_tokens else [] for r in req_ids]
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_output,
        )
        engine_outputs = self.scheduler.update_from_output(out, runner_output)
        return out, meta, [o for outputs in engine_outputs.values() for o in outputs.outputs]

    def close(self) -> None:
        self.scheduler.shutdown()  # the connector releases its store
        self.worker.close()


def block_ids_of(out: SchedulerOutput, req_id: str) -> list[int]:
    """The request's vLLM block ids as this step sent them: all of them for a new or a resumed request."""
    for new in out.scheduled_new_reqs:
        if new.req_id == req_id:
            return list(new.block_ids[0])
    cached = out.scheduled_cached_reqs
    i = cached.req_ids.index(req_id)
    assert req_id in cached.resumed_req_ids
    new_ids = cached.new_block_ids[i]
    assert new_ids is not None
    return list(new_ids[0])


def paged_caches(spec: KVSpec, num_blocks: int, seed: int | None) -> dict[str, torch.Tensor]:
    """Random CPU_ATTN paged caches ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]`` per layer of ``spec``
    (bf16), or all-NaN ones (``seed`` None) so that a block written into them shows."""
    g = torch.Generator().manual_seed(seed or 0)
    shape = (num_blocks, spec.num_kv_heads, spec.block_size, 2 * spec.head_dim)
    return {
        n: (torch.randn(shape, generator=g) if seed is not None else torch.full(shape, float("nan"))).bfloat16()
        for n in spec.layer_names
    }
