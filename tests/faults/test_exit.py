"""An offline script's exit: every block it dumped is stored whole or not visible, and UCM says which.

The real offline ``LLM`` layout (vLLM's engine core in its own process, which vLLM's exit stops with SIGTERM and
SIGKILLs when it has not exited 5 s later) over a store on a FUSE mount whose every write is slowed
(``ucm.testing.fusefs --write-delay-ms``; a block file of the tiny model is written in a few requests; the two files
are written in parallel), one prompt of two blocks, so that the DRAM tier's write-back is still running when the
script ends:
- slow writes (1.5 s per request, so that a block file's few requests take less than vLLM's 5 s even if the script
  ended at once): UCM waits and says the blocks are stored, after saying how many were in flight (when the script's
  end came before the write-back did); both blocks are in storage and verify;
- very slow writes (15 s per request, far more than vLLM's 5 s for any block file, also on a loaded machine): vLLM
  kills the engine while it writes; UCM's first line is there and its second is not; no block file is visible (none
  partial).
"""

from __future__ import annotations

import os
import re

import pytest

from tests.faults.helpers import block_files, engine_spec
from ucm.store.cli import verify_file
from ucm.testing import fusefs
from ucm.testing.engine import run_engine

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="/dev/fuse is absent: no FUSE mount can be made"),
]

STORING_RE = re.compile(r"shutdown: storing (\d+) dumped blocks still in flight")
STORED_RE = re.compile(r"shutdown: every dumped block is stored \((\d+) were still in flight")
NUM_PROMPTS = 1  # 2 full blocks


def _exit_with_backlog(tiny_model, prompts, tmp_path, write_delay_ms: float) -> tuple[str, list]:
    reason = fusefs.unavailable_reason()
    if reason is not None:
        pytest.fail(f"/dev/fuse exists but FUSE cannot be used: {reason} (make setup installs it)")
    source, mountpoint = tmp_path / "source", tmp_path / "mnt"
    source.mkdir()
    # One token each: the script ends right after the prefill that dumped the blocks.
    spec = engine_spec(tiny_model, mountpoint, [{"prompt": p, "max_tokens": 1} for p in prompts[:NUM_PROMPTS]])
    spec["engine_core_process"] = True  # vLLM's own offline layout: its exit stops the engine core process
    with fusefs.mount(source, mountpoint, write_delay_ms=write_delay_ms):
        _, stderr = run_engine(spec, log_path=tmp_path / "engine.log")
    return stderr, block_files(source)


def test_exit_waits_for_the_write_backs_and_says_so(tiny_model, fault_prompts, tmp_path):
    stderr, files = _exit_with_backlog(tiny_model, fault_prompts, tmp_path, write_delay_ms=1500)
    storing, stored = STORING_RE.findall(stderr), STORED_RE.findall(stderr)
    assert len(stored) == 1, stderr[-3000:]
    assert storing in ([], stored)  # "storing N" only when some were in flight; then the same N are stored
    assert len(files) == 2 * NUM_PROMPTS
    assert all(verify_file(str(f))[0] is None for f in files)


def test_exit_killed_while_writing_leaves_no_partial_block(tiny_model, fault_prompts, tmp_path):
    stderr, files = _exit_with_backlog(tiny_model, fault_prompts, tmp_path, write_delay_ms=15000)
    assert STORING_RE.findall(stderr) == [str(2 * NUM_PROMPTS)], stderr[-3000:]
    assert not STORED_RE.findall(stderr)  # killed by vLLM before it could say so
    assert files == []  # both were being written: neither is visible
