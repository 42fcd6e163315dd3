"""Fixtures of the fault suite: distinct real-text prompts, their no-cache outputs, a filled store, mounts. Its
plain helpers are in ``tests/faults/helpers.py``."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.faults.helpers import (
    NUM_PROMPTS,
    PROMPT_TOKENS,
    block_files,
    engine_spec,
    request_block_keys,
    run_ucm,
)
from tests.helpers import assert_same_output
from ucm.testing.engine import RequestResult, run_engine


@pytest.fixture(scope="session")
def fault_prompts(tokenizer) -> list[str]:
    """``NUM_PROMPTS`` prompts of disjoint real text, ~``PROMPT_TOKENS`` tokens each (no shared prefix)."""
    from ucm.testing.texts import prompt_of_tokens

    text = prompt_of_tokens(tokenizer, PROMPT_TOKENS * NUM_PROMPTS + 50)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return [tokenizer.decode(ids[i * PROMPT_TOKENS : (i + 1) * PROMPT_TOKENS]) for i in range(NUM_PROMPTS)]


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
