"""Isolation: two models and two tenants (cache_salt) on one directory never share a block; files are private to
the serving user; block keys never reach a path unescaped."""

from __future__ import annotations

import io
import os
import stat

import pytest

from tests.faults.helpers import block_files, run_ucm
from tests.helpers import MODELS_DIR
from tests.store.blocks import make_blocks
from ucm.store.cli import main, store_stats
from ucm.store.posix import PosixStore
from ucm.store.posix.scan import scan_store
from ucm.testing.models import ensure_tiny_llama


@pytest.mark.engine
def test_two_models_and_two_tenants_never_share_a_block(tiny_model, fault_prompts, tmp_path):
    """Model A and model B (same architecture, other weights), each with two tenants, serve the same prompt on one
    directory: no request hits another's blocks, and each writes its own."""
    other_model = ensure_tiny_llama(MODELS_DIR, seed=1)
    store = tmp_path / "shared"
    prompt = fault_prompts[0]
    requests = [{"prompt": prompt}, {"prompt": prompt, "cache_salt": "tenant-b"}]
    results_a, _ = run_ucm(tiny_model, store, requests)
    files_a = set(block_files(store))
    results_b, _ = run_ucm(other_model, store, requests)
    assert [r.hit_external for r in results_a + results_b] == [0, 0, 0, 0]
    assert len(files_a) == 4
    assert len(block_files(store)) == 8
    assert results_a[0].logprobs != results_b[0].logprobs  # really another model

    # Operators see the two models apart and can clear one of them.
    stats = store_stats(scan_store([str(store)]))
    by_model = {(g["info"] or {}).get("model", "").split("@")[0]: g for g in stats["by_namespace"]}  # path@#config
    assert set(by_model) == {str(tiny_model), str(other_model)}
    assert all(g["block_files"] == 4 and g["info"]["kv_dtype"] == "float32" for g in by_model.values())
    tag_b = by_model[str(other_model)]["namespace"]
    assert main(["clear", "--yes", "--namespace", tag_b, "--storage-backends", str(store)], out=io.StringIO()) == 0
    assert set(block_files(store)) == files_a


def test_files_are_private_and_keys_never_escape_the_directory(tmp_path):
    root = tmp_path / "kv"
    store = PosixStore(str(root))
    hostile = [b"../../../../etc/", b"/" * 16, b"\x00" * 16, b"..\\..\\.." + b"\x00" * 8, b"%s%n%x" + b"." * 10]
    hostile = [k.ljust(16, b".")[:16] for k in hostile]
    old = os.umask(0o022)
    try:
        assert store.wait(store.dump(hostile, make_blocks(len(hostile), 64, seed=90))).ok
    finally:
        os.umask(old)
    store.close()
    files = block_files(root)
    assert len(files) == len(hostile)
    for key, f in zip(sorted(hostile, key=bytes.hex), sorted(files, key=lambda p: p.name), strict=True):
        assert f.name == key.hex() + ".ucmb"
        assert f.resolve().is_relative_to(root.resolve())
        assert stat.S_IMODE(f.stat().st_mode) == 0o600
        assert stat.S_IMODE(f.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE(f.parent.parent.stat().st_mode) == 0o700
    with pytest.raises(ValueError, match="16 bytes"):
        store_path_check = PosixStore(str(root))
        try:
            store_path_check.lookup([b"../x"])
        finally:
            store_path_check.close()
