"""The ``Mooncake`` stage: canonical blocks as objects of a Mooncake Store pool, a DRAM tier shared by instances and
nodes.

Mooncake Store (the kvcache-ai/Mooncake project; PyPI ``mooncake-transfer-engine`` or, without CUDA,
``mooncake-transfer-engine-non-cuda``) is a distributed object store over the DRAM of its clients: a master
(``mooncake_master``) keeps the index, every client mounts a segment of its own memory (``global_segment_size``
bytes) into the pool, an object is placed in some client's segment, and a get reads it from there (TCP or RDMA). So
a block dumped by one instance is read by an instance on another node from the first one's DRAM. This stage is a
client of it; it runs no pool of its own.

Objects: named ``ucm/<namespace tag, 8 hex>/<key hex>`` (the tag of :meth:`MooncakeStore.set_namespace`, so that
one namespace's objects can be removed by name; ``00000000`` until it is set). Value: the Posix stage's 44-byte
header (``ucm.store.posix.format``: magic, format version, codec, namespace tag, payload size, key, xxh3 checksum)
then the canonical block. A put and a get move the block straight from or into the caller's row (Mooncake's
multi-buffer batch calls take the header from a small array and the payload from the row): no copy. A get is checked
as a block file is: an absent object, one of another size, or one whose header or checksum is wrong is a failed key
(a miss, recomputed), never data; a damaged one is also removed, since a put on an existing name keeps the old value.

Encoded payloads (a ``Compress`` stage above, :class:`~ucm.store.base.EncodedStore`): an object of any size, the
header naming its codec; gets read into a scratch buffer of the largest size asked for and are verified
(``check_encoded``) before the caller's decoder sees them.

Tiers: over an optional stage below (``Mooncake|Posix``): ``lookup`` counts a key held by the pool or by the stage
below; ``load`` reads from the pool and then loads the keys that failed there from the stage below, straight into
their rows (one call per run of consecutive rows); ``dump`` puts into the pool and dumps below at the same time; the
task's result is the stage below's (the pool is best effort: a full pool, status -200, skips those blocks with a
warning at most every 30 s). Without a stage below the result is the pool's. Blocks read from below are not put
into the pool.

Faults: no master answering at start is not an error: the stage starts without the pool (lookups count nothing from
it, loads read from below, dumps go below only) and joins the pool once a master answers (tried every
:data:`POOL_RETRY_S` seconds, one info line when it joins). ``lookup`` (synchronous, on the scheduler's path) waits
at most ``timeout_s`` for the pool; past that, or when the master cannot be reached, it counts nothing from the pool
(a warning at most every 30 s). After a call the master did not answer (status -900) or a lookup past ``timeout_s``,
the stage leaves the pool alone for :data:`POOL_RETRY_S` seconds: lookups count nothing from it, loads read from
below, dumps go below only. A load waits for the pool's get however long it takes, since Mooncake may still write
into the rows until it returns (the connector's load deadline abandons the load buffer meanwhile; see
``ucm.integration.vllm.worker``); a failed get (master gone, the client holding the object killed: status < 0) is a
miss. Mooncake's own RPC timeouts bound these calls (seconds). A master restarted keeps no key: the blocks are
missed in the pool and put again by the next dumps.
"""

from __future__ import annotations

import functools
import re
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, TimeoutError
from typing import Any

import numpy as np
import torch

from ucm.affinity import thread_pool
from ucm.logger import init_logger
from ucm.store.base import (
    FOREIGN,
    EncodedBlock,
    EncodedStore,
    PayloadDecoder,
    Removal,
    Task,
    TaskResult,
    UcmKVStoreBase,
    check_encoded_dump,
    check_encoded_load,
    check_keys,
    check_keys_and_buffer,
    check_removal,
    row_runs,
    tiered_lookup,
)
from ucm.store.codecs import CODEC_RAW
from ucm.store.observe import Observation, Op, current_requests
from ucm.store.posix.format import HEADER_NBYTES, check_block, check_encoded, namespace_tag, pack_header

logger = init_logger(__name__)

# Least seconds between two warnings of one kind (pool unreachable, pool full).
_WARNING_INTERVAL_S = 30.0
# Mooncake's status when no segment has room for an object (NO_AVAILABLE_HANDLE), and when the master did not
# answer (RPC_FAIL).
POOL_FULL = -200
RPC_FAIL = -900
# Seconds the stage leaves the pool alone after the master did not answer (each call would wait seconds again).
POOL_RETRY_S = 10.0


def connect(
    master_server_address: str,
    local_hostname: str = "127.0.0.1",
    metadata_server: str = "P2PHANDSHAKE",
    protocol: str = "tcp",
    device_name: str = "",
    global_segment_size: int = 0,
    local_buffer_size: int = 0,
    timeout_s: float = 20.0,
) -> Any:
    """A Mooncake Store client, set up: it mounts ``global_segment_size`` bytes of this process's DRAM into the pool
    (0: none, a client that only reads and writes others' segments) and uses ``local_buffer_size`` bytes for its
    transfers. The other arguments are the keys of Mooncake's ``mooncake.json``. ``timeout_s``: most seconds to wait
    for the master's port to accept a connection, asked before the setup (which retries an absent master for
    about 90 s).

    Raises:
        MooncakeMasterUnreachable: no master answers at ``master_server_address``.
        UcmMooncakeError: the ``mooncake`` package is not installed, or the setup failed.
    """
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise UcmMooncakeError(
            "store_pipeline with Mooncake needs Mooncake Store's client: pip install "
            f"mooncake-transfer-engine-non-cuda (or mooncake-transfer-engine with CUDA) ({exc})"
        ) from exc
    client = MooncakeDistributedStore()
    config = {
        "local_hostname": local_hostname,
        "metadata_server": metadata_server,
        "global_segment_size": global_segment_size,
        "local_buffer_size": local_buffer_size,
        "protocol": protocol,
        "rdma_devices": device_name,
        "master_server_addr": master_server_address,
    }
    # Mooncake's setup retries an absent master for about 90 s, holding the GIL: ask the master's port first.
    host, _, port = master_server_address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as exc:
        raise MooncakeMasterUnreachable(
            f"no Mooncake master answers at master_server_address {master_server_address!r} ({exc}): start "
            "mooncake_master there, or fix the address (host:port)"
        ) from exc
    status = client.setup(config)
    if status != 0:
        raise UcmMooncakeError(
            f"Mooncake client setup failed (status {status}) with master_server_address {master_server_address!r}, "
            f"protocol {protocol!r}, local_hostname {local_hostname!r}: is mooncake_master running there?"
        )
    return client


def _parts(headers: np.ndarray, rows: Sequence[torch.Tensor]) -> tuple[list[list[int]], list[list[int]]]:
    """Mooncake's multi-buffer arguments for objects made of ``headers`` row i (uint8, ``HEADER_NBYTES`` each) then
    ``rows[i]`` (a contiguous uint8 block, anywhere in memory): (addresses, sizes) per object."""
    h0 = headers.ctypes.data
    addresses = [[h0 + i * HEADER_NBYTES, row.data_ptr()] for i, row in enumerate(rows)]
    return addresses, [[HEADER_NBYTES, row.numel()] for row in rows]


class UcmMooncakeError(RuntimeError):
    """The Mooncake stage cannot be used (client missing, setup refused)."""


class MooncakeMasterUnreachable(UcmMooncakeError):
    """No Mooncake master accepts connections at the address."""


class _Every:
    """Log a warning at most every ``_WARNING_INTERVAL_S`` seconds, counting the events in between."""

    def __init__(self) -> None:
        self._last = -_WARNING_INTERVAL_S
        self._count = 0
        self._lock = threading.Lock()

    def warn(self, message: str, *args: object) -> None:
        with self._lock:
            self._count += 1
            now = time.monotonic()
            if now - self._last < _WARNING_INTERVAL_S:
                return
            count, self._count, self._last = self._count, 0, now
        logger.warning(message + " (%d times since the last such warning)", *args, count)


class MooncakeStore(UcmKVStoreBase, EncodedStore):
    """Blocks as objects of a Mooncake Store pool, over an optional stage below (see the module docstring).

    Args:
        client: a set-up Mooncake client (:func:`connect`); closed by :meth:`close`.
        inner: the stage below (``Posix``), or None.
        timeout_s: most seconds a lookup waits for the pool.
        io_threads: threads that make the pool's calls.
        prefer_own_segment: puts place objects in the client's own segment while it has room (Mooncake's
            ``preferred_segment``, set to ``client.get_hostname()``), so an instance's blocks live in its own DRAM
            and others read them from there; False: wherever the master places them (a client without a segment).
        rejoin: with ``client`` None (no master answered at start): a callable that returns a set-up client or
            raises :class:`MooncakeMasterUnreachable`; the stage calls it every :data:`POOL_RETRY_S` seconds on a
            thread of its own until it succeeds, and serves from the stage below (or misses) meanwhile.

    Raises:
        ValueError: ``timeout_s`` not > 0 or ``io_threads`` < 1.
    """

    def __init__(
        self,
        client: Any,
        inner: UcmKVStoreBase | None = None,
        timeout_s: float = 5.0,
        io_threads: int = 2,
        prefer_own_segment: bool = False,
        rejoin: Callable[[], Any] | None = None,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 (seconds), got {timeout_s}")
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        if client is None and rejoin is None:
            raise ValueError("a Mooncake stage without a client needs rejoin (how to connect later)")
        self._client: Any = None
        self._inner = inner
        self._prefer_own_segment = prefer_own_segment
        self._placement: tuple[Any, ...] = ()  # the puts' ReplicateConfig, when the own segment is preferred
        self._stop = threading.Event()
        self._rejoin_thread: threading.Thread | None = None
        if client is not None:
            self._use(client)
        else:
            assert rejoin is not None
            self._rejoin_thread = threading.Thread(
                target=self._rejoin_loop, args=(rejoin,), name="ucm-mooncake-rejoin", daemon=True
            )
        self._timeout_s = timeout_s
        self._pool = thread_pool(io_threads, "ucm-mooncake")
        self._ns_tag = 0
        self._closed = False
        self._unreachable = _Every()
        self._full = _Every()
        self._damaged = _Every()
        self._down_until = 0.0  # time.monotonic() until which the pool is left alone (see the module docstring)
        self._inflight = 0  # pool calls of loads and dumps not finished (flush waits for them)
        self._idle = threading.Condition()
        if self._rejoin_thread is not None:
            self._rejoin_thread.start()

    def _use(self, client: Any) -> None:
        """Serve from ``client`` from now on."""
        if self._prefer_own_segment:
            from mooncake.store import ReplicateConfig

            placement = ReplicateConfig()
            placement.preferred_segment = client.get_hostname()
            self._placement = (placement,)
        self._client = client

    def _rejoin_loop(self, rejoin: Callable[[], Any]) -> None:
        """Connect to the pool once a master answers (every ``POOL_RETRY_S`` s) and serve from it from then on."""
        while not self._stop.wait(POOL_RETRY_S):
            try:
                client = rejoin()
            except MooncakeMasterUnreachable:
                continue
            except Exception as exc:
                self._unreachable.warn("Mooncake pool: joining failed (%s); trying again", exc)
                continue
            if self._stop.is_set():  # closed meanwhile
                client.close()
                return
            self._use(client)
            logger.info("Mooncake stage: the master answers now; blocks are put into and read from the pool")
            return

    # -- pool calls and naming -------------------------------------------------------------------------------

    def _submit(self, fn: Any, *args: Any) -> Future[Any]:
        """Run a pool call of a load or dump on the stage's threads, counted until done (see :meth:`flush`)."""
        with self._idle:
            self._inflight += 1
        future = self._pool.submit(fn, *args)

        def done(_f: Future[Any]) -> None:
            with self._idle:
                self._inflight -= 1
                self._idle.notify_all()

        future.add_done_callback(done)
        return future

    def _pool_down(self) -> bool:
        return self._client is None or time.monotonic() < self._down_until

    def _note_status(self, codes: Sequence[int]) -> None:
        """Leave the pool alone for a while when the master did not answer a call."""
        if RPC_FAIL in codes:
            self._down_until = time.monotonic() + POOL_RETRY_S

    def _failed_rows(self, done: Future[set[int]], n: int, verb: str) -> set[int]:
        """The rows a pool call (``done``, a ``get`` or ``put`` of ``n`` rows) failed: all of them when the client
        raised (a miss or a skipped put, never wrong data; a warning at most every 30 s)."""
        try:
            return done.result()
        except Exception as exc:
            self._unreachable.warn("Mooncake pool: %s failed (%s); %d blocks not served by the pool", verb, exc, n)
            return set(range(n))

    def _name(self, key: bytes) -> str:
        return f"ucm/{self._ns_tag:08x}/{key.hex()}"

    def set_namespace(self, tag: bytes, info: dict[str, Any]) -> None:
        """Name objects under ``tag``'s namespace tag from now on (and pass it down)."""
        self._ns_tag = namespace_tag(tag)
        if self._inner is not None:
            self._inner.set_namespace(tag, info)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the Mooncake stage is closed")

    # -- lookup ----------------------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Leading ``keys`` held by the pool or the stage below; the pool is asked once, for at most ``timeout_s``.

        Raises:
            TypeError / ValueError: a key is not 16 ``bytes``.
            RuntimeError: the stage is closed.
        """
        check_keys(keys)
        self._check_open()
        if not keys:
            return 0
        in_pool = self._in_pool(keys)
        return tiered_lookup(keys, lambda key: key in in_pool, self._inner)

    def _in_pool(self, keys: Sequence[bytes]) -> set[bytes]:
        if self._pool_down():
            return set()
        future = self._pool.submit(self._client.batch_is_exist, [self._name(k) for k in keys])
        try:
            codes = future.result(self._timeout_s)
        except TimeoutError:
            self._down_until = time.monotonic() + POOL_RETRY_S
            self._unreachable.warn("Mooncake pool: a lookup took longer than %.1f s; misses", self._timeout_s)
            return set()
        except Exception as exc:  # the client raising is a miss, never a failed request
            self._unreachable.warn("Mooncake pool: lookup failed (%s); counted as misses", exc)
            return set()
        self._note_status(codes)
        if any(c < 0 for c in codes):
            self._unreachable.warn("Mooncake pool: lookup status %d (master unreachable?); misses", min(codes))
        return {k for k, c in zip(keys, codes, strict=True) if c == 1}

    # -- load ------------------------------------------------------------------------------------------------

    def load(self, keys: Sequence[bytes], dst: torch.Tensor) -> Task:
        """Read the blocks of ``keys`` into the rows of ``dst`` (uint8 ``[len(keys), block_nbytes]``, CPU,
        contiguous): from the pool, then the keys that failed there from the stage below.

        Raises:
            TypeError / ValueError: bad keys or ``dst``.
            RuntimeError: the stage is closed.
        """
        check_keys_and_buffer(keys, dst, "dst")
        self._check_open()
        keys = list(keys)
        future: Future[TaskResult] = Future()
        if not keys:
            future.set_result(TaskResult(0))
            return Task(future)
        if self._pool_down():
            self._load_below(keys, dst, set(range(len(keys))), future)
            return Task(future)
        pool_task = self._submit(self._get, keys, list(dst), current_requests())

        def then(done: Future[set[int]]) -> None:
            self._load_below(keys, dst, self._failed_rows(done, len(keys), "get"), future)

        pool_task.add_done_callback(then)
        return Task(future)

    def _get(self, keys: list[bytes], rows: list[torch.Tensor], requests: tuple[str, ...] = ()) -> set[int]:
        """Get ``keys`` from the pool into ``rows`` (uint8 tensors of one block each, contiguous), check them; the
        indices that failed (recorded as a load of tier ``pool`` for ``requests``)."""
        t0 = time.perf_counter()
        n = len(keys)
        headers = np.empty((n, HEADER_NBYTES), dtype=np.uint8)
        names = [self._name(k) for k in keys]
        got = self._client.batch_get_into_multi_buffers(names, *_parts(headers, rows))
        self._note_status(got)
        failed: set[int] = set()
        damaged: list[str] = []
        nbytes = 0
        for i, status in enumerate(got):
            expected = HEADER_NBYTES + rows[i].numel()
            if status != expected:  # absent (-704), of another size, holder gone, master unreachable
                failed.add(i)
                continue
            reason = check_block(keys[i], rows[i].numpy().data, expected, status, memoryview(headers[i]))
            if reason is None:
                nbytes += rows[i].numel()
            if reason is not None:
                failed.add(i)
                if not reason.startswith(FOREIGN):
                    damaged.append(names[i])
                    self._damaged.warn(
                        "Mooncake pool: object %s is damaged (%s); removed, recomputed", names[i], reason
                    )
        if damaged:
            self._client.batch_remove(damaged, True)  # force: a lease must not keep a damaged object
        self._record("load", n, n - len(failed), nbytes, time.perf_counter() - t0, requests)
        return failed

    def load_rows(self, keys: Sequence[bytes], rows: Sequence[torch.Tensor]) -> list[Task]:
        """Read the block of ``keys[i]`` into ``rows[i]`` (uint8 ``[1, block_nbytes]``, CPU, contiguous, anywhere in
        memory) with one batch get from the pool, then the blocks that failed there from the stage below (its
        :meth:`~ucm.store.base.UcmKVStoreBase.load_rows`); one task per key.

        Raises:
            TypeError / ValueError: bad keys, ``rows`` not one per key or a row not ``[1, block_nbytes]`` uint8.
            RuntimeError: the stage is closed.
        """
        check_keys(keys)
        if len(rows) != len(keys):
            raise ValueError(f"load_rows: {len(rows)} rows for {len(keys)} keys; give one row per key")
        for i, row in enumerate(rows):
            check_keys_and_buffer(keys[i : i + 1], row, f"rows[{i}]")
        self._check_open()
        keys, flat = list(keys), [row.view(-1) for row in rows]
        futures: list[Future[TaskResult]] = [Future() for _ in keys]

        def finish(failed: set[int]) -> None:
            for i, future in enumerate(futures):
                if i not in failed or self._inner is None:
                    future.set_result(TaskResult(1, frozenset({0}) if i in failed else frozenset()))
            if not failed or self._inner is None:
                return
            below_rows = sorted(failed)
            try:
                below = self._inner.load_rows([keys[i] for i in below_rows], [rows[i] for i in below_rows])
            except Exception:
                logger.exception("Mooncake stage: load of %d blocks from the stage below failed to start", len(failed))
                below = [Task.completed(TaskResult(1, frozenset({0}))) for _ in below_rows]
            for i, task in zip(below_rows, below, strict=True):
                task.add_done_callback(functools.partial(lambda f, t: f.set_result(t.result()), futures[i]))

        def then(done: Future[set[int]]) -> None:
            finish(self._failed_rows(done, len(keys), "get"))

        if keys:
            if self._pool_down():
                finish(set(range(len(keys))))
            else:
                self._submit(self._get, keys, flat, current_requests()).add_done_callback(then)
        return [Task(future) for future in futures]

    def _load_below(self, keys: list[bytes], dst: torch.Tensor, failed: set[int], future: Future[TaskResult]) -> None:
        """Load the rows ``failed`` in the pool from the stage below (runs of consecutive rows), then complete
        ``future`` with the keys that failed in both. A load the stage below refuses to start (it raises, e.g. it is
        closed) fails its rows: the task always completes."""
        if not failed or self._inner is None:
            future.set_result(TaskResult(len(keys), frozenset(failed)))
            return
        tasks: list[tuple[int, Task]] = []
        for start, end in row_runs(sorted(failed)):
            try:
                tasks.append((start, self._inner.load(keys[start:end], dst[start:end])))
            except Exception:
                logger.exception("Mooncake stage: load of %d blocks from the stage below failed to start", end - start)
                tasks.append((start, Task.completed(TaskResult(end - start, frozenset(range(end - start))))))
        still: set[int] = set()
        pending = len(tasks)
        lock = threading.Lock()

        def one_done(start: int, task: Task) -> None:
            nonlocal pending
            result = task.result()
            with lock:
                still.update(start + i for i in result.failed)
                pending -= 1
                last = pending == 0
            if last:
                future.set_result(TaskResult(len(keys), frozenset(still)))

        for start, task in tasks:
            task.add_done_callback(functools.partial(one_done, start))

    # -- dump ------------------------------------------------------------------------------------------------

    def dump(self, keys: Sequence[bytes], src: torch.Tensor) -> Task:
        """Put the rows of ``src`` (uint8 ``[len(keys), block_nbytes]``, CPU, contiguous) into the pool and dump them
        to the stage below; ``src`` must stay unchanged until the task is done.

        Raises:
            TypeError / ValueError: bad keys or ``src``.
            RuntimeError: the stage is closed.
        """
        check_keys_and_buffer(keys, src, "src")
        self._check_open()
        keys = list(keys)
        below = self._inner.dump(keys, src) if self._inner is not None and keys else None
        future: Future[TaskResult] = Future()
        if not keys:
            future.set_result(TaskResult(0))
            return Task(future)

        def finish(pool_failed: set[int]) -> None:
            if below is None:
                future.set_result(TaskResult(len(keys), frozenset(pool_failed)))
            else:
                below.add_done_callback(lambda t: future.set_result(t.result()))

        def then(done: Future[set[int]]) -> None:
            finish(self._failed_rows(done, len(keys), "put"))

        if self._pool_down():
            finish(set(range(len(keys))))
        else:
            self._submit(self._put, keys, src, current_requests()).add_done_callback(then)
        return Task(future)

    def _put(self, keys: list[bytes], src: torch.Tensor, requests: tuple[str, ...] = ()) -> set[int]:
        """Put ``keys`` with ``src``'s rows into the pool; the rows not put (recorded as a dump of tier ``pool``)."""
        t0 = time.perf_counter()
        n = src.shape[0]
        rows = src.numpy()
        headers = np.frombuffer(
            b"".join(pack_header(CODEC_RAW, self._ns_tag, k, memoryview(rows[i])) for i, k in enumerate(keys)),
            dtype=np.uint8,
        )
        status = self._client.batch_put_from_multi_buffers(
            [self._name(k) for k in keys], *_parts(headers, list(src)), *self._placement
        )
        self._note_status(status)
        failed = {i for i, s in enumerate(status) if s != 0}
        if failed:
            worst = min(status)
            if worst == POOL_FULL:
                self._full.warn("Mooncake pool is full: %d of %d blocks not put", len(failed), n)
            else:
                self._unreachable.warn("Mooncake pool: put status %d for %d of %d blocks", worst, len(failed), n)
        ok = n - len(failed)
        self._record("dump", n, ok, ok * src.shape[1], time.perf_counter() - t0, requests)
        return failed

    def _record(self, op: Op, blocks: int, ok: int, nbytes: int, seconds: float, requests: tuple[str, ...]) -> None:
        """Record a load (``ok``: blocks served from the pool) or dump (``ok``: blocks put) of tier ``pool``."""
        if self._recorder.enabled:
            self._recorder.record(Observation(op, "pool", blocks, ok, nbytes, seconds=seconds, requests=requests))

    # -- the rest of the contract ----------------------------------------------------------------------------

    def remove_stored(self, *, keys: Sequence[bytes] | None = None, namespace: bytes | None = None) -> Removal:
        """Remove objects from the pool (those of ``keys``, or every one of ``namespace``'s tag) and pass the call
        down; the count is the stage below's (the pool's removals are not counted: it is a cache)."""
        check_removal(keys, namespace)
        self._check_open()
        try:
            if self._client is None:
                pass  # not joined: nothing of this process is in the pool
            elif keys is not None:
                self._client.batch_remove([self._name(k) for k in keys], True)
            else:
                assert namespace is not None
                self._client.remove_by_regex(f"^{re.escape(f'ucm/{namespace_tag(namespace):08x}/')}", True)
        except Exception as exc:
            logger.warning("Mooncake pool: remove failed (%s)", exc)
        if self._inner is None:
            return Removal()
        if keys is not None:
            return self._inner.remove_stored(keys=keys)
        return self._inner.remove_stored(namespace=namespace)

    def drop_cached(self) -> int:
        """Passed down: the pool is shared by instances, like storage, and stays (:meth:`remove_stored` empties
        it)."""
        return self._inner.drop_cached() if self._inner is not None else 0

    def encoded_store(self) -> EncodedStore | None:
        """This stage (encoded payloads as objects, see :meth:`dump_encoded`), unless the stage below cannot hold
        encoded payloads (then None)."""
        if self._inner is not None and self._inner.encoded_store() is None:
            return None
        return self

    # -- encoded payloads (a Compress stage above) -----------------------------------------------------------

    def dump_encoded(
        self, keys: Sequence[bytes], payloads: Sequence[bytes | bytearray | memoryview], codecs: Sequence[int]
    ) -> Task:
        """Put ``payloads[i]`` (any size) with codec ``codecs[i]`` into the pool as key ``i``'s object and store
        them in the stage below (its :meth:`~ucm.store.base.EncodedStore.dump_encoded`); the result is the stage
        below's, or the pool's without one. ``payloads`` must stay unchanged until the task is done.

        Raises:
            TypeError / ValueError: bad keys; ``payloads`` or ``codecs`` not one per key; a codec outside u16.
            RuntimeError: the stage is closed.
        """
        check_encoded_dump(keys, payloads, codecs)
        self._check_open()
        below_store = self._inner.encoded_store() if self._inner is not None else None
        below = below_store.dump_encoded(keys, payloads, codecs) if below_store is not None else None
        bytes_views = [memoryview(p).cast("B") for p in payloads]
        views = [np.frombuffer(b, dtype=np.uint8) for b in bytes_views]
        keys = list(keys)

        def put() -> set[int]:
            if self._pool_down():
                return set(range(len(keys)))
            headers = [np.frombuffer(pack_header(c, self._ns_tag, k, b), dtype=np.uint8)
                       for k, b, c in zip(keys, bytes_views, codecs, strict=True)]  # fmt: skip
            status = self._client.batch_put_from_multi_buffers(
                [self._name(k) for k in keys],
                [[h.ctypes.data, v.ctypes.data] for h, v in zip(headers, views, strict=True)],
                [[HEADER_NBYTES, v.nbytes] for v in views],
                *self._placement,
            )
            self._note_status(status)
            return {i for i, code in enumerate(status) if code != 0}

        future: Future[TaskResult] = Future()

        def then(done: Future[set[int]]) -> None:
            failed = self._failed_rows(done, len(keys), "put")
            if below is None:
                future.set_result(TaskResult(len(keys), frozenset(failed)))
            else:
                below.add_done_callback(lambda t: future.set_result(t.result()))

        self._submit(put).add_done_callback(then)
        return Task(future)

    def load_encoded(self, keys: Sequence[bytes], max_nbytes: int, consume: PayloadDecoder) -> Task:
        """Get the objects of ``keys`` (payloads of at most ``max_nbytes`` bytes) from the pool, verify each as a
        block file is verified (``check_encoded``: header, key, size, checksum) and hand it to ``consume``; the keys
        that failed in the pool are loaded from the stage below the same way. A damaged object is removed.

        Raises:
            TypeError / ValueError: bad keys; ``max_nbytes`` < 1.
            RuntimeError: the stage is closed.
        """
        check_encoded_load(keys, max_nbytes)
        self._check_open()
        keys = list(keys)
        future: Future[TaskResult] = Future()

        def get() -> set[int]:
            if self._pool_down():
                return set(range(len(keys)))
            object_nbytes = HEADER_NBYTES + max_nbytes
            scratch = np.empty((len(keys), object_nbytes), dtype=np.uint8)
            names = [self._name(k) for k in keys]
            got = self._client.batch_get_into(
                names, [scratch.ctypes.data + i * object_nbytes for i in range(len(keys))], [object_nbytes] * len(keys)
            )
            self._note_status(got)
            failed: set[int] = set()
            damaged: list[str] = []
            for i, size in enumerate(got):
                if size <= HEADER_NBYTES:  # absent, unreadable, or larger than max_nbytes (status < 0)
                    failed.add(i)
                    continue
                buf = memoryview(scratch[i])
                reason = check_encoded(buf, size, size, keys[i])
                if reason is None:
                    codec = int.from_bytes(buf[6:8], "little")
                    try:
                        reason = consume(i, EncodedBlock(codec, buf[HEADER_NBYTES:size]))
                    except Exception as exc:
                        logger.error("decoding pool object %s failed: %s", names[i], exc)
                        reason = f"{FOREIGN}decoder raised {exc!r}"
                if reason is not None:
                    failed.add(i)
                    if not reason.startswith(FOREIGN):
                        damaged.append(names[i])
                        self._damaged.warn("Mooncake pool: object %s is damaged (%s); removed", names[i], reason)
            if damaged:
                self._client.batch_remove(damaged, True)
            return failed

        def then(done: Future[set[int]]) -> None:
            failed = self._failed_rows(done, len(keys), "get")
            below_store = self._inner.encoded_store() if self._inner is not None else None
            if not failed or below_store is None:
                future.set_result(TaskResult(len(keys), frozenset(failed)))
                return
            rows = sorted(failed)
            task = below_store.load_encoded(
                [keys[i] for i in rows], max_nbytes, lambda j, block: consume(rows[j], block)
            )
            task.add_done_callback(
                lambda t: future.set_result(TaskResult(len(keys), frozenset(rows[j] for j in t.result().failed)))
            )

        self._submit(get).add_done_callback(then)
        return Task(future)

    def set_recorder(self, recorder: Any) -> None:
        super().set_recorder(recorder)
        if self._inner is not None:
            self._inner.set_recorder(recorder)

    def gauges(self) -> dict[str, float]:
        return self._inner.gauges() if self._inner is not None else {}

    def prepare(self, block_nbytes: int, request_blocks: int = 0) -> None:
        if self._inner is not None:
            self._inner.prepare(block_nbytes, request_blocks)

    def flush(self) -> None:
        """Wait for the pool's puts and gets in progress, then flush the stage below."""
        with self._idle:
            self._idle.wait_for(lambda: self._inflight == 0)
        if self._inner is not None:
            self._inner.flush()

    def close(self) -> None:
        """Wait for the pool calls in progress, close the client and the stage below. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._pool.shutdown(wait=True)
        if self._rejoin_thread is not None:
            self._rejoin_thread.join()
        try:
            if self._client is not None:
                self._client.close()
        except Exception as exc:
            logger.warning("Mooncake client close failed: %s", exc)
        if self._inner is not None:
            self._inner.close()
