"""Collectives per call, counted on one rank of a simulated world (torch's fake backend).

torch's fake backend (``FakeStore`` + backend ``"fake"``) lets one process act as one rank of a
large world: collectives return at once and move no data, and ``CommDebugMode`` counts every
collective issued (c10d ones included). The gradients are DTensors built with
``DTensor.from_local`` in the layouts FSDP2 + TP produce: dp-sharded on the 1D dp mesh, sharded or
replicated on the 2D (dp, tp) mesh, plain replicated tensors beside them, and an empty local shard.

Shared by ``tests/test_scale.py``, which asserts the counts, and by the benchmark
(``benchmarks/``), which reports them and also times the norm on :func:`mixed_grads` at real ranks.
:func:`counts_in_fake_world` initialises and destroys the default process group: run it in a fresh
process (a world torn down leaves state in torch's mesh and group caches that a second world in
the same process would trip on).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from credit.parallel.amp import GradScaler
from credit.parallel.collectives import allreduce_grads_avg, clip_grad_norm_, total_grad_norm
from credit.parallel.replicas import verify_replicas
from credit.parallel.spikes import SpikePolicy

# Averaging: 30 replicated grads of 100 fp32 (400 bytes) in buckets of 1000 bytes (250 floats)
# take 2 per bucket, plus one contiguous grad of 300 floats, reduced alone (>= the cap).
PACKED, PACKED_NUMEL, CAP_BYTES, BIG_NUMEL = 30, 100, 1000, 300
EXPECTED_BUCKETS = math.ceil(PACKED / (CAP_BYTES // 4 // PACKED_NUMEL)) + 1


def mixed_grads(world_mesh: DeviceMesh, blocks: int = 20, width: int = 16) -> list[Tensor]:
    """Gradients of ``blocks`` FSDP2 + TP blocks on ``world_mesh``, a 2D (dp, tp) mesh.

    Each block has five: a dp-sharded ``(4, 2 * width)`` grad on the 1D dp mesh (empty on the
    first block), a colwise, a rowwise and a replicated ``(8, width)`` local shard on the 2D mesh,
    and a plain ``(width,)`` grad. Values come from a fixed seed.

    Args:
        world_mesh: a 2D DeviceMesh whose first dim is the data-parallel one.
        blocks: how many blocks (5 gradients each).
        width: the shapes' last dim; a new width is a new layout for the norm.
    """
    generator = torch.Generator().manual_seed(0)
    dp_mesh = world_mesh[world_mesh.mesh_dim_names[0]]
    device = world_mesh.device_type
    grads: list[Tensor] = []
    for block in range(blocks):
        # FSDP2-only params (norms): dp-sharded on the 1D dp mesh; one has an empty local shard.
        rows = 0 if block == 0 else 4
        local = torch.randn(rows, 2 * width, generator=generator).to(device)
        grads.append(DTensor.from_local(local, dp_mesh, [Shard(0)], run_check=False))
        # TP'd params under FSDP2: colwise weight, rowwise weight, rowwise bias (Replicate on tp).
        for placements in ([Shard(0), Shard(0)], [Shard(0), Shard(1)], [Shard(0), Replicate()]):
            local = torch.randn(8, width, generator=generator).to(device)
            grads.append(DTensor.from_local(local, world_mesh, placements, run_check=False))
        grads.append(torch.randn(width, generator=generator).to(device))  # plain, replicated
    return grads


def _amp_step(params: list[nn.Parameter], spikes: str | None = None) -> Callable[[], None]:
    """The trainer's AMP sequence on ``params``: unscale_, clip_grad_norm_, step, update; with
    ``spikes`` (``"norm"`` or ``"loss"``), a spike policy's clip in place of the clip, given the
    loss or not."""
    # The per-tensor loop: torch's foreach AdamW refuses plain tensors beside DTensors.
    optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    policy = SpikePolicy(adaptive_clip="zscore", warmup=1) if spikes else None
    scaler = GradScaler("cpu", spikes=policy)
    loss = torch.ones(())
    scaler.scale(loss)

    def step() -> None:
        scaler.unscale_(optimizer)
        if policy is None:
            clip_grad_norm_(params, 1.0)
        else:
            policy.clip_grad_norm_(params, 1.0, loss=loss if spikes == "loss" else None)
        scaler.step(optimizer)
        scaler.update()

    return step


def _replicas_check(params: list[nn.Parameter]) -> Callable[[], None]:
    """verify_replicas over ``params`` and their AdamW state (one step taken to fill it)."""
    model = nn.Module()
    model.weights = nn.ParameterList(params)
    optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    optimizer.step()
    return lambda: verify_replicas(model, optimizer)


def count_collectives(call: Callable[[], object]) -> int:
    """How many collectives ``call`` issues (torch's CommDebugMode, c10d ops included)."""
    with CommDebugMode() as mode:
        call()
    return mode.get_total_counts()


def _count_with_pipeline(dp: int, tp: int) -> tuple[int, int]:
    """Norms over two pipeline stages, a (pp=2, dp/2, tp) mesh with pp_group its pp dim: the
    first call's collectives, and a later call's."""
    pp_mesh = init_device_mesh("cpu", (2, dp // 2, tp), mesh_dim_names=("pp", "dp", "tp"))
    grads = mixed_grads(pp_mesh["dp", "tp"])

    def norm() -> None:
        total_grad_norm(grads, pp_group=pp_mesh["pp"])

    return count_collectives(norm), count_collectives(norm)


def counts_in_fake_world(dp: int, tp: int, rank: int) -> dict[str, int]:
    """One rank of a fake dp x tp world: collectives per call (run in a fresh process).

    Args:
        dp: the data-parallel size (at least 2: the pipeline count splits it in two stages).
        tp: the tensor-parallel size.
        rank: which rank of the ``dp * tp`` world this process plays.

    Returns:
        The world size under ``"world"``, and the collectives of each call under its name.
    """
    world = dp * tp
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        world_mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        grads = mixed_grads(world_mesh)
        # torchtitan's construction: every mesh a view unflattened from a 1-D world.
        world_1d = init_device_mesh("cpu", (dp * tp,), mesh_dim_names=("world",))
        unflattened = mixed_grads(world_1d._unflatten(0, (dp, tp), ("dp_shard", "tp")))
        params = []
        for grad in grads:
            param = nn.Parameter(torch.empty_like(grad))
            param.grad = grad
            params.append(param)
        replicated = [torch.randn(PACKED_NUMEL) for _ in range(PACKED)]
        replicated.insert(PACKED // 2, torch.randn(BIG_NUMEL))
        cap_mb = CAP_BYTES / 2**20
        on_2d = [g for g in grads if getattr(g, "device_mesh", None) is world_mesh]
        count = count_collectives

        def average() -> None:
            allreduce_grads_avg(replicated, world_mesh["tp"], bucket_cap_mb=cap_mb)

        pipeline_first, pipeline_later = _count_with_pipeline(dp, tp)
        amp_step = _amp_step(params)
        spike_step, spike_step_with_loss = _amp_step(params, "norm"), _amp_step(params, "loss")
        replicas_check = _replicas_check(params)
        return {
            # A control that the counting sees DTensor's own collectives: torch's norm of the
            # 2D-mesh grads alone redistributes with one all_reduce per mesh dim.
            "control: torch get_total_norm on the 2D mesh": count(
                lambda: torch.nn.utils.get_total_norm(on_2d, 2.0).full_tensor()
            ),
            "world": dist.get_world_size(),
            # The first call for a layout proves it first: its copy counts in one all_reduce,
            # its copies within tp, and their flags in one more.
            "first call for a layout": count(lambda: total_grad_norm(grads, 2.0)),
            "first call, unflattened world": count(lambda: total_grad_norm(unflattened, 2.0)),
            "total_grad_norm p=2": count(lambda: total_grad_norm(grads, 2.0)),
            "total_grad_norm, unflattened world": count(lambda: total_grad_norm(unflattened)),
            "total_grad_norm p=inf": count(lambda: total_grad_norm(grads, math.inf)),
            "clip_grad_norm_": count(lambda: clip_grad_norm_(params, 1.0)),
            # The clip's collectives carry the GradScaler's answer: nothing else is issued
            # (the clip above verified the layout).
            "AMP step (unscale_, clip, step, update)": count(amp_step),
            # A policy's first step: the loss's all_reduce, sent whether any rank gives a loss
            # or not, tells every rank whether one does.
            "first AMP step with a SpikePolicy": count(spike_step),
            "AMP step with a SpikePolicy": count(spike_step),
            "AMP step with a SpikePolicy given the loss": count(spike_step_with_loss),
            # Under pp_group: the norm, then the verification, and once per pp group the
            # stages' lowest ranks.
            "first call with pp_group": pipeline_first,
            "total_grad_norm with pp_group": pipeline_later,
            "allreduce_grads_avg, first call for a layout": count(average),
            "allreduce_grads_avg": count(average),
            # Every copy of the parameters and their AdamW state, bit for bit.
            "verify_replicas (parameters and AdamW state)": count(replicas_check),
        }
    finally:
        dist.destroy_process_group()
