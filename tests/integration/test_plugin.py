"""UCM's ``vllm.general_plugins`` hook never stops a vLLM process that does not use UCM: vLLM loads every installed
plugin in every process, so a bad ``UC_LOGGER_LEVEL`` is one warning there (the level falls back to info), while the
connector refuses it at start, where UCM is actually configured.

The plugin is loaded by vLLM's own plugin loading (``vllm.plugins.load_general_plugins``) in a real subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ucm.testing.plugin import plugin_env

REPO_ROOT = Path(__file__).resolve().parents[2]
ALLOWED = "['debug', 'error', 'info', 'warning']"

_LOAD_PLUGINS = textwrap.dedent(
    """
    import logging
    from vllm.plugins import load_general_plugins
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    load_general_plugins()
    assert "UCMConnector" in KVConnectorFactory._registry, "UCM's plugin did not run"
    print("level", logging.getLevelName(logging.getLogger("ucm").getEffectiveLevel()))
    """
)


def _run(code: str, level: str | None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **plugin_env(), "VLLM_PLUGINS": "ucm_sparse"}
    env.pop("UC_LOGGER_LEVEL", None)
    if level is not None:
        env["UC_LOGGER_LEVEL"] = level
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("level", ["verbose"])
def test_bad_level_is_a_warning_where_plugins_load(level):
    proc = _run(_LOAD_PLUGINS, level)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "level INFO"
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("[UC][W]")]
    assert warnings == [f"[UC][W] UC_LOGGER_LEVEL={level!r} is not a log level; allowed: {ALLOWED}; using info"]


@pytest.mark.parametrize(("level", "name"), [("Warning", "WARNING")])
def test_good_level_is_taken_without_warning(level, name):
    proc = _run(_LOAD_PLUGINS, level)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == f"level {name}"
    assert "[UC][W]" not in proc.stderr


@pytest.mark.parametrize("level", ["verbose", "2", "trace", "info2"])
def test_connector_refuses_a_bad_level(monkeypatch, level):
    """Where UCM is configured, the connector's start refuses the value (``check_level_env``), naming it and the
    allowed ones."""
    from ucm.logger import check_level_env

    monkeypatch.setenv("UC_LOGGER_LEVEL", level)
    with pytest.raises(ValueError, match=rf"UC_LOGGER_LEVEL='{level}' is not a log level; allowed: \['debug'"):
        check_level_env()


@pytest.mark.parametrize("level", ["debug", "INFO", " Warning ", "error", ""])
def test_connector_takes_a_level(monkeypatch, level):
    from ucm.logger import check_level_env

    monkeypatch.setenv("UC_LOGGER_LEVEL", level)
    check_level_env()
