"""UCMConnector: vLLM KV connector (``KVConnectorBase_V1``) backed by a UCM store pipeline.

Use it with::

    vllm serve <model> --kv-transfer-config '{"kv_connector": "UCMConnector",
        "kv_connector_module_path": "ucm.integration.vllm.ucm_connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"UCM_CONFIG_FILE": "ucm_config.yaml"}}'

The class only routes: by role, to :class:`~ucm.integration.vllm.scheduler.UCMScheduler` (block keys, lookups,
per-step plan) or :class:`~ucm.integration.vllm.worker.UCMWorker` (load + scatter, gather + dump).
``kv_role``: ``kv_both`` loads and dumps, ``kv_producer`` only dumps, ``kv_consumer`` only loads.

A block that fails to load is reported to vLLM, which recomputes it: UCM sets vLLM's
``kv_load_failure_policy`` to ``"recompute"`` (vLLM's default, ``"fail"``, would abort the request).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from ucm.config import UcmConfig, UcmConfigError, UcmSparseConfig, config_from_extra_config
from ucm.integration.vllm.engine_info import data_parallel_rank, detect_layout, kv_spec, namespace
from ucm.integration.vllm.events import MIN_KNOWN_BLOCKS, KVEventTranslator, ResidencyBuffer, kv_events_enabled
from ucm.integration.vllm.metadata import UCMConnectorMetadata, UCMWorkerMetadata
from ucm.integration.vllm.metrics import Observability, UCMConnectorStats, UCMPromMetrics
from ucm.integration.vllm.scheduler import UCMScheduler
from ucm.integration.vllm.version import check_vllm_metadata
from ucm.integration.vllm.worker import UCMWorker, any_rank_of, load_buffer_blocks
from ucm.logger import check_level_env, init_logger
from ucm.store.pipeline import release_shared_store, shared_store

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.attention.backends.abstract import AttentionMetadata
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")
_logged_config = False


def _check_layers_config(sparse: UcmSparseConfig | None) -> None:
    """Refuse to start when the attention layers this process built apply another ``ucm_sparse_config`` than this
    connector's (checked only where layers were built: the worker, after the model). The connector names the KV it
    stores after its method (ReRoPE's namespace tag), so a mismatch would store one attention's KV under the other's
    name.

    Raises:
        UcmConfigError: the layers apply another config (e.g. a connector wrapping UCMConnector in a way
            ``sparse_config_of`` does not find).
    """
    backend = sys.modules.get("ucm.integration.vllm.sparse_backend")  # not imported: no UCM layer was built
    built, applied = backend.layers_sparse_config() if backend is not None else (0, None)
    if built and applied != sparse:

        def shown(cfg: UcmSparseConfig | None) -> Any:
            return None if cfg is None else cfg.model_dump(exclude_none=True)

        raise UcmConfigError(
            f"UCMConnector's ucm_sparse_config is {shown(sparse)}, but the model's attention layers apply "
            f"{shown(applied)}: they read it from the engine's kv_transfer_config, where UCMConnector must be the "
            "connector or a child of vLLM's MultiConnector"
        )


def _check_sparse_backend() -> None:
    """Refuse ``ucm_sparse_config`` when UCM's attention wrapper is not the active backend (it would be ignored).

    Raises:
        UcmConfigError: not on vLLM's CPU platform, or UCM's ``vllm.general_plugins`` entry point did not run.
    """
    from vllm.platforms import current_platform

    from ucm.integration.vllm.sparse_backend import is_active

    if not current_platform.is_cpu():
        raise UcmConfigError(
            "ucm_sparse_config is set, but this UCM version applies sparse attention only on vLLM's CPU backend "
            "(CPU_ATTN); remove ucm_sparse_config on this platform"
        )
    if not is_active():
        raise UcmConfigError(
            "ucm_sparse_config is set, but UCM's attention plugin is not loaded (vllm.general_plugins entry point "
            "'ucm_sparse'): reinstall the ucm package (pip install -e .) and keep 'ucm_sparse' in VLLM_PLUGINS if set"
        )


def _log_config_once(config: UcmConfig) -> None:
    global _logged_config
    if not _logged_config:
        _logged_config = True
        logger.info("Using UCM with config: %s", config.to_log_dict())


class UCMConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector over a UCM store pipeline (see the module docstring).

    Raises (at construction):
        UcmConfigError: the UCM config is invalid or its file is missing, or (worker) the model's attention layers
            apply another ``ucm_sparse_config`` than this connector's.
        ValueError: ``kv_role`` is not one of kv_both, kv_producer, kv_consumer, or ``UC_LOGGER_LEVEL`` is not a log
            level (debug, info, warning, error).
        UnsupportedEngineError: the engine's KV cache is not one UCM handles.
        VllmVersionMismatchError: the package metadata named ``vllm`` describes another version than the running
            vLLM (``ucm.integration.vllm.version``).
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        check_vllm_metadata()  # a stale `vllm` metadata shim (tools/vllm_metadata.py) would misreport the version
        check_level_env()  # only warned about where UCM is imported without being used (ucm.logger)
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None  # checked by the base class
        kv_role = transfer.kv_role
        if kv_role not in KV_ROLES:
            raise ValueError(f"UCMConnector: kv_role {kv_role!r} is not supported; allowed: {list(KV_ROLES)}")
        self._ucm_config = config_from_extra_config(transfer.kv_connector_extra_config)
        _log_config_once(self._ucm_config)
        if role == KVConnectorRole.WORKER and self._ucm_config.ucm_sparse_config is not None:
            _check_sparse_backend()
        if role == KVConnectorRole.WORKER:
            _check_layers_config(self._ucm_config.ucm_sparse_config)
        self._spec = kv_spec(kv_cache_config)
        # ReRoPE changes the KV of later layers past its window: such blocks get a namespace of their own.
        sparse = self._ucm_config.ucm_sparse_config
        self._rerope_on = sparse is not None and sparse.ReRoPE is not None
        self._attention = sparse.ReRoPE.tag() if sparse is not None and sparse.ReRoPE is not None else "dense"
        load, dump = kv_role in ("kv_both", "kv_consumer"), kv_role in ("kv_both", "kv_producer")
        # A kv_consumer only loads: it may serve from a read-only store (e.g. a read-only mount of the shared dir).
        self._require_writable = dump
        # Metrics (vLLM's /metrics) and traces: see ucm.integration.vllm.metrics.
        self._obs = Observability(
            self._ucm_config, self._spec.block_size, "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        )
        # A Mooncake stage's client mounts its DRAM segment in the worker; the scheduler's only looks up.
        self._store = shared_store(
            self._ucm_config.store,
            self._require_writable,
            self._ucm_config.load_timeout_s,
            mount_segment=role == KVConnectorRole.WORKER,
        )
        self._closed = False
        # vLLM's KV events (--kv-events-config): UCM's tiers publish too, see ucm.integration.vllm.events.
        events = kv_events_enabled(vllm_config)

        self._scheduler: UCMScheduler | None = None
        self._worker: UCMWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            if transfer.kv_load_failure_policy != "recompute":
                transfer.kv_load_failure_policy = "recompute"
                logger.info("kv_load_failure_policy set to 'recompute': a block that fails to load is recomputed")
            ns = namespace(vllm_config, self._spec, tp_rank=0, attention=self._attention)
            # Stages that name blocks by namespace (Mooncake's objects) look up under the worker's names.
            self._store.set_namespace(ns.digest(), dataclasses.asdict(ns))
            self._scheduler = UCMScheduler(
                self._ucm_config,
                self._spec,
                ns.digest(),
                self._store,
                load=load,
                dump=dump,
                tp_size=vllm_config.parallel_config.tensor_parallel_size,
                dp_rank=data_parallel_rank(vllm_config),
            )
            self._scheduler.recorder = self._obs.recorder
            if events:
                dram_blocks = self._ucm_config.store.cache_buffer_capacity_bytes // max(1, self._spec.block_nbytes)
                self._scheduler.events = KVEventTranslator(
                    self._spec.block_size, max(MIN_KNOWN_BLOCKS, 2 * dram_blocks)
                )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tp_group

            tp_size = vllm_config.parallel_config.tensor_parallel_size
            tp_rank = get_tensor_model_parallel_rank() if tp_size > 1 else 0
            # A load failing on one rank must drop the step's dumps on every rank (see ucm.integration.vllm.worker).
            any_rank = any_rank_of(get_tp_group().cpu_group) if tp_size > 1 else None
            # The request namespace (rank 0's, as the scheduler keys it) tags the block files for operators' tools.
            ns = namespace(vllm_config, self._spec, tp_rank=0, attention=self._attention)
            self._store.set_namespace(ns.digest(), dataclasses.asdict(ns))
            # A kv_producer never loads: no load buffer worth paging in; a kv_consumer never dumps: no dump buffer.
            request_blocks = load_buffer_blocks(vllm_config.model_config.max_model_len, self._spec)
            buffer_blocks = request_blocks if load else 1
            self._worker = UCMWorker(
                self._spec,
                self._store,
                lambda cache: detect_layout(vllm_config, self._spec, cache),
                tp_rank=tp_rank,
                tp_size=tp_size,
                layerwise=self._ucm_config.use_layerwise,
                load_buffer_blocks=buffer_blocks,
                # Dumps in flight hold at most two longest requests' blocks (see ucm.integration.vllm.staging).
                dump_buffer_blocks=2 * request_blocks if dump else 0,
                load_timeout_s=self._ucm_config.load_timeout_s,
                any_rank=any_rank,
            )
            self._worker.recorder = self._obs.recorder
            if sparse is not None and sparse.Blend is not None:
                from ucm.integration.vllm.blend import Blender

                if tp_size > 1 or self._ucm_config.use_layerwise:
                    raise UcmConfigError(
                        "ucm_sparse_config.Blend runs with tensor_parallel_size 1 and use_layerwise: false in this "
                        f"version; got tensor_parallel_size {tp_size}, use_layerwise {self._ucm_config.use_layerwise}"
                    )
                self._worker.blender = Blender(
                    sparse.Blend, vllm_config, self._spec, self._store, self._ucm_config.load_timeout_s
                )
            if events:
                self._worker.residency = ResidencyBuffer()
                self._obs.recorder.add_key_sink(self._worker.residency.add)
            self._store.set_recorder(self._obs.recorder)

    # ---------------------------------------------------------------- worker side
    def _meta(self) -> UCMConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, UCMConnectorMetadata)
        return meta

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # The first call of every step on the worker: a cache reset the scheduler sent is applied before any load.
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, UCMConnectorMetadata):
            self._worker.reset(connector_metadata)
            if self._rerope_on:  # before this step's forward pass: ReRoPE's kept keys check their blocks against it
                from ucm.integration.vllm.sparse_backend import block_allocations

                block_allocations.note(connector_metadata.allocated_block_ids)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Layerwise: scatter this layer of the step's load. Blockwise: every layer was loaded in start_load_kv.
        assert self._worker is not None
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        # Layerwise: gather this layer of the step's dumps. Blockwise: all layers are gathered in wait_for_save.
        assert self._worker is not None
        if self._ucm_config.use_layerwise:
            self._worker.save_kv_layer(layer_name, self._meta())

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.wait_for_save(self._meta())

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.take_worker_meta() if self._worker is not None else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._worker is not None:
            self._finish_dumps()
        release_shared_store(self._ucm_config.store, self._require_writable)
        self._obs.close()

    def _finish_dumps(self) -> None:
        """Worker side, at shutdown (vLLM's engine exit, e.g. the end of an offline ``LLM`` script): wait until every
        dump is stored through every stage, and say so; first say how many blocks were still in flight, when any.
        Block files appear whole or not at all (temp file and rename), so a process killed in between (vLLM kills an
        engine that takes longer than its shutdown timeout to exit) leaves those blocks invisible, and the second
        line missing."""
        assert self._worker is not None
        t0 = time.perf_counter()
        in_flight = self._worker.pending_dump_blocks()
        if in_flight:
            logger.info(
                "shutdown: storing %d dumped blocks still in flight (if this process is killed before the line "
                "'shutdown: every dumped block is stored', those not yet written are not visible in storage; none "
                "is partial)",
                in_flight,
            )
        self._worker.shutdown()
        self._store.flush()
        logger.info(
            "shutdown: every dumped block is stored (%d were still in flight, %.2f s; a block that failed to store "
            "was reported above)",
            in_flight,
            time.perf_counter() - t0,
        )

    # ------------------------------------------------------------- metrics (both sides)
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        # Worker: loads, dumps and the store's levels since the last step; scheduler: lookups. vLLM aggregates both.
        if self._obs.stats is None:  # enable_metrics: false
            return None
        gauges = self._store.gauges() if self._worker is not None else None
        return self._obs.stats.take(gauges)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return UCMConnectorStats(data=data) if data is not None else UCMConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        transfer = vllm_config.kv_transfer_config
        if transfer is not None and not config_from_extra_config(transfer.kv_connector_extra_config).enable_metrics:
            return None
        return UCMPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if self._scheduler is not None and isinstance(meta, UCMWorkerMetadata):
            self._scheduler.add_stored_keys(meta.stored_keys, meta.reset_epoch)
            self._scheduler.forget_failed_keys(meta.failed_keys)
            self._scheduler.redo_dumps(meta.dropped_keys)
            if self._scheduler.events is not None and meta.tier_events:
                self._scheduler.events.add_tier_events(meta.tier_events)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """UCM's tiers' KV events since the last call (``BlockStored``/``BlockRemoved`` with ``medium`` ``CPU``
        for the DRAM tier and ``STORAGE`` for storage; see :mod:`ucm.integration.vllm.events`); none unless vLLM's
        KV events are on."""
        if self._scheduler is None or self._scheduler.events is None:
            return ()
        return self._scheduler.events.take_events()

    def reset_cache(self) -> bool | None:
        """vLLM's reset of external caches (``reset_prefix_cache(reset_connector=True)``, e.g. ``POST
        /reset_prefix_cache?reset_external=true``): see :meth:`UCMScheduler.reset
        <ucm.integration.vllm.scheduler.UCMScheduler.reset>`. ``None`` on the worker side (vLLM calls the
        scheduler's)."""
        return self._scheduler.reset() if self._scheduler is not None else None

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Dumps are gathered during the step that fills a block, so blocks can be freed at once. A prefill for
        # another instance (kv_transfer_params.do_remote_decode) returns what the decode instance will find.
        if self._scheduler is None:
            return False, None
        return False, self._scheduler.request_finished(request.request_id)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[0] if block_ids else [])
