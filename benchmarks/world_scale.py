"""What one rank pays for the norm at worlds of 1,024 to 65,536 ranks (torch's fake backend).

One process plays rank 0 of each world (``testbed/world_layouts.py`` builds the meshes and the
Llama-like gradients of each layout: FSDP2 x TP, HSDP x TP, pipeline stages, experts). For each
(world, layout, model) it reports:

- the first call: ``total_grad_norm`` on a layout nothing has seen (the model widened, so that no
  holding or plan is cached), timed alone;
- the steady host time: the min and median over later calls on that layout;
- the collectives of a steady call of ``total_grad_norm`` and of ``clip_grad_norm_``, and of a
  first call (the process's very first on those meshes, with what is done once per group), with
  the elements each sends, recorded by ``world_layouts.WireRecorder`` (a TorchDispatchMode
  that sees the c10d ops and the functional collectives);
- the host memory a first call leaves held: Python objects (tracemalloc, after ``gc.collect()``)
  and the bytes of the plain tensors it keeps, on the recorded first call; the growth of the
  resident set over the timed one (tracemalloc's own records would swell it).

Each (world, layout, model) runs in a fresh spawned process.
Run alone::

    python benchmarks/run.py --cases world-scale --worlds 1024,8192,65536
"""

from __future__ import annotations

import gc
import itertools
import multiprocessing
import os
import statistics
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

from report import Result, Row

from credit.parallel.collectives import clip_grad_norm_, total_grad_norm
from testbed.world_layouts import (
    MODELS,
    Collective,
    Layout,
    Meshes,
    build_layout,
    build_meshes,
    describe,
    start_world,
    wire,
)

# The bound on any one collective: 16 float64 numbers per gradient, plus a few.
PER_GRADIENT, CONSTANT = 16, 64


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _plain_tensors() -> list[Any]:
    import torch

    return [o for o in gc.get_objects() if type(o) in (torch.Tensor, torch.nn.Parameter)]


def _storage_bytes(tensors: list[Any], skip: set[int]) -> int:
    seen, total = set(skip), 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def held_by(call: Callable[[], object]) -> dict[str, int]:
    """The host memory ``call`` leaves held: Python objects (tracemalloc), and the storage of the
    plain tensors it created and keeps."""
    gc.collect()
    before = _plain_tensors()
    before_ids = {id(t) for t in before}
    before_storages = {t.untyped_storage().data_ptr() for t in before}
    tracemalloc.start()
    start = tracemalloc.get_traced_memory()[0]
    call()
    gc.collect()
    python = tracemalloc.get_traced_memory()[0] - start
    tracemalloc.stop()
    new = [t for t in _plain_tensors() if id(t) not in before_ids]
    return {"python_bytes": python, "tensor_bytes": _storage_bytes(new, before_storages)}


def _first_call(layout: Layout) -> tuple[list[Collective], dict[str, int]]:
    """The collectives of ``layout``'s first call, and the memory it leaves held."""
    found: list[Collective] = []

    def call() -> None:
        found.extend(wire(lambda: total_grad_norm(layout.grads, **layout.kwargs)))

    return found, held_by(call)


def _timed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return 1e3 * (time.perf_counter() - start)


def measure(meshes: Meshes, model_name: str, calls: int) -> dict[str, Any]:
    """One row: ``model_name``'s gradients in the layout of ``meshes`` (see the module's doc)."""
    model = MODELS[model_name]
    first_wire, held = _first_call(build_layout(meshes, model, variant=1))
    layout = build_layout(meshes, model, variant=2)
    gc.collect()

    def norm() -> None:
        total_grad_norm(layout.grads, **layout.kwargs)

    resident = _resident_bytes()
    first_ms = _timed(norm)
    gc.collect()
    resident = _resident_bytes() - resident
    steady = [_timed(norm) for _ in range(calls)]
    return {
        "model": model_name,
        "gradients": model.gradients,
        "local_gradients": len(layout.grads),
        "first_ms": first_ms,
        "steady_min_ms": min(steady),
        "steady_median_ms": statistics.median(steady),
        "steady": wire(norm),
        "clip": wire(lambda: clip_grad_norm_(layout.params, 1.0, **layout.kwargs)),
        "first": first_wire,
        "rss_bytes": resident,
        **held,
    }


def measure_world(world: int, layout: str, model: str, calls: int) -> dict[str, Any]:
    """Rank 0 of a fake world of ``world`` ranks: ``model`` in ``layout`` (run in a fresh process:
    a world torn down leaves state in torch's caches, and what a first call does once per group
    must be seen by each row)."""
    import torch

    # One intra-op thread: on a shared machine, waking a pool of threads for a large vector's
    # kernels costs milliseconds of noise that are not the norm's.
    torch.set_num_threads(1)
    start = time.perf_counter()
    start_world(world)
    try:
        meshes = build_meshes(layout, world)
        mesh_ms = 1e3 * (time.perf_counter() - start)
        return {
            "world": world,
            "layout": layout,
            "mesh_ms": mesh_ms,
            **measure(meshes, model, calls),
        }
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f}"


HEADER = (
    f"{'ranks':>7} {'layout':9} {'model':5} {'grads':>5} {'mesh ms':>7} {'first ms':>9} "
    f"{'steady min/med ms':>17} {'held MiB py/tensors/rss':>23}  steady collectives | clip's | "
    "first call's"
)


def table_line(row: dict[str, Any]) -> str:
    """One row of the table (see :data:`HEADER`)."""
    steady = f"{row['steady_min_ms']:.2f}/{row['steady_median_ms']:.2f}"
    held = "/".join(_mib(row[key]) for key in ("python_bytes", "tensor_bytes", "rss_bytes"))
    clip = "same" if row["clip"] == row["steady"] else describe(row["clip"])
    return (
        f"{row['world']:>7} {row['layout']:9} {row['model']:5} {row['local_gradients']:>5} "
        f"{row['mesh_ms']:>7.0f} {row['first_ms']:>9.1f} {steady:>17} {held:>23}  "
        f"{describe(row['steady'])} | {clip} | {describe(row['first'])}"
    )


def _largest(row: dict[str, Any]) -> int:
    return max((c.elements for c in row["steady"] + row["clip"]), default=0)


def _rows(rows: list[dict[str, Any]]) -> list[Row]:
    found = []
    for row in rows:
        name = f"{row['world']:,} ranks, {row['layout']}, {row['model']}"
        per_gradient = _largest(row) / row["gradients"]
        bound = PER_GRADIENT * row["gradients"] + CONSTANT
        found.append(
            Row(
                f"{name}: first call ms; steady min/median ms; held MiB (py + tensors)",
                f"{row['first_ms']:.1f}; {row['steady_min_ms']:.2f}/{row['steady_median_ms']:.2f}; "
                f"{_mib(row['python_bytes'])} + {_mib(row['tensor_bytes'])}",
                "count",
            )
        )
        found.append(
            Row(
                f"{name}: largest steady collective, numbers per gradient",
                f"{per_gradient:,.1f} ({_largest(row):,})",
                "count",
                f"<= {PER_GRADIENT} per gradient + {CONSTANT}",
                _largest(row) <= bound,
            )
        )
    return found


def _growth_rows(rows: list[dict[str, Any]]) -> list[Row]:
    """Per (layout, model) seen at several worlds: is the steady wire the same at each?"""
    found = []
    keys = dict.fromkeys((row["layout"], row["model"]) for row in rows)
    for layout, model in keys:
        mine = sorted(
            (r for r in rows if (r["layout"], r["model"]) == (layout, model)),
            key=lambda r: r["world"],
        )
        if len(mine) < 2:
            continue
        sizes = [[c.elements for c in r["steady"]] for r in mine]
        worlds = " / ".join(f"{r['world']:,}" for r in mine)
        found.append(
            Row(
                f"{layout}, {model}: steady collectives' elements at {worlds} ranks",
                " / ".join("+".join(f"{n:,}" for n in size) for size in sizes),
                "count",
                "the same at every world",
                all(size == sizes[0] for size in sizes),
            )
        )
    return found


def world_scale(
    worlds: list[int], layouts: list[str], models: list[str], calls: int, timeout_s: float
) -> Result:
    """Measure every (world, layout, model), one fresh process each, printing
    the table as rows come in.

    Args:
        worlds: world sizes, in ranks.
        layouts: names of ``world_layouts.LAYOUTS``.
        models: names of ``world_layouts.MODELS``.
        calls: steady calls timed per row.
        timeout_s: how long one process may take.
    """
    context = multiprocessing.get_context("spawn")
    rows: list[dict[str, Any]] = []
    print(HEADER, flush=True)
    started = time.perf_counter()
    for world, layout, model in itertools.product(worlds, layouts, models):
        with context.Pool(1, maxtasksperchild=1) as pool:
            pending = pool.apply_async(measure_world, (world, layout, model, calls))
            rows.append(pending.get(timeout=timeout_s))
        print(table_line(rows[-1]), flush=True)
    total_s = time.perf_counter() - started
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    print(f"world-scale: {len(rows)} rows in {total_s:.0f} s, load average {load}", flush=True)
    result = Result(
        "world-scale",
        "world-scale",
        "world scale",
        f"one rank's cost at simulated worlds of {', '.join(f'{w:,}' for w in worlds)} ranks "
        "(fake backend, rank 0)",
    )
    result.rows = _rows(rows) + _growth_rows(rows)
    result.notes += [
        "layouts (testbed/world_layouts.py): fsdp-tp (dp, tp=8); hsdp-tp (rep, shard=64, tp=8); "
        "pipeline (pp=4, dp, tp=8), a quarter of the layers a stage; experts: dense params "
        "dp-sharded over the world, w1/w2/w3 experts on the efsdp dim of (efsdp, ep=8), "
        "distinct along ep",
        "8b: 32 layers, 291 gradients; 70b: 80 layers, 723; local shards of 4 elements; one "
        "intra-op thread; held: tracemalloc's Python bytes and the plain tensors' bytes the "
        "recorded first call keeps, the resident set's growth over the timed first call",
        "under pipeline stages a fake world shows stage 0's share of the comparison only (the "
        "stages' slot counts come back in an all_reduce the fake backend leaves as sent)",
        f"the whole measurement took {total_s:.0f} s; load average at its end {load} "
        f"({os.cpu_count()} CPUs)",
    ]
    return result
