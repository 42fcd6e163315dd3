"""Per-step metadata the scheduler-side connector sends to the workers: which blocks to load and to dump."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass
class BlockTransfer:
    """Blocks of one request to move this step.

    Attributes:
        req_id: vLLM request id.
        keys: 16-byte block keys (rank-independent; workers derive per-rank keys).
        block_ids: vLLM block ids, ``block_ids[i]`` holding ``keys[i]``.
        durable: dumps only: the step must not end before these blocks are in the store's last stage (visible to
            every instance sharing it), because the request's response tells another instance to load them
            (prefill/decode disaggregation, ``kv_transfer_params.do_remote_decode``).
    """

    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    durable: bool = False


@dataclass
class BlendTransfer:
    """A run of one request's prompt that CacheBlend fills this step (:mod:`ucm.integration.vllm.blend`).

    Attributes:
        req_id: vLLM request id.
        token_ids: the prompt's first ``end`` token ids.
        start, end: the run is tokens ``[start, end)``; the tokens before ``start`` are in the paged KV when the
            blend runs (vLLM's prefix cache, or this step's loads).
        spans: the prompt's chunks ``[s, e)`` in order (each ends with the chunk-end token), covering the tokens
            up to the last chunk's end; the run's tokens past it (the question but its last token) belong to no
            chunk. The last chunk can reach past ``end`` (a prompt that ends with the chunk-end token).
        block_ids: the vLLM blocks of tokens ``[0, end)``.
        seed: the request's key-chain seed (``ucm.hashing.request_seed``): a chunk's blocks are keyed from it.
        query_ids: the prompt's tokens after its last chunk, through its last token (the question; read by
            ``selection: question``).
    """

    req_id: str
    token_ids: list[int]
    start: int
    end: int
    spans: list[tuple[int, int]]
    block_ids: list[int]
    seed: bytes
    query_ids: list[int] = field(default_factory=list)


@dataclass
class UCMConnectorMetadata(KVConnectorMetadata):
    """What the workers do this step: ``loads`` before the forward pass (then ``blends``, CacheBlend's runs), ``dumps``
    after it.

    ``allocated_block_ids``: every block vLLM allocated in this step (to new, resumed and growing requests, prefix
    hits included): what a worker derived from those blocks' earlier contents is void (ReRoPE's kept keys, see
    ``ucm.integration.vllm.sparse_backend.BlockAllocations``).

    ``reset_epoch`` counts the scheduler's cache resets (vLLM's ``reset_prefix_cache`` with ``reset_external``);
    a worker that sees it above its own empties its DRAM tier before anything else of the step, and with
    ``clear_storage`` also deletes the blocks its unfinished dumps of the previous epoch wrote (see
    :meth:`~ucm.integration.vllm.worker.UCMWorker.reset`).
    """

    loads: list[BlockTransfer] = field(default_factory=list)
    dumps: list[BlockTransfer] = field(default_factory=list)
    blends: list[BlendTransfer] = field(default_factory=list)
    allocated_block_ids: list[int] = field(default_factory=list)
    reset_epoch: int = 0
    clear_storage: bool = False


@dataclass
class UCMWorkerMetadata(KVConnectorWorkerMetadata):
    """What the workers tell the scheduler after a step: keys their store now holds (in DRAM or on storage), and
    keys whose load failed (the store no longer holds them as they were: recomputed, they must be dumped again).

    The scheduler's process does not see the workers' DRAM tier; without ``stored_keys``, a block would only be
    found once written back to storage. Keys are rank-independent (as in :class:`BlockTransfer`). ``reset_epoch``:
    the worker's reset epoch when it stored them (the scheduler ignores keys stored before its last reset).
    ``tier_events``: with vLLM's KV events on, ``(stored, tier, keys)`` for each change of what a tier holds, oldest
    first, keys as this rank stores them (:mod:`ucm.integration.vllm.events`). ``dropped_keys``: keys whose dump
    the workers dropped because it was computed in a step with a failed load (see :mod:`ucm.integration.vllm.worker`):
    the scheduler plans them again.
    """

    stored_keys: list[bytes] = field(default_factory=list)
    failed_keys: list[bytes] = field(default_factory=list)
    reset_epoch: int = 0
    tier_events: list[tuple[bool, str, list[bytes]]] = field(default_factory=list)
    dropped_keys: list[bytes] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Keep the keys every rank stored (a block is usable only when all its shards are), the keys any rank
        failed to load or dropped the dump of, the oldest reset epoch, and every rank's tier events."""
        assert isinstance(other, UCMWorkerMetadata)
        theirs = set(other.stored_keys)
        failed = list(dict.fromkeys([*self.failed_keys, *other.failed_keys]))
        dropped = list(dict.fromkeys([*self.dropped_keys, *other.dropped_keys]))
        epoch = min(self.reset_epoch, other.reset_epoch)
        stored = [k for k in self.stored_keys if k in theirs]
        return UCMWorkerMetadata(stored, failed, epoch, [*self.tier_events, *other.tier_events], dropped)
