"""The GradScaler in the sequences real trainers write, at 4 real gloo ranks.

CREDIT's own boundary step (its "dynamic" clip: a norm of the DTensor gradients alone, a local norm
of the plain ones, then a clip with that tensor as ``max_norm``) on tp x domain and on FSDP2 + TP;
two models with a scaler each, their calls interleaved; a custom step that calls ``update`` without
``step``; checkpoints through ``torch.distributed.checkpoint``; the skipped-step report on DDP, on
TP with a logging norm, and without any norm; a norm under pipeline stages that covers the flags
on one stage only; ``per_rank`` with the check mode; ``scaling=False`` with a device this machine
lacks; a NaN or negative tensor ``max_norm``.

Oracles, on every rank: the norms' bits against the same calls without this package's scaler (a
twin model driven by torch's scaler gets the same unscaled gradients, and no listener); the scale
history and the skipped steps against torch's update rule, or against torch's scaler itself on
FSDP2 over the world, where torch's is right; parameters unchanged on skipped steps, and every copy
of every parameter with the same bits on every rank; the report's (rank, parameter) pairs against
the planted ones; collectives counted per step.
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from support.amp_layouts import (
    GROWTH_INTERVAL,
    INIT_SCALE,
    MAX_NORM,
    STEPS,
    Layout,
    NormFirstNet,
    Plant,
    batch,
    build,
    copies_agree,
    expected_scales,
    local_bits,
    plant_value,
    scaler_warnings,
    shard_model,
)
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn.parallel import DistributedDataParallel

from credit.parallel._common.compat import local_tensor
from credit.parallel.amp import GradScaler
from credit.parallel.collectives import clip_grad_norm_, total_grad_norm
from credit.parallel.grad_sync import sync_domain_gradients, sync_replicated_gradients
from credit.parallel.parallel_mesh import ParallelMesh, build_device_mesh
from testbed.layouts import IN_DIM, TP_PLAN, same_bits_everywhere
from testbed.world_layouts import WireRecorder

WORLD = 4
INF, NAN = math.inf, math.nan


def _bits(value: Tensor) -> Tensor:
    return value.detach().reshape(1).to(torch.float64).view(torch.int64)


def _same(a: Tensor, b: Tensor) -> bool:
    return torch.equal(_bits(a), _bits(b))


# --- CREDIT's boundary step ---------------------------------------------------------------------


@functools.cache
def _credit_mesh(name: str) -> ParallelMesh:
    return build_device_mesh(tp=2, domain=2) if name == "tp_domain" else build_device_mesh(tp=2)


def _credit_model(name: str) -> tuple[nn.Module, ParallelMesh, int, int]:
    """NormFirstNet with TP on its blocks over tp x domain (no FSDP: the LayerNorms, embedding
    and head stay plain) or under FSDP2 over dp; the data slice of this rank and their count."""
    mesh = _credit_mesh(name)
    torch.manual_seed(0)
    model = NormFirstNet()
    for block in model.blocks:
        parallelize_module(block, mesh.tp, TP_PLAN)
    if name == "fsdp_tp":
        shard_model(model, mesh.dp)
    coordinate = mesh.world.get_coordinate()
    assert coordinate is not None
    dp_rank, _, domain_rank = coordinate
    domains = mesh.domain.size()
    return model, mesh, dp_rank * domains + domain_rank, mesh.dp.size() * domains


def _credit_boundary_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: Any,
    mesh: ParallelMesh,
    grad_max_norm: float | str,
    record: Callable[[str, Tensor], None],
) -> None:
    """CREDIT's ``trainer_gen2`` at an accumulation boundary (miles-credit 2026.2.0), with this
    package's sync functions for its own; ``record`` only reads the norms it computes."""
    sync_domain_gradients(model, mesh.domain)
    sync_replicated_gradients(model, mesh.tp)
    scaler.unscale_(optimizer)
    if grad_max_norm == "dynamic":
        plain, sharded = [], []
        for p in model.parameters():
            if p.grad is not None:
                (sharded if isinstance(p.grad, DTensor) else plain).append(p.grad.detach())
        sq_terms = []
        if plain:
            local_sq = torch.stack([g.norm(2) for g in plain]).square().sum()
            dist.all_reduce(local_sq, op=dist.ReduceOp.SUM)
            sq_terms.append(local_sq)
        if sharded:
            sharded_norm = total_grad_norm(sharded, 2.0)
            record("dtensor norm", sharded_norm)
            sq_terms.append(sharded_norm.square())
        global_norm = torch.stack(sq_terms).sum().sqrt()
        record("clip", clip_grad_norm_(model.parameters(), max_norm=global_norm))
    elif grad_max_norm > 0.0:  # type: ignore[operator]
        record("clip", clip_grad_norm_(model.parameters(), max_norm=grad_max_norm))
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()


class _ScalingByHand:
    """The twin's scaler: torch's arithmetic (the loss times the scale, the local gradients times
    its reciprocal with torch's kernel) with the scale this package's scaler had, every step
    taken, nothing attached to the norms. torch's own scaler cannot stand in: its unscale_ raises
    on TP DTensors beside plain gradients (tp x domain)."""

    def __init__(self) -> None:
        self.value = INIT_SCALE

    def scale(self, loss: Tensor) -> Tensor:
        return loss * torch.tensor(self.value)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [
            local_tensor(p.grad) for p in optimizer.param_groups[0]["params"] if p.grad is not None
        ]
        inv_scale = torch.tensor(self.value, dtype=torch.float64).reciprocal().float()
        torch._amp_foreach_non_finite_check_and_unscale_(grads, torch.zeros(()), inv_scale)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def update(self) -> None:
        pass


def _credit_run(name: str, grad_max_norm: float | str, plants: tuple[Plant, ...]) -> dict:
    """CREDIT's step with this package's scaler, beside a twin that scales by hand (which gives
    the norms without this package's scaler, until the first planted step)."""
    runs = []
    for scaler in (
        GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL),
        _ScalingByHand(),
    ):
        model, mesh, data_rank, data_ranks = _credit_model(name)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
        runs.append((model, mesh, Layout(model, data_rank, data_ranks), optimizer, scaler))
    ours, twin = runs[0][4], runs[1][4]
    assert isinstance(ours, GradScaler) and isinstance(twin, _ScalingByHand)
    record: dict[str, list] = {"scale": [], "skipped": [], "kept": [], "copies": []}
    record |= {"norms_as_without": [], "counts": []}
    # The twin's norms are compared up to the first planted step: it stops there.
    compared_steps = min(planted.step for planted in plants) + 1
    for step in range(STEPS):
        twin.value = ours.get_scale()
        norms: list[dict[str, Tensor]] = [{}, {}]
        active = runs if step < compared_steps else runs[:1]
        for (model, mesh, layout, optimizer, scaler), seen in zip(active, norms, strict=False):
            scaler.scale(model(batch(layout, step)).pow(2).mean()).backward()
            for planted in plants:
                if planted.step == step:
                    plant_value(model, planted)
            if scaler is not ours:
                _credit_boundary_step(
                    model, optimizer, scaler, mesh, grad_max_norm, seen.__setitem__
                )
                continue
            before = local_bits(model)
            with WireRecorder() as wire:
                _credit_boundary_step(
                    model, optimizer, scaler, mesh, grad_max_norm, seen.__setitem__
                )
            after = local_bits(model)
            record["kept"].append(all(torch.equal(before[n], after[n]) for n in before))
            record["counts"].append(wire.groups)
        record["scale"].append(ours.get_scale())
        record["skipped"].append(ours.last_step_skipped)
        record["copies"].append(copies_agree(runs[0][2]))
        if step < compared_steps:
            record["norms_as_without"].append(
                {key: _same(norms[0][key], norms[1][key]) for key in norms[0]}
            )
    record["finite"] = all(bool(torch.isfinite(t).all()) for t in local_bits(runs[0][0]).values())
    record["skipped_steps"] = ours.skipped_steps
    return record


# A plain LayerNorm gradient on tp x domain; a TP-sharded one under FSDP2 + TP.
CREDIT_CASES = [
    ("tp_domain", "dynamic", "plain"),
    ("tp_domain", 0.5, "plain"),
    ("fsdp_tp", "dynamic", "tp"),
    ("fsdp_tp", 0.5, "copy"),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "grad_max_norm", "place"),
    CREDIT_CASES,
    ids=[f"{name}-{clip}-{place}" for name, clip, place in CREDIT_CASES],
)
def test_credits_boundary_step_skips_exactly_the_planted_steps(ranks, name, grad_max_norm, place):
    """An inf at step 2 and a NaN at step 4, on one rank each: every rank skips those steps and
    no other, trains on (finite weights, copies bit-identical), and every norm CREDIT computes is
    the one it gets without this package's scaler (compared up to the first planted step, after
    which torch's scaler, deciding per rank, leaves the twin elsewhere)."""
    plants = (Plant(2, 3, place, INF), Plant(4, 1, place, NAN))
    skipped = {plant.step for plant in plants}
    for rank, record in enumerate(ranks.run(WORLD, _credit_run, name, grad_max_norm, plants)):
        label = f"{name} {grad_max_norm} rank {rank}"
        assert record["skipped"] == [step in skipped for step in range(STEPS)], label
        assert record["scale"] == expected_scales(skipped), label
        assert record["skipped_steps"] == len(skipped), label
        assert record["kept"] == [step in skipped for step in range(STEPS)], label
        assert all(record["copies"]) and record["finite"], label
        for step in range(min(skipped) + 1):
            compared = record["norms_as_without"][step]
            assert compared and all(compared.values()), f"{label} step {step}: {compared}"
        # Steady state: the scaler adds no collective to CREDIT's own. Those, by the size of
        # their process group: the syncs (domain and tp on tp x domain, tp alone under FSDP2),
        # then CREDIT's all_reduce of the plain norms (tp x domain only) and the dynamic clip's
        # DTensor norm, and the clip, or the fixed clip alone; a skipped step adds the report's
        # all_gather (loop AdamW). Each norm compares copies in their own group first, then
        # runs the world's one all_reduce: on tp x domain the TP shards' copies on their domain
        # peers, within domain (the rowwise biases, replicated on tp, have copies on every rank:
        # compared in the world's, as the plain replicas); under FSDP2 + TP, within tp.
        syncs = [2, 2] if name == "tp_domain" else [2]
        norm = [2, WORLD]
        clip = norm
        if grad_max_norm == "dynamic":
            clip = ([WORLD] if name == "tp_domain" else []) + norm + norm
        for step in range(1, STEPS):
            groups = syncs + clip + [WORLD] * (step in skipped)
            assert record["counts"][step] == groups, f"{label} step {step}: {record['counts']}"


# --- two models, one scaler each ----------------------------------------------------------------


def _two_models() -> dict:
    """Two FSDP2 models with a scaler and an optimizer each, their calls interleaved (unscale_ A,
    unscale_ B, clip A, clip B), an inf in model B's gradient at step 2; beside them the same
    with torch's scalers and clips (right on FSDP2 over the world)."""
    worlds = {}
    for scaler_type, clip in ((GradScaler, clip_grad_norm_), (torch.amp.GradScaler, None)):
        clip = clip or torch.nn.utils.clip_grad_norm_
        pairs = []
        for _ in range(2):  # the same weights: only model B gets the inf
            layout = build("fsdp")
            optimizer = torch.optim.AdamW(layout.model.parameters(), lr=1e-2, foreach=True)
            scaler = scaler_type("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
            pairs.append((layout, optimizer, scaler))
        worlds[scaler_type] = (pairs, clip)
    record: dict[str, list] = {"norms": [], "scales": [], "params": [], "counts": []}
    for step in range(STEPS):
        results = {}
        for scaler_type, (pairs, clip) in worlds.items():
            for index, (layout, _, scaler) in enumerate(pairs):
                scaler.scale(layout.model(batch(layout, step)).pow(2).mean()).backward()
                if step == 2 and index == 1:
                    plant_value(layout.model, Plant(2, 1, "shard", INF))
            with CommDebugMode() as comm:
                for _, optimizer, scaler in pairs:
                    scaler.unscale_(optimizer)
                norms = [clip(layout.model.parameters(), MAX_NORM) for layout, _, _ in pairs]
                for _, optimizer, scaler in pairs:
                    scaler.step(optimizer)
                    scaler.update()
            for _, optimizer, _ in pairs:
                optimizer.zero_grad()
            norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
            results[scaler_type] = (norms, [s.get_scale() for _, _, s in pairs], comm)
        ours, theirs = results[GradScaler], results[torch.amp.GradScaler]
        record["norms"].append([_same(a, b) for a, b in zip(ours[0], theirs[0], strict=True)])
        record["scales"].append((ours[1], theirs[1]))
        record["counts"].append(ours[2].get_total_counts())
        record["params"].append(
            all(
                torch.equal(local_bits(a.model)[n], local_bits(b.model)[n])
                for (a, _, _), (b, _, _) in zip(
                    worlds[GradScaler][0], worlds[torch.amp.GradScaler][0], strict=True
                )
                for n in local_bits(a.model)
            )
        )
    return record


@pytest.mark.slow
def test_two_scalers_never_answer_each_others_optimizers(ranks):
    """Model A's clip returns torch's norm, A steps and keeps its scale, while B alone skips and
    backs off: scales, norms and parameters have the bits of torch's scalers, step for step."""
    for rank, record in enumerate(ranks.run(WORLD, _two_models)):
        assert all(all(step) for step in record["norms"]), f"rank {rank}: {record['norms']}"
        assert all(ours == theirs for ours, theirs in record["scales"]), record["scales"]
        a_scales = [ours[0] for ours, _ in record["scales"]]
        b_scales = [ours[1] for ours, _ in record["scales"]]
        assert a_scales == expected_scales(set()) and b_scales == expected_scales({2})
        assert all(record["params"]), f"rank {rank}: {record['params']}"
        # One clip each; B's skip is reported in one all_gather.
        assert record["counts"][1:] == [2, 2 + 1, 2, 2, 2], record["counts"]


# --- update() without step() --------------------------------------------------------------------


def _custom_step(variant: str) -> dict:
    """A custom step that steps only a finite norm (or catches error_if_nonfinite) and always
    calls update(); beside it torch's scaler and clip on the same FSDP2 model."""
    plants = {2: Plant(2, 2, "shard", INF), 4: Plant(4, 0, "shard", NAN)}
    runs = []
    for scaler_type, clip in ((GradScaler, clip_grad_norm_), (torch.amp.GradScaler, None)):
        layout = build("fsdp")
        optimizer = torch.optim.AdamW(layout.model.parameters(), lr=1e-2, foreach=True)
        scaler = scaler_type("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
        runs.append((layout, optimizer, scaler, clip or torch.nn.utils.clip_grad_norm_))
    record: dict[str, list] = {"scales": [], "params": [], "counts": []}
    for step in range(STEPS + 1):
        for layout, optimizer, scaler, clip in runs:
            scaler.scale(layout.model(batch(layout, step)).pow(2).mean()).backward()
            if step in plants:
                plant_value(layout.model, plants[step])
            with CommDebugMode() as comm:
                scaler.unscale_(optimizer)
                if variant == "finite norm":
                    norm = clip(layout.model.parameters(), MAX_NORM)
                    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
                    if torch.isfinite(norm):
                        scaler.step(optimizer)
                else:
                    try:
                        clip(layout.model.parameters(), MAX_NORM, error_if_nonfinite=True)
                        scaler.step(optimizer)
                    except RuntimeError:
                        pass
                scaler.update()
            optimizer.zero_grad()
            if isinstance(scaler, GradScaler):
                record["counts"].append(comm.get_total_counts())
        record["scales"].append([scaler.get_scale() for _, _, scaler, _ in runs])
        ours, theirs = (local_bits(layout.model) for layout, _, _, _ in runs)
        record["params"].append(all(torch.equal(ours[n], theirs[n]) for n in ours))
    return record


@pytest.mark.parametrize("variant", ["finite norm", "error_if_nonfinite"])
def test_update_without_step_backs_off_as_torch(ranks, variant):
    """The scale history is torch's: 1024, 2048, 1024, 1024, 512, 512, 1024 (it backs off on
    every planted step, though step() was never called there), and the parameters its bits."""
    for record in ranks.run(WORLD, _custom_step, variant):
        ours = [scales[0] for scales in record["scales"]]
        assert ours == [scales[1] for scales in record["scales"]]
        assert ours == [1024.0, 2048.0, 1024.0, 1024.0, 512.0, 512.0, 1024.0]
        assert all(record["params"])
        assert record["counts"][1:] == [1] * STEPS  # the clip's own; update() adds nothing


# --- checkpoints --------------------------------------------------------------------------------

RESUME_AT = 3
RESUME_STEPS = 8
RESUME_PLANTS = {1: Plant(1, 3, "tp", INF), 2: Plant(2, 1, "copy", NAN), 5: Plant(5, 0, "tp", INF)}
RESUME_PLANTS |= {6: Plant(6, 2, "copy", NAN)}


def _train_with_checkpoint(folder: str | None) -> dict:
    """FSDP2 + TP for RESUME_STEPS steps. With ``folder``, the scaler is saved after RESUME_AT
    steps through torch.distributed.checkpoint and a new one loads it and goes on (the model and
    optimizer go on as they are: they are not under test)."""
    layout = build("fsdp_tp")
    model = layout.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)

    def new_scaler() -> GradScaler:
        return GradScaler(
            "cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL, model=model
        )

    scaler = new_scaler()
    record: dict[str, list] = {"scale": [], "skipped_steps": [], "state": []}
    with scaler_warnings() as reports:
        for step in range(RESUME_STEPS):
            if folder is not None and step == RESUME_AT:
                dcp.save({"scaler": scaler}, checkpoint_id=folder)
                scaler = new_scaler()
                dcp.load({"scaler": scaler}, checkpoint_id=folder)
            scaler.scale(model(batch(layout, step)).pow(2).mean()).backward()
            if step in RESUME_PLANTS:
                plant_value(model, RESUME_PLANTS[step])
            scaler.unscale_(optimizer)
            clip_grad_norm_(model, MAX_NORM)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            record["scale"].append(scaler.get_scale())
            record["skipped_steps"].append(scaler.skipped_steps)
            record["state"].append(scaler.state_dict())
    record["reports"] = list(reports)
    record["params"] = {name: t.view(torch.uint8) for name, t in local_bits(model).items()}
    return record


def test_a_resumed_scaler_goes_on_bit_identical_to_an_uninterrupted_one(ranks, tmp_path):
    uninterrupted = ranks.run(WORLD, _train_with_checkpoint, None)
    resumed = ranks.run(WORLD, _train_with_checkpoint, str(tmp_path / "scaler"))
    for rank, (whole, cut) in enumerate(zip(uninterrupted, resumed, strict=True)):
        assert cut["scale"] == whole["scale"], f"rank {rank}"
        assert cut["skipped_steps"] == whole["skipped_steps"] == [0, 1, 2, 2, 2, 3, 4, 4]
        assert cut["state"] == whole["state"], f"rank {rank}"
        assert cut["reports"] == whole["reports"]
        assert all(torch.equal(cut["params"][n], t) for n, t in whole["params"].items())
    # The 1st, 2nd and 4th skipped steps are reported, counting across the checkpoint.
    counted = [message.split("(")[1].split(")")[0] for message in uninterrupted[0]["reports"]]
    assert counted == ["the 1st skipped so far", "the 2nd skipped so far", "the 4th skipped so far"]


def test_a_state_of_the_other_scaling_mode_is_refused():
    """An fp16 state would leave its scale for a fused step to divide unscaled gradients by."""
    fp16 = GradScaler("cpu", init_scale=2.0**15)
    fp16.scale(torch.ones(()))
    bf16 = GradScaler("cpu", scaling=False)
    for source, target in ((fp16, bf16), (bf16, GradScaler("cpu"))):
        with pytest.raises(ValueError) as raised:
            target.load_state_dict(source.state_dict())
        message = str(raised.value)
        assert f"scaling={source.scaling}" in message and f"scaling={target.scaling}" in message
        assert target.get_scale() == (1.0 if not target.scaling else 2.0**16)
    with pytest.raises(ValueError, match="scaling=True"):  # torch's own scaler scales
        bf16.load_state_dict(torch.amp.GradScaler("cpu", init_scale=8.0).state_dict())
    resumed = GradScaler("cpu")
    resumed.load_state_dict(torch.amp.GradScaler("cpu", init_scale=8.0).state_dict())
    assert resumed.get_scale() == 8.0 and resumed.skipped_steps == 0


@pytest.mark.parametrize("scaling", [True, False], ids=["scaling", "skipping"])
def test_a_forgotten_update_is_named_by_the_next_unscale(scaling):
    """A loop that forgets ``update()`` (or unscales twice) is told to call it, where torch's
    message names ``step()`` alone; the gradients are left as they were."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", scaling=scaling)
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match=r"already been called .*Call scaler\.update\(\)"):
        scaler.unscale_(optimizer)  # twice before the step
    scaler.step(optimizer)
    optimizer.zero_grad()  # scaler.update() forgotten
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    before = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"after step\(\).*scaler\.update\(\) was not called"):
        scaler.unscale_(optimizer)
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before, strict=True))
    scaler.update()  # the fix the message names
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    assert scaler.skipped_steps == 0


# --- the skipped-step report names exactly what unscale_ saw ------------------------------------


class _Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(IN_DIM, 8)
        self.second = nn.Linear(8, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.second(torch.tanh(self.first(x)))


def _report_case(case: str) -> list[str]:
    """One step with a NaN planted on rank 2 after backward; the reports rank 0 logged."""
    torch.manual_seed(0)
    if case == "ddp":
        model: nn.Module = DistributedDataParallel(_Small())
        layout = Layout(model, dist.get_rank(), WORLD)
        names = model.module
    else:
        layout = build("tp" if case == "tp logging norm" else "fsdp")
        model, names = layout.model, layout.model
    # torch's foreach AdamW refuses plain tensors beside DTensors (the tp layout).
    foreach = case != "tp logging norm"
    if case == "param_names":  # no model for the scaler: the optimizer's own names
        optimizer = torch.optim.AdamW(model.named_parameters(), lr=1e-2, foreach=foreach)
        scaler = GradScaler("cpu", init_scale=INIT_SCALE)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=foreach)
        scaler = GradScaler("cpu", init_scale=INIT_SCALE, model=names)
    scaler.scale(model(batch(layout, 0)).pow(2).mean()).backward()
    target = {"ddp": "first.bias", "tp logging norm": "blocks.0.q.weight"}.get(case, "embed.weight")
    if dist.get_rank() == 2:
        local_tensor(dict(names.named_parameters())[target].grad).view(-1)[1] = NAN
    with scaler_warnings() as reports:
        scaler.unscale_(optimizer)
        if case == "tp logging norm":
            dtensors = [p.grad for p in model.parameters() if isinstance(p.grad, DTensor)]
            total_grad_norm(dtensors)
        if case != "no clip":
            clip_grad_norm_(model.parameters(), MAX_NORM)
        scaler.step(optimizer)
        scaler.update()
    return [*reports, target]


@pytest.mark.parametrize("case", ["ddp", "tp logging norm", "no clip", "param_names"])
def test_the_report_names_exactly_the_planted_gradient(ranks, case):
    """DDP's replicas, a logging norm over the DTensor gradients before the clip, no norm at all,
    an optimizer built from ``named_parameters()`` and no model given to the scaler: one (rank,
    parameter) pair each, though the clip has made every gradient NaN since."""
    results = ranks.run(WORLD, _report_case, case)
    *reports, target = results[0]
    assert reports == [
        f"GradScaler skipped a step (the 1st skipped so far): non-finite gradients in rank 2: "
        f"{target}"
    ]
    assert all(result == [target] for result in results[1:]), "only rank 0 logs"


# --- pipeline stages: a norm that covers the flags on one stage only ----------------------------


def _pipeline_partial_norm() -> dict:
    """Stage 0 norms all its gradients for logging, stage 1 its blocks only; no clip. A NaN in
    stage 1's embedding: the norm cannot answer stage 1's flag, so no rank takes its answer from
    it, and step's all_reduce decides alike everywhere (a rank answered alone would leave the
    others waiting in that all_reduce)."""
    layout = build("pp_equal")
    model = layout.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    scaler = GradScaler("cpu", init_scale=INIT_SCALE)
    params = list(model.parameters()) if layout.stage == 0 else list(model.blocks.parameters())
    record: dict[str, list] = {"skipped": [], "counts": [], "norm_as_without": []}
    for step in range(3):
        scaler.scale(model(batch(layout, step)).pow(2).mean()).backward()
        if step == 1 and dist.get_rank() == 2:
            local_tensor(model.embed.weight.grad).view(-1)[0] = NAN
        # Dividing by a power of two is what unscale_ does, exactly.
        scale = scaler.get_scale()
        unscaled = [p.grad / scale for p in params]
        with CommDebugMode() as comm:
            scaler.unscale_(optimizer)
            norm = total_grad_norm([p.grad for p in params], **layout.clip_kwargs)
            scaler.step(optimizer)
            scaler.update()
        reference = total_grad_norm(unscaled, **layout.clip_kwargs)  # no scaler any more
        record["norm_as_without"].append(_same(norm, reference))
        record["skipped"].append(scaler.last_step_skipped)
        record["counts"].append(comm.get_total_counts())
        optimizer.zero_grad()
    return record


def test_a_norm_covering_one_stage_leaves_every_flag_to_step(ranks):
    for record in ranks.run(WORLD, _pipeline_partial_norm):
        assert record["skipped"] == [False, True, False]
        assert all(record["norm_as_without"])
        # The norm, the flag's all_reduce (every rank: no stage answered alone), and the report.
        assert record["counts"][1:] == [1 + 1 + 1, 1 + 1]


# --- models of their own ------------------------------------------------------------------------


def _sweep(how: str) -> dict:
    """Each rank trains a model of its own width: per_rank, checked, issues nothing."""
    torch.manual_seed(dist.get_rank())
    model = nn.Sequential(
        nn.Linear(6, 4 + dist.get_rank()), nn.Tanh(), nn.Linear(4 + dist.get_rank(), 1)
    )
    model(torch.randn(5, 6)).pow(2).sum().backward()
    grads = [p.grad for p in model.parameters()]
    torch_norm = torch.nn.utils.get_total_norm(grads)
    before = os.environ.get("CREDIT_PARALLEL_CHECK")
    kwargs: dict[str, Any] = {"check": True} if how == "check=True" else {}
    if how == "environment":
        os.environ["CREDIT_PARALLEL_CHECK"] = "1"
    try:
        with CommDebugMode() as comm:
            ours = total_grad_norm(grads, per_rank=True, **kwargs)
            clipped = clip_grad_norm_(model.parameters(), 0.1, per_rank=True, **kwargs)
            if dist.get_rank() == 0:  # one more call on one rank only: nothing waits for it
                total_grad_norm(grads, per_rank=True, **kwargs)
    finally:
        if before is None:
            os.environ.pop("CREDIT_PARALLEL_CHECK", None)
        else:
            os.environ["CREDIT_PARALLEL_CHECK"] = before
    alive = torch.ones(())
    dist.all_reduce(alive)
    return {
        "torch_bits": _same(ours, torch_norm) and _same(clipped, torch_norm),
        "collectives": comm.get_total_counts(),
        "alive": alive.item(),
    }


@pytest.mark.parametrize("how", ["check=True", "environment"])
def test_per_rank_compares_nothing_in_check_mode(ranks, how):
    for result in ranks.run(WORLD, _sweep, how):
        assert result == {"torch_bits": True, "collectives": 0, "alive": WORLD}


# --- scaling=False where the device is not there ------------------------------------------------


def _skip_on_cpu(kind: str, scaling: bool) -> dict:
    """GradScaler("cuda") with the loss and the gradients on the CPU (on a machine without CUDA,
    torch's scaler disables itself, and a NaN step makes the weights NaN): the scale and the
    flags follow the tensors."""
    layout = build("fsdp_tp")
    model = layout.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, **{kind: True})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        scaler = GradScaler("cuda", scaling=scaling)
    warned = [str(w.message) for w in seen if "CUDA is not available" in str(w.message)]
    kept = []
    for step in range(4):
        scaler.scale(model(batch(layout, step)).pow(2).mean()).backward()
        if step == 2:
            plant_value(model, Plant(2, 3, "tp", NAN))
        before = local_bits(model)
        scaler.unscale_(optimizer)
        clip_grad_norm_(model.parameters(), MAX_NORM)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        after = local_bits(model)
        kept.append(all(torch.equal(before[n], after[n]) for n in before))
    finite = all(bool(torch.isfinite(t).all()) for t in local_bits(model).values())
    scale = scaler.get_scale()
    return {
        "kept": kept,
        "skipped_steps": scaler.skipped_steps,
        "finite": finite,
        "scale": scale,
        "warned": len(warned),
    }


@pytest.mark.parametrize("scaling", [False, True], ids=["skipping", "scaling"])
@pytest.mark.parametrize("kind", ["foreach", "fused"])
def test_a_cuda_scaler_follows_the_gradients_device(ranks, kind, scaling):
    """With or without scaling: the planted step is skipped on every rank, the weights stay
    finite, and a scaling scaler backs off once from torch's initial scale; without CUDA, a
    scaling one warns once on every rank that it follows the tensors."""
    scale = 2.0**15 if scaling else 1.0
    warned = int(scaling and not torch.cuda.is_available())
    for result in ranks.run(WORLD, _skip_on_cpu, kind, scaling):
        assert result == {
            "kept": [False, False, True, False],
            "skipped_steps": 1,
            "finite": True,
            "scale": scale,
            "warned": warned,
        }


# --- a tensor max_norm that is NaN or negative ---------------------------------------------------


def _bad_tensor_max_norm(value: float, with_scaler: bool) -> dict:
    layout = build("fsdp_tp")
    model = layout.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    scaler = GradScaler("cpu", init_scale=INIT_SCALE) if with_scaler else None
    loss = model(batch(layout, 0)).pow(2).mean()
    (scaler.scale(loss) if scaler is not None else loss).backward()
    if scaler is not None:
        scaler.unscale_(optimizer)
    grads = [local_tensor(p.grad).clone() for p in model.parameters()]
    before = local_bits(model)
    norm = clip_grad_norm_(model.parameters(), torch.tensor(value))
    after_clip = [local_tensor(p.grad) for p in model.parameters()]
    result = {
        "all_nan": all(bool(g.isnan().all()) for g in after_clip if g.numel()),
        "flipped": any(bool((g * c < 0).any()) for g, c in zip(grads, after_clip, strict=True)),
        "norm_finite": bool(torch.isfinite(norm)),
        "same_norm": same_bits_everywhere(norm),
    }
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
        after = local_bits(model)
        result["skipped"] = scaler.last_step_skipped
        result["kept"] = all(torch.equal(before[n], after[n]) for n in before)
    return result


@pytest.mark.parametrize("value", [NAN, -1.0], ids=["nan", "negative"])
@pytest.mark.parametrize("with_scaler", [True, False], ids=["scaler", "no scaler"])
def test_a_bad_tensor_max_norm_makes_every_gradient_nan(ranks, value, with_scaler):
    """No raise and no host sync: the clip returns the norm, makes every gradient NaN on every
    rank (never flipped), and a scaler skips the step."""
    for result in ranks.run(WORLD, _bad_tensor_max_norm, value, with_scaler):
        expected = {"all_nan": True, "flipped": False, "norm_finite": True, "same_norm": True}
        if with_scaler:
            expected |= {"skipped": True, "kept": True}
        assert result == expected
