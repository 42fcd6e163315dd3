"""Transfer observations: what the store stages and the scheduler side record about lookups, loads and dumps.

One mechanism feeds both of UCM's outputs: each stage records an :class:`Observation` once, on the thread that
finished the transfer, into the :class:`Recorder` its connector gave it (:meth:`UcmKVStoreBase.set_recorder`); the
recorder hands it to its sinks, the metrics aggregator (``ucm.integration.vllm.metrics.StatsCollector``: vLLM's
``/metrics``) and, with ``enable_record_traces``, the trace writer (:mod:`ucm.store.traces`). A stage without a
recorder (the default) records nothing.

Tiers: ``dram`` (the ``Cache`` stage), ``compress`` (``Compress``), ``pool`` (``Mooncake``: loads and dumps of
raw blocks), ``storage`` (``Posix``); lookups of the whole pipeline (the scheduler side) are ``all``.

Residency (KV events): a stage also tells the recorder which block keys a tier starts or stops holding
(:meth:`Recorder.record_keys`: a dump's or promotion's new DRAM blocks, an eviction, a block file written, deleted by
garbage collection or found damaged). Only recorders with a key sink listen (:attr:`Recorder.tracks_keys`; the
connector adds one when vLLM publishes KV events, see :mod:`ucm.integration.vllm.events`); stages skip the work
otherwise.

Request ids: a caller names the requests a transfer serves with :func:`requests_of`; a stage reads them
(:func:`current_requests`) when its ``load``/``dump`` is called, on the caller's thread, so a stage called from
another thread (a write-back) sees them only when the thread was started in the caller's context
(``contextvars.copy_context().run``).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from ucm.logger import init_logger

logger = init_logger(__name__)

Tier = Literal["dram", "compress", "pool", "storage", "all"]
Op = Literal["lookup", "load", "dump", "load_failure", "dump_deferred"]
# Why a block failed to load (``load_failure`` observations): no file; a file failing verification; an I/O error;
# a file this version does not read (another format version, codec or block size), kept in place; a load abandoned
# past ``load_timeout_ms`` (tier ``all``: recorded by the worker, whichever stage was slow).
FAILURE_CAUSES = ("missing", "damaged", "io_error", "foreign", "timeout")
TIERS = ("dram", "compress", "pool", "storage")


@dataclass(frozen=True)
class Observation:
    """One lookup, load or dump as a tier saw it, or one failed block load.

    Attributes:
        op: ``lookup`` (scheduler side: a request's prompt blocks looked up, tier ``all``), ``load``, ``dump``,
            ``load_failure`` (one block that failed to load, with its ``cause``), or ``dump_deferred`` (a worker's
            step whose dump waits for a later step: its dumps in flight were at their bound; tier ``all``).
        tier: ``dram``, ``compress``, ``pool``, ``storage`` or ``all``.
        blocks: blocks asked of the tier (lookup: full prompt blocks beyond vLLM's own prefix-cache hit).
        ok: of those, blocks served (load, lookup: hits) or stored (dump).
        nbytes: bytes moved: a load's bytes handed to the caller, a dump's bytes taken from it (storage: block
            file payload bytes; compress: canonical, uncompressed bytes).
        stored_nbytes: compress only: the compressed bytes of the blocks counted in ``nbytes``.
        seconds: from the call to its completion (dram: the copies between DRAM and the caller's buffer).
        tokens: lookup only: tokens UCM offered vLLM.
        cause: load_failure only: one of :data:`FAILURE_CAUSES`.
        key: load_failure only: the block key, hex.
        requests: vLLM request ids of the transfer (a step's transfer may serve several), when known.
    """

    op: Op
    tier: Tier
    blocks: int
    ok: int = 0
    nbytes: int = 0
    stored_nbytes: int = 0
    seconds: float = 0.0
    tokens: int = 0
    cause: str | None = None
    key: str | None = None
    requests: tuple[str, ...] = ()


@dataclass(frozen=True)
class Residency:
    """Block keys a tier started (``stored``) or stopped holding.

    Attributes:
        stored: True: the tier now holds the keys' blocks; False: it no longer does (evicted, deleted, damaged).
        tier: ``dram`` or ``storage``.
        keys: 16-byte block keys as the tier stores them (per tensor-parallel rank).
    """

    stored: bool
    tier: Tier
    keys: tuple[bytes, ...]


Sink = Callable[[Observation], None]
KeySink = Callable[[Residency], None]


class Recorder:
    """Fans observations out to its sinks. Thread-safe; a sink that raises is logged once and kept.

    A recorder without sinks is disabled: stages skip building observations (:attr:`enabled`).
    """

    def __init__(self) -> None:
        self._sinks: tuple[Sink, ...] = ()
        self._key_sinks: tuple[KeySink, ...] = ()
        self._lock = threading.Lock()
        self._failed_logged = False

    @property
    def enabled(self) -> bool:
        """True when at least one sink listens."""
        return bool(self._sinks)

    @property
    def tracks_keys(self) -> bool:
        """True when a key sink listens (:meth:`record_keys` does something)."""
        return bool(self._key_sinks)

    def add_key_sink(self, sink: KeySink) -> None:
        """Hand every later :class:`Residency` to ``sink`` (called on the recording thread, possibly under a
        stage's lock: it must be thread-safe, quick, and must not call into a store)."""
        with self._lock:
            self._key_sinks = (*self._key_sinks, sink)

    def record_keys(self, stored: bool, tier: Tier, keys: Sequence[bytes]) -> None:
        """Tell the key sinks that ``tier`` started (``stored``) or stopped holding ``keys``. Never raises; does
        nothing for no keys or without key sinks."""
        if not keys or not self._key_sinks:
            return
        residency = Residency(stored, tier, tuple(keys))
        for sink in self._key_sinks:
            try:
                sink(residency)
            except Exception:
                if not self._failed_logged:
                    self._failed_logged = True
                    logger.exception("key sink %r failed (logged once)", sink)

    def add_sink(self, sink: Sink) -> None:
        """Hand every later observation to ``sink`` (called on the recording thread; must be thread-safe)."""
        with self._lock:
            self._sinks = (*self._sinks, sink)

    def record(self, observation: Observation) -> None:
        """Hand ``observation`` to every sink. Never raises."""
        for sink in self._sinks:
            try:
                sink(observation)
            except Exception:
                if not self._failed_logged:
                    self._failed_logged = True
                    logger.exception("observation sink %r failed (logged once)", sink)


# What stages hold until a connector gives them a recorder: no sinks, nothing recorded.
NO_RECORDER = Recorder()

_REQUESTS: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("ucm_requests", default=())


@contextlib.contextmanager
def requests_of(request_ids: Sequence[str]) -> Iterator[None]:
    """Within the block, transfers started on this thread (and threads started in its context) serve
    ``request_ids`` (their observations name them)."""
    token = _REQUESTS.set(tuple(dict.fromkeys(request_ids)))
    try:
        yield
    finally:
        _REQUESTS.reset(token)


def current_requests() -> tuple[str, ...]:
    """The request ids set by the innermost :func:`requests_of` of this context (empty outside one)."""
    return _REQUESTS.get()
