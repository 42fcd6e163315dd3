"""Fixtures of the fault suite: distinct real-text prompts, their no-cache outputs, and UCM engine runs.

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

import pytest

from tests.conftest import assert_same_output, ucm_extra_config
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


@pytest.fixture(scope="session")
def fault_prompts(tokenizer) -> list[str]:
    """``NUM_PROMPTS`` prompts of disjoint real text, ~``PROMPT_TOKENS`` tokens each (no shared prefix)."""
    from ucm.testing.texts import prompt_of_tokens

    text = prompt_of_tokens(tokenizer, PROMPT_TOKENS * NUM_PROMPTS + 50)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return [tokenizer.decode(ids[i * PROMPT_TOKENS : (i + 1) * PROMPT_TOKENS]) for i in range(NUM_PROMPTS)]


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


@pytest.fixture(scope="session")
def baseline(tiny_model, fault_prompts) -> list[RequestResult]:
    """No-cache outputs of every fault prompt (the reference every fault outcome must equal)."""
    results, _ = run_engine(engine_spec(tiny_model, None, fault_prompts))
    return results


@pytest.fixture(scope="session")
def filled_store(tiny_model, fault_prompts, baseline, tmp_path_factory) -> tuple[Path, list[list[str]]]:
    """A store filled by a cold UCM engine with every fault prompt, and each prompt's block keys (hex). Tests
    copy it before changing it. The cold run's outputs equal the no-cache run's (nothing was loaded)."""
    store = tmp_path_factory.mktemp("filled_store")
    results, stderr = run_ucm(tiny_model, store, fault_prompts)
    assert [r.hit_external for r in results] == [0] * NUM_PROMPTS
    for got, want in zip(results, baseline, strict=True):
        assert_same_output(got, want)
    keys = request_block_keys(stderr)
    assert [len(k) for k in keys] == [2] * NUM_PROMPTS
    assert len(block_files(store)) == 2 * NUM_PROMPTS
    return store, keys


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


@pytest.fixture
def mounted(tmp_path):
    """Mount helper: ``mounted(kind, path, ...)`` mounts a real filesystem at ``path`` (needs root's mount right);
    every mount is lazily unmounted at teardown. Skips the test with the reason when mounting is refused."""
    mounts: list[Path] = []

    def mount(args: Sequence[str], target: Path) -> None:
        target.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(["mount", *args, str(target)], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount {args} on {target}: {proc.stderr.strip()} (needs root with CAP_SYS_ADMIN)")
        mounts.append(target)

    yield mount
    for target in reversed(mounts):
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


def request_block_keys(stderr: str) -> list[list[str]]:
    """Per request, in order, the hex keys of its blocks (rank 0), from UCM's debug log (``UC_LOGGER_LEVEL=DEBUG``)."""
    return [line.split("block keys:", 1)[1].split() for line in stderr.splitlines() if "block keys:" in line]
