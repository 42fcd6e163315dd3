"""Tests of ``benchmarks/plots.py`` and of the plots ``e2e_ttft.py`` and ``storage_hits.py`` draw from their JSON
summaries: a valid PNG from small made-up summaries, and clear errors for what cannot be drawn. No timing."""

from __future__ import annotations

import math
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.benchmarks import load_script

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MACHINE = {"cpu_model": "Test CPU", "cpu_count": 2, "processor": "x86_64"}
VERSIONS = {"vllm": "0.32.0+cpu", "torch": "2.13.0+cpu", "ucm": "0.1.0"}


@pytest.fixture(scope="module")
def plots() -> ModuleType:
    return load_script("plots")


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) in pixels of a PNG, read back with matplotlib (which fails on a broken file)."""
    import matplotlib.image

    image = matplotlib.image.imread(path)
    return image.shape[1], image.shape[0]


def assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_MAGIC
    width, height = png_size(path)
    assert width > 300 and height > 100


@pytest.mark.parametrize(
    "samples",
    [
        {"blockwise": [310.0, 322.5, 330.0, 318.0, 341.0], "layerwise": [300.0, 305.0, 297.0], "recompute": [2400.0]},
        {"a": [12.0, 11.0], "b": [13.5, 14.0, 12.5]},
        {"only": [0.0]},
    ],
    ids=["log-scale", "linear", "zero-sample"],
)
def test_ttft_boxplot_writes_a_png(plots: ModuleType, tmp_path: Path, samples: dict[str, list[float]]) -> None:
    path = plots.ttft_boxplot(samples, tmp_path / "ttft.png", title="made up", note="machine, date, command")
    assert path == tmp_path / "ttft.png"
    assert_png(path)
    taller = plots.ttft_boxplot({**samples, "more": [1.0], "even more": [2.0]}, tmp_path / "taller.png", title="t")
    assert png_size(taller)[1] > png_size(path)[1]  # one row per variant


@pytest.mark.parametrize(
    ("samples", "message"),
    [
        ({}, "no variant to plot"),
        ({"blockwise": []}, "variant 'blockwise' has no TTFT sample"),
        ({"blockwise": [1.0, math.nan]}, "variant 'blockwise': TTFT sample nan is not a finite number of ms >= 0"),
        ({"x": [-1.0]}, "variant 'x': TTFT sample -1.0 is not a finite number of ms >= 0"),
        ({"x": ["12"]}, "variant 'x': TTFT sample '12' is not a finite number of ms >= 0"),
    ],
    ids=["no-variant", "empty-variant", "nan", "negative", "string"],
)
def test_what_cannot_be_drawn_is_named(plots: ModuleType, tmp_path: Path, samples: Any, message: str) -> None:
    with pytest.raises(ValueError) as info:
        plots.ttft_boxplot(samples, tmp_path / "bad.png", title="t")
    assert message in str(info.value)
    assert not (tmp_path / "bad.png").exists()


def test_png_beside_the_json(plots: ModuleType) -> None:
    assert plots.png_beside("out/results.json") == Path("out/results.png")


def test_storage_hits_plots_its_summary(tmp_path: Path) -> None:
    bench = load_script("storage_hits")
    summary = {
        "model": "SmolLM2-135M-Instruct",
        "prompt_full_blocks": 15,
        "date": "2026-12-04T20:30:00+00:00",
        "command": "benchmarks/storage_hits.py --rounds 3",
        "variants": {
            "blockwise": {"ttft_ms": [315.0, 320.1, 330.4]},
            "layerwise": {"ttft_ms": [300.2, 310.0, 305.5]},
            "recompute": {"ttft_ms": [2498.0, 2510.3, 2470.9]},
        },
        "machine": MACHINE,
        "versions": VERSIONS,
    }
    assert_png(bench.write_plot(summary, tmp_path / "storage_hits.png"))


def test_storage_hits_command_leaves_out_where_the_output_went() -> None:
    bench = load_script("storage_hits")
    argv = ["--rounds", "5", "--out", "/tmp/x.json", "--plot=/tmp/x.png", "--variants", "blockwise", "recompute"]
    assert bench.measured_command(argv) == "benchmarks/storage_hits.py --rounds 5 --variants blockwise recompute"


def test_e2e_ttft_plots_its_summary(tmp_path: Path) -> None:
    bench = load_script("e2e_ttft")
    summary = {
        "prompt_tokens": 1941,
        "repeats": 3,
        "restarts": 1,
        "engine_core": "process",
        "date": "2026-12-04T20:30:00+00:00",
        "ttft_samples_ms": {
            "recompute": [1079.0, 1090.0, 1075.5],
            "UCM DRAM hit": [95.0, 99.0, 97.0],
            "UCM storage hit": [108.0],
        },
        "machine": MACHINE,
        "versions": VERSIONS,
    }
    assert_png(bench.write_plot(summary, tmp_path / "e2e_ttft.png"))
