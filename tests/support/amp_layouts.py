"""The models, layouts and planted non-finite values of the GradScaler's tests.

A LayerNorm first (the first gradient a scaler sees), two blocks and a head, built on the current
world as FSDP2, FSDP2 + TP, HSDP, TP beside plain parameters, TP x domain, DDP, pipeline stages of
equal and unequal shapes (or with TP inside), or experts held per rank; a NaN or an inf planted in one rank's gradient of a chosen kind;
the update rule of torch's scaler as the oracle of the scale history; and the check that every
copy of every parameter holds the same bits on every rank that holds it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn.parallel import DistributedDataParallel

from credit.parallel._common.compat import is_shard, local_tensor
from credit.parallel.grad_sync import sync_domain_gradients, sync_replicated_gradients
from testbed.layouts import DIM, IN_DIM, TP_PLAN, Block, mesh

STEPS = 6
INIT_SCALE = 2.0**10
GROWTH_INTERVAL = 2
MAX_NORM = 0.5


class NormFirstNet(nn.Module):
    """A LayerNorm first (the first gradient a scaler sees), then two blocks and a head; a
    constant buffer (the same on every rank) centres the input."""

    def __init__(self, width: int = DIM) -> None:
        super().__init__()
        self.register_buffer("center", torch.linspace(-0.1, 0.1, IN_DIM))
        self.norm = nn.LayerNorm(IN_DIM)
        self.embed = nn.Linear(IN_DIM, width)
        self.blocks = nn.ModuleList([Block(width) for _ in range(2)])
        self.head = nn.Linear(width, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(self.norm(x - self.center))
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class WithExperts(NormFirstNet):
    """Experts of this rank beside the dense model, on a branch of their own."""

    def __init__(self, ep_rank: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(100 + ep_rank)
        self.experts = nn.ParameterList(
            [nn.Parameter(torch.randn(IN_DIM, IN_DIM, generator=generator)) for _ in range(2)]
        )

    def forward(self, x: Tensor) -> Tensor:
        """The dense output beside the experts' own (a separate term of a squared loss), so that
        the dense gradients stay the same on every expert-parallel rank."""
        routed = [(x.detach() @ expert).mean(dim=1, keepdim=True) for expert in self.experts]
        return torch.cat([super().forward(x), *routed], dim=1)


@dataclass
class Layout:
    """A model on the current world, and how its trainer calls the norm."""

    model: nn.Module
    data_rank: int  # which slice of each global batch this rank trains on
    data_ranks: int
    stage: int = 0
    clip_kwargs: dict[str, Any] = field(default_factory=dict)
    distinct_rank: int | None = None  # experts: this rank's place in the expert group
    sync: Callable[[nn.Module], None] | None = None  # after backward: the trainer's syncs


def shard_model(model: nn.Module, dp: DeviceMesh) -> None:
    for block in model.blocks:
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)


def build(name: str) -> Layout:
    world = dist.get_world_size()
    rank = dist.get_rank()
    torch.manual_seed(0)
    if name == "fsdp":
        model = NormFirstNet()
        dp = mesh((world,), ("dp",))
        shard_model(model, dp)
        return Layout(model, dp.get_local_rank(), world)
    if name == "fsdp_tp":
        model = NormFirstNet()
        dp_tp = mesh((world // 2, 2), ("dp", "tp"))
        for block in model.blocks:
            parallelize_module(block, dp_tp["tp"], TP_PLAN)
        shard_model(model, dp_tp["dp"])
        return Layout(model, dp_tp["dp"].get_local_rank(), world // 2)
    if name == "hsdp":
        model = NormFirstNet()
        shard_model(model, mesh((2, world // 2), ("replicate", "shard")))
        return Layout(model, rank, world)
    if name == "tp":
        model = NormFirstNet()
        parallelize_module(model.blocks[0], mesh((world,), ("tp",)), TP_PLAN)
        return Layout(model, 0, 1)
    if name == "ddp":
        return Layout(DistributedDataParallel(NormFirstNet()), rank, world)
    if name == "tp_domain":  # no FSDP: TP'd projections beside plain replicas, two bands
        tp_domain = mesh((world // 2, 2), ("tp", "domain"))
        model = NormFirstNet()
        for block in model.blocks:
            parallelize_module(block, tp_domain["tp"], TP_PLAN)

        def sync(model: nn.Module) -> None:
            sync_domain_gradients(model, tp_domain["domain"])
            sync_replicated_gradients(model, tp_domain["tp"])

        return Layout(model, tp_domain["domain"].get_local_rank(), 2, sync=sync)
    if name in ("pp_equal", "pp_unequal"):
        pp_dp = mesh((2, world // 2), ("pp", "dp"))
        stage = pp_dp["pp"].get_local_rank()
        torch.manual_seed(stage)
        model = NormFirstNet(DIM + 8 * stage * (name == "pp_unequal"))
        shard_model(model, pp_dp["dp"])
        kwargs = {"pp_group": pp_dp["pp"]}
        return Layout(model, pp_dp["dp"].get_local_rank(), world // 2, stage, kwargs)
    if name == "pp_tp":  # two stages, TP inside each: the LayerNorms are replicas over tp
        pp_tp = mesh((2, world // 2), ("pp", "tp"))
        stage = pp_tp["pp"].get_local_rank()
        torch.manual_seed(stage)
        model = NormFirstNet()
        for block in model.blocks:
            parallelize_module(block, pp_tp["tp"], TP_PLAN)

        def sync_tp(model: nn.Module) -> None:
            sync_replicated_gradients(model, pp_tp["tp"])

        return Layout(model, 0, 1, stage, {"pp_group": pp_tp["pp"]}, sync=sync_tp)
    if name == "experts":
        dp_ep = mesh((world // 2, 2), ("dp", "ep"))
        ep_rank = dp_ep["ep"].get_local_rank()
        model = WithExperts(ep_rank)
        shard_model(model, dp_ep["dp"])
        kwargs = {"distinct_along": [(list(model.experts), dp_ep["ep"])]}
        return Layout(model, dp_ep["dp"].get_local_rank(), world // 2, 0, kwargs, ep_rank)
    raise ValueError(name)


# --- where a non-finite value goes ----------------------------------------------------------------


def _sharded(grad: Tensor) -> bool:
    return isinstance(grad, DTensor) and any(map(is_shard, grad.placements))


def _copied(grad: Tensor) -> bool:
    """A shard that other ranks hold too (outside pipeline stages): a plain gradient, a Replicate
    dim, or a mesh over part of the world (the tp or ep peers hold its other copies)."""
    if not isinstance(grad, DTensor):
        return True
    replicated = any(p.is_replicate() for p in grad.placements)
    return replicated or grad.device_mesh.size() < dist.get_world_size()


def _on_tp(grad: Tensor) -> bool:
    if not isinstance(grad, DTensor):
        return False
    names = grad.device_mesh.mesh_dim_names or ()
    return "tp" in names and is_shard(grad.placements[names.index("tp")])


PLACES: dict[str, Callable[[str, Tensor], bool]] = {
    "shard": lambda name, grad: _sharded(grad),  # this rank's own FSDP2 shard
    "plain": lambda name, grad: not isinstance(grad, DTensor) and not name.startswith("experts"),
    "tp": lambda name, grad: _on_tp(grad),
    "copy": lambda name, grad: _copied(grad),  # a shard another rank holds as well
    "expert": lambda name, grad: name.startswith("experts"),
}


@dataclass(frozen=True)
class Plant:
    step: int
    rank: int
    place: str
    value: float


def plant_value(model: nn.Module, plant: Plant) -> None:
    """Put ``plant.value`` into the first gradient of its place that this rank holds a piece of."""
    if dist.get_rank() != plant.rank:
        return
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is not None and PLACES[plant.place](name, grad) and local_tensor(grad).numel():
            local_tensor(grad).view(-1)[0] = plant.value
            return
    raise AssertionError(f"no gradient for {plant.place} on rank {plant.rank}")


# --- what every rank records ----------------------------------------------------------------------


def local_bits(model: nn.Module) -> dict[str, Tensor]:
    return {name: local_tensor(p.detach()).clone() for name, p in model.named_parameters()}


def copies_agree(layout: Layout) -> bool:
    """Whether every rank holding a copy of a parameter's shard holds the same bits."""
    mine = {}
    for name, param in layout.model.named_parameters():
        coordinates: tuple[int, ...] = ()
        if isinstance(param, DTensor):
            coordinate = param.device_mesh.get_coordinate() or []
            coordinates = tuple(
                c for c, p in zip(coordinate, param.placements, strict=True) if is_shard(p)
            )
        distinct = layout.distinct_rank if name.startswith("experts") else None
        key = (layout.stage, name, coordinates, distinct)
        mine[key] = local_tensor(param.detach()).contiguous().view(torch.uint8).clone()
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    seen: dict[Any, Tensor] = {}
    for held in everyone:
        for key, bits in held.items():
            if key in seen and not torch.equal(seen[key], bits):
                return False
            seen.setdefault(key, bits)
    return True


def batch(layout: Layout, step: int) -> Tensor:
    generator = torch.Generator().manual_seed(1000 * layout.stage + step)
    return torch.randn(4 * layout.data_ranks, IN_DIM, generator=generator).chunk(layout.data_ranks)[
        layout.data_rank
    ]


# AdamW's implementations. torch's foreach and fused kernels refuse a list that mixes plain
# tensors and DTensors (TP beside plain parameters): there, the per-tensor loop.
OPTIMIZERS = {
    "foreach": {"foreach": True},
    "fused": {"fused": True},
    "loop": {"foreach": False},
}


def expected_scales(skipped: set[int]) -> list[float]:
    """torch's update rule: back off by 0.5 on a skipped step, double after GROWTH_INTERVAL clean
    steps in a row."""
    scale, clean, scales = INIT_SCALE, 0, []
    for step in range(STEPS):
        if step in skipped:
            scale, clean = scale * 0.5, 0
        else:
            clean += 1
            if clean == GROWTH_INTERVAL:
                scale, clean = scale * 2.0, 0
        scales.append(scale)
    return scales


@contextmanager
def scaler_warnings() -> Iterator[list[str]]:
    """The GradScaler's skipped-step reports logged while inside (rank 0 logs them)."""
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("credit.parallel.amp")
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
