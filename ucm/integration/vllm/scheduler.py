"""Scheduler side of UCMConnector: block keys, lookups, and the per-step load/dump plan. No tensors.

Cache reset (vLLM's ``reset_prefix_cache`` with ``reset_external``, e.g. ``POST
/reset_prefix_cache?reset_external=true`` on ``vllm serve``): :meth:`UCMScheduler.reset` forgets the keys the
workers reported stored, empties the DRAM tier this process can reach (the workers' own, when vLLM runs them in this
process) and, with ``reset_clears_storage``, deletes this model's block files at once; the next step's metadata
carries the new reset epoch, on which each worker empties its DRAM tier before loading anything (see
:meth:`UCMWorker.reset <ucm.integration.vllm.worker.UCMWorker.reset>`). A reset racing with loads and dumps never
yields wrong KV: a block it removes is a miss for a load planned before it, which vLLM recomputes.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ucm.config import BlendConfig, UcmConfig
from ucm.hashing import block_keys, rank_keys, request_seed
from ucm.integration.vllm.engine_info import KVSpec
from ucm.integration.vllm.events import KVEventTranslator
from ucm.integration.vllm.metadata import BlendTransfer, BlockTransfer, UCMConnectorMetadata
from ucm.logger import init_logger
from ucm.sparse.blend import blend_end, chunk_spans
from ucm.store.base import UcmKVStoreBase, tiered_lookup
from ucm.store.observe import NO_RECORDER, Observation, Recorder

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

# kv_transfer_params keys (vLLM's P/D protocol: the proxy sends ``do_remote_decode`` to the prefill instance and
# passes what the prefill response returns on to the decode instance).
DO_REMOTE_DECODE = "do_remote_decode"
PREFILL_BLOCKS = "ucm_prefill_blocks"  # full prompt blocks the prefill instance has put in the store


@dataclass
class _RequestState:
    keys: list[bytes]  # keys of the prompt's full blocks
    num_stored: int  # leading blocks found in the store at lookup
    num_hbm: int = 0  # leading blocks vLLM already held (its own prefix cache)
    load_block_ids: list[int] | None = None  # vLLM blocks to fill from the store, keys[num_hbm:...]
    next_dump: int = 0  # index of the next prompt block to dump
    block_ids: list[int] | None = None
    logged: bool = False
    remote_decode: bool = False  # prefill for another instance: dumps must be durable before the response
    request: Request | None = None  # kept with KV events on: the events name blocks by vLLM's hashes
    blend: BlendTransfer | None = None  # CacheBlend's run of this prompt, until sent to the workers
    blended: bool = False  # some of its KV is CacheBlend's (approximate): none of its blocks is dumped


def _mm_block_extras(request: Request, num_blocks: int, block_size: int) -> list[list[str]] | None:
    """Identifiers of multimodal inputs overlapping each block (as vLLM's prefix hash includes them)."""
    features = getattr(request, "mm_features", None) or []
    if not features:
        return None
    extras: list[list[str]] = [[] for _ in range(num_blocks)]
    for f in features:
        start, length = f.mm_position.offset, f.mm_position.length
        for b in range(start // block_size, min(num_blocks, (start + length - 1) // block_size + 1)):
            extras[b].append(str(f.identifier))
    return extras


class UCMScheduler:
    """Decides, per request, how many tokens come from the store and which blocks to load and dump.

    Args:
        config: the UCM config.
        spec: the engine's KV spec.
        namespace_digest: 16-byte block-key namespace (``ucm.hashing.KVNamespace.digest``).
        store: the store pipeline (lookups only).
        load: whether this role loads (kv_both, kv_consumer).
        dump: whether this role dumps (kv_both, kv_producer).
        tp_size: tensor-parallel size of the engine.
        dp_rank: the engine's data-parallel rank when it is one of several DP engines (added to the per-request log
            line, whose ranks otherwise share one log), else None.

    With CacheBlend on (``ucm_sparse_config.Blend``), a prompt with chunks past its stored prefix also offers every
    token up to its last one (:func:`~ucm.sparse.blend.blend_end`): the workers fill them from the chunks' stored KV
    and compute the rest (:mod:`ucm.integration.vllm.blend`), vLLM computes the last token; such a request dumps no
    block, since its KV past the prefix is approximate and its keys would claim a prefix computation.
    """

    def __init__(
        self,
        config: UcmConfig,
        spec: KVSpec,
        namespace_digest: bytes,
        store: UcmKVStoreBase,
        *,
        load: bool,
        dump: bool,
        tp_size: int = 1,
        dp_rank: int | None = None,
    ) -> None:
        self._block_size = spec.block_size
        self._namespace = namespace_digest
        self._store = store
        self._load = load
        self._dump = dump
        self._tp_size = tp_size
        self._dp_suffix = "" if dp_rank is None else f", dp rank: {dp_rank}"
        sparse = config.ucm_sparse_config
        self._blend: BlendConfig | None = sparse.Blend if sparse is not None else None
        self._requests: dict[str, _RequestState] = {}
        self.recorder: Recorder = NO_RECORDER  # where each request's first lookup is recorded (ucm.store.observe)
        # Keys the workers reported as stored (their DRAM tier is invisible from this process), most recent last.
        # Bounded: older keys have been written back to storage by the time they fall out.
        self._recent: OrderedDict[bytes, None] = OrderedDict()
        self._recent_capacity = max(4096, 2 * config.store.cache_buffer_capacity_bytes // max(1, spec.block_nbytes))
        self._clears_storage = config.reset_clears_storage
        self._reset_epoch = 0  # resets so far; sent to the workers with every step's metadata
        self._reset_unsent = False  # a reset the workers have not been told of yet
        # With vLLM's KV events on (set by the connector): turns the workers' tier changes into vLLM's events.
        self.events: KVEventTranslator | None = None

    def _keys(self, request: Request) -> list[bytes]:
        tokens = request.prompt_token_ids
        if tokens is None:  # prompt embeddings: no token ids to key on
            return []
        lora = request.lora_request.lora_name if request.lora_request is not None else None
        seed = request_seed(self._namespace, request.cache_salt, lora)
        num_blocks = len(tokens) // self._block_size
        return block_keys(seed, tokens, self._block_size, _mm_block_extras(request, num_blocks, self._block_size))

    def add_stored_keys(self, keys: Sequence[bytes], reset_epoch: int | None = None) -> None:
        """Record keys the workers stored this step (from ``UCMWorkerMetadata``); ignored when stored in a reset
        epoch before the current one (``reset_epoch``; None: the current one)."""
        if reset_epoch is not None and reset_epoch < self._reset_epoch:
            return
        for key in rank_keys(keys, 0, self._tp_size):
            self._recent[key] = None
            self._recent.move_to_end(key)
        while len(self._recent) > self._recent_capacity:
            self._recent.popitem(last=False)

    def forget_failed_keys(self, keys: Sequence[bytes]) -> None:
        """Keys whose load failed (from ``UCMWorkerMetadata``): no longer count them as stored, and dump the
        recomputed blocks again so that the store heals (vLLM recomputes from the first failed block)."""
        if not keys:
            return
        failed = set(keys)
        for key in rank_keys(keys, 0, self._tp_size):
            self._recent.pop(key, None)
        self._rewind_dumps(failed, unstored=True)
        logger.debug("%d blocks failed to load; they will be dumped again once recomputed", len(failed))

    def redo_dumps(self, keys: Sequence[bytes]) -> None:
        """Keys whose dump the workers dropped (from ``UCMWorkerMetadata``: computed in a step with a failed load,
        see :mod:`ucm.integration.vllm.worker`): dump them again at a later step of their requests, from vLLM's
        recomputed KV. Requests already finished lose those dumps (a later request recomputes and stores them)."""
        if keys:
            self._rewind_dumps(set(keys), unstored=False)

    def _rewind_dumps(self, keys: set[bytes], unstored: bool) -> None:
        """Move each live request's next dump back to its first block among ``keys`` (and, with ``unstored``, stop
        counting that block and the later ones as stored)."""
        for state in self._requests.values():
            if state.blended:  # dumps nothing
                continue
            first = next((i for i, k in enumerate(state.keys) if k in keys), None)
            if first is not None:
                if unstored:
                    state.num_stored = min(state.num_stored, first)
                state.next_dump = min(state.next_dump, first)

    def reset(self) -> bool:
        """Reset UCM's caches (vLLM's ``reset_prefix_cache`` with ``reset_external``; see the module docstring).

        Forgets the keys the workers reported stored, empties the DRAM tier this process holds and bumps the reset
        epoch, which the next step's metadata takes to the workers. With ``reset_clears_storage``, also deletes
        every block file of this model's namespace from storage now, and reports no stored prefix to requests until
        the workers have been told (they delete what their unfinished dumps write meanwhile). Logs one info line.

        Returns:
            True when done; False when some block files could not be deleted (a warning names the first).
        """
        forgotten = len(self._recent)
        self._recent.clear()
        self._reset_epoch += 1
        self._reset_unsent = True
        dropped = self._store.drop_cached()
        if self.events is not None:
            self.events.reset(self._clears_storage)
        if not self._clears_storage:
            logger.info(
                "cache reset: forgot %d blocks the workers stored, dropped %d from this process's DRAM tier; the "
                "workers empty theirs at the next step; storage kept (reset_clears_storage: false)",
                forgotten,
                dropped,
            )
            return True
        removal = self._store.remove_stored(namespace=self._namespace)
        logger.info(
            "cache reset: forgot %d blocks the workers stored, dropped %d from this process's DRAM tier; the workers "
            "empty theirs at the next step; removed %d block files (%.1f MiB) of this model from storage "
            "(reset_clears_storage: true)",
            forgotten,
            dropped,
            removal.blocks,
            removal.nbytes / 2**20,
        )
        if removal.errors:
            logger.warning(
                "cache reset: %d block files or directories could not be cleared, e.g. %s",
                len(removal.errors),
                removal.errors[0],
            )
        return not removal.errors

    def _lookup(self, keys: list[bytes]) -> int:
        """Leading keys present: reported by the workers, or found by the store. With tensor parallelism each rank
        stores its shard under its own key; rank 0's stand for all (ranks dump the same blocks in the same step).
        0 while a storage-clearing reset is on its way to the workers."""
        if self._reset_unsent and self._clears_storage:
            return 0
        return tiered_lookup(rank_keys(keys, 0, self._tp_size), self._recent.__contains__, self._store)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` (vLLM's own prefix-cache hit, block-aligned) that the store can
        supply, as ``(tokens, False)``: loads are synchronous (done in the step's ``start_load_kv``).

        Counts the leading full prompt blocks the store holds (or the workers reported stored); a hit on the whole
        prompt leaves its last token to compute (vLLM needs one token to produce logits). The first call for a
        request logs its line (``request_id: .., total_blocks_num: .., hit hbm: .., hit external: ..``, in
        blocks, then ``, dp rank: ..`` in a data-parallel engine); a later call (the request was not scheduled, or
        was preempted) looks up again.
        """
        t0 = time.perf_counter()
        state = self._requests.get(request.request_id)
        params = request.kv_transfer_params or {}
        if state is None:
            keys = self._keys(request)
            num_stored = self._lookup(keys)
            state = _RequestState(keys=keys, num_stored=num_stored, remote_decode=bool(params.get(DO_REMOTE_DECODE)))
            if self.events is not None:
                state.request = request
            self._requests[request.request_id] = state
        else:  # called again (not scheduled last time, or preempted): the store may have changed
            state.num_stored = self._lookup(state.keys)
        num_hbm = num_computed_tokens // self._block_size
        state.num_hbm = num_hbm
        num_external = 0
        if self._load and state.num_stored > num_hbm:
            num_external = (state.num_stored - num_hbm) * self._block_size
            num_prompt = request.num_prompt_tokens
            if num_computed_tokens + num_external >= num_prompt:
                num_external = num_prompt - 1 - num_computed_tokens
            num_external = max(num_external, 0)
        state.blend = None
        if self._load and self._blend is not None:
            num_external = max(num_external, self._plan_blend(request, state, num_computed_tokens))
        if not state.logged:
            state.logged = True
            if self.recorder.enabled:
                self.recorder.record(
                    Observation(
                        "lookup",
                        "all",
                        max(0, len(state.keys) - num_hbm),
                        max(0, state.num_stored - num_hbm) if self._load else 0,
                        seconds=time.perf_counter() - t0,
                        tokens=num_external,
                        requests=(request.request_id,),
                    )
                )
            expected = params.get(PREFILL_BLOCKS)
            if self._load and isinstance(expected, int) and state.num_stored < expected:
                logger.warning(
                    "request_id: %s: the prefill instance stored %d blocks, the store has the first %d; "
                    "recomputing the rest (is storage_backends the same directory on both instances?)",
                    request.request_id,
                    expected,
                    state.num_stored,
                )
            logger.info(
                "request_id: %s, total_blocks_num: %d, hit hbm: %d, hit external: %d%s%s",
                request.request_id,
                len(state.keys),
                num_hbm,
                -(-min(num_external, max(0, state.num_stored - num_hbm) * self._block_size) // self._block_size),
                self._dp_suffix,
                "" if state.blend is None else f", blend: tokens {state.blend.start}-{state.blend.end}",
            )
            logger.debug(
                "request_id: %s, block keys: %s",
                request.request_id,
                " ".join(k.hex() for k in rank_keys(state.keys, 0, self._tp_size)),
            )
        return num_external, False

    def _plan_blend(self, request: Request, state: _RequestState, num_computed_tokens: int) -> int:
        """CacheBlend's run of ``request`` (kept in ``state.blend`` until :meth:`build_connector_meta` sends it): the
        tokens from its stored or cached prefix to its last token (:func:`~ucm.sparse.blend.blend_end`). Returns
        the tokens offered beyond ``num_computed_tokens`` (0: no run, e.g. no chunk-end token past the prefix)."""
        assert self._blend is not None
        tokens = request.prompt_token_ids
        if tokens is None or request.lora_request is not None or getattr(request, "mm_features", None):
            return 0
        spans = chunk_spans(tokens, self._blend.chunk_end_token_id)
        end = blend_end(spans, request.num_prompt_tokens)
        start = max(num_computed_tokens, state.num_stored * self._block_size)
        if not spans or min(spans[-1][1], end) <= start:  # no chunk token past the prefix: nothing to blend
            return 0
        seed = request_seed(self._namespace, request.cache_salt, None)
        query = list(tokens[spans[-1][1] :]) if self._blend.selection == "question" else []
        state.blend = BlendTransfer(request.request_id, list(tokens[:end]), start, end, spans, [], seed, query)
        return end - num_computed_tokens

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Record the vLLM blocks that the store's blocks go into: ``blocks`` are all the request's blocks (vLLM's
        prefix-cache hit first), ``num_external_tokens`` what :meth:`get_num_new_matched_tokens` offered and vLLM
        accepted (0 when it did not)."""
        state = self._requests.get(request.request_id)
        if state is None:
            return
        block_ids = list(blocks.get_block_ids()[0])
        state.block_ids = block_ids
        state.next_dump = max(state.next_dump, state.num_stored)
        if num_external_tokens > 0:
            num_load = -(-num_external_tokens // self._block_size)
            start = state.num_hbm
            if state.blend is not None:  # the blocks before the blend's run; the run's come with it
                num_load = max(0, state.num_stored - start)
                state.blended = True
            state.load_block_ids = block_ids[start : start + num_load] or None
        elif state.blend is not None:
            state.blend = None  # vLLM took none of the offer
        if state.blended:
            state.next_dump = len(state.keys)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> UCMConnectorMetadata:
        """The loads and dumps of this step. Dumps cover prompt blocks that become full in this step."""
        meta = UCMConnectorMetadata(reset_epoch=self._reset_epoch, clear_storage=self._clears_storage)
        self._reset_unsent = False
        scheduled: list[tuple[str, int, list[int] | None, bool]] = []
        for new in scheduler_output.scheduled_new_reqs:
            scheduled.append((new.req_id, new.num_computed_tokens, list(new.block_ids[0]), True))
            meta.allocated_block_ids.extend(b for group in new.block_ids for b in group)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if new_ids:
                meta.allocated_block_ids.extend(b for group in new_ids for b in group)
            resumed = req_id in cached.resumed_req_ids
            scheduled.append((req_id, cached.num_computed_tokens[i], list(new_ids[0]) if new_ids else None, resumed))
        for req_id, num_computed, new_block_ids, replace in scheduled:
            state = self._requests.get(req_id)
            if state is None:
                continue
            if replace or state.block_ids is None:
                state.block_ids = new_block_ids or []
            elif new_block_ids:
                state.block_ids.extend(new_block_ids)
            if state.load_block_ids:
                start = state.num_hbm
                keys = state.keys[start : start + len(state.load_block_ids)]
                meta.loads.append(BlockTransfer(req_id, keys, state.load_block_ids))
                self._note_blocks(state, start, start + len(keys))
                state.load_block_ids = None
            if state.blend is not None:
                blend = state.blend
                blend.block_ids = state.block_ids[: -(-blend.end // self._block_size)]
                meta.blends.append(blend)
                state.blend = None
            if not self._dump:
                continue
            done_tokens = num_computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            full = min(len(state.keys), done_tokens // self._block_size, len(state.block_ids))
            if full > state.next_dump:
                meta.dumps.append(
                    BlockTransfer(
                        req_id,
                        state.keys[state.next_dump : full],
                        state.block_ids[state.next_dump : full],
                        durable=state.remote_decode,
                    )
                )
                self._note_blocks(state, state.next_dump, full)
                state.next_dump = full
        return meta

    def _note_blocks(self, state: _RequestState, start: int, stop: int) -> None:
        """With KV events on: remember the vLLM identity of prompt blocks ``[start, stop)`` (loaded or dumped)."""
        if self.events is not None and state.request is not None:
            self.events.note_blocks(state.request, start, rank_keys(state.keys[start:stop], 0, self._tp_size))

    def request_finished(self, request_id: str) -> dict[str, int] | None:
        """Forget a finished request; return the ``kv_transfer_params`` for its response.

        A request sent with ``kv_transfer_params.do_remote_decode`` (a prefill for another instance) gets
        ``{"ucm_prefill_blocks": n}``: its first ``n`` full prompt blocks are in the store (their dumps were made
        durable before the step ended, see :class:`~ucm.integration.vllm.metadata.BlockTransfer`). The proxy passes
        it to the decode instance, which warns when its store holds fewer. Other requests: ``None``.
        """
        state = self._requests.pop(request_id, None)
        if state is None or not state.remote_decode or not self._dump:
            return None
        return {PREFILL_BLOCKS: min(state.next_dump, len(state.keys))}
