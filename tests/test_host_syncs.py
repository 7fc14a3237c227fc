"""No host sync at steady state: every public path traced on fake CUDA tensors, on this CPU.

``tests/support/sync_paths.py`` holds the table (one row per path: the host reads and blocking copies a
call may make at steady state, every other kind of sync zero) and traces every row, as one rank
of a 4-rank fake world, in a fresh spawned process: ranks 0 (the reference of every copy group,
holding the 1-row weights) and 3 (the last, with the empty shards), in parallel. A path's first
call (its layout's) may verify and read: it is bounded, and listed in ``build/host-syncs.txt``.

The trace needs a CUDA device guard: on a CPU-only torch it builds torch's no-op guard with a
C++ compiler (``tests/support/sync_trace.py``). Without one it skips, with the reason; ``.ci/run`` sets
``CREDIT_PARALLEL_REQUIRE_TRACE=1``, which turns that skip into a failure, as it does for a row
whose function is missing.

A control proves the recorder sees each kind of sync, and a planted read and CPU collective in
the norm prove the trace fails where it should, naming the planted lines.
"""

from __future__ import annotations

import multiprocessing
import os

import pytest
from support.sync_paths import ROWS, WORLD, Row, Traced, trace_world
from support.sync_trace import (
    BLOCKING_COPY,
    CPU_COLLECTIVE,
    DEVICE_MISMATCH,
    KINDS,
    READ,
    REPO,
    Sync,
)

# Slow, every test (make test-fast leaves them out): the trace builds its world (and, once, the no-op CUDA guard).
pytestmark = pytest.mark.slow

RANKS = (0, WORLD - 1)
REQUIRED = "CREDIT_PARALLEL_REQUIRE_TRACE"
REPORT = REPO / "build" / "host-syncs.txt"
# A layout's first call proves its copies and may read and copy: at most 13 syncs today (the replica
# check, grad_norm_report with pp_group); plans that build their constants on the device once, on
# the first call, add a few.
FIRST_CALL_BOUND = 32


def _skip_unless_required(reason: str) -> None:
    """Skip, unless CI requires the trace to run (then fail, with the same reason)."""
    if os.environ.get(REQUIRED) == "1":
        pytest.fail(f"{reason} ({REQUIRED}=1: the trace must run here)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def traced() -> dict[int, dict]:
    # One fresh process per rank: the fake world's process group and the no-op CUDA guard stay
    # in it.
    context = multiprocessing.get_context("spawn")
    with context.Pool(len(RANKS), maxtasksperchild=1) as pool:
        pending = {rank: pool.apply_async(trace_world, (rank,)) for rank in RANKS}
        results = {rank: result.get(timeout=300) for rank, result in pending.items()}
    skipped = sorted({result["skip"] for result in results.values() if "skip" in result})
    if skipped:
        _skip_unless_required("; ".join(skipped))
    _write_report(results)
    return results


def _describe(syncs: list[Sync]) -> str:
    return "\n".join(f"    {sync}" for sync in syncs) or "    (none)"


def _write_report(results: dict[int, dict]) -> None:
    """Every path's syncs, call by call and rank by rank: the first call's among them."""
    lines = []
    for row in ROWS:
        lines.append(f"{row.path}: steady state {row.reads} read(s), {row.copies} copy(ies)")
        for rank, result in results.items():
            traced: Traced = result["rows"][row.path]
            if traced.missing or traced.error:
                lines.append(f"  rank {rank}: {traced.missing or 'raised'}")
            for number, syncs in enumerate(traced.calls, start=1):
                lines.append(f"  rank {rank}, call {number}:")
                lines.append(_describe(syncs))
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text("\n".join(lines) + "\n")


def _count(syncs: list[Sync], kind: str) -> int:
    return sum(sync.kind == kind for sync in syncs)


@pytest.mark.parametrize("row", ROWS, ids=[row.path for row in ROWS])
def test_steady_state_makes_only_the_documented_syncs(traced, row: Row):
    failures = []
    for rank, result in traced.items():
        found: Traced = result["rows"][row.path]
        if found.missing is not None:
            _skip_unless_required(found.missing)
        if found.error is not None:
            failures.append(f"rank {rank}: the path raised\n{found.error}")
            continue
        for number, syncs in enumerate(found.steady, start=2):
            reads, copies = _count(syncs, READ), _count(syncs, BLOCKING_COPY)
            if (reads, copies, len(syncs)) != (row.reads, row.copies, row.reads + row.copies):
                failures.append(
                    f"rank {rank}, call {number}: {reads} read(s) and {copies} blocking "
                    f"copy(ies) where {row.reads} and {row.copies} are allowed, and "
                    f"{len(syncs) - reads - copies} other sync(s):\n{_describe(syncs)}"
                )
    assert not failures, f"{row.path}:\n" + "\n".join(failures)


def test_first_calls_are_bounded(traced):
    """A layout's first call may read and copy while it proves the layout, within a bound;
    never a CPU collective or a device mismatch, which fail under NCCL."""
    failures = []
    for rank, result in traced.items():
        for path, found in result["rows"].items():
            if not found.calls:
                continue
            first = found.calls[0]
            faults = [s for s in first if s.kind in (CPU_COLLECTIVE, DEVICE_MISMATCH)]
            if len(first) > FIRST_CALL_BOUND or faults:
                failures.append(f"rank {rank}, {path}: {len(first)} syncs\n{_describe(first)}")
    assert not failures, "\n".join(failures)


def test_the_trace_catches_a_planted_read_and_cpu_collective(traced):
    """The norm with a ``float()`` and an all_reduce of a CPU tensor planted in it: both are
    found, at the planted lines, called from the library; the same path without them is clean."""
    clean = "total_grad_norm mixed, p=2, foreach=True"
    for rank, result in traced.items():
        planted: Traced = result["planted"]
        lines = result["planted_lines"]
        assert planted.error is None, planted.error
        assert len(planted.calls) == 3
        for syncs in planted.calls[1:]:
            found = {(sync.kind, sync.where) for sync in syncs}
            assert (READ, lines["read"]) in found, _describe(syncs)
            assert (CPU_COLLECTIVE, lines["collective"]) in found, _describe(syncs)
            assert all(str(sync.library).startswith("src/credit/parallel/") for sync in syncs)
        assert result["rows"][clean].steady == [[], []], f"rank {rank}"


def test_the_recorder_sees_each_kind_of_sync(traced):
    """torch snippets whose syncs on a GPU are known: each recorded as exactly those."""
    for rank, result in traced.items():
        for snippet, (expected, recorded) in result["controls"].items():
            assert recorded == expected, f"rank {rank}: {snippet}"
        assert {kind for expected, _ in result["controls"].values() for kind in expected} == set(
            KINDS
        )
