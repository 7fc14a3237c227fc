"""The benchmark's results: the table on stdout, the JSON file, the bar chart."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Variant:
    """One timed way of doing a case's work."""

    name: str
    label: str
    median_ms: float
    times_ms: list[float]
    cpu_median_ms: float | None = None
    cpu_times_ms: list[float] = field(default_factory=list)
    collectives: int | None = None
    peak_extra_bytes: int | None = None
    largest_alloc_bytes: int | None = None
    kept_bytes: int | None = None


@dataclass
class Row:
    """A derived figure (a ratio, a count, a check), with its goal if it has one."""

    goal_id: str | None
    label: str
    value: float | int | str
    goal: str | None = None
    holds: bool | None = None
    kind: str = "ratio"  # "ratio" (smaller is better), "speedup", "count" or "check"
    short: str = ""  # the label on the chart


@dataclass
class Case:
    key: str
    title: str
    variants: list[Variant] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def median(self, name: str) -> float:
        return next(v.median_ms for v in self.variants if v.name == name)


def ratio_row(
    case: Case, goal_id: str | None, numerator: str, denominator: str, at_most: float | None
) -> Row:
    """median(numerator) / median(denominator), checked against ``at_most`` when given."""
    value = case.median(numerator) / case.median(denominator)
    labels = {v.name: v.label for v in case.variants}
    label = f"{labels[numerator]} / {labels[denominator]}"
    short = f"{numerator} / {denominator}"
    if at_most is None:
        return Row(goal_id, label, value, short=short)
    return Row(goal_id, label, value, f"<= {at_most:g}", value <= at_most, short=short)


def paired_ratio_row(case: Case, numerator: str, denominator: str) -> Row:
    """The median over repetitions of each repetition's own ratio (robust to load drifting)."""
    by_name = {v.name: v for v in case.variants}
    ratios = sorted(
        a / b
        for a, b in zip(by_name[numerator].times_ms, by_name[denominator].times_ms, strict=True)
    )
    middle = len(ratios) // 2
    value = ratios[middle] if len(ratios) % 2 else (ratios[middle - 1] + ratios[middle]) / 2
    label = f"{numerator} / {denominator}, median of per-repetition ratios"
    return Row(None, label, value, short=f"{numerator} / {denominator} (paired)")


def speedup_row(case: Case, goal_id: str, slow: str, fast: str, at_least: float) -> Row:
    """median(slow) / median(fast): how many times faster ``fast`` is."""
    value = case.median(slow) / case.median(fast)
    labels = {v.name: v.label for v in case.variants}
    label = f"speed-up of {labels[fast]} over {labels[slow]}"
    goal = f">= {at_least:g}x"
    short = f"{fast} / {slow}"
    return Row(goal_id, label, value, goal, value >= at_least, kind="speedup", short=short)


def _size(nbytes: int | None) -> str:
    if nbytes is None:
        return "-"
    if abs(nbytes) < 2**10:
        return f"{nbytes} B"
    if abs(nbytes) < 2**20:
        return f"{nbytes / 2**10:.1f} KiB"
    return f"{nbytes / 2**20:.1f} MiB"


def _value(row: Row) -> str:
    if isinstance(row.value, str):
        return row.value
    if row.kind == "speedup":
        return f"{row.value:.1f}x"
    if row.kind == "count" or isinstance(row.value, int):
        return str(row.value)
    return f"{row.value:.3f}"


def format_table(header: str, cases: list[Case]) -> str:
    """The whole report as text."""
    lines = [header, ""]
    for case in cases:
        lines.append(f"== {case.title}")
        if case.variants:
            lines.append(
                f"  {'variant':46} {'median ms':>10} {'cpu ms':>8} {'collectives':>12} "
                f"{'peak extra':>11} {'kept':>10}"
            )
            for v in case.variants:
                cpu = "-" if v.cpu_median_ms is None else f"{v.cpu_median_ms:.2f}"
                lines.append(
                    f"  {v.label:46} {v.median_ms:10.2f} {cpu:>8} "
                    f"{'-' if v.collectives is None else v.collectives:>12} "
                    f"{_size(v.peak_extra_bytes):>11} {_size(v.kept_bytes):>10}"
                )
        for row in case.rows:
            goal = "" if row.goal is None else f"goal {row.goal}"
            verdict = "" if row.holds is None else ("holds" if row.holds else "MISSED")
            tag = f"[{row.goal_id}]" if row.goal_id else "    "
            lines.append(f"  {tag:5} {row.label:58} {_value(row):>10}  {goal:14} {verdict}")
        lines.extend(f"  note: {note}" for note in case.notes)
        lines.append("")
    goals = [row for case in cases for row in case.rows if row.holds is not None]
    missed = [row for row in goals if not row.holds]
    lines.append(f"goals: {len(goals) - len(missed)} of {len(goals)} hold")
    lines.extend(f"  missed [{row.goal_id}] {row.label}: {_value(row)}" for row in missed)
    return "\n".join(lines)


def write_json(path: Path, meta: dict[str, Any], cases: list[Case]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"meta": meta, "cases": [asdict(case) for case in cases]}
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")


def write_plot(path: Path, title: str, cases: list[Case]) -> None:
    """A bar chart of every ratio that has a goal, on a log scale, with the goal marked.

    Raises:
        RuntimeError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise RuntimeError(
            "--plot needs matplotlib, an optional dependency: "
            "pip install 'credit-parallel[bench]' (or pip install matplotlib)"
        ) from error
    rows = [
        (case, row)
        for case in cases
        for row in case.rows
        if row.kind in ("ratio", "speedup") and row.goal is not None
    ]
    if not rows:
        return
    # Every bar is "time of ours / time of the baseline": below 1 is faster.
    values = [float(row.value) if row.kind == "ratio" else 1 / float(row.value) for _, row in rows]
    targets = [_target(row) for _, row in rows]
    labels = [f"[{row.goal_id}] {case.key}: {row.short or row.label}" for case, row in rows]
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(rows) + 1.6))
    colors = ["tab:green" if row.holds else "tab:red" for _, row in rows]
    positions = list(range(len(rows)))
    ax.barh(positions, values, color=colors)
    for position, target in zip(positions, targets, strict=True):
        ax.plot([target, target], [position - 0.4, position + 0.4], color="black", linewidth=2)
    for position, value in zip(positions, values, strict=True):
        ax.text(value, position, f" {value:.3g}", va="center", fontsize=8)
    ax.set_yticks(positions, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlim(right=max(2.0, 1.5 * max(values)))  # room for the labels of bars near 1
    ax.axvline(1.0, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xlabel("time of ours / time of the baseline (log scale; black mark: the goal)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _target(row: Row) -> float:
    assert row.goal is not None
    number = float(row.goal.split()[-1].rstrip("x"))
    return 1 / number if row.kind == "speedup" else number
