"""The comparisons, each run on every rank; rank 0's ``Case`` is the result.

Goals (ratios of medians measured side by side in one run):

- G1: ``allreduce_grads_avg`` on a transformer-like set within 1.15x one all_reduce of a
  pre-flattened buffer of the same size (and the zero-copy layout too).
- G2: many tiny grads at least 20x faster than a per-parameter all_reduce loop.
- G3: DTensor shards bucketed, at most 0.3x the time of per-shard async all_reduces, one
  collective per bucket.
- G4: ``clip_grad_norm_`` at most 0.3x ``torch.nn.utils.clip_grad_norm_`` on a homogeneous
  FSDP2 model, with the same bits.
- G5: one collective per norm, whatever the mix of meshes.
- G6 (in ``_scale``): collectives per call do not grow with the world size.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from credit.parallel import _buckets
from credit.parallel.bench import _baselines, _workloads
from credit.parallel.bench._memory import extra_memory
from credit.parallel.bench._report import (
    Case,
    Row,
    Variant,
    paired_ratio_row,
    ratio_row,
    speedup_row,
)
from credit.parallel.bench._timing import Progress, measure, median_ms
from credit.parallel.collectives import (
    allreduce_grads_avg,
    clip_grad_norm_,
    contiguous_grads_,
    total_grad_norm,
)


@dataclass
class Context:
    """What every case needs: where to run, how long, and the bucket cap under test."""

    device: torch.device
    warmup: int
    reps: int
    bucket_cap_mb: float
    progress: Progress

    @property
    def world(self) -> int:
        return dist.get_world_size()


def count_collectives(call: Callable[[], object]) -> int:
    """How many collectives ``call`` issues (torch's CommDebugMode, c10d ops included)."""
    with CommDebugMode() as mode:
        call()
    return mode.get_total_counts()


def expected_buckets(tensors: list[Tensor], cap_bytes: int) -> int:
    """Collectives ``allreduce_grads_avg`` should issue for ``tensors`` (all on one device).

    The documented rule, per dtype: a contiguous tensor of at least ``cap`` elements is reduced
    alone; the other non-empty tensors fill buckets in order, a bucket closing when the next
    tensor would take it past ``cap`` elements (``cap = cap_bytes // itemsize``).
    """
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    count = 0
    for dtype, same in by_dtype.items():
        cap = max(1, cap_bytes // dtype.itemsize)
        filled = 0
        for tensor in same:
            numel = tensor.numel()
            if numel >= cap and tensor.is_contiguous():
                count += 1
            elif numel > 0:
                if filled == 0 or filled + numel > cap:
                    count += 1
                    filled = 0
                filled += numel
    return count


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence the profiler's start/stop lines, which the C++ side writes to fd 2."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _run_variants(
    ctx: Context,
    label: str,
    variants: dict[str, tuple[str, Callable[[], object]]],
    memory: bool = False,
) -> list[Variant]:
    calls = {name: call for name, (_, call) in variants.items()}
    times = measure(
        calls,
        warmup=ctx.warmup,
        reps=ctx.reps,
        device=ctx.device,
        progress=ctx.progress,
        label=label,
    )
    results = []
    for name, (title, call) in variants.items():
        timing = times[name]
        variant = Variant(
            name,
            title,
            median_ms(timing.wall),
            [1e3 * t for t in timing.wall],
            median_ms(timing.cpu),
            [1e3 * t for t in timing.cpu],
        )
        variant.collectives = count_collectives(call)
        if memory:
            with _quiet_stderr():
                use = extra_memory(call, ctx.device)
            variant.peak_extra_bytes = use.peak_bytes
            variant.largest_alloc_bytes = use.largest_bytes
        results.append(variant)
    return results


def _avg_floor(flat: Tensor, group: ProcessGroup | None) -> Callable[[], None]:
    op, divisor = _baselines._avg_op(group, flat.device)

    def floor() -> None:
        dist.all_reduce(flat, op=op, group=group)
        if divisor != 1:
            flat.div_(divisor)

    return floor


def _kept_after(call: Callable[[], object]) -> int:
    _buckets.release_buffers()
    call()
    return _buckets.kept_buffer_bytes()


def dense_case(ctx: Context) -> Case:
    """G1: a transformer-like set of dense fp32 grads, ~80 MiB in 291 tensors."""
    shapes = _workloads.transformer_shapes()
    grads = _workloads.grads_of(_workloads.parameters_with_grads(shapes, ctx.device, seed=1))
    tiled_params = _workloads.parameters_with_grads(shapes, ctx.device, seed=1)
    contiguous_grads_(tiled_params)
    tiled = _workloads.grads_of(tiled_params)
    numel = sum(g.numel() for g in grads)
    flat = torch.randn(numel, generator=torch.Generator().manual_seed(2)).to(ctx.device)
    cap = ctx.bucket_cap_mb
    variants: dict[str, tuple[str, Callable[[], object]]] = {
        "ours": (
            f"ours: allreduce_grads_avg ({cap:g} MiB buckets)",
            lambda: allreduce_grads_avg(grads, None, bucket_cap_mb=cap),
        ),
        "zero_copy": (
            "ours, zero-copy (contiguous_grads_ layout)",
            lambda: allreduce_grads_avg(tiled, None, bucket_cap_mb=cap),
        ),
        "floor": ("floor: one all_reduce, pre-flattened", _avg_floor(flat, None)),
        "floor_sum": (
            "the same all_reduce, SUM without the division",
            lambda: dist.all_reduce(flat, op=dist.ReduceOp.SUM),
        ),
        "spec": (
            "spec's scheme: flatten into a fresh buffer",
            lambda: _baselines.spec_allreduce_grads_avg(grads, None),
        ),
        "coalesced": (
            "torch: all_reduce_coalesced",
            lambda: _baselines.torch_all_reduce_coalesced(grads, None),
        ),
        "loop": (
            "per-parameter all_reduce loop",
            lambda: _baselines.per_parameter_loop(grads, None),
        ),
    }
    title = f"dense averaging: {len(grads)} fp32 grads, {4 * numel / 2**20:.1f} MiB"
    case = Case("dense", title, _run_variants(ctx, "dense", variants, memory=True))
    kept = {
        "ours": _kept_after(variants["ours"][1]),
        "zero_copy": _kept_after(variants["zero_copy"][1]),
    }
    for variant in case.variants:
        variant.kept_bytes = kept.get(variant.name, 0)
    cap_bytes = int(cap * 2**20)
    case.rows += [
        ratio_row(case, "G1", "ours", "floor", 1.15),
        ratio_row(case, "G1", "zero_copy", "floor", 1.15),
        paired_ratio_row(case, "ours", "floor"),
        ratio_row(case, None, "ours", "floor_sum", None),
        ratio_row(case, None, "ours", "spec", None),
        ratio_row(case, None, "ours", "coalesced", None),
        ratio_row(case, None, "ours", "loop", None),
        _count_row(
            case,
            "ours",
            "collectives per call, ours (one per bucket)",
            expected_buckets(grads, cap_bytes),
        ),
        _count_row(case, "zero_copy", "collectives per call, ours zero-copy (one buffer)", 1),
    ]
    return case


def _count_row(case: Case, name: str, label: str, expected: int) -> Row:
    seen = next(v.collectives for v in case.variants if v.name == name) or 0
    return Row(None, label, seen, f"== {expected}", seen == expected, "count")


def tiny_case(ctx: Context) -> Case:
    """G2: 1000 tiny grads of 64 floats."""
    shapes: list[tuple] = [(64,)] * 1000
    grads = _workloads.grads_of(_workloads.parameters_with_grads(shapes, ctx.device, seed=3))
    flat = torch.zeros(64 * 1000, device=ctx.device)
    cap = ctx.bucket_cap_mb
    variants: dict[str, tuple[str, Callable[[], object]]] = {
        "ours": (
            "ours: allreduce_grads_avg",
            lambda: allreduce_grads_avg(grads, None, bucket_cap_mb=cap),
        ),
        "loop": (
            "per-parameter all_reduce loop",
            lambda: _baselines.per_parameter_loop(grads, None),
        ),
        "spec": (
            "spec's scheme: flatten into a fresh buffer",
            lambda: _baselines.spec_allreduce_grads_avg(grads, None),
        ),
        "floor": ("floor: one all_reduce, pre-flattened", _avg_floor(flat, None)),
    }
    case = Case("tiny", "many tiny grads: 1000 x 64 fp32", _run_variants(ctx, "tiny", variants))
    case.rows += [
        speedup_row(case, "G2", "loop", "ours", 20.0),
        ratio_row(case, None, "ours", "spec", None),
        ratio_row(case, None, "ours", "floor", None),
    ]
    return case


def dtensor_case(ctx: Context) -> Case:
    """G3: 400 FSDP2 grads averaged over the domain group, as sync_domain_gradients does."""
    if ctx.world % 2:
        return Case("dtensor", "DTensor averaging", notes=["needs an even number of ranks"])
    # Its own dim names: torch may hand a DTensor an equal 1D mesh sliced from another root (same
    # ranks, same name), and these grads must not meet the other cases' meshes.
    mesh = _workloads.mesh(ctx.device.type, (ctx.world // 2, 2), ("fsdp", "domain"))
    model = _workloads.fsdp_model(mesh["fsdp"], blocks=100, dim=128, device=ctx.device, seed=4)
    grads = _workloads.grads_of(list(model.parameters()))
    domain = mesh.get_group("domain")
    local = [g._local_tensor for g in grads if isinstance(g, DTensor)]
    flat = torch.zeros(sum(t.numel() for t in local), device=ctx.device)
    cap = ctx.bucket_cap_mb
    variants: dict[str, tuple[str, Callable[[], object]]] = {
        "ours": (
            "ours: allreduce_grads_avg",
            lambda: allreduce_grads_avg(grads, domain, bucket_cap_mb=cap),
        ),
        "spec": (
            "spec's scheme: per-shard async all_reduces",
            lambda: _baselines.spec_allreduce_grads_avg(grads, domain),
        ),
        "loop": (
            "per-shard blocking all_reduce loop",
            lambda: _baselines.per_parameter_loop(grads, domain),
        ),
        "floor": ("floor: one all_reduce, pre-flattened", _avg_floor(flat, domain)),
    }
    title = (
        f"DTensor averaging: {len(grads)} FSDP2 grads (dp={ctx.world // 2}) over the domain "
        f"group (2 ranks), {4 * flat.numel() / 2**20:.1f} MiB"
    )
    case = Case("dtensor", title, _run_variants(ctx, "dtensor", variants))
    expected = expected_buckets(local, int(cap * 2**20))
    buckets_row = _count_row(case, "ours", "collectives per call, ours (one per bucket)", expected)
    buckets_row.goal_id = "G3"
    case.rows += [
        ratio_row(case, "G3", "ours", "spec", 0.3),
        buckets_row,
        ratio_row(case, None, "ours", "floor", None),
    ]
    return case


def _local_bits(grads: list[Tensor]) -> list[Tensor]:
    return [(g._local_tensor if isinstance(g, DTensor) else g).detach().clone() for g in grads]


def _restore(grads: list[Tensor], saved: list[Tensor]) -> None:
    for grad, value in zip(grads, saved, strict=True):
        (grad._local_tensor if isinstance(grad, DTensor) else grad).copy_(value)


def _same_bits(a: list[Tensor], b: list[Tensor]) -> bool:
    return all(
        x.shape == y.shape and torch.equal(x.view(torch.int32), y.view(torch.int32))
        for x, y in zip(a, b, strict=True)
    )


def _everywhere(flag: bool, device: torch.device) -> bool:
    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def _full(value: Tensor) -> Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _clip_bit_identity(params: list[nn.Parameter], max_norm: float, device: torch.device) -> bool:
    """Whether ours and torch's clip give the same bits (norm and every clipped local grad)."""
    grads = _workloads.grads_of(params)
    saved = _local_bits(grads)
    ours = clip_grad_norm_(params, max_norm)
    ours_grads = _local_bits(grads)
    _restore(grads, saved)
    theirs = _full(torch.nn.utils.clip_grad_norm_(params, max_norm))
    theirs_grads = _local_bits(grads)
    _restore(grads, saved)
    same = _same_bits([ours.reshape(1)], [theirs.reshape(1)]) and _same_bits(
        ours_grads, theirs_grads
    )
    return _everywhere(same, device)


def clip_case(ctx: Context) -> Case:
    """G4 and G5 on one mesh: clipping a homogeneous FSDP2 model of 400 grads."""
    mesh = _workloads.mesh(ctx.device.type, (ctx.world,), ("dp",))
    model = _workloads.fsdp_model(mesh, blocks=100, dim=128, device=ctx.device, seed=5)
    params = [p for p in model.parameters() if p.grad is not None]
    grads = _workloads.grads_of(params)
    max_norm = 0.5 * float(total_grad_norm(grads))
    identical = _clip_bit_identity(params, max_norm, ctx.device)
    variants: dict[str, tuple[str, Callable[[], object]]] = {
        "ours": ("ours: clip_grad_norm_", lambda: clip_grad_norm_(params, max_norm)),
        "torch": (
            "torch.nn.utils.clip_grad_norm_",
            lambda: _full(torch.nn.utils.clip_grad_norm_(params, max_norm)),
        ),
        "spec": (
            "spec's scheme: per-mesh-group clip",
            lambda: _baselines.spec_clip_grad_norm_(params, max_norm),
        ),
        "kernels": (
            "floor: the kernels alone, on local shards",
            _clip_kernels(grads, max_norm),
        ),
        "ours_norm": ("ours: total_grad_norm", lambda: total_grad_norm(grads)),
        "torch_norm": (
            "torch: get_total_norm(...).full_tensor()",
            lambda: _full(torch.nn.utils.get_total_norm(grads)),
        ),
    }
    title = f"clipping, one mesh: {len(params)} FSDP2 grads (dp={ctx.world})"
    case = Case("clip", title, _run_variants(ctx, "clip", variants))
    ours = next(v for v in case.variants if v.name == "ours")
    case.rows += [
        ratio_row(case, "G4", "ours", "torch", 0.3),
        Row(
            "G4",
            "same bits as torch (norm and clipped grads, every rank)",
            "yes" if identical else "no",
            "same bits",
            identical,
            "check",
        ),
        Row(
            "G5",
            "collectives per clip_grad_norm_ (ours)",
            ours.collectives or 0,
            "== 1",
            ours.collectives == 1,
            "count",
        ),
        ratio_row(case, None, "kernels", "torch", None),
        ratio_row(case, None, "ours", "spec", None),
        ratio_row(case, None, "ours_norm", "torch_norm", None),
    ]
    case.notes.append(
        "the kernels floor runs only what a clip with torch's bits must run: the per-grad "
        "foreach norm, the stacked norm, one all_reduce and the foreach multiply, on local "
        "shards listed in advance; G4 cannot hold when this floor alone is above 0.3x torch"
    )
    return case


def _clip_kernels(grads: list[Tensor], max_norm: float) -> Callable[[], None]:
    local = [g._local_tensor if isinstance(g, DTensor) else g for g in grads]

    def kernels() -> None:
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(local, 2.0)), 2.0)
        powered = norm**2
        dist.all_reduce(powered)
        coefficient = torch.clamp(max_norm / (powered**0.5 + 1e-6), max=1.0)
        torch._foreach_mul_(local, coefficient)

    return kernels


def _ulp(a: Tensor, b: Tensor) -> int:
    a32 = a.detach().reshape(1).to(torch.float32).cpu()
    b32 = b.detach().reshape(1).to(torch.float32).cpu()
    return abs(int(a32.view(torch.int32)) - int(b32.view(torch.int32)))


def mixed_case(ctx: Context) -> Case:
    """G5: norms and clipping on FSDP2 + TP, grads on a 1D and a 2D mesh (torch's clip raises)."""
    if ctx.world % 2:
        return Case("mixed", "mixed meshes", notes=["needs an even number of ranks"])
    mesh = _workloads.mesh(ctx.device.type, (ctx.world // 2, 2), ("dp", "tp"))
    model = _workloads.fsdp_tp_model(mesh, blocks=64, dim=128, device=ctx.device, seed=6)
    params = [p for p in model.parameters() if p.grad is not None]
    grads = _workloads.grads_of(params)
    ours_norm = total_grad_norm(grads)
    spec_norm = _baselines.spec_total_grad_norm(grads)
    max_norm = 0.5 * float(ours_norm)
    try:
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        torch_note = "torch.nn.utils.clip_grad_norm_ ran on this layout"
    except Exception as error:  # the failure this library exists for
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        torch_note = (
            f"torch.nn.utils.clip_grad_norm_ raises {type(error).__name__}: {first_line[:90]}"
        )
    variants: dict[str, tuple[str, Callable[[], object]]] = {
        "ours": ("ours: clip_grad_norm_", lambda: clip_grad_norm_(params, max_norm)),
        "spec": (
            "spec's scheme: per-mesh-group clip",
            lambda: _baselines.spec_clip_grad_norm_(params, max_norm),
        ),
        "ours_norm": ("ours: total_grad_norm", lambda: total_grad_norm(grads)),
        "spec_norm": (
            "spec's scheme: per-mesh-group norm",
            lambda: _baselines.spec_total_grad_norm(grads),
        ),
    }
    meshes = {id(g.device_mesh): g.device_mesh.ndim for g in grads if isinstance(g, DTensor)}
    title = (
        f"mixed meshes: {len(params)} grads under FSDP2 (dp={ctx.world // 2}) + TP (tp=2), "
        f"on {len(meshes)} meshes ({', '.join(f'{n}D' for n in sorted(set(meshes.values())))})"
    )
    case = Case("mixed", title, _run_variants(ctx, "mixed", variants), notes=[torch_note])
    counts = {v.name: v.collectives for v in case.variants}
    ulps = _ulp(ours_norm, spec_norm)
    case.rows += [
        Row(
            "G5",
            "collectives per total_grad_norm (ours)",
            counts["ours_norm"] or 0,
            "== 1",
            counts["ours_norm"] == 1,
            "count",
        ),
        Row(
            "G5",
            "collectives per clip_grad_norm_ (ours)",
            counts["ours"] or 0,
            "== 1",
            counts["ours"] == 1,
            "count",
        ),
        Row(None, "collectives per norm, spec's scheme", counts["spec_norm"] or 0, kind="count"),
        Row(
            None, "norm: ULPs between ours and the spec's scheme", ulps, "<= 8", ulps <= 8, "count"
        ),
        ratio_row(case, None, "ours", "spec", None),
        ratio_row(case, None, "ours_norm", "spec_norm", None),
    ]
    return case


CASES: dict[str, Callable[[Context], Case]] = {
    "dense": dense_case,
    "tiny": tiny_case,
    "dtensor": dtensor_case,
    "clip": clip_case,
    "mixed": mixed_case,
}


def run_cases(config: dict) -> list[Case]:
    """Every rank's entry point: run the selected cases in order; rank 0's results count."""
    rank = dist.get_rank()
    device = torch.device(config["device"])
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    # torch warns, on every call of the spec's norm on a 2D mesh, that it redistributes with two
    # sequential all_reduces; the table counts them instead.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    selected = [name for name in CASES if name in config["cases"]]
    progress = Progress(len(selected), enabled=rank == 0)
    ctx = Context(device, config["warmup"], config["reps"], config["bucket_cap_mb"], progress)
    results = []
    for name in selected:
        results.append(CASES[name](ctx))
        progress.case_done()
        progress.update(f"{name} done", 0.0)
    progress.close()
    _buckets.release_buffers()
    return results
