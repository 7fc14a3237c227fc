"""verify_replicas: every copy of every parameter, buffer and optimizer state proven bit-identical,
on real layouts at 4 gloo ranks, and repaired where something tells which copy is right.

Layouts: DDP, HSDP (replicate x shard), FSDP2 + TP with the LayerNorms replicated over tp, TP x
domain with plain replicas, experts declared with ``distinct_along``, pipeline stages with TP
inside (their LayerNorms replicated over tp). After two AdamW steps, one rank of one group of
copies gets, in turn: the lowest mantissa bit and the highest exponent bit of a parameter's
element flipped, a buffer's bit flipped, an exp_avg's exponent bit flipped, a step count's bit
flipped, two elements of a parameter swapped. The planted copy's group is found in the test from
the placements (the ranks of the stage at the same coordinates along the dims that shard it).
Oracles, on every rank: the same ReplicaMismatchError; in a group of 3 or more copies it names the
planted rank against the majority's copy, and ``repair=True`` repairs from it; in a group of 2 it
names both ranks and no culprit, ``repair=True`` is refused, and ``repair_from`` (the healthy
ranks) repairs; every local byte unchanged by each failed call; the planted tensor back to its bits
before the plant, and the next call passing; the collectives counted (one on the good path).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support.amp_layouts import Layout, batch, build
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from credit.parallel._common.compat import local_tensor
from credit.parallel.replicas import ReplicaMismatchError, verify_replicas

WORLD = 4
PLANTED_RANK = WORLD - 1
LAYOUTS = ["ddp", "hsdp", "fsdp_tp", "tp_domain", "experts", "pp_tp"]
COUNTED = "parameter: lowest mantissa bit"  # the plant whose collectives are counted


def _train(layout: Layout, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        layout.model(batch(layout, step)).pow(2).mean().backward()
        if layout.sync is not None:
            layout.sync(layout.model)
        optimizer.step()
        optimizer.zero_grad()


def _has_copies(tensor: Tensor, layout: Layout) -> bool:
    """Whether other ranks of the stage hold the same elements (read from the layout)."""
    if not isinstance(tensor, DTensor):
        return True
    stage_size = WORLD // (2 if "pp_group" in layout.clip_kwargs else 1)
    replicated = any(placement.is_replicate() for placement in tensor.placements)
    return replicated or tensor.device_mesh.size() < stage_size


def _targets(layout: Layout, optimizer: torch.optim.Optimizer) -> dict[str, tuple[str, Tensor]]:
    """What each plant corrupts: a parameter with copies (its first two elements on this rank
    unequal), the buffer, that parameter's exp_avg, and a step count."""
    model = layout.model
    named = list(model.named_parameters())
    name, param = next(
        (n, p)
        for n, p in named
        if _has_copies(p, layout) and local_tensor(p).numel() > 1 and not n.endswith("bias")
    )
    buffer_name, buffer = next(iter(model.named_buffers()))
    state = optimizer.state[param]
    return {
        "parameter: lowest mantissa bit": (name, param),
        "parameter: highest exponent bit": (name, param),
        "two elements swapped": (name, param),
        "buffer": (buffer_name, buffer),
        "exp_avg": (f"exp_avg of {name}", state["exp_avg"]),
        "step": (f"step of {name}", state["step"]),
    }


@torch.no_grad()
def _plant(kind: str, tensor: Tensor) -> None:
    local = local_tensor(tensor).view(-1)
    if kind == "two elements swapped":
        local[[0, 1]] = local[[1, 0]].clone()
        return
    bit = 1 if kind in ("parameter: lowest mantissa bit", "buffer", "step") else 1 << 30
    local.view(torch.int32)[0] ^= bit


def _group_of(tensor: Tensor, layout: Layout) -> list[int]:
    """The ranks holding a copy of this rank's elements of ``tensor``: those of its stage at the
    same coordinates along the mesh dims that shard it (every rank of the stage for a plain
    tensor), read from the placements."""
    coordinates: tuple[int, ...] = ()
    if isinstance(tensor, DTensor):
        coordinate = tensor.device_mesh.get_coordinate() or []
        coordinates = tuple(
            c for c, p in zip(coordinate, tensor.placements, strict=True) if not p.is_replicate()
        )
    everyone: list[Any] = [None] * WORLD
    dist.all_gather_object(everyone, (layout.stage, coordinates))
    return [rank for rank, seen in enumerate(everyone) if seen == (layout.stage, coordinates)]


def _everything(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[Tensor]:
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [v for state in optimizer.state.values() for v in state.values()]
    return [local_tensor(t).detach().clone().reshape(-1).view(torch.uint8) for t in tensors]


def _same(a: list[Tensor], b: list[Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _counted(call: Any) -> tuple[Any, int]:
    with CommDebugMode() as comm:
        result, _ = _uncounted(call)
    return result, comm.get_total_counts()


def _uncounted(call: Any) -> tuple[Any, int | None]:
    try:
        return call(), None
    except ReplicaMismatchError as error:
        return error, None


def _named(mismatches: Any) -> list[tuple[str, int | None, tuple[int, ...], str | None]]:
    return [(m.name, m.reference, m.ranks, m.decided_by) for m in mismatches]


HEALTHY = [rank for rank in range(WORLD) if rank != PLANTED_RANK]


def _plants_on(name: str) -> dict[str, Any]:
    layout = build(name)
    optimizer = torch.optim.AdamW(layout.model.parameters(), lr=1e-2, foreach=False)
    _train(layout, optimizer, range(2))
    # The buffer is constant: checked even under DDP, which leaves buffers out by default.
    kwargs = {**layout.clip_kwargs, "buffers": True}

    def verify(**more: Any) -> Any:
        return verify_replicas(layout.model, optimizer, **kwargs, **more)

    # Under pipeline stages the first call also learns the ranks of its stage.
    record: dict[str, Any] = {"first": _counted(verify)[1], "clean": _counted(verify)[1]}
    for kind, (target, tensor) in _targets(layout, optimizer).items():
        # Counting puts every op through Python dispatch: the collectives of the first plant.
        counted = _counted if kind == COUNTED else _uncounted
        group = _group_of(tensor, layout)  # every rank of it takes part, so all ranks call it
        before = local_tensor(tensor).detach().clone()
        if dist.get_rank() == PLANTED_RANK:
            _plant(kind, tensor)
        planted = _everything(layout.model, optimizer)

        raised, raise_count = counted(verify)
        unchanged_after_raise = _same(planted, _everything(layout.model, optimizer))
        refused, unchanged_after_refusal = None, True
        if len(group) < 3:  # nothing tells which copy is right: refused, then named
            refused, _ = _uncounted(lambda: verify(repair=True))
            unchanged_after_refusal = _same(planted, _everything(layout.model, optimizer))
        sources = None if len(group) >= 3 else HEALTHY
        report, repair_count = counted(functools.partial(verify, repair=True, repair_from=sources))
        after, after_count = counted(verify)
        record[kind] = {
            "target": target,
            "group": group,
            "message": str(raised) if isinstance(raised, ReplicaMismatchError) else None,
            "mismatches": _named(getattr(raised, "mismatches", ())),
            "unchanged": unchanged_after_raise and unchanged_after_refusal,
            "refused": str(refused) if isinstance(refused, ReplicaMismatchError) else None,
            "repaired": _named(getattr(report, "repaired", ())),
            "restored": torch.equal(
                before.reshape(-1).view(torch.uint8),
                local_tensor(tensor).detach().reshape(-1).view(torch.uint8),
            ),
            "passes_after": isinstance(after, type(report)) and not after.repaired,
            "counts": (raise_count, repair_count, after_count),
        }
    return record


def _check_plant(
    planted: dict[str, Any], first: dict[str, Any], group: list[int], label: str
) -> None:
    """A planted difference named, left alone by every failed call, and repaired from the right
    copy (``group``: the planted copy's): the majority's in a group of 3 or more, the one
    repair_from names in a group of 2."""
    target = planted["target"]
    assert PLANTED_RANK in group and len(group) >= 2, f"{label}: group {group}"
    assert planted["message"] is not None, f"{label}: not detected"
    assert planted["message"] == first["message"], f"{label}: another message"
    assert "Nothing was modified" in planted["message"]
    assert planted["unchanged"], f"{label}: a failed call modified something"
    if len(group) >= 3:
        source = min(r for r in group if r != PLANTED_RANK)
        expected = [(target, source, (PLANTED_RANK,), "majority")]
        assert planted["mismatches"] == expected, label
        assert f"{target} (rank {PLANTED_RANK} differs from rank {source}" in planted["message"]
        assert planted["refused"] is None
    else:  # two copies: both named, no culprit; the repair refused, then taken from repair_from
        (peer,) = (r for r in group if r != PLANTED_RANK)
        assert planted["mismatches"] == [(target, None, tuple(group), None)], label
        copies = " / ".join(f"rank {r}" for r in group)
        assert f"{target} (2 different copies: {copies}; no strict majority)" in planted["message"]
        assert "differs from" not in planted["message"], label
        assert planted["refused"] == first["refused"], label
        assert planted["refused"].startswith("verify_replicas: cannot repair 1 of the 1 tensors")
        assert "Reload the last checkpoint on every rank" in planted["refused"]
        expected = [(target, peer, (PLANTED_RANK,), "repair_from")]
    assert planted["repaired"] == expected, label
    assert planted["restored"], f"{label}: not back to the bits before the plant"
    assert planted["passes_after"], label


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_every_planted_difference_is_named_and_repaired(ranks, name):
    records = ranks.run(WORLD, _plants_on, name, timeout_s=180)
    for rank, record in enumerate(records):
        assert record["first"] == 1 + (name == "pp_tp"), f"{name} rank {rank}: {record['first']}"
        assert record["clean"] == 1, f"{name} rank {rank}: a clean call costs one collective"
        for kind in _KINDS:
            group = records[PLANTED_RANK][kind]["group"]
            _check_plant(record[kind], records[0][kind], group, f"{name} {kind} rank {rank}")
        # The proof; on failure the records' all_gather_object (two collectives); the repair.
        counts = record[COUNTED]["counts"]
        assert counts == (1 + 2, 1 + 2 + 1, 1), f"{name} rank {rank}: {counts}"
    # Groups of both kinds are planted across the layouts (a plain buffer: every rank).
    assert len(records[PLANTED_RANK]["buffer"]["group"]) == (2 if name == "pp_tp" else WORLD)


_KINDS = (
    "parameter: lowest mantissa bit",
    "parameter: highest exponent bit",
    "two elements swapped",
    "buffer",
    "exp_avg",
    "step",
)


# --- a corrupted run, repaired, goes on as if nothing happened ----------------------------------


def _corrupted_and_repaired(corrupt: bool) -> list[Tensor]:
    layout = build("fsdp_tp")
    optimizer = torch.optim.AdamW(layout.model.parameters(), lr=1e-2, foreach=True)
    _train(layout, optimizer, range(3))
    if corrupt:
        _, tensor = _targets(layout, optimizer)["exp_avg"]
        if dist.get_rank() == PLANTED_RANK:  # a group of two (its tp peer): named by repair_from
            _plant("parameter: highest exponent bit", tensor)
        verify_replicas(layout.model, optimizer, repair=True, repair_from=HEALTHY)
    _train(layout, optimizer, range(3, 6))
    return _everything(layout.model, optimizer)


@pytest.mark.slow
def test_a_run_repaired_where_it_was_corrupted_goes_on_bit_identical(ranks):
    clean = ranks.run(WORLD, _corrupted_and_repaired, False)
    repaired = ranks.run(WORLD, _corrupted_and_repaired, True)
    for rank, (a, b) in enumerate(zip(clean, repaired, strict=True)):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), f"rank {rank}"


def _reference_corrupted() -> dict[str, Any]:
    """DDP's four copies, the reference's (rank 0's) corrupted: the three others outvote it."""
    layout = build("ddp")
    optimizer = torch.optim.AdamW(layout.model.parameters(), lr=1e-2, foreach=True)
    _train(layout, optimizer, range(2))
    _, tensor = _targets(layout, optimizer)["exp_avg"]
    before = local_tensor(tensor).clone()
    if dist.get_rank() == 0:
        _plant("parameter: highest exponent bit", tensor)
    report = verify_replicas(layout.model, optimizer, repair=True)
    return {
        "repaired": _named(report.repaired),
        "restored": torch.equal(before, local_tensor(tensor)),
    }


def test_a_majority_outvotes_a_corrupted_reference(ranks):
    for result in ranks.run(WORLD, _reference_corrupted):
        assert result == {
            "repaired": [("exp_avg of module.norm.weight", 1, (0,), "majority")],
            "restored": True,
        }


# --- buffers that legitimately differ; layouts that cannot be compared --------------------------


class _WithBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 4)
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(self.linear(x))


def _batch_norm(wrap: str) -> dict[str, Any]:
    """Running statistics that each rank updates from its own batch."""
    torch.manual_seed(0)
    model: nn.Module = _WithBatchNorm()
    if wrap in ("ddp", "compiled ddp"):
        model = nn.parallel.DistributedDataParallel(model)
    if wrap == "compiled ddp":  # the wrapper hides DDP; "eager" compiles nothing
        model = torch.compile(model, backend="eager")
    model(torch.randn(8, 6, generator=torch.Generator().manual_seed(dist.get_rank()))).sum()
    result: dict[str, Any] = {}
    for buffers in (None, True, False):
        try:
            report = verify_replicas(model, buffers=buffers)
            result[str(buffers)] = ("passed", report.buffers)
        except ReplicaMismatchError as error:
            result[str(buffers)] = ("raised", str(error))
    return result


@pytest.mark.slow
@pytest.mark.parametrize("wrap", ["ddp", "compiled ddp", "plain"])
def test_buffers_that_each_rank_updates(ranks, wrap):
    """DDP broadcasts its buffers at every forward, so they differ between forwards: left out
    unless asked for, also where torch.compile wraps the DDP. Elsewhere they are checked, and the
    message says how to leave them out."""
    for result in ranks.run(WORLD, _batch_norm, wrap):
        assert result["False"] == ("passed", False)
        raised, message = result["True"]
        assert raised == "raised" and "running_mean" in message and "buffers=False" in message
        assert result["None"] == (("passed", False) if "ddp" in wrap else result["True"])


def _different_tensors() -> str:
    torch.manual_seed(0)
    model = nn.Linear(4, 3 + (dist.get_rank() == 1))
    try:
        verify_replicas(model)
    except RuntimeError as error:
        return f"{type(error).__name__}: {error}"
    return "passed"


def test_ranks_holding_different_tensors_are_told_apart_from_corruption(ranks):
    messages = ranks.run(WORLD, _different_tensors)
    assert all(message == messages[0] for message in messages)
    assert messages[0].startswith("RuntimeError: verify_replicas: the ranks hold different tensors")
    assert "rank 0 has weight (tensor shape=(3, 4)" in messages[0]
    assert "rank 1 has weight (tensor shape=(4, 4)" in messages[0]


def test_bad_arguments_raise_before_any_collective():
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module"):
        verify_replicas([torch.zeros(2)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"optimizer must be a torch\.optim\.Optimizer"):
        verify_replicas(nn.Linear(2, 2), object())  # type: ignore[arg-type]
    report = verify_replicas(nn.Linear(2, 2))  # no process group: a world of one
    assert (report.tensors, report.compared, report.repaired) == (2, 0, ())
