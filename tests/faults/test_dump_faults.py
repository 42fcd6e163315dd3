"""Faults on the dump path while the real engine serves: a full filesystem, a read-only one, permissions taken away
and given back, a write error, the storage directory deleted / replaced by a file and restored.

Each fault must leave the engine serving with output identical to the no-cache run, warn once per kind, leave no
temp file or partial block behind, and resume caching when the fault is gone. Faults are real (a small tmpfs, a
read-only remount, chmod under an engine without permission-bypassing capabilities, rm -rf while serving) except
EIO, which is injected (``inject/sitecustomize.py``).
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.faults.helpers import (
    NO_DAC_OVERRIDE,
    block_files,
    block_path,
    can_drop_dac_override,
    run_ucm,
    temp_files,
    wait_for_blocks_cmd,
    warnings_of,
)
from tests.helpers import assert_same_output
from ucm.store.cli import verify_file
from ucm.testing.engine import failed_loads

pytestmark = pytest.mark.engine

BLOCK_FILE_NBYTES = 131072 + 44  # the tiny model's block: 2 layers x K,V x 128 tokens x 2 heads x 32 x fp32


def _infos(stderr: str, needle: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if "[UC][I]" in ln and needle in ln]


def _assert_all_valid(store) -> None:
    assert not temp_files(store), "a temp file was left behind"
    for f in block_files(store):
        assert verify_file(str(f))[0] is None, f


def test_full_filesystem_then_read_only(tiny_model, fault_prompts, baseline, filled_store, tmp_path, mounted):
    """ENOSPC: a 600 KiB tmpfs holds 4 of the 8 blocks of 4 prompts; serving goes on, one warning. EROFS: the
    filesystem is remounted read-only while serving; dumps warn once. A restart (read-write again, still full)
    loads the stored blocks exactly."""
    keys = filled_store[1]
    store = tmp_path / "small_fs"
    mounted(["-t", "tmpfs", "-o", "size=600k,mode=0700", "tmpfs"], store)
    remount_ro = f"{wait_for_blocks_cmd(store, 1)} && sleep 0.5 && mount -o remount,ro {store}"
    prompts = [*fault_prompts[:4], {"prompt": fault_prompts[4], "before_cmd": remount_ro}]
    results, stderr = run_ucm(tiny_model, store, prompts)
    for got, want in zip(results, baseline, strict=False):
        assert_same_output(got, want)
    assert len(warnings_of(stderr, "No space left on device")) == 1
    assert len(warnings_of(stderr, "Read-only file system")) == 1
    stored = block_files(store)
    assert 1 <= len(stored) < 8
    _assert_all_valid(store)

    subprocess.run(["mount", "-o", "remount,rw", str(store)], check=True)
    results, stderr = run_ucm(tiny_model, store, fault_prompts[:5])
    for got, want in zip(results, baseline, strict=False):
        assert_same_output(got, want)
    assert failed_loads(stderr) == 0
    for i, r in enumerate(results):
        leading = 0
        while leading < 2 and block_path(store, keys[i][leading]).exists():
            leading += 1
        assert r.hit_external == leading
    assert sum(r.hit_external for r in results) >= 1
    _assert_all_valid(store)


def test_consumer_serves_from_a_read_only_mount(tiny_model, fault_prompts, baseline, filled_store, tmp_path, mounted):
    """A decode instance (kv_consumer) may see the shared store through a read-only mount: it starts, loads every
    stored block and answers as without a cache; an instance that dumps (kv_both) is refused at start, naming why."""
    store = tmp_path / "ro"
    mounted(["-t", "tmpfs", "-o", "size=64m,mode=0700", "tmpfs"], store)
    shutil.copytree(filled_store[0], store, dirs_exist_ok=True, copy_function=shutil.copy2)
    subprocess.run(["mount", "-o", "remount,ro", str(store)], check=True)
    before = sorted((p, p.stat().st_mtime_ns) for p in block_files(store))

    results, stderr = run_ucm(tiny_model, store, fault_prompts, kv_role="kv_consumer")
    for got, want in zip(results, baseline, strict=True):
        assert_same_output(got, want)
    assert [r.hit_external for r in results] == [2] * len(fault_prompts)
    assert failed_loads(stderr) == 0
    assert f"storage backend {store} is read-only: blocks are only loaded from it" in stderr
    assert not warnings_of(stderr, ""), warnings_of(stderr, "")
    assert sorted((p, p.stat().st_mtime_ns) for p in block_files(store)) == before

    with pytest.raises(RuntimeError, match="is not writable \\(a read-only store can only serve kv_role: kv_consumer"):
        run_ucm(tiny_model, store, fault_prompts[:1])


def test_permission_denied_and_write_error_while_serving(tiny_model, fault_prompts, baseline, filled_store, tmp_path):
    """EACCES: the store is made read-only (chmod) between requests and writable again later; EIO: one block's
    write fails. The engine runs without the capabilities that bypass file permissions."""
    if not can_drop_dac_override():
        pytest.skip("needs root and setpriv so that chmod really denies the engine")
    keys = filled_store[1]
    store = tmp_path / "store"
    prompts = [
        fault_prompts[0],
        {"prompt": fault_prompts[1], "before_cmd": f"{wait_for_blocks_cmd(store, 2)} && chmod -R a-w {store}"},
        fault_prompts[2],
        {"prompt": fault_prompts[3], "before_cmd": f"chmod -R u+w {store}"},
        fault_prompts[4],
    ]
    results, stderr = run_ucm(
        tiny_model,
        store,
        prompts,
        store_pipeline="Posix",
        faults={"write_eio": [keys[4][0]]},
        wrapper=NO_DAC_OVERRIDE,
    )
    for got, want in zip(results, baseline, strict=False):
        assert_same_output(got, want)
    assert len(warnings_of(stderr, "Permission denied")) == 1
    assert len(warnings_of(stderr, "Input/output error")) == 1
    assert _infos(stderr, "write works again")
    present = {i: [block_path(store, k).exists() for k in keys[i]] for i in range(5)}
    assert present == {0: [True, True], 1: [False, False], 2: [False, False], 3: [True, True], 4: [False, True]}
    _assert_all_valid(store)


def test_storage_directory_deleted_replaced_and_restored(tiny_model, fault_prompts, baseline, filled_store, tmp_path):
    """The storage directory is deleted while serving (ENOENT), then a file takes its place (ENOTDIR), then it
    comes back: serving never stops, each kind warns once, caching resumes; the deleted blocks are misses."""
    keys = filled_store[1]
    store = tmp_path / "store"
    prompts = [
        fault_prompts[0],
        {"prompt": fault_prompts[1], "before_cmd": f"{wait_for_blocks_cmd(store, 2)} && rm -rf {store}"},
        {"prompt": fault_prompts[2], "before_cmd": f"touch {store}"},
        {"prompt": fault_prompts[3], "before_cmd": f"rm {store} && mkdir {store}"},
        fault_prompts[0],
    ]
    results, stderr = run_ucm(tiny_model, store, prompts, store_pipeline="Posix")
    for got, want in zip(results, [baseline[i] for i in (0, 1, 2, 3, 0)], strict=True):
        assert_same_output(got, want)
    assert len(warnings_of(stderr, "No such file or directory")) == 1
    assert len(warnings_of(stderr, "Not a directory")) == 1
    assert _infos(stderr, "write works again")
    present = {i: [block_path(store, k).exists() for k in keys[i]] for i in range(4)}
    # Prompt 0's blocks went with the directory; its second request found them missing (a failed load: the engine
    # had seen them stored), recomputed them and stored them again.
    assert present == {0: [True, True], 1: [False, False], 2: [False, False], 3: [True, True]}
    _assert_all_valid(store)


def test_storage_unmounted_and_mounted_again(tiny_model, fault_prompts, baseline, filled_store, tmp_path, mounted):
    """The storage filesystem is unmounted while serving: nothing is written onto the bare mount point (ENODEV,
    one warning); mounted again, caching resumes and the blocks written before are hits again."""
    keys = filled_store[1]
    backing = tmp_path / "backing"
    mounted(["-t", "tmpfs", "-o", "size=64m,mode=0700", "tmpfs"], backing)
    store = tmp_path / "store"
    mounted(["--bind", str(backing)], store)
    prompts = [
        fault_prompts[0],
        {"prompt": fault_prompts[1], "before_cmd": f"{wait_for_blocks_cmd(store, 2)} && umount -l {store}"},
        {"prompt": fault_prompts[2], "before_cmd": f"mount --bind {backing} {store}"},
        fault_prompts[0],
    ]
    results, stderr = run_ucm(tiny_model, store, prompts, store_pipeline="Posix")
    for got, want in zip(results, [baseline[i] for i in (0, 1, 2, 0)], strict=True):
        assert_same_output(got, want)
    assert len(warnings_of(stderr, "unmounted?")) == 1
    assert _infos(stderr, "write works again")
    assert results[3].hit_external == 2 and failed_loads(stderr) == 0
    present = {i: [block_path(backing, k).exists() for k in keys[i]] for i in range(3)}
    assert present == {0: [True, True], 1: [False, False], 2: [True, True]}
    subprocess.run(["umount", "-l", str(store)], check=True)
    assert not list(store.iterdir()), "blocks were written onto the bare mount point"
