"""torchtitan 0.3 on 4 CPU ranks: its meshes (``ParallelDims.build_mesh``: views unflattened from
a 1-D world) and the function its trainer clips with, ``torchtitan.distributed.utils.
clip_grad_norm_``, beside ``credit.parallel.integrations.torchtitan.clip_grad_norm_``, on FSDP2 +
TP in torchtitan's style (every parameter under TP, the norm through SequenceParallel) and with
pipeline stages (its ``pp_mesh`` path, ours through the split API); and the adapter clipping
through an adaptive ``SpikePolicy``.

torchtitan's trainer itself is not run: ``ParallelDims`` builds its meshes on
``torchtitan.tools.utils.device_type``, "cuda" on a machine without an accelerator, which the
tests set to "cpu"; everything else is torchtitan's code as installed.
"""

from __future__ import annotations

import functools
import math
import statistics
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import (
    DIM,
    HIDDEN,
    MIXED_MESH_ERROR,
    Net,
    assert_norm,
    bits,
    framework,
    materialised_norm,
    parallelize,
    run_ranks,
    same_on_every_rank,
    start_rank,
)
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from credit.parallel.collectives import clip_grads_with_norm_, get_total_norm
from credit.parallel.integrations.torchtitan import clip_grad_norm_
from credit.parallel.replicas import verify_replicas
from credit.parallel.spikes import SpikePolicy

framework("torchtitan")
from torchtitan.distributed import parallel_dims, utils  # noqa: E402

STEPS = 3
MAX_NORM = 0.05
SEQ = 4


def _parallel_dims(**degrees: int) -> Any:
    """torchtitan's ParallelDims for 4 ranks, its meshes built on the CPU."""
    parallel_dims.device_type = "cpu"
    sizes = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1, "ep": 1} | degrees
    dims = parallel_dims.ParallelDims(**sizes, world_size=4, spmd_backend="partial_dtensor")
    dims.build_mesh()
    return dims


def _sequence_parallel(net: Net, dims: Any) -> Net:
    """torchtitan's style: the norm under SequenceParallel, the MLP Colwise/Rowwise on the
    sequence-sharded activations, then FSDP2 on the fsdp view."""
    plan = {
        "norm": SequenceParallel(),
        "fc1": ColwiseParallel(input_layouts=Shard(1)),
        "fc2": RowwiseParallel(output_layouts=Shard(1)),
    }
    parallelize_module(net, dims.get_mesh("tp"), plan)
    fully_shard(net, mesh=dims.get_mesh("fsdp"))
    return net


def _counted(clip: Any, *args: Any, **kwargs: Any) -> tuple[float, int]:
    """The norm a clip returns and the collectives it issued."""
    with CommDebugMode() as comms:
        norm = clip(*args, **kwargs)
    return float(norm), comms.get_total_counts()


def _dense() -> dict[str, Any]:
    start_rank()
    dims = _parallel_dims(dp_shard=2, tp=2)
    net = _sequence_parallel(Net(), dims)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1234)
    dp_rank = dims.get_mesh("fsdp").get_local_rank()
    tp_rank = dims.get_mesh("tp").get_local_rank()
    steps = []
    for _ in range(STEPS):
        x, y = (torch.randn(4, SEQ, DIM, generator=generator) for _ in range(2))
        # This dp rank's samples, this tp rank's half of their sequence (SequenceParallel's input).
        mine = (
            slice(2 * dp_rank, 2 * dp_rank + 2),
            slice(tp_rank * SEQ // 2, (tp_rank + 1) * SEQ // 2),
        )
        F.mse_loss(net(x[mine]), y[mine]).backward()
        materialised = materialised_norm(net.parameters())
        # max_norm 1e9: torchtitan's clip multiplies by exactly 1, leaving the gradients as they are.
        theirs, their_comms = _counted(
            utils.clip_grad_norm_, list(net.parameters()), 1e9, foreach=True
        )
        ours, our_comms = _counted(clip_grad_norm_, list(net.parameters()), MAX_NORM, foreach=True)
        steps.append(
            {
                "materialised": materialised,
                "theirs": bits(theirs),
                "ours": bits(ours),
                "comms": (their_comms, our_comms),
                "clipped": materialised_norm(net.parameters()),
            }
        )
        optimizer.step()
        optimizer.zero_grad()
    verify_replicas(net, optimizer)

    # The layout on the same meshes: the LayerNorm left out of TP, on the fsdp view only.
    mixed = parallelize(Net(), dims.get_mesh("fsdp"), dims.get_mesh("tp"))
    mixed(torch.randn(2, DIM)).square().mean().backward()
    try:
        utils.clip_grad_norm_(list(mixed.parameters()), 1.0)
        their_mixed = "no error"
    except RuntimeError as error:
        their_mixed = str(error)
    materialised = materialised_norm(mixed.parameters())
    return {
        "steps": steps,
        "their_mixed": their_mixed,
        "mixed": (materialised, float(clip_grad_norm_(list(mixed.parameters()), 1.0))),
    }


def test_torchtitan_clip_swapped_for_ours_on_fsdp2_tp():
    """On torchtitan's meshes and layout both clips give the materialised norm (within an ULP of
    each other: torchtitan's sums over the two mesh dims one after the other), ours with the same
    bits on every rank and in two all_reduces, one within tp where the copies of shards are
    compared and one over the world (after the first call for the layout, which proves it first),
    torchtitan's in two. On the issue's layout torchtitan's clip raises, ours does not."""
    runs = run_ranks(_dense)
    for step in range(STEPS):
        oracle = runs[0]["steps"][step]["materialised"]
        ours = same_on_every_rank([run["steps"][step]["ours"] for run in runs])
        assert_norm(float.fromhex(ours), oracle)
        for run in runs:
            assert_norm(float.fromhex(run["steps"][step]["theirs"]), oracle)
        clipped = same_on_every_rank([run["steps"][step]["clipped"] for run in runs])
        assert math.isclose(clipped, MAX_NORM, rel_tol=1e-4)
        their_comms, our_comms = same_on_every_rank([run["steps"][step]["comms"] for run in runs])
        assert their_comms == 2
        # Ours: within tp, then over the world; on the layout's first call its proof before them
        # (the self-check over the world, the copies within tp, their flags over the world).
        assert our_comms == (3 + 2 if step == 0 else 2)
    assert all(MIXED_MESH_ERROR in run["their_mixed"] for run in runs)
    for materialised, ours in (run["mixed"] for run in runs):
        assert_norm(ours, materialised)


def _pipeline() -> list[dict[str, Any]]:
    """pp=2 x fsdp=2: each stage holds its own MLP (seeded by its stage), FSDP2 on the fsdp view."""
    start_rank()
    dims = _parallel_dims(pp=2, dp_shard=2)
    pp_mesh = dims.get_mesh("pp")
    stage = pp_mesh.get_local_rank()
    torch.manual_seed(10 + stage)
    part = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM))
    fully_shard(part, mesh=dims.get_mesh("fsdp"))
    optimizer = torch.optim.AdamW(part.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1234 + stage)
    steps = []
    for _ in range(STEPS):
        part(torch.randn(4, DIM, generator=generator)).square().mean().backward()
        own = torch.tensor(materialised_norm(part.parameters()) ** 2, dtype=torch.float64)
        dist.all_reduce(own, group=pp_mesh.get_group())  # every stage's gradients
        params = list(part.parameters())
        # max_norm 1e9: both clips multiply by exactly 1, leaving the gradients as they are.
        theirs, their_comms = _counted(utils.clip_grad_norm_, params, 1e9, pp_mesh=pp_mesh)
        ours, adapter_comms = _counted(clip_grad_norm_, params, 1e9, pp_mesh=pp_mesh)
        # The split API, where torchtitan's pipeline clip calls torch's.
        with CommDebugMode() as comms:
            split = get_total_norm([p.grad for p in params], pp_group=pp_mesh)
        clip_grads_with_norm_(params, MAX_NORM, split)
        steps.append(
            {
                "oracle": math.sqrt(own.item()),
                "theirs": theirs,
                "split": bits(split),
                "comms": (their_comms, adapter_comms, comms.get_total_counts()),
                "ours": bits(ours),
                "clipped": materialised_norm(params) ** 2,
            }
        )
        optimizer.step()
        optimizer.zero_grad()
    return steps


def test_torchtitan_pipeline_clip_and_ours_through_the_split_api():
    """Two stages with different parameters: torchtitan's pp_mesh clip, our split API and our
    adapter all give the norm of both stages' materialised gradients; ours with the same bits
    on every rank of both stages, in one all_reduce where torchtitan's issues two (three on the
    layout's first call)."""
    runs = run_ranks(_pipeline)
    for step in range(STEPS):
        oracle = same_on_every_rank([run[step]["oracle"] for run in runs])
        ours = same_on_every_rank([run[step]["ours"] for run in runs])
        assert same_on_every_rank([run[step]["split"] for run in runs]) == ours
        assert_norm(float.fromhex(ours), oracle)
        for run in runs:
            assert_norm(run[step]["theirs"], oracle)
        # Ours: 3 all_reduces on the layout's first call (with its proof), 1 on every later one.
        assert same_on_every_rank([run[step]["comms"] for run in runs]) == (
            (2, 3, 1) if step == 0 else (2, 1, 1)
        )
        clipped = math.sqrt(sum(run[step]["clipped"] for run in runs[::2]))  # one rank a stage
        assert math.isclose(clipped, MAX_NORM, rel_tol=1e-4), clipped


# --- an adaptive clip through the adapter ----------------------------------------------------

# The policy's warm-up: steps 0 to 2 enter its history, step 3 holds the spike.
WARMUP = 3
SPIKE_FACTOR = 1e3  # rank 3's TP shard of fc1's gradient made this many times larger
CLIP_Z = 2.5  # ZClip's default


def _adaptive() -> list[dict[str, Any]]:
    """ZClip's adaptive clip ("zscore") through the adapter, called as torchtitan's trainer
    calls its clip (max_norm 1e9 its ceiling), on torchtitan's meshes and layout; a spike planted
    after the warm-up. torchtitan's trainer steps through no scaler: nothing is skipped."""
    start_rank()
    dims = _parallel_dims(dp_shard=2, tp=2)
    net = _sequence_parallel(Net(), dims)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    spikes = SpikePolicy(skip=False, adaptive_clip="zscore", clip_z=CLIP_Z, warmup=WARMUP)
    clip = functools.partial(clip_grad_norm_, spikes=spikes)
    generator = torch.Generator().manual_seed(1234)
    steps = []
    for step in range(WARMUP + 1):
        x, y = (torch.randn(2, SEQ // 2, DIM, generator=generator) for _ in range(2))
        F.mse_loss(net(x), y).backward()
        if step == WARMUP and dist.get_rank() == 3:
            net.fc1.weight.grad.to_local().mul_(SPIKE_FACTOR)
        materialised = materialised_norm(net.parameters())
        norm = clip(list(net.parameters()), 1e9, foreach=True, pp_mesh=None, ep_enabled=False)
        steps.append(
            {
                "materialised": materialised,
                "norm": bits(norm),
                "clipped": materialised_norm(net.parameters()),
            }
        )
        optimizer.step()
        optimizer.zero_grad()
    verify_replicas(net, optimizer)
    return steps


def test_torchtitan_clip_with_an_adaptive_spike_policy():
    """The norm the materialised one, on every rank alike; nothing clipped during the warm-up;
    the spike clipped to ZClip's threshold, mean + clip_z**2 * std / z over the warm-up's
    norms (their mean and population deviation, computed here in float64)."""
    runs = run_ranks(_adaptive)
    norms = []
    for step in range(WARMUP + 1):
        norms.append(float.fromhex(same_on_every_rank([run[step]["norm"] for run in runs])))
        assert_norm(norms[step], runs[0][step]["materialised"])
    clipped = [same_on_every_rank([run[s]["clipped"] for run in runs]) for s in range(WARMUP + 1)]
    for step in range(WARMUP):
        assert math.isclose(clipped[step], norms[step], rel_tol=1e-5)
    mean, std = statistics.fmean(norms[:WARMUP]), statistics.pstdev(norms[:WARMUP])
    z = (norms[WARMUP] - mean) / (std + 1e-6)
    assert z > CLIP_Z
    assert math.isclose(clipped[WARMUP], mean + CLIP_Z**2 * std / z, rel_tol=1e-5)
