"""The spike policy on the GradScaler's layouts, at 4 real gloo ranks (2 for the long run).

A spike planted in one data rank's loss (1000 times larger at one step, on every rank that trains
on that slice of the batch) on FSDP2 + TP, DDP, HSDP, pipeline stages and experts held per rank,
with ``SpikePolicy(warmup=3)`` held by ``GradScaler("cpu", scaling=False)``. Oracles, on every
rank: the scaler skips that step alone, the weights keep their bits on it, the policy counts one
spike and its history leaves it out; the policy's figures of every step (norm, z-score, limit,
loss) have the same bits on every rank; the weights have the bits of the same layout whose trainer
skips that step by hand, and lie within 16 ULPs of a one-process replica (the model without
distribution, trained with SGD on every rank's batch together, the step skipped by hand), whose
norms the policy's match within 16 ULPs; the same run without the policy takes the step, and
lies millions of ULPs off. Rank 0 alone warns, naming the step.

With fp16's scaling (FSDP2 + TP): an inf backs the scale off and leaves the histories as they
were; a spike is skipped at the same scale, which grows on as torch's rule says of a clean step.
A run resumed from the states of the model, optimizer, scaler and policy takes the decisions and
has the bits of the run that went straight through; resumed without the policy's state, it
takes the spike. Two policies for two optimizers: a spike in one optimizer's gradients skips that
optimizer alone, and leaves the other policy's history with the bits of a run without the spike.
And 300 steps of ordinary training (AdamW, a linear warm-up then decay of the learning rate) at
the policy's defaults skip nothing.
"""

from __future__ import annotations

import copy
import io
import math
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from support.amp_layouts import (
    GROWTH_INTERVAL,
    INIT_SCALE,
    Layout,
    Plant,
    batch,
    build,
    copies_agree,
    expected_scales,
    local_bits,
    plant_value,
)
from support.spike_runs import (
    SPIKE,
    SPIKE_STEP,
    STEPS,
    WARMUP,
    float_bits,
    history_bits,
    loss_weight,
    replica,
    sgd,
    spike_warnings,
    train,
    ulps_apart,
)
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from credit.parallel._common.compat import local_tensor
from credit.parallel.amp import GradScaler
from credit.parallel.spikes import SpikePolicy
from testbed.layouts import IN_DIM

# Slow, every test (make test-fast leaves them out): training runs on every layout at real ranks.
pytestmark = pytest.mark.slow

# The one-process replica sums every gradient in another order (over ranks, shards and TP
# partial sums), a few ULPs off the distributed sum; SGD carries that into the weights multiplied
# by its learning rate, and 8 steps compound it. Observed: at most 5 ULPs for the norms and
# 4.25 ULPs of each tensor's largest magnitude for the weights, over the five layouts. A step
# taken or skipped moves the weights by millions of ULPs.
REPLICA_ULPS = 16


def _same_bits(ours: dict, theirs: dict) -> bool:
    return all(torch.equal(ours[n].view(torch.int32), theirs[n].view(torch.int32)) for n in ours)


def _spiked_layout(name: str) -> dict:
    """Three runs of layout ``name``: with the policy, without it, and skipping the spike step
    by hand; and the one-process replica, whose norms are compared with the policy's."""
    policy = SpikePolicy(warmup=WARMUP)
    with spike_warnings() as messages:
        spiked = train(name, policy)
    plain = train(name, None)
    by_hand = train(name, None, skip_by_hand=SPIKE_STEP)
    replicas, norms = replica(name, skip=SPIKE_STEP)
    mine = replicas[spiked["index"]]
    return {
        "skipped": spiked["skipped"],
        "kept": spiked["kept"],
        "counts": (policy.skipped_spikes, policy.skipped_non_finite, spiked["skipped_steps"]),
        "entered": int(policy.state_dict()["statistics"]["count"]),
        "decisions": [{k: float_bits(v) for k, v in m.items()} for m in spiked["metrics"]],
        "norm_z": [float(m["norm_z"]) for m in spiked["metrics"]],
        "norm_ulps": [
            abs(float_bits(m["norm"]) - float_bits(n))
            for m, n in zip(spiked["metrics"], norms, strict=True)
        ],
        "messages": messages,
        "copies": spiked["copies"],
        "as_by_hand": _same_bits(spiked["bits"], by_hand["bits"]),
        "plain_skipped": plain["skipped"],
        "plain_kept": plain["kept"],
        "ulps": ulps_apart(spiked["full"], mine),
        "plain_ulps": ulps_apart(plain["full"], mine),
    }


@pytest.mark.parametrize("name", ["fsdp_tp", "ddp", "hsdp", "pp_equal", "experts"])
def test_a_spike_is_skipped_on_every_rank(ranks, name):
    records = ranks.run(4, _spiked_layout, name)
    only_the_spike = [step == SPIKE_STEP for step in range(STEPS)]
    for rank, record in enumerate(records):
        label = f"{name} rank {rank}"
        assert record["skipped"] == only_the_spike, f"{label}: {record['skipped']}"
        assert record["kept"] == only_the_spike, f"{label}: {record['kept']}"
        assert record["counts"] == (1, 0, 1), label
        assert record["entered"] == STEPS - 1, f"{label}: the spike entered the history"
        assert record["norm_z"][SPIKE_STEP] > 6.0, f"{label}: the norm alone is a spike"
        assert record["decisions"] == records[0]["decisions"], f"{label}: decided otherwise"
        assert record["copies"], f"{label}: copies differ"
        assert record["as_by_hand"], f"{label}: not the bits of the step skipped by hand"
        assert max(record["norm_ulps"]) <= REPLICA_ULPS, f"{label}: {record['norm_ulps']}"
        assert record["ulps"] <= REPLICA_ULPS, f"{label}: {record['ulps']} ULP off the replica"
        # Without the policy, the step is taken: the same comparison fails.
        assert not any(record["plain_skipped"]) and not any(record["plain_kept"]), label
        assert record["plain_ulps"] > 1e5, f"{label}: {record['plain_ulps']}"
        # Rank 0 alone warns, once, naming the step (counted from 1).
        heads = [m.split(":")[0] for m in record["messages"]]
        assert len(heads) == (rank == 0), f"{label}: {record['messages']}"
        assert all(h.startswith("SpikePolicy skipped") and str(SPIKE_STEP + 1) in h for h in heads)


# --- fp16: a NaN or inf is not a spike --------------------------------------------------------

SCALED_STEPS, INF_STEP, SCALED_SPIKE = 6, 3, 4


def _scaled() -> dict:
    """FSDP2 + TP with the loss scaled: an inf in rank 3's TP shard at INF_STEP, a spike in data
    rank 1's loss at SCALED_SPIKE; the policy's state after every step."""
    layout = build("fsdp_tp")
    model = layout.model
    optimizer = sgd(model)
    policy = SpikePolicy(warmup=WARMUP)
    scaler = GradScaler(
        "cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL, spikes=policy
    )
    record: dict = {"scale": [], "skipped": [], "kept": [], "states": [policy.state_dict()]}
    for step in range(SCALED_STEPS):
        loss = model(batch(layout, step)).pow(2).mean() * loss_weight(layout, step, SCALED_SPIKE)
        scaler.scale(loss).backward()
        if step == INF_STEP:
            plant_value(model, Plant(step, 3, "tp", math.inf))
        before = local_bits(model)
        scaler.unscale_(optimizer)
        policy.clip_grad_norm_(model.parameters(), loss=loss)
        scaler.step(optimizer)
        scaler.update()
        record["kept"].append(_same_bits(before, local_bits(model)))
        record["scale"].append(scaler.get_scale())
        record["skipped"].append(scaler.last_step_skipped)
        record["states"].append(policy.state_dict())
        optimizer.zero_grad()
    counts = (policy.skipped_spikes, policy.skipped_non_finite, scaler.skipped_steps)
    record.update(counts=counts, copies=copies_agree(layout))
    return record


def test_an_inf_backs_off_and_a_spike_keeps_the_scale(ranks):
    """torch's rule with INF_STEP alone skipped: the spike step counts as a clean step for the
    growth interval. The histories move on every taken step, and on neither skipped one."""
    for rank, record in enumerate(ranks.run(4, _scaled)):
        skipped = [step in (INF_STEP, SCALED_SPIKE) for step in range(SCALED_STEPS)]
        assert record["scale"] == expected_scales({INF_STEP}), f"rank {rank}: {record['scale']}"
        assert record["skipped"] == skipped and record["kept"] == skipped, f"rank {rank}"
        assert record["counts"] == (1, 1, 2), f"rank {rank}"
        assert record["copies"], f"rank {rank}"
        histories = [history_bits(state) for state in record["states"]]
        counts = [state["statistics"]["count"].item() for state in record["states"]]
        assert counts == [0, 1, 2, 3, 3, 3, 4], f"rank {rank}: {counts}"
        for step in range(SCALED_STEPS):
            moved = histories[step + 1] != histories[step]
            assert moved == (not skipped[step]), f"rank {rank} step {step}"


# --- resuming -----------------------------------------------------------------------------------

RESUME_AT, RESUMED_INF, RESUMED_SPIKE = 5, 2, 6


# On FSDP2 + TP: DDP rebuilds its buckets after its first iteration, so a resumed DDP run sums
# its first gradients in another order than the run that went straight through (1 ULP apart).


@dataclass
class _Trainer:
    layout: Layout
    optimizer: torch.optim.Optimizer
    scaler: GradScaler
    policy: SpikePolicy


def _trainer(checkpoint: dict | None, with_policy: bool = True) -> _Trainer:
    """FSDP2 + TP with fp16's scaling, fresh or from ``checkpoint`` (without the policy's state
    when not ``with_policy``)."""
    layout = build("fsdp_tp")
    optimizer = sgd(layout.model)
    policy = SpikePolicy(warmup=WARMUP)
    scaler = GradScaler(
        "cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL, spikes=policy
    )
    if checkpoint is not None:
        layout.model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        saved = torch.load(io.BytesIO(checkpoint["amp"]), weights_only=True)
        scaler.load_state_dict(saved["scaler"])
        if with_policy:
            policy.load_state_dict(saved["policy"])
    return _Trainer(layout, optimizer, scaler, policy)


def _checkpoint(trainer: _Trainer) -> dict:
    """Every state: the model's and optimizer's (DTensors) copied, the scaler's and policy's
    through torch.save (plain tensors and numbers only)."""
    buffer = io.BytesIO()
    torch.save(
        {"scaler": trainer.scaler.state_dict(), "policy": trainer.policy.state_dict()}, buffer
    )
    return {
        "model": copy.deepcopy(trainer.layout.model.state_dict()),
        "optimizer": copy.deepcopy(trainer.optimizer.state_dict()),
        "amp": buffer.getvalue(),
    }


def _steps(trainer: _Trainer, steps: range) -> list[bool]:
    """Train ``steps``, an inf on rank 3 at RESUMED_INF and a spike at RESUMED_SPIKE; return
    which were skipped."""
    model = trainer.layout.model
    skipped = []
    for step in steps:
        weight = loss_weight(trainer.layout, step, RESUMED_SPIKE)
        loss = model(batch(trainer.layout, step)).pow(2).mean() * weight
        trainer.scaler.scale(loss).backward()
        if step == RESUMED_INF:
            plant_value(model, Plant(step, 3, "tp", math.inf))
        trainer.scaler.unscale_(trainer.optimizer)
        trainer.policy.clip_grad_norm_(model.parameters(), loss=loss)
        trainer.scaler.step(trainer.optimizer)
        trainer.scaler.update()
        skipped.append(trainer.scaler.last_step_skipped)
        trainer.optimizer.zero_grad()
    return skipped


def _summary(trainer: _Trainer, skipped: list[bool]) -> dict:
    policy = trainer.policy
    return {
        "skipped": skipped,
        "counts": (policy.skipped_spikes, policy.skipped_non_finite),
        "skipped_steps": trainer.scaler.skipped_steps,
        "scale": trainer.scaler.get_scale(),
        "history": history_bits(policy.state_dict()),
        "bits": local_bits(trainer.layout.model),
    }


def _resumed() -> dict:
    """The run straight through; the run resumed at RESUME_AT; and, as a control, resumed
    without the policy's state."""
    straight = _trainer(None)
    runs = {"straight": _summary(straight, _steps(straight, range(STEPS)))}
    first = _trainer(None)
    before = _steps(first, range(RESUME_AT))
    checkpoint = _checkpoint(first)
    for name, with_policy in (("resumed", True), ("control", False)):
        second = _trainer(checkpoint, with_policy)
        runs[name] = _summary(second, before + _steps(second, range(RESUME_AT, STEPS)))
    return {
        name: {**run, "bits": _same_bits(run["bits"], runs["straight"]["bits"])}
        for name, run in runs.items()
    }


def test_a_resumed_run_decides_as_the_straight_one(ranks):
    for rank, runs in enumerate(ranks.run(4, _resumed)):
        straight, resumed, control = runs["straight"], runs["resumed"], runs["control"]
        skipped = [step in (RESUMED_INF, RESUMED_SPIKE) for step in range(STEPS)]
        assert straight["skipped"] == skipped, f"rank {rank}: {straight['skipped']}"
        assert straight["counts"] == (1, 1) and straight["skipped_steps"] == 2, f"rank {rank}"
        assert resumed == straight, f"rank {rank}: {resumed} vs {straight}"
        # Without its history, the fresh policy is still warming up: the spike is taken.
        assert not control["skipped"][RESUMED_SPIKE] and not control["bits"], f"rank {rank}"


# --- two optimizers -------------------------------------------------------------------------------


def _two_policies(spiked: bool) -> dict:
    """The experts (optimizer A) and the dense parameters (B) on the experts layout, each with
    its policy; the experts' gradients on rank 2 multiplied by SPIKE at SPIKE_STEP."""
    layout = build("experts")
    model = layout.model
    experts = list(model.experts)
    dense = [p for n, p in model.named_parameters() if not n.startswith("experts")]
    optimizers = [torch.optim.SGD(params, lr=0.05) for params in (experts, dense)]
    policies = [SpikePolicy(warmup=WARMUP) for _ in optimizers]
    scaler = GradScaler("cpu", scaling=False, spikes=dict(zip(optimizers, policies, strict=True)))
    kept = []
    for step in range(STEPS):
        scaler.scale(model(batch(layout, step)).pow(2).mean()).backward()
        if spiked and step == SPIKE_STEP and dist.get_rank() == 2:
            torch._foreach_mul_([local_tensor(p.grad) for p in experts], SPIKE)
        before = local_bits(model)
        for optimizer in optimizers:
            scaler.unscale_(optimizer)
        policies[0].clip_grad_norm_(experts, **layout.clip_kwargs)
        policies[1].clip_grad_norm_(dense)
        for optimizer in optimizers:
            scaler.step(optimizer)
        scaler.update()
        after = local_bits(model)
        kept.append(  # whether the experts, and the dense parameters, kept their values
            tuple(_same_bits(_part(before, part), _part(after, part)) for part in (True, False))
        )
        for optimizer in optimizers:
            optimizer.zero_grad()
    return {
        "kept": kept,
        "spikes": [policy.skipped_spikes for policy in policies],
        "histories": [history_bits(policy.state_dict()) for policy in policies],
        "dense": _part(local_bits(model), False),
    }


def _part(bits: dict, experts: bool) -> dict:
    return {n: t for n, t in bits.items() if n.startswith("experts") == experts}


def _two_runs() -> dict:
    return {"spiked": _two_policies(True), "clean": _two_policies(False)}


def test_a_spike_skips_only_its_optimizer(ranks):
    for rank, runs in enumerate(ranks.run(4, _two_runs)):
        spiked, clean = runs["spiked"], runs["clean"]
        assert spiked["kept"] == [(s == SPIKE_STEP, False) for s in range(STEPS)], f"rank {rank}"
        assert clean["kept"] == [(False, False)] * STEPS, f"rank {rank}"
        assert spiked["spikes"] == [1, 0] and clean["spikes"] == [0, 0], f"rank {rank}"
        # B's history and weights are those of the run without the spike, bit for bit.
        assert spiked["histories"][1] == clean["histories"][1], f"rank {rank}"
        assert _same_bits(spiked["dense"], clean["dense"]), f"rank {rank}"
        entered = [run["histories"][0]["count"] for run in (spiked, clean)]
        assert entered == [[STEPS - 1], [STEPS]], f"rank {rank}: {entered}"


# --- no false skips -------------------------------------------------------------------------------

NORMAL_STEPS, LR_WARMUP = 300, 30


def _mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(IN_DIM, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 1)
    )


def _schedule(step: int) -> float:
    """A linear warm-up over LR_WARMUP steps, then a linear decay to a tenth."""
    if step < LR_WARMUP:
        return (step + 1) / LR_WARMUP
    return 1.0 - 0.9 * (step - LR_WARMUP) / (NORMAL_STEPS - LR_WARMUP)


def _normal_training() -> dict:
    """A regression onto a fixed random teacher, with noise, under DDP at the defaults."""
    torch.manual_seed(0)
    teacher, model = _mlp(), DistributedDataParallel(_mlp())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule)
    policy = SpikePolicy()
    scaler = GradScaler("cpu", scaling=False, spikes=policy)
    generator = torch.Generator().manual_seed(dist.get_rank())
    figures = []
    for _ in range(NORMAL_STEPS):
        x = torch.randn(16, IN_DIM, generator=generator)
        with torch.no_grad():
            y = teacher(x) + 0.1 * torch.randn(16, 1, generator=generator)
        loss = (model(x) - y).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        policy.clip_grad_norm_(model.parameters(), max_norm=1.0, loss=loss)
        scaler.step(optimizer)
        scaler.update()
        if not scaler.last_step_skipped:
            scheduler.step()
        figures.append(torch.stack(list(policy.metrics().values())))
        optimizer.zero_grad()
    # The step whose norm or loss lay furthest out (the z-scores are NaN during the warm-up).
    table = torch.stack(figures)
    names = list(policy.metrics())
    z = table[:, [names.index("norm_z"), names.index("loss_z")]].nan_to_num(-math.inf)
    worst = int(z.amax(dim=1).argmax())
    return {
        "skipped": (policy.skipped_spikes, scaler.skipped_steps),
        "worst": {"step": worst, **dict(zip(names, table[worst].tolist(), strict=True))},
    }


def test_ordinary_training_skips_nothing_at_the_defaults(ranks):
    """Observed: z-scores up to 3.7 (norm) and 3.8 (loss), against the default limit of 6."""
    for rank, record in enumerate(ranks.run(2, _normal_training)):
        assert record["skipped"] == (0, 0), f"rank {rank}: furthest out {record['worst']}"
        assert max(record["worst"]["norm_z"], record["worst"]["loss_z"]) < 6.0, record
