"""The ``Mooncake`` stage against a real ``mooncake_master`` and real clients (``tests/store/mooncake_cases.py``),
each scenario in its own loopback-only network namespace (Mooncake's client listens on every interface)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests.store.mooncake_cases import CASES
from ucm.testing.mooncake import loopback_netns_argv, master_binary, netns_unusable_reason

ROOT = Path(__file__).resolve().parents[2]


def _unusable() -> str | None:
    if importlib.util.find_spec("mooncake") is None or master_binary() is None:
        return "Mooncake Store's client is not installed (make setup installs mooncake-transfer-engine-non-cuda)"
    return netns_unusable_reason()


REASON = _unusable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

# What a scenario's output must also hold (its warnings and measurements).
EXPECTED_OUTPUT = {
    "pool_full": ["Mooncake pool is full"],
    "holder_killed": ["all failed"],
    "master_down": ["Mooncake pool: lookup", "master down: lookups, loads and dumps took"],
    "damaged_objects_are_misses": ["is damaged (checksum mismatch); removed"],
    "compress_over_the_pool": ["is damaged (checksum mismatch); removed"],
    "master_absent_at_start": [
        "Mooncake stage starts without the pool, joining it once the master answers",
        "Mooncake stage: the master answers now",
    ],
    "pipelines_from_config": ["pipeline Compress|Mooncake|Posix: stored, found and loaded", "Mooncake pool is full"],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_mooncake_stage(case: str, tmp_path: Path) -> None:
    run = subprocess.run(
        loopback_netns_argv([sys.executable, "-m", "tests.store.mooncake_cases", case, str(tmp_path)]),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0 and f"case {case} ok" in run.stdout, output[-6000:]
    for text in EXPECTED_OUTPUT.get(case, []):
        assert text in output, (text, output[-6000:])
