"""Not regular files in place of block files, served by the real engine: a FIFO (what a stalled mount or a stray
``mkfifo`` looks like to a reader: an open or read of it blocks until someone writes), a socket, a device node.

One engine filled a store (``filled_store``); here some block files are replaced by such files and a restarted
engine serves the prompts. Each must be a lookup miss (the hit stops before it), never block the engine, end as a
recompute with output identical to the no-cache run, and be replaced by the recomputed block's dump: a valid block
file at the path afterwards.
"""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from tests.faults.helpers import block_path, copy_store, engine_spec
from tests.helpers import assert_same_output
from ucm.store.cli import verify_file
from ucm.testing.engine import failed_loads, run_engine

pytestmark = pytest.mark.engine

# (prompt index, block of that prompt, kind, external hit expected: the blocks before the replaced one)
CASES = [
    (0, 0, "fifo", 0),
    (1, 1, "fifo", 1),
    (2, 0, "socket", 0),
    (3, 1, "char_device", 1),
]
ENGINE_TIMEOUT_S = 600  # the engine blocked on a FIFO would never end: fail instead


def _replace(path: Path, kind: str) -> socket.socket | None:
    """Put a ``kind`` at ``path`` in place of its block file; a socket is returned (bound from its directory: a
    socket path is limited to 107 bytes), to be closed by the caller."""
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        cwd = os.getcwd()
        os.chdir(path.parent)
        try:
            sock.bind(path.name)
        finally:
            os.chdir(cwd)
        return sock
    elif kind == "char_device":
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers
    else:
        raise ValueError(f"kind must be fifo, socket or char_device, got {kind!r}")
    return None


@pytest.fixture(scope="module")
def served(tiny_model, fault_prompts, filled_store, tmp_path_factory):
    """Copy the filled store, replace one block file per case, serve the cases' prompts from a restarted engine."""
    store = copy_store(filled_store, tmp_path_factory.mktemp("not_regular") / "store")
    keys = filled_store[1]
    cases = list(CASES)
    try:
        probe = tmp_path_factory.mktemp("mknod_probe") / "dev"
        os.mknod(probe, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    except PermissionError:  # no CAP_MKNOD: the other kinds still run
        cases = [c for c in cases if c[2] != "char_device"]
    sockets = []
    paths = []
    for prompt, block, kind, _hit in cases:
        path = block_path(store, keys[prompt][block])
        sock = _replace(path, kind)
        if sock is not None:
            sockets.append(sock)
        paths.append(path)
    try:
        results, stderr = run_engine(
            engine_spec(tiny_model, store, [fault_prompts[c[0]] for c in cases]),
            env={"UC_LOGGER_LEVEL": "DEBUG"},
            timeout_s=ENGINE_TIMEOUT_S,
        )
    finally:
        for sock in sockets:
            sock.close()
    return cases, paths, results, stderr


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{c[2]}-block{c[1]}" for c in CASES])
def test_not_regular_file_is_a_miss_recomputed_and_replaced(served, baseline, index):
    cases, paths, results, _ = served
    if CASES[index] not in cases:
        pytest.skip("creating a device node needs CAP_MKNOD")
    i = cases.index(CASES[index])
    prompt, _block, _kind, hit = cases[i]
    assert_same_output(results[i], baseline[prompt])
    assert results[i].hit_external == hit
    path = paths[i]
    assert stat.S_ISREG(os.lstat(path).st_mode), "the recomputed block's dump did not replace the file"
    assert verify_file(str(path))[0] is None


def test_no_load_met_them(served):
    """Each was a lookup miss: nothing was loaded from them, so no load failed."""
    _, _, _, stderr = served
    assert failed_loads(stderr) == 0
