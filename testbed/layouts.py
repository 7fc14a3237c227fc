"""Real parallel layouts of one small model, built inside a multi-rank test body.

Each layout wraps the same transformer-like model with real FSDP2 (``fully_shard``) and/or real TP
(``parallelize_module``) on real DeviceMeshes, runs one forward/backward on data sharded by the dp
coordinate only (tp peers see the same batch), and returns the model with its gradients in place.

Names: "plain" (no wrapping, every rank the same data), "fsdp" (FSDP2 on a 1D mesh), "hsdp" (FSDP2
on a 2D (replicate, shard) mesh), "fsdp_tp" (TP on tp, FSDP2 on dp of a (dp=2, tp=2) mesh), "tp"
(TP only on a 1D tp mesh, the second block left out of the plan: DTensor grads beside plain ones).
Every model has a frozen layer (grad None) and a 1-row head weight, which leaves one dp rank an
empty shard.

The tests use the tiny defaults (2 blocks, dim 16); the benchmark (``benchmarks/``) builds the same
layouts larger, through the size arguments of :func:`build`, on its own meshes and devices.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
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
    def __init__(self, dim: int = DIM, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(x)
        x = x + self.o(torch.tanh(self.q(h)))
        return x + self.w2(torch.tanh(self.w1(h)))


class TinyNet(nn.Module):
    """Embedding, a frozen layer, ``blocks`` blocks and a 1-row head: ``10 * blocks + 4`` grads."""

    def __init__(self, blocks: int = 2, dim: int = DIM, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.embed = nn.Linear(IN_DIM, dim)
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.blocks = nn.ModuleList([Block(dim, hidden) for _ in range(blocks)])
        self.head = nn.Linear(dim, 1)  # a 1-row weight: one dp rank of two gets an empty shard

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


def mesh(shape: tuple[int, ...], names: tuple[str, ...], device_type: str = "cpu") -> DeviceMesh:
    """A DeviceMesh (CPU by default), cached so reused worker processes do not pile up groups."""
    return _cached_mesh(shape, names, device_type)


@functools.cache
def _cached_mesh(shape: tuple[int, ...], names: tuple[str, ...], device_type: str) -> DeviceMesh:
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


@dataclass
class Built:
    model: nn.Module
    dp_rank: int
    dp_size: int


def build(
    layout: str,
    seed: int = 0,
    grad_scale: float = 1.0,
    *,
    blocks: int = 2,
    dim: int = DIM,
    hidden: int = HIDDEN,
    device: str = "cpu",
    dp_mesh: DeviceMesh | None = None,
) -> Built:
    """Build ``layout`` on the current world and leave gradients from one backward in place.

    Args:
        layout: one of :data:`LAYOUTS`.
        seed: fixes the weights and the global batch.
        grad_scale: multiplies the loss.
        blocks, dim, hidden: the model's size (see :class:`TinyNet`).
        device: where the model and its meshes live ("cpu", or "cuda" with the current device).
        dp_mesh: for "fsdp", the 1D mesh to shard over (default: every rank).
    """
    world = dist.get_world_size()
    torch.manual_seed(seed)
    model = TinyNet(blocks, dim, hidden).to(device)
    if layout == "plain":
        dp_rank, dp_size = 0, 1
    elif layout == "fsdp":
        dp_mesh = dp_mesh if dp_mesh is not None else mesh((world,), ("dp",), device)
        for block in model.blocks:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
        dp_rank, dp_size = dp_mesh.get_local_rank(), dp_mesh.size()
    elif layout == "hsdp":
        hsdp_mesh = mesh((2, world // 2), ("replicate", "shard"), device)
        for block in model.blocks:
            fully_shard(block, mesh=hsdp_mesh)
        fully_shard(model, mesh=hsdp_mesh)
        dp_rank, dp_size = dist.get_rank(), world
    elif layout == "fsdp_tp":
        world_mesh = mesh((world // 2, 2), ("dp", "tp"), device)
        for block in model.blocks:
            parallelize_module(block, world_mesh["tp"], TP_PLAN)
            fully_shard(block, mesh=world_mesh["dp"])
        fully_shard(model, mesh=world_mesh["dp"])
        coordinate = world_mesh.get_coordinate()
        assert coordinate is not None
        dp_rank, dp_size = coordinate[0], world // 2
    elif layout == "tp":
        tp_mesh = mesh((world,), ("tp",), device)
        parallelize_module(model.blocks[0], tp_mesh, TP_PLAN)
        dp_rank, dp_size = 0, 1
    else:
        raise ValueError(f"unknown layout {layout!r}")
    run_step(model, seed, dp_rank, dp_size, grad_scale, device=device)
    return Built(model, dp_rank, dp_size)


def run_step(
    model: nn.Module,
    seed: int,
    dp_rank: int,
    dp_size: int,
    scale: float = 1.0,
    *,
    device: str = "cpu",
) -> None:
    """One forward/backward on this dp rank's slice of a global batch fixed by ``seed``."""
    generator = torch.Generator().manual_seed(seed + 1)
    batch = torch.randn(4 * dp_size, IN_DIM, generator=generator)
    local = batch.chunk(dp_size)[dp_rank].to(device)
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


def local_bytes(tensor: Tensor) -> Tensor:
    """The raw bytes of a tensor's values (NaN-safe equality); the local shard for a DTensor."""
    if isinstance(tensor, DTensor):
        tensor = tensor._local_tensor
    if tensor.is_sparse:
        tensor = tensor.to_dense()
    return tensor.detach().clone().contiguous().view(-1).view(torch.uint8)


def ulp_distance(a: Tensor, b: Tensor) -> int:
    """How many float32 values lie between ``a`` and ``b`` (both finite and non-negative)."""
    a32 = a.detach().reshape(1).to(torch.float32)
    b32 = b.detach().reshape(1).to(torch.float32)
    return abs(int(a32.view(torch.int32)) - int(b32.view(torch.int32)))


def error_of(call: Callable[[], object]) -> tuple[str, str] | None:
    """The type and message ``call`` raises, or None when it returns."""
    try:
        call()
    except Exception as error:
        return type(error).__name__, str(error)
    return None
