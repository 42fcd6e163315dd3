"""TTFT per variant as a PNG, written beside a benchmark's JSON summary (``benchmarks/e2e_ttft.py``,
``benchmarks/storage_hits.py``).

One horizontal box per variant: the box spans the quartiles (25th to 75th percentile), the line inside it is the
median (its value printed beside the box), the whiskers reach the smallest and the largest sample, and every sample
is drawn as a dot, so a variant measured a few times shows its few points rather than a box that suggests more.
The axis starts at 0 ms, so lengths compare, unless the medians differ by more than :data:`LOG_SCALE_RATIO` (a
recompute beside storage hits): then it is logarithmic, so that each box stays readable, and the label says so.

matplotlib (a ``dev`` dependency, installed by ``make setup``) is imported when a plot is drawn, with its
non-interactive ``Agg`` backend; importing this module costs nothing.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

FIG_WIDTH_IN = 7.5
ROW_HEIGHT_IN = 0.42
DPI = 100
NOTE_LINE_IN = 0.13  # height of a line of the 7-point note under the axis
NOTE_WRAP_CHARS = 125
LOG_SCALE_RATIO = 4.0  # largest / smallest median above which the axis is logarithmic


def check_samples(samples: Mapping[str, Sequence[float]]) -> None:
    """Validate what :func:`ttft_boxplot` draws.

    Raises:
        ValueError: no variant, a variant with no sample, or a sample that is not a finite number >= 0 (naming the
            variant and the value).
    """
    if not samples:
        raise ValueError("no variant to plot: give at least one variant with its TTFT samples (ms)")
    for name, values in samples.items():
        if len(values) == 0:
            raise ValueError(f"variant {name!r} has no TTFT sample; give at least one, or leave the variant out")
        for v in values:
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise ValueError(f"variant {name!r}: TTFT sample {v!r} is not a finite number of ms >= 0")


def ttft_boxplot(
    samples: Mapping[str, Sequence[float]],
    path: str | Path,
    *,
    title: str,
    note: str = "",
    log_scale: bool | None = None,
) -> Path:
    """Write a PNG of the TTFT samples (ms) of each variant, in the mapping's order, top to bottom (see the module
    docstring for what is drawn).

    Args:
        samples: variant name -> its TTFT samples in ms (at least one each).
        path: the PNG to write (its directory must exist).
        title: the plot's title (what was measured).
        note: a line under the axis, e.g. machine, date and command.
        log_scale: a logarithmic TTFT axis; None: when the medians differ by more than :data:`LOG_SCALE_RATIO`
            (a sample of 0 ms keeps the axis linear).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ValueError: bad ``samples`` (see :func:`check_samples`).
        OSError: the file cannot be written.
    """
    check_samples(samples)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    names = list(samples)
    data = [sorted(float(v) for v in samples[n]) for n in names]
    legend = "box: quartiles; red line: median; whiskers: min and max; dots: every sample"
    note_lines = [legend, *textwrap.wrap(note, NOTE_WRAP_CHARS)]
    height = 1.4 + ROW_HEIGHT_IN * len(names) + NOTE_LINE_IN * len(note_lines)
    fig, ax = plt.subplots(figsize=(FIG_WIDTH_IN, height))
    try:
        positions = list(range(len(names), 0, -1))  # the first variant on top
        ax.boxplot(
            data,
            positions=positions,
            orientation="horizontal",
            whis=(0, 100),  # whiskers at min and max: no sample is hidden as an "outlier"
            widths=0.55,
            showfliers=False,
            patch_artist=True,
            boxprops={"facecolor": "#cfe0f3", "edgecolor": "#1f4e79"},
            medianprops={"color": "#c0392b", "linewidth": 2},
            whiskerprops={"color": "#1f4e79"},
            capprops={"color": "#1f4e79"},
        )
        for y, values in zip(positions, data, strict=True):
            ax.plot(values, [y] * len(values), "o", color="#1f4e79", markersize=3, alpha=0.6)
        top, bottom = max(v[-1] for v in data), min(v[0] for v in data)
        medians = [_median(values) for values in data]
        if log_scale is None:
            log_scale = bottom > 0 and max(medians) > LOG_SCALE_RATIO * min(medians)
        if log_scale and bottom > 0:
            ax.set_xscale("log")
            ax.set_xlim(bottom / 1.3, top * 2.2)
            ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 3.0, 5.0)))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: f"{x:g}"))
            ax.xaxis.set_minor_locator(NullLocator())
            label_at = [values[-1] * 1.06 for values in data]
        else:
            log_scale = False
            ax.set_xlim(0, top * 1.18 if top > 0 else 1)
            label_at = [values[-1] + top * 0.015 for values in data]
        for y, x, values, median in zip(positions, label_at, data, medians, strict=True):
            ax.text(x, y, f"{median:.0f} ms (n={len(values)})", va="center", fontsize=8)
        ax.set_yticks(positions, names)
        ax.set_xlabel("TTFT (ms, log scale)" if log_scale else "TTFT (ms)")
        ax.set_title(title, fontsize=10)
        ax.grid(axis="x", color="#dddddd", linewidth=0.6)
        ax.set_axisbelow(True)
        fig.text(0.01, 0.01, "\n".join(note_lines), fontsize=7, color="#555555", va="bottom")
        fig.tight_layout(rect=(0, (0.05 + NOTE_LINE_IN * len(note_lines)) / height, 1, 1))
        out = Path(path)
        fig.savefig(out, dpi=DPI)
    finally:
        plt.close(fig)
    return out


def _median(sorted_values: Sequence[float]) -> float:
    n = len(sorted_values)
    mid = n // 2
    return sorted_values[mid] if n % 2 else (sorted_values[mid - 1] + sorted_values[mid]) / 2


def png_beside(json_path: str | Path) -> Path:
    """The PNG path beside a JSON summary: ``results.json`` -> ``results.png``."""
    return Path(json_path).with_suffix(".png")
