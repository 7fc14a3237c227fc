"""On a real GPU: every steady-state path of the host-sync table under torch's sync debug mode,
with the same bits as the same computation on the CPU.

Skipped without CUDA, with the reason (but for two tests of the comparison). On a machine with
a GPU, from the repository's root, with nothing installed but torch and pytest (no venv, no
editable install, no hypothesis)::

    PYTHONPATH=src python -m pytest tests/test_gpu_syncs.py tests/test_gpu_demo.py

or ``tests/gpu_check.sh``, which runs them and writes a log. ``tests/test_host_syncs.py`` traces the
same paths on fake CUDA tensors everywhere else.

Four gloo ranks share the GPU (each sets device 0) and run every row of the table of
``tests/support/sync_paths.py`` twice: on CUDA meshes, and on CPU meshes with the same values, chosen so
that every norm is exact (see ``support.sync_paths.World``): the CUDA run's results and gradients must
have the CPU run's bits. Each row is called three times, its gradients restored before each call;
the second and third CUDA calls run under ``torch.cuda.set_sync_debug_mode("warn")`` and must make
exactly the row's syncs (its reads and blocking copies, one sync each on a GPU).

Why "warn" on gloo: gloo's CUDA all_reduce stages through the host and waits for its own copy
stream in its worker thread (``AsyncAllreduceCUDAHostWork::run``), which "error", global to the
process, would turn into a failed collective. A warning raised in that thread stays in C++
(printed on stderr); a sync of the calling thread becomes a Python warning, recorded here with
the line that made it.

NCCL, at one rank (one GPU holds one NCCL rank) in a process of its own, runs the paths of a
world of one under "error": a sync raises where it happens. The paths that must read (the report,
``error_if_nonfinite``, a foreach optimizer's step) run under "warn" and must warn once.

Two tests run everywhere: the comparison sees one changed bit, and the harness compares a path
with itself on the CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import multiprocessing
import tempfile
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support.sync_paths import CALLS, ROWS, WORLD, Row, World
from torch import Tensor, nn

from credit.parallel import collectives
from credit.parallel._common.compat import local_tensor
from credit.parallel.amp import GradScaler
from credit.parallel.collectives import (
    all_reduce_avg,
    allreduce_grads_avg,
    clip_grad_norm_,
    total_grad_norm,
)
from credit.parallel.norm_report import grad_norm_report
from credit.parallel.replicas import verify_replicas

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device (torch.cuda.is_available() is False)"
)

SYNC = "called a synchronizing CUDA operation"


# ---------------------------------------------------------------------------------------------
# what every run shares: the sync window, snapshots, and the comparison of bits


@contextlib.contextmanager
def _sync_window(mode: str) -> Iterator[list[str]]:
    """torch's sync debug mode ``mode`` inside: "error" raises at a sync, "warn" lists each sync
    of the calling thread as ``path:line: message``. Nothing without CUDA."""
    found: list[str] = []
    if not torch.cuda.is_available():
        yield found
        return
    torch.cuda.synchronize()  # nothing queued before the window counts in it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(mode)
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")
    found += [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if SYNC in str(w.message)]


def _snapshot(value: Any) -> Any:
    """``value`` with every tensor cloned where it is (a DTensor's local shard): no sync."""
    if isinstance(value, Tensor):
        return local_tensor(value).detach().clone()
    if isinstance(value, dict):
        return {key: _snapshot(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_snapshot(item) for item in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


def _differences(checked: Any, reference: Any, where: str = "") -> list[str]:
    """Where ``checked`` (from the GPU) and ``reference`` (from the CPU) differ in any bit."""
    if isinstance(reference, Tensor):
        ours = checked.cpu()
        same = (
            ours.dtype == reference.dtype
            and ours.shape == reference.shape
            and torch.equal(
                ours.reshape(-1).view(torch.uint8), reference.reshape(-1).view(torch.uint8)
            )
        )
        return [] if same else [f"{where}: {ours} on the GPU, {reference} on the CPU"]
    if isinstance(reference, dict):
        if checked.keys() != reference.keys():
            return [f"{where}: keys {list(checked)} on the GPU, {list(reference)} on the CPU"]
        return [
            d
            for key in reference
            for d in _differences(checked[key], reference[key], f"{where}[{key!r}]")
        ]
    if isinstance(reference, list):
        return [
            d
            for i, (a, b) in enumerate(zip(checked, reference, strict=True))
            for d in _differences(a, b, f"{where}[{i}]")
        ]
    if isinstance(reference, float) and math.isnan(reference):
        return [] if math.isnan(checked) else [f"{where}: {checked} on the GPU, nan on the CPU"]
    return (
        []
        if checked == reference
        else [f"{where}: {checked!r} on the GPU, {reference!r} on the CPU"]
    )


def _restore(tensors: list[Tensor], values: list[Tensor]) -> None:
    for tensor, value in zip(tensors, values, strict=True):
        local_tensor(tensor).copy_(value)


Build = Callable[[], tuple[Callable[[], object], list[Tensor]]]


def _run_and_compare(checked: Build, reference: Build, mode: str = "warn") -> dict[str, Any]:
    """Build a path twice, ``checked`` on CUDA and ``reference`` on the CPU (each gives its call
    and the gradients it works on), call each :data:`CALLS` times, its gradients restored before
    each call, and the checked calls after the first (the steady state) inside a sync window of
    ``mode``.

    Returns:
        ``syncs`` (per steady-state checked call, the syncs warned) and ``differences`` (every
        bit the checked run's results or gradients differ in from the reference run's).

    Raises:
        RuntimeError: in "error" mode, at the first sync.
    """
    runs = []
    for build in (checked, reference):
        call, grads = build()
        runs.append((call, grads, _snapshot(grads)))
    outputs: list[list] = [[], []]
    syncs = []
    for number in range(CALLS):
        for run, (call, grads, initial) in enumerate(runs):
            _restore(grads, initial)
            if number > 0 and run == 0:
                with _sync_window(mode) as warned:
                    outputs[run].append(_snapshot([call(), grads]))
                syncs.append(warned)
            else:
                outputs[run].append(_snapshot([call(), grads]))
    return {"syncs": syncs, "differences": _differences(*outputs)}


# ---------------------------------------------------------------------------------------------
# four gloo ranks sharing the GPU: every row of the table


@functools.cache
def _world(device: str) -> World:
    """This rank's meshes on ``device``, built once per worker process."""
    return World.build(dist.get_rank(), device)


def _row_builder(row: Row, device: str) -> Build:
    def build() -> tuple[Callable[[], object], list[Tensor]]:
        world = _world(device)
        first = len(world.made)
        call = row.build(world)
        return call, world.made[first:]

    return build


def _every_row() -> dict[str, dict[str, Any]]:
    """On one gloo rank: every row, on CUDA against the CPU (see the module docstring)."""
    torch.cuda.set_device(0)  # CUDA: every rank of the gloo world uses the one GPU
    results = {}
    for row in ROWS:
        if row.needs is not None and not hasattr(collectives, row.needs):
            results[row.path] = {"missing": f"credit.parallel.collectives has no {row.needs}"}
            continue
        try:
            results[row.path] = _run_and_compare(
                _row_builder(row, "cuda"), _row_builder(row, "cpu")
            )
        except Exception:
            results[row.path] = {"error": traceback.format_exc()}
    return results


@pytest.fixture(scope="module")
def gloo_results(ranks) -> list[dict[str, dict[str, Any]]]:
    return ranks.run(WORLD, _every_row, timeout_s=150)


@needs_cuda
@pytest.mark.parametrize("row", ROWS, ids=[row.path for row in ROWS])
def test_steady_state_syncs_on_cuda_gloo_ranks(gloo_results, row: Row):
    failures = []
    for rank, results in enumerate(gloo_results):
        result = results[row.path]
        if "missing" in result:
            pytest.skip(result["missing"])
        if "error" in result:
            failures.append(f"rank {rank} raised:\n{result['error']}")
            continue
        for number, syncs in enumerate(result["syncs"], start=2):
            if len(syncs) != row.reads + row.copies:
                listed = "\n".join(f"    {sync}" for sync in syncs)
                failures.append(
                    f"rank {rank}, call {number}: {len(syncs)} syncs, {row.reads + row.copies} allowed:\n{listed}"
                )
        failures += [f"rank {rank}: {difference}" for difference in result["differences"]]
    assert not failures, f"{row.path}:\n" + "\n".join(failures)


# ---------------------------------------------------------------------------------------------
# NCCL at one rank, in a process of its own: the paths of a world of one


def _plain(device: str) -> list[Tensor]:
    """Plain gradients, zero but for one small integer each (exact norms, as in the table)."""
    grads = [torch.zeros(16, 8), torch.zeros(8), torch.zeros(3, 5)]
    for grad, value in zip(grads, (2.0, 3.0, 6.0), strict=True):
        grad.view(-1)[0] = value
    return [grad.to(device) for grad in grads]


def _with_grads(grads: list[Tensor]) -> list[nn.Parameter]:
    params = []
    for grad in grads:
        param = nn.Parameter(torch.zeros_like(grad))
        param.grad = grad
        params.append(param)
    return params


def _norm(device: str, **kwargs: Any) -> tuple[Callable[[], object], list[Tensor]]:
    grads = _plain(device)
    return lambda: total_grad_norm(grads, **kwargs), grads


def _clip(
    device: str, max_norm: Callable[[str], float | Tensor]
) -> tuple[Callable[[], object], list[Tensor]]:
    grads = _plain(device)
    params, bound = _with_grads(grads), max_norm(device)
    return lambda: clip_grad_norm_(params, bound), grads


def _amp(device: str, kind: str, scaling: bool = True) -> tuple[Callable[[], object], list[Tensor]]:
    grads = _plain(device)
    params = _with_grads(grads)
    optimizer = torch.optim.AdamW(params, lr=1e-3, **{kind: True})
    scaler = GradScaler(device, scaling=scaling)
    scaler.scale(torch.ones((), device=device))

    def step() -> Tensor:
        scaler.unscale_(optimizer)
        total = clip_grad_norm_(params, 1.0)
        scaler.step(optimizer)
        scaler.update()
        return total

    return step, grads


def _average(device: str) -> tuple[Callable[[], object], list[Tensor]]:
    grads = _plain(device)

    def average() -> None:
        allreduce_grads_avg(grads, None)
        all_reduce_avg(grads[0])

    return average, grads


def _replicas(device: str) -> tuple[Callable[[], object], list[Tensor]]:
    grads = _plain(device)
    model = nn.Module()
    model.weights = nn.ParameterList(_with_grads(grads))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    optimizer.step()
    return lambda: verify_replicas(model, optimizer), grads


def _report(device: str) -> tuple[Callable[[], object], list[Tensor]]:
    grads = _plain(device)
    named = [(f"p{i}", param) for i, param in enumerate(_with_grads(grads))]
    return lambda: grad_norm_report(named), grads


# At one rank every function takes its world-of-one path: no collective, no sync but the reads
# the caller asks for.
ONE_RANK: dict[str, tuple[int, Callable[[str], tuple[Callable[[], object], list[Tensor]]]]] = {
    "total_grad_norm p=2": (0, functools.partial(_norm, norm_type=2.0)),
    "total_grad_norm p=inf": (0, functools.partial(_norm, norm_type=math.inf)),
    "total_grad_norm foreach=False": (0, functools.partial(_norm, foreach=False)),
    "clip_grad_norm_ max_norm float": (0, functools.partial(_clip, max_norm=lambda d: 1.0)),
    "clip_grad_norm_ max_norm CPU 0-dim": (
        0,
        functools.partial(_clip, max_norm=lambda d: torch.tensor(1.0)),
    ),
    "clip_grad_norm_ max_norm CPU 1-element": (
        0,
        functools.partial(_clip, max_norm=lambda d: torch.tensor([1.0])),
    ),
    "clip_grad_norm_ max_norm CUDA 0-dim": (
        0,
        functools.partial(_clip, max_norm=lambda d: torch.tensor(1.0, device=d)),
    ),
    "clip_grad_norm_ max_norm CUDA 1-element": (
        0,
        functools.partial(_clip, max_norm=lambda d: torch.ones(1, device=d)),
    ),
    "GradScaler fused AdamW: unscale_, clip, step, update": (
        0,
        functools.partial(_amp, kind="fused"),
    ),
    "GradScaler(scaling=False) fused AdamW": (
        0,
        functools.partial(_amp, kind="fused", scaling=False),
    ),
    "allreduce_grads_avg and all_reduce_avg": (0, _average),
    "verify_replicas": (0, _replicas),
    "total_grad_norm error_if_nonfinite=True": (
        1,
        functools.partial(_norm, error_if_nonfinite=True),
    ),
    "grad_norm_report": (1, _report),
    "GradScaler foreach AdamW: unscale_, clip, step, update": (
        1,
        functools.partial(_amp, kind="foreach"),
    ),
}


def _one_rank(path: str) -> dict[str, Any]:
    """``path`` at one NCCL rank: "error" mode where it must not sync, else every sync counted."""
    expected, build = ONE_RANK[path]
    mode = "warn" if expected else "error"
    return _run_and_compare(functools.partial(build, "cuda"), functools.partial(build, "cpu"), mode)


def _nccl_world_of_one(store: str) -> dict[str, dict[str, Any]]:
    """Every path of :data:`ONE_RANK` as the only rank of an NCCL world (a fresh process)."""
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        results = {}
        for path in ONE_RANK:
            try:
                results[path] = _one_rank(path)
            except Exception:
                results[path] = {"error": traceback.format_exc()}
        return results
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def nccl_results() -> dict[str, dict[str, Any]]:
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as directory, context.Pool(1) as pool:
        store = str(Path(directory) / "store")
        return pool.apply_async(_nccl_world_of_one, (store,)).get(timeout=120)


@needs_cuda
@pytest.mark.parametrize("path", ONE_RANK)
def test_steady_state_syncs_at_one_nccl_rank(nccl_results, path):
    expected = ONE_RANK[path][0]
    result = nccl_results[path]
    assert "error" not in result, (
        f"{path} raised (under 'error' mode a sync raises):\n{result.get('error')}"
    )
    for number, syncs in enumerate(result["syncs"], start=2):
        assert len(syncs) == expected, f"{path}, call {number}: " + "; ".join(syncs)
    assert not result["differences"], "\n".join(result["differences"])


# ---------------------------------------------------------------------------------------------
# the comparison itself, everywhere (without CUDA the checked run is on the CPU too)


def test_the_comparison_sees_one_changed_bit():
    value = torch.tensor([1.0, 2.0])
    changed = value.clone()
    changed[1] = torch.nextafter(changed[1], torch.tensor(3.0))
    report = {"total": 1.5, "group": float("nan")}
    assert _differences([value, report], [value.clone(), dict(report)]) == []
    assert _differences([changed, report], [value, report]) != []
    assert _differences([value, {**report, "total": 1.5000001}], [value, report]) != []
    assert _differences([value, {**report, "group": 0.0}], [value, report]) != []


def test_a_path_run_twice_on_the_cpu_compares_equal():
    """The harness of the NCCL test, its checked run on the CPU: the same bits, no sync window."""
    for path in ("clip_grad_norm_ max_norm float", "grad_norm_report", "verify_replicas"):
        build = ONE_RANK[path][1]
        result = _run_and_compare(functools.partial(build, "cpu"), functools.partial(build, "cpu"))
        assert result == {"syncs": [[], []], "differences": []}, path
