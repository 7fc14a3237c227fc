"""The public functions' steady state on fake CUDA tensors, and the host syncs each may make.

One rank of a 4-rank fake world (torch's ``"fake"`` backend with a ``FakeStore``), on CUDA
DeviceMeshes, holds gradients in the layouts FSDP2 and FSDP2 + TP produce, built directly with
``DTensor.from_local``: plain replicated tensors; FSDP2 over the world (a 1-row weight leaves
every rank but the first an empty shard); dp=2 x tp=2 with ``_StridedShard`` (FSDP2 over TP's
colwise shard), rowwise ``(Shard(0), Shard(1))``, a ``(Shard(0), Replicate())`` bias, dp-only
shards and plain replicas beside them; and two pipeline stages of FSDP2 shards. Every path of
:data:`ROWS` is called three times under :class:`~support.sync_trace.SyncRecorder`; the second and third
calls are the steady state, which the row's numbers bound exactly.

:data:`ROWS` is the table of the guide: one row per path, its host reads and blocking copies at
steady state (every other kind of sync is always zero). Add a row to trace a new path. A row whose
``needs`` names a function of ``credit.parallel.collectives`` that does not exist yet is reported
as missing (``tests/test_host_syncs.py`` decides what that means).

:func:`trace_world` runs everything in one process: run it in a fresh spawned process, since the
default process group it initialises and the no-op CUDA guard it loads stay there.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from credit.parallel import collectives
from credit.parallel._common import compat as _compat
from credit.parallel.amp import GradScaler
from credit.parallel.collectives import all_reduce_avg, allreduce_grads_avg, clip_grad_norm_
from credit.parallel.collectives import total_grad_norm as _total_grad_norm
from credit.parallel.grad_sync import sync_domain_gradients, sync_replicated_gradients
from credit.parallel.norm_report import grad_norm_report
from credit.parallel.replicas import verify_replicas
from credit.parallel.spikes import SpikePolicy
from support.sync_trace import (
    BLOCKING_COPY,
    CPU_COLLECTIVE,
    DATA_DEPENDENT,
    DEVICE_MISMATCH,
    READ,
    Sync,
    fake_cuda,
    load_noop_cuda_guard,
    recording,
    register_fake_collectives,
)

WORLD = 4
CALLS = 3  # the first call of a layout, then two at steady state
LAYOUTS = ("plain", "fsdp", "mixed")


# ---------------------------------------------------------------------------------------------
# the world and its gradients


@dataclass
class World:
    """This rank's meshes, and the gradients of each layout on ``device``.

    Every local shard is zero but for its first element, a small integer chosen so that every
    norm is exact: a shard's norm is that integer, and each gradient's sum of squares over its
    distinct shards is a perfect square (shards of 1 over 4 ranks, of 3 and 4 over 2), so that
    only the total's square root rounds. The same computation on the CPU and on CUDA then gives
    the same bits, whatever order each device's kernels add in (``tests/test_gpu_syncs.py``
    compares them); the trace ignores values.

    Attributes:
        made: every gradient handed out, in order.
    """

    rank: int
    device: str
    flat: DeviceMesh  # ("dp",) over every rank: FSDP2 alone
    dp_tp: DeviceMesh  # (dp=2, tp=2)
    pp_dp: DeviceMesh  # (pp=2, dp=2): two pipeline stages of FSDP2
    dp_domain: DeviceMesh  # (dp=2, domain=2)
    made: list[Tensor] = field(default_factory=list)

    @classmethod
    def build(cls, rank: int, device: str = "cuda") -> World:
        """The meshes of a world of :data:`WORLD` ranks (call it on every rank)."""
        grid = torch.arange(WORLD).view(2, 2)
        # A CUDA DeviceMesh picks this rank's device from the host's GPU count (2.10 even on a
        # fake world): one GPU, already set.
        with (
            mock.patch.object(torch.cuda, "device_count", return_value=1),
            mock.patch.object(torch.cuda, "set_device"),
        ):
            return cls(
                rank=rank,
                device=device,
                flat=DeviceMesh(device, torch.arange(WORLD), mesh_dim_names=("dp",)),
                dp_tp=DeviceMesh(device, grid, mesh_dim_names=("dp", "tp")),
                pp_dp=DeviceMesh(device, grid, mesh_dim_names=("pp", "dp")),
                dp_domain=DeviceMesh(device, grid, mesh_dim_names=("dp", "domain")),
            )

    def grads(self, layout: str) -> list[Tensor]:
        """Fresh gradients of ``layout`` (a new layout for the norm's caches)."""
        grads = {
            "plain": self._plain,
            "fsdp": self._fsdp,
            "mixed": self._mixed,
            "dtensors": self._dtensors,
            "buckets": self._buckets,
            "dp_shards": self._dp_shards,
            "domain": self._domain,
            "pp": self._pipeline,
        }[layout]()
        self.made.extend(grads)
        return grads

    def params(self, layout: str) -> list[nn.Parameter]:
        """Parameters holding fresh gradients of ``layout``."""
        params = []
        for grad in self.grads(layout):
            param = nn.Parameter(torch.zeros_like(grad))
            param.grad = grad
            params.append(param)
        return params

    def tensor(self, *shape: int, value: float = 2.0) -> Tensor:
        """A local tensor on this world's device: zeros, and ``value`` first."""
        tensor = torch.zeros(shape)
        if tensor.numel():
            tensor.view(-1)[0] = value
        return tensor.to(self.device)

    def _dp_rank(self, mesh: DeviceMesh) -> int:
        coordinate = mesh.get_coordinate()
        assert coordinate is not None
        return coordinate[0]

    def _plain(self) -> list[Tensor]:
        return [self.tensor(16, 8), self.tensor(8, value=3.0), self.tensor(3, 5)]

    def _fsdp(self) -> list[Tensor]:
        first = 1 if self.rank == 0 else 0  # a 1-row weight: every other rank holds no row
        return [
            _shard(self.tensor(4, 8, value=1.0), self.flat, [Shard(0)], (16, 8)),
            _shard(self.tensor(2, 8, value=1.0), self.flat, [Shard(0)], (8, 8)),
            _shard(self.tensor(first, 8, value=1.0), self.flat, [Shard(0)], (1, 8)),
        ]

    def _dtensors(self) -> list[Tensor]:
        """FSDP2 + TP: every gradient a DTensor, as torch's optimizers need them."""
        mesh, dp = self.dp_tp, self.dp_tp["dp"]
        dp_rank = self._dp_rank(mesh)
        half = (3.0, 4.0)[dp_rank]  # 3^2 + 4^2 = 5^2 over the two dp shards
        strided = [_StridedShard(0, split_factor=2), Shard(0)]
        return [
            _shard(self.tensor(2, 8, value=1.0), mesh, strided, (8, 8)),
            _shard(self.tensor(4, 4, value=1.0), mesh, [Shard(0), Shard(1)], (8, 8)),
            _shard(self.tensor(4, value=half), mesh, [Shard(0), Replicate()], (8,)),
            _shard(self.tensor(4, value=half), dp, [Shard(0)], (8,)),
            _shard(self.tensor(1 - dp_rank, 8), dp, [Shard(0)], (1, 8)),
        ]

    def _buckets(self) -> list[Tensor]:
        """Plain replicas, and one larger than a small bucket (reduced in place)."""
        return [*self._plain(), self.tensor(300)]

    def _dp_shards(self) -> list[Tensor]:
        """FSDP2 shards on the dp mesh of (dp, tp): the same on both tp peers."""
        dp = self.dp_tp["dp"]
        return [
            _shard(self.tensor(4, 8), dp, [Shard(0)], (8, 8)),
            _shard(self.tensor(3), dp, [Shard(0)], (6,)),
        ]

    def _domain(self) -> list[Tensor]:
        """FSDP2 shards on the dp mesh of (dp, domain), and plain gradients beside them."""
        dp = self.dp_domain["dp"]
        shard = _shard(self.tensor(4, 8), dp, [Shard(0)], (8, 8))
        return [shard, self.tensor(8), self.tensor(3, 5)]

    def _mixed(self) -> list[Tensor]:
        """FSDP2 + TP with a plain replicated gradient beside the DTensors."""
        return [*self._dtensors(), self.tensor(8)]

    def _pipeline(self) -> list[Tensor]:
        """This rank's stage: FSDP2 shards over the stage's dp mesh; the stages differ."""
        dp = self.pp_dp["dp"]
        # All DTensors (a replicated one among them), as torch's fused optimizers need them.
        grads = [
            _shard(self.tensor(4, 8), dp, [Shard(0)], (8, 8)),
            _shard(self.tensor(8), dp, [Replicate()], (8,)),
        ]
        if self._dp_rank(self.pp_dp) == 0:
            grads.append(_shard(self.tensor(2), dp, [Shard(0)], (4,)))
        return grads


def _shard(local: Tensor, mesh: DeviceMesh, placements: list, shape: tuple[int, ...]) -> DTensor:
    stride = tuple(math.prod(shape[dim + 1 :]) for dim in range(len(shape)))
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def _adamw(params: list[nn.Parameter], kind: str) -> torch.optim.AdamW:
    """torch's AdamW, ``fused`` (its step counts on the device) or ``foreach`` (on the CPU)."""
    return torch.optim.AdamW(params, lr=1e-3, **{kind: True})


# ---------------------------------------------------------------------------------------------
# the paths: each builds its objects and returns one steady-state call

Call = Callable[[], object]


def _total_norm(layout: str, order: float, foreach: bool | None, world: World) -> Call:
    grads = world.grads(layout)
    return lambda: _total_grad_norm(grads, order, foreach=foreach)


def _clip(layout: str, order: float, foreach: bool | None, world: World) -> Call:
    params = world.params(layout)
    return lambda: clip_grad_norm_(params, 1.0, order, foreach=foreach)


# Every max_norm form torch's clip takes: a float, or a one-element tensor on the CPU or beside
# the gradients ("CUDA": on the CPU too, when the same path runs on the CPU to compare).
MAX_NORMS: dict[str, Callable[[str], float | Tensor]] = {
    "float": lambda device: 1.0,
    "CPU 0-dim": lambda device: torch.tensor(1.0),
    "CPU 1-element": lambda device: torch.tensor([1.0]),
    "CUDA 0-dim": lambda device: torch.tensor(1.0, device=device),
    "CUDA 1-element": lambda device: torch.ones(1, device=device),
}


def _clip_max_norm(layout: str, kind: str, foreach: bool, world: World) -> Call:
    params = world.params(layout)
    max_norm = MAX_NORMS[kind](world.device)
    return lambda: clip_grad_norm_(params, max_norm, foreach=foreach)


def _pipeline_norm(order: float, world: World) -> Call:
    grads = world.grads("pp")
    return lambda: _total_grad_norm(grads, order, pp_group=world.pp_dp["pp"])


def _pipeline_clip(world: World) -> Call:
    params = world.params("pp")
    return lambda: clip_grad_norm_(params, 1.0, pp_group=world.pp_dp["pp"])


def _report(layout: str, world: World) -> Call:
    named = [(f"p{i}", p) for i, p in enumerate(world.params(layout))]
    pp_group = world.pp_dp["pp"] if layout == "pp" else None
    return lambda: grad_norm_report(named, pp_group=pp_group)


def _nonfinite_error(what: str, layout: str, world: World) -> Call:
    pp_group = world.pp_dp["pp"] if layout == "pp" else None
    if what == "total_grad_norm":
        grads = world.grads(layout)
        return lambda: _total_grad_norm(grads, error_if_nonfinite=True, pp_group=pp_group)
    params = world.params(layout)
    return lambda: clip_grad_norm_(params, 1.0, error_if_nonfinite=True, pp_group=pp_group)


def _nonfinite_raised(layout: str, world: World) -> Call:
    """``error_if_nonfinite=True`` on a norm read back as non-finite: the call raises, after the
    same one read."""
    call = _nonfinite_error("clip_grad_norm_", layout, world)

    def raises() -> None:
        try:
            call()
        except RuntimeError as error:
            if "non-finite" in str(error):
                return
            raise
        raise AssertionError("a non-finite norm did not raise")

    return raises


def _scaler(device: str, scaling: bool, spikes: SpikePolicy | None = None) -> GradScaler:
    """A GradScaler on ``device``: torch's constructor disables a "cuda" scaler without CUDA,
    which the fake world lacks."""
    with mock.patch.object(torch.cuda, "is_available", return_value=True):
        return GradScaler(device, scaling=scaling, spikes=spikes)


def _amp_step(
    layout: str,
    optimizer_kind: str,
    norm: str,
    world: World,
    *,
    scaling: bool = True,
) -> Call:
    """The trainer's step: ``unscale_``, a norm or clip while the flag is pending, ``step``,
    ``update``. ``norm="spikes"``: a spike policy's clip (skip and adaptive clip, a loss)."""
    params = world.params(layout)
    optimizer = _adamw(params, optimizer_kind)
    spikes = SpikePolicy(adaptive_clip="zscore", warmup=1) if norm == "spikes" else None
    scaler = _scaler(world.device, scaling, spikes)
    loss = world.tensor(1)
    scaler.scale(loss)  # places the scale on the device
    pp_group = world.pp_dp["pp"] if layout == "pp" else None

    def step() -> Tensor:
        scaler.unscale_(optimizer)
        if spikes is not None:
            total = spikes.clip_grad_norm_(params, 1.0, loss=loss, pp_group=pp_group)
        elif norm == "clip":
            total = clip_grad_norm_(params, 1.0, pp_group=pp_group)
        else:
            total = _total_grad_norm([p.grad for p in params], pp_group=pp_group)
        scaler.step(optimizer)
        scaler.update()
        return total

    return step


def _average(layout: str, cap_mb: float, world: World) -> Call:
    grads = world.grads(layout)
    return lambda: allreduce_grads_avg(grads, world.dp_tp["tp"], bucket_cap_mb=cap_mb)


def _domain_sync(world: World) -> Call:
    params = world.params("domain")
    return lambda: sync_domain_gradients(params, world.dp_domain["domain"])


def _replicated_sync(world: World) -> Call:
    params = world.params("mixed")
    return lambda: sync_replicated_gradients(params, world.dp_tp["tp"])


def _loss_average(world: World) -> Call:
    loss = world.tensor(1)

    def average() -> Tensor:
        all_reduce_avg(loss)
        return loss

    return average


def _replica_check(optimizer_kind: str, world: World) -> Call:
    """Every copy of parameters and AdamW state: fused keeps the step counts on the device,
    foreach on the CPU (0-dim tensors, copies on every rank that holds the parameter)."""
    model = nn.Module()
    model.weights = nn.ParameterList(world.params("dtensors"))
    optimizer = _adamw(list(model.parameters()), optimizer_kind)
    optimizer.step()  # its state, checked with the parameters
    return lambda: verify_replicas(model, optimizer)


def _get_total_norm(world: World) -> Call:
    grads = world.grads("mixed")
    return lambda: collectives.get_total_norm(grads, 2.0, False, None)


def _clip_with_norm(world: World) -> Call:
    params = world.params("mixed")
    total = world.tensor(value=8.0)
    return lambda: collectives.clip_grads_with_norm_(params, 1.0, total, None)


# ---------------------------------------------------------------------------------------------
# the table


@dataclass(frozen=True)
class Row:
    """One path and the host syncs its steady state may make.

    Attributes:
        path: what is called, on which layout.
        build: builds the path's objects on a :class:`World` and returns one steady-state call.
        reads: host reads per call at steady state.
        copies: blocking copies between CPU and CUDA per call at steady state.
        answer: what each host read returns (see :class:`~support.sync_trace.SyncRecorder`).
        needs: a function of ``credit.parallel.collectives`` the path calls.
    """

    path: str
    build: Callable[[World], Call]
    reads: int = 0
    copies: int = 0
    answer: float = 0.0
    needs: str | None = None


def _norm_rows() -> list[Row]:
    rows = []
    for layout in LAYOUTS:
        for order in (2.0, math.inf):
            for foreach in (None, True, False):
                how = f"{layout}, p={order:g}, foreach={foreach}"
                rows.append(
                    Row(f"total_grad_norm {how}", partial(_total_norm, layout, order, foreach))
                )
                rows.append(Row(f"clip_grad_norm_ {how}", partial(_clip, layout, order, foreach)))
        # A GPU takes the foreach path where foreach is None (fake tensors take the other).
        for kind in MAX_NORMS:
            for foreach in (True, False):
                if kind != "float":
                    how = f"{layout}, max_norm {kind}, foreach={foreach}"
                    build = partial(_clip_max_norm, layout, kind, foreach)
                    rows.append(Row(f"clip_grad_norm_ {how}", build))
    return rows


ROWS: tuple[Row, ...] = (
    *_norm_rows(),
    # Under pipeline stages one read per call brings back every cross-stage decision: whether
    # another stage met a new layout (then every rank verifies), the stages' result dtype, and
    # whether every scaler flag was answered. No rank can know them without it.
    Row("total_grad_norm pp_group, p=2", partial(_pipeline_norm, 2.0), reads=1),
    Row("total_grad_norm pp_group, p=inf", partial(_pipeline_norm, math.inf), reads=1),
    Row("clip_grad_norm_ pp_group", _pipeline_clip, reads=1),
    # error_if_nonfinite: one read answers both whether the norm is finite and whether copies
    # differed, on mixed meshes and on plain replicas alike.
    *(
        Row(
            f"{what} error_if_nonfinite=True{suffix}",
            partial(_nonfinite_error, what, layout),
            reads=1,
            answer=1.0,
        )
        for what in ("total_grad_norm", "clip_grad_norm_")
        for layout, suffix in (("mixed", ""), ("plain", ", plain replicas"))
    ),
    # Under pipeline stages the total comes back with the stages' one read: nothing more.
    *(
        Row(
            f"{what} error_if_nonfinite=True, pp_group",
            partial(_nonfinite_error, what, "pp"),
            reads=1,
        )
        for what in ("total_grad_norm", "clip_grad_norm_")
    ),
    # The same read answered "not finite": the copies' verdict comes back with it.
    *(
        Row(
            f"clip_grad_norm_ error_if_nonfinite=True raising{suffix}",
            partial(_nonfinite_raised, layout),
            reads=1,
        )
        for layout, suffix in (("mixed", ""), ("plain", ", plain replicas"))
    ),
    Row(
        "GradScaler fused AdamW: unscale_, clip, step, update (FSDP2)",
        partial(_amp_step, "fsdp", "fused", "clip"),
    ),
    Row(
        "GradScaler fused AdamW: unscale_, clip, step, update (FSDP2 + TP)",
        partial(_amp_step, "dtensors", "fused", "clip"),
    ),
    Row(
        "GradScaler fused AdamW: unscale_, total_grad_norm, step, update",
        partial(_amp_step, "dtensors", "fused", "norm"),
    ),
    Row(
        "GradScaler(scaling=False) fused AdamW: unscale_, clip, step, update",
        partial(_amp_step, "dtensors", "fused", "clip", scaling=False),
    ),
    Row(
        "GradScaler fused AdamW with pp_group: unscale_, clip, step, update",
        partial(_amp_step, "pp", "fused", "clip"),
        reads=1,
    ),
    # torch's own read: a foreach optimizer's step is taken or skipped on the host.
    Row(
        "GradScaler foreach AdamW: unscale_, clip, step, update",
        partial(_amp_step, "dtensors", "foreach", "clip"),
        reads=1,
    ),
    # A spike policy decides on the device: its skip reaches a fused optimizer as the non-finite
    # answer does, and its histories take the step in at update(), without a read.
    Row(
        "GradScaler + SpikePolicy fused AdamW: unscale_, policy clip with a loss, step, update",
        partial(_amp_step, "dtensors", "fused", "spikes"),
    ),
    Row(
        "GradScaler(scaling=False) + SpikePolicy fused AdamW (FSDP2)",
        partial(_amp_step, "fsdp", "fused", "spikes", scaling=False),
    ),
    Row(
        "GradScaler + SpikePolicy fused AdamW with pp_group",
        partial(_amp_step, "pp", "fused", "spikes"),
        reads=1,
    ),
    Row(
        "GradScaler + SpikePolicy foreach AdamW",
        partial(_amp_step, "dtensors", "foreach", "spikes"),
        reads=1,
    ),
    Row("allreduce_grads_avg plain, 25 MiB buckets", partial(_average, "buckets", 25.0)),
    Row("allreduce_grads_avg plain, 1 KiB buckets", partial(_average, "buckets", 1 / 1024)),
    Row("allreduce_grads_avg FSDP2 shards over tp", partial(_average, "dp_shards", 25.0)),
    Row("sync_domain_gradients", _domain_sync),
    Row("sync_replicated_gradients", _replicated_sync),
    Row("all_reduce_avg", _loss_average),
    Row("grad_norm_report mixed", partial(_report, "mixed"), reads=1),
    Row("grad_norm_report pp_group", partial(_report, "pp"), reads=1),
    Row("verify_replicas, fused AdamW state", partial(_replica_check, "fused"), reads=1),
    Row("verify_replicas, foreach AdamW state", partial(_replica_check, "foreach"), reads=1),
    Row("get_total_norm mixed", _get_total_norm, needs="get_total_norm"),
    Row(
        "clip_grads_with_norm_ mixed, CUDA total_norm",
        _clip_with_norm,
        needs="clip_grads_with_norm_",
    ),
)


# ---------------------------------------------------------------------------------------------
# tracing


@dataclass
class Traced:
    """What the calls of one path did: the syncs of each call, in order.

    Attributes:
        calls: the syncs of each call that ran (the first call of the layout first).
        error: the traceback of the exception that stopped a call, if any.
        missing: why the path could not be called (a function it needs does not exist yet).
        seconds: how long the path's calls took, tracing included.
    """

    calls: list[list[Sync]] = field(default_factory=list)
    error: str | None = None
    missing: str | None = None
    seconds: float = 0.0

    @property
    def steady(self) -> list[list[Sync]]:
        return self.calls[1:]


def trace(row: Row, world: World) -> Traced:
    """Call ``row``'s path :data:`CALLS` times, recording each call's syncs."""
    import time

    started = time.perf_counter()
    traced = Traced()
    if row.needs is not None and not hasattr(collectives, row.needs):
        traced.missing = f"credit.parallel.collectives has no {row.needs}"
        return traced
    try:
        call = row.build(world)
    except Exception:
        traced.error = "building the path failed:\n" + traceback.format_exc()
        return traced
    for _ in range(CALLS):
        with recording(row.answer) as syncs:
            try:
                call()
            except Exception:
                traced.error = traceback.format_exc()
        traced.calls.append(list(syncs))
        if traced.error is not None:
            break
    traced.seconds = time.perf_counter() - started
    return traced


# ---------------------------------------------------------------------------------------------
# controls: the recorder sees each kind of sync


def _controls() -> dict[str, tuple[list[str], Callable[[], object]]]:
    """Snippets of torch, each with the syncs it makes on a GPU."""
    x = torch.randn(8, device="cuda")
    mask = x > 0
    ones = torch.ones(8, dtype=torch.long, device="cuda")
    return {
        "float(t)": ([READ], lambda: float(x.sum())),
        "t.tolist() (one sync)": ([READ], lambda: x.tolist()),
        "torch.tensor(list, device='cuda')": (
            [BLOCKING_COPY],
            lambda: torch.tensor([1.0], device="cuda"),
        ),
        "cpu_t.to('cuda')": ([BLOCKING_COPY], lambda: torch.ones(2).to("cuda")),
        "t[list]": ([BLOCKING_COPY], lambda: x[[0, 1]]),
        "t[cpu index tensor]": ([BLOCKING_COPY], lambda: x[torch.tensor([0, 1])]),
        "t.nonzero()": ([DATA_DEPENDENT], lambda: x.nonzero()),
        "t[mask]": ([DATA_DEPENDENT], lambda: x[mask]),
        "repeat_interleave without output_size": (
            [DATA_DEPENDENT],
            lambda: x.repeat_interleave(ones),
        ),
        "t * cpu_t of shape (1,)": ([DEVICE_MISMATCH], lambda: x * torch.ones(1)),
        "all_reduce(cpu_t)": ([CPU_COLLECTIVE], lambda: dist.all_reduce(torch.ones(2))),
        "t * cpu_t of shape () (a host scalar)": ([], lambda: x * torch.tensor(2.0)),
        "cpu_t.to('cuda', non_blocking=True)": (
            [],
            lambda: torch.ones(2).to("cuda", non_blocking=True),
        ),
        "repeat_interleave with output_size": (
            [],
            lambda: x.repeat_interleave(ones, output_size=8),
        ),
    }


def run_controls() -> dict[str, tuple[list[str], list[str]]]:
    """Each control's syncs, expected and recorded (an op that raises in the fake mode, as a
    data-dependent shape with no answer does, is recorded before it raises)."""
    found = {}
    for name, (expected, snippet) in _controls().items():
        with recording() as syncs, contextlib.suppress(Exception):
            snippet()
        found[name] = (expected, [sync.kind for sync in syncs])
    return found


# ---------------------------------------------------------------------------------------------
# the planted syncs: a read and a CPU collective inside the norm


def _planted_foreach_norm(original: Callable[..., list[Tensor]]) -> Callable[..., list[Tensor]]:
    def foreach_norm(
        tensors: list[Tensor], order: float, dtype: torch.dtype | None
    ) -> list[Tensor]:
        norms = original(tensors, order, dtype)
        float(norms[0])  # planted: a host read
        dist.all_reduce(torch.zeros(1))  # planted: a collective of a CPU tensor
        return norms

    return foreach_norm


def planted_lines() -> dict[str, str]:
    """Where the planted read and collective are, as the trace names them."""
    lines, first = inspect.getsourcelines(_planted_foreach_norm)
    where = {}
    for offset, line in enumerate(lines):
        for kind, marker in (("read", "float(norms[0])"), ("collective", "dist.all_reduce(")):
            if marker in line:
                where[kind] = f"tests/support/sync_paths.py:{first + offset} (foreach_norm)"
    return where


def trace_planted(world: World) -> Traced:
    """``total_grad_norm`` with ``foreach=True`` while every reference the norm has to
    ``_compat.foreach_norm`` is replaced by one with a host read and a CPU collective."""
    original = _compat.foreach_norm
    planted = _planted_foreach_norm(original)
    modules = [
        module
        for name, module in sys.modules.items()
        if name.startswith("credit.parallel.") and getattr(module, "foreach_norm", None) is original
    ]
    with contextlib.ExitStack() as patches:
        for module in modules:
            patches.enter_context(mock.patch.object(module, "foreach_norm", planted))
        return trace(Row("planted", partial(_total_norm, "mixed", 2.0, True)), world)


# ---------------------------------------------------------------------------------------------
# the whole trace, in one process


def trace_world(rank: int) -> dict[str, Any]:
    """Load the no-op CUDA guard, then trace every row, the controls and the plant as ``rank``
    of the fake world (run it in a fresh process).

    Returns:
        ``skip`` (why nothing ran) or ``rows`` (path -> :class:`Traced`), ``controls``,
        ``planted`` and ``planted_lines``; ``guard_seconds`` and ``seconds`` either way.
    """
    import time

    started = time.perf_counter()
    guard_seconds, reason = load_noop_cuda_guard()
    if reason is not None:
        return {"skip": reason, "guard_seconds": guard_seconds, "seconds": 0.0}
    shimmed = register_fake_collectives()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)
    try:
        world = World.build(rank)
        with fake_cuda():
            rows = {row.path: trace(row, world) for row in ROWS}
            controls = run_controls()
            planted = trace_planted(world)
    finally:
        dist.destroy_process_group()
    return {
        "rows": rows,
        "controls": controls,
        "planted": planted,
        "planted_lines": planted_lines(),
        "guard_seconds": guard_seconds,
        "fake_collectives_registered": shimmed,
        "seconds": time.perf_counter() - started,
    }
