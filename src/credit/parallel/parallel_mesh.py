"""The device mesh of a run that combines data, tensor and spatial domain parallelism.

One 3D DeviceMesh holds every rank, with dims ordered ``("dp", "tp", "domain")`` and laid out
row-major, so the domain dim is innermost: global rank ``r`` sits at

    dp = r // (tp * domain),   tp = (r // domain) % tp,   domain = r % domain.

Data is sharded by the dp coordinate only; tp and domain peers see the same batch. FSDP2 shards
over ``dp`` (with TP on ``tp``, FSDP2 composes on the 2D ``("dp", "tp")`` submesh), TP splits
layers over ``tp``, and each ``domain`` rank computes one latitude band of the globe.
"""

from __future__ import annotations

import logging
import numbers
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["MESH_DIM_NAMES", "ParallelMesh", "build_device_mesh"]

logger = logging.getLogger(__name__)

MESH_DIM_NAMES = ("dp", "tp", "domain")


@dataclass(frozen=True)
class ParallelMesh:
    """The world mesh of a run and the submeshes each kind of parallelism uses.

    Attributes:
        world: the 3D mesh, dims ``("dp", "tp", "domain")``, row-major.
        dp: 1D submesh of this rank's data-parallel peers (same tp and domain coordinate).
        tp: 1D submesh of this rank's tensor-parallel peers (same dp and domain coordinate).
        domain: 1D submesh of this rank's domain peers (same dp and tp coordinate).
        dp_tp: 2D ``("dp", "tp")`` submesh, the one FSDP2 composed with TP shards over.
    """

    world: DeviceMesh
    dp: DeviceMesh
    tp: DeviceMesh
    domain: DeviceMesh
    dp_tp: DeviceMesh


def build_device_mesh(
    dp: int | None = None,
    tp: int = 1,
    domain: int = 1,
    *,
    device_type: str | None = None,
) -> ParallelMesh:
    """Build the ``(dp, tp, domain)`` device mesh over every rank of the default process group.

    Call it once per run, on every rank (creating a mesh creates process groups, a collective).

    Args:
        dp: data-parallel size. Default: inferred as ``world_size // (tp * domain)``.
        tp: tensor-parallel size. Default: 1.
        domain: domain-parallel size (number of latitude bands). Default: 1.
        device_type: device type of the mesh. Default: ``"cuda"`` when CUDA is available,
            else ``"cpu"``.

    Returns:
        A :class:`ParallelMesh` with the 3D world mesh and its dp, tp, domain and (dp, tp)
        submeshes.

    Raises:
        ValueError: a size is not a positive int, ``tp * domain`` does not divide the world size
            (``dp`` inferred), or ``dp * tp * domain`` is not the world size.
        RuntimeError: the default process group is not initialised.
    """
    tp, domain = _checked_size("tp", tp), _checked_size("domain", domain)
    if dp is not None:
        dp = _checked_size("dp", dp)
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "build_device_mesh needs an initialised default process group: call "
            "torch.distributed.init_process_group() first (torchrun sets up its environment)"
        )
    world_size = dist.get_world_size()
    dp = _data_parallel_size(dp, tp, domain, world_size)
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    world = init_device_mesh(device_type, (dp, tp, domain), mesh_dim_names=MESH_DIM_NAMES)
    logger.info("device mesh %s: dp=%d tp=%d domain=%d", device_type, dp, tp, domain)
    return ParallelMesh(
        world=world,
        dp=world["dp"],
        tp=world["tp"],
        domain=world["domain"],
        dp_tp=world["dp", "tp"],
    )


def _checked_size(name: str, size: object) -> int:
    if isinstance(size, bool) or not isinstance(size, numbers.Integral) or int(size) < 1:
        raise ValueError(f"{name} must be a positive int, got {size!r}")
    return int(size)


def _data_parallel_size(dp: int | None, tp: int, domain: int, world_size: int) -> int:
    """``dp``, inferred when None; ValueError unless dp * tp * domain is the world size."""
    if dp is None:
        if world_size % (tp * domain) != 0:
            raise ValueError(
                f"tp * domain = {tp} * {domain} = {tp * domain} does not divide the world size "
                f"{world_size}, so dp cannot be inferred"
            )
        return world_size // (tp * domain)
    if dp * tp * domain != world_size:
        raise ValueError(
            f"dp * tp * domain = {dp} * {tp} * {domain} = {dp * tp * domain} does not equal the "
            f"world size {world_size}"
        )
    return dp
