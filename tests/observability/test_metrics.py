"""UCM's KV-connector stats: folding observations, aggregation and reduction as vLLM does them, the payload's trip
through vLLM's own serializers (pickle to the engine core, msgpack to the API server), the Prometheus metrics, and
the metrics table in docs/operations.md."""

from __future__ import annotations

import functools
import pickle
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tests.integration.helpers import BLOCK_SIZE as SPEC_BLOCK_SIZE
from tests.integration.helpers import NAMESPACE, SPEC, fill_store, keys_of, make_request, tokens
from ucm.config import parse_config
from ucm.integration.vllm.metrics import (
    METRICS,
    PREFIX,
    Observability,
    StatsCollector,
    UCMConnectorStats,
    UCMPromMetrics,
)
from ucm.integration.vllm.scheduler import UCMScheduler
from ucm.integration.vllm.ucm_connector import UCMConnector
from ucm.store.observe import Observation
from ucm.store.pipeline import build_store

BLOCK_SIZE = 128
DOCS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def _worker_step() -> UCMConnectorStats:
    """A worker step: 3 DRAM hits of 5, 2 storage reads of which one damaged, a dump through Compress."""
    c = StatsCollector(BLOCK_SIZE)
    c.observe(Observation("load", "dram", 5, 3, 3000, seconds=0.001, requests=("r1",)))
    c.observe(Observation("load", "storage", 1, 1, 1000, seconds=0.004))
    c.observe(Observation("load", "storage", 1, 0, 0, seconds=0.002))
    c.observe(Observation("load_failure", "storage", 1, cause="damaged", key="ab" * 16))
    c.observe(Observation("dump", "dram", 4, 2, 2000, seconds=0.0005))
    c.observe(Observation("dump", "compress", 2, 2, 2000, stored_nbytes=1250, seconds=0.01))
    c.observe(Observation("dump", "storage", 2, 1, 625, seconds=0.008))
    gauges = {
        "dram:used_bytes": 2000.0,
        "dram:capacity_bytes": 4096.0,
        "dram:evicted_blocks_total": 3.0,
        "storage:evicted_blocks_total": 0.0,
    }
    stats = c.take(gauges)
    assert stats is not None
    return stats


def test_collector_folds_observations() -> None:
    data = _worker_step().data
    counters, gauges, hists = data["counters"], data["gauges"], data["histograms"]
    assert counters["load_blocks"] == {"dram": 5, "storage": 2}
    assert counters["hit_blocks"] == {"dram": 3, "storage": 1}
    assert counters["hit_tokens"] == {"dram": 3 * BLOCK_SIZE, "storage": BLOCK_SIZE}
    assert counters["load_failures"] == {"storage,damaged": 1}
    assert counters["dump_blocks"] == {"dram": 2, "compress": 2, "storage": 1}
    assert counters["dump_failures"] == {"compress": 0, "storage": 1}  # dram's uncopied blocks are not failures
    assert counters["compress_raw_bytes"] == {"": 2000} and counters["compress_stored_bytes"] == {"": 1250}
    assert gauges["compress_ratio"] == {"": 1.6}
    assert gauges["used_bytes"] == {"dram": 2000.0} and gauges["capacity_bytes"] == {"dram": 4096.0}
    assert counters["evicted_blocks"] == {"dram": 3.0}  # a running total: its first value is the increment
    assert "storage" not in counters["evicted_blocks"]  # zero: no increment
    assert hists["load_seconds"] == {"dram": [0.001], "storage": [0.004, 0.002]}


def test_take_sends_changes_only() -> None:
    c = StatsCollector(BLOCK_SIZE)
    gauges = {"dram:used_bytes": 10.0, "dram:evicted_blocks_total": 2.0}
    assert c.take(gauges) is not None
    assert c.take(gauges) is None  # nothing new: vLLM gets no stats object
    after = c.take({"dram:used_bytes": 10.0, "dram:evicted_blocks_total": 5.0})
    assert after is not None
    assert after.data["counters"] == {"evicted_blocks": {"dram": 3.0}}
    assert after.data["gauges"] == {}


def test_aggregate_and_reduce_as_vllm_does() -> None:
    # Two workers' steps aggregated (KVOutputAggregator), then the scheduler side's lookups (Scheduler).
    a, b = _worker_step(), _worker_step()
    lookups = StatsCollector(BLOCK_SIZE)
    lookups.observe(Observation("lookup", "all", 7, 5, seconds=0.0001, tokens=5 * BLOCK_SIZE, requests=("r1",)))
    scheduler_side = lookups.take()
    assert scheduler_side is not None
    total = a.aggregate(b)
    assert total is a
    total = total.aggregate(scheduler_side)
    assert isinstance(total, UCMConnectorStats)
    counters = total.data["counters"]
    assert counters["hit_blocks"] == {"dram": 6, "storage": 2}
    assert counters["lookup_hit_tokens"] == {"": 5 * BLOCK_SIZE}
    assert total.data["histograms"]["load_seconds"]["storage"] == [0.004, 0.002, 0.004, 0.002]
    reduced = total.reduce()
    assert reduced["ucm_hit_blocks[dram]"] == 6
    assert reduced["ucm_lookups"] == 1
    assert reduced["ucm_load_seconds[storage]_count"] == 4
    assert reduced["ucm_load_seconds[storage]_mean_ms"] == pytest.approx(3.0)
    assert not total.is_empty() and UCMConnectorStats().is_empty()
    total.reset()
    assert total.is_empty()
    with pytest.raises(TypeError, match="UCMConnectorStats"):
        total.aggregate(_OtherStats())
    with pytest.raises(KeyError, match="not a counter"):
        total.add("used_bytes", 1)


class _OtherStats(UCMConnectorStats.__mro__[1]):  # type: ignore[misc]  # vLLM's KVConnectorStats
    pass


def test_payload_survives_vllms_serializers() -> None:
    """Worker -> engine core: the stats object is pickled in the model runner's output; engine core -> API server:
    ``to_dict()`` rides in vLLM's SchedulerStats through its msgpack encoder; the API server rebuilds it with the
    connector's ``build_kv_connector_stats``."""
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    stats = _worker_step()
    pickled = pickle.loads(pickle.dumps(stats))
    assert isinstance(pickled, UCMConnectorStats) and pickled.data == stats.data

    outputs = EngineCoreOutputs(scheduler_stats=SchedulerStats(kv_connector_stats=stats.to_dict()))
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(outputs))
    payload = decoded.scheduler_stats.kv_connector_stats
    assert payload == stats.data
    rebuilt = UCMConnector.build_kv_connector_stats(payload)
    assert isinstance(rebuilt, UCMConnectorStats)
    assert rebuilt.reduce() == stats.reduce()
    assert isinstance(UCMConnector.build_kv_connector_stats(), UCMConnectorStats)


def test_multi_connector_rebuilds_ucm_stats_by_name() -> None:
    """Under vLLM's MultiConnector the API server rebuilds each sub-connector's stats by the connector's name alone
    (``KVConnectorFactory.get_connector_class_by_name``): UCM's vLLM plugin registers that name."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    from ucm.integration.vllm.plugin import CONNECTOR_NAME, register

    register()
    register()  # idempotent: vLLM calls it once per process, tests may call it again
    assert KVConnectorFactory.get_connector_class_by_name(CONNECTOR_NAME) is UCMConnector
    stats = _worker_step()
    rebuilt = MultiConnector.build_kv_connector_stats({CONNECTOR_NAME: stats.to_dict()})
    assert rebuilt is not None
    ucm = rebuilt.data[CONNECTOR_NAME]
    assert isinstance(ucm, UCMConnectorStats) and ucm.reduce() == stats.reduce()


def test_prometheus_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    labels = {"model_name": "m", "engine": "0"}
    prom = UCMPromMetrics(_FakeVllmConfig(), types, list(labels), {0: ["m", "0"]})  # type: ignore[arg-type]
    data = _worker_step().to_dict()
    prom.observe(data, 0)
    prom.observe(data, 0)  # counters add up, gauges are set

    def value(name: str, **extra: str) -> float | None:
        return registry.get_sample_value(PREFIX + name, {**labels, **extra})

    assert value("hit_blocks_total", tier="dram") == 6
    assert value("load_failures_total", tier="storage", cause="damaged") == 2
    assert value("used_bytes", tier="dram") == 2000
    assert value("compress_ratio") == 1.6
    assert value("load_seconds_count", tier="storage") == 4
    assert value("load_seconds_bucket", tier="storage", le="0.0025") == 2
    assert value("hit_blocks_total", tier="compress") is None  # never observed: no series
    prom.observe({"counters": {"from_a_newer_ucm": {"": 1}}}, 0)  # unknown metrics are skipped


class _FakeVllmConfig:
    kv_transfer_config = None


def test_docs_table_lists_every_metric() -> None:
    """docs/operations.md has one table row per metric, in :data:`METRICS`' order, with its kind and labels."""
    rows = re.findall(r"^\| `(vllm:ucm_[a-z_]+)` \| (counter|gauge|histogram) \| ([^|]*) \|", DOCS.read_text(), re.M)
    expected = []
    for m in METRICS:
        name = PREFIX + m.name + ("_total" if m.kind == "counter" else "")
        expected.append((name, m.kind, ", ".join(f"`{label}`" for label in m.labels) or "-"))
    assert [(n, k, lab.strip()) for n, k, lab in rows] == expected


def test_scheduler_records_each_requests_first_lookup(tmp_path: Path) -> None:
    """The scheduler side records one lookup per request (not per repeated call): blocks beyond vLLM's own hit,
    those found, the tokens offered; the connector's collector turns it into the lookup counters."""
    config = parse_config({"ucm_connectors": [{"ucm_connector_config": {"storage_backends": str(tmp_path / "kv")}}]})
    ids = tokens(4 * SPEC_BLOCK_SIZE + 9)
    fill_store(config, keys_of(ids)[:3])
    store = build_store(config.store)
    try:
        sched = UCMScheduler(config, SPEC, NAMESPACE, store, load=True, dump=True)
        obs = Observability(config, SPEC_BLOCK_SIZE, "scheduler")
        sched.recorder = obs.recorder
        seen: list[Observation] = []
        obs.recorder.add_sink(seen.append)
        request = make_request("r", ids)
        assert sched.get_num_new_matched_tokens(request, SPEC_BLOCK_SIZE) == (2 * SPEC_BLOCK_SIZE, False)
        sched.get_num_new_matched_tokens(request, SPEC_BLOCK_SIZE)  # not scheduled, asked again: not recorded
        (lookup,) = seen
        assert (lookup.op, lookup.tier, lookup.requests) == ("lookup", "all", ("r",))
        assert (lookup.blocks, lookup.ok, lookup.tokens) == (3, 2, 2 * SPEC_BLOCK_SIZE)  # one block was vLLM's
        stats = obs.stats.take()
        assert stats is not None
        assert stats.data["counters"]["lookup_hit_blocks"] == {"": 2}
        assert stats.data["counters"]["lookups"] == {"": 1}
    finally:
        store.close()
