"""``python -m ucm.store``: stats, verify (damage, foreign files, --remove), gc by LRU, clear, location errors.

Stores are real files written by :class:`PosixStore`; ``stats`` and ``verify`` also run as real subprocesses.
"""

from __future__ import annotations

import io
import json
import os
import shlex
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.store.blocks import make_blocks, make_keys
from tests.store.helpers import Closer
from ucm.store.cli import main
from ucm.store.posix import FILE_SUFFIX, HEADER_NBYTES, TMP_SUFFIX, PosixStore, namespace_tag

REPO_ROOT = Path(__file__).resolve().parents[2]
NBYTES = [1000, 4099]  # two block sizes: two groups in stats' breakdown
NUM_BLOCKS = [5, 3]


def dump(dirs: str, n: int, nbytes: int, seed: int) -> list[str]:
    """Write ``n`` blocks of ``nbytes`` into the store at ``dirs``; return their file paths."""
    store = PosixStore(dirs)
    keys = make_keys(n, seed=seed)
    try:
        assert not store.wait(store.dump(keys, make_blocks(n, nbytes, seed=seed))).failed
        return [store.block_path(k) for k in keys]
    finally:
        store.close()


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ucm.store", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )


def run_main(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(list(args), out=out), out.getvalue()


def blocks_on_disk(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*" + FILE_SUFFIX) if not p.name.startswith("."))


@pytest.fixture
def two_dir_store(tmp_path: Path) -> tuple[str, list[str]]:
    """A store over two directories with NUM_BLOCKS[i] blocks of NBYTES[i] bytes, one temp file and one stray."""
    dirs = f"{tmp_path / 'a'}:{tmp_path / 'b'}"
    paths = [p for i, (n, nb) in enumerate(zip(NUM_BLOCKS, NBYTES, strict=True)) for p in dump(dirs, n, nb, seed=i)]
    (tmp_path / "a" / f".deadbeef.1.2.ab{TMP_SUFFIX}").write_bytes(b"x" * 10)
    (tmp_path / "a" / "README").write_text("not a block")
    return dirs, paths


def test_stats_subprocess_json(two_dir_store: tuple[str, list[str]]) -> None:
    dirs, _ = two_dir_store
    proc = run_cli("stats", "--storage-backends", dirs, "--json")
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout)
    assert stats["block_files"] == sum(NUM_BLOCKS)
    assert stats["block_bytes"] == sum(n * (HEADER_NBYTES + nb) for n, nb in zip(NUM_BLOCKS, NBYTES, strict=True))
    assert (stats["tmp_files"], stats["tmp_bytes"], stats["other_files"]) == (1, 10, 1)
    assert stats["by_payload_size"] == [
        {"payload_nbytes": nb, "block_files": n, "bytes": n * (HEADER_NBYTES + nb)}
        for n, nb in sorted(zip(NUM_BLOCKS, NBYTES, strict=True), key=lambda t: -t[0] * (HEADER_NBYTES + t[1]))
    ]


def test_stats_text_from_config(tmp_path: Path, two_dir_store: tuple[str, list[str]]) -> None:
    dirs, _ = two_dir_store
    cfg = tmp_path / "ucm.yaml"
    cfg.write_text(f"ucm_connectors:\n  - ucm_connector_config:\n      storage_backends: {dirs!r}\n")
    code, out = run_main("stats", "--config", str(cfg))
    assert code == 0
    assert f"block files: {sum(NUM_BLOCKS)}," in out
    assert "1000 B payload:" in out and "4099 B payload:" in out


def flip_payload_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(HEADER_NBYTES + 7)
        b = f.read(1)
        f.seek(HEADER_NBYTES + 7)
        f.write(bytes([b[0] ^ 0x01]))


def set_version(path: str, version: int) -> None:
    with open(path, "r+b") as f:
        f.seek(4)
        f.write(struct.pack("<H", version))


def test_verify_subprocess_finds_damage_and_remove_keeps_foreign(two_dir_store: tuple[str, list[str]]) -> None:
    dirs, paths = two_dir_store
    flipped, truncated, foreign = paths[0], paths[1], paths[2]
    flip_payload_byte(flipped)
    os.truncate(truncated, os.path.getsize(truncated) - 5)
    set_version(foreign, 2)

    proc = run_cli("verify", "--storage-backends", dirs)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stdout.splitlines()
    assert f"damaged: {flipped}: checksum mismatch" in lines
    assert any(line.startswith(f"damaged: {truncated}: file is ") for line in lines)
    assert any(line.startswith(f"foreign: {foreign}: format version 2") for line in lines)
    assert all(os.path.exists(p) for p in paths)  # without --remove nothing is deleted

    proc = run_cli("verify", "--storage-backends", dirs, "--remove")
    assert proc.returncode == 1, proc.stderr
    assert "2 damaged (2 removed), 1 foreign (kept)" in proc.stdout
    assert not os.path.exists(flipped) and not os.path.exists(truncated)
    assert os.path.exists(foreign)
    assert all(os.path.exists(p) for p in paths[3:])

    proc = run_cli("verify", "--storage-backends", dirs)
    assert proc.returncode == 0, proc.stdout  # only the foreign file is left to report: not a failure


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda p: os.truncate(p, 10), id="shorter-than-header"),
        pytest.param(lambda p: Path(p).write_bytes(Path(p).read_bytes() + b"\0"), id="trailing-byte"),
        pytest.param(lambda p: Path(p).write_bytes(b"XXXX" + Path(p).read_bytes()[4:]), id="bad-magic"),
        # Header says a huge payload: reported as truncated without allocating it.
        pytest.param(
            lambda p: Path(p).write_bytes(Path(p).read_bytes()[:12] + struct.pack("<Q", 1 << 60) + b"\0" * 24),
            id="huge-size",
        ),
    ],
)
def test_verify_other_damage(tmp_path: Path, damage) -> None:
    paths = dump(str(tmp_path / "kv"), 2, 1000, seed=3)
    damage(paths[0])
    code, out = run_main("verify", "--storage-backends", str(tmp_path / "kv"), "--remove")
    assert code == 1
    assert out.startswith(f"damaged: {paths[0]}: ")
    assert not os.path.exists(paths[0]) and os.path.exists(paths[1])


def test_verify_keeps_atime(tmp_path: Path) -> None:
    (path,) = dump(str(tmp_path / "kv"), 1, 1000, seed=4)
    os.utime(path, ns=(1_000_000_000, 2_000_000_000))
    assert run_main("verify", "--storage-backends", str(tmp_path / "kv"))[0] == 0
    st = os.stat(path)
    assert (st.st_atime_ns, st.st_mtime_ns) == (1_000_000_000, 2_000_000_000)


def test_gc_removes_least_recently_used_first(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    paths = dump(str(root), 6, 4096 - HEADER_NBYTES, seed=5)  # 4096-byte files
    now = time.time()
    # Ages in seconds, by file; last use = max(atime, mtime), so setting one older than the other must not matter.
    ages = [50, 10, 60, 20, 40, 30]
    for path, age in zip(paths, ages, strict=True):
        os.utime(path, (now - age, now - age - 1000))  # atime recent, mtime old: atime wins
    stale = root / f".{'0' * 32}.1.2.ab{TMP_SUFFIX}"
    young = root / f".{'1' * 32}.1.2.cd{TMP_SUFFIX}"
    stale.write_bytes(b"t")
    young.write_bytes(b"t")
    os.utime(stale, (now - 7200, now - 7200))
    (root / "notes.txt").write_text("kept")
    os.utime(root / "notes.txt", (now - 10**6, now - 10**6))

    code, out = run_main("gc", "--storage-backends", str(root), "--target-gb", str(3 * 4096 / 2**30))
    assert code == 0
    # The three oldest (60, 50, 40 s) go; the three most recent stay.
    kept = {p for p, age in zip(paths, ages, strict=True) if age < 35}
    assert {str(p) for p in blocks_on_disk(root)} == kept
    assert not stale.exists() and young.exists() and (root / "notes.txt").exists()
    assert "least recently used block files: removed 3 files, freed 12.0 KiB (12288 bytes)" in out
    assert "stale temp files: removed 1 files" in out

    # Already under the target: nothing more to do.
    code, out = run_main("gc", "--storage-backends", str(root), "--target-gb", "1")
    assert code == 0 and len(blocks_on_disk(root)) == 3
    assert "least recently used block files: removed 0 files" in out


def test_gc_falls_back_to_mtime(tmp_path: Path) -> None:
    """With atime never updated (noatime), the mtime (write time) orders the blocks."""
    root = tmp_path / "kv"
    paths = dump(str(root), 3, 4096 - HEADER_NBYTES, seed=6)
    now = time.time()
    for path, age in zip(paths, [10, 30, 20], strict=True):
        os.utime(path, (now - 10**6, now - age))
    assert run_main("gc", "--storage-backends", str(root), "--target-gb", str(2 * 4096 / 2**30))[0] == 0
    assert {str(p) for p in blocks_on_disk(root)} == {paths[0], paths[2]}


def test_clear_needs_yes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "kv"
    paths = dump(str(root), 4, 100, seed=7)
    with pytest.raises(SystemExit) as exc:
        run_main("clear", "--storage-backends", str(root))
    assert exc.value.code == 2
    assert "--yes" in capsys.readouterr().err
    assert all(os.path.exists(p) for p in paths)

    (root / "keep.txt").write_text("kept")
    code, out = run_main("clear", "--storage-backends", str(root), "--yes")
    assert code == 0
    assert blocks_on_disk(root) == [] and (root / "keep.txt").exists()
    assert "block files: removed 4 files" in out


def test_missing_dir_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    existing = tmp_path / "kv"
    existing.mkdir()
    missing = tmp_path / "nope"
    code, _ = run_main("stats", "--storage-backends", f"{existing}:{missing}")
    assert code == 2
    assert f"storage directory {str(missing)!r} does not exist" in capsys.readouterr().err


def test_location_required(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert run_main("stats")[0] == 2
    assert "--storage-backends" in capsys.readouterr().err
    code, _ = run_main("stats", "--config", str(tmp_path / "missing.yaml"))
    assert code == 2
    assert "cannot read UCM config file" in capsys.readouterr().err


def test_stats_and_clear_by_namespace(tmp_path: Path, close_after: Closer) -> None:
    """Blocks tagged by two namespaces and untagged ones: stats groups them with each namespace's description;
    clear --namespace deletes only that namespace's blocks."""
    dirs = f"{tmp_path / 'a'}:{tmp_path / 'b'}"
    tags = {}
    paths: dict[str, list[str]] = {}
    for name, seed in (("model-a", 40), ("model-b", 41), (None, 42)):
        store = close_after(PosixStore(dirs))
        if name is not None:
            digest = bytes([seed]) * 16
            store.set_namespace(digest, {"model": name, "kv_dtype": "bfloat16", "block_size": 128})
            tags[name] = f"{namespace_tag(digest):08x}"
        keys = make_keys(3 + seed - 40, seed=seed)
        assert store.wait(store.dump(keys, make_blocks(len(keys), 512, seed=seed))).ok
        paths[str(name)] = [store.block_path(k) for k in keys]
        store.close()
    for d in ("a", "b"):
        info = json.loads((tmp_path / d / "namespaces" / f"{tags['model-a']}.json").read_text())
        assert info == {"tag": tags["model-a"], "model": "model-a", "kv_dtype": "bfloat16", "block_size": 128}
    code, text = run_main("stats", "--storage-backends", dirs, "--json")
    assert code == 0
    stats = json.loads(text)
    assert stats["other_files"] == 0  # namespace files are UCM's, not strays
    groups = {g["namespace"]: (g["block_files"], (g["info"] or {}).get("model")) for g in stats["by_namespace"]}
    assert groups == {tags["model-a"]: (3, "model-a"), tags["model-b"]: (4, "model-b"), "unknown": (5, None)}
    code, text = run_main("stats", "--storage-backends", dirs)
    assert f"{tags['model-b']}:        4 files" in text and "model=model-b" in text

    code, text = run_main("clear", "--yes", "--namespace", tags["model-b"], "--storage-backends", dirs)
    assert code == 0, text
    assert not any(os.path.exists(p) for p in paths["model-b"])
    assert all(os.path.exists(p) for p in paths["model-a"] + paths["None"])
    with pytest.raises(SystemExit):
        run_main("clear", "--yes", "--namespace", "xyz", "--storage-backends", dirs)


# -- a closed output pipe ------------------------------------------------------------------------------------------


def test_closed_pipe_ends_quietly_like_ls(two_dir_store: tuple[str, list[str]]) -> None:
    """The reader is gone before the CLI writes anything (a real pipe, its read end closed at once): the CLI ends by
    SIGPIPE, as ``ls`` does (status -SIGPIPE here, 141 in a shell), with nothing on stderr (no BrokenPipeError
    traceback)."""
    dirs, _ = two_dir_store
    for command in (["stats"], ["stats", "--json"], ["verify"]):
        proc = subprocess.Popen(
            [sys.executable, "-m", "ucm.store", *command, "--storage-backends", dirs],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()  # before the child has imported anything: its first write meets a closed pipe
        stderr = proc.stderr.read().decode()
        assert proc.wait(timeout=60) == -signal.SIGPIPE, stderr
        assert stderr == "", command


def test_shell_pipeline_into_head(two_dir_store: tuple[str, list[str]]) -> None:
    """``python -m ucm.store stats | head -1`` in a real shell: one line out, nothing on stderr, and the CLI's status
    0 (its output fit in the pipe) or 141 (SIGPIPE, as ``ls | head -1`` gets on a long listing)."""
    dirs, _ = two_dir_store
    script = (
        f"{shlex.quote(sys.executable)} -m ucm.store stats --storage-backends {shlex.quote(dirs)} | head -1; "
        'echo "status ${PIPESTATUS[0]}"'
    )
    proc = subprocess.run(["bash", "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 and lines[1] in ("status 0", "status 141"), proc.stdout
    assert proc.stderr == ""
