"""The store contract every UCM store stage implements.

A store maps block keys (16-byte digests, see ``ucm.hashing``) to canonical blocks (opaque byte rows, see
``ucm.kernels.layouts``). Stages stack into a pipeline (``Cache|Posix``): each implements this contract and calls
the stage below it.

Semantics (the design's store contract):
- ``lookup(keys)`` returns how many *leading* keys are present (prefix semantics); it reads no block data.
- ``load(keys, dst)`` / ``dump(keys, src)`` are batched and asynchronous: they return a :class:`Task`;
  ``wait(task)`` blocks until it is done and returns a :class:`TaskResult` naming the keys that failed.
- ``load_sharded(keys, dst, num_shards)`` is ``load`` for rows made of equal shards (a layerwise load: one per
  layer): its task's ``wait_shard(s)`` returns once shard ``s`` of every row is in ``dst`` (not yet validated), so a
  caller can use the first layers while later ones are still being read; the task's result is validated as ``load``'s,
  and an optional ``on_row(i, ok)`` hook hears of each row as soon as it is validated or failed.
- ``lend(keys, block_nbytes)`` hands out read-only views of the blocks a stage holds in process memory (the
  ``Cache`` stage's DRAM slots), kept from eviction and reuse until the :class:`Lease` is released, so a caller can
  copy them where they lie (the connector scatters them straight into the paged KV) instead of into a ``dst`` first.
- A dumped block becomes visible to ``lookup`` only once it is completely written.
- A load that cannot produce the exact bytes that were dumped (missing, truncated, corrupted, wrong key or size)
  reports that key as failed and leaves the matching ``dst`` row unspecified; it never reports wrong bytes as
  loaded. Callers treat a failed key as a cache miss.
- ``drop_cached()`` empties the tiers held in process memory (the ``Cache`` stage's DRAM);
  ``remove_stored(keys=...)`` / ``remove_stored(namespace=...)`` deletes blocks from the storage tier (for vLLM's
  ``reset_prefix_cache``, see ``ucm.integration.vllm.scheduler``). A block removed under a running load is a miss
  for it, never wrong data.

Buffers are CPU ``torch.uint8`` tensors of shape ``[len(keys), block_nbytes]``, row ``i`` holding key ``i``'s
block; the caller keeps ``src`` unchanged and ``dst`` alive until the task is done.

Encoded (variable-size) payloads are part of the contract: a stage that stores bytes offers
:class:`EncodedStore`'s verbs (``dump_encoded``, ``load_encoded``: a payload of any size with a codec id, decoded
by the caller) through :meth:`UcmKVStoreBase.encoded_store`, so a stage that encodes blocks (``Compress``) stacks
over any such stage. A stage answers ``None`` there when it keeps canonical blocks only; the pipeline builder
refuses to put an encoding stage over it.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from ucm.logger import init_logger
from ucm.store.observe import NO_RECORDER, Recorder

logger = init_logger(__name__)

KEY_NBYTES = 16

# A sharded load's per-row hook: ``(row, ok)``, see :meth:`UcmKVStoreBase.load_sharded`.
RowCallback = Callable[[int, bool], None]


class StoreError(Exception):
    """Base class of store failures. A store failure on a load is a cache miss, never wrong data."""


class BlockCorruptedError(StoreError):
    """A stored block failed validation (header, key, size or checksum). Treat as a miss."""


# Prefix of a failure reason meaning "not a block this reader knows" (another format version, codec, container or
# block size: another UCM version sharing the storage, or a caller's size mismatch) rather than damage: the stored
# block is kept, never removed as damaged.
FOREIGN = "foreign: "


@dataclass
class Removal:
    """What :meth:`UcmKVStoreBase.remove_stored` deleted: block files, their bytes, and one ``"<path>: <reason>"``
    per block that could not be deleted."""

    blocks: int = 0
    nbytes: int = 0
    errors: list[str] = field(default_factory=list)


class Lease:
    """Blocks lent by :meth:`UcmKVStoreBase.lend`: ``rows[i]`` is key ``i``'s block, a read-only 1-D CPU
    ``torch.uint8`` view of ``block_nbytes`` (never written by the store, nor evicted or reused, until
    :meth:`release`), or ``None`` where it was not lent (the caller loads it). Release it once done reading, as soon
    as possible: lent blocks cannot be evicted. A context manager; :meth:`release` is idempotent."""

    def __init__(self, rows: list[torch.Tensor | None], release: Callable[[], None] | None = None) -> None:
        self.rows = rows
        self._release = release
        self._lock = threading.Lock()

    @property
    def lent(self) -> int:
        """How many rows were lent."""
        return sum(r is not None for r in self.rows)

    def release(self) -> None:
        """Give the lent blocks back (the views must not be read afterwards)."""
        with self._lock:
            release, self._release = self._release, None
        if release is not None:
            release()

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


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


class ShardProgress:
    """Progress of a sharded load (:meth:`UcmKVStoreBase.load_sharded`): which shards are in every row of ``dst``.

    A row of ``num_shards`` equal shards (a layerwise load: shard = layer) is read shard by shard; whoever reads a
    part (a store stage, or the stages under it that it passed this object to) calls :meth:`done` once per shard
    for the rows it read (or failed to read). Shard ``s`` is *ready* when all ``num_rows`` rows have reported it.
    Thread-safe.

    Args:
        num_shards: shards per row (>= 1).
        num_rows: rows of the load (>= 0).
    """

    def __init__(self, num_shards: int, num_rows: int) -> None:
        self._remaining = [num_rows] * num_shards
        self._cond = threading.Condition()

    @property
    def num_shards(self) -> int:
        """Shards per row."""
        return len(self._remaining)

    def done(self, shard: int, count: int = 1) -> None:
        """Record that ``count`` more rows have their shard ``shard`` read (or failed)."""
        with self._cond:
            self._remaining[shard] -= count
            if self._remaining[shard] <= 0:
                self._cond.notify_all()

    def done_all(self, count: int) -> None:
        """Record every shard of ``count`` more rows (rows served whole, or failed before any read)."""
        with self._cond:
            self._remaining = [r - count for r in self._remaining]
            self._cond.notify_all()

    def ready(self, shard: int) -> bool:
        """True when every row has reported shard ``shard``."""
        with self._cond:
            return self._remaining[shard] <= 0

    def wait(self, shard: int, finished: Callable[[], bool], timeout: float | None = None) -> bool:
        """Block until shard ``shard`` is ready or ``finished()`` is true (re-checked at each :meth:`notify`), at
        most ``timeout`` seconds (``None``: no bound); return False when the time ran out first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._remaining[shard] <= 0 or finished(), timeout)

    def notify(self) -> None:
        """Wake the waiters so that they re-check their ``finished`` condition."""
        with self._cond:
            self._cond.notify_all()


class Task:
    """Handle of an asynchronous batched load or dump, backed by a ``concurrent.futures.Future``.

    A sharded load (:meth:`UcmKVStoreBase.load_sharded`) also carries a :class:`ShardProgress`, so that a reader can
    use each shard as soon as it has arrived (:meth:`wait_shard`).
    """

    __slots__ = ("_future", "_progress")

    def __init__(self, future: Future[TaskResult], progress: ShardProgress | None = None) -> None:
        self._future = future
        self._progress = progress
        if progress is not None:  # a finished task releases its shard waiters, whatever happened
            future.add_done_callback(lambda _f: progress.notify())

    @classmethod
    def completed(cls, result: TaskResult, progress: ShardProgress | None = None) -> Task:
        """A task that is already done with ``result`` (a sharded load's carries its ``progress``)."""
        future: Future[TaskResult] = Future()
        future.set_result(result)
        return cls(future, progress)

    def done(self) -> bool:
        """True once the task has finished (successfully or not)."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> TaskResult:
        """Block until the task is done and return its result, at most ``timeout`` seconds (``None``: no bound).

        Raises:
            TimeoutError: the task is not done within ``timeout``; it goes on (a load's ``dst`` and a dump's ``src``
                stay in use until it is done).
        """
        return self._future.result(timeout)

    def wait_shard(self, shard: int, timeout: float | None = None) -> bool:
        """Block until shard ``shard`` (``0 <= shard < num_shards``) of every row of a sharded load is in ``dst``,
        or the task is done, at most ``timeout`` seconds (``None``: no bound); return False when the time ran out
        first (the load goes on: its ``dst`` may still be written). The bytes are **not yet validated**: only
        :meth:`result` says which rows are good (a row that fails validation later has unspecified bytes). A task
        without shard progress (a plain load, or a stage that reads whole blocks) waits for the whole task.

        Raises:
            IndexError: ``shard`` is out of range for a sharded load.
        """
        if self._progress is None:
            try:
                self._future.exception(timeout)  # waits; the outcome is the caller's to take from result()
            except TimeoutError:
                return False
            return True
        if not 0 <= shard < self._progress.num_shards:
            raise IndexError(f"shard {shard} out of range [0, {self._progress.num_shards})")
        return self._progress.wait(shard, self._future.done, timeout)

    def shard_ready(self, shard: int) -> bool:
        """Non-blocking :meth:`wait_shard`: True when it would return at once."""
        if self._future.done():
            return True
        return self._progress is not None and self._progress.ready(shard)

    def add_done_callback(self, fn: Callable[[Task], None]) -> None:
        """Call ``fn(task)`` once the task is done (at once if it is), on the thread that completes it."""
        self._future.add_done_callback(lambda _f: fn(self))


@dataclass(frozen=True)
class EncodedBlock:
    """One stored payload, handed to the caller's decoder by :meth:`EncodedStore.load_encoded`.

    Attributes:
        codec: the codec id (u16) given when it was dumped (see :mod:`ucm.store.codecs`).
        payload: the stored bytes, verified by the stage to be exactly the ones dumped; a view of the stage's buffer,
            valid only during the decoder's call.
    """

    codec: int
    payload: memoryview


# The decoder of EncodedStore.load_encoded: ``(row, block) -> None`` when it used the block, else why not.
PayloadDecoder = Callable[[int, EncodedBlock], str | None]


class EncodedStore(abc.ABC):
    """The verbs of a stage that holds *encoded* blocks: payloads of any size, each stored with the id of the codec
    that produced it, for a stage above that encodes canonical blocks (``Compress``). A stage offers them through
    :meth:`UcmKVStoreBase.encoded_store`; keys, ``lookup``, visibility and failures follow the store contract (see
    the module docstring):

    - :meth:`dump_encoded` stores a payload of any size with a codec id as a key's block;
    - :meth:`load_encoded` reads each key's stored block, whatever its codec, and hands the codec and payload to the
      caller's decoder, which decodes it where it needs it;
    - failures are per key, a miss for the caller, never wrong bytes: a stage hands over only payloads it has
      verified to be exactly the ones dumped, and reports a key failed when it cannot.
    """

    @abc.abstractmethod
    def dump_encoded(
        self, keys: Sequence[bytes], payloads: Sequence[bytes | bytearray | memoryview], codecs: Sequence[int]
    ) -> Task:
        """Start storing ``payloads[i]`` (bytes-like, any size, may differ per key) with codec id ``codecs[i]``
        (u16) as the block of ``keys[i]``.

        A block becomes visible to ``lookup`` once completely stored; a key already present is skipped and counts as
        stored. The task's result names the keys not stored. ``payloads`` must stay unchanged until the task is
        done.

        Raises:
            TypeError / ValueError: bad keys; ``payloads`` or ``codecs`` not one per key; a codec outside u16.
            RuntimeError: the store is closed.
        """

    @abc.abstractmethod
    def load_encoded(self, keys: Sequence[bytes], max_nbytes: int, consume: PayloadDecoder) -> Task:
        """Start reading the stored blocks of ``keys``, whatever their codec, each handed to ``consume(i, block)``
        (:class:`EncodedBlock`) as soon as it is read and verified, on the stage's thread that read it (so decoding
        overlaps the reads of later blocks).

        ``block.payload`` is valid only during the call: ``consume`` decodes or copies it before returning. It
        returns ``None`` when it used the block, else why not: a reason starting with :data:`FOREIGN` (a codec,
        container or block size it does not read) fails the key and keeps the stored block; any other reason fails
        the key as damaged (the stage may drop the block). An exception from ``consume`` fails the key. A block that
        is missing, fails verification or has a payload over ``max_nbytes`` bytes is never handed over (its key
        fails). The task completes once every key has been handed over or failed.

        Raises:
            TypeError / ValueError: bad keys; ``max_nbytes`` < 1.
            RuntimeError: the store is closed.
        """


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


def row_runs(indices: Sequence[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive values in sorted ``indices`` as ``(start, stop)`` ranges (a stage calls the stage
    below once per run of rows, on ``dst[start:stop]``)."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def check_encoded_load(keys: Sequence[bytes], max_nbytes: int) -> None:
    """Validate the arguments of :meth:`EncodedStore.load_encoded`.

    Raises:
        TypeError / ValueError: a key is not 16 ``bytes``; ``max_nbytes`` < 1.
    """
    check_keys(keys)
    if max_nbytes < 1:
        raise ValueError(f"max_nbytes must be >= 1, got {max_nbytes}")


def check_encoded_dump(
    keys: Sequence[bytes], payloads: Sequence[bytes | bytearray | memoryview], codecs: Sequence[int]
) -> None:
    """Validate the arguments of :meth:`EncodedStore.dump_encoded`.

    Raises:
        TypeError / ValueError: a key is not 16 ``bytes``; ``payloads`` or ``codecs`` not one per key; a codec
            outside u16.
    """
    check_keys(keys)
    if len(payloads) != len(keys) or len(codecs) != len(keys):
        raise ValueError(
            f"need one payload and one codec per key: {len(keys)} keys, {len(payloads)} payloads, {len(codecs)} codecs"
        )
    for c in codecs:
        if not 0 <= c <= 0xFFFF:
            raise ValueError(f"codec must be a u16, got {c}")


def check_removal(keys: Sequence[bytes] | None, namespace: bytes | None) -> None:
    """Validate the arguments of :meth:`UcmKVStoreBase.remove_stored`.

    Raises:
        TypeError: ``namespace`` or a key is not ``bytes``.
        ValueError: both or neither of ``keys`` and ``namespace`` are given, ``namespace`` is shorter than 4
            bytes, or a key is not 16 bytes long.
    """
    if (keys is None) == (namespace is None):
        raise ValueError("remove_stored takes exactly one of keys= (the blocks to delete) or namespace= (a digest)")
    if keys is not None:
        check_keys(keys)
        return
    if not isinstance(namespace, bytes):
        raise TypeError(f"namespace must be bytes (a namespace digest), got {type(namespace).__name__}")
    if len(namespace) < 4:
        raise ValueError(f"namespace digest must have at least 4 bytes, got {len(namespace)}")


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


def check_shards(buf: torch.Tensor, num_shards: int) -> int:
    """Validate ``num_shards`` for a sharded load into ``buf`` (``[num_keys, nbytes]``); return the shard size in
    bytes.

    Raises:
        ValueError: ``num_shards`` < 1, or it does not divide the row size ``nbytes``.
    """
    nbytes = buf.shape[-1] if buf.dim() else 0
    if not isinstance(num_shards, int) or num_shards < 1 or nbytes % num_shards:
        raise ValueError(f"num_shards must be an int >= 1 dividing the row size {nbytes} bytes, got {num_shards!r}")
    return nbytes // num_shards


def report_whole(task: Task, progress: ShardProgress | None, num_rows: int, on_row: RowCallback | None = None) -> Task:
    """``task`` (a whole-block load of ``num_rows`` rows) as a sharded load reporting into ``progress``: every shard
    of its rows is reported when it is done, then ``on_row`` (if given) is called for every row, then the returned
    task completes. With neither, ``task`` itself (``wait_shard`` waits for the whole task)."""
    if progress is None and on_row is None:
        return task
    outer: Future[TaskResult] = Future()

    def finish(done: Task) -> None:  # report the shards first: whoever sees the result sees them ready
        if progress is not None:
            progress.done_all(num_rows)
        try:
            result = done.result()
        except BaseException as exc:
            for i in range(num_rows):
                call_on_row(on_row, i, False)
            outer.set_exception(exc)
            return
        for i in range(num_rows):
            call_on_row(on_row, i, i not in result.failed)
        outer.set_result(result)

    task.add_done_callback(finish)
    return Task(outer, progress)


def call_on_row(on_row: RowCallback | None, row: int, ok: bool) -> None:
    """``on_row(row, ok)`` if ``on_row`` is given; an exception from it is logged, never raised (a bug in the
    caller's hook must not leave a task unresolved)."""
    if on_row is None:
        return
    try:
        on_row(row, ok)
    except Exception:
        logger.exception("store: the on_row hook of a sharded load raised for row %d", row)


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

    def load_rows(self, keys: Sequence[bytes], rows: Sequence[torch.Tensor]) -> list[Task]:
        """Start reading the block of ``keys[i]`` into ``rows[i]`` (each a uint8 ``[1, block_nbytes]`` tensor, CPU,
        contiguous; anywhere in memory): one task per key, whose result names ``{0}`` as failed when that block
        failed. A stage above that reads its misses into scattered buffers (the ``Cache`` stage's slots) calls this
        once for all of them; stages where one call per batch is cheaper than one per block (``Mooncake``: one
        round trip to the master) override it. This default makes one :meth:`load` per key.

        Raises:
            TypeError / ValueError: bad keys, ``rows`` not one per key, or a row not ``[1, block_nbytes]`` uint8.
            RuntimeError: the store is closed.
        """
        check_keys(keys)
        if len(rows) != len(keys):
            raise ValueError(f"load_rows: {len(rows)} rows for {len(keys)} keys; give one row per key")
        tasks: list[Task] = []
        for key, row in zip(keys, rows, strict=True):
            try:
                tasks.append(self.load([key], row))
            except Exception:
                if not tasks:  # nothing started: the caller sees the error
                    raise
                # Loads already started must stay tracked (their rows are being written): fail only the rest.
                logger.exception("load_rows: a load failed to start; its block fails, the others go on")
                tasks.append(Task.completed(TaskResult(1, frozenset({0}))))
        return tasks

    def load_sharded(
        self,
        keys: Sequence[bytes],
        dst: torch.Tensor,
        num_shards: int,
        progress: ShardProgress | None = None,
        on_row: RowCallback | None = None,
    ) -> Task:
        """Like :meth:`load`, for rows made of ``num_shards`` equal byte ranges (a layerwise load: one shard per
        layer), read so that the task's :meth:`Task.wait_shard` can hand out shard ``s`` of every row before the
        later shards have arrived. Validation is unchanged: the task's result names the keys that failed, possibly
        after some of their shards were handed out (such rows must then be dropped).

        ``progress``: a stage above that serves some rows itself passes its own :class:`ShardProgress` (sized for
        all its rows); this stage then reports its rows into it. ``None``: a new one for these rows.

        ``on_row``: called as ``on_row(i, ok)`` once per row ``i``, as soon as the row is settled (validated:
        ``ok`` True; failed: False), on the thread that settled it, and before the task completes (so the task's
        result means every hook has returned). A stage above uses it to act on each row while the others are still
        being read (the ``Cache`` stage copies it into DRAM). It must not raise (an exception is logged) and may run
        before this method returns.

        Stages that read shard by shard override this; this default reads whole blocks with :meth:`load`, reports
        every shard of a row and calls ``on_row`` for every row when the whole load is done.

        Raises:
            TypeError / ValueError: bad keys or ``dst`` (see :func:`check_keys_and_buffer`); ``num_shards`` < 1 or
                not dividing the row size.
            RuntimeError: the store is closed.
        """
        check_keys_and_buffer(keys, dst, "dst")
        check_shards(dst, num_shards)
        return report_whole(self.load(keys, dst), progress, len(keys), on_row)

    def lend(self, keys: Sequence[bytes], block_nbytes: int) -> Lease:
        """Lend the blocks of ``keys`` that this stage holds in process memory as blocks of ``block_nbytes`` bytes
        (see :class:`Lease`); synchronous, no I/O. A lent block counts as a load hit in the stage's observations and
        is made most recently used, as a load of it would. This default lends nothing (stages without such a tier,
        and stages over another: a block is lent only by the stage that holds it in the form the caller reads).

        Raises:
            TypeError / ValueError: a key is not 16 ``bytes``, or ``block_nbytes`` < 1.
        """
        check_keys(keys)
        if block_nbytes < 1:
            raise ValueError(f"block_nbytes must be >= 1, got {block_nbytes}")
        return Lease([None] * len(keys))

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

    def encoded_store(self) -> EncodedStore | None:
        """Where this stage holds encoded payloads: the object whose :class:`EncodedStore` verbs store them (the
        stage itself when it stores bytes; the stage below's for a stage that passes them through), or ``None``
        when this stage keeps canonical blocks only (this default). A stage that encodes blocks needs one below it;
        the pipeline builder checks it when it stacks the stages."""
        return None

    def set_namespace(self, tag: bytes, info: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """Record the model namespace of the blocks dumped from now on: ``tag`` (the namespace digest, >= 4 bytes)
        and ``info`` (JSON-serializable fields naming it: model, dtype, block_size...), for operators' tools.
        Stages that keep nothing per namespace ignore it; stages over another stage pass it down."""

    # Where this stage records its observations (ucm.store.observe); set by set_recorder.
    _recorder: Recorder = NO_RECORDER

    def set_recorder(self, recorder: Recorder) -> None:
        """Record this stage's loads and dumps into ``recorder`` from now on (:mod:`ucm.store.observe`). Stages over
        another stage pass it down."""
        self._recorder = recorder

    def gauges(self) -> dict[str, float]:
        """This stage's (and the stages below's) current levels and running totals for metrics, named
        ``<tier>:<metric>``, e.g. ``dram:used_bytes`` or ``storage:evicted_blocks_total`` (names ending in ``_total``
        only grow); empty by default. Cheap: no I/O."""
        return {}

    def prepare(self, block_nbytes: int, request_blocks: int = 0) -> None:  # noqa: B027 - optional hook
        """Get ready for blocks of ``block_nbytes`` bytes (the connector calls it once it knows its KV layout, before
        the first load or dump; other sizes still work), of which one request loads or dumps at most
        ``request_blocks`` (``max_model_len`` tokens' worth; 0: unknown). Returns at once; work it starts runs in the
        background. Stages that need nothing ignore it; stages over another stage pass it down."""

    def drop_cached(self) -> int:
        """Empty the tiers this pipeline holds in process memory (the ``Cache`` stage's DRAM); return the number of
        blocks dropped. A block being read out or written back when this runs finishes that copy from memory that is
        no longer reused; nothing read from below before the call is cached after it. Stages without such a tier
        return 0; stages over another pass it down."""
        return 0

    def remove_stored(self, *, keys: Sequence[bytes] | None = None, namespace: bytes | None = None) -> Removal:
        """Delete blocks from the storage tier: those of ``keys`` (16-byte keys), or every block tagged with
        ``namespace`` (the digest given to :meth:`set_namespace`; blocks of other namespaces are kept); give exactly
        one of the two. Never raises for a block that cannot be deleted: it is listed in :attr:`Removal.errors`.
        Stages without a storage tier return an empty :class:`Removal`; stages over another pass it down.

        Raises:
            TypeError / ValueError: both or neither of ``keys`` and ``namespace`` given, a key not 16 ``bytes``, or
                ``namespace`` not ``bytes`` of at least 4.
        """
        check_removal(keys, namespace)
        return Removal()

    def flush(self) -> None:  # noqa: B027 - optional hook, a no-op for stages without background work
        """Block until all background work (write-backs) started so far is finished."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Flush and release resources (threads, file handles). Idempotent."""
