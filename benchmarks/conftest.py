"""pytest-benchmark runs of the kernels: ``pytest benchmarks/ --benchmark-only`` (``bench_*.py`` files; the
project's ``testpaths`` is ``tests``, so ``make test`` never collects them).

Options: ``--big`` (or ``UCM_BENCH_BIG=1``) for the full sizes of ``benchmarks/kernels.py`` instead of the small
default that finishes in minutes on 2 CPUs; ``--bench-device cpu|cuda`` (default: CUDA where present).
Compare runs with pytest-benchmark's own ``--benchmark-autosave`` / ``--benchmark-compare``; each result carries
GB/s and the ratio to a plain copy of the same bytes in ``extra_info``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kernel_timing import resolve_device


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ucm kernel benchmarks")
    group.addoption(
        "--big", action="store_true", help="full model sizes (as benchmarks/kernels.py); also UCM_BENCH_BIG=1"
    )
    group.addoption("--bench-device", default=None, choices=["cpu", "cuda"], help="device (default: cuda if present)")


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    """Collect ``bench_<op family>.py`` here (the benchmark of ``ucm/kernels/<op family>/``) besides ``test_*.py``;
    a file named on the command line is collected by pytest itself."""
    if file_path.suffix == ".py" and file_path.name.startswith("bench_") and not parent.session.isinitpath(file_path):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


@pytest.fixture(scope="session")
def bench_device(request: pytest.FixtureRequest) -> torch.device:
    return resolve_device(request.config.getoption("--bench-device"))


_ROWS_KEY = pytest.StashKey[list[dict[str, object]]]()


@pytest.fixture(scope="session")
def bench_rows(request: pytest.FixtureRequest) -> list[dict[str, object]]:
    """Where each benchmark leaves its figures for the summary table at the end of the run."""
    return request.config.stash.setdefault(_ROWS_KEY, [])


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """GB/s and the paired ratio to a plain copy of each case (pytest-benchmark's own table shows times only)."""
    rows = config.stash.get(_ROWS_KEY, [])
    if not rows:
        return
    terminalreporter.section("kernel GB/s and ratio to a plain copy of the same bytes")
    terminalreporter.write_line(
        f"{'op':18} {'layout':13} {'model':17} {'blocks':>6} {'MiB':>8} {'GB/s':>8} {'copy GB/s':>9} {'ratio':>6}"
    )
    for r in rows:
        terminalreporter.write_line(
            f"{r['op']!s:18} {r['layout']!s:13} {r['model']!s:17} {r['blocks']!s:>6} "
            f"{int(r['bytes']) / 2**20:>8.1f} {r['gbps']!s:>8} {r['copy_gbps']!s:>9} {r['ratio']!s:>6}"  # type: ignore[call-overload]
        )
