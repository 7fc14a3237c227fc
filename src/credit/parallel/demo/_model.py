"""A tiny weather-style model, its parallel layout, and a synthetic, deterministic dataset.

The model maps a state of the atmosphere on a regular latitude-longitude grid, shaped
``(batch, channels, lat, lon)``, to the state one time step later: a patch embedding, a learned
position embedding, transformer blocks, and a linear head that predicts the increment. The data
are smooth waves drifting east by one grid cell per step, so the model has something to learn.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from credit.parallel.demo._config import ModelConfig

# The projections that carry the TP plan; norms, embeddings and the head stay out of it.
TP_PLAN: dict[str, ParallelStyle] = {
    "attn.q": ColwiseParallel(),
    "attn.k": ColwiseParallel(),
    "attn.v": ColwiseParallel(),
    "attn.out": RowwiseParallel(),
    "mlp.fc1": ColwiseParallel(),
    "mlp.fc2": RowwiseParallel(),
}


class Attention(nn.Module):
    """Multi-head self-attention; under TP each rank holds ``heads / tp`` of the heads."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.q = nn.Linear(dim, dim)
        # No key bias: softmax ignores a shift shared by all keys, so its gradient is zero in
        # exact arithmetic and rounding noise alone, which Adam would blow up to full-size steps.
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        batch, tokens, _ = x.shape
        q, k, v = (self._split_heads(proj(x)) for proj in (self.q, self.k, self.v))
        attended = F.scaled_dot_product_attention(q, k, v)
        return self.out(attended.transpose(1, 2).reshape(batch, tokens, -1))

    def _split_heads(self, x: Tensor) -> Tensor:
        batch, tokens, width = x.shape  # width is the local width under TP
        return x.view(batch, tokens, width // self.head_dim, self.head_dim).transpose(1, 2)


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, hidden)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyWeatherModel(nn.Module):
    """Predicts the next state of a ``(batch, channels, lat, lon)`` grid as state + increment."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.embed = nn.Conv2d(c.channels, c.dim, kernel_size=c.patch, stride=c.patch)
        self.pos = nn.Parameter(0.02 * torch.randn(1, c.tokens, c.dim))
        self.blocks = nn.ModuleList([Block(c.dim, c.heads, c.hidden) for _ in range(c.depth)])
        self.norm = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.channels * c.patch * c.patch)

    def forward(self, x: Tensor) -> Tensor:
        c = self.config
        batch = x.shape[0]
        h = self.embed(x).flatten(2).transpose(1, 2) + self.pos
        for block in self.blocks:
            h = block(h)
        patches = self.head(self.norm(h))  # (batch, tokens, channels * patch * patch)
        rows, cols = c.lat // c.patch, c.lon // c.patch
        grid = patches.view(batch, rows, cols, c.channels, c.patch, c.patch)
        increment = grid.permute(0, 3, 1, 4, 2, 5).reshape(batch, c.channels, c.lat, c.lon)
        return x + increment


def parallelize(model: TinyWeatherModel, tp_mesh: DeviceMesh, dp_mesh: DeviceMesh) -> None:
    """TP on the blocks' projections over ``tp_mesh`` (if larger than one), then FSDP2 over ``dp_mesh``.

    Every rank must hold the same initial weights (built with the same seed): each keeps its own
    shards of them, with no broadcast.
    """
    blocks: list[nn.Module] = list(model.blocks)
    if tp_mesh.size() > 1:
        for block in blocks:
            # src_data_rank=None: no broadcast from the first rank.
            parallelize_module(block, tp_mesh, TP_PLAN, src_data_rank=None)
    for block in blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


def global_batch(
    config: ModelConfig, size: int, seed: int, step: int, micro: int
) -> tuple[Tensor, Tensor]:
    """A global micro-batch ``(state, next_state)``, the same on every rank for the same keys."""
    generator = torch.Generator().manual_seed(((seed * 1_000_003) + step) * 1_009 + micro)
    c = config
    lat = torch.linspace(-math.pi / 2, math.pi / 2, c.lat + 2)[1:-1].view(c.lat, 1)
    lon = torch.arange(c.lon + 1, dtype=torch.float32).view(1, c.lon + 1) * (2 * math.pi / c.lon)
    waves = torch.arange(1, 4, dtype=torch.float32).view(3, 1, 1)
    amplitude = torch.randn(size, c.channels, 3, 1, 1, generator=generator)
    phase = 2 * math.pi * torch.rand(size, c.channels, 3, 1, 1, generator=generator)
    fields = amplitude * torch.cos(lat) * torch.sin(waves * lon + phase)  # (..., 3, lat, lon+1)
    states = fields.sum(dim=2) + 0.1 * torch.sin(lat)
    # The next state is the current one drifted east by one cell: column j takes column j - 1.
    return states[..., 1:], states[..., :-1]


def latitude_weights(config: ModelConfig) -> Tensor:
    """cos(latitude) per grid row, normalised to mean 1, shaped ``(lat, 1)``."""
    lat = torch.linspace(-math.pi / 2, math.pi / 2, config.lat + 2)[1:-1]
    weights = torch.cos(lat)
    return (weights / weights.mean()).view(config.lat, 1)


def band(lat: int, parts: int, index: int) -> slice:
    """Rows of latitude band ``index`` of ``parts`` near-equal bands."""
    return slice(index * lat // parts, (index + 1) * lat // parts)


def band_loss(
    prediction: Tensor, target: Tensor, weights: Tensor, rows: slice, parts: int
) -> Tensor:
    """Latitude-weighted MSE restricted to ``rows``, scaled so the mean over bands is the full loss.

    Each band contributes its weighted squared errors divided by the size of the whole grid, times
    the number of bands: the mean of the band losses (and of their gradients, which is what
    averaging over the domain group computes) is the loss (gradient) of the whole grid.
    """
    error = prediction[:, :, rows] - target[:, :, rows]
    return (weights[rows] * error.square()).sum() * (parts / prediction.numel())
