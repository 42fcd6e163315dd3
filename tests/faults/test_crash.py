"""Crashes: writers killed with SIGKILL at any moment, stale temp files, and an engine killed while serving.

A block file becomes visible only by an atomic rename of a complete temp file, so a killed writer leaves at most a
hidden temp file (removed at a later start once stale), never a visible partial block.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.faults.helpers import block_files, engine_spec, run_ucm, temp_files
from tests.helpers import REPO, assert_same_output
from tests.store.blocks import make_blocks, make_keys, poisoned
from ucm.store.cli import verify_file
from ucm.store.posix import PosixStore
from ucm.testing.engine import engine_env, failed_loads

BLOCK_NBYTES = 8 << 20  # large blocks: a kill lands in the middle of a write most of the time
NUM_BLOCKS = 24
_WRITER = """
import sys
from tests.store.blocks import make_blocks, make_keys
from ucm.store.posix import PosixStore
store = PosixStore(sys.argv[1], io_threads=2)
keys = make_keys(int(sys.argv[2]), seed=70)
for i, key in enumerate(keys):  # one block per dump, so blocks are written over the whole run
    store.wait(store.dump([key], make_blocks(1, int(sys.argv[3]), seed=100 + i)))
store.close()
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def _kill_writer_mid_write(store: Path) -> None:
    """Start a writer process and SIGKILL it as soon as it has a temp file open (a write in progress)."""
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(store), str(NUM_BLOCKS), str(BLOCK_NBYTES)], env=_env())
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if temp_files(store) and len(block_files(store)) >= 2:
                break
            time.sleep(0.002)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def test_killed_writers_leave_no_visible_partial_block_and_stale_temps_are_cleaned(tmp_path):
    store = tmp_path / "kv"
    for _ in range(3):
        _kill_writer_mid_write(store)
    left = temp_files(store)
    assert left, "no kill landed during a write (no temp file left): the test did not exercise a torn write"
    keys = make_keys(NUM_BLOCKS, seed=70)
    reader = PosixStore(str(store))
    visible = reader.lookup(keys)  # blocks are written in order, so the visible ones are a prefix
    assert visible >= 2 and len(block_files(store)) == visible
    for f in block_files(store):
        assert verify_file(str(f))[0] is None, f
    dst = poisoned(visible, BLOCK_NBYTES)
    assert reader.wait(reader.load(keys[:visible], dst)).ok
    for i in range(visible):
        assert torch.equal(dst[i : i + 1], make_blocks(1, BLOCK_NBYTES, seed=100 + i))
    reader.close()

    # A restart removes temp files older than tmp_age_s (writers long dead) and keeps a fresh one (a live writer).
    old = time.time() - 7200
    for t in left:
        os.utime(t, (old, old))
    live = left[0].with_name(".live-writer.tmp")
    live.write_bytes(b"x")
    PosixStore(str(store)).close()  # close() waits for the start-up clean-up
    assert temp_files(store) == [live]


@pytest.mark.engine
def test_engine_killed_while_dumping_then_restarted(tiny_model, fault_prompts, baseline, tmp_path):
    """SIGKILL the whole engine (front end and engine core) while it dumps; a restart serves every prompt with
    identical output, loading only whole blocks (no failed load) and storing the rest."""
    store = tmp_path / "store"
    spec = engine_spec(tiny_model, store, fault_prompts)
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ucm.testing.engine"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=engine_env(),
        start_new_session=True,
        text=True,
    )
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(spec))
    proc.stdin.close()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None and len(block_files(store)) < 6:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for name in set(os.listdir("/dev/shm")) - shm_before if shm_before else ():  # what the killed engine leaked
        if name.startswith(("psm_", "sem.mp-")):
            Path("/dev/shm", name).unlink(missing_ok=True)
    written = len(block_files(store))
    assert 6 <= written < 2 * len(fault_prompts), "the engine was not killed in the middle of its dumps"

    results, stderr = run_ucm(tiny_model, store, fault_prompts)
    for got, want in zip(results, baseline, strict=True):
        assert_same_output(got, want)
    assert failed_loads(stderr) == 0
    assert sum(r.hit_external for r in results) >= written - 1
    assert len(block_files(store)) == 2 * len(fault_prompts)
    for f in block_files(store):
        assert verify_file(str(f))[0] is None, f
