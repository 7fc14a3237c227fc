"""verify_replicas in the corners a trainer reaches, at 4 real gloo ranks.

- Differences on several copies of one group that cancel in a sum (+1 and -1 ULP on two ranks,
  +2 / -1 / -1 on three; a parameter, its exp_avg, a Replicate DTensor), and on two groups at
  once: detected on every rank with the same message naming every rank.
- No arbiter: two copies that differ, or two against two, are named without a culprit, a repair is
  refused with nothing modified, and ``repair_from`` names the source; a strict majority repairs
  without being named, and outvotes ``repair_from``.
- Optimizer state created lazily: rank-local state on some ranks only passes in one collective;
  a copy of state that some members of its group lack is a mismatch, created by the repair (a
  DTensor for a DTensor parameter) or refused where no strict majority holds it.
- Every dtype torch has, a meta or quantized tensor on one rank, a rank-local buffer declared with
  ``distinct_along``, a Partial DTensor beside a Replicate one.

Oracles: the planted bits (each rank's local bytes before and after), torch's own AdamW stepping
on the repaired state, every rank's message compared with rank 0's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from credit.parallel._common.compat import local_tensor
from credit.parallel.replicas import ReplicaMismatchError, ReplicaReport, verify_replicas
from testbed.layouts import mesh

WORLD = 4


def _bytes(tensor: Tensor) -> Tensor:
    """A copy of the local raw bytes of ``tensor``."""
    flat = local_tensor(tensor).detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    return flat.view(torch.uint8).clone()


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[Tensor]:
    tensors = [*model.parameters(), *model.buffers()]
    if optimizer is not None:
        for group in optimizer.param_groups:
            for param in group["params"]:
                state = optimizer.state.get(param, {})
                tensors += [state[key] for key in sorted(state, key=str)]
    return [_bytes(t) for t in tensors]


def _same(a: list[Tensor], b: list[Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _attempt(call: Callable[[], ReplicaReport]) -> dict[str, Any]:
    """The outcome of one call: the report's repairs, or the error's message and mismatches."""
    try:
        report = call()
    except ReplicaMismatchError as error:
        return {"raised": str(error), "mismatches": _named(error.mismatches)}
    return {"raised": None, "repaired": _named(report.repaired)}


def _named(mismatches: Any) -> list[tuple[Any, ...]]:
    return [(m.name, m.reference, m.ranks, m.decided_by, m.copies, m.missing) for m in mismatches]


@torch.no_grad()
def _add_to_bits(tensor: Tensor, deltas: dict[int, int], index: int = 0) -> None:
    """Add ``deltas[rank]`` to the int32 view of element ``index`` of this rank's copy (ULPs of a
    float32)."""
    delta = deltas.get(dist.get_rank(), 0)
    if delta:
        local_tensor(tensor).view(-1).view(torch.int32)[index] += delta


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(4, 4)


def _adamw_stepped(model: nn.Module, lr: float = 1e-2) -> torch.optim.AdamW:
    """AdamW after one step on gradients the same on every rank."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
    model(torch.randn(3, 4, generator=torch.Generator().manual_seed(1))).pow(2).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return optimizer


def _scenario(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    plant: Callable[[], None],
    repair_from: Any = None,
    **every: Any,
) -> dict[str, Any]:
    """Plant, then: the check, a repair without a source named, a repair from ``repair_from``
    (if given), a last check, each call with the keywords ``every``; whether the failed calls
    (the check, a refused repair) left every bit alone, and whether the bits are back to those
    before the plant."""

    def verify(**more: Any) -> ReplicaReport:
        return verify_replicas(model, optimizer, **every, **more)

    before = _snapshot(model, optimizer)
    plant()
    planted = _snapshot(model, optimizer)
    record: dict[str, Any] = {"check": _attempt(verify)}
    record["unchanged"] = _same(planted, _snapshot(model, optimizer))
    record["plain repair"] = _attempt(lambda: verify(repair=True))
    if record["plain repair"]["raised"] is not None:  # refused
        record["unchanged"] &= _same(planted, _snapshot(model, optimizer))
    if repair_from is not None:
        record["named repair"] = _attempt(lambda: verify(repair=True, repair_from=repair_from))
    record["restored"] = _same(before, _snapshot(model, optimizer))
    record["after"] = _attempt(verify)
    return record


# --- copies that cancel -------------------------------------------------------------------------


def _cancelling() -> dict[str, dict[str, Any]]:
    records = {}
    model = _linear()
    records["weight +1 -1"] = _scenario(
        model, None, lambda: _add_to_bits(model.weight, {1: 1, 2: -1}), repair_from=0
    )
    model = _linear()
    records["weight +2 -1 -1"] = _scenario(
        model, None, lambda: _add_to_bits(model.weight, {1: 2, 2: -1, 3: -1}), repair_from=0
    )
    model = _linear()
    optimizer = _adamw_stepped(model)
    exp_avg = optimizer.state[model.weight]["exp_avg"]
    records["exp_avg +1 -1"] = _scenario(
        model, optimizer, lambda: _add_to_bits(exp_avg, {1: 1, 2: -1}), repair_from=0
    )
    world = mesh((WORLD,), ("world",))
    torch.manual_seed(0)
    replicated = nn.Module()
    replicated.weight = nn.Parameter(distribute_tensor(torch.randn(4, 4), world, [Replicate()]))
    records["Replicate DTensor +1 -1"] = _scenario(
        replicated, None, lambda: _add_to_bits(replicated.weight, {1: 1, 2: -1}), repair_from=0
    )

    def two_groups() -> None:
        _add_to_bits(model.weight, {1: 1})
        _add_to_bits(model.bias, {2: -1})

    model = _linear()
    records["two groups +1 -1"] = _scenario(model, None, two_groups)
    return records


def test_differences_that_cancel_in_a_sum_are_named_with_every_rank(ranks):
    results = ranks.run(WORLD, _cancelling)
    everyone = (0, 1, 2, 3)
    # The ranks holding each copy (the most widely held first), and those unlike rank 0.
    copies = {
        "weight +1 -1": (((0, 3), (1,), (2,)), (1, 2)),
        "weight +2 -1 -1": (((2, 3), (0,), (1,)), (1, 2, 3)),
        "exp_avg +1 -1": (((0, 3), (1,), (2,)), (1, 2)),
        "Replicate DTensor +1 -1": (((0, 3), (1,), (2,)), (1, 2)),
    }
    names = {"exp_avg +1 -1": "exp_avg of weight"}
    for rank, records in enumerate(results):
        for case, (held, wrong) in copies.items():
            record, label = records[case], f"{case}, rank {rank}"
            name = names.get(case, "weight")
            # No strict majority (2 of 4 at most): every rank named, none blamed.
            assert record["check"]["mismatches"] == [(name, None, everyone, None, held, ())], label
            assert record["check"]["raised"] == results[0][case]["check"]["raised"], label
            listed = " / ".join(
                f"rank {r[0]}" if len(r) == 1 else f"ranks {', '.join(map(str, r))}" for r in held
            )
            expected = f"{name} (3 different copies: {listed}; no strict majority)"
            assert expected in record["check"]["raised"], label
            assert record["plain repair"]["raised"].startswith("verify_replicas: cannot repair")
            assert record["unchanged"], f"{label}: a failed call modified something"
            repaired = [(name, 0, wrong, "repair_from", held, ())]
            assert record["named repair"]["repaired"] == repaired, label
            assert record["restored"] and record["after"]["repaired"] == [], label
        # Two groups, each with one differing copy: a strict majority repairs both.
        record = records["two groups +1 -1"]
        assert record["check"]["mismatches"] == [
            ("weight", 0, (1,), "majority", ((0, 2, 3), (1,)), ()),
            ("bias", 0, (2,), "majority", ((0, 1, 3), (2,)), ()),
        ], f"rank {rank}"
        assert record["plain repair"]["repaired"] == record["check"]["mismatches"]
        assert record["restored"] and record["after"]["repaired"] == []


# --- no arbiter -----------------------------------------------------------------------------------


def _pairs() -> nn.Module:
    """A parameter laid out as FSDP2 + TP lays out a norm: sharded over dp, replicated over tp,
    so its copies come in pairs (the tp peers 0, 1 and 2, 3)."""
    dp_tp = mesh((2, 2), ("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Module()
    model.norm = nn.Parameter(distribute_tensor(torch.randn(4, 3), dp_tp, [Shard(0), Replicate()]))
    return model


def _no_arbiter() -> dict[str, dict[str, Any]]:
    records = {}
    # The reference copy (rank 0's) corrupted, its pair's other copy healthy.
    model = _pairs()
    records["reference of a pair"] = _scenario(
        model, None, lambda: _add_to_bits(model.norm, {0: 1}), repair_from=[1]
    )
    # repair_from naming ranks outside the group: still refused, nothing modified.
    model = _pairs()
    records["repair_from outside"] = _scenario(
        model, None, lambda: _add_to_bits(model.norm, {0: 1}), repair_from=[2, 3]
    )
    # Two against two.
    model = _linear()
    records["two against two"] = _scenario(
        model, None, lambda: _add_to_bits(model.weight, {0: 1, 1: 1}), repair_from=[3, 2]
    )
    # A strict majority outvotes repair_from, which only decides where there is none.
    model = _linear()
    records["majority first"] = _scenario(
        model, None, lambda: _add_to_bits(model.weight, {0: 1}), repair_from=[0]
    )
    try:
        verify_replicas(_linear(), repair=True, repair_from=[WORLD])
    except ValueError as error:
        records["out of the world"] = {"raised": str(error)}
    return records


def test_no_culprit_named_and_no_repair_where_nothing_tells_which_copy_is_right(ranks):
    results = ranks.run(WORLD, _no_arbiter)
    for rank, records in enumerate(results):
        for case, record in records.items():
            assert record.get("unchanged", True), f"{case}: rank {rank} modified by a failed call"
            for call in ("check", "plain repair", "named repair", "raised"):
                assert record.get(call) == results[0][case].get(call), f"{case} {call} rank {rank}"
        # Only the planted copy (rank 0's) stays unrepaired where the repair is refused.
        assert records["repair_from outside"]["restored"] == (rank != 0)
    records = results[0]
    record = records["reference of a pair"]
    assert record["check"]["mismatches"] == [("norm", None, (0, 1), None, ((0,), (1,)), ())]
    message = record["check"]["raised"]
    assert "norm (2 different copies: rank 0 / rank 1; no strict majority)" in message
    assert "differs from" not in message
    assert "reload the last checkpoint on every rank, or name the ranks" in message
    refused = record["plain repair"]["raised"]
    assert refused.startswith(
        "verify_replicas: cannot repair 1 of the 1 tensors whose copies differ, as nothing tells "
        "which copy is right: norm (2 different copies: rank 0 / rank 1; no strict majority). "
        "Nothing was modified. Reload the last checkpoint on every rank, or name the ranks"
    )
    assert record["unchanged"]
    assert record["named repair"]["repaired"] == [
        ("norm", 1, (0,), "repair_from", ((0,), (1,)), ())
    ]
    assert record["restored"] and record["after"]["repaired"] == []

    record = records["repair_from outside"]
    assert (
        "repair_from=[2, 3] names no rank of theirs that holds a copy"
        in (record["named repair"]["raised"])
    )

    record = records["two against two"]
    assert record["check"]["mismatches"] == [
        ("weight", None, (0, 1, 2, 3), None, ((0, 1), (2, 3)), ())
    ]
    assert (
        "weight (2 different copies: ranks 0, 1 / ranks 2, 3; no strict majority)"
        in (record["check"]["raised"])
    )
    assert record["unchanged"]
    assert record["named repair"]["repaired"] == [
        ("weight", 3, (0, 1), "repair_from", ((0, 1), (2, 3)), ())
    ]
    assert record["restored"]

    record = records["majority first"]
    majority = [("weight", 1, (0,), "majority", ((1, 2, 3), (0,)), ())]
    assert record["plain repair"]["repaired"] == majority and record["restored"]
    assert (
        "weight (rank 0 differs from rank 1; a strict majority holds rank 1's copy)"
        in (record["check"]["raised"])
    )
    assert records["out of the world"]["raised"] == (
        "verify_replicas: repair_from names ranks [4], not all in a world of 4 ranks (rank 0). "
        "Nothing was modified."
    )


def test_repair_from_is_checked_before_anything_else():
    with pytest.raises(ValueError, match=r"repair_from .* pass it with repair=True"):
        verify_replicas(nn.Linear(2, 2), repair_from=0)
    with pytest.raises(TypeError, match=r"repair_from must be a rank or an iterable of ranks"):
        verify_replicas(nn.Linear(2, 2), repair=True, repair_from="0")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"repair_from must hold ranks \(ints\), got True"):
        verify_replicas(nn.Linear(2, 2), repair=True, repair_from=[True])
    with pytest.raises(ValueError, match=r"repair_from holds -1, which is no rank"):
        verify_replicas(nn.Linear(2, 2), repair=True, repair_from=[0, -1])
    with pytest.raises(ValueError, match=r"repair_from names no rank"):
        verify_replicas(nn.Linear(2, 2), repair=True, repair_from=[])
    report = verify_replicas(nn.Linear(2, 2), repair=True, repair_from=(0, 0))
    assert report.repaired == ()


# --- optimizer state created lazily ---------------------------------------------------------------


class _WithExperts(nn.Module):
    """A dense layer beside two experts of this rank's own (rank-local values)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense = nn.Linear(4, 4)
        generator = torch.Generator().manual_seed(100 + dist.get_rank())
        self.experts = nn.ParameterList(
            [nn.Parameter(torch.randn(4, 4, generator=generator)) for _ in range(2)]
        )

    def loss(self, x: Tensor, used: list[int]) -> Tensor:
        """The dense layer's term beside the experts' (so that its gradients are the same on
        every rank)."""
        experts = sum(((x @ self.experts[i]).pow(2).sum() for i in used), torch.zeros(()))
        return self.dense(x).pow(2).sum() + experts


def _idle_expert() -> dict[str, Any]:
    """Experts rank-local (declared along the world); expert 1 idle on rank 1: no grad, no
    state there."""
    model = _WithExperts()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    used = [0] if dist.get_rank() == 1 else [0, 1]
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    model.loss(x, used).backward()
    optimizer.step()
    distinct = [(list(model.experts), dist.group.WORLD)]
    counts = []
    for _ in range(2):
        with CommDebugMode() as comm:
            report = verify_replicas(model, optimizer, distinct_along=distinct)
        counts.append(comm.get_total_counts())
    return {
        "idle has state": bool(optimizer.state[model.experts[1]]),
        "counts": counts,
        "compared": report.compared,
        "tensors": report.tensors,
    }


def test_rank_local_state_on_some_ranks_only_passes_in_one_collective(ranks):
    results = ranks.run(WORLD, _idle_expert)
    assert [r["idle has state"] for r in results] == [True, False, True, True]
    for rank, result in enumerate(results):
        assert result["counts"] == [1, 1], f"rank {rank}"
        # dense.weight, dense.bias and their three states each have copies; experts do not.
        assert result["compared"] == 8
        assert result["tensors"] == (13 if rank == 1 else 16)


def _state_on_some_ranks() -> dict[str, Any]:
    records: dict[str, Any] = {}
    # Before any step: no state anywhere passes.
    model = _linear()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, foreach=False)
    records["no state"] = _attempt(lambda: verify_replicas(model, optimizer))

    def step_but_on_rank_1() -> None:  # lr 0: the parameters keep their bits
        if dist.get_rank() != 1:
            model(torch.ones(2, 4)).pow(2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()

    records["plain"] = _scenario(model, optimizer, step_but_on_rank_1)
    everyone: list[Any] = [None] * WORLD
    dist.all_gather_object(everyone, _snapshot(model, optimizer))
    records["state alike"] = all(_same(theirs, everyone[0]) for theirs in everyone)
    records["step on"] = str(optimizer.state[model.weight]["step"].device)
    # torch's AdamW goes on from the created state: every rank steps alike.
    optimizer.param_groups[0]["lr"] = 1e-2
    model(torch.ones(2, 4)).pow(2).sum().backward()
    optimizer.step()
    dist.all_gather_object(everyone, _snapshot(model, None))
    records["stepped alike"] = all(_same(theirs, everyone[0]) for theirs in everyone)

    # A Replicate DTensor's state: created as a DTensor like the parameter.
    world = mesh((WORLD,), ("world",))
    torch.manual_seed(0)
    replicated = nn.Module()
    replicated.weight = nn.Parameter(distribute_tensor(torch.randn(4, 4), world, [Replicate()]))
    optimizer = torch.optim.AdamW(replicated.parameters(), lr=0.0, foreach=False)

    def dtensor_step_but_on_rank_1() -> None:
        if dist.get_rank() != 1:
            replicated.weight.grad = replicated.weight.detach() * 2
            optimizer.step()

    records["dtensor"] = _scenario(replicated, optimizer, dtensor_step_but_on_rank_1)
    created = optimizer.state[replicated.weight]["exp_avg"]
    records["dtensor state"] = (type(created).__name__, getattr(created, "placements", None))

    # Copies in pairs (plain tensors declared distinct along pairs {0, 1}, {2, 3}: ranks 0 and
    # 2 hold copies, 1 and 3 others): a missing copy has no strict majority.
    pairs = mesh((2, 2), ("copies", "pair")).get_group("pair")
    torch.manual_seed(sorted(dist.get_process_group_ranks(pairs)).index(dist.get_rank()))
    model = nn.Linear(2, 2, bias=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, foreach=False)

    def step_but_on_rank_2() -> None:
        if dist.get_rank() != 2:
            model(torch.ones(1, 2)).sum().backward()
            optimizer.step()

    records["pairs"] = _scenario(
        model,
        optimizer,
        step_but_on_rank_2,
        distinct_along=[([model.weight], pairs)],
        repair_from=0,
    )
    return records


def test_state_missing_on_some_copies_is_a_mismatch_and_created_by_the_repair(ranks):
    results = ranks.run(WORLD, _state_on_some_ranks)
    for rank, records in enumerate(results):
        assert records["no state"] == {"raised": None, "repaired": []}, f"rank {rank}"
        record = records["plain"]
        names = [f"{k} of {p}" for p in ("weight", "bias") for k in ("exp_avg", "exp_avg_sq")]
        names = [*names[:2], "step of weight", *names[2:], "step of bias"]
        majority = [(name, 0, (1,), "majority", ((0, 2, 3),), (1,)) for name in names]
        assert record["check"]["mismatches"] == majority, f"rank {rank}"
        assert record["check"]["raised"] == results[0]["plain"]["check"]["raised"]
        assert (
            "exp_avg of weight (on ranks 0, 2, 3, missing on rank 1; a strict majority holds "
            "rank 0's copy)"
        ) in record["check"]["raised"]
        assert "different bits, or no copy at all," in record["check"]["raised"]
        assert record["unchanged"], f"rank {rank}"
        assert record["plain repair"]["repaired"] == majority
        assert record["after"] == {"raised": None, "repaired": []}
        assert records["state alike"] and records["step on"] == "cpu"
        assert records["stepped alike"], "AdamW did not go on alike from the created state"

        record = records["dtensor"]
        names = ["exp_avg of weight", "exp_avg_sq of weight", "step of weight"]
        majority = [(name, 0, (1,), "majority", ((0, 2, 3),), (1,)) for name in names]
        assert record["plain repair"]["repaired"] == majority, f"rank {rank}"
        assert records["dtensor state"] == ("DTensor", (Replicate(),))
        assert record["after"] == {"raised": None, "repaired": []}

        record = records["pairs"]
        refused = [(name, None, (0, 2), None, ((0,),), (2,)) for name in names]
        assert record["check"]["mismatches"] == refused, f"rank {rank}"
        assert (
            "exp_avg of weight (on rank 0, missing on rank 2; no strict majority)"
            in record["check"]["raised"]
        )
        assert record["plain repair"]["raised"].startswith("verify_replicas: cannot repair 3 of")
        assert record["unchanged"]
        created = [(name, 0, (2,), "repair_from", ((0,),), (2,)) for name in names]
        assert record["named repair"]["repaired"] == created
        assert record["after"] == {"raised": None, "repaired": []}


# --- every dtype; tensors that cannot be read ---------------------------------------------------

# Every dtype torch has but the quantized ones (their scale and zero point are no bits of theirs:
# refused, below).
DTYPES = sorted(
    {
        dtype
        for dtype in vars(torch).values()
        if isinstance(dtype, torch.dtype) and not str(dtype).startswith("torch.q")
    },
    key=str,
)


class _EveryDtype(nn.Module):
    """A parameter of each floating and complex dtype, a buffer of every other; the same bits on
    every rank."""

    def __init__(self, dtypes: list[torch.dtype]) -> None:
        super().__init__()
        pattern = torch.arange(48, dtype=torch.int64).mul(37).remainder(251).to(torch.uint8)
        for dtype in dtypes:
            size = torch.empty(0, dtype=dtype).element_size()
            value = pattern[: 3 * size].clone().view(dtype)
            name = _dtype_name(dtype)
            if dtype.is_floating_point or dtype.is_complex:
                self.register_parameter(name, nn.Parameter(value, requires_grad=False))
            else:
                self.register_buffer(name, value)


def _dtype_name(dtype: torch.dtype) -> str:
    return "of_" + str(dtype).removeprefix("torch.")  # nn.Module has a method .bfloat16()


def _every_dtype(dtypes: list[torch.dtype]) -> dict[str, Any]:
    model = _EveryDtype(dtypes)

    @torch.no_grad()
    def plant() -> None:
        if dist.get_rank() == 3:
            for tensor in [*model.parameters(), *model.buffers()]:
                flat = tensor.view(-1)
                if flat.is_complex():
                    flat = torch.view_as_real(flat).reshape(-1)
                flat.view(torch.uint8)[0] ^= 1

    try:
        clean = _attempt(lambda: verify_replicas(model))
    except RuntimeError as error:  # told apart from a mismatch, without restarting the ranks
        return {"clean": {"raised": f"{type(error).__name__}: {error}"}}
    return {"clean": clean, **_scenario(model, None, plant)}


def test_every_dtype_is_compared_and_repaired(ranks):
    results = ranks.run(WORLD, _every_dtype, DTYPES)
    names = [_dtype_name(d) for d in DTYPES]
    floating = [
        n for n, d in zip(names, DTYPES, strict=True) if d.is_floating_point or d.is_complex
    ]
    order = floating + [n for n in names if n not in floating]
    for rank, record in enumerate(results):
        assert record["clean"] == {"raised": None, "repaired": []}, f"rank {rank}"
        found = record["check"]["mismatches"]
        assert found == [(n, 0, (3,), "majority", ((0, 1, 2), (3,)), ()) for n in order]
        assert record["plain repair"]["repaired"] == found
        assert record["restored"], f"rank {rank}: not back to the bits before the plant"
        assert record["after"] == {"raised": None, "repaired": []}


def _unreadable() -> dict[str, str]:
    results = {}
    model = _linear()
    if dist.get_rank() == 1:
        model.weight = nn.Parameter(torch.empty(4, 4, device="meta"))
    try:
        verify_replicas(model)
    except ValueError as error:
        results["meta"] = str(error)
    model = _linear()
    if dist.get_rank() == 2:
        model.register_buffer("q", torch.quantize_per_tensor(torch.ones(3), 0.5, 0, torch.qint8))
    else:
        model.register_buffer("q", torch.ones(3))
    try:
        verify_replicas(model)
    except ValueError as error:
        results["quantized"] = str(error)
    return results


def test_a_tensor_without_data_on_one_rank_raises_the_same_error_on_every_rank(ranks):
    results = ranks.run(WORLD, _unreadable)
    assert all(result == results[0] for result in results)
    assert results[0] == {
        "meta": "verify_replicas: weight is on the meta device; only dense tensors with data "
        "are compared (rank 1). Nothing was modified.",
        "quantized": "verify_replicas: q is quantized (torch.qint8); only dense tensors with "
        "data are compared (rank 2). Nothing was modified.",
    }


# --- buffers: rank-local by design, Partial ---------------------------------------------------------


def _bands() -> dict[str, Any]:
    """A per-band latitude weight under domain parallelism: each domain rank holds its band's,
    its dp peers the same band's."""
    dp_domain = mesh((2, 2), ("dp", "domain"))
    model = _linear()
    band = dp_domain["domain"].get_local_rank()
    model.register_buffer("latitude_weight", torch.linspace(0.5, 1.0, 3) + band)
    undeclared = _attempt(lambda: verify_replicas(model))
    domain = dp_domain.get_group("domain")
    declared = _attempt(
        lambda: verify_replicas(model, distinct_along=[([model.latitude_weight], domain)])
    )
    return {"undeclared": undeclared, "declared": declared}


def test_a_rank_local_buffer_is_named_with_its_declaration(ranks):
    results = ranks.run(WORLD, _bands)
    for result in results:
        assert result["declared"] == {"raised": None, "repaired": []}
        assert result["undeclared"]["mismatches"] == [
            ("latitude_weight", None, (0, 1, 2, 3), None, ((0, 2), (1, 3)), ())
        ]
        message = result["undeclared"]["raised"]
        assert "declare it: distinct_along=[(buffers, group)]" in message
        assert "pass buffers=False" in message


def _partial() -> dict[str, Any]:
    """torchtitan's MoE token counts: a buffer placed Partial on tp (each rank's own counts, the
    addends of a pending sum), beside a Replicate buffer."""
    tp = mesh((2, 2), ("dp", "tp"))["tp"]
    model = _linear()
    counts = torch.tensor([dist.get_rank(), 10.0 * dist.get_rank()])
    model.register_buffer("tokens_per_expert", DTensor.from_local(counts, tp, [Partial()]))
    model.register_buffer("scale", DTensor.from_local(torch.ones(3), tp, [Replicate()]))
    records = {"clean": _attempt(lambda: verify_replicas(model))}
    records.update(_scenario(model, None, lambda: _add_to_bits(model.scale, {3: 1})))
    return records


def test_a_partial_dtensor_is_no_copy_and_a_replicate_one_beside_it_is(ranks):
    for record in ranks.run(WORLD, _partial):
        assert record["clean"] == {"raised": None, "repaired": []}
        expected = [("scale", 0, (3,), "majority", ((0, 1, 2), (3,)), ())]
        assert record["check"]["mismatches"] == expected
        assert "tokens_per_expert" not in record["check"]["raised"]
        assert record["plain repair"]["repaired"] == expected and record["restored"]
