"""UCM's metrics through vLLM's KV-connector stats API, on ``vllm serve``'s ``/metrics`` beside vLLM's own.

The path, in vLLM 0.32's processes:

1. The store stages and the scheduler side record :class:`~ucm.store.observe.Observation` s; a
   :class:`StatsCollector` (a recorder sink, one per connector) folds them into counters and latency samples.
2. Each step, vLLM asks the connector for its stats (``get_kv_connector_stats``): the worker's (loads, dumps, tier
   levels) travel to the engine core in the model runner's output (pickled), where vLLM aggregates them across
   workers and with the scheduler side's (lookups) through :meth:`UCMConnectorStats.aggregate`; ``to_dict()`` then
   crosses to the API server (msgpack) inside vLLM's scheduler stats.
3. There vLLM rebuilds them (``UCMConnector.build_kv_connector_stats``) for its periodic log line
   (:meth:`UCMConnectorStats.reduce`) and hands the dict to :class:`UCMPromMetrics` (``build_prom_metrics``), which
   updates the Prometheus metrics listed in :data:`METRICS`, labelled with vLLM's ``model_name`` and ``engine``
   labels plus ``tier`` (and ``cause``).

The payload (``UCMConnectorStats.data``) uses string keys, numbers and lists only, so it survives both pickle and
msgpack: ``{"counters": {metric: {labels: number}}, "gauges": {...}, "histograms": {metric: {labels: [seconds]}}}``
where ``labels`` is the label values joined by ``,`` (``""`` for none).

Stats reach vLLM at engine steps only: what finishes between steps (a write-back to storage that completes after a
request's last step, a garbage collection while idle) shows on ``/metrics`` after the next step.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from ucm.config import UcmConfig, UcmConfigError
from ucm.store.observe import Observation, Recorder
from ucm.store.traces import TraceWriter

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT

PREFIX = "vllm:ucm_"
# Latency histogram buckets, seconds (vLLM's latency metrics are in seconds).
LATENCY_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

Kind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True)
class MetricDef:
    """One UCM metric: its name after ``vllm:ucm_``, Prometheus kind, labels beyond vLLM's, unit and meaning."""

    name: str
    kind: Kind
    labels: tuple[str, ...]
    unit: str
    doc: str


# The metrics, in the order of the table in docs/operations.md (tests/observability checks that they agree).
METRICS: tuple[MetricDef, ...] = (
    MetricDef("lookups", "counter", (), "requests", "Requests whose prompt blocks the scheduler side looked up."),
    MetricDef(
        "lookup_blocks", "counter", (), "blocks", "Full prompt blocks looked up beyond vLLM's own prefix-cache hit."
    ),
    MetricDef("lookup_hit_blocks", "counter", (), "blocks", "Of those, blocks found in UCM (any tier)."),
    MetricDef("lookup_hit_tokens", "counter", (), "tokens", "Prompt tokens UCM offered vLLM instead of computing."),
    MetricDef("load_blocks", "counter", ("tier",), "blocks", "Blocks loads asked of the tier."),
    MetricDef("hit_blocks", "counter", ("tier",), "blocks", "Blocks the tier served to loads."),
    MetricDef("hit_tokens", "counter", ("tier",), "tokens", "Tokens of the blocks the tier served (x block size)."),
    MetricDef(
        "load_bytes",
        "counter",
        ("tier",),
        "bytes",
        "Bytes the tier handed up on loads (storage: file payload bytes; dram, compress: uncompressed).",
    ),
    MetricDef(
        "load_failures",
        "counter",
        ("tier", "cause"),
        "blocks",
        "Blocks that failed to load, by cause: missing, damaged, io_error, foreign, timeout (recomputed by vLLM).",
    ),
    MetricDef("load_seconds", "histogram", ("tier",), "seconds", "Time of one load call at the tier."),
    MetricDef(
        "dump_blocks", "counter", ("tier",), "blocks", "Blocks the tier stored (dram: copied in; already held: not)."
    ),
    MetricDef(
        "dump_bytes",
        "counter",
        ("tier",),
        "bytes",
        "Bytes of those blocks (storage: file payload bytes; dram, compress: uncompressed).",
    ),
    MetricDef("dump_failures", "counter", ("tier",), "blocks", "Blocks the tier failed to store (storage, compress)."),
    MetricDef("dump_seconds", "histogram", ("tier",), "seconds", "Time of one dump call at the tier."),
    MetricDef(
        "dump_deferred_blocks",
        "counter",
        (),
        "blocks",
        "Blocks whose dump a worker deferred to a later step: its dumps in flight were at their bound (store lags).",
    ),
    MetricDef(
        "used_bytes",
        "gauge",
        ("tier",),
        "bytes",
        "dram: bytes of cached blocks; storage: block files in the store's directories (last scan plus this "
        "process's writes since).",
    ),
    MetricDef(
        "capacity_bytes",
        "gauge",
        ("tier",),
        "bytes",
        "dram: cache_buffer_capacity_gb; storage: posix_capacity_gb (absent when unbounded).",
    ),
    MetricDef(
        "evicted_blocks",
        "counter",
        ("tier",),
        "blocks",
        "dram: blocks evicted (LRU) to make room; storage: block files deleted by garbage collection.",
    ),
    MetricDef("evicted_bytes", "counter", ("tier",), "bytes", "Bytes of those blocks."),
    MetricDef(
        "write_back_pending_blocks",
        "gauge",
        ("tier",),
        "blocks",
        "dram: blocks dumped into the DRAM tier and not yet written to the stage below (a kill loses them).",
    ),
    MetricDef("compress_raw_bytes", "counter", (), "bytes", "KVfold: uncompressed bytes of the blocks dumped."),
    MetricDef("compress_stored_bytes", "counter", (), "bytes", "KVfold: their compressed bytes."),
    MetricDef("compress_ratio", "gauge", (), "ratio", "KVfold: raw / stored bytes of the blocks dumped since start."),
)
_BY_NAME = {m.name: m for m in METRICS}
_SECTIONS = {"counter": "counters", "gauge": "gauges", "histogram": "histograms"}


def _empty() -> dict[str, Any]:
    return {"counters": {}, "gauges": {}, "histograms": {}}


@dataclass
class UCMConnectorStats(KVConnectorStats):
    """UCM's stats of one interval (see the module docstring for ``data``'s layout).

    ``aggregate`` sums counters, concatenates latency samples and keeps the other's gauges (the latest); it changes
    this object and returns it, as vLLM's accumulators expect.
    """

    def __post_init__(self) -> None:
        for section in ("counters", "gauges", "histograms"):
            self.data.setdefault(section, {})

    def reset(self) -> None:
        """Drop everything."""
        self.data = _empty()

    def is_empty(self) -> bool:
        """True when it holds no value."""
        return not any(self.data[s] for s in ("counters", "gauges", "histograms"))

    def add(self, metric: str, value: float, labels: str = "") -> None:
        """Add ``value`` to counter ``metric`` (a name of :data:`METRICS`) at ``labels``.

        Raises:
            KeyError: ``metric`` is not a counter of :data:`METRICS`.
        """
        if _BY_NAME[metric].kind != "counter":
            raise KeyError(f"{metric!r} is not a counter")
        row = self.data["counters"].setdefault(metric, {})
        row[labels] = row.get(labels, 0) + value

    def set(self, metric: str, value: float, labels: str = "") -> None:
        """Set gauge ``metric`` at ``labels``.

        Raises:
            KeyError: ``metric`` is not a gauge of :data:`METRICS`.
        """
        if _BY_NAME[metric].kind != "gauge":
            raise KeyError(f"{metric!r} is not a gauge")
        self.data["gauges"].setdefault(metric, {})[labels] = value

    def sample(self, metric: str, seconds: float, labels: str = "") -> None:
        """Add one latency sample (seconds) to histogram ``metric`` at ``labels``.

        Raises:
            KeyError: ``metric`` is not a histogram of :data:`METRICS`.
        """
        if _BY_NAME[metric].kind != "histogram":
            raise KeyError(f"{metric!r} is not a histogram")
        self.data["histograms"].setdefault(metric, {}).setdefault(labels, []).append(seconds)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Fold ``other`` (stats of another worker, the scheduler side or a later step) into this one.

        Raises:
            TypeError: ``other`` is not UCM's stats.
        """
        if not isinstance(other, UCMConnectorStats):
            raise TypeError(f"cannot aggregate UCMConnectorStats with {type(other).__name__}")
        for metric, row in other.data["counters"].items():
            mine = self.data["counters"].setdefault(metric, {})
            for labels, value in row.items():
                mine[labels] = mine.get(labels, 0) + value
        for metric, row in other.data["gauges"].items():
            self.data["gauges"].setdefault(metric, {}).update(row)
        for metric, row in other.data["histograms"].items():
            mine = self.data["histograms"].setdefault(metric, {})
            for labels, samples in row.items():
                mine.setdefault(labels, []).extend(samples)
        return self

    def reduce(self) -> dict[str, int | float]:
        """A flat summary for vLLM's periodic log line: every counter and gauge as ``metric[labels]``, and each
        latency histogram as its sample count and mean in ms."""
        out: dict[str, int | float] = {}

        def key(metric: str, labels: str) -> str:
            return f"ucm_{metric}[{labels}]" if labels else f"ucm_{metric}"

        for section in ("counters", "gauges"):
            for metric, row in self.data[section].items():
                for labels, value in row.items():
                    out[key(metric, labels)] = round(value, 3) if isinstance(value, float) else value
        for metric, row in self.data["histograms"].items():
            for labels, samples in row.items():
                out[key(metric, labels) + "_count"] = len(samples)
                out[key(metric, labels) + "_mean_ms"] = round(1e3 * sum(samples) / max(1, len(samples)), 3)
        return out


class StatsCollector:
    """Folds observations into :class:`UCMConnectorStats` until :meth:`take` (a recorder sink; thread-safe).

    Args:
        block_size: tokens per block (for the token counters).
    """

    def __init__(self, block_size: int) -> None:
        self._block_size = block_size
        self._lock = threading.Lock()
        self._stats = UCMConnectorStats()
        self._gauges: dict[str, float] = {}  # last levels and running totals taken
        self._raw = 0  # KVfold bytes since start: uncompressed / compressed
        self._stored = 0

    def observe(self, obs: Observation) -> None:
        """Count one observation (see :mod:`ucm.store.observe` for what each field means)."""
        with self._lock:
            s = self._stats
            if obs.op == "lookup":
                s.add("lookups", 1)
                s.add("lookup_blocks", obs.blocks)
                s.add("lookup_hit_blocks", obs.ok)
                s.add("lookup_hit_tokens", obs.tokens)
            elif obs.op == "load":
                s.add("load_blocks", obs.blocks, obs.tier)
                s.add("hit_blocks", obs.ok, obs.tier)
                s.add("hit_tokens", obs.ok * self._block_size, obs.tier)
                s.add("load_bytes", obs.nbytes, obs.tier)
                s.sample("load_seconds", obs.seconds, obs.tier)
            elif obs.op == "dump":
                s.add("dump_blocks", obs.ok, obs.tier)
                s.add("dump_bytes", obs.nbytes, obs.tier)
                if obs.tier != "dram":  # dram: blocks not copied were held already or did not fit, not failures
                    s.add("dump_failures", obs.blocks - obs.ok, obs.tier)
                s.sample("dump_seconds", obs.seconds, obs.tier)
                if obs.tier == "compress" and obs.stored_nbytes:
                    s.add("compress_raw_bytes", obs.nbytes)
                    s.add("compress_stored_bytes", obs.stored_nbytes)
                    self._raw += obs.nbytes
                    self._stored += obs.stored_nbytes
                    s.set("compress_ratio", self._raw / self._stored)
            elif obs.op == "load_failure":
                s.add("load_failures", obs.blocks, f"{obs.tier},{obs.cause}")
            elif obs.op == "dump_deferred":
                s.add("dump_deferred_blocks", obs.blocks)

    def take(self, gauges: Mapping[str, float] | None = None) -> UCMConnectorStats | None:
        """The stats since the last call (``None`` when there are none), with ``gauges`` (a store's
        :meth:`~ucm.store.base.UcmKVStoreBase.gauges`: ``<tier>:<metric>`` levels, and running totals ending in
        ``_total`` that become counter increments) where they changed."""
        with self._lock:
            s, self._stats = self._stats, UCMConnectorStats()
            for name, value in (gauges or {}).items():
                last = self._gauges.get(name)
                if last == value:
                    continue
                self._gauges[name] = value
                tier, _, metric = name.partition(":")
                if metric.endswith("_total"):
                    if value > (last or 0.0):
                        s.add(metric.removesuffix("_total"), value - (last or 0.0), tier)
                else:
                    s.set(metric, value, tier)
        return None if s.is_empty() else s


class UCMPromMetrics(KVConnectorPromMetrics):
    """The Prometheus metrics of :data:`METRICS`, named ``vllm:ucm_<name>``, labelled with vLLM's labels (model
    name, engine index) plus the metric's own; updated from each step's stats by :meth:`observe`."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._families: dict[str, Any] = {}
        for m in METRICS:
            kwargs: dict[str, Any] = {
                "name": PREFIX + m.name,
                "documentation": f"UCM: {m.doc} Unit: {m.unit}.",
                "labelnames": [*labelnames, *m.labels],
            }
            if m.kind == "counter":
                self._families[m.name] = self._counter_cls(**kwargs)
            elif m.kind == "gauge":
                self._families[m.name] = self._gauge_cls(**kwargs)
            else:
                histogram_cls: Any = self._histogram_cls  # typed by vLLM as any of the three kinds
                self._families[m.name] = histogram_cls(buckets=LATENCY_BUCKETS_S, **kwargs)
        self._children: dict[tuple[int, str, str], Any] = {}

    def _child(self, engine_idx: int, metric: str, labels: str) -> Any:
        key = (engine_idx, metric, labels)
        child = self._children.get(key)
        if child is None:
            values = [*self.per_engine_labelvalues[engine_idx], *(labels.split(",") if labels else [])]
            child = self._families[metric].labels(*values)
            self._children[key] = child
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Apply one step's stats (``UCMConnectorStats.data``) of engine ``engine_idx``; metrics this version does
        not know (a newer sender) are skipped."""
        for metric, row in transfer_stats_data.get("counters", {}).items():
            if metric in self._families:
                for labels, value in row.items():
                    if value > 0:
                        self._child(engine_idx, metric, labels).inc(value)
        for metric, row in transfer_stats_data.get("gauges", {}).items():
            if metric in self._families:
                for labels, value in row.items():
                    self._child(engine_idx, metric, labels).set(value)
        for metric, row in transfer_stats_data.get("histograms", {}).items():
            if metric in self._families:
                for labels, samples in row.items():
                    child = self._child(engine_idx, metric, labels)
                    for seconds in samples:
                        child.observe(seconds)


class Observability:
    """One connector's observation plumbing: a :class:`~ucm.store.observe.Recorder` feeding a
    :class:`StatsCollector` (unless ``enable_metrics: false``; :attr:`stats` is then ``None``) and, with
    ``enable_record_traces``, a :class:`~ucm.store.traces.TraceWriter`.

    Args:
        config: the UCM config (trace settings).
        block_size: tokens per block.
        role: ``scheduler`` or ``worker`` (the trace file's name).

    Raises:
        UcmConfigError: traces are on and their directory cannot be created or written (naming it).
    """

    def __init__(self, config: UcmConfig, block_size: int, role: str) -> None:
        self.recorder = Recorder()
        self.stats: StatsCollector | None = None
        if config.enable_metrics:
            self.stats = StatsCollector(block_size)
            self.recorder.add_sink(self.stats.observe)
        self.trace: TraceWriter | None = None
        if config.enable_record_traces:
            try:
                self.trace = TraceWriter(config.traces_dir, config.traces_max_bytes, role)
            except ValueError as exc:
                raise UcmConfigError(
                    f"enable_record_traces: {exc}; set record_traces_dir to a writable directory"
                ) from None
            self.recorder.add_sink(self.trace.write)

    def close(self) -> None:
        """Close the trace file, if any."""
        if self.trace is not None:
            self.trace.close()
