"""Process groups: resolving what users pass, and what each backend can reduce."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

GroupLike = ProcessGroup | DeviceMesh | None


def is_distributed() -> bool:
    """True when a default process group exists; otherwise every function acts on a world of one."""
    return dist.is_available() and dist.is_initialized()


def resolve_group(group: GroupLike, argument: str = "group") -> ProcessGroup | None:
    """Return the ProcessGroup behind ``group`` (a ProcessGroup, a 1D DeviceMesh, or None = world)."""
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"{argument} must be a ProcessGroup or a 1D DeviceMesh, got a {group.ndim}D "
                f"DeviceMesh with dims {group.mesh_dim_names}; pass one of its dims, e.g. mesh['dp']"
            )
        return group.get_group()
    if group is None or isinstance(group, ProcessGroup):
        return group
    raise TypeError(
        f"{argument} must be a ProcessGroup, a 1D DeviceMesh or None, got {type(group).__name__}"
    )


def peer_group(group: GroupLike, argument: str) -> ProcessGroup | None:
    """The ProcessGroup a sync averages over, or None when there is nothing to do.

    For the sync functions None means "no such parallelism", not "the world"; a group of one
    rank has nothing to average either.
    """
    if group is None:
        return None
    process_group = resolve_group(group, argument)
    return process_group if group_size(process_group) > 1 else None


def collective_device(local: Sequence[torch.Tensor] = ()) -> torch.device:
    """Where a small tensor sent to a collective of the world must live: beside ``local`` when
    there is one, else on the current CUDA device under NCCL and on the CPU otherwise (and
    without a process group)."""
    if local:
        return local[0].device
    if not is_distributed():
        return torch.device("cpu")
    if "nccl" in str(dist.get_backend()) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def moves_data() -> bool:
    """False on torch's "fake" backend, which simulates a large world in one process (to count
    collectives at scale) and leaves every reduced tensor as this rank sent it."""
    return str(dist.get_backend()) != "fake"


def group_size(group: ProcessGroup | None) -> int:
    """Size of ``group``, or 1 when torch.distributed is not initialised."""
    return dist.get_world_size(group) if is_distributed() else 1


def world_of_one() -> bool:
    """True without a default process group, or with one of a single rank: a call acts alone."""
    return group_size(None) == 1


def group_ranks(group: ProcessGroup | None) -> list[int]:
    """Global ranks of ``group`` (the whole world for None)."""
    if group is None:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


@dataclass(frozen=True)
class Averaging:
    """How to average over a group: the collective's op, then a division (1 for none)."""

    op: dist.ReduceOp.RedOpType
    divisor: int


def averaging(group: ProcessGroup | None, device: torch.device) -> Averaging:
    """``ReduceOp.AVG`` where the backend has it for ``device``, else SUM and a division (MPI, UCC)."""
    if supports_native_avg(group, device):
        return Averaging(dist.ReduceOp.AVG, 1)
    return Averaging(dist.ReduceOp.SUM, dist.get_world_size(group))


def supports_native_avg(group: ProcessGroup | None, device: torch.device) -> bool:
    """Whether ``group``'s backend for ``device`` implements ``ReduceOp.AVG``."""
    backend = str(dist.get_backend(group))
    if ":" in backend:  # a per-device backend such as "cpu:gloo,cuda:nccl"
        per_device = dict(item.split(":", 1) for item in backend.split(","))
        backend = per_device.get(device.type, backend)
    return backend in ("gloo", "nccl", "xccl", "fake")  # gloo: from torch 2.8, below the floor
