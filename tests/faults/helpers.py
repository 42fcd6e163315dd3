"""Helpers of the fault suite (plain functions and constants; its fixtures are in ``tests/faults/conftest.py``).

Every serving-path fault runs the real vLLM engine (tiny float32 Llama, CPU) with the real connector on real files;
outcomes are compared with a no-cache run of the same prompts: greedy tokens equal and log-probs within
``LOGPROB_TOL`` (a wrong block moves them by ~1e-2; a correct load by ~1e-6).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.helpers import ucm_extra_config
from ucm.store.posix import block_file_path
from ucm.testing.engine import RequestResult, run_engine, ucm_transfer_config

BLOCK_SIZE = 128
PROMPT_TOKENS = 300  # 2 full blocks each
NUM_PROMPTS = 12
MAX_TOKENS = 8
INJECT_DIR = Path(__file__).parent / "inject"
# Root without the capabilities that bypass file permissions: permission bits apply to it as to any user.
NO_DAC_OVERRIDE = (
    "setpriv",
    "--bounding-set=-dac_override,-dac_read_search",
    "--inh-caps=-dac_override,-dac_read_search",
)


def engine_spec(
    model: Path,
    store: Path | str | None,
    prompts: Sequence[str | dict[str, Any]],
    kv_role: str = "kv_both",
    **store_config: Any,
) -> dict[str, Any]:
    """Engine spec: one request per prompt (a str, or a request dict), each after a prefix-cache reset so that
    hits come from UCM; ``store=None`` runs without a connector."""
    requests = [
        {"max_tokens": MAX_TOKENS, "reset_prefix_cache": True, **({"prompt": p} if isinstance(p, str) else p)}
        for p in prompts
    ]
    spec: dict[str, Any] = {"model": str(model), "dtype": "float32", "max_model_len": 2048, "requests": requests}
    if store is not None:
        extra = ucm_extra_config(store, store_config.pop("store_pipeline", "Cache|Posix"))
        extra["ucm_connectors"][0]["ucm_connector_config"].update(store_config)
        spec["connector"] = ucm_transfer_config(extra, kv_role)
    return spec


def copy_store(filled: tuple[Path, list[list[str]]], dst: Path) -> Path:
    """A private copy of the filled store at ``dst`` (file modes and times kept)."""
    shutil.copytree(filled[0], dst, copy_function=shutil.copy2)
    return dst


def block_path(store: Path, key_hex: str) -> Path:
    """Where the Posix store keeps ``key_hex``'s block under a single-directory ``store``."""
    return Path(block_file_path([str(store)], bytes.fromhex(key_hex)))


def wait_for_blocks_cmd(store: Path, n: int, timeout_s: float = 60) -> str:
    """Shell command that waits until ``store`` holds at least ``n`` block files (dumps finish asynchronously),
    failing after ``timeout_s``."""
    tries = int(timeout_s / 0.05)
    return (
        f"i=0; while [ $(find {store} -name '*.ucmb' ! -name '.*' 2>/dev/null | wc -l) -lt {n} ]; do "
        f"i=$((i+1)); [ $i -gt {tries} ] && echo 'timed out waiting for {n} blocks' >&2 && exit 1; sleep 0.05; done"
    )


def run_ucm(
    model: Path,
    store: Path | str,
    prompts: Sequence[str | dict[str, Any]],
    *,
    faults: dict[str, list[str]] | None = None,
    wrapper: Sequence[str] = (),
    kv_role: str = "kv_both",
    **store_config: Any,
) -> tuple[list[RequestResult], str]:
    """Run the prompts through an engine with UCM on ``store`` (UCM logging at debug level, for
    :func:`request_block_keys`); ``faults`` injects EIO (see inject/sitecustomize); ``wrapper`` prefixes the
    engine's command; ``store_config`` adds ``ucm_connector_config`` keys."""
    env: dict[str, str] = {"UC_LOGGER_LEVEL": "DEBUG"}
    if faults:
        env["UCM_TEST_FAULTS"] = json.dumps(faults)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(INJECT_DIR), os.environ.get("PYTHONPATH")]))
    return run_engine(engine_spec(model, store, prompts, kv_role, **store_config), env=env, wrapper=wrapper)


def block_files(store: Path) -> list[Path]:
    """The block files under ``store``."""
    return sorted(p for p in store.rglob("*.ucmb") if not p.name.startswith("."))


def temp_files(store: Path) -> list[Path]:
    """The temp files under ``store``."""
    return sorted(store.rglob(".*.tmp"))


def warnings_of(stderr: str, needle: str) -> list[str]:
    """UCM warning lines of ``stderr`` containing ``needle``."""
    return [ln for ln in stderr.splitlines() if "[UC][W]" in ln and needle in ln]


def can_drop_dac_override() -> bool:
    """True when ``setpriv`` can run a command without the permission-bypassing capabilities (and the test process
    is root, for whom that matters)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return False
    probe = subprocess.run([*NO_DAC_OVERRIDE, "true"], capture_output=True)
    return probe.returncode == 0


def request_block_keys(stderr: str) -> list[list[str]]:
    """Per request, in order, the hex keys of its blocks (rank 0), from UCM's debug log (``UC_LOGGER_LEVEL=DEBUG``)."""
    return [line.split("block keys:", 1)[1].split() for line in stderr.splitlines() if "block keys:" in line]
