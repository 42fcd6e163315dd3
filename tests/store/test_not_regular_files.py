"""Not regular files where a block file should be (FIFO, socket, device, directory): what a stalled mount or a stray
``mkfifo`` leaves. Each is a miss at ``lookup``, a failed key at load that never blocks (recorded as ``damaged``,
and removed), replaced by the next dump of the key, and reported and removed by ``python -m ucm.store verify
--remove`` and ``clear --yes``. Everything here is real: real FIFOs, sockets and device nodes on real directories,
the CLI as a real subprocess (a verify that opened a FIFO without ``O_NONBLOCK`` would hang until its timeout).
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.store.blocks import make_blocks, make_keys
from tests.store.helpers import Closer
from ucm.store.base import EncodedBlock, Task, TaskResult
from ucm.store.observe import Observation, Recorder
from ucm.store.posix import PosixStore

REPO_ROOT = Path(__file__).resolve().parents[2]
NBYTES = 4096 + 52  # not a power of two nor a multiple of the O_DIRECT unit
NUM_KEYS = 3
KINDS = ["fifo", "socket", "char_device", "empty_directory"]
# What not_regular names each kind in log lines and verify's report.
KIND_NAMES = {
    "fifo": "a FIFO",
    "socket": "a socket",
    "char_device": "a character device",
    "empty_directory": "a directory",
}
TIMEOUT_S = 20  # a read that blocked on a FIFO would never end: fail instead of hanging


@pytest.fixture
def make_not_regular(monkeypatch: pytest.MonkeyPatch) -> Iterator:
    """``make_not_regular(path, kind)``: put a ``kind`` (one of ``KINDS``) at ``path`` in place of whatever is
    there. Sockets are bound from their directory (a socket path is limited to 107 bytes) and closed at teardown;
    a device node (``/dev/null``'s numbers) needs ``CAP_MKNOD``: the test is skipped without it."""
    sockets: list[socket.socket] = []

    def make(path: Path, kind: str) -> None:
        if path.is_dir():
            path.rmdir()
        else:
            path.unlink(missing_ok=True)
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "socket":
            sock = socket.socket(socket.AF_UNIX)
            sockets.append(sock)
            monkeypatch.chdir(path.parent)
            sock.bind(path.name)
        elif kind == "char_device":
            try:
                os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
            except PermissionError:
                pytest.skip("creating a device node needs CAP_MKNOD")
        elif kind == "empty_directory":
            path.mkdir()
        else:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")

    yield make
    for sock in sockets:
        sock.close()


def result_or_release(task: Task, fifo: Path) -> TaskResult:
    """The task's result within ``TIMEOUT_S``; past it, a reader blocked on the FIFO at ``fifo`` is released (a
    writer opens it) so that the store can close, and the test fails."""
    try:
        return task.result(TIMEOUT_S)
    except TimeoutError:
        if stat.S_ISFIFO(os.lstat(fifo).st_mode):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"the load did not end within {TIMEOUT_S} s: blocked on the FIFO")


def recorded(store: PosixStore) -> list[Observation]:
    seen: list[Observation] = []
    recorder = Recorder()
    recorder.add_sink(seen.append)
    store.set_recorder(recorder)
    return seen


@pytest.mark.parametrize("kind", KINDS)
def test_lookup_miss_load_fails_fast_and_dump_replaces(store: PosixStore, make_not_regular, kind: str) -> None:
    keys = make_keys(NUM_KEYS, seed=1)
    src = make_blocks(NUM_KEYS, NBYTES, seed=2)
    assert not store.wait(store.dump(keys, src)).failed
    seen = recorded(store)
    path = Path(store.block_path(keys[1]))
    make_not_regular(path, kind)

    assert store.lookup(keys) == 1  # prefix semantics: stops at the not regular file
    assert store.lookup(keys[1:]) == 0

    dst = torch.zeros_like(src)
    result = result_or_release(store.load(keys, dst), path)
    assert result.failed == {1}
    assert torch.equal(dst[0], src[0]) and torch.equal(dst[2], src[2])
    failures = [(o.cause, o.key) for o in seen if o.op == "load_failure"]
    assert failures == [("damaged", keys[1].hex())]
    assert not os.path.lexists(path)  # removed as damaged: the next dump writes the block again

    make_not_regular(path, kind)  # again, for the dump to meet it
    assert not store.wait(store.dump(keys, src)).failed
    assert stat.S_ISREG(os.lstat(path).st_mode)
    assert store.lookup(keys) == NUM_KEYS
    dst.zero_()
    assert not store.wait(store.load(keys, dst)).failed
    assert torch.equal(dst, src)


@pytest.mark.parametrize("kind", ["fifo", "empty_directory"])
def test_sharded_and_encoded_loads_fail_fast(store: PosixStore, make_not_regular, kind: str) -> None:
    keys = make_keys(NUM_KEYS, seed=3)
    src = make_blocks(NUM_KEYS, NBYTES, seed=4)
    assert not store.wait(store.dump(keys, src)).failed
    path = Path(store.block_path(keys[2]))

    make_not_regular(path, kind)
    dst = torch.zeros_like(src)
    result = result_or_release(store.load_sharded(keys, dst, num_shards=4), path)
    assert result.failed == {2}
    assert torch.equal(dst[:2], src[:2])

    make_not_regular(path, kind)
    handed: list[int] = []

    def consume(i: int, _block: EncodedBlock) -> str | None:
        handed.append(i)
        return None

    result = result_or_release(store.load_encoded(keys, NBYTES, consume), path)
    assert result.failed == {2} and sorted(handed) == [0, 1]


def test_directory_with_entries_is_kept_and_fails_the_dump(tmp_path: Path, close_after: Closer, ucm_log) -> None:
    store = close_after(PosixStore(str(tmp_path / "kv")))
    keys = make_keys(2, seed=5)
    src = make_blocks(2, NBYTES, seed=6)
    path = Path(store.block_path(keys[0]))
    path.mkdir(parents=True)
    (path / "not-ucm").write_text("someone else's")

    assert store.lookup(keys) == 0
    assert store.wait(store.dump(keys, src)).failed == {0}  # UCM never deletes a tree it did not write
    assert (path / "not-ucm").read_text() == "someone else's"
    result = store.wait(store.load(keys, torch.zeros_like(src)))
    assert result.failed == {0}
    assert (path / "not-ucm").exists()
    assert any("a directory" in r.getMessage() and "left in place" in r.getMessage() for r in ucm_log.records)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ucm.store", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )


CLI_KINDS = ["fifo", "socket", "empty_directory"]  # the device node needs CAP_MKNOD: tested on the store above


def test_cli_stats_verify_remove_and_clear(tmp_path: Path, make_not_regular) -> None:
    root = tmp_path / "kv"
    store = PosixStore(str(root))
    keys = make_keys(2 + len(CLI_KINDS), seed=7)
    try:
        assert not store.wait(store.dump(keys, make_blocks(len(keys), NBYTES, seed=8))).failed
        paths = [Path(store.block_path(k)) for k in keys]
    finally:
        store.close()
    for path, kind in zip(paths[2:], CLI_KINDS, strict=True):
        make_not_regular(path, kind)
    irregular = {str(p): KIND_NAMES[k] for p, k in zip(paths[2:], CLI_KINDS, strict=True)}

    proc = run_cli("stats", "--json", "--storage-backends", str(root))
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout)
    assert (stats["block_files"], stats["irregular_files"]) == (2, len(irregular))

    proc = run_cli("verify", "--storage-backends", str(root))  # would hang on the FIFO if it opened it blocking
    assert proc.returncode == 1, proc.stderr
    for path, what in irregular.items():
        assert f"damaged: {path}: not a regular file: {what}" in proc.stdout.splitlines()
    assert all(os.path.lexists(p) for p in irregular)  # without --remove nothing is deleted

    proc = run_cli("verify", "--remove", "--storage-backends", str(root))
    assert proc.returncode == 1, proc.stderr
    assert f"{len(irregular)} damaged ({len(irregular)} removed)" in proc.stdout
    assert not any(os.path.lexists(p) for p in irregular)
    assert all(p.is_file() for p in paths[:2])
    assert run_cli("verify", "--storage-backends", str(root)).returncode == 0

    for path, kind in zip(paths[2:], CLI_KINDS, strict=True):
        make_not_regular(path, kind)
    proc = run_cli("clear", "--yes", "--storage-backends", str(root))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"not regular files at block paths: removed {len(irregular)} files" in proc.stdout
    assert not any(os.path.lexists(p) for p in paths)
