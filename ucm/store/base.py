"""The store contract every UCM store stage implements.

A store maps block keys (16-byte digests, see ``ucm.hashing``) to canonical blocks (opaque byte rows, see
``ucm.kernels.layouts``). Stages stack into a pipeline (``Cache|Posix``): each implements this contract and calls
the stage below it.

Semantics (the design's store contract):
- ``lookup(keys)`` returns how many *leading* keys are present (prefix semantics); it reads no block data.
- ``load(keys, dst)`` / ``dump(keys, src)`` are batched and asynchronous: they return a :class:`Task`;
  ``wait(task)`` blocks until it is done and returns a :class:`TaskResult` naming the keys that failed.
- A dumped block becomes visible to ``lookup`` only once it is completely written.
- A load that cannot produce the exact bytes that were dumped (missing, truncated, corrupted, wrong key or size)
  reports that key as failed and leaves the matching ``dst`` row unspecified; it never reports wrong bytes as
  loaded. Callers treat a failed key as a cache miss.

Buffers are CPU ``torch.uint8`` tensors of shape ``[len(keys), block_nbytes]``, row ``i`` holding key ``i``'s
block; the caller keeps ``src`` unchanged and ``dst`` alive until the task is done.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

KEY_NBYTES = 16


class StoreError(Exception):
    """Base class of store failures. A store failure on a load is a cache miss, never wrong data."""


class BlockCorruptedError(StoreError):
    """A stored block failed validation (header, key, size or checksum). Treat as a miss."""


@dataclass(frozen=True)
class TaskResult:
    """Outcome of a load or dump.

    Attributes:
        num_keys: number of keys the task was given.
        failed: indices (into the task's keys) of the blocks that were not loaded / not stored.
    """

    num_keys: int
    failed: frozenset[int] = field(default_factory=frozenset)

    @property
    def ok(self) -> bool:
        """True when every key succeeded."""
        return not self.failed


class Task:
    """Handle of an asynchronous batched load or dump, backed by a ``concurrent.futures.Future``."""

    __slots__ = ("_future",)

    def __init__(self, future: Future[TaskResult]) -> None:
        self._future = future

    @classmethod
    def completed(cls, result: TaskResult) -> Task:
        """A task that is already done with ``result``."""
        future: Future[TaskResult] = Future()
        future.set_result(result)
        return cls(future)

    def done(self) -> bool:
        """True once the task has finished (successfully or not)."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> TaskResult:
        """Block until the task is done and return its result (``timeout`` in seconds)."""
        return self._future.result(timeout)


def check_keys(keys: Sequence[bytes]) -> None:
    """Validate block keys: each a 16-byte ``bytes``.

    Raises:
        TypeError: a key is not ``bytes``.
        ValueError: a key has the wrong length.
    """
    for key in keys:
        if not isinstance(key, bytes):
            raise TypeError(f"block keys must be bytes, got {type(key).__name__}")
        if len(key) != KEY_NBYTES:
            raise ValueError(f"block keys must be {KEY_NBYTES} bytes, got {len(key)}")


def check_keys_and_buffer(keys: Sequence[bytes], buf: torch.Tensor, name: str) -> None:
    """Validate a batch: keys are 16-byte ``bytes``; ``buf`` is a contiguous CPU uint8 ``[len(keys), n]`` tensor.

    Raises:
        TypeError: a key is not ``bytes`` or ``buf`` is not a uint8 tensor.
        ValueError: a key has the wrong length, or ``buf``'s shape, device or contiguity is wrong.
    """
    check_keys(keys)
    if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8:
        got = buf.dtype if isinstance(buf, torch.Tensor) else type(buf).__name__
        raise TypeError(f"{name} must be a torch.uint8 tensor, got {got}")
    if buf.dim() != 2 or buf.shape[0] != len(keys):
        raise ValueError(f"{name} must have shape [num_keys={len(keys)}, block_nbytes], got {tuple(buf.shape)}")
    if buf.device.type != "cpu" or not buf.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous CPU tensor (device={buf.device}, contiguous={buf.is_contiguous()})"
        )


def tiered_lookup(keys: Sequence[bytes], present: Callable[[bytes], bool], below: UcmKVStoreBase | None) -> int:
    """Leading ``keys`` that are ``present`` here or, failing that, in the store ``below`` (prefix semantics).

    Asks ``below`` once per run of keys missing here, so a key held by either tier counts.
    """
    i = 0
    while i < len(keys):
        if present(keys[i]):
            i += 1
            continue
        found = below.lookup(keys[i:]) if below is not None else 0
        if found == 0:
            break
        i += found
    return i


class UcmKVStoreBase(abc.ABC):
    """Abstract store stage. See the module docstring for the contract."""

    @abc.abstractmethod
    def lookup(self, keys: Sequence[bytes]) -> int:
        """Return the number of leading ``keys`` whose blocks are present (0..len(keys)). Reads no block data."""

    @abc.abstractmethod
    def load(self, keys: Sequence[bytes], dst: torch.Tensor) -> Task:
        """Start reading the blocks of ``keys`` into the rows of ``dst`` (uint8 ``[len(keys), block_nbytes]``).

        The task's result names the keys that failed (absent or damaged); their ``dst`` rows are unspecified.
        """

    @abc.abstractmethod
    def dump(self, keys: Sequence[bytes], src: torch.Tensor) -> Task:
        """Start writing the rows of ``src`` (uint8 ``[len(keys), block_nbytes]``) as the blocks of ``keys``.

        A block is visible to ``lookup`` only once fully written. The task's result names the keys not stored.
        """

    def wait(self, task: Task) -> TaskResult:
        """Block until ``task`` is done; return its :class:`TaskResult`."""
        return task.result()

    def check(self, task: Task) -> bool:
        """True when ``task`` is done (non-blocking)."""
        return task.done()

    def set_namespace(self, tag: bytes, info: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """Record the model namespace of the blocks dumped from now on: ``tag`` (the namespace digest, >= 4 bytes)
        and ``info`` (JSON-serializable fields naming it: model, dtype, block_size...), for operators' tools.
        Stages that keep nothing per namespace ignore it; stages over another stage pass it down."""

    def flush(self) -> None:  # noqa: B027 - optional hook, a no-op for stages without background work
        """Block until all background work (write-backs) started so far is finished."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Flush and release resources (threads, file handles). Idempotent."""
