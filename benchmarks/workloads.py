"""The gradients each case works on, built the same way on every rank, from fixed seeds.

The FSDP2 and FSDP2 + TP models are the test suite's layouts (``testbed/layouts.py``), built larger
through its size arguments; the layouts of the setup-cost case are the simulated-scale tests'
(``testbed/fake_world.py``), here on real ranks. The other gradient sets are lists of given shapes;
their values differ between ranks (the seed includes the rank), so averages combine different
numbers.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import baselines
import checks
import torch
import torch.distributed as dist
from report import Row
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

from credit.parallel._common.compat import local_tensor
from credit.parallel.amp import GradScaler
from credit.parallel.collectives import clip_grad_norm_, contiguous_grads_, total_grad_norm
from credit.parallel.grad_sync import sync_domain_gradients, sync_domain_gradients_in_backward
from credit.parallel.replicas import verify_replicas
from credit.parallel.spikes import SpikePolicy
from testbed import layouts
from testbed.fake_world import mixed_grads

# The layouts' model for the FSDP2 cases: 40 blocks of 10 grads, plus 4 outside them.
MODEL = {"blocks": 40, "dim": 64, "hidden": 128}


@dataclass(frozen=True)
class Context:
    """Where the cases run, and for how long."""

    device: torch.device
    warmup: int
    reps: int
    bucket_cap_mb: float

    @property
    def world(self) -> int:
        return dist.get_world_size()

    @property
    def calls(self) -> int:
        """How many times a case calls each variant: warm-up, repetitions, one count."""
        return self.warmup + self.reps + 1


@dataclass
class Workload:
    """What the variants of a case work on.

    Attributes:
        title: the case as the report heads it.
        grads: the gradients (plain or DTensor).
        params: the parameters holding them, for the clips.
        group: the group averaged over (None: every rank).
        bucket_cap_mb: the bucket cap under test.
        buckets: the collectives one call of ours should issue.
        max_norm: the clips' threshold, half the gradients' norm.
        flat: one buffer of the grads' total size, for the floors.
        tiled: the same grads laid out by ``contiguous_grads_``.
        fresh: gradient sets of layouts not yet seen, one per call.
        per_gradient: report the time per gradient too.
        first_calls: nothing ran on the gradients yet: each variant's first call is its first
            for this layout.
        steps: training steps to time, by name, for the cases that train.
        rows: checks made while building.
        notes: what the report should say about the case.
    """

    title: str
    grads: list[Tensor]
    params: list[Tensor] = field(default_factory=list)
    group: ProcessGroup | None = None
    bucket_cap_mb: float = 25.0
    buckets: int = 1
    max_norm: float = 1.0
    flat: Tensor | None = None
    tiled: list[Tensor] = field(default_factory=list)
    fresh: Iterator[list[Tensor]] = field(default_factory=lambda: iter(()))
    per_gradient: bool = False
    first_calls: bool = False
    steps: dict[str, Callable[[], object]] = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _params_with_grads(shapes: list[tuple[int, ...]], ctx: Context, seed: int) -> list[Tensor]:
    """One parameter per shape, each with a random gradient (different on every rank)."""
    generator = torch.Generator().manual_seed(seed * 7919 + dist.get_rank())
    params = []
    for shape in shapes:
        param = nn.Parameter(torch.empty(shape, device=ctx.device))
        param.grad = torch.randn(shape, generator=generator).to(ctx.device)
        params.append(param)
    return params


def _grads(params: list[Tensor]) -> list[Tensor]:
    return [param.grad for param in params if param.grad is not None]


def _transformer_shapes(
    dim: int = 256, layers: int = 24, vocab: int = 8192
) -> list[tuple[int, ...]]:
    """Parameter shapes of a small transformer: 291 tensors, 80.3 MiB of fp32 at the defaults."""
    shapes: list[tuple[int, ...]] = [(vocab, dim)]
    for _ in range(layers):
        shapes += [(dim,), (dim,), (3 * dim, dim), (3 * dim,), (dim, dim), (dim,)]
        shapes += [(dim,), (dim,), (4 * dim, dim), (4 * dim,), (dim, 4 * dim), (dim,)]
    return [*shapes, (dim,), (dim,)]


def expected_buckets(tensors: list[Tensor], cap_mb: float) -> int:
    """Collectives ``allreduce_grads_avg`` should issue for ``tensors`` (all on one device).

    The documented rule, per dtype: a contiguous tensor of at least ``cap`` elements is reduced
    alone; the other non-empty tensors fill buckets in order, a bucket closing when the next
    tensor would take it past ``cap`` elements (``cap = cap_bytes // itemsize``).
    """
    count = 0
    for dtype in dict.fromkeys(tensor.dtype for tensor in tensors):
        cap = max(1, int(cap_mb * 2**20) // dtype.itemsize)
        filled = 0
        for tensor in (t for t in tensors if t.dtype == dtype):
            numel = tensor.numel()
            if numel >= cap and tensor.is_contiguous():
                count += 1
            elif numel > 0:
                if filled == 0 or filled + numel > cap:
                    count += 1
                    filled = 0
                filled += numel
    return count


def dense(ctx: Context) -> Workload:
    """A transformer's dense fp32 grads, 80 MiB in 291 tensors, averaged over every rank."""
    shapes = _transformer_shapes()
    grads = _grads(_params_with_grads(shapes, ctx, seed=1))
    tiled = _params_with_grads(shapes, ctx, seed=1)
    contiguous_grads_(tiled)
    numel = sum(grad.numel() for grad in grads)
    return Workload(
        f"dense averaging: {len(grads)} fp32 grads, {4 * numel / 2**20:.1f} MiB, "
        f"{ctx.bucket_cap_mb:g} MiB buckets",
        grads,
        bucket_cap_mb=ctx.bucket_cap_mb,
        buckets=expected_buckets(grads, ctx.bucket_cap_mb),
        flat=torch.randn(numel, generator=torch.Generator().manual_seed(2)).to(ctx.device),
        tiled=_grads(tiled),
    )


def tiny(ctx: Context) -> Workload:
    """1000 grads of 64 floats, averaged over every rank."""
    grads = _grads(_params_with_grads([(64,)] * 1000, ctx, seed=3))
    return Workload(
        "many tiny grads: 1000 x 64 fp32",
        grads,
        bucket_cap_mb=ctx.bucket_cap_mb,
        flat=torch.zeros(64 * 1000, device=ctx.device),
    )


def dtensor(ctx: Context) -> Workload:
    """FSDP2 grads averaged over the domain group, as ``sync_domain_gradients`` does."""
    # Dim names of its own: torch may hand a DTensor an equal 1D mesh sliced from another root
    # (same ranks, same name), and these grads must not meet the other cases' meshes.
    mesh = layouts.mesh((ctx.world // 2, 2), ("fsdp", "domain"), ctx.device.type)
    model = layouts.build("fsdp", 4, **MODEL, device=ctx.device.type, dp_mesh=mesh["fsdp"]).model
    grads = layouts.grads(model)
    local = [local_tensor(grad) for grad in grads]
    numel = sum(shard.numel() for shard in local)
    return Workload(
        f"DTensor averaging: {len(grads)} FSDP2 grads (dp={ctx.world // 2}) over the domain "
        f"group (2 ranks), {4 * numel / 2**20:.1f} MiB",
        grads,
        group=mesh.get_group("domain"),
        bucket_cap_mb=ctx.bucket_cap_mb,
        buckets=expected_buckets(local, ctx.bucket_cap_mb),
        flat=torch.zeros(numel, device=ctx.device),
    )


def _with_grads(model: nn.Module) -> list[Tensor]:
    return [param for param in model.parameters() if param.grad is not None]


def _to_clip(ctx: Context, layout: str, seed: int) -> tuple[list[Tensor], list[Tensor], float]:
    """The layouts' model built as ``layout`` with gradients in place, and a max_norm of half
    their norm (so that the clip scales)."""
    params = _with_grads(layouts.build(layout, seed, **MODEL, device=ctx.device.type).model)
    grads = _grads(params)
    return params, grads, 0.5 * float(total_grad_norm(grads))


def clip(ctx: Context) -> Workload:
    """An FSDP2 model over every rank: every grad on one 1D mesh; torch's clip works."""
    params, grads, max_norm = _to_clip(ctx, "fsdp", 5)
    return Workload(
        f"clip on one mesh: {len(params)} FSDP2 grads (dp={ctx.world})",
        grads,
        params,
        max_norm=max_norm,
        rows=[checks.same_bits_as_torch(params, max_norm)],
        notes=[
            "the kernels alone run what a clip with torch's bits must: the per-gradient foreach "
            "norm, the stacked powers in one all_reduce, the total and the foreach multiply, on "
            "local shards listed in advance; ours cannot beat torch by more than they allow"
        ],
    )


def ddp(ctx: Context) -> Workload:
    """Plain replicas on every rank (DDP's layout): torch's clip issues no collective, ours one
    small all_reduce that compares the copies and carries a NaN or inf from any of them."""
    params, grads, max_norm = _to_clip(ctx, "plain", 7)
    return Workload(
        f"clip on DDP's layout: {len(params)} plain grads, copies on every rank ({ctx.world} "
        "ranks)",
        grads,
        params,
        max_norm=max_norm,
        rows=[
            checks.same_bits_as_torch(params, max_norm),
            checks.wire_of(
                lambda: clip_grad_norm_(params, max_norm),
                [(3 * len(params), ctx.world)],
                ctx.device,
            ),
        ],
        notes=[
            "torch's clip takes each rank's norm alone, with no collective: a NaN or inf on one "
            "rank, or copies that drifted apart, stay on that rank; ours returns torch's bits and "
            f"adds one all_reduce of 3 x {len(params)} float64 numbers (a norm per gradient, and "
            "two per gradient that compare its copies)"
        ],
    )


def pipeline(ctx: Context) -> Workload:
    """Two pipeline stages, each its own model replicated over its ranks (DDP inside a stage):
    ours compares every group of copies in the norm's one all_reduce; torchtitan's clip takes the
    copies as they are."""
    dp = ctx.world // 2
    stage, place = divmod(dist.get_rank(), dp)
    pp_groups = [dist.new_group([place_, place_ + dp]) for place_ in range(dp)]
    params = _with_grads(layouts.build("plain", 8 + stage, **MODEL, device=ctx.device.type).model)
    grads, pp_group = _grads(params), pp_groups[place]
    return Workload(
        f"clip across pipeline stages: pp=2 x dp={dp}, {len(params)} plain grads a stage, "
        "replicated over the stage's ranks",
        grads,
        params,
        group=pp_group,
        max_norm=0.5 * float(total_grad_norm(grads, pp_group=pp_group)),
        notes=[
            "ours adds to the norm's all_reduce four float64 numbers per group of copies of every "
            f"stage ({2 * len(params) if dp > 1 else 0} groups here), proving every copy within "
            "its bound on every call; torchtitan's all-reduces one number over the pipeline group",
        ],
    )


def mixed(ctx: Context) -> Workload:
    """FSDP2 + TP: grads on a 1D and a 2D mesh, where torch's clip raises."""
    params, grads, max_norm = _to_clip(ctx, "fsdp_tp", 6)
    return Workload(
        f"clip on FSDP2 (dp={ctx.world // 2}) + TP (tp=2): {len(params)} grads on a 1D and a "
        "2D mesh",
        grads,
        params,
        max_norm=max_norm,
        rows=[checks.ulps_from_norm_per_mesh_group(grads)],
        notes=[checks.torch_clip_fails(params, max_norm)],
    )


# The process group where each layout's copies meet, by its mesh dim's name.
COPY_GROUP_DIMS = {"fsdp_tp": "tp", "hsdp": "replicate"}


def copy_groups(ctx: Context, layout: str) -> Workload:
    """FSDP2 + TP or HSDP, where the norm compares the copies of a gradient in their own
    process group (tp; HSDP's replicate dim) before the world's all_reduce; beside it, each of
    those two all_reduces alone, with buffers of the sizes ours sends.

    The sizes follow from the layout: two float64 numbers per gradient whose copies span the
    group (on a mesh without its dim, as FSDP2's dp mesh sliced from a (dp, tp) one, whose
    copies are its peers there, or Replicate on that dim), and over the world one number per
    gradient and the flag; ``checks.wire_of`` holds ours to them.
    """
    dim = COPY_GROUP_DIMS[layout]
    params, grads, max_norm = _to_clip(ctx, layout, 12)
    meshes = [grad.device_mesh for grad in grads if isinstance(grad, DTensor)]
    group = next(m for m in meshes if dim in (m.mesh_dim_names or ())).get_group(dim)
    beside = sum(dim not in (m.mesh_dim_names or ()) for m in meshes)
    replicated = sum(_replicated_on(grad, dim) for grad in grads)
    sizes = (2 * (beside + replicated), len(grads) + 1)
    in_group, in_world = (torch.zeros(n, dtype=torch.float64, device=ctx.device) for n in sizes)

    def both_rounds() -> None:
        dist.all_reduce(in_group, group=group)
        dist.all_reduce(in_world)

    span = f"{replicated} with Replicate on {dim}"
    if beside:
        span = f"{beside} on a mesh without {dim} (their copies are their {dim} peers) and {span}"
    return Workload(
        f"copies compared in their own groups, {_layout_title(layout, ctx.world)}: "
        f"{len(grads)} grads, {beside + replicated} of them compared over {dim} "
        f"({group.size()} ranks)",
        grads,
        params,
        max_norm=max_norm,
        steps={
            "group_round": functools.partial(dist.all_reduce, in_group, group=group),
            "world_round": functools.partial(dist.all_reduce, in_world),
            "both_rounds": both_rounds,
        },
        rows=[
            checks.wire_of(
                lambda: clip_grad_norm_(params, max_norm),
                [(sizes[0], group.size()), (sizes[1], ctx.world)],
                ctx.device,
            )
        ],
        notes=[
            f"ours: the group round, one all_reduce over {dim} of 2 float64 numbers per gradient "
            f"whose copies span it ({span}), then the world's all_reduce of one number per "
            "gradient and the flag of the comparison; the other variants time those "
            "all_reduces alone, on buffers of the same sizes over the same ranks",
            f"on these {ctx.world} ranks of one machine, gloo's all_reduce over {group.size()} "
            f"ranks and over {ctx.world} move data through the same loopback; across nodes the "
            "group round stays within the copies' own group (tp within a node; HSDP's replicas)",
        ],
    )


def _layout_title(layout: str, world: int) -> str:
    if layout == "hsdp":
        return f"HSDP (replicate=2, shard={world // 2})"
    return f"FSDP2 (dp={world // 2}) + TP (tp=2)"


def _replicated_on(grad: Tensor, dim: str) -> bool:
    if not isinstance(grad, DTensor):
        return False
    names = grad.device_mesh.mesh_dim_names or ()
    return dim in names and isinstance(grad.placements[names.index(dim)], Replicate)


def scaling(ctx: Context, count: int) -> Workload:
    """``count`` small Shard(0) DTensor grads on one 1D mesh over every rank, to clip."""
    mesh = layouts.mesh((ctx.world,), ("dp",), ctx.device.type)
    generator = torch.Generator().manual_seed(7 * 7919 + dist.get_rank())
    params = []
    for _ in range(count):
        local = torch.randn(4, 64, generator=generator).to(ctx.device)
        grad = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        param = nn.Parameter(torch.empty_like(grad))
        param.grad = grad
        params.append(param)
    grads = _grads(params)
    return Workload(
        f"clip scaling: {count} Shard(0) DTensor grads, (4, 64) on each rank, on one 1D mesh "
        f"over every rank",
        grads,
        params,
        max_norm=0.5 * _norm_of_shards(grads),
        per_gradient=True,
        first_calls=True,
        notes=[
            "first call: each variant's first call on these gradients; torch's includes "
            "DTensor's sharding propagation for its foreach ops over the whole list, cached after"
        ],
    )


def _norm_of_shards(grads: list[Tensor]) -> float:
    """The norm of gradients sharded over every rank without copies, with plain torch calls."""
    powers = torch.stack(torch._foreach_norm([local_tensor(grad) for grad in grads])) ** 2
    dist.all_reduce(powers)
    return float(powers.sum().sqrt())


def setup(ctx: Context) -> Workload:
    """The norm on a layout seen for the first time, and on one seen before.

    The layouts are the simulated-scale tests' (FSDP2 + TP grads on a 1D and a 2D mesh, plain
    grads beside them); each first call gets a set of new shapes.
    """
    mesh = layouts.mesh((ctx.world // 2, 2), ("dp", "tp"), ctx.device.type)
    sets = [mixed_grads(mesh, blocks=80, width=16 + index) for index in range(ctx.calls + 1)]
    return Workload(
        f"norm setup: first call for a layout vs a later call, {len(sets[0])} grads on a 1D and "
        f"a 2D mesh (dp={ctx.world // 2}, tp=2)",
        sets[0],
        fresh=iter(sets[1:]),
    )


# The AMP step's scalers and clips, by variant: this package's, torch's, torch's sharded one, and
# torch's clip and the optimizer step with no scaler at all.
AMP_VARIANTS: dict[str, tuple[type[torch.amp.GradScaler] | None, Callable[..., object]]] = {
    "ours": (GradScaler, clip_grad_norm_),
    "torch": (torch.amp.GradScaler, baselines.torch_clip),
    "sharded": (ShardedGradScaler, baselines.torch_clip),
    "no_scaler": (None, baselines.torch_clip),
}
AMP_MAX_NORM = 1e30  # above any norm here: the clip multiplies by 1


def amp(ctx: Context) -> Workload:
    """The AMP step (unscale_, clip, step, update) on FSDP2 over every rank: one mesh, where
    torch's scaler is right. Each variant trains its own copy of the model, from the same
    weights and gradients, with foreach AdamW.

    The scale stays at 1.0 (init_scale 1, no growth) and max_norm lies above the norm, so the
    gradients are the same before every call, while every kernel still runs: the unscale and the
    clip multiply whatever the factor. A larger scale would divide the gradients again on every
    call (``unscale_`` works in place), down to denormals and zeros.
    """
    # The sharded scaler hands DTensor ops a 1-element found_inf, which DTensor warns about.
    warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1")
    steps: dict[str, Callable[[], object]] = {}
    params: dict[str, list[Tensor]] = {}
    for key, (scaler_type, clip) in AMP_VARIANTS.items():
        model = layouts.build("fsdp", 8, **MODEL, device=ctx.device.type).model
        params[key] = _with_grads(model)
        optimizer = torch.optim.AdamW(params[key], lr=1e-6, foreach=True)
        scaler = None if scaler_type is None else _constant_scaler(scaler_type, ctx.device)
        steps[key] = _amp_step(scaler, optimizer, clip, params[key])
    for key, loss in (("spikes", None), ("spikes_loss", torch.ones((), device=ctx.device))):
        model = layouts.build("fsdp", 8, **MODEL, device=ctx.device.type).model
        params[key] = _with_grads(model)
        optimizer = torch.optim.AdamW(params[key], lr=1e-6, foreach=True)
        steps[key] = _spike_step(optimizer, params[key], loss, ctx.device)
    grads = _grads(params["ours"])
    return Workload(
        f"AMP step: unscale_ + clip + step + update, foreach AdamW, {len(grads)} FSDP2 grads "
        f"(dp={ctx.world})",
        grads,
        steps=steps,
        # The check makes each variant's first call, where ours verifies the layout with one
        # more collective: every call timed or counted is a later one.
        rows=[checks.steps_taken_alike(steps, params)],
        notes=[
            "torch's scaler reduces found_inf in unscale_ (DTensor's all_reduce over the first "
            "gradient's mesh) and torch's clip reduces the norm: 2 collectives; the sharded "
            "scaler adds its own all_reduce of found_inf over the default group: 3; ours lets "
            "the clip's all_reduce carry the answer: 1",
            "the scale stays at 1.0 and the clip at a factor of 1, so every call runs on the "
            "same gradients",
            "with the spike policy (skip and adaptive clip, ours's scaler and norm): the same "
            "kernels run whatever the values; its eps is set so high that no step is a spike, "
            "so every call steps; a loss adds its average over the world: 2 collectives",
        ],
    )


def _spike_step(
    optimizer: torch.optim.Optimizer,
    params: list[Tensor],
    loss: Tensor | None,
    device: torch.device,
) -> Callable[[], None]:
    """Ours with a spike policy (skip and adaptive clip) in place of the clip, given ``loss``."""
    policy = SpikePolicy(adaptive_clip="zscore", warmup=1, eps=1e30)
    scaler = GradScaler(device.type, init_scale=1.0, growth_interval=10**9, spikes=policy)
    scaler.scale(torch.ones((), device=device))

    def step() -> None:
        scaler.unscale_(optimizer)
        policy.clip_grad_norm_(params, AMP_MAX_NORM, loss=loss)
        scaler.step(optimizer)
        scaler.update()

    return step


def _constant_scaler(
    scaler_type: type[torch.amp.GradScaler], device: torch.device
) -> torch.amp.GradScaler:
    """A scaler of ``scaler_type`` whose scale is 1.0 and stays so while no step is skipped."""
    scaler = scaler_type(device.type, init_scale=1.0, growth_interval=10**9)
    scaler.scale(torch.ones((), device=device))  # the scale is created on first use
    return scaler


def _amp_step(
    scaler: torch.amp.GradScaler | None,
    optimizer: torch.optim.Optimizer,
    clip: Callable[..., object],
    params: list[Tensor],
) -> Callable[[], None]:
    def step() -> None:
        if scaler is None:
            clip(params, AMP_MAX_NORM)
            optimizer.step()
            return
        scaler.unscale_(optimizer)
        clip(params, AMP_MAX_NORM)
        scaler.step(optimizer)
        scaler.update()

    return step


# The replica check on a GPU, estimated on paper (nothing here runs on one). Ours moves about 8.5
# bytes through device memory per byte digested (per 32-bit word: the copy of the small tensors
# together, 4 + 4; the conversion to float64, 4 + 8; the product, 8; the rows' five sums
# converted, weighted and added, about 5), 6 for tensors of 1 MiB or more (read in place, not
# copied). SHA-1 copies every tensor to the host, one blocking copy each, and hashes it on one
# core.
HBM_TB_S = (3.35, 4.8)  # H100 SXM, H200
PCIE_GB_S = (25.0, 50.0)  # device to host over PCIe Gen5 x16, pageable to pinned memory
NVLINK_C2C_GB_S = 450.0  # device to host on a Grace Hopper node
SHA1_GB_S = (1.0, 2.0)  # per core
BILLION_WITH_ADAMW = 12e9  # bytes: 1 B fp32 parameters, exp_avg and exp_avg_sq


def _span(nbytes: float, rates: tuple[float, ...]) -> str:
    """The time ``nbytes`` take at each of ``rates`` (bytes per second), fastest first, in one
    unit, to two significant figures."""
    times = sorted(nbytes / rate for rate in rates)
    unit, scale = next(
        ((u, s) for u, s in (("s", 1.0), ("ms", 1e-3)) if times[-1] >= s), ("us", 1e-6)
    )
    return "-".join(f"{float(f'{t / scale:.2g}'):g}" for t in times) + f" {unit}"


def _on_a_gpu(nbytes: float, bytes_moved: float) -> str:
    """Ours against SHA-1 for ``nbytes`` of tensors, on paper."""
    hbm = tuple(tb * 1e12 for tb in HBM_TB_S)
    pcie = tuple(gb * 1e9 for gb in PCIE_GB_S)
    sha1 = tuple(gb * 1e9 for gb in SHA1_GB_S)
    return (
        f"ours {_span(nbytes * bytes_moved, hbm)} of device-memory traffic "
        f"({bytes_moved} bytes per byte at {HBM_TB_S[0]}-{HBM_TB_S[1]} TB/s); SHA-1 "
        f"{_span(nbytes, pcie)} of copies at {PCIE_GB_S[0]:.0f}-{PCIE_GB_S[1]:.0f} GB/s over "
        f"PCIe ({_span(nbytes, (NVLINK_C2C_GB_S * 1e9,))} over NVLink-C2C) and "
        f"{_span(nbytes, sha1)} of hashing at {SHA1_GB_S[0]:.0f}-{SHA1_GB_S[1]:.0f} GB/s on one "
        "core"
    )


def replicas(ctx: Context) -> Workload:
    """The layouts' model as plain replicas on every rank (DDP's layout), one AdamW step taken:
    its parameters and their state, every tensor a copy on every rank."""
    built = layouts.build("plain", 9, **MODEL, device=ctx.device.type)
    params = _with_grads(built.model)
    optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    optimizer.step()
    # What ours reads: every parameter (a frozen layer's too) and every state tensor.
    tensors = list(built.model.parameters())
    tensors += [value for state in optimizer.state.values() for value in state.values()]
    steps = {
        "ours": lambda: verify_replicas(built.model, optimizer),
        "sha1": lambda: baselines.sha1_all_gather(tensors),
        "all_gather": lambda: baselines.all_gather_compare(tensors),
    }
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    report = verify_replicas(built.model, optimizer)
    return Workload(
        f"replica check: {len(params)} trained parameters and their AdamW state, "
        f"{len(tensors)} tensors, "
        f"{nbytes / 2**20:.1f} MiB, copies on every rank (DDP's layout, {ctx.world} ranks)",
        _grads(params),
        steps=steps,
        rows=[
            checks.replicas_found_equal(steps, report.compared == report.tensors == len(tensors))
        ],
        notes=[
            "every variant reads the same tensors: the parameters and exp_avg, exp_avg_sq, step",
            "SHA-1: each tensor copied to the host as float32 (a no-op for float32 CPU tensors) "
            "and hashed, the 20-byte digests all_gathered and compared with rank 0's (Megatron's "
            "scheme, over every tensor); all_gather: every copy's bytes gathered and compared",
            "ours: four 64-bit lanes per tensor, one all_reduce of six int64 numbers; a plan per "
            "layout (built on its first call) keeps the padding, row coefficient and weight "
            "tensors on the device; each later call copies the small tensors of a dtype together "
            "a block of rows at a time, converts each block to float64 while it is in cache for "
            "the exact product, and adds up the weighted rows (one index_add_), with no host read "
            "but the verdict; it also covers sharded and TP layouts, buffers, and repairs",
            f"on a GPU, estimated on paper (not measured), for these {len(tensors)} tensors: "
            f"{_on_a_gpu(nbytes, 8.5)}; ours then launches a few tens of kernels and runs its "
            f"Python, SHA-1 also waits on {len(tensors)} blocking copies",
            "on a GPU, estimated on paper (not measured), for 1 B fp32 parameters with their "
            f"AdamW state (12 GB, large tensors read in place): "
            f"{_on_a_gpu(BILLION_WITH_ADAMW, 6.0)}",
        ],
    )


# The in-backward case: 16 blocks, each an FSDP2 unit, and the root: 17 units.
DEEP_MODEL = {"blocks": 16, "dim": 128, "hidden": 512}
DEEP_BATCH = 128


def in_backward(ctx: Context) -> Workload:
    """The domain average after backward (explicit) and inside it, on a 17-unit FSDP2 model.

    Two copies of the model over a (dp = world / 2, domain = 2) mesh; each domain rank trains on
    its own batch. The steps time zero_grad, forward, backward and, for the explicit copy, the
    sync; the forward alone is timed too, to be taken off both.
    """
    # FSDP2 warns on each step that the 1-column head's output is a view, and autograd that the
    # input needs no gradient; neither concerns a loss that is only backpropagated.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    mesh = layouts.mesh((ctx.world // 2, 2), ("shard", "band"), ctx.device.type)
    explicit, ours = (_deep_fsdp(mesh["shard"], ctx) for _ in range(2))
    sync_domain_gradients_in_backward(ours, mesh["band"])
    generator = torch.Generator().manual_seed(11 + dist.get_rank())
    x = torch.randn(DEEP_BATCH, layouts.IN_DIM, generator=generator).to(ctx.device)

    def explicit_step() -> None:
        _backward(explicit, x)
        sync_domain_gradients(explicit, mesh["band"])

    rows = _in_backward_rows(explicit, ours, x, mesh["band"])
    units = 1 + int(DEEP_MODEL["blocks"])
    return Workload(
        f"domain average after vs inside backward: FSDP2, {units} units, "
        f"{sum(p.numel() for p in explicit.parameters()):,} parameters on dp={ctx.world // 2}, "
        f"over the domain group (2 ranks), batch {DEEP_BATCH}",
        layouts.grads(ours),
        steps={
            "explicit": explicit_step,
            "in_backward": lambda: _backward(ours, x),
            "forward": lambda: _forward(explicit, x),
        },
        rows=rows,
        notes=[
            "times are of zero_grad + forward + backward (+ the explicit sync); the ratio less "
            "the forward takes the forward's median off both. On CPU FSDP2 reduces and runs "
            "its all-reduce hook on the calling thread, so each unit's domain all_reduce waits "
            "in backward instead of after it: the collectives move, the time cannot hide"
        ],
    )


def _deep_fsdp(dp_mesh: DeviceMesh, ctx: Context) -> nn.Module:
    torch.manual_seed(5)
    model = layouts.TinyNet(**DEEP_MODEL).to(ctx.device)
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def _forward(model: nn.Module, x: Tensor) -> Tensor:
    return model(x).pow(2).mean()


def _backward(model: nn.Module, x: Tensor) -> None:
    model.zero_grad(set_to_none=True)
    _forward(model, x).backward()


def _in_backward_rows(
    explicit: nn.Module, ours: nn.Module, x: Tensor, domain: DeviceMesh
) -> list[Row]:
    """Collectives in and after a step of each (the second: the first call for a layout may
    check it), and whether their grads have the same bits."""
    counts = {}
    for name, model, after in (
        ("ours", ours, lambda: None),
        ("explicit", explicit, lambda: sync_domain_gradients(explicit, domain)),
    ):
        for _ in range(2):
            with CommDebugMode() as during:
                _backward(model, x)
            with CommDebugMode() as later:
                after()
        counts[name] = (during.get_total_counts(), later.get_total_counts())
    label = "collectives {} backward (ours / explicit)"
    return [
        Row(label.format("after"), f"{counts['ours'][1]} / {counts['explicit'][1]}", "count"),
        Row(label.format("in"), f"{counts['ours'][0]} / {counts['explicit'][0]}", "count"),
        checks.same_grads(ours, explicit),
    ]
