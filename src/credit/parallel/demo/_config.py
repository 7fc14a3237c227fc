"""The demo model's sizes: plain data, so that the options are checked before torch is imported
(a bad option or ``--help`` answers at once)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the grid and of the model."""

    channels: int = 4
    lat: int = 16
    lon: int = 32
    patch: int = 4
    dim: int = 32
    heads: int = 4
    hidden: int = 64
    depth: int = 2

    @property
    def tokens(self) -> int:
        return (self.lat // self.patch) * (self.lon // self.patch)
