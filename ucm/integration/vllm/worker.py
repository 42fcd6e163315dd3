"""Worker side of UCMConnector: moves KV between vLLM's paged cache and the store, blockwise or layerwise.

Blockwise (default), per step: ``start_load_kv`` loads every block the scheduler planned, all layers at once, and
scatters them into the paged KV before the forward pass (in rounds of the load buffer's blocks: one request of
``max_model_len`` tokens, so memory does not grow with the number of requests loaded in one step); ``wait_for_save``
gathers the blocks that became full during the pass into a staging buffer and hands it to the store, whose writes
finish in the background (the gather is the only part the step waits for, so vLLM may reuse the blocks as soon as it
returns).

Layerwise (``use_layerwise: true``), per step:
- ``start_load_kv`` starts a sharded load (``UcmKVStoreBase.load_sharded``, one shard per layer) and returns at once;
  ``wait_for_layer_load(layer i)``, called by vLLM just before layer i's attention, waits for shard i of every
  block and scatters that layer (with any later layer already in, in the same launch), while the store is still
  reading the later layers. Blocks are validated when
  all their layers are in (the end of the step at the latest, in ``wait_for_save``): a block that then fails
  (damaged, vanished) was already scattered, so it is reported through ``get_block_ids_with_load_errors`` like
  any failed load, and vLLM discards the step's output for the requests using it and recomputes them (vLLM's
  ``kv_load_failure_policy: recompute``, which UCM sets). Wrong KV never reaches an output, nor the store (see below).
- ``save_kv_layer(layer i)``, called right after layer i's attention, gathers layer i of the step's newly full
  blocks into the dump's staging buffer; ``wait_for_save`` gathers any layer not seen and hands the buffer to the
  store, as blockwise does. The stored bytes are the same in both modes, so either reads what the other wrote.

Deadline (``load_timeout_ms``): a step never waits longer than it for a load (blockwise: ``start_load_kv``;
layerwise: from the load's start to its last layer) nor for a durable dump. A load past it is abandoned: every block
of it is reported through ``get_block_ids_with_load_errors`` (vLLM recomputes them; layerwise, the layers already
scattered are dropped with the rest) with one warning, and its staging buffer, which the store's late reads may
still write into, is never read again (the next load gets a fresh one). The scatter into vLLM's paged KV happens
only from a buffer the store has finished with, so late I/O never reaches KV that vLLM has reused. A durable dump
past it keeps its staging buffer (reaped on later steps) and the step goes on.

Dumps after a failed load: in a step where a load failed (on any tensor-parallel rank), vLLM computes the rest of the
affected prompts over the failed blocks' stale slots before it throws that step's output away and recomputes them;
a block that became full then holds wrong KV (with a valid checksum, once stored). So the dumps of that step, and of
the next one (which async scheduling plans before vLLM knows of the failure), are dropped, and their keys are sent
to the scheduler (``UCMWorkerMetadata.dropped_keys``), which dumps those blocks again at a later step, once they hold
the recomputed KV (:meth:`UCMScheduler.redo_dumps <ucm.integration.vllm.scheduler.UCMScheduler.redo_dumps>`).

Dumps in flight: each holds its rows of the staging arena (``dump_buffer_blocks`` rows, allocated and paged in at
start; the connector makes it twice one request of ``max_model_len`` tokens; see :mod:`ucm.integration.vllm.staging`)
until the store has written them through every stage, so the dumps' host memory never grows, however far a slow or
stalled store falls behind. A step whose blocks find no free run of rows large enough dumps the blocks that fit (the
first ones, in request order; none when the arena is full) and defers the rest: their keys go to the scheduler like
dropped ones, which dumps them at a later step of their requests (from vLLM's KV, still there while the request
runs); the blocks of requests that finish meanwhile are not stored (a later request recomputes them). One warning
per 30 s counts them. A durable dump (a prefill another instance will load) is never deferred: without room in the
arena it takes a buffer of its own, freed when the step's wait for it ends.

Cache reset: a step whose metadata carries a newer ``reset_epoch`` than the worker's starts with :meth:`UCMWorker.reset`
(called from the connector's ``bind_connector_metadata``, before the step's loads).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ucm.hashing import rank_keys
from ucm.integration.vllm.engine_info import KVSpec
from ucm.integration.vllm.metadata import BlockTransfer, UCMConnectorMetadata, UCMWorkerMetadata
from ucm.integration.vllm.staging import StagingArena
from ucm.kernels import KVLayout, canonical_block_shape, gather_blocks, scatter_blocks, scatter_layers, warm_up
from ucm.logger import init_logger
from ucm.sparse import invalidate_blocks
from ucm.store.base import Lease, Task, UcmKVStoreBase
from ucm.store.observe import NO_RECORDER, Observation, Recorder, requests_of

if TYPE_CHECKING:
    from ucm.integration.vllm.blend import Blender
    from ucm.integration.vllm.events import ResidencyBuffer

logger = init_logger(__name__)


def any_rank_of(group: object) -> Callable[[bool], bool]:
    """:class:`UCMWorker`'s ``any_rank`` over a ``torch.distributed`` process group (vLLM's tensor-parallel CPU
    group, ``get_tp_group().cpu_group``): a max all-reduce of one int32 flag. Every rank of the group must call it."""
    import torch.distributed as dist

    def any_rank(flag: bool) -> bool:
        value = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
        return bool(value.item())

    return any_rank


@dataclass
class _LayerLoad:
    """A layerwise load of this step: its sharded store task and how far it has been scattered."""

    task: Task
    keys: list[bytes]
    block_ids: list[int]
    ids: torch.Tensor  # int64 [n] block ids on the caches' device
    staging: torch.Tensor  # [n, num_layers, *shard] CPU, the task's dst
    started: float  # perf_counter at start
    next_layer: int = 0  # layers [0, next_layer) are scattered
    waited_s: float = 0.0  # time spent waiting for shards (seconds)
    scatter_s: float = 0.0  # time spent scattering (seconds)
    timed_out: bool = False  # abandoned past load_timeout_ms: every block failed, nothing more scattered
    requests: tuple[str, ...] = ()  # vLLM request ids of the load


@dataclass
class _LayerDump:
    """A layerwise dump of this step: the staging buffer its layers are gathered into."""

    keys: list[bytes]
    block_ids: list[int]
    ids: torch.Tensor  # int64 [n] block ids on the caches' device
    host: torch.Tensor  # [n, num_layers, *shard] CPU: the dump's rows of the staging arena (or its own buffer)
    staging: torch.Tensor  # [n, num_layers, *shard] on the caches' device (on CPU: host's first n blocks)
    gathered: list[bool]  # per layer


LOAD_BUFFER_MAX_BYTES = 1 << 30
DEFAULT_LOAD_TIMEOUT_S = 10.0
# Least seconds between two warnings about deferred dumps (see UCMWorker._admit_dump).
_DEFERRED_WARNING_INTERVAL_S = 30.0


def load_buffer_blocks(max_model_len: int, spec: KVSpec) -> int:
    """Blocks of the load staging buffer that :class:`UCMWorker` pages in at start: those of one request of
    ``max_model_len`` tokens (the longest prefix one step can load for one request), at most
    :data:`LOAD_BUFFER_MAX_BYTES` (1 GiB) of them, at least one."""
    blocks = -(-max_model_len // spec.block_size)
    return max(1, min(blocks, LOAD_BUFFER_MAX_BYTES // spec.block_nbytes))


class UCMWorker:
    """Loads and dumps canonical blocks for one worker (one TP rank).

    Args:
        spec: the engine's KV spec (layer order, block_size, heads, dtype).
        store: the store pipeline.
        layout_fn: detects the paged layout from one layer's KV tensor (``engine_info.detect_layout``).
        tp_rank / tp_size: tensor-parallel rank and size.
        layerwise: ``use_layerwise``: load and gather layer by layer (see the module docstring).
        load_buffer_blocks: blocks of the load staging buffer allocated and paged in by
            :meth:`register_kv_caches` (a larger blockwise load is done in rounds of that many blocks; a larger
            layerwise load grows it). Without it the first storage hit of a process
            copies every block into fresh memory, whose page faults contend with the I/O threads' and make those
            copies many times slower than copies into touched memory (figures in benchmarks/RESULTS.md, "Other
            one-off costs").
        dump_buffer_blocks: rows (blocks) of the dumps' staging arena
            (:class:`~ucm.integration.vllm.staging.StagingArena`), allocated and paged in by
            :meth:`register_kv_caches`: the most blocks that dumps in flight hold at once (see the module
            docstring); None: twice ``load_buffer_blocks``; 0: no arena (a worker that never dumps).
        load_timeout_s: most seconds a step waits for a load or a durable dump (``load_timeout_ms``; see the
            module docstring).
        any_rank: with tensor parallelism, ``any_rank(flag)`` is True on every rank when ``flag`` is True on at
            least one (a collective over the tensor-parallel group: every rank calls it in the same steps); it
            makes a load failure on one rank drop the step's dumps on all (see the module docstring). None: this
            rank alone.

    Raises:
        ValueError: ``load_buffer_blocks`` < 1, ``dump_buffer_blocks`` < 0 or ``load_timeout_s`` not > 0.
    """

    def __init__(
        self,
        spec: KVSpec,
        store: UcmKVStoreBase,
        layout_fn: Callable[[torch.Tensor], KVLayout],
        tp_rank: int = 0,
        tp_size: int = 1,
        layerwise: bool = False,
        load_buffer_blocks: int = 16,
        dump_buffer_blocks: int | None = None,
        load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S,
        any_rank: Callable[[bool], bool] | None = None,
    ) -> None:
        if load_buffer_blocks < 1:
            raise ValueError(f"load_buffer_blocks must be >= 1, got {load_buffer_blocks}")
        if dump_buffer_blocks is None:
            dump_buffer_blocks = 2 * load_buffer_blocks
        if dump_buffer_blocks < 0:
            raise ValueError(f"dump_buffer_blocks must be >= 0 or None, got {dump_buffer_blocks}")
        self._dump_buffer_blocks = dump_buffer_blocks
        if not load_timeout_s > 0:
            raise ValueError(f"load_timeout_s must be > 0 (seconds), got {load_timeout_s}")
        self._deferred_blocks = 0  # blocks whose dump was deferred since the last warning
        self._deferred_warned = 0.0  # perf_counter() of that warning
        self._layer_dump_deferred = False  # layerwise: this step's dump is deferred (see _admit_dump)
        self._load_timeout_s = load_timeout_s
        # Flushes the store for durable dumps, so that the step can stop waiting for a stalled one.
        self._flusher: ThreadPoolExecutor | None = None
        self._spec = spec
        self._layerwise = layerwise
        self._layer_index = {name: i for i, name in enumerate(spec.layer_names)}
        self._layer_load: _LayerLoad | None = None
        self._layer_dump: _LayerDump | None = None
        self._store = store
        self._layout_fn = layout_fn
        self._tp_rank, self._tp_size = tp_rank, tp_size
        self._kv_caches: list[torch.Tensor] = []
        self._layout: KVLayout | None = None
        self._load_errors: set[int] = set()
        # (task, its rows of the staging arena, store keys): the rows go back to the arena once the task is done
        self._pending_dumps: list[tuple[Task, torch.Tensor, list[bytes]]] = []
        self._dump_arena: StagingArena | None = None  # made by register_kv_caches
        self._reset_epoch = 0
        self._stored_keys: list[bytes] = []
        self._failed_keys: list[bytes] = []
        self._any_rank = any_rank
        self._load_failed = False  # a load of this step failed (on this rank)
        self._drop_dump_steps = 0  # steps, this one included, whose dumps are dropped (see the module docstring)
        self._dropped_keys: list[bytes] = []
        self._load_buffer: torch.Tensor | None = None
        self._load_buffer_blocks = load_buffer_blocks
        # With vLLM's KV events on: the tiers' changes, sent to the scheduler with the step's metadata.
        self.residency: ResidencyBuffer | None = None
        # Where loads abandoned past the deadline are recorded (load_failure, cause timeout); set by the connector.
        self.recorder: Recorder = NO_RECORDER
        # With CacheBlend on (set by the connector): fills the step's blend runs after its loads.
        self.blender: Blender | None = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take vLLM's per-layer paged KV tensors, ordered as the KV spec's layers, detect their layout, warm the
        copy kernels up and page the load buffer in.

        Args:
            kv_caches: layer name -> that layer's paged KV in the KV spec's dtype: on CPU ``[num_blocks,
                num_kv_heads, block_size, 2 * head_dim]`` (in-block layout of vLLM's kernel variant), with
                FlashAttention ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.

        Raises:
            ValueError: a layer of the KV spec has no tensor.
            UnsupportedEngineError: the layout is not one UCM handles.
        """
        missing = [name for name in self._spec.layer_names if name not in kv_caches]
        if missing:
            raise ValueError(f"kv_caches lacks layers {missing[:4]}... of the KV spec")
        self._kv_caches = [kv_caches[name] for name in self._spec.layer_names]
        self._layout = self._layout_fn(self._kv_caches[0])
        if self.blender is not None:
            self.blender.bind(kv_caches, self._layout)
        t0 = time.perf_counter()
        warm_up(self._kv_caches, self._layout)  # the kernels' first-call cost (numba compiling, loading), not on a TTFT
        t1 = time.perf_counter()
        # Page the load buffer in now: a first touch during a storage hit would be on its TTFT.
        self._load_buffer = self._staging(self._load_buffer_blocks)
        self._load_buffer.view(torch.uint8).zero_()
        # The dumps' host memory, all of it, now (see ucm.integration.vllm.staging).
        self._dump_arena = StagingArena(self._dump_buffer_blocks, self._block_shape(), self._spec.dtype)
        self._dump_arena.page_in()
        t2 = time.perf_counter()
        # e.g. the Cache stage pages in DRAM slots for one request's blocks (or cache_prefault_gb) in the background
        self._store.prepare(self._spec.block_nbytes, self._load_buffer_blocks)
        logger.info(
            "registered %d KV layers, layout %s, block %d tokens, %.2f MiB per block, %s transfer (kernels ready "
            "in %.0f ms; load buffer of %d blocks, %.0f MiB, and dump staging arena of %d blocks, %.0f MiB, paged "
            "in in %.0f ms)",
            len(self._kv_caches),
            self._layout.value,
            self._spec.block_size,
            self._spec.block_nbytes / 2**20,
            "layerwise" if self._layerwise else "blockwise",
            (t1 - t0) * 1e3,
            self._load_buffer_blocks,
            self._load_buffer.nbytes / 2**20,
            self._dump_buffer_blocks,
            self._dump_arena.buffer.nbytes / 2**20,
            (t2 - t1) * 1e3,
        )

    def _staging(self, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """A new ``[n, num_layers, 2, block_size, num_kv_heads, head_dim]`` buffer."""
        return torch.empty((n, *self._block_shape()), dtype=self._spec.dtype, device=device)

    def _gather_target(self, host: torch.Tensor) -> torch.Tensor:
        """The ``[n, num_layers, 2, block_size, num_kv_heads, head_dim]`` buffer a dump whose host rows are
        ``host`` gathers into: ``host`` itself, or a new one on the caches' device, copied into ``host`` by
        :meth:`_to_host`."""
        device = self._kv_caches[0].device
        return host if device.type == "cpu" else self._staging(host.shape[0], device)

    def _give_back(self, host: torch.Tensor) -> None:
        """Return a dump's host rows once nothing reads them (a durable dump's own buffer is just dropped)."""
        assert self._dump_arena is not None
        if self._dump_arena.owns(host):
            self._dump_arena.give(host)

    @staticmethod
    def _to_host(host: torch.Tensor, staging: torch.Tensor) -> torch.Tensor:
        """The dump's gathered blocks as uint8 rows ``[n, block_nbytes]`` of its host buffer."""
        n = staging.shape[0]
        if staging.device.type != "cpu":
            host[:n].copy_(staging)
        return host[:n].view(torch.uint8).view(n, -1)

    def _load_staging(self, n: int) -> torch.Tensor:
        """The first ``n`` blocks of a load buffer kept across steps (a step's load is over before the next one
        starts: when ``start_load_kv`` returns, or, layerwise, in ``wait_for_save``); reusing it spares the page
        faults of a fresh allocation per load. Allocated and paged in by :meth:`register_kv_caches`; a blockwise
        load larger than it is done in rounds of its size (:meth:`start_load_kv`); a larger layerwise load replaces
        it by one of ``n`` blocks; after :meth:`_abandon_load_buffer`, a new one of at least
        ``load_buffer_blocks`` blocks."""
        if self._load_buffer is None or self._load_buffer.shape[0] < n:
            self._load_buffer = self._staging(max(n, self._load_buffer_blocks))
        return self._load_buffer[:n]

    def _abandon_load_buffer(self) -> None:
        """Leave the load buffer to a load that timed out (the store may still write into it); later loads get a
        new one. The store's task keeps the old one alive until it is done."""
        self._load_buffer = None

    def _timed_out(self, keys: list[bytes], block_ids: list[int], layerwise: bool, requests: tuple[str, ...]) -> None:
        """Record a load abandoned past ``load_timeout_ms``: every block failed (vLLM recomputes them; a
        ``load_failure`` observation of tier ``all``, cause ``timeout``), one warning."""
        self._abandon_load_buffer()
        self._record_failed(keys, block_ids, range(len(keys)))
        if self.recorder.enabled:
            self.recorder.record(Observation("load_failure", "all", len(keys), cause="timeout", requests=requests))
        logger.warning(
            "load of %d blocks did not finish within load_timeout_ms (%.0f ms)%s; vLLM recomputes them (the store "
            "is stalled or slow: raise load_timeout_ms if it is only slow)",
            len(keys),
            self._load_timeout_s * 1e3,
            " (layerwise: its layers already used are dropped with it)" if layerwise else "",
        )

    def _record_failed(self, keys: list[bytes], block_ids: list[int], failed: Iterable[int]) -> None:
        """Record the failed rows ``failed`` of a load of ``keys`` into ``block_ids``: reported to vLLM
        (:meth:`get_block_ids_with_load_errors`) and to the scheduler (failed keys), and this step's dumps dropped
        (:meth:`_drop_this_step`)."""
        rows = sorted(failed)
        self._load_errors |= {block_ids[i] for i in rows}
        self._failed_keys.extend(keys[i] for i in rows)
        self._load_failed = True

    @staticmethod
    def _flatten(transfers: list[BlockTransfer]) -> tuple[list[bytes], list[int]]:
        keys: list[bytes] = []
        block_ids: list[int] = []
        for t in transfers:
            keys.extend(t.keys)
            block_ids.extend(t.block_ids)
        return keys, block_ids

    def start_load_kv(self, meta: UCMConnectorMetadata) -> None:
        """Load the step's planned blocks (``meta.loads``) and scatter them into the paged KV (blockwise:
        synchronous, all layers; layerwise: start the load, see :meth:`wait_for_layer_load`). A no-op before
        :meth:`register_kv_caches`.

        Blocks the store cannot produce are recorded for :meth:`get_block_ids_with_load_errors` (vLLM recomputes
        them); blockwise, they are not written to the paged KV.
        """
        if self._layout is None:
            return
        if meta.loads:
            if self._layerwise:
                self._start_layer_load(meta)
            else:
                self._load_blocks(meta)
        if meta.blends:  # after the loads: a blend reads the prefix they fill
            self._blend(meta)

    def _load_blocks(self, meta: UCMConnectorMetadata) -> None:
        """Blockwise: load ``meta.loads`` and scatter them, in rounds of the load buffer's blocks."""
        keys, block_ids = self._flatten(meta.loads)
        requests = tuple(t.req_id for t in meta.loads)
        deadline = time.perf_counter() + self._load_timeout_s
        # In rounds of at most the load buffer's blocks: a step that loads for many requests at once reuses the
        # buffer instead of growing it (the process's memory would keep the largest batch ever loaded).
        step = self._load_buffer_blocks
        for start in range(0, len(keys), step):
            end = start + step
            if not self._load_round(keys[start:end], block_ids[start:end], requests, deadline):
                # Abandoned: its buffer is never read again (see the module docstring); later rounds fail too.
                self._timed_out(keys[start:], block_ids[start:], layerwise=False, requests=requests)
                return

    def _blend(self, meta: UCMConnectorMetadata) -> None:
        """Fill the step's CacheBlend runs (``meta.blends``; see :mod:`ucm.integration.vllm.blend`). A run whose
        request had a block fail to load, or whose blend fails, is reported as failed loads of its blocks (vLLM
        recomputes them)."""
        if self.blender is None:
            raise RuntimeError("the scheduler sent CacheBlend runs to a worker without ucm_sparse_config.Blend")
        for t in meta.blends:
            run_blocks = t.block_ids[t.start // self._spec.block_size :]
            if self._load_errors & set(t.block_ids):
                self._load_errors |= set(run_blocks)
                continue
            try:
                self.blender.blend(t)
            except Exception as exc:  # any failure is a miss: vLLM recomputes the run, exactly
                self._load_errors |= set(run_blocks)
                self._load_failed = True
                logger.warning(
                    "request_id: %s: blend failed (%r); vLLM recomputes tokens %d-%d", t.req_id, exc, t.start, t.end
                )

    def _load_round(self, keys: list[bytes], block_ids: list[int], requests: tuple[str, ...], deadline: float) -> bool:
        """Load ``keys`` (at most the load buffer's blocks) and scatter those that loaded into ``block_ids``; record
        those that failed. With the paged KV on CPU, the blocks the store holds in DRAM are lent
        (:meth:`~ucm.store.base.UcmKVStoreBase.lend`) and scattered straight from there; the others are loaded into
        the load buffer first. False when the store did not finish by ``deadline`` (``perf_counter`` seconds):
        nothing is scattered or recorded then."""
        t0 = time.perf_counter()
        staging = self._load_staging(len(keys))
        block_nbytes = staging[0].numel() * staging.element_size()
        store_keys = rank_keys(keys, self._tp_rank, self._tp_size)
        on_cpu = self._kv_caches[0].device.type == "cpu"
        with requests_of(requests):  # named in the stages' observations
            lease = self._store.lend(store_keys, block_nbytes) if on_cpu else Lease([None] * len(keys))
        with lease:
            rest = [i for i, row in enumerate(lease.rows) if row is None]  # to load into the buffer
            failed: set[int] = set()
            if rest:
                rows = staging[: len(rest)].view(torch.uint8).view(len(rest), -1)
                with requests_of(requests):
                    task = self._store.load([store_keys[i] for i in rest], rows)
                try:
                    result = task.result(max(0.0, deadline - t0))
                except TimeoutError:
                    return False
                failed = {rest[j] for j in result.failed}
            t1 = time.perf_counter()
            if failed:
                self._record_failed(keys, block_ids, failed)
                logger.warning("%d of %d blocks failed to load; vLLM recomputes them", len(failed), len(keys))
            ok = [i for i in range(len(keys)) if i not in failed]
            if not ok:
                return True
            ids = [block_ids[i] for i in ok]
            if not lease.lent:  # every row in the buffer: one tensor (the GPU path copies it to the device)
                self._scatter(ids, staging if len(ok) == len(keys) else staging[ok])
            else:
                in_buffer = {i: j for j, i in enumerate(rest)}
                self._scatter(
                    ids,
                    [
                        self._lent_block(lease.rows[i], staging) if i not in in_buffer else staging[in_buffer[i]]
                        for i in ok
                    ],
                )
        logger.debug(
            "loaded %d blocks into vLLM block ids %s (%d lent from DRAM): store %.1f ms, scatter %.1f ms",
            len(ok),
            ids,
            lease.lent,
            (t1 - t0) * 1e3,
            (time.perf_counter() - t1) * 1e3,
        )
        return True

    @staticmethod
    def _lent_block(row: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
        """A lent uint8 row viewed as one canonical block ``like[0]`` (dtype and shape of the load buffer's rows)."""
        assert row is not None
        return row.view(like.dtype).view(like.shape[1:])

    def _block_shape(self) -> tuple[int, ...]:
        s = self._spec
        return tuple(canonical_block_shape(len(self._kv_caches), s.block_size, s.num_kv_heads, s.head_dim))

    def _scatter(self, block_ids: list[int], src: torch.Tensor | list[torch.Tensor]) -> None:
        """Write canonical blocks ``src`` (``[len(block_ids), num_layers, 2, block_size, num_kv_heads, head_dim]``,
        CPU; or, with the paged KV on CPU, a list of such blocks, each where it lies) into ``block_ids`` of the paged
        KV."""
        assert self._layout is not None
        device = self._kv_caches[0].device
        ids = torch.tensor(block_ids, dtype=torch.int64)
        if isinstance(src, torch.Tensor):
            src = src.to(device, non_blocking=True)
        scatter_blocks(src, self._kv_caches, ids.to(device), self._layout)
        # Sparse attention's per-block summaries of these blocks describe their previous contents: recompute them.
        invalidate_blocks(ids)

    def wait_for_save(self, meta: UCMConnectorMetadata) -> None:
        """Gather the step's newly full blocks and start their dump; return once the gather is done.

        The gather copies the blocks out of vLLM's paged KV into a fresh staging buffer, so vLLM may reuse those
        blocks as soon as this returns; the store writes the staging buffer in the background (kept alive until its
        task is done, reaped on later steps and at :meth:`shutdown`). Exception: when a dump is ``durable`` (a
        prefill whose KV another instance will load), this also waits until the store's task is done, i.e. the
        blocks are written through every stage (renamed into place in the Posix directory), so the request's
        response cannot reach the proxy before its KV is visible to other instances."""
        self._reap_dumps(block=False)
        self._finish_layer_load()
        layer_dump, self._layer_dump = self._layer_dump, None
        deferred, self._layer_dump_deferred = self._layer_dump_deferred, False  # layerwise: keys handed back already
        if self._drop_this_step(meta):
            if layer_dump is not None:
                self._give_back(layer_dump.host)
            if meta.dumps and self._layout is not None:
                keys, _ = self._flatten(meta.dumps)
                self._dropped_keys.extend(keys)
                logger.warning(
                    "dropped the dump of %d blocks computed in a step with a failed load or just after one (they "
                    "may hold KV computed over the failed blocks); they are dumped again once recomputed",
                    len(keys),
                )
            return
        if not meta.dumps or self._layout is None:
            return
        if deferred:
            return
        if layer_dump is not None:  # layerwise: gather the layers save_kv_layer did not see
            for layer, done in enumerate(layer_dump.gathered):
                if not done:
                    self._gather_layer(layer_dump, layer)
            keys, block_ids = layer_dump.keys, layer_dump.block_ids
            host, rows = layer_dump.host, self._to_host(layer_dump.host, layer_dump.staging)
        else:
            admitted = self._admit_dump(meta)
            if admitted is None:
                return
            keys, block_ids, host = admitted
            ids = torch.tensor(block_ids, dtype=torch.int64, device=self._kv_caches[0].device)
            gathered = gather_blocks(self._kv_caches, ids, self._layout, out=self._gather_target(host))
            rows = self._to_host(host, gathered)
        ranked = rank_keys(keys, self._tp_rank, self._tp_size)
        logger.debug("dumping %d blocks: vLLM block ids %s", len(keys), block_ids)
        with requests_of([t.req_id for t in meta.dumps]):
            task = self._store.dump(ranked, rows)
        if any(t.durable for t in meta.dumps):
            # A prefill for another instance: its response must not leave before the blocks are in storage.
            if not self._wait_durable(task, host, ranked):
                return  # the store is stalled: nothing to report stored, and a lookup would wait again
        else:
            # The store reads the rows until the task is done; _reap_dumps then gives them back to the arena.
            self._pending_dumps.append((task, host, ranked))
        # Blocks the store can already serve (e.g. copied into the DRAM tier), reported to the scheduler.
        start = 0
        for t in meta.dumps:
            n = min(len(t.keys), len(ranked) - start)  # of a dump cut short by the arena, the blocks dumped
            if n <= 0:
                break
            self._stored_keys.extend(t.keys[: self._store.lookup(ranked[start : start + n])])
            start += n

    def _admit_dump(self, meta: UCMConnectorMetadata) -> tuple[list[bytes], list[int], torch.Tensor] | None:
        """Rows of the staging arena for this step's dump: ``(keys, block_ids, host)`` of the blocks that get rows,
        ``host`` their ``[n, num_layers, 2, block_size, num_kv_heads, head_dim]`` rows; None when none does.

        Every block gets a row when the arena has a free run long enough; else the first blocks get the largest
        free run and the rest are deferred: their keys are handed back to the scheduler to dump later, with a
        ``dump_deferred`` observation and a warning at most every 30 s (see the module docstring). A durable dump is
        never deferred: without a run long enough it gets a buffer of its own (the step waits for it, so it does
        not stay in flight). The caller has reaped the dumps done."""
        assert self._dump_arena is not None
        keys, block_ids = self._flatten(meta.dumps)
        host = self._dump_arena.take(len(keys))
        if host is not None:
            return keys, block_ids, host
        if any(t.durable for t in meta.dumps):
            return keys, block_ids, self._staging(len(keys))
        n = self._dump_arena.largest_free  # only this thread takes rows: a run of n stays free until taken
        deferred = keys[n:]
        self._dropped_keys.extend(deferred)
        self._deferred_blocks += len(deferred)
        if self.recorder.enabled:
            requests = tuple(t.req_id for t in meta.dumps)
            self.recorder.record(Observation("dump_deferred", "all", len(deferred), requests=requests))
        now = time.perf_counter()
        if now - self._deferred_warned >= _DEFERRED_WARNING_INTERVAL_S:
            # Either the store lags (dumps in flight fill the arena) or one step has more blocks than the arena.
            logger.warning(
                "dumps deferred: a step had %d blocks to dump, the dumps' staging arena %d of its %d blocks free in "
                "one run (%d dumps in flight hold %d); deferred the dumps of %d blocks since the last warning "
                "(dumped later while their requests run)",
                len(keys),
                n,
                self._dump_arena.num_blocks,
                len(self._pending_dumps),
                self._dump_arena.blocks_in_use,
                self._deferred_blocks,
            )
            self._deferred_warned, self._deferred_blocks = now, 0
        if n == 0:
            return None
        host = self._dump_arena.take(n)
        assert host is not None
        return keys[:n], block_ids[:n], host

    def _drop_this_step(self, meta: UCMConnectorMetadata) -> bool:
        """Whether this step's dumps are dropped: a load of this step failed on some rank, or one of the step
        before did (see the module docstring). Called once per step, at its end."""
        failed, self._load_failed = self._load_failed, False
        if meta.loads and self._any_rank is not None:  # every rank has the same loads planned: all call it
            failed = self._any_rank(failed)
        if failed:
            self._drop_dump_steps = 2
        drop = self._drop_dump_steps > 0
        self._drop_dump_steps = max(0, self._drop_dump_steps - 1)
        return drop

    def _wait_durable(self, task: Task, host: torch.Tensor, keys: list[bytes]) -> bool:
        """Wait for a durable dump's task and then for the store's earlier write-backs (which may be writing blocks
        of this dump), at most ``load_timeout_s`` in all; return False when the time ran out. The step then goes on
        with one warning: the blocks not stored by then are recomputed by the instance that loads them; the task
        keeps ``host`` (its staging rows, not vLLM's KV) until it is done, and :meth:`_reap_dumps` gives them back
        to the arena. Done in time, ``host`` goes back at once."""
        t_wait = time.perf_counter()
        deadline = t_wait + self._load_timeout_s
        try:
            result = task.result(self._load_timeout_s)
            if self._flusher is None:
                self._flusher = ThreadPoolExecutor(1, thread_name_prefix="ucm-flush")
            # One flush at a time: one still stalled makes the next wait behind it, and time out too.
            self._flusher.submit(self._store.flush).result(max(0.0, deadline - time.perf_counter()))
        except TimeoutError:
            # Reaped (its failures logged, its buffer given back) on later steps.
            self._pending_dumps.append((task, host, keys))
            logger.warning(
                "durable dump of %d blocks did not finish within load_timeout_ms (%.0f ms); the response leaves "
                "now and the instance that loads them recomputes the blocks not stored by then",
                len(keys),
                self._load_timeout_s * 1e3,
            )
            return False
        self._give_back(host)
        if result.failed:
            logger.warning("%d of %d blocks were not stored", len(result.failed), len(keys))
        logger.debug("durable dump of %d blocks: waited %.1f ms", len(keys), (time.perf_counter() - t_wait) * 1e3)
        return True

    # -- layerwise -------------------------------------------------------------------------------------------

    def _start_layer_load(self, meta: UCMConnectorMetadata) -> None:
        """Start the step's sharded load (one shard per layer); layers are scattered by :meth:`wait_for_layer_load`."""
        self._finish_layer_load()  # none is left from an earlier step; this only guards against a missed end
        keys, block_ids = self._flatten(meta.loads)
        staging = self._load_staging(len(keys))
        rows = staging.view(torch.uint8).view(len(keys), -1)
        t0 = time.perf_counter()
        with requests_of([t.req_id for t in meta.loads]):
            task = self._store.load_sharded(rank_keys(keys, self._tp_rank, self._tp_size), rows, len(self._kv_caches))
        device = self._kv_caches[0].device
        ids = torch.tensor(block_ids, dtype=torch.int64).to(device)
        self._layer_load = _LayerLoad(
            task, keys, block_ids, ids, staging, t0, requests=tuple(t.req_id for t in meta.loads)
        )

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layerwise: scatter layer ``layer_name`` (and any earlier layer not yet scattered) of the step's load,
        waiting for its shard of every block. A no-op without a layerwise load in flight or for an unknown layer."""
        load = self._layer_load
        layer = self._layer_index.get(layer_name)
        if load is None or layer is None:
            return
        self._scatter_layers(load, layer + 1)

    def _scatter_layers(self, load: _LayerLoad, stop: int) -> None:
        """Scatter layers ``[load.next_layer, stop)``, each once the store has it; a load still not in at
        ``load_timeout_s`` after its start is abandoned (:meth:`_timed_out`) and nothing more is scattered."""
        assert self._layout is not None
        device = self._kv_caches[0].device
        num_layers = len(self._kv_caches)
        while load.next_layer < stop and not load.timed_out:
            first = load.next_layer
            t0 = time.perf_counter()
            left = load.started + self._load_timeout_s - t0
            if not load.task.wait_shard(first, max(0.0, left)):
                load.timed_out = True
                self._timed_out(load.keys, load.block_ids, layerwise=True, requests=load.requests)
                return
            t1 = time.perf_counter()
            # Every later layer that has arrived too goes in the same launch (fewer, larger scatters).
            end = first + 1
            while end < num_layers and load.task.shard_ready(end):
                end += 1
            shards = load.staging[:, first:end].transpose(0, 1)  # [layers, n, *shard], shard dims contiguous
            caches = self._kv_caches[first:end]
            scatter_layers(shards.to(device, non_blocking=True), caches, load.ids, self._layout)
            load.waited_s += t1 - t0
            load.scatter_s += time.perf_counter() - t1
            load.next_layer = end

    def _finish_layer_load(self) -> None:
        """End the step's layerwise load: scatter the layers not done yet, wait for validation, record failures."""
        load, self._layer_load = self._layer_load, None
        if load is None:
            return
        self._scatter_layers(load, len(self._kv_caches))
        t_wait = time.perf_counter()
        try:
            if load.timed_out:
                raise TimeoutError
            result = load.task.result(max(0.0, load.started + self._load_timeout_s - t_wait))
        except TimeoutError:  # validation still pending: every block failed, the buffer is left to the late reads
            if not load.timed_out:
                self._timed_out(load.keys, load.block_ids, layerwise=True, requests=load.requests)
            invalidate_blocks(load.ids.cpu())
            return
        if result.failed:
            self._record_failed(load.keys, load.block_ids, result.failed)
            logger.warning(
                "%d of %d blocks failed to load (layerwise: found after their layers were used); vLLM discards the "
                "step's output for their requests and recomputes them",
                len(result.failed),
                len(load.keys),
            )
        invalidate_blocks(load.ids.cpu())
        logger.debug(
            "layerwise load of %d blocks into vLLM block ids %s: %.1f ms from start to validated; the step waited "
            "%.1f ms for layers and %.1f ms for validation, scatter %.1f ms",
            len(load.keys),
            load.block_ids,
            (time.perf_counter() - load.started) * 1e3,
            load.waited_s * 1e3,
            (time.perf_counter() - t_wait) * 1e3,
            load.scatter_s * 1e3,
        )

    def save_kv_layer(self, layer_name: str, meta: UCMConnectorMetadata) -> None:
        """Layerwise: gather layer ``layer_name`` of the step's newly full blocks into the dump's staging buffer
        (right after its attention wrote the layer's KV); :meth:`wait_for_save` hands the buffer to the store.
        A no-op when blockwise, without dumps, or for an unknown layer."""
        layer = self._layer_index.get(layer_name)
        if not self._layerwise or not meta.dumps or self._layout is None or layer is None:
            return
        if self._layer_dump_deferred:
            return
        if self._layer_dump is None:
            self._reap_dumps(block=False)  # the step's first layer: give back the dumps done since the last step
            admitted = self._admit_dump(meta)
            if admitted is None:
                self._layer_dump_deferred = True
                return
            keys, block_ids, host = admitted
            ids = torch.tensor(block_ids, dtype=torch.int64).to(self._kv_caches[0].device)
            staging = self._gather_target(host)
            self._layer_dump = _LayerDump(keys, block_ids, ids, host, staging, [False] * len(self._kv_caches))
        self._gather_layer(self._layer_dump, layer)

    def _gather_layer(self, dump: _LayerDump, layer: int) -> None:
        assert self._layout is not None
        gather_blocks([self._kv_caches[layer]], dump.ids, self._layout, out=dump.staging[:, layer : layer + 1])
        dump.gathered[layer] = True

    def _reap_dumps(self, block: bool) -> None:
        still: list[tuple[Task, torch.Tensor, list[bytes]]] = []
        for task, host, keys in self._pending_dumps:
            if block or task.done():
                result = task.result()
                self._give_back(host)
                if result.failed:
                    logger.warning("%d of %d blocks were not stored", len(result.failed), len(keys))
            else:
                still.append((task, host, keys))
        self._pending_dumps = still

    def reset(self, meta: UCMConnectorMetadata) -> None:
        """Start a step: when ``meta.reset_epoch`` is newer than the worker's (the scheduler reset UCM's caches, see
        :meth:`UCMScheduler.reset <ucm.integration.vllm.scheduler.UCMScheduler.reset>`), empty the DRAM tier before
        the step loads anything. A no-op otherwise.

        First waits for the dumps still being written back (so none lands in DRAM or storage after the reset
        unnoticed), then drops every cached block; with ``meta.clear_storage`` also deletes the block files of the
        dumps that may have landed after the scheduler cleared the storage (those not seen finished when the
        previous step started, and that step's). Keys stored before the reset and not yet reported are not
        reported. Logs one info line.
        """
        if meta.reset_epoch <= self._reset_epoch:
            return
        self._reset_epoch = meta.reset_epoch
        self._finish_layer_load()  # none is left from an earlier step; this only guards against a missed end
        # Dumps not seen finished when the last step started, or started by it: the only ones that may have landed
        # after the scheduler cleared the storage (between two steps).
        unfinished = [k for _, _, keys in self._pending_dumps for k in keys]
        self._reap_dumps(block=True)
        self._store.flush()  # write-backs and read-through promotions of earlier loads and dumps
        dropped = self._store.drop_cached()
        self._stored_keys = []
        removed = ""
        if meta.clear_storage and unfinished:
            removal = self._store.remove_stored(keys=unfinished)
            removed = f"; removed {removal.blocks} block files written back since the storage was cleared"
            if removal.errors:
                logger.warning(
                    "cache reset: %d block files could not be removed, e.g. %s", len(removal.errors), removal.errors[0]
                )
        logger.info("cache reset: dropped %d blocks from the DRAM tier%s", dropped, removed)

    def take_worker_meta(self) -> UCMWorkerMetadata | None:
        """Keys stored, keys that failed to load and keys whose dump was dropped since the last call, and the tiers'
        changes (with KV events on), for the scheduler (``None``: none)."""
        tier_events = self.residency.take() if self.residency is not None else []
        if not self._stored_keys and not self._failed_keys and not self._dropped_keys and not tier_events:
            return None
        meta = UCMWorkerMetadata(
            self._stored_keys, self._failed_keys, self._reset_epoch, tier_events, self._dropped_keys
        )
        self._stored_keys, self._failed_keys, self._dropped_keys = [], [], []
        return meta

    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM block ids whose load failed since the last call (reported once)."""
        self._finish_layer_load()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def pending_dump_blocks(self) -> int:
        """Blocks of this worker's dumps whose store task has not finished: not yet stored through every stage (a
        ``Cache`` stage's dump task ends when its write-back to the stage below does)."""
        return sum(len(keys) for task, _, keys in self._pending_dumps if not task.done())

    def shutdown(self) -> None:
        """Wait for in-flight loads (at most ``load_timeout_s``) and dumps."""
        self._finish_layer_load()
        self._reap_dumps(block=True)
        if self._flusher is not None:
            self._flusher.shutdown(wait=False)
