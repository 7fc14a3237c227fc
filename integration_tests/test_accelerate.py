"""accelerate 1.15 on 4 CPU ranks: the hand-built route (a (dp, tp) mesh, TP and FSDP2 applied by
hand, only the optimizer prepared), ``Accelerator.clip_grad_norm_`` beside this package's clip
through ``credit.parallel.integrations.accelerate.clip_grad_norm_``, this package's GradScaler
as ``accelerator.scaler`` (scaling, or skipping non-finite bf16 steps), stepped by accelerate's
prepared optimizer, a gradient spike skipped through a ``SpikePolicy`` that scaler holds, the
refusal of parameters no prepared optimizer holds while a scaler is set, and the norm handed to
``accelerator.log`` (a tracker of accelerate's kind that records it).
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
from torch.utils._python_dispatch import TorchDispatchMode

from credit.parallel import collectives
from credit.parallel.amp import GradScaler
from credit.parallel.integrations.accelerate import clip_grad_norm_
from credit.parallel.replicas import verify_replicas
from credit.parallel.spikes import SpikePolicy

accelerate = framework("accelerate")

STEPS = 3
MAX_NORM = 0.05
PLANTED_STEP = 1
PLANTED_RANK = 3


def _setup(mixed_precision: str = "no", **accelerator_kwargs: Any) -> tuple[Any, Net, int]:
    """The recipe: a hand-built (dp, tp) mesh, TP and FSDP2 by hand, only the optimizer to be
    prepared. The accelerator, the model and this rank's dp rank."""
    start_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    net = parallelize(Net(), mesh["dp"], mesh["tp"])
    accelerator = accelerate.Accelerator(
        cpu=True, mixed_precision=mixed_precision, **accelerator_kwargs
    )
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


# --- a SpikePolicy, the scaler holding it set before prepare -----------------------------------

# The policy's warm-up: steps 0 to 2 enter its history, step 3 holds the spike, step 4 steps.
WARMUP = 3
SPIKE_STEPS = 5
SPIKE_FACTOR = 1e3  # rank 3's TP shard of fc1's gradient made this many times larger


def _spiky() -> list[dict[str, Any]]:
    """bf16 autocast, a policy that skips spikes held by accelerator.scaler, the loss given to
    it too; a spike planted after the warm-up."""
    accelerator, net, dp_rank = _setup("bf16")
    spikes = SpikePolicy(warmup=WARMUP)
    accelerator.scaler = GradScaler("cpu", scaling=False, spikes=spikes)
    optimizer = accelerator.prepare(torch.optim.AdamW(net.parameters(), lr=1e-2))
    steps = []
    for step, (x, y) in enumerate(batches(SPIKE_STEPS, dp_rank)):
        with accelerator.autocast():
            loss = F.mse_loss(net(x), y)
        accelerator.backward(loss)
        if step == WARMUP and dist.get_rank() == PLANTED_RANK:
            net.fc1.weight.grad.to_local().mul_(SPIKE_FACTOR)
        materialised = materialised_norm(net.parameters())
        before = local_digest(net.parameters())
        norm = clip_grad_norm_(accelerator, net, MAX_NORM, spikes=spikes, loss=loss)
        optimizer.step()
        steps.append(
            {
                "materialised": materialised,
                "norm": bits(norm),
                "skipped": optimizer.step_was_skipped,
                "spikes": spikes.skipped_spikes,
                "moved": before != local_digest(net.parameters()),
            }
        )
        optimizer.zero_grad()
    verify_replicas(net, optimizer.optimizer)
    return steps


def test_accelerate_prepared_optimizer_skips_a_planted_spike_on_every_rank():
    """The adapter clips through the policy, accelerate's prepared optimizer steps through the
    scaler holding it: the step whose gradient has a spike in rank 3's TP shard is skipped on
    every rank (step_was_skipped, no weight moved, counted by the policy), the steps before and
    after it clip and step, every norm the materialised one, and the replicas stay identical."""
    runs = run_ranks(_spiky)
    for step in range(SPIKE_STEPS):
        norm = float.fromhex(same_on_every_rank([run[step]["norm"] for run in runs]))
        assert_norm(norm, runs[0][step]["materialised"])
        skipped = same_on_every_rank([run[step]["skipped"] for run in runs])
        spikes = same_on_every_rank([run[step]["spikes"] for run in runs])
        moved = [run[step]["moved"] for run in runs]
        if step == WARMUP:
            assert skipped and spikes == 1 and not any(moved)
        else:
            assert not skipped and spikes == (1 if step > WARMUP else 0) and all(moved)


# --- a scaler set, the optimizer not prepared: refused before anything is touched ---------------

FP16_SCALE = 2.0**16  # accelerate's fp16 scaler starts there, and so does ours


def _grad_digest(net: Net) -> str:
    return local_digest(p.grad for p in net.parameters() if p.grad is not None)


def _unprepared() -> dict[str, Any]:
    """The issue's case: accelerator.scaler set, the optimizer not passed through prepare, the
    gradients scaled by accelerator.backward; the same with a scaler that only skips. Then the
    optimizer prepared, and a parameter of no optimizer passed beside the model's. Then, mended,
    the call of the issue in the same step."""
    accelerator, net, dp_rank = _setup()
    accelerator.scaler = GradScaler("cpu")
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    x, y = batches(1, dp_rank)[0]
    accelerator.backward(F.mse_loss(net(x), y))
    scaled = _grad_digest(net)
    oracle = materialised_norm(net.parameters()) / FP16_SCALE
    errors = [_clip_error(accelerator, net)]
    scaling, accelerator.scaler = accelerator.scaler, GradScaler("cpu", scaling=False)
    errors.append(_clip_error(accelerator, net))  # bf16's scaler: nothing scaled, none skipped
    accelerator.scaler = scaling
    prepared = accelerator.prepare(optimizer)
    stray = nn.Parameter(torch.zeros(3))
    stray.grad = torch.ones(3)
    errors.append(_clip_error(accelerator, [*net.parameters(), stray]))
    untouched = _grad_digest(net) == scaled
    norm = clip_grad_norm_(accelerator, net, MAX_NORM)
    clipped = materialised_norm(net.parameters())
    prepared.step()
    return {
        "errors": errors,
        "untouched": untouched,
        "oracle": oracle,
        "norm": bits(norm),
        "clipped": clipped,
        "skipped": prepared.step_was_skipped,
    }


def _clip_error(accelerator: Any, parameters: Any) -> str:
    """The ValueError's message of the adapter's clip (AssertionError when it clips)."""
    try:
        clip_grad_norm_(accelerator, parameters, MAX_NORM)
    except ValueError as error:
        return str(error)
    raise AssertionError("the clip did not raise")


def test_accelerate_clip_refuses_parameters_no_prepared_optimizer_holds_while_a_scaler_is_set():
    """Without the refusal the clip returns the scaled norm (65,536 times the real one) and clips
    by it. Refused on every rank with the same message naming the parameters and both ways out,
    no gradient modified; once the optimizer is prepared, the model's parameters clip to the
    materialised norm of the unscaled gradients and the prepared optimizer steps."""
    runs = run_ranks(_unprepared)
    unprepared, skipping, stray = (
        same_on_every_rank([run["errors"][i] for run in runs]) for i in range(3)
    )
    everything = "6 of the parameters to clip (norm.weight, norm.bias, fc1.weight and 3 more)"
    assert everything in unprepared and everything in skipping
    assert "1 of the parameters to clip (parameters[6])" in stray
    for message in (unprepared, skipping, stray):
        assert "accelerator.prepare" in message and "accelerator.scaler.unscale_" in message
    assert "the scale times the real one" in unprepared and "the scale times" in stray
    assert "skip no step of theirs that holds a NaN or inf" in skipping
    assert all(run["untouched"] for run in runs)
    oracle = same_on_every_rank([run["oracle"] for run in runs])
    assert_norm(float.fromhex(same_on_every_rank([run["norm"] for run in runs])), oracle)
    assert oracle > MAX_NORM
    assert all(math.isclose(run["clipped"], MAX_NORM, rel_tol=1e-4) for run in runs)
    assert not any(run["skipped"] for run in runs)


# --- the norm handed to accelerator.log ---------------------------------------------------------

# log_as per step; step 0 is the first call (which plans), and step 1 calls this package's clip
# itself: the host reads the adapter adds are counted against its.
LOG_AS = ("grad_norm", None, None, "train/grad_norm")
BASELINE = 1


class _Recorder(accelerate.tracking.GeneralTracker):
    """A tracker that keeps what ``accelerator.log`` hands it."""

    name = "recorder"
    requires_logging_directory = False

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[dict[str, Any], int | None]] = []

    @property
    def tracker(self) -> list[tuple[dict[str, Any], int | None]]:
        return self.logged

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.logged.append((dict(values), step))


class _HostReads(TorchDispatchMode):
    """Counts the reads of a tensor's value by the host (``item()``, ``float()``) in its scope."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _logged() -> dict[str, Any]:
    """A recording tracker passed as ``log_with`` on every rank (accelerate starts it on the main
    process only), the norm logged on steps 0 and 3, not on step 2; the host reads of each
    call counted; a ``log_step`` without ``log_as`` refused."""
    recorder = _Recorder()
    accelerator, net, dp_rank = _setup(log_with=[recorder])
    accelerator.init_trackers("credit-parallel")
    optimizer = accelerator.prepare(torch.optim.AdamW(net.parameters(), lr=1e-2))
    steps = []
    for step, (x, y) in enumerate(batches(len(LOG_AS), dp_rank)):
        accelerator.backward(F.mse_loss(net(x), y))
        log_as = LOG_AS[step]
        with _HostReads() as reads:
            if step == BASELINE:
                norm = collectives.clip_grad_norm_(net, MAX_NORM)
            else:
                log_step = None if log_as is None else step
                norm = clip_grad_norm_(accelerator, net, MAX_NORM, log_as=log_as, log_step=log_step)
        steps.append({"norm": bits(norm), "reads": reads.count})
        optimizer.step()
        optimizer.zero_grad()
    try:
        clip_grad_norm_(accelerator, net, MAX_NORM, log_step=3)
        refused = "no error"
    except ValueError as error:
        refused = str(error)
    return {
        "steps": steps,
        "trackers": len(accelerator.trackers),
        "logged": [(values, step) for values, step in recorder.logged],
        "refused": refused,
    }


def test_accelerate_clip_logs_the_norm_through_accelerator_log_on_request_only():
    """The main process's tracker records the returned norm's bits under log_as, at log_step, on
    the steps that ask. Against this package's clip alone, logging adds one host read on the
    main process and none elsewhere, and with log_as None the adapter adds none."""
    runs = run_ranks(_logged)
    assert [run["trackers"] for run in runs] == [1, 0, 0, 0]
    norms = [
        float.fromhex(same_on_every_rank([run["steps"][step]["norm"] for run in runs]))
        for step in range(len(LOG_AS))
    ]
    assert runs[0]["logged"] == [({"grad_norm": norms[0]}, 0), ({"train/grad_norm": norms[3]}, 3)]
    assert not any(run["logged"] for run in runs[1:])
    reads = [[run["steps"][step]["reads"] for step in range(len(LOG_AS))] for run in runs]
    assert [r[2] - r[BASELINE] for r in reads] == [0, 0, 0, 0], reads  # not logged
    assert [r[3] - r[BASELINE] for r in reads] == [1, 0, 0, 0], reads  # logged
    refused = same_on_every_rank([run["refused"] for run in runs])
    assert "log_step=3 was given without log_as" in refused
