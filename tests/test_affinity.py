"""UCM's threads run on every CPU of the process, whatever core the thread that started them is bound to."""

from __future__ import annotations

import os

import pytest

from ucm.affinity import _cpu_list, daemon_thread, thread_pool

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux thread affinity")


@pytest.fixture
def bound_to_one_cpu():
    """The calling thread bound to one CPU, as vLLM's CPU worker binds its main thread (OpenMP thread 0)."""
    before = os.sched_getaffinity(0)
    if len(before) < 2:
        pytest.skip("needs 2 CPUs to tell a bound thread from a free one")
    os.sched_setaffinity(0, {min(before)})
    yield min(before), before
    os.sched_setaffinity(0, before)


def test_pool_threads_started_from_a_bound_thread_use_every_cpu(bound_to_one_cpu):
    cpu, everything = bound_to_one_cpu
    pool = thread_pool(2, "ucm-test")
    try:
        seen = {frozenset(s) for s in pool.map(lambda _: os.sched_getaffinity(0), range(8))}
    finally:
        pool.shutdown()
    assert seen == {frozenset(everything)}
    assert os.sched_getaffinity(0) == {cpu}  # the caller keeps its own binding


def test_daemon_thread_widens_itself(bound_to_one_cpu):
    cpu, everything = bound_to_one_cpu
    seen: list[set[int]] = []

    def target() -> None:
        seen.append(os.sched_getaffinity(0))

    t = daemon_thread(target, "ucm-test")
    t.start()
    t.join()
    assert seen == [everything]
    assert os.sched_getaffinity(0) == {cpu}


def test_cpu_list_format():
    assert _cpu_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    assert _cpu_list({3}) == "3"


def test_ucm_threads_run_torch_single_threaded_and_leave_the_callers_count():
    """A torch operator on a UCM thread runs on that thread alone (no second OpenMP team competing with the model's
    threads); the thread that started it keeps its own count."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        pool = thread_pool(1, "ucm-test")
        try:
            seen = pool.submit(lambda: (torch.get_num_threads(), torch.ones(1 << 22).sum().item())).result()
        finally:
            pool.shutdown()
        daemon_seen: list[int] = []
        t = daemon_thread(lambda: daemon_seen.append(torch.get_num_threads()), "ucm-test")
        t.start()
        t.join()
        assert seen == (1, float(1 << 22))
        assert daemon_seen == [1]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
