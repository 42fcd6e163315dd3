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
    """

    req_id: str
    keys: list[bytes]
    block_ids: list[int]


@dataclass
class UCMConnectorMetadata(KVConnectorMetadata):
    """What the workers do this step: ``loads`` before the forward pass, ``dumps`` after it."""

    loads: list[BlockTransfer] = field(default_factory=list)
    dumps: list[BlockTransfer] = field(default_factory=list)


@dataclass
class UCMWorkerMetadata(KVConnectorWorkerMetadata):
    """What the workers tell the scheduler after a step: keys their store now holds (in DRAM or on storage).

    The scheduler's process does not see the workers' DRAM tier; without this, a block would only be found once
    written back to storage. Keys are rank-independent (as in :class:`BlockTransfer`).
    """

    stored_keys: list[bytes] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Keep the keys every rank stored (a block is usable only when all its shards are)."""
        assert isinstance(other, UCMWorkerMetadata)
        theirs = set(other.stored_keys)
        return UCMWorkerMetadata([k for k in self.stored_keys if k in theirs])
