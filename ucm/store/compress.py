"""``Compress`` store stage (KVfold): encodes canonical blocks on their way to the stage below, decodes on the way back.

Pipelines ``Cache|Compress|Posix`` and ``Compress|Posix``. The stage sits on any stage that holds encoded payloads
(:meth:`~ucm.store.base.UcmKVStoreBase.encoded_store`: ``Posix``; a ``Cache`` passes them through to its stage below)
and stores each block as a variable-size payload through :meth:`~ucm.store.base.EncodedStore.dump_encoded`, with its
codec id (:mod:`ucm.store.codecs`; the Posix stage keeps it in the block file's header): ``CODEC_KVFOLD`` (a
self-describing container, :mod:`ucm.store.kvfold`) or ``CODEC_RAW`` (the block's bytes, exactly what
``Cache|Posix`` writes). Reading goes through :meth:`~ucm.store.base.EncodedStore.load_encoded` and decodes
(:func:`~ucm.store.codecs.decode_into`) by what the stored block says, not by this stage's settings, so:

- a store written in one mode is read correctly in any other (a block written with ``fixed_rate`` stays lossy:
  reading it under ``lossless`` is logged once);
- a store written by ``Cache|Posix`` (raw files) is fully readable by ``Cache|Compress|Posix``;
- the other way round, ``Cache|Posix`` and ``Posix`` decode KVfold files too (:meth:`~ucm.store.posix.PosixStore.load`,
  with the same :func:`~ucm.store.codecs.decode_into`: lossy blocks stay lossy), so switching ``store_pipeline``
  back, or mixing both pipelines on one directory, loses no stored block. Never wrong KV.

Modes (``compress_mode``, see :mod:`ucm.config`): ``lossless`` (default; bit-exact), ``fixed_rate`` (lossy int8
with a per-(token, head) scale, ``compress_ratio: 16``), ``off`` (raw files through this stage). Blocks of a KV
dtype other than bf16 (learnt from :meth:`set_namespace`; the connector calls it with the model's KV spec) are stored
raw, with one info log line.

Work: blocks are encoded on ``threads`` threads (``decompress_thread_num``; zstandard and numba release the GIL),
one job per block, then written in one batched ``dump_encoded``. A load is one batched ``load_encoded``: the stage
below hands each block to the decoder on its thread that has just read it (the Posix stage: an I/O thread, from its
own reused buffer), which decodes it straight into the destination row, so decoding overlaps the reads still waiting
on the disk and no buffer is allocated per block; at most ``threads`` blocks decode at once. No thread waits for a
load (so as many blocks are in flight as the stage below has I/O threads, however the stage above splits its
loads); each dump task is run by one of a few coordinator threads. With ``UC_LOGGER_LEVEL=debug``, per task::

    COMPRESS DUMP START | <task id> | <n> blocks
    COMPRESS DUMP | <task id> | block <key> | <mode> | shard sizes [...]        (bytes per section: layer K, V, ...)
    COMPRESS DUMP END | <task id> | ...
    COMPRESS LOAD START | <task id> | <n> blocks
    COMPRESS LOAD | <task id> | block <key> | <codec> | <stored> -> <decompressed> bytes
    COMPRESS LOAD END | <task id> | ...
"""

from __future__ import annotations

import contextvars
import itertools
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from typing import Any, Literal

import torch

from ucm.affinity import thread_pool
from ucm.logger import init_logger
from ucm.store.base import (
    EncodedBlock,
    EncodedStore,
    Removal,
    Task,
    TaskResult,
    UcmKVStoreBase,
    check_keys_and_buffer,
)
from ucm.store.codecs import CODEC_KVFOLD, CODEC_RAW, decode_into, max_encoded_nbytes
from ucm.store.kvfold import DEFAULT_GROUP, KVGeometry, Mode, decode_block, encode_block
from ucm.store.observe import Observation, Recorder, current_requests

logger = init_logger(__name__)

CompressMode = Literal["lossless", "fixed_rate", "off"]
COMPRESS_MODES: tuple[CompressMode, ...] = ("lossless", "fixed_rate", "off")
# compress_ratio in 1/32 units of the raw size (16 bits per bf16 value = 32): the fixed-rate settings built.
FIXED_RATE_RATIOS: dict[int, Mode] = {16: "int8"}  # 16/32 -> 8 bits per value (+ 16 bits of scale per head_dim values)
RATIO_OFF = 32
DATA_TYPES = {0: torch.bfloat16}  # data_type codes of the seed configs
COORDINATORS = 4  # dump tasks in flight at once (loads need none: they run on the stage below's I/O threads)


def _dtype_of(name: Any) -> torch.dtype | None:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    return dtype if isinstance(dtype, torch.dtype) else None


class CompressStore(UcmKVStoreBase):
    """The KVfold stage over a stage that holds encoded payloads (see the module docstring).

    Args:
        inner: the stage below (owned: closed by :meth:`close`); its
            :meth:`~ucm.store.base.UcmKVStoreBase.encoded_store` stores the encoded blocks.
        mode: ``"lossless"``, ``"fixed_rate"`` (lossy) or ``"off"``.
        compress_ratio: with ``fixed_rate``: stored bits per value in 1/32 of the raw 16 (16 = 8 bits: int8 with a
            per-(token, head) bf16 scale); otherwise must be 32.
        data_type: KV dtype code the codec compresses (0 = bf16, the only one).
        threads: encode threads, and the most blocks decoded at once (``decompress_thread_num``).

    Raises:
        ValueError: an unknown mode, a ``compress_ratio`` not allowed for it, an unknown ``data_type``, ``threads``
            < 1; TypeError: ``inner`` cannot hold encoded payloads (its ``encoded_store()`` is ``None``).
    """

    def __init__(
        self,
        inner: UcmKVStoreBase,
        *,
        mode: CompressMode = "lossless",
        compress_ratio: int = RATIO_OFF,
        data_type: int = 0,
        threads: int = 4,
    ) -> None:
        check_compress_settings(mode, compress_ratio, data_type)
        encoded = inner.encoded_store()
        if encoded is None:
            raise TypeError(
                f"the Compress stage needs a stage below it that holds encoded payloads; {type(inner).__name__} "
                "does not (its encoded_store() is None)"
            )
        if threads < 1:
            raise ValueError(f"decompress_thread_num must be >= 1, got {threads}")
        self._inner = inner
        self._encoded: EncodedStore = encoded
        self._mode = mode
        self._codec: Mode | None = FIXED_RATE_RATIOS[compress_ratio] if mode == "fixed_rate" else None
        if mode == "lossless":
            self._codec = "lossless"
        self._dtype = DATA_TYPES[data_type]
        self._geometry: KVGeometry | None = None
        self._passthrough: str | None = "compress_mode: off" if mode == "off" else None
        self._pool = thread_pool(threads, "ucm-kvfold")  # encodes
        self._decode_slots = threading.BoundedSemaphore(threads)  # decodes, on the stage below's I/O threads
        self._coord = thread_pool(COORDINATORS, "ucm-compress")
        self._ids = itertools.count(1)
        self._pending: set[Future[TaskResult]] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._error_logged = False
        self._lossy_read_logged = False
        self._error_measured = False
        self._warm_up()
        if self._codec == "int8":
            logger.warning(
                "Compress stage: compress_mode: fixed_rate, compress_ratio: %d is LOSSY: int8 values with one bf16 "
                "scale per (token, head) (8 + 16/head_dim bits per value); the RMS error on this model's KV is "
                "logged after the first dump",
                compress_ratio,
            )
        else:
            logger.info("Compress stage: compress_mode: %s (bit-exact), %d threads", mode, threads)

    @property
    def inner(self) -> UcmKVStoreBase:
        """The stage below."""
        return self._inner

    @property
    def geometry(self) -> KVGeometry | None:
        """The block geometry learnt from :meth:`set_namespace` (``None`` before)."""
        return self._geometry

    # -- contract -------------------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` stored below (any codec). Reads no block data."""
        return self._inner.lookup(keys)

    def dump(self, keys: Sequence[bytes], src: torch.Tensor) -> Task:
        """Start encoding the rows of ``src`` (uint8 ``[len(keys), block_nbytes]``) and writing them below.

        Blocks already stored below are skipped (and count as stored). A block that fails to encode or write is
        reported failed.

        Raises:
            TypeError / ValueError: bad keys or ``src``. RuntimeError: the store is closed.
        """
        check_keys_and_buffer(keys, src, "src")
        return self._submit(self._dump_task, list(keys), src)

    def load(self, keys: Sequence[bytes], dst: torch.Tensor) -> Task:
        """Start reading the blocks of ``keys`` into the rows of ``dst`` (uint8 ``[len(keys), block_nbytes]``),
        decoding each by the codec its file records. Missing, damaged or undecodable blocks fail (a miss).

        Raises:
            TypeError / ValueError: bad keys or ``dst``. RuntimeError: the store is closed.
        """
        check_keys_and_buffer(keys, dst, "dst")
        with self._lock:
            if self._closed:
                raise RuntimeError("CompressStore is closed")
            task_id = next(self._ids)
        if not keys:
            return Task.completed(TaskResult(0))
        return self._start_load(task_id, list(keys), dst)

    def set_namespace(self, tag: bytes, info: dict[str, Any]) -> None:
        """Learn the block geometry and KV dtype from the namespace ``info`` (keys ``kv_dtype``, ``num_layers``,
        ``block_size``, ``num_kv_heads``, ``head_dim``, as the connector passes them) and pass the namespace down.
        A KV dtype other than ``data_type``'s makes this stage store blocks raw (one info line)."""
        dtype = _dtype_of(info.get("kv_dtype"))
        try:
            geometry = KVGeometry(
                num_layers=int(info["num_layers"]),
                block_size=int(info["block_size"]),
                num_kv_heads=int(info["num_kv_heads"]),
                head_dim=int(info["head_dim"]),
                dtype=dtype if dtype is not None else self._dtype,
            )
        except (KeyError, TypeError, ValueError):
            geometry = None
        self._geometry = geometry
        if self._mode != "off":
            if dtype is not None and dtype != self._dtype:
                self._passthrough = f"KV dtype {dtype} is not {self._dtype} (data_type)"
                logger.info("Compress stage: %s: blocks are stored uncompressed", self._passthrough)
            else:
                self._passthrough = None
        self._inner.set_namespace(tag, info)

    def set_recorder(self, recorder: Recorder) -> None:
        """Record this stage's loads and dumps (tier ``compress``: canonical bytes, and the compressed bytes as
        ``stored_nbytes``) and pass ``recorder`` down."""
        self._recorder = recorder
        self._inner.set_recorder(recorder)

    def gauges(self) -> dict[str, float]:
        """The stage below's (this stage's ratio is counted from its observations)."""
        return self._inner.gauges()

    def prepare(self, block_nbytes: int, request_blocks: int = 0) -> None:
        """Pass the block size down (this stage's buffers are per stored block, sized as they come)."""
        self._inner.prepare(block_nbytes, request_blocks)

    def drop_cached(self) -> int:
        """Passed down: this stage keeps no blocks in memory."""
        return self._inner.drop_cached()

    def remove_stored(self, *, keys: Sequence[bytes] | None = None, namespace: bytes | None = None) -> Removal:
        """Passed down to the stage below (see :meth:`~ucm.store.base.UcmKVStoreBase.remove_stored`).

        Raises:
            TypeError / ValueError: bad arguments (see :func:`~ucm.store.base.check_removal`).
        """
        return self._inner.remove_stored(keys=keys, namespace=namespace)

    def flush(self) -> None:
        """Wait for the tasks started so far, then for the stage below."""
        with self._lock:
            pending = list(self._pending)
        futures_wait(pending)
        self._inner.flush()

    def close(self) -> None:
        """Finish the running tasks, stop the threads and close the stage below. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._coord.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        self._inner.close()

    # -- internals ------------------------------------------------------------------------------------------

    def _warm_up(self) -> None:
        """Encode and decode a tiny block once, so the first real load or dump does not pay one-time costs (numba
        loading its compiled kernels, zstd contexts): on a storage hit they landed in the request's TTFT."""
        if self._codec is None:
            return
        tiny = torch.linspace(-2, 2, 2 * DEFAULT_GROUP, dtype=torch.bfloat16).view(torch.uint8)
        container, _, _ = encode_block(tiny, self._codec)
        out = torch.empty_like(tiny)
        decode_block(container, out)

    def _submit(self, fn: Any, keys: list[bytes], buf: torch.Tensor) -> Task:
        with self._lock:
            if self._closed:
                raise RuntimeError("CompressStore is closed")
            if not keys:
                return Task.completed(TaskResult(0))
            # In the caller's context: observations of this task and of the stage below name the caller's requests.
            run = contextvars.copy_context().run
            future: Future[TaskResult] = self._coord.submit(run, self._guarded, fn, next(self._ids), keys, buf)
            self._pending.add(future)
        future.add_done_callback(self._forget)
        return Task(future)

    def _forget(self, future: Future[TaskResult]) -> None:
        with self._lock:
            self._pending.discard(future)

    def _guarded(self, fn: Any, task_id: int, keys: list[bytes], buf: torch.Tensor) -> TaskResult:
        """Run a task; an unexpected exception (a bug) fails every key, loudly, instead of hanging the caller."""
        try:
            result: TaskResult = fn(task_id, keys, buf)
            return result
        except Exception:
            logger.exception(
                "Compress stage: task %d failed unexpectedly; reporting all %d keys failed", task_id, len(keys)
            )
            return TaskResult(len(keys), frozenset(range(len(keys))))

    def _encode(self, row: torch.Tensor) -> tuple[bytes, list[int], Mode]:
        assert self._codec is not None
        return encode_block(row, self._codec, self._geometry)

    def _dump_task(self, task_id: int, keys: list[bytes], src: torch.Tensor) -> TaskResult:
        t0 = time.perf_counter()
        n = len(keys)
        logger.debug("COMPRESS DUMP START | %d | %d blocks", task_id, n)
        todo = [i for i in range(n) if self._inner.lookup([keys[i]]) == 0]
        failed: set[int] = set()
        payloads: list[bytes | memoryview] = []
        codecs: list[int] = []
        written: list[int] = []
        # bf16 blocks only: an odd-sized row is not a bf16 block (stored raw, like other dtypes).
        if self._passthrough is not None or self._codec is None or src.shape[1] % 2:
            for i in todo:
                payloads.append(src[i].numpy().data.cast("B"))
                codecs.append(CODEC_RAW)
                written.append(i)
        else:
            jobs = [(i, self._pool.submit(self._encode, src[i])) for i in todo]
            for i, job in jobs:
                try:
                    container, sizes, used = job.result()
                except Exception:
                    if not self._error_logged:
                        self._error_logged = True
                        logger.exception("Compress stage: cannot encode block %s; not stored", keys[i].hex())
                    failed.add(i)
                    continue
                logger.debug("COMPRESS DUMP | %d | block %s | %s | shard sizes %s", task_id, keys[i].hex(), used, sizes)
                payloads.append(container)
                codecs.append(CODEC_KVFOLD)
                written.append(i)
                if self._codec == "int8" and not self._error_measured:
                    self._error_measured = True
                    self._log_error(src[i], container)
        raw_nbytes = len(written) * src.shape[1]
        stored_nbytes = sum(len(p) for p in payloads)
        if written:
            result = self._inner.wait(self._encoded.dump_encoded([keys[i] for i in written], payloads, codecs))
            failed.update(written[j] for j in result.failed)
        logger.debug(
            "COMPRESS DUMP END | %d | %d blocks encoded (%d already stored), %d -> %d bytes (%.3fx), %d failed, "
            "%.1f ms",
            task_id,
            len(written),
            n - len(todo),
            raw_nbytes,
            stored_nbytes,
            raw_nbytes / stored_nbytes if stored_nbytes else 0.0,
            len(failed),
            (time.perf_counter() - t0) * 1e3,
        )
        if self._recorder.enabled:
            stored = [j for j, i in enumerate(written) if i not in failed]
            self._recorder.record(
                Observation(
                    "dump",
                    "compress",
                    n,
                    n - len(failed),
                    len(stored) * src.shape[1],
                    stored_nbytes=sum(len(payloads[j]) for j in stored),
                    seconds=time.perf_counter() - t0,
                    requests=current_requests(),
                )
            )
        return TaskResult(n, frozenset(failed))

    def _log_error(self, row: torch.Tensor, container: bytes) -> None:
        """Log the relative RMS error of a fixed-rate block (once per store)."""
        decoded = torch.empty_like(row)
        decode_block(container, decoded)
        x = row.view(torch.bfloat16).float()
        err = (decoded.view(torch.bfloat16).float() - x).pow(2).mean().sqrt()
        rms = x.pow(2).mean().sqrt()
        logger.warning(
            "Compress stage: fixed_rate is LOSSY: measured on the first block dumped: RMS error %.3g = %.2f%% of "
            "the block's RMS %.3g",
            float(err),
            100 * float(err / rms) if rms > 0 else 0.0,
            float(rms),
        )

    def _start_load(self, task_id: int, keys: list[bytes], dst: torch.Tensor) -> Task:
        """Start one batched ``load_encoded`` of ``keys`` below, decoding into ``dst`` on the threads that read them;
        no coordinator thread waits for it (one per load would cap the blocks in flight at ``COORDINATORS``, below
        the Posix stage's I/O threads, when the Cache stage above loads its misses one block per call)."""
        t0 = time.perf_counter()
        n = len(keys)
        logger.debug("COMPRESS LOAD START | %d | %d blocks", task_id, n)
        stored = [0] * n
        requests = current_requests()

        def decode(i: int, block: EncodedBlock) -> str | None:  # on the thread below that read block i
            with self._decode_slots:
                reason, kind = decode_into(block, dst[i])
            if reason is not None:
                return reason  # the stage below keeps (foreign) or drops (damaged) the stored block
            stored[i] = len(block.payload)
            logger.debug(
                "COMPRESS LOAD | %d | block %s | %s | %d -> %d bytes",
                task_id,
                keys[i].hex(),
                kind,
                len(block.payload),
                dst.shape[1],
            )
            if kind == "int8" and self._codec != "int8" and not self._lossy_read_logged:
                self._lossy_read_logged = True
                logger.info("Compress stage: loaded blocks stored lossy (fixed_rate int8) by another configuration")
            return None

        read = self._encoded.load_encoded(keys, max_encoded_nbytes(dst.shape[1]), decode)
        future: Future[TaskResult] = Future()

        def finish(done: Task) -> None:
            try:
                result = done.result()
            except Exception:  # a bug below: fail every key, loudly, instead of hanging the caller
                logger.exception(
                    "Compress stage: load %d failed unexpectedly; reporting all %d keys failed", task_id, n
                )
                result = TaskResult(n, frozenset(range(n)))
            ok = n - len(result.failed)
            logger.debug(
                "COMPRESS LOAD END | %d | %d of %d blocks, %d -> %d bytes decompressed, %.1f ms",
                task_id,
                ok,
                n,
                sum(stored),
                ok * dst.shape[1],
                (time.perf_counter() - t0) * 1e3,
            )
            if self._recorder.enabled:
                self._recorder.record(
                    Observation(
                        "load",
                        "compress",
                        n,
                        ok,
                        ok * dst.shape[1],
                        stored_nbytes=sum(stored[i] for i in range(n) if i not in result.failed),
                        seconds=time.perf_counter() - t0,
                        requests=requests,
                    )
                )
            future.set_result(result)

        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._forget)
        read.add_done_callback(finish)
        return Task(future)


def check_compress_settings(mode: str, compress_ratio: int, data_type: int) -> None:
    """Validate the Compress stage's keys together.

    Raises:
        ValueError: naming the bad value and the allowed ones.
    """
    if mode not in COMPRESS_MODES:
        raise ValueError(f"compress_mode {mode!r} is not a mode; allowed: {', '.join(map(repr, COMPRESS_MODES))}")
    if data_type not in DATA_TYPES:
        raise ValueError(f"data_type {data_type!r} is not supported; allowed: 0 (bf16)")
    if mode == "fixed_rate":
        if compress_ratio not in FIXED_RATE_RATIOS:
            raise ValueError(
                f"compress_ratio {compress_ratio!r} is not a fixed rate this version builds; allowed with "
                f"compress_mode: fixed_rate: {sorted(FIXED_RATE_RATIOS)} (16 = 8 bits per value, lossy)"
            )
    elif compress_ratio != RATIO_OFF:
        raise ValueError(
            f"compress_ratio {compress_ratio!r} selects a lossy fixed rate, but compress_mode is {mode!r}; allowed: "
            f"compress_ratio: {RATIO_OFF} (the default) with compress_mode: {mode}, or compress_mode: fixed_rate with "
            f"compress_ratio in {sorted(FIXED_RATE_RATIOS)} to accept lossy KV"
        )
