"""G6: collectives per call at simulated world sizes, in one process with a fake process group.

``python -m credit.parallel.bench._scale 8 64 1024`` prints, as JSON, how many collectives each
call issues on a simulated (dp, tp) world of each size (torch's fake backend moves no data;
CommDebugMode counts the collectives). Run it in a process of its own: it initialises and
destroys the default process group.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

from credit.parallel.collectives import allreduce_grads_avg, clip_grad_norm_, total_grad_norm

# 40 blocks: a norm's two grads on the 1D dp mesh (FSDP2), four TP'd grads on the 2D mesh.
BLOCKS = 40
# Small buckets, so the averaging needs several: the count must still not depend on the world.
BUCKET_CAP_MB = 1 / 128


def _mixed_grads(dp: DeviceMesh, dp_tp: DeviceMesh) -> list[Tensor]:
    grads: list[Tensor] = []
    for _ in range(BLOCKS):
        grads.append(DTensor.from_local(torch.randn(4, 64), dp, [Shard(0)], run_check=False))
        grads.append(DTensor.from_local(torch.randn(4), dp, [Shard(0)], run_check=False))
        for placements in ([Shard(0), Shard(0)], [Shard(0), Shard(1)], [Shard(0), Replicate()]):
            local = torch.randn(8, 16)
            grads.append(DTensor.from_local(local, dp_tp, placements, run_check=False))
        grads.append(torch.randn(16))  # a plain grad, replicated everywhere
    return grads


def _count(call: Callable[[], object]) -> int:
    with CommDebugMode() as mode:
        call()
    return mode.get_total_counts()


def counts_at(world: int, tp: int = 8) -> dict[str, int]:
    """Collectives per call on a simulated world of ``world`` ranks, a (world // tp, tp) mesh.

    Returns:
        Collectives per call of each function, and ``expected_buckets``: how many the averaging
        should issue by the bucketing rule.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from credit.parallel.bench._cases import expected_buckets

    tp = min(tp, world)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        world_mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        grads = _mixed_grads(world_mesh["dp"], world_mesh)
        params = []
        for grad in grads:
            param = nn.Parameter(torch.empty_like(grad))
            param.grad = grad
            params.append(param)
        tp_group = world_mesh["tp"]
        replicated = [g for g in grads if not isinstance(g, DTensor) or g.device_mesh.ndim == 1]
        return {
            "total_grad_norm": _count(lambda: total_grad_norm(grads)),
            "clip_grad_norm_": _count(lambda: clip_grad_norm_(params, 1.0)),
            "allreduce_grads_avg": _count(
                lambda: allreduce_grads_avg(replicated, tp_group, bucket_cap_mb=BUCKET_CAP_MB)
            ),
            "total_grad_norm with pp_group": _count_with_pipeline(world, tp),
            "expected_buckets": expected_buckets(
                [g._local_tensor if isinstance(g, DTensor) else g for g in replicated],
                int(BUCKET_CAP_MB * 2**20),
            ),
        }
    finally:
        dist.destroy_process_group()


def _count_with_pipeline(world: int, tp: int) -> int:
    """Collectives of one norm over two pipeline stages: a (pp=2, dp, tp) mesh, pp_group its dim."""
    tp = min(tp, world // 2)
    shape = (2, world // (2 * tp), tp)
    pp_mesh = init_device_mesh("cpu", shape, mesh_dim_names=("pp", "dp", "tp"))
    grads = _mixed_grads(pp_mesh["dp"], pp_mesh["dp", "tp"])
    return _count(lambda: total_grad_norm(grads, pp_group=pp_mesh["pp"]))


def main(argv: list[str]) -> int:
    worlds = [int(arg) for arg in argv] or [8, 64, 1024]
    print(json.dumps({str(world): counts_at(world) for world in worlds}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
