"""The benchmark's chart: every ratio that has a goal, against its goal (matplotlib)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from report import Result, format_value


def write_plot(path: Path, title: str, results: list[Result]) -> None:
    """A horizontal bar per ratio goal, on a log scale: time of ours / time of the baseline.

    Below 1 this package is faster. Each bar is green where its goal holds, red where it is
    missed, and the black mark on it is the goal.

    Args:
        path: the PNG to write (its folder is created).
        title: the chart's title (the run's setting).
        results: the cases, in the order of the report.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [
        (result, row)
        for result in results
        for row in result.rows
        if row.kind == "ratio" and row.target is not None
    ]
    if not bars:
        return
    values = [float(row.value) for _, row in bars]
    labels = [textwrap.fill(f"{result.name}: {row.label}", 56) for result, row in bars]
    fig, ax = plt.subplots(figsize=(11, 0.75 * len(bars) + 1.6))
    positions = range(len(bars))
    ax.barh(positions, values, color=["tab:green" if row.holds else "tab:red" for _, row in bars])
    for position, (_, row) in zip(positions, bars, strict=True):
        assert row.target is not None
        ax.plot([row.target] * 2, [position - 0.4, position + 0.4], color="black", linewidth=2)
        ax.text(
            float(row.value),
            position,
            f"  {format_value(row)}, goal {row.goal}",
            va="center",
            fontsize=8,
        )
    ax.set_yticks(list(positions), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlim(min(0.5 * min(values), 0.1), 8 * max(max(values), 1.0))  # room for the text
    ax.axvline(1.0, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xlabel("time of ours / time of the baseline (log scale; below 1: ours is faster)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
