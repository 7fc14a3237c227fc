"""Collectives per call at simulated scale: a 1024-rank (dp=128 x tp=8) world in one process.

torch's fake backend (FakeStore + backend "fake") lets one process act as one rank of a large
world: collectives return at once and move no data, and CommDebugMode counts every collective
issued (c10d ones included). The gradients are DTensors built with ``DTensor.from_local`` on the
fake mesh in the layouts FSDP2 + TP produce: dp-sharded on the 1D dp mesh, sharded or replicated
on the 2D (dp, tp) mesh, plain replicated tensors beside them, and an empty local shard.

Each fake world is set up and torn down in a fresh spawned process, so it never meets the real
process groups of other tests.
"""

from __future__ import annotations

import math
import multiprocessing

import pytest

DP, TP = 128, 8
SMALL_WORLD = (2, TP)  # the same counts must come out of a 16-rank world
# Averaging: 30 replicated grads of 100 fp32 (400 bytes) in buckets of 1000 bytes (250 floats)
# take 2 per bucket, plus one contiguous grad of 300 floats, reduced alone (>= the cap).
PACKED, PACKED_NUMEL, CAP_BYTES, BIG_NUMEL = 30, 100, 1000, 300
EXPECTED_BUCKETS = math.ceil(PACKED / (CAP_BYTES // 4 // PACKED_NUMEL)) + 1


def _mixed_grads(world_mesh):
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    generator = torch.Generator().manual_seed(0)
    dp_mesh = world_mesh[world_mesh.mesh_dim_names[0]]
    grads = []
    for block in range(20):
        # FSDP2-only params (norms): dp-sharded on the 1D dp mesh; one has an empty local shard.
        rows = 0 if block == 0 else 4
        local = torch.randn(rows, 32, generator=generator)
        grads.append(DTensor.from_local(local, dp_mesh, [Shard(0)], run_check=False))
        # TP'd params under FSDP2: colwise weight, rowwise weight, rowwise bias (Replicate on tp).
        for placements in ([Shard(0), Shard(0)], [Shard(0), Shard(1)], [Shard(0), Replicate()]):
            local = torch.randn(8, 16, generator=generator)
            grads.append(DTensor.from_local(local, world_mesh, placements, run_check=False))
        grads.append(torch.randn(16, generator=generator))  # a plain, replicated grad
    return grads


def _count(call) -> int:
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as mode:
        call()
    return mode.get_total_counts()


def _count_with_pipeline(dp: int, tp: int) -> int:
    """One norm over two pipeline stages: a (pp=2, dp/2, tp) mesh with pp_group its pp dim."""
    from torch.distributed.device_mesh import init_device_mesh

    from credit.parallel.collectives import total_grad_norm

    pp_mesh = init_device_mesh("cpu", (2, dp // 2, tp), mesh_dim_names=("pp", "dp", "tp"))
    grads = _mixed_grads(pp_mesh["dp", "tp"])
    return _count(lambda: total_grad_norm(grads, pp_group=pp_mesh["pp"]))


def _counts_in_fake_world(dp: int, tp: int, rank: int) -> dict[str, int]:
    """One rank of a fake dp x tp world: collectives per call (run in a fresh process)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from credit.parallel.collectives import allreduce_grads_avg, clip_grad_norm_, total_grad_norm

    world = dp * tp
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        world_mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        grads = _mixed_grads(world_mesh)
        # torchtitan's construction: every mesh a view unflattened from a 1-D world.
        world_1d = init_device_mesh("cpu", (dp * tp,), mesh_dim_names=("world",))
        unflattened = _mixed_grads(world_1d._unflatten(0, (dp, tp), ("dp_shard", "tp")))
        params = []
        for grad in grads:
            param = nn.Parameter(torch.empty_like(grad))
            param.grad = grad
            params.append(param)
        replicated = [torch.randn(PACKED_NUMEL) for _ in range(PACKED)]
        replicated.insert(PACKED // 2, torch.randn(BIG_NUMEL))
        cap_mb = CAP_BYTES / 2**20
        on_2d = [g for g in grads if getattr(g, "device_mesh", None) is world_mesh]
        return {
            # A control that the counting sees DTensor's own collectives: torch's norm of the
            # 2D-mesh grads alone redistributes with one all_reduce per mesh dim.
            "control: torch get_total_norm on the 2D mesh": _count(
                lambda: torch.nn.utils.get_total_norm(on_2d, 2.0).full_tensor()
            ),
            "world": dist.get_world_size(),
            # The first call for a layout verifies its copy counts in one more all_reduce.
            "first call for a layout": _count(lambda: total_grad_norm(grads, 2.0)),
            "first call, unflattened world": _count(lambda: total_grad_norm(unflattened, 2.0)),
            "total_grad_norm p=2": _count(lambda: total_grad_norm(grads, 2.0)),
            "total_grad_norm, unflattened world": _count(lambda: total_grad_norm(unflattened)),
            "total_grad_norm p=inf": _count(lambda: total_grad_norm(grads, math.inf)),
            "clip_grad_norm_": _count(lambda: clip_grad_norm_(params, 1.0)),
            "total_grad_norm with pp_group": _count_with_pipeline(dp, tp),
            "allreduce_grads_avg": _count(
                lambda: allreduce_grads_avg(replicated, world_mesh["tp"], bucket_cap_mb=cap_mb)
            ),
        }
    finally:
        dist.destroy_process_group()


# (dp, tp, rank): rank 0 counts every shard it holds; the last rank, at coordinate (127, 7),
# counts none, and must still take part in exactly the same collectives.
WORLDS = {"first": (DP, TP, 0), "last": (DP, TP, DP * TP - 1), "small": (*SMALL_WORLD, 5)}


@pytest.fixture(scope="module")
def counts() -> dict[str, dict[str, int]]:
    # One fresh process per fake world (maxtasksperchild=1): a world torn down leaves state in
    # torch's mesh and group caches that a second world in the same process would trip on.
    context = multiprocessing.get_context("spawn")
    with context.Pool(len(WORLDS), maxtasksperchild=1) as pool:
        pending = {
            name: pool.apply_async(_counts_in_fake_world, world) for name, world in WORLDS.items()
        }
        return {name: result.get(timeout=180) for name, result in pending.items()}


def test_the_fake_world_has_1024_ranks(counts):
    assert counts["first"]["world"] == counts["last"]["world"] == 1024


def test_counting_sees_the_collectives_inside_dtensor_ops(counts):
    assert counts["first"]["control: torch get_total_norm on the 2D mesh"] == 2


@pytest.mark.parametrize("rank", ["first", "last"])
@pytest.mark.parametrize("call", ["first call for a layout", "first call, unflattened world"])
def test_one_setup_collective_per_layout_at_1024_ranks(counts, call, rank):
    assert counts[rank][call] == 2


@pytest.mark.parametrize("rank", ["first", "last"])
@pytest.mark.parametrize(
    "call",
    [
        "total_grad_norm p=2",
        "total_grad_norm, unflattened world",
        "total_grad_norm p=inf",
        "clip_grad_norm_",
        "total_grad_norm with pp_group",
    ],
)
def test_one_collective_per_norm_on_mixed_meshes_at_1024_ranks(counts, call, rank):
    assert counts[rank][call] == 1


@pytest.mark.parametrize("rank", ["first", "last"])
def test_one_collective_per_bucket_at_1024_ranks(counts, rank):
    assert EXPECTED_BUCKETS == 16
    assert counts[rank]["allreduce_grads_avg"] == EXPECTED_BUCKETS


def test_collectives_per_call_do_not_grow_with_the_world(counts):
    def calls(name: str) -> dict[str, int]:
        return {key: value for key, value in counts[name].items() if key != "world"}

    assert counts["small"]["world"] == 16
    assert calls("small") == calls("first") == calls("last")
