"""The attention-backend wrapper that applies UCM's sparse attention (``ucm_sparse_config``) inside vLLM.

vLLM builds attention layers before any KV connector exists, so the wrapper comes in through this package's
``vllm.general_plugins`` entry point (:func:`register`, run by vLLM in every process before the model loads), which
overrides the ``CPU_ATTN`` member of vLLM's ``AttentionBackendEnum`` (the CPU platform always picks that member)
with :class:`UcmCPUAttentionBackend`: vLLM's own CPU backend with its impl subclassed.

Each layer's impl reads UCM's config from ``kv_connector_extra_config`` (:func:`sparse_config_of`: the connector is
``UCMConnector``, or one of vLLM's ``MultiConnector``'s connectors is).
With no method on, ``forward`` is vLLM's, untouched (same metadata object, same kernel call). With ReRoPE on (vLLM
writes the step's KV before ``forward``), the output rows of the requests longer than the window are computed with
rectified positions (``ucm.kernels.rerope.torch``), each request's values and re-rotated far keys kept for its next
step (:class:`KeptRequestKV`, checked against the block allocations UCMConnector reports, :class:`BlockAllocations`);
vLLM's kernel runs only in steps that also have rows no longer than the window, which are ReRoPE's already. A
CacheBlend pass or probe (its metadata a ``BlendAttention``, see ``ucm.integration.vllm.blend``) gets its attention
from that object instead of vLLM's kernel. With GSA on:

- every step it marks the blocks written this step (``slot_mapping``) stale in the layer's summary table;
- for the rows of the batch with one query token (decode; also a one-token prefill chunk), it asks the method for
  a selection and hands vLLM's kernel a replaced metadata object (``dataclasses.replace``: the block table is a
  view of a persistent buffer shared by all layers and is never written) whose ``block_table``, ``seq_lens``,
  ``max_seq_len`` and ``scheduler_metadata`` (derived from ``seq_lens`` by vLLM's
  ``cpu_attn_get_scheduler_metadata``, recomputed here with the builder's arguments) name the kept blocks;
- rows with more query tokens (prefill, chunked prefill) keep their dense block table; the method may learn from
  their queries (:meth:`~ucm.sparse.base.SparseMethod.observe`: GSA with ``block_scoring: attention`` scores the
  request's blocks by the attention of the prompt's last queries).

The keys are read in place from the paged cache in the layout of the layer's CPU kernel variant (``layer.isa``, set
by vLLM's metadata builder): ``vec`` and ``vec16`` store them as ``KVLayout.CPU_ATTN``, ``amx`` (bf16 on CPUs with
AMX tiles) as ``KVLayout.CPU_ATTN_AMX`` (:func:`layout_of_isa`); other variants are refused with an error.

Dropping middle blocks changes no positions: RoPE is already applied to the cached keys, and the kernel only uses
the compacted length for the causal bound of the single query, which stays the last token.

GPU backends are not wrapped in this version (the plugin registers nothing there; the connector refuses
``ucm_sparse_config`` when the wrapper is not the active backend).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from typing import Any

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    _get_attn_isa,
)

from ucm.config import ReRoPEConfig, UcmConfigError, UcmSparseConfig, config_from_extra_config
from ucm.integration.vllm.blend import BlendAttention
from ucm.integration.vllm.engine_info import CPU_ISA_LAYOUTS
from ucm.kernels.layouts import KVLayout
from ucm.kernels.paged_keys import paged_keys
from ucm.kernels.rerope.torch import RequestKV, rerope_paged_attention
from ucm.logger import init_logger
from ucm.sparse import BlockSummaries, SparseMethod, make_method

logger = init_logger(__name__)

BACKEND_PATH = "ucm.integration.vllm.sparse_backend.UcmCPUAttentionBackend"
_UCM_CONNECTOR = "UCMConnector"
_said: set[str] = set()  # the one-off info lines this process has logged, by key


def _info_once(key: str, msg: str, *args: Any) -> None:
    """Log ``msg % args`` at info level the first time this process asks with ``key`` (the first sparse decode
    selection, the first reuse of ReRoPE's kept KV...)."""
    if key not in _said:
        _said.add(key)
        logger.info(msg, *args)


@dataclasses.dataclass(frozen=True)
class _StepRows:
    """A step's rows by kind: ``decode`` (int64 ``[D]``: rows with one query token) and their token indices in the
    step's query (``decode_tokens``), ``prefill`` as ``(row, first token, end token)``, and whether every row
    decodes."""

    decode: torch.Tensor
    decode_tokens: torch.Tensor
    prefill: list[tuple[int, int, int]]
    all_decode: bool


_last_step: tuple[CPUAttentionMetadata, _StepRows] | None = None


def _step_rows(md: CPUAttentionMetadata) -> _StepRows:
    """The rows of the step whose metadata is ``md``, computed at its first layer: vLLM's CPU builder makes one
    metadata object per step and hands it to every layer (a new object each step; the strong reference kept here
    also keeps its id from being reused)."""
    global _last_step
    if _last_step is not None and _last_step[0] is md:
        return _last_step[1]
    num_reqs = md.seq_lens.shape[0]
    starts = md.query_start_loc[: num_reqs + 1]
    query_lens = starts[1:] - starts[:-1]
    decode = (query_lens == 1).nonzero().flatten()
    prefill = [(r, int(starts[r]), int(starts[r + 1])) for r in (query_lens > 1).nonzero().flatten().tolist()]
    rows = _StepRows(decode, starts[decode].long(), prefill, decode.numel() == num_reqs)
    _last_step = (md, rows)
    return rows


def layout_of_isa(isa: str | None) -> KVLayout:
    """The paged-KV layout vLLM's CPU attention kernel variant ``isa`` (``layer.isa``) writes: ``vec``/``vec16``:
    ``KVLayout.CPU_ATTN``, ``amx``: ``KVLayout.CPU_ATTN_AMX``.

    Raises:
        UcmConfigError: ``isa`` is a kernel variant whose in-block K layout UCM has not verified.
    """
    layout = CPU_ISA_LAYOUTS.get(isa) if isa is not None else None
    if layout is None:
        raise UcmConfigError(
            f"ucm_sparse_config: vLLM's CPU attention uses kernel variant {isa!r} here; UCM reads keys from the "
            f"paged cache only for {list(CPU_ISA_LAYOUTS)}"
        )
    return layout


_warmed: set[tuple[str, torch.dtype, KVLayout]] = set()


def _warm_up(method: SparseMethod, dtype: torch.dtype, layout: KVLayout) -> None:
    """The method's warm-up (its CPU kernels compiled or loaded), once per process, KV dtype and layout, timed in the
    log."""
    if (method.name, dtype, layout) in _warmed:
        return
    _warmed.add((method.name, dtype, layout))
    start = time.perf_counter()
    method.warm_up(dtype, torch.device("cpu"), layout)
    logger.info("sparse attention %s: kernels ready in %.1f s", method.name, time.perf_counter() - start)


def _expected_layout(vllm_config: Any, dtype: torch.dtype, head_size: int) -> KVLayout | None:
    """The layout this layer's KV will have, from the kernel variant vLLM's CPU metadata builder will pick (its own
    ``_get_attn_isa`` on the model dtype, block size and head size); ``None`` where that is not known yet or is a
    variant UCM refuses (the first forward then reports it)."""
    block_size = getattr(getattr(vllm_config, "cache_config", None), "block_size", None)
    if not isinstance(block_size, int):
        return None
    try:
        return layout_of_isa(_get_attn_isa(dtype, block_size, head_size))
    except (UcmConfigError, NotImplementedError):
        return None


_parsed: dict[str, UcmSparseConfig | None] = {}  # kv_connector_extra_config (JSON) -> its ucm_sparse_config


def _ucm_extra_configs(connector: str | None, extra: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The ``kv_connector_extra_config`` of every UCMConnector in a transfer config: the connector itself, or the
    children of vLLM's ``MultiConnector`` (``extra["connectors"]``, each a transfer-config dict), at any depth."""
    extra = extra or {}
    if connector == _UCM_CONNECTOR:
        return [extra]
    children = extra.get("connectors") if connector == "MultiConnector" else None
    found: list[dict[str, Any]] = []
    for child in children if isinstance(children, list) else []:
        if isinstance(child, dict):
            found += _ucm_extra_configs(child.get("kv_connector"), child.get("kv_connector_extra_config"))
    return found


def _parse_sparse(extra: dict[str, Any]) -> UcmSparseConfig | None:
    cache_key = json.dumps(extra, sort_keys=True, default=str)
    if cache_key not in _parsed:
        try:
            _parsed[cache_key] = config_from_extra_config(extra).ucm_sparse_config
        except UcmConfigError as exc:
            logger.debug("attention wrapper: invalid UCM config, left to UCMConnector to report: %s", exc)
            _parsed[cache_key] = None
    return _parsed[cache_key]


def sparse_config_of(vllm_config: Any) -> UcmSparseConfig | None:
    """``ucm_sparse_config`` of the UCMConnector in a vLLM config's ``kv_transfer_config``: the connector itself or a
    child of vLLM's ``MultiConnector`` (which builds each child from a copy of the config holding the child's
    transfer config, so the child applies its ``ucm_sparse_config`` and the attention layers must too).

    Parsed once per process and config (every attention layer asks). An invalid UCM config gives ``None`` here
    (pass-through): UCMConnector, built after the model, refuses it at start with the full error message, so a bad
    key is reported once, by the connector, whether or not it concerns sparse attention.

    Raises:
        UcmConfigError: a ``MultiConnector`` holds several UCMConnectors whose ``ucm_sparse_config`` differ (the
            attention layers can apply one).
    """
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    if transfer is None:
        return None
    extras = _ucm_extra_configs(transfer.kv_connector, transfer.kv_connector_extra_config)
    configs = [_parse_sparse(extra) for extra in extras]
    if any(cfg != configs[0] for cfg in configs[1:]):
        raise UcmConfigError(
            f"MultiConnector holds {len(configs)} UCMConnectors with different ucm_sparse_config "
            f"({[None if cfg is None else cfg.model_dump(exclude_none=True) for cfg in configs]}); the attention "
            "layers apply one, and each UCMConnector names its stored KV after its own: give them all the same "
            "ucm_sparse_config"
        )
    return configs[0] if configs else None


class _LayersBuilt:
    """What the UCM attention layers of this process were built with (:func:`layers_sparse_config`)."""

    count = 0
    config: UcmSparseConfig | None = None


def layers_sparse_config() -> tuple[int, UcmSparseConfig | None]:
    """How many UCM attention layers this process built, and the ``ucm_sparse_config`` the last one applies
    (:func:`sparse_config_of` of the config current then; every layer reads the same). UCMConnector's worker side,
    built after the model, checks it against its own (``ucm.integration.vllm.ucm_connector``)."""
    return _LayersBuilt.count, _LayersBuilt.config


@dataclasses.dataclass(frozen=True)
class _ReRoPE:
    """ReRoPE's settings for one layer: the config's window and leaky factor, the model's RoPE, and the bytes of
    running requests' :class:`~ucm.kernels.rerope.torch.RequestKV` the layer may keep between steps."""

    window: int
    leaky_factor: float
    rotary_dim: int
    base: float
    keep_bytes: int


class BlockAllocations:
    """The step at which vLLM last allocated each KV block of this process's engine, as UCMConnector's scheduler side
    reports it every step (``UCMConnectorMetadata.allocated_block_ids``, noted by the worker side when the step's
    metadata is bound, before the forward pass).

    A block allocated again may hold other tokens (computed, or loaded by the connector, which writes no
    ``slot_mapping``): what was derived from its old contents (ReRoPE's kept keys and values) is void from then on.
    Steps count from 1; ``step == 0``: nothing reported yet (no connector metadata), so nothing can be checked.
    """

    def __init__(self) -> None:
        self.step = 0
        self._allocated_at = torch.zeros(0, dtype=torch.int64)  # [max block id + 1]: step of the last allocation

    def note(self, block_ids: list[int]) -> None:
        """Start a step in which vLLM allocated ``block_ids`` (to new, resumed or growing requests)."""
        self.step += 1
        if not block_ids:
            return
        ids = torch.tensor(block_ids, dtype=torch.int64)
        size = int(ids.max()) + 1
        if size > self._allocated_at.numel():
            grown = torch.zeros(max(size, 2 * self._allocated_at.numel()), dtype=torch.int64)
            grown[: self._allocated_at.numel()] = self._allocated_at
            self._allocated_at = grown
        self._allocated_at[ids] = self.step

    def unchanged_since(self, block_ids: torch.Tensor, step: int) -> bool:
        """Whether none of ``block_ids`` (int64 ``[n]``) was allocated after ``step``."""
        known = block_ids[block_ids < self._allocated_at.numel()]
        return bool((self._allocated_at[known] <= step).all())


block_allocations = BlockAllocations()


@dataclasses.dataclass
class _KeptKV:
    kv: RequestKV
    blocks: torch.Tensor  # int64: the block-table prefix that holds kv's values
    step: int  # the allocation step up to which those blocks were checked


class KeptRequestKV:
    """One layer's ReRoPE :class:`~ucm.kernels.rerope.torch.RequestKV` of the running requests, from one step to the
    next, within ``budget_bytes``.

    An entry is filed under the block of its request's last token (a block only that request writes) and found again
    by the block of the token before a step's first query. It is handed out only while the block-table prefix that
    holds its values is the same and none of those blocks was allocated again since it was filed
    (``allocations``); each step keeps only the entries of the requests it ran.
    """

    def __init__(self, budget_bytes: int, allocations: BlockAllocations) -> None:
        self.budget_bytes = budget_bytes
        self._allocations = allocations
        self._entries: dict[int, _KeptKV] = {}
        self._next: dict[int, _KeptKV] = {}
        self._next_bytes = 0

    @property
    def active(self) -> bool:
        """Whether anything can be kept: a budget, and block allocations reported (else nothing could be checked)."""
        return self.budget_bytes > 0 and self._allocations.step > 0

    def take(self, row: torch.Tensor, first_query: int, block_size: int) -> RequestKV | None:
        """The entry for the request whose block-table row is ``row`` (int ``[max_blocks]``) and whose step starts at
        position ``first_query``: the one kept at its last step if still valid, else a new one; None when
        :attr:`active` is false."""
        if not self.active:
            return None
        old = self._entries.get(int(row[(first_query - 1) // block_size])) if first_query > 0 else None
        if (
            old is None
            or old.blocks.numel() > row.numel()
            or not torch.equal(row[: old.blocks.numel()].long(), old.blocks)
            or not self._allocations.unchanged_since(old.blocks, old.step)
        ):
            return RequestKV()
        return old.kv

    def put(self, kv: RequestKV, row: torch.Tensor, seq_len: int, block_size: int) -> None:
        """Keep ``kv`` (its values cover ``seq_len`` tokens of the request of ``row``) for the next step, if it fits
        in what is left of the budget this step."""
        if self._next_bytes + kv.nbytes > self.budget_bytes:
            return
        self._next_bytes += kv.nbytes
        blocks = row[: -(-seq_len // block_size)].long().clone()
        self._next[int(row[(seq_len - 1) // block_size])] = _KeptKV(kv, blocks, self._allocations.step)

    def end_step(self) -> None:
        """Keep what :meth:`put` filed this step, and only that."""
        self._entries, self._next, self._next_bytes = self._next, {}, 0


def _rerope_of(cfg: ReRoPEConfig, vllm_config: Any, head_size: int) -> _ReRoPE:
    """ReRoPE's settings for a layer of ``head_size`` of the model in ``vllm_config``.

    Raises:
        UcmConfigError: the model's RoPE is scaled (``rope_type`` other than ``default``): ReRoPE rectifies plain RoPE
            positions only.
    """
    hf = vllm_config.model_config.hf_text_config
    params = dict(getattr(hf, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise UcmConfigError(
            f"ucm_sparse_config.ReRoPE: the model's RoPE has rope_type {rope_type!r}; allowed: 'default' (ReRoPE "
            "rectifies the positions of plain RoPE)"
        )
    base = float(params.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))
    partial = float(params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0)))
    leaky = math.inf if cfg.leaky_factor is None else cfg.leaky_factor
    num_layers = max(1, vllm_config.model_config.get_num_layers(vllm_config.parallel_config))
    keep_bytes = int(cfg.decode_cache_gb * 2**30 / num_layers)
    return _ReRoPE(cfg.window, leaky, int(head_size * partial), base, keep_bytes)


class UcmCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention impl, with UCM's sparse block selection at decode when ``ucm_sparse_config`` is on, or
    ReRoPE's rectified positions for requests longer than its window."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._method: SparseMethod | None = None
        self._summaries: BlockSummaries | None = None
        self._rerope: _ReRoPE | None = None
        self._kept: KeptRequestKV | None = None  # ReRoPE's, for the requests' next steps
        cfg = sparse_config_of(get_current_vllm_config())
        _LayersBuilt.count += 1
        _LayersBuilt.config = cfg
        if cfg is not None and cfg.ReRoPE is not None:
            if self.attn_type == AttentionType.DECODER and self.sliding_window == -1 and self.sinks is None:
                self._rerope = _rerope_of(cfg.ReRoPE, get_current_vllm_config(), self.head_size)
                self._kept = KeptRequestKV(self._rerope.keep_bytes, block_allocations)
            return
        method = make_method(cfg)
        if method is None:
            return
        if self.attn_type != AttentionType.DECODER or self.sliding_window != -1 or self.sinks is not None:
            logger.debug(
                "sparse attention off for a layer of type %s (sliding window %s)", self.attn_type, self.sliding_window
            )
            return
        if self.kv_cache_dtype != "auto":
            raise UcmConfigError(
                f"ucm_sparse_config.{method.name} needs the KV cache in the model's dtype; kv_cache_dtype is "
                f"{self.kv_cache_dtype!r}; allowed: 'auto'"
            )
        self._method = method
        vllm_config = get_current_vllm_config()
        model_config = vllm_config.model_config
        if model_config is not None and isinstance(model_config.dtype, torch.dtype):  # resolved from "auto" by now
            layout = _expected_layout(vllm_config, model_config.dtype, self.head_size)
            if layout is not None:
                _warm_up(method, model_config.dtype, layout)

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: CPUAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """vLLM's CPU attention; with a sparse method on, decode rows read only their selected blocks.

        Tensors as vLLM passes them: ``query`` ``[num_tokens, num_heads, head_dim]`` (post-RoPE), ``key`` / ``value``
        ``[num_tokens, num_kv_heads, head_dim]``, ``kv_cache`` ``[num_blocks, num_kv_heads, block_size, 2 *
        head_dim]`` in the model's dtype (in-block layout of ``layer.isa``), ``output`` the tensor the result is
        written into; returns ``[num_tokens, num_heads * head_dim]``.

        Raises:
            UcmConfigError: a sparse method is on and ``layer.isa`` is a kernel variant UCM has not verified.
            ValueError: a sparse method is on and ``kv_cache`` does not fit the layout of ``layer.isa``.
        """
        if isinstance(attn_metadata, BlendAttention):  # CacheBlend's pass or probe runs the layer
            attn_metadata.attend(self, layer, query, key, value, output.view(query.shape[0], self.num_heads, -1))
            return output
        if self._method is not None and attn_metadata is not None and attn_metadata.dynamic_causal is None:
            attn_metadata = self._sparse_metadata(layer, query, kv_cache, attn_metadata)
        if self._rerope is None or attn_metadata is None or attn_metadata.dynamic_causal is not None:
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
            )
        num_reqs = attn_metadata.seq_lens.shape[0]
        long_rows = (attn_metadata.seq_lens[:num_reqs] > self._rerope.window).nonzero().flatten().tolist()
        if len(long_rows) < num_reqs:  # vLLM's kernel for the rows no longer than the window (all rows: simpler)
            super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
        if long_rows:
            self._rectify(layer, query, kv_cache, attn_metadata, output, long_rows)
        return output

    def _rectify(
        self,
        layer: Any,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        md: CPUAttentionMetadata,
        output: torch.Tensor,
        long_rows: list[int],
    ) -> None:
        """Compute, with ReRoPE, the output rows of the requests whose keys reach the window (shorter requests'
        dense results are ReRoPE's already: every distance is below the window), each request's values and far keys
        kept for its next step (:class:`KeptRequestKV`)."""
        rr, kept = self._rerope, self._kept
        assert rr is not None and kept is not None
        layout = layout_of_isa(getattr(layer, "isa", None))
        block_size = kv_cache.shape[2]
        starts = md.query_start_loc
        for r in long_rows:
            q0, q1 = int(starts[r]), int(starts[r + 1])
            if q1 == q0:
                continue
            n = q1 - q0
            seq_len = int(md.seq_lens[r])
            entry = kept.take(md.block_table[r], seq_len - n, block_size)
            if entry is not None and entry.num_values:
                _info_once(
                    "rerope-kept",
                    "ReRoPE: a step reused the values and far keys a request kept from its last step (%.1f MiB per "
                    "layer)",
                    rr.keep_bytes / 2**20,
                )
            rerope_paged_attention(
                query[q0:q1],
                kv_cache,
                layout,
                md.block_table[r : r + 1],
                md.seq_lens[r : r + 1],
                torch.tensor([0, n], dtype=torch.int32),
                window=rr.window,
                leaky_factor=rr.leaky_factor,
                rotary_dim=rr.rotary_dim,
                base=rr.base,
                scale=self.scale,
                out=output[q0:q1].view(n, self.num_heads, self.head_size),
                request_kv=[entry] if entry is not None else None,
            )
            if entry is not None:
                kept.put(entry, md.block_table[r], seq_len, block_size)
        kept.end_step()

    def _sparse_metadata(
        self, layer: Any, query: torch.Tensor, kv_cache: torch.Tensor, md: CPUAttentionMetadata
    ) -> CPUAttentionMetadata:
        assert self._method is not None
        num_blocks, num_kv_heads = kv_cache.shape[:2]
        if self._summaries is None or self._summaries.num_blocks != num_blocks:
            self._summaries = self._method.new_summaries(num_blocks, num_kv_heads, self.head_size, kv_cache.device)
        return sparse_cpu_metadata(
            self._method,
            self._summaries,
            md,
            query,
            kv_cache,
            isa=getattr(layer, "isa", None),
            num_heads=self.num_heads,
            scale=self.scale,
        )


def sparse_cpu_metadata(
    method: SparseMethod,
    summaries: BlockSummaries,
    md: CPUAttentionMetadata,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    *,
    isa: str | None,
    num_heads: int,
    scale: float,
) -> CPUAttentionMetadata:
    """A replacement for one layer's CPU attention metadata whose one-query rows attend to ``method``'s blocks.

    Marks the blocks written this step stale in ``summaries``, selects blocks for each row with exactly one query
    token, and returns ``dataclasses.replace(md, ...)`` with new ``block_table``, ``seq_lens``, ``max_seq_len`` and
    ``scheduler_metadata`` (``md`` itself and its tensors are not modified); ``md`` unchanged when no row is a
    one-query row.

    Args:
        md: vLLM's ``CPUAttentionMetadata`` for the step (shared by all layers).
        query: ``[num_tokens, num_heads, head_dim]`` this layer's (post-RoPE) queries.
        kv_cache: ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]`` this layer's paged KV (CPU layout of
            ``isa``, :func:`layout_of_isa`), with this step's keys already written.
        isa: the CPU kernel variant (``layer.isa``); num_heads: query heads; scale: softmax scale.

    Raises:
        UcmConfigError: ``isa`` is a kernel variant whose in-block K layout UCM has not verified.
        ValueError: ``kv_cache`` does not fit the layout of ``isa``.
    """
    layout = layout_of_isa(isa)
    assert isa is not None  # for mypy: layout_of_isa refuses None
    _, num_kv_heads, block_size, two_d = kv_cache.shape
    summaries.invalidate_slots(md.slot_mapping[: md.num_actual_tokens], block_size)
    num_reqs = md.seq_lens.shape[0]
    step = _step_rows(md)
    keys = paged_keys(kv_cache, layout)
    for r, start, end in step.prefill:  # prefill rows: the method may learn from them
        method.observe(query[start:end], keys, summaries, md.block_table[r], int(md.seq_lens[r]), scale)
    if step.decode.numel() == 0:
        return md
    if step.all_decode:  # one query token per row (a pure decode step): no row to pick out or merge back
        sel = method.select(query[:num_reqs], keys, summaries, md.block_table, md.seq_lens, scale)
        block_table, seq_lens = sel.block_table, sel.seq_lens
    else:
        rows = step.decode
        sel = method.select(query[step.decode_tokens], keys, summaries, md.block_table[rows], md.seq_lens[rows], scale)
        block_table = md.block_table.clone()
        block_table[rows] = sel.block_table
        seq_lens = md.seq_lens.clone()
        seq_lens[rows] = sel.seq_lens
    if "selection" not in _said or logger.isEnabledFor(logging.DEBUG):
        kept, total = int(sel.kept.sum()), int(sel.num_blocks.sum())
        message = "sparse attention %s: first decode selection kept %d of %d blocks"
        _info_once("selection", message, method.name, kept, total)
        logger.debug(
            "%s: rows %s kept %s of %s blocks",
            method.name,
            step.decode.tolist(),
            sel.kept.tolist(),
            sel.num_blocks.tolist(),
        )
    # No sliding window: layers with one never get here; no dynamic causal mask: checked by the caller.
    scheduler_metadata = cpu_scheduler_metadata(
        md.query_start_loc, seq_lens, num_heads, num_kv_heads, two_d // 2, query.dtype, isa, causal=md.causal
    )
    return dataclasses.replace(
        md,
        block_table=block_table,
        seq_lens=seq_lens,
        max_seq_len=int(seq_lens.max()),
        scheduler_metadata=scheduler_metadata,
    )


def cpu_scheduler_metadata(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    isa: str,
    *,
    causal: bool = True,
) -> torch.Tensor:
    """The ``scheduler_metadata`` of vLLM's CPU attention metadata, as ``CPUAttentionMetadataBuilder.build`` computes
    it (with the builder's arguments: no sliding window, no dynamic causal mask, KV in the model's dtype) for
    requests whose queries are rows ``query_start_loc[r] .. query_start_loc[r + 1]`` (int32 ``[R + 1]``), the last
    tokens of their ``seq_lens[r]`` (int32 ``[R]``); ``isa``: the layer's CPU kernel variant (``layer.isa``)."""
    return ops.cpu_attn_get_scheduler_metadata(
        num_reqs=seq_lens.shape[0],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        seq_lens=seq_lens,
        dtype=dtype,
        query_start_loc=query_start_loc,
        causal=causal,
        sliding_window_size=-1,
        isa=isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
        dynamic_causal=None,
        kv_cache_dtype="auto",
    )


class UcmCPUAttentionBackend(CPUAttentionBackend):
    """vLLM's ``CPU_ATTN`` backend with :class:`UcmCPUAttentionImpl` (same name, builder and KV layout)."""

    @staticmethod
    def get_impl_cls() -> type[UcmCPUAttentionImpl]:
        return UcmCPUAttentionImpl


def is_active() -> bool:
    """Whether vLLM's attention registry resolves ``CPU_ATTN`` to this wrapper in this process."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum.CPU_ATTN.get_path() == BACKEND_PATH
