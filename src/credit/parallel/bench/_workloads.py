"""The gradient sets the benchmark runs on, built on the calling rank.

Every rank builds the same shapes and fills them from a seed that depends on its rank, so an
average really combines different values.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 7919 + dist.get_rank())


def transformer_shapes(dim: int = 256, layers: int = 24, vocab: int = 8192) -> list[tuple]:
    """Parameter shapes of a small transformer: 291 tensors, 80.3 MiB of fp32 at the defaults."""
    shapes: list[tuple] = [(vocab, dim)]
    for _ in range(layers):
        shapes += [(dim,), (dim,), (3 * dim, dim), (3 * dim,), (dim, dim), (dim,)]
        shapes += [(dim,), (dim,), (4 * dim, dim), (4 * dim,), (dim, 4 * dim), (dim,)]
    shapes += [(dim,), (dim,)]
    return shapes


def parameters_with_grads(
    shapes: list[tuple], device: torch.device, seed: int
) -> list[nn.Parameter]:
    """One parameter per shape, each with a random gradient (different on every rank)."""
    generator = _generator(seed)
    params = []
    for shape in shapes:
        param = nn.Parameter(torch.empty(shape, device=device))
        param.grad = torch.randn(shape, generator=generator).to(device)
        params.append(param)
    return params


def grads_of(params: Sequence[Tensor]) -> list[Tensor]:
    return [p.grad for p in params if p.grad is not None]


@functools.cache
def mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """A DeviceMesh over every rank, built once per shape."""
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.tanh(self.proj(self.norm(x)))


class _TPBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.w1 = nn.Linear(dim, 2 * dim)
        self.w2 = nn.Linear(2 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.w2(torch.tanh(self.w1(self.norm(x))))


def _backward(model: nn.Module, dim: int, device: torch.device, seed: int) -> None:
    batch = torch.randn(8, dim, generator=_generator(seed)).to(device)
    model(batch).pow(2).mean().backward()


def fsdp_model(
    dp_mesh: DeviceMesh, blocks: int, dim: int, device: torch.device, seed: int
) -> nn.Module:
    """``blocks`` x (LayerNorm, Linear) under FSDP2 on ``dp_mesh``: 4 DTensor grads per block."""
    torch.manual_seed(seed)
    model = nn.Sequential(*[_Block(dim) for _ in range(blocks)]).to(device)
    for block in model:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    _backward(model, dim, device, seed)
    return model


def fsdp_tp_model(
    world_mesh: DeviceMesh, blocks: int, dim: int, device: torch.device, seed: int
) -> nn.Module:
    """TP on the "tp" dim and FSDP2 on "dp" of a (dp, tp) mesh: grads on a 1D and a 2D mesh.

    Each block has 6 parameters: the norm's two on the 1D dp mesh, the TP'd linears' four on the
    2D (dp, tp) mesh. Every tp peer sees the same batch, as in training.
    """
    torch.manual_seed(seed)
    model = nn.Sequential(*[_TPBlock(dim) for _ in range(blocks)]).to(device)
    plan = {"w1": ColwiseParallel(), "w2": RowwiseParallel()}
    for block in model:
        parallelize_module(block, world_mesh["tp"], plan)
        fully_shard(block, mesh=world_mesh["dp"])
    fully_shard(model, mesh=world_mesh["dp"])
    coordinate = world_mesh.get_coordinate()
    assert coordinate is not None
    batch_seed = seed * 1000 + coordinate[0]  # data sharded by dp coordinate only
    batch = torch.randn(8, dim, generator=torch.Generator().manual_seed(batch_seed)).to(device)
    model(batch).pow(2).mean().backward()
    return model
