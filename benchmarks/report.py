"""The benchmark's results and their text form: the table on stdout and the JSON file."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Timed:
    """One variant of a case, timed: medians in milliseconds, collectives and memory per call."""

    key: str
    label: str
    median_ms: float
    cpu_median_ms: float
    times_ms: list[float]
    first_call_ms: float
    collectives: int
    peak_extra_bytes: int | None = None
    kept_bytes: int | None = None


@dataclass
class Row:
    """A derived figure: a ratio of medians, a count or a check, with its goal in words.

    ``target`` is a ratio goal as a number (the largest ratio that meets it), for the plot.
    """

    label: str
    value: float | int | str
    kind: str = "ratio"  # "ratio" (time of the first / time of the second), "count" or "check"
    goal: str | None = None
    holds: bool | None = None
    target: float | None = None


@dataclass
class Result:
    """One case as measured: its variants, derived rows and notes.

    ``per_gradient`` is the number of gradients where the case also reports time per gradient;
    ``first_calls`` when nothing ran on the workload before the variants' first calls, which the
    report then shows.
    """

    key: str
    family: str
    name: str
    title: str
    variants: list[Timed] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    per_gradient: int = 0
    first_calls: bool = False


def _size(nbytes: int | None) -> str:
    if nbytes is None:
        return "-"
    if abs(nbytes) < 2**10:
        return f"{nbytes} B"
    if abs(nbytes) < 2**20:
        return f"{nbytes / 2**10:.1f} KiB"
    return f"{nbytes / 2**20:.1f} MiB"


def format_value(row: Row) -> str:
    """A row's value as the table shows it: ratios as "0.57x", far below 1 with the speed-up."""
    if row.kind != "ratio" or isinstance(row.value, str):
        return str(row.value)
    ratio = float(row.value)
    text = f"{ratio:.3g}x"
    return f"{text} ({1 / ratio:.0f}x faster)" if 0 < ratio < 0.1 else text


def _verdict(row: Row) -> str:
    goal = "" if row.goal is None else f"goal: {row.goal}"
    if row.holds is None:
        return goal
    return f"{goal:24} {'holds' if row.holds else 'MISSED'}"


def _case_lines(result: Result) -> list[str]:
    lines = [f"== {result.title}"]
    labels = [v.label for v in result.variants] + [r.label for r in result.rows]
    width = max(map(len, labels), default=0)  # a skipped case has neither
    if result.variants:
        first = f" {'first call ms':>13}" if result.first_calls else ""
        per = f" {'us per grad':>11}" if result.per_gradient else ""
        lines.append(
            f"  {'variant':{width}} {'median ms':>10} {'cpu ms':>8} {'collectives':>11} "
            f"{'peak extra':>10} {'kept':>9}{first}{per}"
        )
        for v in result.variants:
            first = f" {v.first_call_ms:13.1f}" if result.first_calls else ""
            per = f" {1e3 * v.median_ms / result.per_gradient:11.2f}" if result.per_gradient else ""
            lines.append(
                f"  {v.label:{width}} {v.median_ms:10.2f} {v.cpu_median_ms:8.2f} "
                f"{v.collectives:>11} {_size(v.peak_extra_bytes):>10} {_size(v.kept_bytes):>9}"
                f"{first}{per}"
            )
    for row in result.rows:
        lines.append(f"  {row.label:{width}} {format_value(row):>10}  {_verdict(row)}".rstrip())
    lines.extend(f"  note: {note}" for note in result.notes)
    return [*lines, ""]


def _family_lines(family: list[Result]) -> list[str]:
    """Cases that differ only in their number of gradients, side by side."""
    head = family[0]
    figures: list[tuple[str, list[str]]] = []
    for index, variant in enumerate(head.variants):
        per = [1e3 * r.variants[index].median_ms / r.per_gradient for r in family]
        figures.append((f"{variant.label}: us per gradient", [f"{us:.2f}" for us in per]))
    if head.first_calls:
        for index, variant in enumerate(head.variants):
            firsts = [r.variants[index].first_call_ms for r in family]
            figures.append((f"{variant.label}: first call, ms", [f"{ms:.1f}" for ms in firsts]))
    for index, row in enumerate(head.rows):
        if row.kind == "ratio":
            figures.append((row.label, [format_value(r.rows[index]) for r in family]))
    width = max(len(label) for label, _ in figures)
    sizes = "".join(f"{r.per_gradient:>10,}" for r in family)
    lines = [f"== {head.name}, by number of gradients", f"  {'':{width}}{sizes}"]
    lines += [f"  {label:{width}}" + "".join(f"{c:>10}" for c in cells) for label, cells in figures]
    return [*lines, ""]


def format_report(header: str, results: list[Result]) -> str:
    """The whole report as text: every case, the per-item summaries, then the goals."""
    lines = [header, ""]
    for result in results:
        lines += _case_lines(result)
    for family in dict.fromkeys(r.family for r in results if r.per_gradient):
        lines += _family_lines([r for r in results if r.family == family])
    goals = [(r, row) for r in results for row in r.rows if row.holds is not None]
    missed = [(r, row) for r, row in goals if not row.holds]
    lines.append(f"goals: {len(goals) - len(missed)} of {len(goals)} hold")
    lines += [
        f"  missed: {r.name}: {row.label}: {format_value(row)} (goal: {row.goal})"
        for r, row in missed
    ]
    return "\n".join(lines)


def write_json(path: Path, meta: dict[str, Any], results: list[Result]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"meta": meta, "results": [asdict(result) for result in results]}
    path.write_text(json.dumps(payload, indent=2) + "\n")
