"""Per-step metadata the scheduler-side connector sends to the workers: which blocks to load and to dump."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


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
