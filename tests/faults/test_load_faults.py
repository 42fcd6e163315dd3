"""Faults on the load path: damaged, foreign, unreadable and missing block files, served by the real engine.

One engine fills a store with ``NUM_PROMPTS`` prompts; each prompt's block file is then damaged in its own way;
a second engine (a restart) serves every prompt again. Every fault must end as a recompute with output identical
to the no-cache run, a damaged file must be removed (so the block can be stored again) and a file of another
format kept. The second engine runs as root without the capabilities that bypass file permissions, so a file with
mode 000 is really unreadable (EACCES); EIO is the one injected fault (see ``inject/sitecustomize.py``).
"""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.faults.helpers import (
    NO_DAC_OVERRIDE,
    NUM_PROMPTS,
    block_path,
    can_drop_dac_override,
    copy_store,
    run_ucm,
    warnings_of,
)
from tests.helpers import assert_same_output
from ucm.store.cli import verify_file
from ucm.store.posix import HEADER_NBYTES
from ucm.testing.engine import failed_loads

pytestmark = pytest.mark.engine


@dataclass(frozen=True)
class LoadFault:
    """A fault on one block file of one prompt: ``block`` (0 or 1) of the prompt, what ``damage`` does to the
    file, how many blocks the restarted engine's lookup finds (``hit``) and whether the load fails, and what must
    be left at the path: ``"stored again"`` (the damaged file removed, the block recomputed and dumped again: a
    valid file) or ``"kept"`` (unchanged: not UCM's to delete, or unreadable)."""

    name: str
    block: int
    damage: Callable[[Path, Path], None]  # (block file, another prompt's block file of the same size)
    hit: int
    load_fails: bool
    left: str
    warning: str


def _flip_payload_byte(path: Path, _other: Path) -> None:
    data = bytearray(path.read_bytes())
    data[HEADER_NBYTES + len(data) // 3] ^= 0x40
    path.write_bytes(bytes(data))


def _truncate(path: Path, _other: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _zero_length(path: Path, _other: Path) -> None:
    os.truncate(path, 0)


def _bad_magic(path: Path, _other: Path) -> None:
    with open(path, "r+b") as f:
        f.write(b"XXXX")


def _other_block(path: Path, other: Path) -> None:
    shutil.copyfile(other, path)


def _trailing_bytes(path: Path, _other: Path) -> None:
    with open(path, "ab") as f:
        f.write(b"\0" * 17)


def _future_version(path: Path, _other: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(4)
        f.write(struct.pack("<H", 2))


def _directory(path: Path, _other: Path) -> None:
    path.unlink()
    path.mkdir()


def _mode_000(path: Path, _other: Path) -> None:
    path.chmod(0)


def _leave(_path: Path, _other: Path) -> None:  # EIO is injected at read time
    pass


def _delete(path: Path, _other: Path) -> None:
    path.unlink()


def _symlink_to_other(path: Path, other: Path) -> None:
    path.unlink()
    path.symlink_to(other)


FAULTS = [
    LoadFault("payload bit flip", 0, _flip_payload_byte, 2, True, "stored again", "checksum mismatch"),
    LoadFault("truncated file", 1, _truncate, 2, True, "stored again", "bytes, expected"),
    LoadFault("zero-length file", 0, _zero_length, 2, True, "stored again", "shorter than the 44-byte header"),
    LoadFault("bad magic", 0, _bad_magic, 2, True, "stored again", "bad magic"),
    LoadFault("another block's file", 0, _other_block, 2, True, "stored again", "file holds key"),
    LoadFault("trailing bytes", 1, _trailing_bytes, 2, True, "stored again", "bytes, expected"),
    LoadFault("newer format version", 0, _future_version, 2, True, "kept", "format version 2"),
    # Not a regular file: a lookup miss (never opened), replaced by the recomputed block's dump.
    LoadFault("directory in place of the file", 0, _directory, 0, False, "stored again", ""),
    LoadFault("unreadable file (EACCES)", 0, _mode_000, 2, True, "kept", "Permission denied"),
    LoadFault("read error (EIO, injected)", 0, _leave, 2, True, "kept", "Input/output error"),
    LoadFault("missing file", 1, _delete, 1, False, "stored again", ""),
    LoadFault("symlink to another block", 0, _symlink_to_other, 2, True, "stored again", "file holds key"),
]
assert len(FAULTS) == NUM_PROMPTS
EIO_PROMPT = next(i for i, f in enumerate(FAULTS) if f.name.startswith("read error"))


@pytest.fixture(scope="module")
def served(tiny_model, fault_prompts, filled_store, tmp_path_factory):
    """Copy the filled store, damage one block per prompt, serve all prompts from a restarted engine."""
    if not can_drop_dac_override():
        pytest.skip("needs root and setpriv to make a mode-000 file unreadable to the engine")
    store = copy_store(filled_store, tmp_path_factory.mktemp("load_faults") / "store")
    keys = filled_store[1]
    files = [[block_path(store, h) for h in ks] for ks in keys]
    before: dict[int, bytes] = {}
    for i, fault in enumerate(FAULTS):
        path = files[i][fault.block]
        j = (i + 1) % NUM_PROMPTS
        fault.damage(path, files[j][1 - FAULTS[j].block])  # a block no fault touches
        if fault.left == "kept" and path.is_file() and path.stat().st_mode & 0o400:
            before[i] = path.read_bytes()
    results, stderr = run_ucm(
        tiny_model,
        store,
        fault_prompts,
        faults={"read_eio": [keys[EIO_PROMPT][FAULTS[EIO_PROMPT].block]]},
        wrapper=NO_DAC_OVERRIDE,
    )
    return files, before, results, stderr


@pytest.mark.parametrize("index", range(NUM_PROMPTS), ids=[f.name for f in FAULTS])
def test_load_fault_is_a_recompute_with_identical_output(served, baseline, index):
    files, before, results, stderr = served
    fault = FAULTS[index]
    assert_same_output(results[index], baseline[index])
    assert results[index].hit_external == fault.hit
    path = files[index][fault.block]
    if fault.left == "stored again":  # removed as damaged (or missing), recomputed, dumped again: healed
        assert not path.is_symlink()
        assert path.is_file() and verify_file(str(path))[0] is None
    elif fault.left == "kept":
        assert path.exists()
        if index in before:
            assert path.read_bytes() == before[index]
    else:
        raise AssertionError(fault.left)
    if fault.warning:
        assert warnings_of(stderr, fault.warning), f"no warning naming {fault.warning!r}"


def test_every_failed_load_was_reported_to_vllm(served):
    _, _, _, stderr = served
    assert failed_loads(stderr) == sum(f.load_fails for f in FAULTS)


def test_each_read_error_kind_warns_once(served):
    _, _, _, stderr = served
    for needle in ("Permission denied", "Input/output error"):
        assert len(warnings_of(stderr, needle)) == 1, needle
