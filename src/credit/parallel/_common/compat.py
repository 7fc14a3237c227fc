"""The private and release-dependent torch APIs the library relies on, one function per concern.

The supported range is torch 2.10 to 2.15 (``pyproject.toml``); each function says which releases
it covers and how. DTensor's public accessors cost microseconds of autograd bookkeeping per call,
which adds up over thousands of gradients per step; :func:`local_tensor` and :func:`dtensor_spec`
read the same state directly.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from torch.amp.grad_scaler import OptState
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard

# The right-to-left shard of FSDP2 + TP: a placement of its own, not a Shard subclass, from 2.10 on.
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils import _foreach_utils

if TYPE_CHECKING:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec


def local_tensor(tensor: Tensor) -> Tensor:
    """The local shard of a DTensor (``to_local()`` without its autograd bookkeeping), or ``tensor``.

    ``DTensor._local_tensor`` on every supported release (2.10 to 2.15).
    """
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def dtensor_spec(tensor: DTensor) -> DTensorSpec:
    """The spec object of ``tensor`` (mesh, placements, global shape), shared by equal layouts.

    ``DTensor._spec`` on every supported release (2.10 to 2.15); FSDP2 and TP reuse one spec object
    per parameter across steps, so its identity is a cache key.
    """
    return tensor._spec


def is_shard(placement: Placement) -> bool:
    """Whether ``placement`` splits the tensor across its mesh dim (strided shards included).

    ``_StridedShard`` is no ``Shard`` subclass on the supported releases (2.10 to 2.15), so both
    types are matched.
    """
    return isinstance(placement, (Shard, _StridedShard)) or placement.is_shard()


def root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was sliced from (itself where it was built whole).

    ``DeviceMesh._get_root_mesh()`` on every supported release (2.10 to 2.15); a release without
    it answers ``mesh``, which only makes fewer process groups known to hold copies.
    """
    found = getattr(mesh, "_get_root_mesh", None)
    return found() if found is not None else mesh


def foreach_norm(tensors: list[Tensor], order: float, dtype: torch.dtype | None) -> list[Tensor]:
    """One norm per tensor in one foreach kernel, accumulated in ``dtype`` (None: each tensor's).

    ``torch._foreach_norm(..., dtype=)`` on every supported release (2.10 to 2.15).
    """
    return list(torch._foreach_norm(tensors, order, dtype=dtype))


def group_by_device_and_dtype(
    tensors: list[Tensor],
) -> dict[tuple[torch.device, torch.dtype], list[Tensor]]:
    """``tensors`` grouped by (device, dtype) in torch's order (the order decides the bits of a
    stacked norm).

    ``torch.utils._foreach_utils._group_tensors_by_device_and_dtype``, the grouping torch's own
    clip uses, on every supported release (2.10 to 2.15).
    """
    return {key: group for key, (group, _) in _grouped(tensors).items()}


def group_indices_by_device_and_dtype(
    tensors: list[Tensor],
) -> dict[tuple[torch.device, torch.dtype], list[int]]:
    """Indices into ``tensors`` grouped as :func:`group_by_device_and_dtype` groups them."""
    return {key: indices for key, (_, indices) in _grouped(tensors).items()}


def _grouped(
    tensors: list[Tensor],
) -> dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], list[int]]]:
    grouped = _foreach_utils._group_tensors_by_device_and_dtype([tensors], with_indices=True)  # type: ignore[list-item]
    return {key: (lists[0], indices) for key, (lists, indices) in grouped.items()}  # type: ignore[misc]


def use_foreach(foreach: bool | None, tensors: list[Tensor], device: torch.device) -> bool:
    """torch's rule for its foreach kernels: where supported when ``foreach`` is None; True
    demands support (RuntimeError on a device without them), False never uses them.

    ``torch.utils._foreach_utils._has_foreach_support`` and ``_device_has_foreach_support`` on
    every supported release (2.10 to 2.15).
    """
    if (foreach is None and _foreach_utils._has_foreach_support(tensors, device)) or (
        foreach and _foreach_utils._device_has_foreach_support(device)
    ):
        return True
    if foreach:
        raise RuntimeError(
            f"foreach=True was passed, but can't use the foreach API on {device.type} tensors"
        )
    return False


def queue_at_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the running backward pass has finished.

    The autograd engine's ``queue_callback``, as DDP and FSDP use it, on every supported release
    (2.10 to 2.15).
    """
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def uncompiled(module: nn.Module) -> nn.Module:
    """The module inside ``torch.compile``'s wrappers, or ``module`` itself.

    ``torch._dynamo.eval_frame.OptimizedModule._orig_mod``, unwrapped as often as nested, on
    every supported release (2.10 to 2.15). No compiled module exists before dynamo is imported,
    so this does not import it.
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    wrapper = getattr(eval_frame, "OptimizedModule", None)
    while wrapper is not None and isinstance(module, wrapper):
        module = module._orig_mod
    return module


def unscaled_since_update(scaler: object, optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``scaler.unscale_(optimizer)`` ran since the scaler's last ``update()``.

    ``torch.amp.GradScaler._per_optimizer_states[id(optimizer)]["stage"]`` is
    ``OptState.UNSCALED`` then, on every supported release (2.10 to 2.15); a scaler without that
    state (not torch's, nor a subclass) never is.
    """
    states = getattr(scaler, "_per_optimizer_states", None)
    if not isinstance(states, dict) or id(optimizer) not in states:
        return False
    return states[id(optimizer)]["stage"] is OptState.UNSCALED
