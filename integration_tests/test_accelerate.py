"""accelerate 1.15 on 4 CPU ranks: the hand-built route (a (dp, tp) mesh, TP and FSDP2 applied by
hand, only the optimizer prepared), ``Accelerator.clip_grad_norm_`` beside this package's clip
through ``credit.parallel.integrations.accelerate.clip_grad_norm_``, and this package's
GradScaler as ``accelerator.scaler`` (scaling, or skipping non-finite bf16 steps), stepped by
accelerate's prepared optimizer.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import (
    DIM,
    Net,
    assert_norm,
    batches,
    bits,
    framework,
    local_digest,
    materialised_norm,
    parallelize,
    plant_inf,
    run_ranks,
    same_on_every_rank,
    start_rank,
)
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from credit.parallel.amp import GradScaler
from credit.parallel.integrations.accelerate import clip_grad_norm_
from credit.parallel.replicas import verify_replicas

accelerate = framework("accelerate")

STEPS = 3
MAX_NORM = 0.05
PLANTED_STEP = 1
PLANTED_RANK = 3


def _setup(mixed_precision: str = "no") -> tuple[Any, Net, int]:
    """The recipe: a hand-built (dp, tp) mesh, TP and FSDP2 by hand, only the optimizer to be
    prepared. The accelerator, the model and this rank's dp rank."""
    start_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    net = parallelize(Net(), mesh["dp"], mesh["tp"])
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision=mixed_precision)
    return accelerator, net, mesh["dp"].get_local_rank()


def _dense() -> dict[str, Any]:
    accelerator, net, dp_rank = _setup()
    optimizer = accelerator.prepare(torch.optim.AdamW(net.parameters(), lr=1e-2))
    steps = []
    for x, y in batches(STEPS, dp_rank):
        accelerator.backward(F.mse_loss(net(x), y))
        materialised = materialised_norm(net.parameters())
        # max_norm inf: accelerate's clip multiplies by exactly 1, leaving the gradients as they are.
        theirs = accelerator.clip_grad_norm_(net.parameters(), math.inf)
        ours = clip_grad_norm_(accelerator, net, MAX_NORM)
        clipped = materialised_norm(net.parameters())
        steps.append(
            {
                "materialised": materialised,
                "theirs": float(theirs),
                "ours": bits(ours),
                "clipped": clipped,
            }
        )
        optimizer.step()
        optimizer.zero_grad()
    verify_replicas(net, optimizer.optimizer)
    try:
        accelerator.prepare(net)
        prepared_model = "no error"
    except RuntimeError as error:
        prepared_model = str(error)
    return {"steps": steps, "prepared_model": prepared_model}


def test_accelerate_clip_and_ours_agree_on_fsdp2_tp_and_preparing_the_model_fails():
    """accelerate's mesh-grouped clip and ours both give the materialised norm on the issue's
    layout; ours has the same bits on every rank and clips to max_norm. Preparing the model too
    wraps it in DDP, which refuses the mixed meshes: the recipe prepares the optimizer only."""
    runs = run_ranks(_dense)
    for step in range(STEPS):
        oracle = runs[0]["steps"][step]["materialised"]
        ours = float.fromhex(same_on_every_rank([run["steps"][step]["ours"] for run in runs]))
        assert_norm(ours, oracle)
        for run in runs:
            assert_norm(run["steps"][step]["theirs"], oracle)
            assert math.isclose(run["steps"][step]["clipped"], MAX_NORM, rel_tol=1e-4)
    assert all("cross mesh" in run["prepared_model"] for run in runs), runs[0]["prepared_model"]


def _experts() -> list[dict[str, Any]]:
    """Rank-local experts: each expert-parallel rank trains its own expert (seeded by its ep
    rank), FSDP2-sharded over the edp mesh beside the dense (dp, tp) one."""
    accelerator, net, dp_rank = _setup()
    expert_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("edp", "ep"))
    ep_group = expert_mesh["ep"]
    torch.manual_seed(100 + ep_group.get_local_rank())
    expert = nn.Linear(DIM, DIM)
    fully_shard(expert, mesh=expert_mesh["edp"])
    parameters = [*net.parameters(), *expert.parameters()]
    optimizer = accelerator.prepare(torch.optim.AdamW(parameters, lr=1e-2))
    steps = []
    for x, y in batches(STEPS, dp_rank):
        accelerator.backward(F.mse_loss(net(x), y) + expert(x).square().mean())
        dense = materialised_norm(net.parameters())
        local_expert = torch.tensor(
            materialised_norm(expert.parameters()) ** 2, dtype=torch.float64
        )
        dist.all_reduce(local_expert, group=ep_group.get_group())  # every ep rank's expert
        oracle = math.sqrt(dense**2 + local_expert.item())
        theirs = accelerator.clip_grad_norm_(parameters, math.inf)
        ours = clip_grad_norm_(
            accelerator, parameters, MAX_NORM, distinct_along=[(expert.parameters(), ep_group)]
        )
        steps.append({"oracle": oracle, "theirs": float(theirs), "ours": bits(ours)})
        optimizer.step()
        optimizer.zero_grad()
    return steps


def test_accelerate_clip_differs_across_ep_ranks_on_rank_local_experts_ours_does_not():
    """accelerate takes the ranks outside the experts' edp mesh for copies: each ep rank gets a
    norm of its own expert alone, silently. Ours, with the experts declared through
    distinct_along, gives the norm of every expert and the dense part, the same on every rank."""
    runs = run_ranks(_experts)
    for step in range(STEPS):
        oracle = same_on_every_rank([run[step]["oracle"] for run in runs])
        assert_norm(float.fromhex(same_on_every_rank([run[step]["ours"] for run in runs])), oracle)
        theirs = [run[step]["theirs"] for run in runs]
        assert len({round(norm, 6) for norm in theirs}) == 2, theirs  # one per ep rank
        assert not any(math.isclose(norm, oracle, rel_tol=1e-3) for norm in theirs)


def _planted(scaling: bool) -> list[dict[str, Any]]:
    """fp16's loss scaling (accelerate's CPU runs take no "fp16", so the scaler scales a float32
    loss), or bf16 autocast with a scaler that only skips non-finite steps."""
    accelerator, net, dp_rank = _setup("no" if scaling else "bf16")
    # Before prepare(optimizer), which hands the scaler to the prepared optimizer.
    accelerator.scaler = GradScaler("cpu", init_scale=1024.0, scaling=scaling)
    optimizer = accelerator.prepare(torch.optim.AdamW(net.parameters(), lr=1e-2))
    steps = []
    for step, (x, y) in enumerate(batches(STEPS, dp_rank)):
        with accelerator.autocast():
            loss = F.mse_loss(net(x), y)
        accelerator.backward(loss)
        if step == PLANTED_STEP and dist.get_rank() == PLANTED_RANK:
            plant_inf(net.fc1.weight)
        scaled = materialised_norm(net.parameters())
        scale = accelerator.scaler.get_scale()
        before = local_digest(net.parameters())
        norm = clip_grad_norm_(accelerator, net, MAX_NORM)
        optimizer.step()
        steps.append(
            {
                "materialised": scaled / scale,
                "norm": bits(norm),
                "skipped": optimizer.step_was_skipped,
                "scale": accelerator.scaler.get_scale(),
                "moved": before != local_digest(net.parameters()),
            }
        )
        optimizer.zero_grad()
    verify_replicas(net, optimizer.optimizer)
    return steps


@pytest.mark.parametrize("scaling", [True, False], ids=["fp16-scaling", "bf16"])
def test_accelerate_prepared_optimizer_skips_a_planted_inf_on_every_rank(scaling):
    """An inf in rank 3's TP shard: the adapter unscales through accelerator.scaler and clips,
    accelerate's prepared optimizer steps through the scaler: every rank reports
    step_was_skipped and leaves its weights as they were, and a scaling scaler halves its scale
    on every rank; every other step clips and steps."""
    runs = run_ranks(_planted, scaling)
    first, backed_off = (1024.0, 512.0) if scaling else (1.0, 1.0)
    for step in range(STEPS):
        skipped = same_on_every_rank([run[step]["skipped"] for run in runs])
        scale = same_on_every_rank([run[step]["scale"] for run in runs])
        norm = float.fromhex(same_on_every_rank([run[step]["norm"] for run in runs]))
        moved = [run[step]["moved"] for run in runs]
        if step == PLANTED_STEP:
            assert skipped and scale == backed_off and math.isinf(norm) and not any(moved)
        else:
            assert not skipped and scale == (first if step < PLANTED_STEP else backed_off)
            assert_norm(norm, runs[0][step]["materialised"])
            assert all(moved)


def _retry_after_copies_differ() -> dict[str, Any]:
    """Rank 1's copy of the LayerNorm's gradient (held by its tp peer too) made to differ after
    backward: the adapter unscales, then the clip raises on every rank. Mended, the same call in
    the same step clips, without unscaling twice."""
    accelerator, net, dp_rank = _setup()
    accelerator.scaler = GradScaler("cpu", init_scale=1024.0)
    optimizer = accelerator.prepare(torch.optim.AdamW(net.parameters(), lr=1e-2))
    x, y = batches(1, dp_rank)[0]
    accelerator.backward(F.mse_loss(net(x), y))
    grad = net.norm.weight.grad.to_local()
    if dist.get_rank() == 1:
        grad.mul_(2.0)
    try:
        clip_grad_norm_(accelerator, net, MAX_NORM)
        first = "no error"
    except ValueError as error:
        first = str(error)
    if dist.get_rank() == 1:
        grad.div_(2.0)
    oracle = materialised_norm(net.parameters())
    norm = clip_grad_norm_(accelerator, net, MAX_NORM)
    optimizer.step()
    return {
        "first": first,
        "oracle": oracle,
        "norm": bits(norm),
        "skipped": optimizer.step_was_skipped,
    }


def test_accelerate_clip_called_again_after_copies_differed_unscales_once():
    runs = run_ranks(_retry_after_copies_differ)
    assert all("norm.weight" in run["first"] for run in runs), runs[0]["first"]
    norm = float.fromhex(same_on_every_rank([run["norm"] for run in runs]))
    assert_norm(norm, runs[0]["oracle"])  # the gradients unscaled once: the scale divided out
    assert not any(run["skipped"] for run in runs)
