"""Bad configuration at engine start: the real engine refuses to start with one clear error naming the key or the
path, the bad value and what is allowed (the full matrix of config errors is in ``tests/test_config.py``)."""

from __future__ import annotations

import pytest

from tests.faults.helpers import NO_DAC_OVERRIDE, can_drop_dac_override
from ucm.testing.engine import run_engine, ucm_transfer_config

pytestmark = pytest.mark.engine


def _start_error(model, extra_config: dict, wrapper=()) -> str:
    spec = {
        "model": str(model),
        "dtype": "float32",
        "max_model_len": 2048,
        "connector": ucm_transfer_config(extra_config),
        "requests": [{"prompt": "hello", "max_tokens": 1}],
    }
    with pytest.raises(RuntimeError) as err:
        run_engine(spec, wrapper=wrapper)
    return str(err.value)


def _store(storage_backends: str, **more) -> dict:
    config = {"store_pipeline": "Cache|Posix", "storage_backends": storage_backends, **more}
    return {"ucm_connectors": [{"ucm_connector_name": "UcmPipelineStore", "ucm_connector_config": config}]}


def test_missing_config_file(tiny_model, tmp_path):
    path = tmp_path / "nowhere" / "ucm.yaml"
    message = _start_error(tiny_model, {"UCM_CONFIG_FILE": str(path)})
    assert f"cannot read UCM config file '{path}' (UCM_CONFIG_FILE): No such file or directory" in message


def test_unreadable_config_file_and_unwritable_storage(tiny_model, tmp_path):
    if not can_drop_dac_override():
        pytest.skip("needs root and setpriv so that chmod really denies the engine")
    config = tmp_path / "ucm.yaml"
    config.write_text("use_layerwise: false\n")
    config.chmod(0)
    message = _start_error(tiny_model, {"UCM_CONFIG_FILE": str(config)}, wrapper=NO_DAC_OVERRIDE)
    assert f"cannot read UCM config file '{config}' (UCM_CONFIG_FILE): Permission denied" in message

    store = tmp_path / "store"
    store.mkdir(mode=0o500)
    message = _start_error(tiny_model, _store(str(store)), wrapper=NO_DAC_OVERRIDE)
    assert f"storage backend '{store}' is not writable" in message


def test_storage_backend_is_a_file_and_bad_values(tiny_model, tmp_path):
    regular = tmp_path / "regular"
    regular.write_text("x")
    message = _start_error(tiny_model, _store(str(regular)))
    assert f"storage backend '{regular}' exists and is not a directory" in message

    message = _start_error(tiny_model, _store(str(tmp_path / "kv"), posix_capacity_gb=-1, cache_buffer_capacity_gb="x"))
    assert "posix_capacity_gb" in message and "greater than 0" in message and "-1" in message
    assert "cache_buffer_capacity_gb" in message and "'x'" in message
