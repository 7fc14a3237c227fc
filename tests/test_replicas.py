"""verify_replicas: every copy of every parameter, buffer and optimizer state proven bit-identical,
on real layouts at 4 gloo ranks, and repaired.

Layouts: DDP, HSDP (replicate x shard), FSDP2 + TP with the LayerNorms replicated over tp, TP x
domain with plain replicas, experts declared with ``distinct_along``, pipeline stages with TP
inside (their LayerNorms replicated over tp). After two
AdamW steps, one rank of one group of copies gets, in turn: the lowest mantissa bit and the
highest exponent bit of a parameter's element flipped, a buffer's bit flipped, an exp_avg's
exponent bit flipped, a step count's bit flipped, two elements of a parameter swapped. Oracles, on
every rank: the same ReplicaMismatchError, naming the tensor and the rank that differs from the
reference; every local byte unchanged by the failed call; with ``repair=True`` the planted tensor
back to its bits before the plant (the reference holds them), and the next call passing; the
collectives counted (one on the good path).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from amp_layouts import Layout, batch, build
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from credit.parallel._compat import local_tensor
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


def _everything(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[Tensor]:
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [v for state in optimizer.state.values() for v in state.values()]
    return [local_tensor(t).detach().clone().reshape(-1).view(torch.uint8) for t in tensors]


def _counted(call: Any) -> tuple[Any, int]:
    with CommDebugMode() as comm:
        result, _ = _uncounted(call)
    return result, comm.get_total_counts()


def _uncounted(call: Any) -> tuple[Any, int | None]:
    try:
        return call(), None
    except ReplicaMismatchError as error:
        return error, None


def _plants_on(name: str) -> dict[str, Any]:
    layout = build(name)
    optimizer = torch.optim.AdamW(layout.model.parameters(), lr=1e-2, foreach=False)
    _train(layout, optimizer, range(2))
    # The buffer is constant: checked even under DDP, which leaves buffers out by default.
    kwargs = {**layout.clip_kwargs, "buffers": True}

    def verify(**more: Any) -> Any:
        return verify_replicas(layout.model, optimizer, **kwargs, **more)

    # Under pipeline stages the first call also learns each stage's lowest rank.
    record: dict[str, Any] = {"first": _counted(verify)[1], "clean": _counted(verify)[1]}
    for kind, (target, tensor) in _targets(layout, optimizer).items():
        # Counting puts every op through Python dispatch: the collectives of the first plant.
        counted = _counted if kind == COUNTED else _uncounted
        before = local_tensor(tensor).detach().clone()
        if dist.get_rank() == PLANTED_RANK:
            _plant(kind, tensor)
        planted = _everything(layout.model, optimizer)
        raised, raise_count = counted(verify)
        unchanged = all(
            torch.equal(a, b)
            for a, b in zip(planted, _everything(layout.model, optimizer), strict=True)
        )
        report, repair_count = counted(lambda: verify(repair=True))
        after, after_count = counted(verify)
        record[kind] = {
            "target": target,
            "message": str(raised) if isinstance(raised, ReplicaMismatchError) else None,
            "mismatches": [(m.name, m.ranks) for m in getattr(raised, "mismatches", ())],
            "unchanged": unchanged,
            "repaired": [(m.name, m.ranks) for m in report.repaired],
            "restored": torch.equal(
                before.reshape(-1).view(torch.uint8),
                local_tensor(tensor).detach().reshape(-1).view(torch.uint8),
            ),
            "passes_after": isinstance(after, type(report)) and not after.repaired,
            "counts": (raise_count, repair_count, after_count),
        }
    return record


@pytest.mark.parametrize("name", LAYOUTS)
def test_every_planted_difference_is_named_and_repaired(ranks, name):
    records = ranks.run(WORLD, _plants_on, name, timeout_s=180)
    for rank, record in enumerate(records):
        assert record["first"] == 1 + (name == "pp_tp"), f"{name} rank {rank}: {record['first']}"
        assert record["clean"] == 1, f"{name} rank {rank}: a clean call costs one collective"
        for kind in ("parameter: lowest mantissa bit", "buffer", "exp_avg", "step"):
            planted = record[kind]
            label = f"{name} {kind} rank {rank}"
            assert planted["message"] is not None, f"{label}: not detected"
            assert planted["message"] == records[0][kind]["message"], f"{label}: another message"
            assert planted["mismatches"] == [(planted["target"], (PLANTED_RANK,))], label
            assert (
                f"{planted['target']} (rank {PLANTED_RANK} differs from rank" in planted["message"]
            )
            assert "Nothing was modified" in planted["message"]
            assert planted["unchanged"], f"{label}: the failed call modified something"
            assert planted["repaired"] == planted["mismatches"], label
            assert planted["restored"], f"{label}: not back to the reference's bits"
            assert planted["passes_after"], label
        # The proof; on failure the records' all_gather_object (two collectives); the repair.
        counts = record[COUNTED]["counts"]
        assert counts == (1 + 2, 1 + 2 + 1, 1), f"{name} rank {rank}: {counts}"
        for kind in ("parameter: highest exponent bit", "two elements swapped"):
            assert record[kind]["mismatches"] == [(record[kind]["target"], (PLANTED_RANK,))]
            assert record[kind]["restored"] and record[kind]["passes_after"]


# --- a corrupted run, repaired, goes on as if nothing happened ----------------------------------


def _corrupted_and_repaired(corrupt: bool) -> list[Tensor]:
    layout = build("fsdp_tp")
    optimizer = torch.optim.AdamW(layout.model.parameters(), lr=1e-2, foreach=True)
    _train(layout, optimizer, range(3))
    if corrupt:
        _, tensor = _targets(layout, optimizer)["exp_avg"]
        if dist.get_rank() == PLANTED_RANK:  # not the reference: rank 2 holds its group's
            _plant("parameter: highest exponent bit", tensor)
        verify_replicas(layout.model, optimizer, repair=True)
    _train(layout, optimizer, range(3, 6))
    return _everything(layout.model, optimizer)


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
        "repaired": [(m.name, m.reference, m.ranks) for m in report.repaired],
        "restored": torch.equal(before, local_tensor(tensor)),
    }


def test_a_majority_outvotes_a_corrupted_reference(ranks):
    for result in ranks.run(WORLD, _reference_corrupted):
        assert result == {
            "repaired": [("exp_avg of module.norm.weight", 1, (0,))],
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
    if wrap == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    model(torch.randn(8, 6, generator=torch.Generator().manual_seed(dist.get_rank()))).sum()
    result: dict[str, Any] = {}
    for buffers in (None, True, False):
        try:
            report = verify_replicas(model, buffers=buffers)
            result[str(buffers)] = ("passed", report.buffers)
        except ReplicaMismatchError as error:
            result[str(buffers)] = ("raised", str(error))
    return result


@pytest.mark.parametrize("wrap", ["ddp", "plain"])
def test_buffers_that_each_rank_updates(ranks, wrap):
    """DDP broadcasts its buffers at every forward, so they differ between forwards: left out
    unless asked for. Elsewhere they are checked, and the message says how to leave them out."""
    for result in ranks.run(WORLD, _batch_norm, wrap):
        assert result["False"] == ("passed", False)
        raised, message = result["True"]
        assert raised == "raised" and "running_mean" in message and "buffers=False" in message
        assert result["None"] == (("passed", False) if wrap == "ddp" else result["True"])


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
