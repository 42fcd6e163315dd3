"""A slow and a hung store under the real engine: the store directory is a FUSE mount (``ucm.testing.fusefs``, a
passthrough over a directory, in its own process) whose daemon adds a delay to every read, then is stopped with
SIGSTOP, which hangs every access that reaches it exactly as a dead NFS server does.

One engine per transfer mode (``Posix`` only, so every hit is read through the mount; ``load_timeout_ms`` small):
1. two prompts cold: their blocks are written through the mount;
2. both again: storage hits through slow reads (each read delayed, below the deadline), outputs identical;
3. daemon stopped; a stored prompt again: the kernel still answers its ``stat`` from its attribute cache (as an NFS
   client does), so the lookup hits and the load's ``open`` hangs: past ``load_timeout_ms`` its blocks are reported
   failed and recomputed, the output identical, within the deadline plus a margin;
4. still stopped, a prompt never stored: the lookup's ``stat`` reaches the stopped daemon and hangs: past the deadline
   the lookup is a miss, the prompt recomputed;
5. daemon resumed: a stored prompt is a storage hit again, output identical (later loads use a fresh load buffer).

``tests/store/test_stalled_mount.py`` checks the Posix stage's bounded lookup and the store tasks' timeouts on the
same mount without an engine.

The mount is always unmounted (the daemon resumed first), whatever the test's outcome, and a watchdog resumes the
daemon after ``WATCHDOG_S`` (a failure), so an engine blocked on the mount cannot hang the suite. Skipped only where
the kernel has no FUSE (``/dev/fuse`` absent).
"""

from __future__ import annotations

import os
import re

import pytest

from tests.faults.helpers import engine_spec, wait_for_blocks_cmd, warnings_of
from tests.helpers import assert_same_output
from ucm.testing import fusefs
from ucm.testing.engine import failed_loads, run_engine

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="/dev/fuse is absent: no FUSE mount can be made"),
]

LOAD_TIMEOUT_MS = 1500
READ_DELAY_MS = 100  # per read request; a block file takes a few, in parallel across files: well below the deadline
MARGIN_MS = 8000  # a request past its deadline: the recompute of one short prompt, on a loaded 2-core machine
ATTR_CACHE_S = 600  # longer than the test: a name the kernel has seen is stat-ed without the daemon
ENGINE_TIMEOUT_S = 600
# The daemon is resumed by then whatever the engine does (the engine's own commands stop and resume it): an engine
# blocked on the mount fails the test instead of hanging the suite (a killed process still waits for a request the
# stopped daemon had read).
WATCHDOG_S = 300
LOAD_MS_RE = re.compile(r"(?:loaded \d+ blocks into .*: store|layerwise load of \d+ blocks .*?:) ([\d.]+) ms")


def _spec(tiny_model, mountpoint, prompts, layerwise: bool):
    spec = engine_spec(tiny_model, mountpoint, prompts, store_pipeline="Posix")
    extra = spec["connector"]["kv_connector_extra_config"]
    extra.update(load_timeout_ms=LOAD_TIMEOUT_MS, use_layerwise=layerwise)
    return spec


@pytest.fixture(params=["blockwise", "layerwise"])
def stalled(request, tiny_model, fault_prompts, tmp_path):
    """Run the five steps (module doc) through one engine; the mount is cleaned up whatever happens."""
    reason = fusefs.unavailable_reason()
    if reason is not None and os.path.exists("/dev/fuse"):
        pytest.fail(f"FUSE is available but its user-space part is not: {reason} (make setup installs it)")
    source, mountpoint = tmp_path / "source", tmp_path / "mnt"
    source.mkdir()
    p0, p1, p2 = fault_prompts[0], fault_prompts[1], fault_prompts[2]
    with (
        fusefs.mount(source, mountpoint, read_delay_ms=READ_DELAY_MS, attr_timeout_s=ATTR_CACHE_S) as daemon,
        fusefs.resumed_after(daemon.pid, WATCHDOG_S) as watchdog_fired,
    ):
        requests = [
            p0,
            p1,
            {"prompt": p0, "before_cmd": wait_for_blocks_cmd(source, 4)},  # written back: checked beside the mount
            p1,
            {"prompt": p1, "before_cmd": f"kill -STOP {daemon.pid}"},
            p2,
            {"prompt": p0, "before_cmd": f"kill -CONT {daemon.pid} && sleep 1"},
        ]
        results, stderr = run_engine(
            _spec(tiny_model, mountpoint, requests, request.param == "layerwise"),
            env={"UC_LOGGER_LEVEL": "DEBUG"},
            timeout_s=ENGINE_TIMEOUT_S,
            log_path=tmp_path / "engine.log",  # kept by pytest: what the engine said, when a check fails
        )
    assert not os.path.ismount(mountpoint)
    if watchdog_fired.is_set():
        pytest.fail(f"the FUSE daemon was still stopped after {WATCHDOG_S} s: the engine hung on it:\n{stderr[-6000:]}")
    return results, stderr


def test_slow_then_hung_mount(stalled, baseline):
    results, stderr = stalled
    want = [baseline[i] for i in (0, 1, 0, 1, 1, 2, 0)]
    for got, ref in zip(results, want, strict=True):
        assert_same_output(got, ref)
    # 1-2: cold, then storage hits through slow reads (each load took at least one read delay)
    assert [r.hit_external for r in results[:4]] == [0, 0, 2, 2]
    load_ms = [float(ms) for ms in LOAD_MS_RE.findall(stderr)]
    assert len(load_ms) >= 2 and all(ms >= READ_DELAY_MS for ms in load_ms[:2]), load_ms
    # 3: the lookup hit, the load hung: failed past the deadline, recomputed, in time
    assert results[4].hit_external == 2
    timeouts = warnings_of(stderr, "did not finish within load_timeout_ms")
    load_timeouts = [w for w in timeouts if w.split("[UC][W] ", 1)[1].startswith("load of 2 blocks")]
    assert len(load_timeouts) == 1, timeouts
    assert f"({LOAD_TIMEOUT_MS} ms)" in load_timeouts[0]
    assert LOAD_TIMEOUT_MS <= results[4].wall_ms < LOAD_TIMEOUT_MS + MARGIN_MS
    assert failed_loads(stderr) == 0  # the deadline's warning is its own, not a damaged block's
    # 4: the lookup hung: a miss past the deadline, recomputed, in time
    assert results[5].hit_external == 0
    assert len(warnings_of(stderr, "posix store: a lookup of")) == 1
    assert LOAD_TIMEOUT_MS <= results[5].wall_ms < LOAD_TIMEOUT_MS + MARGIN_MS
    # 5: resumed: a storage hit again
    assert results[6].hit_external == 2
