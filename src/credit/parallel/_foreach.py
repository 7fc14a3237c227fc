"""torch's grouping of tensors by (device, dtype) and its choice of foreach kernels."""

from __future__ import annotations

import torch
from torch import Tensor

from credit.parallel._compat import foreach_supported
from credit.parallel._compat import group_by_device_and_dtype as _grouped


def group_by_device_and_dtype(
    tensors: list[Tensor],
) -> dict[tuple[torch.device, torch.dtype], list[Tensor]]:
    """``tensors`` grouped in torch's order (the order decides the bits of a stacked norm)."""
    return {key: group for key, (group, _) in _grouped(tensors).items()}


def group_indices_by_device_and_dtype(
    tensors: list[Tensor],
) -> dict[tuple[torch.device, torch.dtype], list[int]]:
    """Indices into ``tensors`` grouped as :func:`group_by_device_and_dtype` groups them."""
    return {key: indices for key, (_, indices) in _grouped(tensors).items()}


def use_foreach(foreach: bool | None, tensors: list[Tensor], device: torch.device) -> bool:
    """torch's rule: foreach where supported when None; True demands support."""
    if (foreach is None and foreach_supported(tensors, device)) or (
        foreach and foreach_supported(None, device)
    ):
        return True
    if foreach:
        raise RuntimeError(
            f"foreach=True was passed, but can't use the foreach API on {device.type} tensors"
        )
    return False
