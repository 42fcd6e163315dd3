"""KV events for UCM's tiers: ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` on vLLM's KV-event stream.

With ``vllm serve --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'`` vLLM publishes
what its own prefix cache holds (``medium: "GPU"``); a router that follows those events (llm-d, Dynamo, SGLang's
router) would forget a prefix once vLLM drops it from its KV cache, although UCM still serves it. With events on,
UCM publishes its tiers on the same stream, as vLLM's own offloading connectors do: ``medium`` is ``"CPU"`` for
UCM's DRAM tier (the ``Cache`` stage) and ``"STORAGE"`` for its storage (``Posix``); the block hashes are vLLM's own
(``request.block_hashes``, converted as vLLM converts them, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), so the same
block has one hash in every medium, and ``BlockStored`` carries the block's tokens, parent hash, LoRA and extra keys
like vLLM's.

The path, in vLLM 0.32's processes:

1. Each store stage tells its recorder which keys a tier starts or stops holding
   (:meth:`~ucm.store.observe.Recorder.record_keys`): a dump's new DRAM blocks, a promotion after a storage hit, an
   LRU eviction, a block file written, deleted by garbage collection or found damaged. On the worker a
   :class:`ResidencyBuffer` (a key sink) collects them.
2. After each step the worker sends them to the scheduler side inside ``UCMWorkerMetadata`` (as the stored keys
   already travel), where :class:`KVEventTranslator` turns the keys into vLLM's block hashes and vLLM publishes them
   with the step's other events (``take_events``).
3. The translator knows a key's vLLM block through the requests whose blocks this instance loaded or dumped (the
   most recent ``capacity`` blocks): a tier event of a key it does not know (a block file of another instance, or
   one older than that) is not published.

A reset (``POST /reset_prefix_cache?reset_external=true``): vLLM itself publishes ``AllBlocksCleared`` for the
instance. With ``reset_clears_storage: true`` UCM publishes ``AllBlocksCleared`` too, since nothing of this model is
left; with ``false`` it publishes ``BlockStored`` (``STORAGE``) again for the stored blocks it knows, after vLLM's
clear, so that a router keeps them. Events reach vLLM at engine steps only: what a tier does while the engine is idle
(a write-back finishing after the request's last step, a garbage collection) is published at the next step.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)

from ucm.logger import init_logger
from ucm.store.observe import Residency

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)

# UCM tier -> vLLM's KV-event medium.
MEDIUMS = {"dram": MEDIUM_CPU, "storage": MEDIUM_STORAGE}
# One tier event as it travels in UCMWorkerMetadata: (stored, tier, keys).
TierEvent = tuple[bool, str, list[bytes]]
# Tier events a worker holds between two steps at most (older ones are dropped, with one warning).
MAX_PENDING_EVENTS = 65536
# Blocks whose vLLM identity the scheduler side keeps, at least (see KVEventTranslator).
MIN_KNOWN_BLOCKS = 65536


def kv_events_enabled(vllm_config: VllmConfig) -> bool:
    """True when the engine publishes KV events (``--kv-events-config`` with ``enable_kv_cache_events``)."""
    events = getattr(vllm_config, "kv_events_config", None)
    return bool(events is not None and events.enable_kv_cache_events)


class ResidencyBuffer:
    """Worker side: a key sink (:meth:`~ucm.store.observe.Recorder.add_key_sink`) that keeps the tier events of
    ``dram`` and ``storage`` until the step's end takes them (:meth:`take`). Thread-safe; holds at most
    :data:`MAX_PENDING_EVENTS` events (the oldest are dropped, with one warning)."""

    def __init__(self) -> None:
        self._events: list[TierEvent] = []
        self._lock = threading.Lock()
        self._dropped_logged = False

    def add(self, residency: Residency) -> None:
        """Keep one tier event (other tiers are ignored)."""
        if residency.tier not in MEDIUMS:
            return
        with self._lock:
            self._events.append((residency.stored, residency.tier, list(residency.keys)))
            if len(self._events) > MAX_PENDING_EVENTS:
                del self._events[: len(self._events) - MAX_PENDING_EVENTS]
                if not self._dropped_logged:
                    self._dropped_logged = True
                    logger.warning(
                        "KV events: more than %d tier events between two engine steps; the oldest are not published",
                        MAX_PENDING_EVENTS,
                    )

    def take(self) -> list[TierEvent]:
        """The events since the last call, oldest first."""
        with self._lock:
            events, self._events = self._events, []
        return events


@dataclass
class _Block:
    """What vLLM's event names a block by, and the media UCM holds it in."""

    block_hash: Any  # ExternalBlockHash
    parent_hash: Any  # ExternalBlockHash | None
    token_ids: list[int]
    lora_id: int | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None
    media: set[str] = field(default_factory=set)

    def stored(self, block_size: int, medium: str) -> BlockStored:
        return BlockStored(
            block_hashes=[self.block_hash],
            parent_block_hash=self.parent_hash,
            token_ids=self.token_ids,
            block_size=block_size,
            lora_id=self.lora_id,
            medium=medium,
            lora_name=self.lora_name,
            extra_keys=self.extra_keys,
            group_idx=0,
        )


class KVEventTranslator:
    """Scheduler side: turns the workers' tier events (UCM keys) into vLLM KV events (vLLM's block hashes).

    Args:
        block_size: tokens per block (vLLM's ``block_size``).
        capacity: blocks whose identity is kept (most recently loaded or dumped last); the events of other keys are
            not published.
    """

    def __init__(self, block_size: int, capacity: int = MIN_KNOWN_BLOCKS) -> None:
        self._block_size = block_size
        self._capacity = max(1, capacity)
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()
        self._events: list[KVCacheEvent] = []
        self._unhashed_logged = False

    def note_blocks(self, request: Request, start: int, keys: Sequence[bytes]) -> None:
        """Remember the vLLM identity of ``request``'s prompt blocks ``start, start + 1, ...`` whose UCM keys (as rank
        0 stores them) are ``keys``: they are about to be loaded or dumped. Needs vLLM's block hashes at UCM's block
        size (prefix caching on, ``hash_block_size == block_size``); without them nothing is noted (logged once)."""
        stop = start + len(keys)
        hashes = request.block_hashes
        if len(hashes) < stop or len(hashes) != len(request.all_token_ids) // self._block_size:
            if not self._unhashed_logged:
                self._unhashed_logged = True
                logger.warning(
                    "KV events: request %s has no vLLM block hash per %d-token block (prefix caching off, or another "
                    "hash block size); UCM publishes no events for such requests",
                    request.request_id,
                    self._block_size,
                )
            return
        lora = request.lora_request
        for i, key in zip(range(start, stop), keys, strict=True):
            known = self._blocks.get(key)
            if known is not None:
                self._blocks.move_to_end(key)
                continue
            a, b = i * self._block_size, (i + 1) * self._block_size
            extra, _ = generate_block_hash_extra_keys(request, a, b, 0)
            self._blocks[key] = _Block(
                block_hash=maybe_convert_block_hash(hashes[i]),
                parent_hash=maybe_convert_block_hash(hashes[i - 1]) if i > 0 else None,
                token_ids=list(request.all_token_ids[a:b]),
                lora_id=lora.adapter_id if lora is not None else None,
                lora_name=lora.name if lora is not None else None,
                extra_keys=to_event_extra_keys([extra]),
            )
        while len(self._blocks) > self._capacity:
            self._blocks.popitem(last=False)

    def add_tier_events(self, events: Iterable[TierEvent]) -> None:
        """Queue the vLLM events of the workers' tier events (keys as rank 0 stores them; others are unknown here).
        A key already in (or already gone from) a medium publishes nothing again."""
        for stored, tier, keys in events:
            medium = MEDIUMS[tier]
            changed: list[_Block] = []
            for key in keys:
                block = self._blocks.get(key)
                if block is None or (medium in block.media) == stored:
                    continue
                if stored:
                    block.media.add(medium)
                else:
                    block.media.discard(medium)
                changed.append(block)
            if not changed:
                continue
            if stored:
                self._events.extend(block.stored(self._block_size, medium) for block in changed)
            else:
                self._events.append(BlockRemoved(block_hashes=[b.block_hash for b in changed], medium=medium))

    def reset(self, clears_storage: bool) -> None:
        """A cache reset (see the module docstring): forget DRAM residency; with ``clears_storage`` forget all and
        publish ``AllBlocksCleared``, else publish the stored blocks again after vLLM's own ``AllBlocksCleared``."""
        if clears_storage:
            self._blocks.clear()
            self._events.append(AllBlocksCleared())
            return
        for block in self._blocks.values():
            block.media.discard(MEDIUM_CPU)
            if MEDIUM_STORAGE in block.media:
                self._events.append(block.stored(self._block_size, MEDIUM_STORAGE))

    def take_events(self) -> list[KVCacheEvent]:
        """The events queued since the last call, oldest first."""
        events, self._events = self._events, []
        return events
