"""What the library is measured against, each named for what it does.

- fresh flat buffer per call: plain grads flattened into a new buffer per (device, dtype), one
  all_reduce, copied back;
- per-shard async all_reduces: one async all_reduce per DTensor local shard, all waited together;
- per-parameter loop: one blocking all_reduce per gradient (its local shard for a DTensor);
- one all_reduce of a pre-flattened buffer (floor): the collective alone, nothing to copy;
- one norm (clip) per mesh group: ``get_total_norm`` per group of gradients on the same mesh, made
  global with ``full_tensor()`` and combined with ``vector_norm`` (then ``clip_grads_with_norm_``
  per group);
- the kernels alone (floor): the kernels a clip with torch's bits runs, on local shards listed in
  advance, with none of the work of finding them;
- SHA-1 of each tensor on the host: each tensor copied to the host as float32 and hashed, the
  digests all_gathered and compared with rank 0's (Megatron-LM's check of parameter hashes across
  data-parallel replicas, here over every rank and every tensor given);
- all_gather of every copy: every tensor's bytes in one buffer, all_gathered and compared with
  rank 0's.

The averages divide as the library does: :func:`~credit.parallel.collectives.all_reduce_avg` for
one tensor at a time, and a SUM with one foreach division where many all_reduces are in flight.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from credit.parallel._common.compat import local_tensor
from credit.parallel.collectives import all_reduce_avg


def _by_device_and_dtype(tensors: Sequence[Tensor]) -> list[list[Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    return list(groups.values())


def fresh_flat_buffer(grads: Sequence[Tensor], group: ProcessGroup | None) -> None:
    """Average plain grads through a new flat buffer per (device, dtype), copied back."""
    for tensors in _by_device_and_dtype(grads):
        flat = _flatten_dense_tensors(tensors)
        all_reduce_avg(flat, group)
        for tensor, synced in zip(tensors, _unflatten_dense_tensors(flat, tensors), strict=True):
            tensor.copy_(synced)


def per_shard_async(grads: Sequence[Tensor], group: ProcessGroup | None) -> None:
    """Average DTensor grads on their local shards: one async all_reduce each, waited together."""
    shards = [local_tensor(grad) for grad in grads]
    works = [dist.all_reduce(shard, group=group, async_op=True) for shard in shards]
    for work in works:
        work.wait()
    torch._foreach_div_(shards, dist.get_world_size(group))


def per_parameter_loop(grads: Sequence[Tensor], group: ProcessGroup | None) -> None:
    """Average each gradient (its local shard for a DTensor) in a blocking all_reduce of its own."""
    for grad in grads:
        all_reduce_avg(grad, group)


def all_reduce_coalesced(grads: Sequence[Tensor], group: ProcessGroup | None) -> None:
    """torch's coalesced all_reduce (a SUM) per (device, dtype), then a foreach division."""
    world = dist.get_world_size(group)
    for tensors in _by_device_and_dtype([local_tensor(grad) for grad in grads]):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # "will be deprecated"
            dist.all_reduce_coalesced(tensors, op=dist.ReduceOp.SUM, group=group)
        torch._foreach_div_(tensors, world)


def _by_mesh(tensors: Sequence[Tensor]) -> list[list[Tensor]]:
    groups: dict[int | None, list[Tensor]] = {}
    for tensor in tensors:
        key = id(tensor.device_mesh) if isinstance(tensor, DTensor) else None
        groups.setdefault(key, []).append(tensor)
    return list(groups.values())


@torch.no_grad()
def norm_per_mesh_group(grads: Sequence[Tensor], norm_type: float = 2.0) -> Tensor:
    """``get_total_norm`` per group of grads on one mesh, ``full_tensor()``, then combined."""
    norms = []
    for same_mesh in _by_mesh(grads):
        norm = torch.nn.utils.get_total_norm(same_mesh, norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if len(norms) == 1:
        return norms[0]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


@torch.no_grad()
def clip_per_mesh_group(params: Sequence[Tensor], max_norm: float) -> Tensor:
    """:func:`norm_per_mesh_group`, then ``clip_grads_with_norm_`` per group of params."""
    with_grad = [param for param in params if param.grad is not None]
    total = norm_per_mesh_group([param.grad for param in with_grad])  # type: ignore[misc]
    by_mesh: dict[int | None, list[Tensor]] = {}
    for param in with_grad:
        key = id(param.grad.device_mesh) if isinstance(param.grad, DTensor) else None
        by_mesh.setdefault(key, []).append(param)
    for same_mesh in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(same_mesh, max_norm, total)
    return total


def torch_clip(params: Sequence[Tensor], max_norm: float) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_``, its norm made a plain tensor as ours returns it."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def pipeline_clip(params: Sequence[Tensor], max_norm: float, pp_group: ProcessGroup) -> Tensor:
    """torchtitan's clip under pipeline parallelism: torch's norm of this stage's gradients, its
    square summed over the pipeline group, and torch's scaling by the total. The copies inside a
    stage are taken as they are, unproven."""
    grads = [param.grad for param in params if param.grad is not None]
    total = torch.nn.utils.get_total_norm(grads) ** 2
    dist.all_reduce(total, group=pp_group)
    total = total.sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def torch_norm(grads: Sequence[Tensor]) -> Tensor:
    """``torch.nn.utils.get_total_norm``, made a plain tensor with ``full_tensor()``."""
    norm = torch.nn.utils.get_total_norm(grads)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def clip_kernels(grads: Sequence[Tensor], max_norm: float) -> Callable[[], None]:
    """The kernels of a clip with torch's bits, on the local shards listed now.

    ``torch._foreach_norm``, ``torch.stack``, the power, one ``dist.all_reduce`` of the stacked
    powers, the root, ``torch.linalg.vector_norm``, the clamped coefficient, ``_foreach_mul_``.
    """
    local = [local_tensor(grad) for grad in grads]

    def kernels() -> None:
        powers = torch.stack(torch._foreach_norm(local, 2.0)) ** 2.0
        dist.all_reduce(powers)
        total = torch.linalg.vector_norm(powers ** (1 / 2.0), 2.0)
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        torch._foreach_mul_(local, coefficient)

    return kernels


def sha1_all_gather(tensors: Sequence[Tensor]) -> bool:
    """Whether every rank's tensors hash as rank 0's: SHA-1 of each on the host, one all_gather."""
    digests = torch.stack(
        [
            torch.frombuffer(
                bytearray(hashlib.sha1(t.detach().to("cpu").float().numpy(force=True)).digest()),
                dtype=torch.uint8,
            )
            for t in tensors
        ]
    )
    gathered = [torch.empty_like(digests) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, digests)
    return all(torch.equal(other, gathered[0]) for other in gathered)


def all_gather_compare(tensors: Sequence[Tensor]) -> bool:
    """Whether every rank's tensors hold rank 0's bytes: all of them gathered in one buffer."""
    local = torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in tensors])
    gathered = torch.empty(
        dist.get_world_size() * local.numel(), dtype=torch.uint8, device=local.device
    )
    dist.all_gather_into_tensor(gathered, local)
    everyone = gathered.view(dist.get_world_size(), -1)
    return bool((everyone == everyone[0]).all())
