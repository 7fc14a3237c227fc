"""Real parallel layouts of one small model, built inside a multi-rank test body.

Each layout wraps the same transformer-like model with real FSDP2 (``fully_shard``) and/or real TP
(``parallelize_module``) on real DeviceMeshes, runs one forward/backward on data sharded by the dp
coordinate only (tp peers see the same batch), and returns the model with its gradients in place.

Names: "plain" (no wrapping, every rank the same data), "fsdp" (FSDP2 on a 1D mesh), "hsdp" (FSDP2
on a 2D (replicate, shard) mesh), "fsdp_tp" (TP on tp, FSDP2 on dp of a (dp=2, tp=2) mesh), "tp"
(TP only on a 1D tp mesh, the second block left out of the plan: DTensor grads beside plain ones).
Every model has a frozen layer (grad None) and a 1-row head weight, which leaves one dp rank an
empty shard.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

LAYOUTS = ("plain", "fsdp", "hsdp", "fsdp_tp", "tp")
IN_DIM, DIM, HIDDEN = 6, 16, 24


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.q = nn.Linear(DIM, DIM)
        self.o = nn.Linear(DIM, DIM)
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(x)
        x = x + self.o(torch.tanh(self.q(h)))
        return x + self.w2(torch.tanh(self.w1(h)))


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(IN_DIM, DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(DIM, 1)  # a 1-row weight: one dp rank of two gets an empty shard

    def forward(self, x: Tensor) -> Tensor:
        x = self.frozen(self.embed(x))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


TP_PLAN = {
    "q": ColwiseParallel(),
    "o": RowwiseParallel(),
    "w1": ColwiseParallel(),
    "w2": RowwiseParallel(),
}


@functools.cache
def mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """A CPU DeviceMesh, cached so reused worker processes do not pile up process groups."""
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


@dataclass
class Built:
    model: nn.Module
    dp_rank: int
    dp_size: int


def build(layout: str, seed: int = 0, grad_scale: float = 1.0) -> Built:
    """Build ``layout`` on the current world and leave gradients from one backward in place."""
    world = dist.get_world_size()
    torch.manual_seed(seed)
    model = TinyNet()
    rank = dist.get_rank()
    if layout == "plain":
        dp_rank, dp_size = 0, 1
    elif layout == "fsdp":
        dp_mesh = mesh((world,), ("dp",))
        for block in model.blocks:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
        dp_rank, dp_size = rank, world
    elif layout == "hsdp":
        hsdp_mesh = mesh((2, world // 2), ("replicate", "shard"))
        for block in model.blocks:
            fully_shard(block, mesh=hsdp_mesh)
        fully_shard(model, mesh=hsdp_mesh)
        dp_rank, dp_size = rank, world
    elif layout == "fsdp_tp":
        world_mesh = mesh((world // 2, 2), ("dp", "tp"))
        for block in model.blocks:
            parallelize_module(block, world_mesh["tp"], TP_PLAN)
            fully_shard(block, mesh=world_mesh["dp"])
        fully_shard(model, mesh=world_mesh["dp"])
        coordinate = world_mesh.get_coordinate()
        assert coordinate is not None
        dp_rank, dp_size = coordinate[0], world // 2
    elif layout == "tp":
        tp_mesh = mesh((world,), ("tp",))
        parallelize_module(model.blocks[0], tp_mesh, TP_PLAN)
        dp_rank, dp_size = 0, 1
    else:
        raise ValueError(f"unknown layout {layout!r}")
    run_step(model, seed, dp_rank, dp_size, grad_scale)
    return Built(model, dp_rank, dp_size)


def run_step(model: nn.Module, seed: int, dp_rank: int, dp_size: int, scale: float = 1.0) -> None:
    """One forward/backward on this dp rank's slice of a global batch fixed by ``seed``."""
    generator = torch.Generator().manual_seed(seed + 1)
    batch = torch.randn(4 * dp_size, IN_DIM, generator=generator)
    local = batch.chunk(dp_size)[dp_rank]
    loss = model(local).pow(2).mean() * scale
    loss.backward()


def grads(model: nn.Module) -> list[Tensor]:
    return [p.grad for p in model.parameters() if p.grad is not None]


def full_grads(model: nn.Module) -> list[Tensor]:
    """Every gradient materialised on every rank (a collective per DTensor: call on all ranks)."""
    return [g.full_tensor() if isinstance(g, DTensor) else g for g in grads(model)]


def gather_bits(value: Tensor) -> list[Tensor]:
    """``value`` from every rank, for checking that all ranks got the same bits."""
    out = [torch.empty_like(value) for _ in range(dist.get_world_size())]
    dist.all_gather(out, value.contiguous())
    return out


def same_bits_everywhere(value: Tensor) -> bool:
    gathered = gather_bits(value.detach().reshape(1).to(torch.float64))
    return all(torch.equal(g.view(torch.int64), gathered[0].view(torch.int64)) for g in gathered)


def ulp_distance(a: Tensor, b: Tensor) -> int:
    """How many float32 values lie between ``a`` and ``b`` (both finite and non-negative)."""
    a32 = a.detach().reshape(1).to(torch.float32)
    b32 = b.detach().reshape(1).to(torch.float32)
    return abs(int(a32.view(torch.int32)) - int(b32.view(torch.int32)))
