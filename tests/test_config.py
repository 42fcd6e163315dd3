"""UCM config: defaults, YAML loading, strict errors that name the key and the allowed values, extra_config forms."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

from ucm.config import (
    CONFIG_FILE_KEY,
    DEFAULT_STORAGE_DIR,
    GIB,
    UcmConfig,
    UcmConfigError,
    UcmConnectorEntry,
    UcmPipelineStoreConfig,
    config_from_extra_config,
    load_config_file,
    parse_config,
)

# The design's example (module docstring of ucm.config / examples/ucm_config_example.yaml).
DESIGN_EXAMPLE_YAML = """\
ucm_connectors:
  - ucm_connector_name: "UcmPipelineStore"
    ucm_connector_config:
      store_pipeline: "Cache|Posix"
      storage_backends: "/mnt/kv"        # one directory, or several joined by ':'
      cache_buffer_capacity_gb: 64
enable_event_sync: true
use_layerwise: false
"""


def write_yaml(tmp_path: Path, text: str, name: str = "ucm.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def store_cfg(**store: Any) -> dict[str, Any]:
    """A top-level config mapping whose single store entry has the keys ``store``."""
    return {"ucm_connectors": [{"ucm_connector_name": "UcmPipelineStore", "ucm_connector_config": store}]}


def config_error(data: Any) -> str:
    with pytest.raises(UcmConfigError) as info:
        parse_config(data)
    return str(info.value)


# -- defaults --------------------------------------------------------------------------------------------------------


def test_defaults_filled_in() -> None:
    cfg = parse_config({})
    assert cfg == parse_config(None)
    assert cfg.store.store_pipeline == "Cache|Posix"
    assert cfg.store.storage_backends == DEFAULT_STORAGE_DIR
    assert cfg.store.storage_dirs == [DEFAULT_STORAGE_DIR]
    assert cfg.store.cache_buffer_capacity_gb == 4.0
    assert cfg.store.cache_buffer_capacity_bytes == 4 * GIB
    assert cfg.use_layerwise is False
    assert cfg.enable_event_sync is True


def test_to_log_dict_has_every_key() -> None:
    log = parse_config({}).to_log_dict()
    assert set(log) == set(UcmConfig.model_fields)
    assert len(log["ucm_connectors"]) == 1
    entry = log["ucm_connectors"][0]
    assert set(entry) == set(UcmConnectorEntry.model_fields)
    assert entry["ucm_connector_name"] == "UcmPipelineStore"
    assert set(entry["ucm_connector_config"]) == set(UcmPipelineStoreConfig.model_fields)
    # Plain, JSON-able values only (it goes into a log line).
    assert entry["ucm_connector_config"]["store_pipeline"] == "Cache|Posix"


def test_partial_store_config_fills_the_rest() -> None:
    cfg = parse_config(store_cfg(store_pipeline="Posix"))
    assert cfg.store.store_pipeline == "Posix"
    assert cfg.store.posix_io_threads == UcmPipelineStoreConfig.model_fields["posix_io_threads"].default
    assert cfg.store.storage_backends == DEFAULT_STORAGE_DIR


# -- YAML files ------------------------------------------------------------------------------------------------------


def test_design_example_yaml(tmp_path: Path) -> None:
    cfg = load_config_file(write_yaml(tmp_path, DESIGN_EXAMPLE_YAML))
    assert cfg.store.store_pipeline == "Cache|Posix"
    assert cfg.store.storage_dirs == ["/mnt/kv"]
    # YAML writes 64 as an int; the float field accepts it.
    assert cfg.store.cache_buffer_capacity_gb == 64.0
    assert cfg.store.cache_buffer_capacity_bytes == 64 * GIB
    assert cfg.enable_event_sync is True
    assert cfg.use_layerwise is False


def test_yaml_posix_pipeline_and_several_dirs(tmp_path: Path) -> None:
    path = write_yaml(
        tmp_path,
        """\
        ucm_connectors:
          - ucm_connector_config:
              store_pipeline: "Posix"
              storage_backends: "/a:/b/c::/d"
              posix_io_threads: 3
              cache_buffer_capacity_gb: 0.5
        """,
    )
    cfg = load_config_file(str(path))
    assert cfg.store.store_pipeline == "Posix"
    assert cfg.store.storage_dirs == ["/a", "/b/c", "/d"]  # empty entries between ':' are skipped
    assert cfg.store.posix_io_threads == 3
    assert cfg.store.cache_buffer_capacity_bytes == GIB // 2


def test_empty_yaml_file_gives_defaults(tmp_path: Path) -> None:
    assert load_config_file(write_yaml(tmp_path, "")) == parse_config({})


@pytest.mark.parametrize(
    ("backends", "dirs"),
    [
        ("/mnt/kv", ["/mnt/kv"]),
        ("/mnt/a:/mnt/b", ["/mnt/a", "/mnt/b"]),
        ("rel/x:/abs/y:", ["rel/x", "/abs/y"]),
    ],
    ids=["one", "two", "trailing-colon"],
)
def test_storage_dirs_split_on_colon(backends: str, dirs: list[str]) -> None:
    assert parse_config(store_cfg(storage_backends=backends)).store.storage_dirs == dirs


# -- errors name the key and what is allowed -------------------------------------------------------------------------


def test_unknown_top_level_key() -> None:
    msg = config_error({"use_layerwize": False})
    assert "use_layerwize" in msg
    for key in UcmConfig.model_fields:
        assert key in msg


def test_unknown_store_key() -> None:
    msg = config_error(store_cfg(storage_backend="/mnt/kv"))
    assert "'storage_backend'" in msg
    assert "ucm_connectors[0].ucm_connector_config" in msg
    for key in UcmPipelineStoreConfig.model_fields:
        assert key in msg


def test_unknown_connector_entry_key() -> None:
    msg = config_error({"ucm_connectors": [{"ucm_connector_nmae": "UcmPipelineStore"}]})
    assert "ucm_connector_nmae" in msg
    for key in UcmConnectorEntry.model_fields:
        assert key in msg


def test_wrong_type() -> None:
    msg = config_error({"use_layerwise": "yes"})
    assert "use_layerwise" in msg
    assert "'yes'" in msg
    assert "boolean" in msg


@pytest.mark.parametrize(
    "pipeline", ["Disk", "Cache", "Posix|Cache", ""], ids=["disk", "cache-only", "reversed", "empty"]
)
def test_unsupported_pipeline(pipeline: str) -> None:
    msg = config_error(store_cfg(store_pipeline=pipeline))
    assert "store_pipeline" in msg
    assert repr(pipeline) in msg
    assert "'Cache|Posix'" in msg and "'Posix'" in msg


@pytest.mark.parametrize("pipeline", ["Cache|Compress|Posix", "Compress|Posix"])
def test_compress_pipelines_lossless_by_default(pipeline: str) -> None:
    store = parse_config(store_cfg(store_pipeline=pipeline)).store
    assert store.store_pipeline == pipeline
    assert (store.compress_mode, store.compress_ratio, store.data_type) == ("lossless", 32, 0)


def test_compress_fixed_rate_16_accepted() -> None:
    store = parse_config(
        store_cfg(store_pipeline="Cache|Compress|Posix", compress_mode="fixed_rate", compress_ratio=16)
    ).store
    assert (store.compress_mode, store.compress_ratio) == ("fixed_rate", 16)


def test_seed_ratio_16_without_fixed_rate_is_refused() -> None:
    # The seeds' "compress_ratio: 16" alone would silently be lossy: refused, naming the opt-in.
    msg = config_error(store_cfg(store_pipeline="Cache|Compress|Posix", compress_ratio=16))
    assert "compress_ratio 16" in msg and "'lossless'" in msg
    assert "compress_mode: fixed_rate" in msg and "[16]" in msg


@pytest.mark.parametrize("ratio", [32, 8, 20], ids=["off", "8", "20"])
def test_fixed_rate_needs_a_built_ratio(ratio: int) -> None:
    msg = config_error(store_cfg(store_pipeline="Compress|Posix", compress_mode="fixed_rate", compress_ratio=ratio))
    assert f"compress_ratio {ratio}" in msg and "[16]" in msg


def test_compress_mode_and_data_type_values() -> None:
    msg = config_error(store_cfg(store_pipeline="Compress|Posix", compress_mode="zip"))
    assert "compress_mode" in msg and "'zip'" in msg and "'lossless'" in msg and "'fixed_rate'" in msg
    msg = config_error(store_cfg(store_pipeline="Compress|Posix", data_type=1))
    assert "data_type 1" in msg and "allowed: 0 (bf16)" in msg
    assert parse_config(store_cfg(store_pipeline="Compress|Posix", compress_mode="off")).store.compress_mode == "off"


def test_pipeline_spaces_are_normalized() -> None:
    assert parse_config(store_cfg(store_pipeline=" Cache | Posix ")).store.store_pipeline == "Cache|Posix"


def test_layerwise_accepted() -> None:
    assert parse_config({"use_layerwise": True}).use_layerwise is True
    assert parse_config({"use_layerwise": False}).use_layerwise is False


def test_reset_clears_storage_is_off_by_default_and_a_boolean() -> None:
    assert parse_config({}).reset_clears_storage is False
    assert parse_config({"reset_clears_storage": True}).reset_clears_storage is True
    for value in ("yes", 1, None):
        message = config_error({"reset_clears_storage": value})
        assert "reset_clears_storage: not a boolean; allowed: false (a reset empties the DRAM tier" in message
        assert f"(got {value!r})" in message


def test_load_timeout_ms() -> None:
    assert parse_config({}).load_timeout_ms == 10000.0
    assert parse_config({}).load_timeout_s == 10.0
    assert parse_config({"load_timeout_ms": 1500}).load_timeout_s == 1.5  # YAML's int is taken as a number
    assert parse_config({"load_timeout_ms": 0.5}).load_timeout_ms == 0.5
    for value, allowed in [
        (0, "greater than 0"),
        (-5, "greater than 0"),
        ("10s", "a valid number"),
        (True, "a valid number"),
        (None, "a valid number"),
        (float("inf"), "a finite number"),
        (float("nan"), "a finite number"),
    ]:
        message = config_error({"load_timeout_ms": value})
        assert "load_timeout_ms" in message and allowed in message, message
        assert f"(got {float(value) if isinstance(value, int) and not isinstance(value, bool) else value!r})" in message


def test_record_traces_keys() -> None:
    config = parse_config({"enable_record_traces": True, "record_traces_max_mb": 2})
    assert config.enable_record_traces is True
    assert config.traces_max_bytes == 2 << 20
    assert config.traces_dir == str(Path(DEFAULT_STORAGE_DIR) / "traces")
    assert parse_config({"enable_record_traces": True, "record_traces_dir": "/tmp/t"}).traces_dir == "/tmp/t"
    assert parse_config({}).enable_record_traces is False
    # Trace settings without traces are refused, naming the switch.
    message = config_error({"record_traces_dir": "/tmp/t"})
    assert "record_traces_dir" in message and "enable_record_traces: true" in message
    assert "record_traces_max_mb" in config_error({"enable_record_traces": True, "record_traces_max_mb": 0})


def test_io_direct_accepted() -> None:
    assert config_from_extra_config(store_cfg(io_direct=True)).store.io_direct is True
    assert "io_direct" in config_error(store_cfg(io_direct="yes"))


def test_posix_io_engine_psync_or_aio() -> None:
    assert config_from_extra_config(store_cfg()).store.posix_io_engine == "psync"
    assert config_from_extra_config(store_cfg(posix_io_engine="aio")).store.posix_io_engine == "aio"
    msg = config_error(store_cfg(posix_io_engine="libaio"))
    assert "posix_io_engine" in msg and "'libaio'" in msg
    assert "'psync'" in msg and "'aio'" in msg


def test_posix_io_engine_aio_with_io_direct_accepted() -> None:
    store = config_from_extra_config(store_cfg(posix_io_engine="aio", io_direct=True)).store
    assert store.posix_io_engine == "aio" and store.io_direct is True


@pytest.mark.parametrize(
    ("key", "value"),
    [("compress_ratio", 8), ("data_type", 1), ("decompress_thread_num", 2), ("compress_mode", "off")],
    ids=lambda v: str(v),
)
def test_compress_keys_need_compress_stage(key: str, value: Any) -> None:
    msg = config_error(store_cfg(store_pipeline="Cache|Posix", **{key: value}))
    assert key in msg
    assert "Compress" in msg
    assert "'Cache|Posix'" in msg


def test_compress_keys_at_default_are_accepted() -> None:
    assert parse_config(store_cfg(compress_ratio=32, data_type=0)).store.compress_ratio == 32


@pytest.mark.parametrize("backends", ["", ":", "::"], ids=["empty", "colon", "two-colons"])
def test_empty_storage_backends(backends: str) -> None:
    msg = config_error(store_cfg(storage_backends=backends))
    assert "storage_backends" in msg
    assert repr(backends) in msg


@pytest.mark.parametrize("capacity", [0, 0.0, -1, -2.5], ids=["int-zero", "float-zero", "int-neg", "float-neg"])
def test_capacity_must_be_positive(capacity: float) -> None:
    msg = config_error(store_cfg(cache_buffer_capacity_gb=capacity))
    assert "cache_buffer_capacity_gb" in msg
    assert "greater than 0" in msg


def test_capacity_bool_is_not_a_number() -> None:
    assert "cache_buffer_capacity_gb" in config_error(store_cfg(cache_buffer_capacity_gb=True))


def test_cache_prefault_defaults_off_and_accepts_up_to_the_capacity() -> None:
    assert UcmPipelineStoreConfig().cache_prefault_bytes == 0
    cfg = parse_config(store_cfg(cache_buffer_capacity_gb=2, cache_prefault_gb=2)).store
    assert cfg.cache_prefault_gb == 2.0 and cfg.cache_prefault_bytes == 2 * GIB  # a YAML int is taken as float
    assert parse_config(store_cfg(store_pipeline="Cache|Compress|Posix", cache_prefault_gb=0.5)).store.cache_prefault_gb


@pytest.mark.parametrize(
    ("cfg", "expected"),
    [
        ({"cache_prefault_gb": -1}, "greater than or equal to 0"),
        (
            {"cache_buffer_capacity_gb": 1, "cache_prefault_gb": 1.5},
            "cache_prefault_gb 1.5 exceeds cache_buffer_capacity_gb 1.0; allowed: 0 to 1.0",
        ),
        (
            {"store_pipeline": "Posix", "cache_prefault_gb": 1},
            "cache_prefault_gb 1.0 needs a Cache stage; store_pipeline is 'Posix'",
        ),
    ],
    ids=["negative", "above-capacity", "no-cache-stage"],
)
def test_cache_prefault_errors(cfg: dict[str, Any], expected: str) -> None:
    msg = config_error(store_cfg(**cfg))
    assert "cache_prefault_gb" in msg and expected in msg


@pytest.mark.parametrize("n", [0, 2], ids=["none", "two"])
def test_exactly_one_connector(n: int) -> None:
    msg = config_error({"ucm_connectors": [{} for _ in range(n)]})
    assert "ucm_connectors" in msg
    assert f"has {n} entries" in msg
    assert "exactly 1" in msg


def test_unknown_connector_name() -> None:
    msg = config_error({"ucm_connectors": [{"ucm_connector_name": "UcmNfsStore"}]})
    assert "ucm_connector_name" in msg
    assert "UcmPipelineStore" in msg


def test_several_errors_reported_together() -> None:
    msg = config_error({"use_layerwise": "no", "bogus": 1})
    assert "use_layerwise" in msg
    assert "bogus" in msg


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nope" / "ucm.yaml"
    with pytest.raises(UcmConfigError) as info:
        load_config_file(path)
    assert str(path) in str(info.value)
    assert CONFIG_FILE_KEY in str(info.value)


def test_invalid_yaml(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "ucm_connectors: [\n  - {store_pipeline: Posix\n")
    with pytest.raises(UcmConfigError) as info:
        load_config_file(path)
    assert str(path) in str(info.value)
    assert "not valid YAML" in str(info.value)


def test_top_level_list(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "- use_layerwise: false\n")
    with pytest.raises(UcmConfigError) as info:
        load_config_file(path)
    assert "mapping" in str(info.value)
    assert "list" in str(info.value)
    assert str(path) in str(info.value)


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "record_traces_max_mb: 1\n")
    with pytest.raises(UcmConfigError) as info:
        load_config_file(path)
    assert str(path) in str(info.value)
    assert "record_traces_max_mb" in str(info.value)


# -- kv_connector_extra_config ---------------------------------------------------------------------------------------


def test_extra_config_file_form(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, DESIGN_EXAMPLE_YAML)
    cfg = config_from_extra_config({CONFIG_FILE_KEY: str(path)})
    assert cfg == load_config_file(path)
    assert cfg.store.cache_buffer_capacity_gb == 64.0
    assert config_from_extra_config({CONFIG_FILE_KEY: path}) == cfg  # a PathLike works too


def test_extra_config_inline_form() -> None:
    cfg = config_from_extra_config(store_cfg(store_pipeline="Posix", storage_backends="/x:/y"))
    assert cfg.store.store_pipeline == "Posix"
    assert cfg.store.storage_dirs == ["/x", "/y"]


def test_extra_config_inline_errors_name_the_source() -> None:
    with pytest.raises(UcmConfigError, match="kv_connector_extra_config") as info:
        config_from_extra_config({"use_layerwise": "yes"})
    assert "use_layerwise" in str(info.value)


def test_extra_config_file_and_inline_is_an_error(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, DESIGN_EXAMPLE_YAML)
    with pytest.raises(UcmConfigError) as info:
        config_from_extra_config({CONFIG_FILE_KEY: str(path), "use_layerwise": False})
    assert CONFIG_FILE_KEY in str(info.value)
    assert "use_layerwise" in str(info.value)


def test_extra_config_file_path_must_be_a_string() -> None:
    with pytest.raises(UcmConfigError, match=CONFIG_FILE_KEY):
        config_from_extra_config({CONFIG_FILE_KEY: 42})


def test_extra_config_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "missing.yaml"
    with pytest.raises(UcmConfigError, match=r"missing\.yaml"):
        config_from_extra_config({CONFIG_FILE_KEY: str(path)})


@pytest.mark.parametrize("extra", [None, {}], ids=["none", "empty"])
def test_extra_config_empty_gives_defaults(extra: dict[str, Any] | None) -> None:
    cfg = config_from_extra_config(extra)
    assert cfg == parse_config({})
    assert cfg.store.store_pipeline == "Cache|Posix"
    assert cfg.store.storage_dirs == [DEFAULT_STORAGE_DIR]


def test_extra_config_is_not_mutated(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, DESIGN_EXAMPLE_YAML)
    extra = {CONFIG_FILE_KEY: str(path)}
    config_from_extra_config(extra)
    assert extra == {CONFIG_FILE_KEY: str(path)}


# -- the Mooncake stage's settings -----------------------------------------------------------------------------------

MOONCAKE_JSON = '{"metadata_server": "P2PHANDSHAKE", "protocol": "tcp", "device_name": "",\n'
MOONCAKE_JSON += ' "master_server_address": "127.0.0.1:50088", "global_segment_size": 107374182400}'


def test_mooncake_section_inline_with_sizes_in_units() -> None:
    store = parse_config(
        store_cfg(
            store_pipeline="Cache|Mooncake|Posix",
            mooncake={"master_server_address": "10.0.0.1:50088", "global_segment_size": "4GB", "local_buffer_size": 0},
        )
    ).store
    assert store.mooncake is not None
    assert store.mooncake.global_segment_size == 4 * GIB
    assert store.mooncake.local_buffer_size == 0
    assert (store.mooncake.protocol, store.mooncake.metadata_server) == ("tcp", "P2PHANDSHAKE")


def test_mooncake_json_from_the_key_and_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(MOONCAKE_JSON)  # the seeds' template, as users copy it
    store = parse_config(store_cfg(store_pipeline="Mooncake|Posix", mooncake_config_path=str(path))).store
    assert store.mooncake is not None and store.mooncake.global_segment_size == 100 * GIB
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(path))
    store = parse_config(store_cfg(store_pipeline="Cache|Mooncake")).store
    assert store.mooncake is not None and store.mooncake.master_server_address == "127.0.0.1:50088"
    # An inline section wins over the environment variable; the hostname falls back to VLLM_HOST_IP.
    monkeypatch.setenv("VLLM_HOST_IP", "10.1.2.3")
    store = parse_config(store_cfg(store_pipeline="Mooncake", mooncake={"master_server_address": "h:1"})).store
    assert store.mooncake is not None and store.mooncake.master_server_address == "h:1"
    assert store.mooncake.hostname == "10.1.2.3"


@pytest.mark.parametrize(
    ("store", "expected"),
    [
        ({"store_pipeline": "Cache|Mooncake"}, "has a Mooncake stage but no Mooncake settings"),
        ({"store_pipeline": "Posix", "mooncake": {"master_server_address": "h:1"}}, "only for a pipeline with a Moon"),
        ({"store_pipeline": "Mooncake", "mooncake": {"master_server_address": "h"}}, "'h' is not host:port"),
        ({"store_pipeline": "Mooncake", "mooncake_config_path": "/nonexistent/mooncake.json"}, "No such file"),
        (
            {"store_pipeline": "Mooncake", "mooncake": {"master_server_address": "h:1", "global_segment_size": 4096}},
            "global_segment_size 4096 bytes is too small; allowed: 0 (no segment) or at least 16777216",
        ),
        (
            {"store_pipeline": "Mooncake", "mooncake": {"master_server_address": "h:1", "global_segment_size": "lots"}},
            "'lots' is not a size",
        ),
        (
            {"store_pipeline": "Mooncake", "mooncake": {"master_server_address": "h:1", "protcol": "tcp"}},
            "unknown key 'protcol' in ucm_connectors[0].ucm_connector_config.mooncake; valid keys: device_name",
        ),
        (
            {"store_pipeline": "Mooncake", "mooncake": {"master_server_address": "h:1"}, "mooncake_config_path": "x"},
            "give the settings inline or the file, not both",
        ),
    ],
)
def test_mooncake_errors(store: dict[str, Any], expected: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    assert expected in config_error(store_cfg(**store))


def test_mooncake_json_that_is_not_json(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text("{master_server_address: 1")
    msg = config_error(store_cfg(store_pipeline="Mooncake", mooncake_config_path=str(path)))
    assert f"the Mooncake config file {str(path)!r} (mooncake_config_path) is not valid JSON" in msg
