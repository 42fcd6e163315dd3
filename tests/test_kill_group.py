"""``ucm.testing.server.kill_group``, which tests use to find and stop servers a script left behind: a live process
group is killed and reported, a group whose only process is a zombie (dead, not yet reaped) is not reported as left
running. Real processes, no mocks."""

from __future__ import annotations

import subprocess
import time

from ucm.testing.server import _group_pids, kill_group


def test_a_live_group_is_killed_and_reported() -> None:
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        assert kill_group(proc.pid) is True
        assert proc.wait(timeout=10) == -9
    finally:
        proc.kill()
        proc.wait()


def test_a_group_of_one_zombie_is_not_left_running() -> None:
    proc = subprocess.Popen(["true"], start_new_session=True)  # exits at once; not reaped until wait() below
    try:
        deadline = time.monotonic() + 10
        while _group_pids(proc.pid):  # live until it has exited; then a zombie, which _group_pids leaves out
            assert time.monotonic() < deadline, "the child did not exit"
            time.sleep(0.05)
        assert kill_group(proc.pid) is False  # killpg(pgid, 0) still succeeds here: the zombie is in the group
    finally:
        proc.wait()
    assert kill_group(proc.pid) is False  # reaped: no such group
