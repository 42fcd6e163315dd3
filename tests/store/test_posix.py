"""PosixStore on real temp dirs: round trips, prefix lookup, damaged files, I/O errors, two processes."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import needs_aio
from tests.store.blocks import make_blocks, make_keys, poisoned
from tests.store.helpers import Closer, usable_store_modes
from ucm.store.base import Task, TaskResult
from ucm.store.posix import (
    FILE_SUFFIX,
    FORMAT_VERSION,
    HEADER,
    HEADER_NBYTES,
    MAGIC,
    TMP_SUFFIX,
    PosixStore,
    block_file_path,
)
from ucm.store.posix import store as posix_store_module
from ucm.store.posix import uring as posix_uring
from ucm.store.posix.direct import round_up

REPO_ROOT = Path(__file__).resolve().parents[2]
BLOCK_NBYTES = [1, 1000, 4099]  # odd sizes: nothing assumes a power of two


def all_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


# (io_engine, io_direct): every engine and I/O mode the store supports.
@pytest.fixture(
    params=[
        pytest.param(False, id="aio-buffered", marks=needs_aio),
        pytest.param(True, id="aio-direct", marks=needs_aio),
    ]
)
def aio_store(tmp_path: Path, request: pytest.FixtureRequest):
    """An io_uring store on a temp directory, buffered and with O_DIRECT."""
    s = PosixStore(str(tmp_path / "kv"), io_engine="aio", io_direct=request.param)
    yield s
    s.close()


@pytest.fixture
def buffered_store(tmp_path: Path):
    """A buffered-I/O store, for tests that patch the buffered write path."""
    s = PosixStore(str(tmp_path / "kv"))
    yield s
    s.close()


def test_header_layout() -> None:
    assert HEADER_NBYTES == HEADER.size == 44
    assert FORMAT_VERSION == 1
    assert MAGIC == b"UCMB"


@pytest.mark.parametrize("nbytes", BLOCK_NBYTES, ids=lambda n: f"nbytes{n}")
def test_round_trip_two_dirs(tmp_path: Path, nbytes: int, close_after: Closer) -> None:
    d0, d1 = tmp_path / "a", tmp_path / "b"
    store = close_after(PosixStore(f"{d0}:{d1}", io_threads=3))
    keys = make_keys(97, seed=1)
    src = make_blocks(97, nbytes, seed=2)
    result = store.wait(store.dump(keys, src))
    assert result == TaskResult(97)
    assert store.lookup(keys) == 97
    # Keys spread over both dirs, each file where the placement rule puts it, with the documented size.
    for key in keys:
        d = (d0, d1)[int.from_bytes(key[:8], "little") % 2]
        h = key.hex()
        path = d / h[:2] / h[2:4] / (h + FILE_SUFFIX)
        assert path.stat().st_size == HEADER_NBYTES + nbytes
    assert all_files(d0) and all_files(d1)
    dst = poisoned(97, nbytes)
    assert store.wait(store.load(keys, dst)).ok
    assert torch.equal(dst, src)


def test_list_of_dirs_equals_colon_string(tmp_path: Path, close_after: Closer) -> None:
    d0, d1 = str(tmp_path / "a"), str(tmp_path / "b")
    keys = make_keys(20, seed=3)
    src = make_blocks(20, 64, seed=4)
    with_list = close_after(PosixStore([d0, d1]))
    assert with_list.wait(with_list.dump(keys, src)).ok
    with_string = close_after(PosixStore(f"{d0}:{d1}"))
    dst = poisoned(20, 64)
    assert with_string.wait(with_string.load(keys, dst)).ok
    assert torch.equal(dst, src)


def test_lookup_prefix_semantics(store: PosixStore) -> None:
    keys = make_keys(6, seed=5)
    src = make_blocks(6, 32, seed=6)
    present = [0, 1, 2, 4, 5]  # key 3 missing in the middle
    assert store.wait(store.dump([keys[i] for i in present], src[present])).ok
    assert store.lookup(keys) == 3
    assert store.lookup(keys[:3]) == 3
    assert store.lookup(keys[4:]) == 2
    assert store.lookup(keys[3:]) == 0
    assert store.lookup([]) == 0


def test_load_missing_key_fails_only_that_index(store: PosixStore) -> None:
    keys = make_keys(5, seed=7)
    src = make_blocks(5, 100, seed=8)
    assert store.wait(store.dump(keys[:2] + keys[3:], src[[0, 1, 3, 4]])).ok
    dst = poisoned(5, 100)
    result = store.wait(store.load(keys, dst))
    assert result.failed == {2}
    for i in (0, 1, 3, 4):
        assert torch.equal(dst[i], src[i])


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:-1])


def _truncate_header(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: HEADER_NBYTES // 2])


def _flip(offset: int):
    def damage(path: Path) -> None:
        data = bytearray(path.read_bytes())
        data[offset] ^= 0x01
        path.write_bytes(bytes(data))

    return damage


def _zero_length(path: Path) -> None:
    path.write_bytes(b"")


def _trailing_garbage(path: Path) -> None:
    with path.open("ab") as f:
        f.write(b"\x00garbage")


DAMAGES = {
    "truncated_payload": _truncate,
    "truncated_header": _truncate_header,
    "flip_payload_first": _flip(HEADER_NBYTES),
    "flip_payload_last": _flip(-1),
    "flip_magic": _flip(0),
    "flip_version": _flip(4),
    "flip_codec": _flip(6),
    "flip_nbytes": _flip(12),
    "flip_key": _flip(20),
    "flip_checksum": _flip(36),
    "zero_length": _zero_length,
    "trailing_garbage": _trailing_garbage,
}


@pytest.mark.parametrize("sharded", [False, True], ids=["load", "load_sharded"])
@pytest.mark.parametrize("damage", list(DAMAGES.values()), ids=list(DAMAGES))
def test_damaged_file_is_a_failed_key(store: PosixStore, damage, sharded: bool, ucm_log) -> None:
    keys = make_keys(3, seed=9)
    src = make_blocks(3, 258, seed=10)
    assert store.wait(store.dump(keys, src)).ok
    path = Path(store.block_path(keys[1]))
    damage(path)
    dst = poisoned(3, 258)
    # load_sharded reads 3 ranges of 86 bytes per block (a layerwise load) and validates the whole block at the end.
    result = store.wait(store.load_sharded(keys, dst, 3) if sharded else store.load(keys, dst))
    assert result.failed == {1}
    assert torch.equal(dst[0], src[0]) and torch.equal(dst[2], src[2])
    warnings = [r for r in ucm_log.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0].getMessage()
    # Damage is removed so the block can be stored again; a header that may be another UCM version's is kept.
    kept = damage in (DAMAGES["flip_version"], DAMAGES["flip_codec"], DAMAGES["flip_nbytes"])
    assert path.exists() == kept
    if not kept:
        assert store.lookup(keys) == 1
        assert store.wait(store.dump(keys, src)).ok  # the recomputed block is stored again
        dst = poisoned(3, 258)
        assert store.wait(store.load(keys, dst)).ok and torch.equal(dst, src)


def test_wrong_key_file_is_a_failed_key(store: PosixStore) -> None:
    keys = make_keys(2, seed=11)
    src = make_blocks(2, 300, seed=12)
    assert store.wait(store.dump(keys[:1], src[:1])).ok
    b_path = Path(store.block_path(keys[1]))
    b_path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(store.block_path(keys[0]), b_path)
    assert store.lookup(keys) == 2  # lookup reads no data: the file exists
    dst = poisoned(2, 300)
    assert store.wait(store.load(keys, dst)).failed == {1}
    assert torch.equal(dst[0], src[0])


def test_wrong_block_size_is_a_failed_key(store: PosixStore) -> None:
    keys = make_keys(1, seed=13)
    src = make_blocks(1, 100, seed=14)
    assert store.wait(store.dump(keys, src)).ok
    assert store.wait(store.load(keys, poisoned(1, 101))).failed == {0}
    assert store.wait(store.load(keys, poisoned(1, 99))).failed == {0}
    dst = poisoned(1, 100)  # a caller's size mismatch did not destroy the block
    assert store.wait(store.load(keys, dst)).ok and torch.equal(dst, src)


def test_missing_file_logs_at_debug_only(store: PosixStore, ucm_log) -> None:
    keys = make_keys(1, seed=15)
    assert store.wait(store.load(keys, poisoned(1, 8))).failed == {0}
    assert [r.levelno for r in ucm_log.records] == [logging.DEBUG]


def test_no_temp_files_left_and_existing_block_skipped(store: PosixStore, tmp_path: Path) -> None:
    keys = make_keys(50, seed=16)
    src = make_blocks(50, 123, seed=17)
    assert store.wait(store.dump(keys, src)).ok
    files = all_files(tmp_path / "kv")
    assert len(files) == 50
    assert not [p for p in files if p.name.startswith(".") or p.name.endswith(TMP_SUFFIX)]
    # A second dump of the same keys (even with other bytes) keeps the existing files: content is keyed.
    inodes = {p: p.stat().st_ino for p in files}
    assert store.wait(store.dump(keys, make_blocks(50, 123, seed=18))).ok
    assert {p: p.stat().st_ino for p in all_files(tmp_path / "kv")} == inodes
    dst = poisoned(50, 123)
    assert store.wait(store.load(keys, dst)).ok
    assert torch.equal(dst, src)


def test_duplicate_keys_in_one_batch(store: PosixStore) -> None:
    key = make_keys(1, seed=19)[0]
    src = make_blocks(1, 77, seed=20).repeat(8, 1)
    assert store.wait(store.dump([key] * 8, src)).ok
    dst = poisoned(8, 77)
    assert store.wait(store.load([key] * 8, dst)).ok
    assert torch.equal(dst, src)


def test_empty_batch_is_completed(store: PosixStore) -> None:
    empty = torch.empty((0, 16), dtype=torch.uint8)
    for task in (store.dump([], empty), store.load([], empty)):
        assert isinstance(task, Task) and store.check(task)
        assert store.wait(task) == TaskResult(0)


def test_bad_arguments_raise(store: PosixStore) -> None:
    keys = make_keys(2, seed=21)
    with pytest.raises(TypeError):
        store.dump(keys, torch.zeros((2, 8), dtype=torch.int32))
    with pytest.raises(ValueError):
        store.dump(keys, torch.zeros((3, 8), dtype=torch.uint8))
    with pytest.raises(ValueError):
        store.load([b"short"], torch.zeros((1, 8), dtype=torch.uint8))
    with pytest.raises(TypeError):
        store.lookup(["not bytes"])  # type: ignore[list-item]


@pytest.mark.parametrize("spec", ["", "a::b", ":"], ids=["empty", "empty_middle", "only_colon"])
def test_empty_backend_raises(tmp_path: Path, spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="storage_backends"):
        PosixStore(spec)


def test_backend_that_is_a_file_raises(tmp_path: Path) -> None:
    regular = tmp_path / "regular"
    regular.write_bytes(b"x")
    with pytest.raises(ValueError, match=str(regular)):
        PosixStore(f"{tmp_path / 'ok'}:{regular}")
    with pytest.raises(ValueError, match="regular"):
        PosixStore(str(regular / "sub"))


def test_bad_io_threads_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="io_threads"):
        PosixStore(str(tmp_path), io_threads=0)


def test_close_is_idempotent_and_final(tmp_path: Path, close_after: Closer) -> None:
    store = close_after(PosixStore(str(tmp_path)))
    store.close()
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.dump(make_keys(1, seed=22), make_blocks(1, 4, seed=23))


def _make_unwritable(store: PosixStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every write under the store fail: chmod if that works, else (root) a dir under a regular file."""
    root = Path(store.dirs[0])
    root.chmod(0o555)
    if not os.access(root, os.W_OK):
        return
    root.chmod(0o755)
    regular = tmp_path / "regular_file"
    regular.write_bytes(b"x")
    monkeypatch.setattr(store._files, "dirs", [str(regular / "kv")])


def test_unwritable_dir_dump_fails_with_one_warning(
    store: PosixStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ucm_log
) -> None:
    _make_unwritable(store, tmp_path, monkeypatch)
    keys = make_keys(4, seed=24)
    src = make_blocks(4, 64, seed=25)
    try:
        assert store.wait(store.dump(keys, src)).failed == {0, 1, 2, 3}
        assert store.wait(store.dump(keys, src)).failed == {0, 1, 2, 3}
    finally:
        (tmp_path / "kv").chmod(0o755)
    warnings = [r for r in ucm_log.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # one warning per errno kind, the rest at debug level
    assert store.lookup(keys) == 0
    assert not [p for p in all_files(tmp_path / "kv")]


def test_write_error_midway_removes_temp_file(
    buffered_store: PosixStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ucm_log
) -> None:
    """A full disk (ENOSPC) during the payload write: failed key, temp file removed, nothing visible."""
    import errno

    real_write = os.write
    calls = {"n": 0}

    def flaky_write(fd: int, data) -> int:
        calls["n"] += 1
        if calls["n"] == 2:  # header succeeds, payload hits a full disk
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", flaky_write)
    keys = make_keys(1, seed=26)
    assert buffered_store.wait(buffered_store.dump(keys, make_blocks(1, 500, seed=27))).failed == {0}
    monkeypatch.setattr(os, "write", real_write)
    assert all_files(tmp_path / "kv") == []
    assert buffered_store.lookup(keys) == 0
    assert any("ENOSPC" in r.getMessage() for r in ucm_log.records if r.levelno == logging.WARNING)


def test_short_writes_are_completed(buffered_store: PosixStore, monkeypatch: pytest.MonkeyPatch) -> None:
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data)[:7]))
    keys = make_keys(3, seed=28)
    src = make_blocks(3, 100, seed=29)
    assert buffered_store.wait(buffered_store.dump(keys, src)).ok
    monkeypatch.setattr(os, "write", real_write)
    dst = poisoned(3, 100)
    assert buffered_store.wait(buffered_store.load(keys, dst)).ok
    assert torch.equal(dst, src)


_CHILD = """
import sys, torch
from tests.store.blocks import make_blocks, make_keys
from ucm.store.posix import PosixStore
dirs, mode, n, nbytes, key_seed, data_seed = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
keys = make_keys(n, key_seed)
src = make_blocks(n, nbytes, data_seed)
store = PosixStore(dirs)
if mode == "dump":
    ok = store.wait(store.dump(keys, src)).ok
else:
    dst = torch.zeros_like(src)
    ok = store.lookup(keys) == n and store.wait(store.load(keys, dst)).ok and torch.equal(dst, src)
store.close()
sys.exit(0 if ok else 1)
"""


def _child(dirs: str, mode: str, n: int, nbytes: int, key_seed: int, data_seed: int) -> list[str]:
    return [sys.executable, "-c", _CHILD, dirs, mode, str(n), str(nbytes), str(key_seed), str(data_seed)]


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    return env


def test_second_process_reads_what_first_wrote(tmp_path: Path, close_after: Closer) -> None:
    dirs = f"{tmp_path / 'a'}:{tmp_path / 'b'}"
    store = close_after(PosixStore(dirs))
    keys = make_keys(40, seed=30)
    src = make_blocks(40, 999, seed=31)
    assert store.wait(store.dump(keys, src)).ok
    store.close()
    proc = subprocess.run(
        _child(dirs, "load", 40, 999, 30, 31), env=_child_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr


def test_concurrent_writer_processes(tmp_path: Path, close_after: Closer) -> None:
    """Two processes dump the same keys at once: every block ends up whole, no temp files remain."""
    dirs = str(tmp_path / "kv")
    procs = [
        subprocess.Popen(_child(dirs, "dump", 200, 513, 32, 33), env=_child_env(), stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    store = close_after(PosixStore(dirs))
    keys = make_keys(200, seed=32)
    dst = poisoned(200, 513)
    assert store.wait(store.load(keys, dst)).ok
    assert torch.equal(dst, make_blocks(200, 513, seed=33))
    assert len(all_files(tmp_path / "kv")) == 200


@pytest.mark.parametrize("nbytes", [1, 4052, 4053, 8192, 100_000])
def test_files_identical_across_engines_and_io_modes(tmp_path: Path, nbytes: int, close_after: Closer) -> None:
    """Every engine and I/O mode writes the same bytes (O_DIRECT writes whole 4 KiB units and truncates the padding),
    and every mode reads every other mode's files (the modes that can start here: see ``usable_store_modes``)."""
    keys = make_keys(3, seed=50)
    src = make_blocks(3, nbytes, seed=51)
    modes = usable_store_modes()
    dirs = {mode: tmp_path / f"{mode[0]}-{int(mode[1])}" for mode in modes}
    for (io_engine, io_direct), d in dirs.items():
        writer = close_after(PosixStore(str(d), io_engine=io_engine, io_direct=io_direct))
        assert writer.wait(writer.dump(keys, src)).ok
        writer.close()
    reference = dirs[("psync", False)]
    for d in dirs.values():
        for k in keys:
            name = Path(block_file_path([str(d)], k)).relative_to(d)
            assert (d / name).read_bytes() == (reference / name).read_bytes()
    for io_engine, io_direct in modes:
        for d in dirs.values():
            reader = close_after(PosixStore(str(d), io_engine=io_engine, io_direct=io_direct))
            dst = poisoned(3, nbytes)
            assert reader.wait(reader.load(keys, dst)).ok and torch.equal(dst, src), (io_engine, io_direct, d.name)
            reader.close()


@pytest.mark.parametrize("io_engine", ["psync", pytest.param("aio", marks=needs_aio)])
def test_direct_io_refused_names_the_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, io_engine) -> None:
    """A filesystem refusing O_DIRECT (EINVAL at open, as older tmpfs and some FUSE mounts do) stops start-up with
    an error naming the directory, for either engine, leaving nothing running. Injected: every filesystem on this
    machine (ext4, tmpfs on Linux 6.18) accepts O_DIRECT."""
    import errno

    real_open = os.open

    def no_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_direct)
    target = tmp_path / "kv"
    before = set(threading.enumerate())
    with pytest.raises(ValueError, match=r"refuses O_DIRECT I/O \(io_direct: true\): Invalid argument"):
        PosixStore(str(target), io_direct=True, io_engine=io_engine)
    assert not list(target.iterdir())  # no probe file left
    assert set(threading.enumerate()) == before  # no io_uring reaper or pool started


# -- aio engine (io_uring) ----------------------------------------------------------------------------------------


@needs_aio  # the binding runs in this process up to the injected failure
def test_aio_refused_when_io_uring_is_unusable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel refusing io_uring (kernel.io_uring_disabled, seccomp: EPERM at setup) stops start-up with an error
    naming the engine, the reason and the allowed engine; no silent fallback to psync. Injected: this machine's
    kernel allows io_uring."""
    import errno

    import liburing

    def refused(entries, ring, *args):
        raise OSError(errno.EPERM, os.strerror(errno.EPERM))

    monkeypatch.setattr(liburing, "io_uring_queue_init", refused)
    before = set(threading.enumerate())
    with pytest.raises(ValueError, match=r"posix_io_engine: aio .*Operation not permitted.*allowed: psync"):
        PosixStore(str(tmp_path / "kv"), io_engine="aio")
    assert set(threading.enumerate()) == before  # nothing left running


def test_aio_refused_when_the_binding_crashes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A binding that kills its process (the liburing wheel's AVX-512 code on a CPU without it dies of SIGILL) is
    found in a child process and refused at start with the signal named, never run in the serving process. Injected:
    the child kills itself with SIGILL."""
    monkeypatch.setattr(posix_uring, "_PROBE", "import os, signal; os.kill(os.getpid(), signal.SIGILL)")
    posix_uring._binding_crash.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"posix_io_engine: aio is not usable: .* with SIGILL .*allowed: psync"):
            PosixStore(str(tmp_path / "kv"), io_engine="aio")
    finally:
        posix_uring._binding_crash.cache_clear()  # the next aio store probes the real binding again


def test_aio_starts_or_says_why_not(tmp_path: Path) -> None:
    """On this machine, unmocked: an aio store either starts and moves a block, or start-up fails with the reason
    that ``aio_unusable_reason`` (what the ``needs_aio`` tests are skipped with) gives."""
    reason = posix_uring.aio_unusable_reason()
    if reason is not None:
        assert reason.startswith("posix_io_engine: aio") and reason.endswith("allowed: psync")
        with pytest.raises(ValueError) as info:
            PosixStore(str(tmp_path / "kv"), io_engine="aio")
        assert str(info.value) == reason
        return
    store = PosixStore(str(tmp_path / "kv"), io_engine="aio")
    try:
        keys, src = make_keys(1, seed=60), make_blocks(1, 4096, seed=60)
        dst = poisoned(1, 4096)
        assert store.wait(store.dump(keys, src)).ok and store.wait(store.load(keys, dst)).ok
        assert torch.equal(dst, src)
    finally:
        store.close()


def test_aio_refused_without_liburing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "liburing", None)  # import liburing raises ImportError
    with pytest.raises(ValueError, match=r"posix_io_engine: aio needs the 'liburing' package.*allowed: psync"):
        PosixStore(str(tmp_path / "kv"), io_engine="aio")


def test_unknown_engine_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'psync' or 'aio', got 'libaio'"):
        PosixStore(str(tmp_path / "kv"), io_engine="libaio")  # type: ignore[arg-type]


def test_aio_many_blocks_in_flight(aio_store: PosixStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """256 keys in one call: the io_uring fills to its full depth (the first completion is held until then), and
    every block loads byte-exact."""
    uring = aio_store._uring
    assert uring is not None
    depth = posix_uring.DEFAULT_DEPTH
    peak = {"n": 0}

    def held(real):
        def complete(*args):
            if peak["n"] == 0:  # the first completion: wait until the ring is full
                deadline = time.monotonic() + 30
                while len(uring._ops) < depth and time.monotonic() < deadline:
                    time.sleep(0.001)
                peak["n"] = len(uring._ops)
            return real(*args)

        return complete

    keys = make_keys(256, seed=60)
    src = make_blocks(256, 12_289, seed=61)
    engine = aio_store._aio
    assert engine is not None
    monkeypatch.setattr(engine, "dump_complete", held(engine.dump_complete))
    assert aio_store.wait(aio_store.dump(keys, src)) == TaskResult(256)
    assert peak["n"] == depth
    peak["n"] = 0
    monkeypatch.setattr(engine, "load_complete", held(engine.load_complete))
    dst = poisoned(256, 12_289)
    assert aio_store.wait(aio_store.load(keys, dst)) == TaskResult(256)
    assert peak["n"] == depth
    assert torch.equal(dst, src)


@contextlib.contextmanager
def file_size_limit(limit: int):
    """Writes past ``limit`` bytes of a file fail (RLIMIT_FSIZE: a short write, then EFBIG) in this context;
    SIGXFSZ is ignored so that the failure is an error return, not a signal."""
    import resource
    import signal

    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old_limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


@pytest.mark.parametrize("limit", [0, 8192], ids=["efbig", "short_write"])
def test_write_past_file_size_limit_fails(store: PosixStore, tmp_path: Path, limit: int, ucm_log) -> None:
    """A real write failure in the data transfer (file size limit: the kernel refuses the write, or writes 8 KiB of
    each file and stops short): every key fails, no temp file remains, one warning; the next dump works again."""
    keys = make_keys(8, seed=62)
    src = make_blocks(8, 20_000, seed=63)
    with file_size_limit(limit):
        assert store.wait(store.dump(keys, src)).failed == set(range(8))
    assert all_files(tmp_path / "kv") == []
    warnings = [r.getMessage() for r in ucm_log.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cannot write" in warnings[0]
    assert store.wait(store.dump(keys, src)).ok
    dst = poisoned(8, 20_000)
    assert store.wait(store.load(keys, dst)).ok and torch.equal(dst, src)


@needs_aio
@pytest.mark.parametrize("io_direct", [False, True], ids=["aio-buffered", "aio-direct"])
def test_aio_close_with_operations_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, io_direct: bool, close_after: Closer
) -> None:
    """close() right after a dump of 256 blocks: the first completion is held until close has begun, so operations
    are in flight when it does; close drains them (every key stored, every O_DIRECT buffer given back), stops the
    reaper and exits the ring."""
    store = close_after(PosixStore(str(tmp_path / "kv"), io_engine="aio", io_direct=io_direct))
    uring = store._uring
    assert uring is not None
    engine = store._aio
    assert engine is not None
    real = engine.dump_complete
    in_flight_at_close = {"n": -1}

    def complete(*args):
        if in_flight_at_close["n"] < 0:
            deadline = time.monotonic() + 30
            while not store._closed and time.monotonic() < deadline:
                time.sleep(0.001)
            # close has begun; the pool threads are still queuing the other blocks: let a second one get queued
            # (on a loaded machine they may not have submitted any yet when close starts).
            while not uring._ops and time.monotonic() < deadline:
                time.sleep(0.001)
            in_flight_at_close["n"] = len(uring._ops) + 1  # this one included
        return real(*args)

    monkeypatch.setattr(engine, "dump_complete", complete)
    keys = make_keys(256, seed=64)
    src = make_blocks(256, 5_000, seed=65)
    task = store.dump(keys, src)
    store.close()
    assert in_flight_at_close["n"] > 1
    assert task.done() and task.result() == TaskResult(256)
    assert not uring._reaper.is_alive()
    assert not [t for t in threading.enumerate() if t.name.startswith("ucm-posix") and t.is_alive()]
    if io_direct:
        assert store._direct_pool is not None and store._direct_pool.held_bytes == 0
    assert {p.stat().st_size for p in all_files(tmp_path / "kv")} == {HEADER_NBYTES + 5_000}
    reader = close_after(PosixStore(str(tmp_path / "kv")))
    dst = poisoned(256, 5_000)
    assert reader.wait(reader.load(keys, dst)).ok and torch.equal(dst, src)
    reader.close()


@needs_aio
def test_aio_direct_opens_block_files_with_o_direct(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, close_after: Closer
) -> None:
    """aio + io_direct: the temp file written and the block file read are opened with O_DIRECT (the io_uring
    operations then move aligned buffers: a misaligned one fails with EINVAL, which the round trip rules out)."""
    store = close_after(PosixStore(str(tmp_path / "kv"), io_engine="aio", io_direct=True))
    real_open = os.open
    opened: list[tuple[str, int]] = []

    def recording_open(path, flags, *args, **kwargs):
        opened.append((os.fspath(path), flags))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", recording_open)
    keys = make_keys(4, seed=70)
    src = make_blocks(4, 4099, seed=71)
    assert store.wait(store.dump(keys, src)).ok
    dst = poisoned(4, 4099)
    assert store.wait(store.load(keys, dst)).ok and torch.equal(dst, src)
    monkeypatch.setattr(os, "open", real_open)
    store.close()
    temps = [flags for path, flags in opened if path.endswith(TMP_SUFFIX)]
    blocks = [flags for path, flags in opened if path.endswith(FILE_SUFFIX)]
    assert len(temps) == 4 and len(blocks) == 4
    assert all(flags & os.O_DIRECT for flags in temps + blocks)


@needs_aio
@pytest.mark.parametrize("nbytes", [4099, 100_000], ids=["nbytes4099", "nbytes100000_over_the_bound"])
def test_aio_direct_buffers_are_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nbytes: int, close_after: Closer
) -> None:
    """The aligned buffers held by operations in flight stay within AIO_DIRECT_BUFFER_BYTES (here 3 buffers of
    4099 + 44 bytes rounded up to 8 KiB; a block larger than the bound moves alone) and all come back; 200 blocks
    still round-trip."""
    bound = 3 * 8192
    monkeypatch.setattr(posix_store_module, "AIO_DIRECT_BUFFER_BYTES", bound)
    store = close_after(PosixStore(str(tmp_path / "kv"), io_engine="aio", io_direct=True, io_threads=8))
    pool = store._direct_pool
    assert pool is not None
    real_acquire = pool.acquire
    peak = {"bytes": 0, "buffers": 0}

    def acquire(n: int) -> memoryview:
        buf = real_acquire(n)
        peak["bytes"] = max(peak["bytes"], pool.held_bytes)
        peak["buffers"] += 1
        return buf

    monkeypatch.setattr(pool, "acquire", acquire)
    keys = make_keys(200, seed=72)
    src = make_blocks(200, nbytes, seed=73)
    assert store.wait(store.dump(keys, src)).ok
    dst = poisoned(200, nbytes)
    assert store.wait(store.load(keys, dst)).ok and torch.equal(dst, src)
    assert peak["buffers"] == 400
    assert 0 < peak["bytes"] <= max(bound, round_up(HEADER_NBYTES + nbytes))
    assert pool.held_bytes == 0


@needs_aio
@pytest.mark.parametrize("io_direct", [False, True], ids=["aio-buffered", "aio-direct"])
def test_pipeline_builds_aio_store(tmp_path: Path, io_direct: bool, close_after: Closer) -> None:
    from ucm.config import config_from_extra_config
    from ucm.store.pipeline import build_store

    extra = {
        "ucm_connectors": [
            {
                "ucm_connector_config": {
                    "store_pipeline": "Posix",
                    "storage_backends": str(tmp_path),
                    "posix_io_engine": "aio",
                    "io_direct": io_direct,
                }
            }
        ]
    }
    store = close_after(build_store(config_from_extra_config(extra).store))
    assert isinstance(store, PosixStore) and store._uring is not None
    assert (store._direct_pool is not None) == io_direct
    keys = make_keys(3, seed=66)
    src = make_blocks(3, 4099, seed=67)
    assert store.wait(store.dump(keys, src)).ok
    dst = poisoned(3, 4099)
    assert store.wait(store.load(keys, dst)).ok and torch.equal(dst, src)
