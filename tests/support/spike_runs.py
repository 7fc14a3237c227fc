"""Training runs of the spike policy on the GradScaler's layouts, and their one-process replica.

A spike is planted in the loss of one data rank (every rank that trains on that slice of the
global batch: its TP or expert-parallel peers too), multiplied by :data:`SPIKE` at one step. The
input itself cannot carry it: :class:`~support.amp_layouts.NormFirstNet` opens with a LayerNorm, which
undoes any scaling of its input. Within a data-parallel group the loss's weight reaches that
slice's gradients alone, as a batch that runs away does.

The replica is the layout's model in one process, without any distribution, trained with the
same optimizer on the concatenation of every data rank's batch (the spiked rows weighted as
above), and the spike step skipped by hand: one model for each pipeline stage or expert-parallel
rank of the layout.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from credit.parallel.amp import GradScaler
from credit.parallel.spikes import SpikePolicy
from support.amp_layouts import (
    Layout,
    NormFirstNet,
    WithExperts,
    batch,
    build,
    copies_agree,
    local_bits,
)
from testbed.layouts import IN_DIM

STEPS = 8
SPIKE_STEP = 5
SPIKE = 1e3
WARMUP = 3
LR = 0.05
MOMENTUM = 0.9
# The data rank whose loss is spiked, on pipeline stage 0.
SPIKED_RANK = 1

# Per layout of amp_layouts.build: how many data ranks it has and how many one-process models
# it stands for (pipeline stages, or the experts of each expert-parallel rank).
REPLICAS = {
    "fsdp_tp": (2, 1),
    "ddp": (4, 1),
    "hsdp": (4, 1),
    "pp_equal": (2, 2),
    "experts": (2, 2),
}


def loss_weight(layout: Layout, step: int, spike_step: int | None = SPIKE_STEP) -> float:
    """How much this rank's loss is multiplied by at ``step``: :data:`SPIKE` on the spiked slice
    of the batch at ``spike_step``, else 1."""
    spiked = step == spike_step and layout.data_rank == SPIKED_RANK and layout.stage == 0
    return SPIKE if spiked else 1.0


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum: a rounding difference in a gradient reaches the weights multiplied by
    the learning rate (Adam's division by the root of its second moment would blow up the
    rounding of a gradient near zero), so a one-process replica stays within a few ULPs."""
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


# --- the one-process replica ------------------------------------------------------------------


def _replica_models(name: str) -> list[nn.Module]:
    """The layout's models as amp_layouts.build initialises them, without distribution."""
    count = REPLICAS[name][1]
    models: list[nn.Module] = []
    for index in range(count):
        if name == "experts":
            torch.manual_seed(0)
            models.append(WithExperts(index))
        else:
            torch.manual_seed(index)  # pipeline stage s is seeded with s; else seed 0
            models.append(NormFirstNet())
    return models


def _replica_norm(name: str, models: list[nn.Module]) -> Tensor:
    """The total gradient norm the layout's clip takes: every stage's gradients, or the dense
    gradients once and every expert-parallel rank's experts."""
    grads = [p.grad for p in models[0].parameters() if p.grad is not None]
    if name == "experts":
        grads += [p.grad for p in models[1].experts.parameters() if p.grad is not None]
    elif len(models) > 1:
        grads += [p.grad for p in models[1].parameters() if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads)


def _replica_loss(name: str, model: nn.Module, stage: int, step: int) -> Tensor:
    """The loss of the global batch of ``step`` (every data rank's slice of amp_layouts.batch
    together), the spiked slice's rows weighted as its rank's loss is."""
    data_ranks = REPLICAS[name][0]
    generator = torch.Generator().manual_seed(1000 * stage + step)
    x = torch.randn(4 * data_ranks, IN_DIM, generator=generator)
    weights = torch.ones(4 * data_ranks)
    if step == SPIKE_STEP and stage == 0:
        weights[4 * SPIKED_RANK : 4 * (SPIKED_RANK + 1)] = SPIKE
    return (model(x).pow(2) * weights[:, None]).mean()


def replica(name: str, skip: int | None) -> tuple[list[dict[str, Tensor]], list[Tensor]]:
    """Train the layout's one-process replica for :data:`STEPS` steps, spiked at
    :data:`SPIKE_STEP`, skipping step ``skip`` by hand.

    Returns:
        The parameters of each replica model after the run, and the total norm of each step.
    """
    models = _replica_models(name)
    optimizers = [sgd(model) for model in models]
    norms = []
    for step in range(STEPS):
        for index, model in enumerate(models):
            stage = index if name == "pp_equal" else 0
            _replica_loss(name, model, stage, step).backward()
        norms.append(_replica_norm(name, models))
        for optimizer in optimizers:
            if step != skip:
                optimizer.step()
            optimizer.zero_grad()
    return [full_parameters(model) for model in models], norms


# --- what a rank compares ---------------------------------------------------------------------


def full_parameters(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter whole (a collective per DTensor: call on every rank), by its name in the
    unwrapped model."""
    full = {}
    for name, param in model.named_parameters():
        value = param.detach()
        full[name.removeprefix("module.")] = (
            value.full_tensor() if isinstance(value, DTensor) else value.clone()
        )
    return full


def ulps_apart(ours: dict[str, Tensor], theirs: dict[str, Tensor]) -> float:
    """The largest difference between two sets of float32 parameters, in ULPs of each tensor's
    largest magnitude (the spacing of float32 values there), over all tensors."""
    worst = 0.0
    for name, reference in theirs.items():
        top = reference.abs().max()
        spacing = torch.nextafter(top, torch.tensor(float("inf"))) - top
        worst = max(worst, float((ours[name] - reference).abs().max() / spacing))
    return worst


def float_bits(value: Tensor) -> int:
    """The bits of a float32 scalar, as an int (NaN-safe equality)."""
    return int(value.detach().float().reshape(1).view(torch.int32).item())


@contextmanager
def spike_warnings() -> Iterator[list[str]]:
    """The spike policy's skipped-spike reports logged while inside (rank 0 logs them)."""
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("credit.parallel.spikes")
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


# --- a run on the current world -----------------------------------------------------------------


def replica_index(layout: Layout) -> int:
    """Which replica model stands for this rank's part: its pipeline stage or its experts."""
    return layout.distinct_rank if layout.distinct_rank is not None else layout.stage


def train(name: str, policy: SpikePolicy | None, skip_by_hand: int | None = None) -> dict:
    """Train layout ``name`` for :data:`STEPS` steps with bf16's scaler (``scaling=False``),
    spiked at :data:`SPIKE_STEP`, the clip being ``policy``'s (no fixed ``max_norm``: it clips
    nothing, so the gradients are those of a run without it), or none.

    Args:
        name: a layout of amp_layouts.build.
        policy: the spike policy the scaler holds, or None.
        skip_by_hand: a step the trainer itself does not take (it does not call ``step``).

    Returns:
        Per step: whether the scaler skipped it, whether the weights kept their bits, and the
        policy's metrics; after the run: the local shards, the whole parameters, and whether
        every copy agrees.
    """
    layout = build(name)
    model = layout.model
    optimizer = sgd(model)
    scaler = GradScaler("cpu", scaling=False, spikes=policy)
    record: dict = {"skipped": [], "kept": [], "metrics": [], "index": replica_index(layout)}
    for step in range(STEPS):
        loss = model(batch(layout, step)).pow(2).mean() * loss_weight(layout, step)
        scaler.scale(loss).backward()
        before = local_bits(model)
        scaler.unscale_(optimizer)
        if policy is not None:
            policy.clip_grad_norm_(model.parameters(), loss=loss, **layout.clip_kwargs)
            record["metrics"].append({k: v.clone() for k, v in policy.metrics().items()})
        if step != skip_by_hand:
            scaler.step(optimizer)
        scaler.update()
        after = local_bits(model)
        record["kept"].append(all(torch.equal(before[n], after[n]) for n in before))
        record["skipped"].append(scaler.last_step_skipped)
        optimizer.zero_grad()
    record.update(
        bits=local_bits(model),
        full=full_parameters(model),
        copies=copies_agree(layout),
        skipped_steps=scaler.skipped_steps,
    )
    return record


def history_bits(state: dict) -> dict[str, list[int]]:
    """The history of a policy's ``state_dict`` (the norm's and the loss's statistics), as the
    bits of each value: equal when nothing entered it."""
    bits = {}
    for field, tensor in state["statistics"].items():
        as_ints = tensor.view(torch.int32) if tensor.is_floating_point() else tensor
        bits[field] = as_ints.reshape(-1).tolist()
    return bits
