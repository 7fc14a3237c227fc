"""The GradScaler: one decision for the world, on any mix of meshes, with torch's bits where torch is
right.

A matrix of layouts at 4 and 8 real gloo ranks (FSDP2; FSDP2 + TP with a LayerNorm as the model's
first parameter; HSDP; TP beside plain parameters; pipeline stages of equal and unequal shapes
with ``pp_group``; experts held per rank and declared with ``distinct_along``) trains 6 steps with
``growth_interval=2`` and the trainer's sequence (unscale_, clip_grad_norm_, step, update), with an
inf and a NaN planted at chosen steps in one rank's FSDP2 shard, a plain gradient, a TP shard, an
expert, or a copy that another rank holds too. Oracle: the scale history that torch's update rule
gives for the planted steps (skip and back off by 0.5 on each, double after 2 clean steps), the
same on every rank; parameters unchanged on the skipped steps; and after every step every copy of
every parameter holding the same bits on every rank that holds it. Foreach and fused AdamW.
Collectives per step, once the layout is verified: the clip's, that is one all_reduce within each
process group where copies of a shard meet (tp, HSDP's replicas, the ep peers of the dense
shards), then one over the world, which carries the answer; plus the skipped-step report's
all_gather where a foreach step reads the answer on the host.

Against torch: on FSDP2 over the world, where torch's scaler is right, the same scales, skips, norms
and parameter bits as ``torch.amp.GradScaler`` with torch's clip, step for step. On FSDP2 + TP with a
LayerNorm first, torch's scaler is shown diverging (the test fails the day torch fixes it).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from support.amp_layouts import (
    GROWTH_INTERVAL,
    INIT_SCALE,
    MAX_NORM,
    OPTIMIZERS,
    STEPS,
    NormFirstNet,
    Plant,
    batch,
    build,
    copies_agree,
    expected_scales,
    local_bits,
    plant_value,
    scaler_warnings,
)
from torch.distributed.tensor import DTensor

from credit.parallel._common.compat import local_tensor
from credit.parallel.amp import GradScaler
from credit.parallel.collectives import clip_grad_norm_
from testbed.layouts import IN_DIM
from testbed.world_layouts import WireRecorder


def _train(name: str, plants: tuple[Plant, ...], optimizer_kind: str, unscale: bool = True) -> dict:
    layout = build(name)
    model = layout.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, **OPTIMIZERS[optimizer_kind])
    scaler = GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    record: dict[str, list] = {"scale": [], "skipped": [], "collectives": [], "kept": []}
    record["copies"] = []
    for step in range(STEPS):
        scaler.scale(model(batch(layout, step)).pow(2).mean()).backward()
        for plant in plants:
            if plant.step == step:
                plant_value(model, plant)
        before = local_bits(model)
        with WireRecorder() as wire:
            if unscale:
                scaler.unscale_(optimizer)
                clip_grad_norm_(model.parameters(), MAX_NORM, **layout.clip_kwargs)
            scaler.step(optimizer)
            scaler.update()
        after = local_bits(model)
        record["scale"].append(scaler.get_scale())
        record["skipped"].append(scaler.last_step_skipped)
        record["collectives"].append(wire.groups)
        record["kept"].append(all(torch.equal(before[n], after[n]) for n in before))
        record["copies"].append(copies_agree(layout))
        optimizer.zero_grad()
    record["skipped_steps"] = scaler.skipped_steps
    return record


INF, NAN = math.inf, math.nan
# Per layout, the sizes of the process groups where the norm compares copies of shards, one
# all_reduce each before the world's: tp (FSDP2 + TP: the rowwise biases replicated on tp, the dp
# mesh's shards on their tp peers), HSDP's replicate dim, and the ep peers of the experts layout's
# dense dp shards. None elsewhere: no copies (FSDP2 over the world or over each stage), or copies
# that span the world (TP over the world beside plain replicas), compared in the world's.
COPY_GROUPS = {
    "fsdp": [],
    "fsdp_tp": [2],
    "hsdp": [2],
    "tp": [],
    "pp_equal": [],
    "pp_unequal": [],
    "experts": [2],
}
MATRIX: list[tuple[int, str, str, tuple[Plant, ...]]] = [
    (4, "fsdp", "foreach", (Plant(2, 1, "shard", INF), Plant(4, 3, "shard", NAN))),
    (4, "fsdp_tp", "foreach", (Plant(2, 3, "tp", INF), Plant(4, 1, "copy", NAN))),
    (8, "fsdp_tp", "fused", (Plant(1, 5, "tp", NAN), Plant(3, 6, "copy", INF))),
    (4, "hsdp", "fused", (Plant(2, 2, "shard", INF), Plant(3, 1, "copy", NAN))),
    (4, "tp", "loop", (Plant(2, 2, "plain", INF), Plant(4, 3, "tp", NAN))),
    (4, "pp_equal", "foreach", (Plant(2, 3, "shard", NAN), Plant(4, 0, "shard", INF))),
    (8, "pp_unequal", "fused", (Plant(2, 7, "shard", INF), Plant(4, 2, "shard", NAN))),
    (4, "experts", "foreach", (Plant(2, 3, "expert", INF), Plant(4, 1, "copy", NAN))),
    (8, "experts", "fused", (Plant(3, 5, "expert", NAN),)),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "name", "optimizer", "plants"),
    MATRIX,
    ids=[f"{name}-{world}-{optimizer}" for world, name, optimizer, _ in MATRIX],
)
def test_every_rank_takes_the_same_decision(ranks, world, name, optimizer, plants):
    skipped = {plant.step for plant in plants}
    fused = optimizer == "fused"
    records = ranks.run(world, _train, name, plants, optimizer, timeout_s=120)
    expected = expected_scales(skipped)
    for rank, record in enumerate(records):
        label = f"{name} rank {rank}"
        assert record["scale"] == expected, f"{label}: scales {record['scale']}"
        assert record["skipped"] == [step in skipped for step in range(STEPS)], label
        assert record["skipped_steps"] == len(skipped), label
        assert all(record["copies"]), f"{label}: copies differ after steps {record['copies']}"
        for step in range(STEPS):
            assert record["kept"][step] == (step in skipped), f"{label} step {step}"
        # Per step once the layout is verified, by the size of each collective's group: the
        # clip's, within the copies' groups then over the world; a foreach step that skips reads
        # the answer on the host and reports the culprits in one all_gather over the world.
        for step in range(1, STEPS):
            reported = step in skipped and not fused
            groups = [*COPY_GROUPS[name], world] + [world] * reported
            assert record["collectives"][step] == groups, f"{label} step {step}: {record}"


# --- against torch --------------------------------------------------------------------------------


def _against_torch(optimizer_kind: str) -> dict:
    """FSDP2 over the world, where torch's scaler is right: two identical models side by side,
    one with this package's scaler and clip, one with torch's, the same non-finite values."""
    models, optimizers, scalers = [], [], []
    for scaler_type in (GradScaler, torch.amp.GradScaler):
        layout = build("fsdp")
        models.append(layout.model)
        kind = OPTIMIZERS[optimizer_kind]
        optimizers.append(torch.optim.AdamW(layout.model.parameters(), lr=1e-2, **kind))
        scalers.append(scaler_type("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL))
    clips = (clip_grad_norm_, torch.nn.utils.clip_grad_norm_)
    plants = {2: Plant(2, 1, "shard", INF), 4: Plant(4, 0, "shard", NAN)}
    same = {"scale": True, "norm": True, "params": True}
    for step in range(STEPS):
        norms, scales = [], []
        for model, optimizer, scaler, clip in zip(models, optimizers, scalers, clips, strict=True):
            scaler.scale(model(batch(layout, step)).pow(2).mean()).backward()
            if step in plants:
                plant_value(model, plants[step])
            scaler.unscale_(optimizer)
            norm = clip(model.parameters(), MAX_NORM)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
            scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
            optimizer.zero_grad()
        same["scale"] &= scales[0] == scales[1]
        same["norm"] &= torch.equal(norms[0].view(torch.int32), norms[1].view(torch.int32))
        ours, theirs = (local_bits(model) for model in models)
        same["params"] &= all(
            torch.equal(ours[n].view(torch.int32), theirs[n].view(torch.int32)) for n in ours
        )
    return same


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("optimizer", ["foreach", "fused"])
def test_torch_bits_where_torch_is_right(ranks, world, optimizer):
    for rank, same in enumerate(ranks.run(world, _against_torch, optimizer)):
        assert same == {"scale": True, "norm": True, "params": True}, f"rank {rank}: {same}"


def _torch_scaler_on_fsdp_tp() -> dict:
    """torch's own scaler on FSDP2 + TP with a LayerNorm first: an inf in rank 3's TP shard."""
    layout = build("fsdp_tp")
    model = layout.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    scaler.scale(model(batch(layout, 0)).pow(2).mean()).backward()
    plant_value(model, Plant(0, 3, "tp", INF))
    before = local_bits(model)
    scaler.unscale_(optimizer)
    clip_grad_norm_(model.parameters(), MAX_NORM)  # torch's own clip raises on this layout
    scaler.step(optimizer)
    scaler.update()
    after = local_bits(model)
    return {
        "skipped": all(torch.equal(before[n], after[n]) for n in before),
        "scale": scaler.get_scale(),
        "copies_agree": copies_agree(layout),
    }


def test_torch_scaler_diverges_where_this_one_does_not(ranks):
    """Why the class exists. DTensor's handler reduces found_inf over the mesh of the first
    gradient only, the LayerNorm's dp mesh: rank 3 and its dp peer, rank 1, skip and back off,
    while ranks 0 and 2 step. The day torch fixes it, this test fails: revisit the docs then."""
    results = ranks.run(4, _torch_scaler_on_fsdp_tp)
    assert [r["skipped"] for r in results] == [False, True, False, True]
    assert [r["scale"] for r in results] == [INIT_SCALE, INIT_SCALE / 2] * 2
    assert not any(r["copies_agree"] for r in results), "the replicas should have diverged"


# --- the other ways to call it ------------------------------------------------------------------


def _without_unscale(optimizer_kind: str) -> dict:
    """No unscale_ and no clip: step checks, then answers in one all_reduce of its own."""
    return _train("fsdp_tp", (Plant(2, 3, "tp", INF),), optimizer_kind, unscale=False)


@pytest.mark.parametrize("optimizer", ["foreach", "fused"])
def test_step_without_unscale_decides_for_the_world(ranks, optimizer):
    records = ranks.run(4, _without_unscale, optimizer)
    for record in records:
        assert record["skipped"] == [step == 2 for step in range(STEPS)]
        assert record["scale"] == expected_scales({2})
        assert all(record["copies"])
        reported = [step == 2 and optimizer == "foreach" for step in range(STEPS)]
        # No clip, so no copies compared: step's own all_reduce over the world, and the report's.
        assert record["collectives"] == [[4] + [4] * r for r in reported]


def _two_optimizers(value: float) -> dict:
    """The dense parameters and the experts in two optimizers, one clip over all of them;
    ``value`` planted in an expert's gradient at step 3."""
    layout = build("experts")
    model = layout.model
    experts = list(model.experts)
    dense = [p for n, p in model.named_parameters() if not n.startswith("experts")]
    optimizers = [torch.optim.AdamW(params, lr=1e-2, foreach=True) for params in (dense, experts)]
    scaler = GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    skipped, counts, kept = [], [], []
    for step in range(STEPS):
        scaler.scale(model(batch(layout, step)).pow(2).mean()).backward()
        if step == 3:
            plant_value(model, Plant(3, 2, "expert", value))
        before = local_bits(model)
        with WireRecorder() as wire:
            for optimizer in optimizers:
                scaler.unscale_(optimizer)
            clip_grad_norm_(model.parameters(), MAX_NORM, **layout.clip_kwargs)
            for optimizer in optimizers:
                scaler.step(optimizer)
            scaler.update()
        after = local_bits(model)
        # Whether the dense parameters, and the experts, kept their values.
        kept.append(
            tuple(
                all(
                    torch.equal(before[n], after[n]) for n in before if n.startswith("experts") == e
                )
                for e in (False, True)
            )
        )
        skipped.append(scaler.last_step_skipped)
        counts.append(wire.groups)
        for optimizer in optimizers:
            optimizer.zero_grad()
    return {"skipped": skipped, "scale": scaler.get_scale(), "counts": counts, "kept": kept}


def test_a_nan_clip_skips_every_optimizer_it_covers(ranks):
    """A NaN in an expert makes the clip's total NaN, and the clip multiplies every gradient by
    NaN: both optimizers skip, on every rank (torch's scaler would step the dense one, into NaN);
    the skipped step is reported once per optimizer. Collectives per step: the clip's, within
    ep (the dense dp shards' copies) then over the world; and the two reports' all_gathers."""
    clip = [*COPY_GROUPS["experts"], 4]
    for record in ranks.run(4, _two_optimizers, NAN):
        assert record["skipped"] == [step == 3 for step in range(STEPS)]
        assert record["scale"] == expected_scales({3})[-1]
        assert record["kept"][3] == (True, True)
        assert record["counts"][1:] == [clip, clip, [*clip, 4, 4], clip, clip]


def test_each_optimizer_takes_its_own_answer(ranks):
    """An inf in an expert: the clip's total is inf and its coefficient 0, so the dense
    gradients are zeros, finite: the dense optimizer steps, as with torch's scaler, and the
    experts' skips (reported once)."""
    clip = [*COPY_GROUPS["experts"], 4]
    for record in ranks.run(4, _two_optimizers, INF):
        assert record["skipped"] == [step == 3 for step in range(STEPS)]
        assert record["kept"][3] == (False, True)
        assert record["counts"][1:] == [clip, clip, [*clip, 4], clip, clip]


def _skip_mode(optimizer_kind: str) -> dict:
    """scaling=False (bf16, float32): no scale, the same skipped steps everywhere, counted."""
    layout = build("fsdp_tp")
    model = layout.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, **OPTIMIZERS[optimizer_kind])
    scaler = GradScaler("cpu", scaling=False)
    record: dict[str, list] = {"scale": [], "skipped": [], "counts": [], "unscaled": []}
    for step in range(STEPS):
        loss = model(batch(layout, step)).pow(2).mean()
        scaler.scale(loss).backward()  # returns the loss unchanged
        if step in (1, 4):
            plant_value(model, Plant(step, 3 - step % 2, "tp", NAN if step == 1 else INF))
        grads = [local_tensor(p.grad).clone() for p in model.parameters()]
        with WireRecorder() as wire:
            scaler.unscale_(optimizer)
            record["unscaled"].append(
                all(
                    torch.equal(g.view(torch.int32), local_tensor(p.grad).view(torch.int32))
                    for g, p in zip(grads, model.parameters(), strict=True)
                )
            )
            clip_grad_norm_(model.parameters(), MAX_NORM)
            scaler.step(optimizer)
            scaler.update()
        record["scale"].append(scaler.get_scale())
        record["skipped"].append(scaler.last_step_skipped)
        record["counts"].append(wire.groups)
        optimizer.zero_grad()
    record["skipped_steps"] = scaler.skipped_steps
    record["copies"] = copies_agree(layout)
    return record


@pytest.mark.parametrize("optimizer", ["foreach", "fused"])
def test_skip_mode_without_scaling(ranks, optimizer):
    for record in ranks.run(4, _skip_mode, optimizer):
        assert record["scale"] == [1.0] * STEPS
        assert record["skipped"] == [step in (1, 4) for step in range(STEPS)]
        assert record["skipped_steps"] == 2
        assert all(record["unscaled"]), "unscale_ must leave the gradients as they are"
        assert record["copies"]
        reported = [step in (1, 4) and optimizer == "foreach" for step in range(STEPS)]
        # The clip's within tp then over the world; the report's all_gather over the world.
        clip = [*COPY_GROUPS["fsdp_tp"], 4]
        assert record["counts"][1:] == [clip + [4] * r for r in reported[1:]]


def _uncovered() -> dict:
    """The clip covers the blocks only; a NaN in the embedding's gradient must still skip. A twin
    driven by torch's scaler (same weights, data and NaN, so the same unscaled gradients) gives
    the same clip without this package's scaler."""
    clips = {}
    for scaler_type in (GradScaler, torch.amp.GradScaler):
        layout = build("fsdp_tp")
        model = layout.model
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
        scaler = scaler_type("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
        scaler.scale(model(batch(layout, 0)).pow(2).mean()).backward()
        if dist.get_rank() == 2:
            local_tensor(model.embed.weight.grad).view(-1)[0] = math.nan
        scaler.unscale_(optimizer)
        with WireRecorder() as wire:
            norm = clip_grad_norm_(model.blocks.parameters(), MAX_NORM)
            scaler.step(optimizer)
        scaler.update()
        clips[scaler_type.__module__] = (norm, scaler, wire.groups)
    norm, scaler, counts = clips[GradScaler.__module__]
    torch_norm = clips[torch.amp.GradScaler.__module__][0]
    return {
        "skipped": scaler.last_step_skipped,
        "norm_bits": torch.equal(norm.view(torch.int32), torch_norm.view(torch.int32)),
        "finite": bool(torch.isfinite(norm)),
        "counts": counts,
    }


def test_a_flag_the_clip_does_not_cover_still_skips(ranks):
    """The clip returns what it returns without a scaler (finite: the NaN is outside it) and
    leaves the flag to step, whose all_reduce makes every rank skip. Collectives, by the size of
    their group: the clip's on its layout's first call (the proof: the self-check over the world,
    the copies of the rowwise biases within tp, their flags over the world; then the norm: within
    tp, over the world), the flag's one, the report's all_gather."""
    proof, norm = [4, 2, 4], [2, 4]
    for record in ranks.run(4, _uncovered):
        counts = proof + norm + [4, 4]
        assert record == {"skipped": True, "norm_bits": True, "finite": True, "counts": counts}


def _report(steps: int) -> list[str]:
    """Skip every step (a NaN on rank 3); return the warnings rank 0 logged."""
    layout = build("fsdp_tp")
    model = layout.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    scaler = GradScaler("cpu", init_scale=INIT_SCALE, model=model)
    with scaler_warnings() as messages:
        for step in range(steps):
            scaler.scale(model(batch(layout, step)).pow(2).mean()).backward()
            plant_value(model, Plant(step, 3, "tp", NAN))
            scaler.unscale_(optimizer)
            clip_grad_norm_(model.parameters(), MAX_NORM)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    return messages


def test_a_skipped_step_names_the_culprits_on_rank_0(ranks):
    logs = ranks.run(4, _report, 5)
    assert logs[1:] == [[], [], []], "only rank 0 logs"
    # The 1st, 2nd and 4th skipped steps are reported, not the 3rd and 5th.
    assert [message.split("(")[1].split(")")[0] for message in logs[0]] == [
        "the 1st skipped so far",
        "the 2nd skipped so far",
        "the 4th skipped so far",
    ]
    for message in logs[0]:
        assert message.endswith("non-finite gradients in rank 3: blocks.0.q.weight"), message


def test_one_process_behaves_as_torch():
    """Without a process group: torch's scales, skips and parameters, for both optimizers."""
    for kind in ("foreach", "fused"):
        models = [NormFirstNet() for _ in range(2)]
        models[1].load_state_dict(models[0].state_dict())
        optimizers = [
            torch.optim.AdamW(m.parameters(), lr=1e-2, **OPTIMIZERS[kind]) for m in models
        ]
        scalers = [
            scaler_type("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
            for scaler_type in (GradScaler, torch.amp.GradScaler)
        ]
        for step in range(STEPS):
            x = torch.randn(4, IN_DIM, generator=torch.Generator().manual_seed(step))
            for model, optimizer, scaler in zip(models, optimizers, scalers, strict=True):
                scaler.scale(model(x).pow(2).mean()).backward()
                if step == 2:
                    model.head.weight.grad[0, 0] = math.inf
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
            assert scalers[0].get_scale() == scalers[1].get_scale()
        for ours, theirs in zip(models[0].parameters(), models[1].parameters(), strict=True):
            assert torch.equal(ours, theirs)
        assert scalers[0].skipped_steps == 1
