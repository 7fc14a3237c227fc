"""Copies proven by value: ranks that only look like replicas make the norm raise, never average.

The rank maps say which ranks hold copies of a shard; a rank map cannot see that those ranks hold
different values. Each case below is a layout a new user builds by mistake (on 4 real gloo ranks,
real FSDP2): rank-local experts without ``distinct_along`` (plain, and DTensors on a mesh without
the ep dim), pipeline stages of equal shapes without ``pp_group``, ranks that train independent
models (with and without the check mode), copies with equal norms but different values, and experts
inside pipeline stages. Each asserts that the call raises the same ValueError on every rank, naming
the gradient, the ranks that disagree and the likely fix, that no gradient changed, and that the
corrected call returns the oracle: ``torch.nn.utils.get_total_norm`` on every distinct gradient
materialised (``full_tensor()``, every rank's own values gathered), within 8 float32 ULP as in
test_ownership.py, the same bits on every rank, in one collective over the world once its layout
is verified (after one within ep where the dense shards' copies meet there).
For models of their own (``per_rank=True``) the oracle is torch's norm of the rank's own
gradients, bit for bit, with no collective.

Legitimate copies never raise: the demo's model trained 20 steps under DDP, HSDP, FSDP2 + TP
(after ``sync_replicated_gradients``) and TP + domain parallelism (after ``sync_domain_gradients``),
with the copies compared on every call (the check mode); and after every step ``verify_replicas``
proves every copy of the parameters and AdamW state bit-identical, in one collective.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.nn.parallel import DistributedDataParallel

from credit.parallel.collectives import clip_grad_norm_, total_grad_norm
from credit.parallel.demo._model import (
    ModelConfig,
    TinyWeatherModel,
    band,
    band_loss,
    global_batch,
    latitude_weights,
    parallelize,
)
from credit.parallel.grad_sync import sync_domain_gradients, sync_replicated_gradients
from credit.parallel.norm_report import grad_norm_report
from credit.parallel.replicas import verify_replicas
from testbed.layouts import (
    IN_DIM,
    Block,
    TinyNet,
    full_grads,
    local_bytes,
    mesh,
    run_step,
    same_bits_everywhere,
    ulp_distance,
)
from testbed.world_layouts import WireRecorder

WORLD = 4
TOLERANCE_ULP = 8
EXPERTS, EXPERT_DIM = 2, 4


@dataclass
class Case:
    """A layout with its gradients in place, the mistaken call and the corrected one.

    Attributes:
        model: the module whose parameters carry the gradients.
        oracle: every distinct gradient, materialised (the same list on every rank).
        call: the norm, with the arguments a user passes: ``call(**arguments)``.
        mistaken: the arguments of the call that must raise.
        corrected: the arguments that declare the layout.
        names: what the message must contain.
    """

    model: nn.Module
    oracle: list[Tensor]
    call: Callable[..., Tensor]
    mistaken: dict[str, Any]
    corrected: dict[str, Any]
    names: list[str] = field(default_factory=list)


def _every_rank(values: list[Tensor]) -> list[Tensor]:
    """Every rank's ``values``, in rank order."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [v.detach().clone() for v in values])
    return [value for rank_values in gathered for value in rank_values]


def _with_grad(value: Tensor) -> nn.Parameter:
    param = nn.Parameter(torch.zeros_like(value))
    param.grad = value
    return param


def _fsdp_net(dp: DeviceMesh) -> TinyNet:
    torch.manual_seed(0)
    model = TinyNet()
    for block in model.blocks:
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    run_step(model, 0, dp.get_local_rank(), dp.size())
    return model


# --- the layouts ------------------------------------------------------------------------------


def plain_experts() -> Case:
    """FSDP2 over every rank, beside plain experts held one set per rank (an ep group of 4)."""
    model = _fsdp_net(mesh((WORLD,), ("dp",)))
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    experts = [torch.randn(EXPERT_DIM, EXPERT_DIM, generator=generator) for _ in range(EXPERTS)]
    model.experts = nn.ParameterList([_with_grad(e) for e in experts])  # type: ignore[assignment]
    oracle = full_grads(model)[:-EXPERTS] + _every_rank(experts)
    ep = dist.group.WORLD
    return Case(
        model,
        oracle,
        lambda **kw: clip_grad_norm_(model, 1e9, **kw),
        {},
        {"distinct_along": [(list(model.experts.parameters()), ep)]},
        ["clip_grad_norm_: experts.0 (tensor shape=(4, 4)", "distinct_along"],
    )


def dtensor_experts() -> Case:
    """A (dp=2, ep=2) world: dense FSDP2 over dp, experts Shard(0) over dp, one set per ep rank."""
    world = mesh((2, 2), ("dp", "ep"))
    model = _fsdp_net(world["dp"])
    generator = torch.Generator().manual_seed(100 + world["ep"].get_local_rank())
    full = [torch.randn(EXPERT_DIM, EXPERT_DIM, generator=generator) for _ in range(EXPERTS)]
    experts = [distribute_tensor(e, world["dp"], [Shard(0)]) for e in full]
    model.experts = nn.ParameterList(  # type: ignore[assignment]
        [_with_grad(e) for e in experts]
    )
    by_ep = _every_rank(full)  # every rank's experts; the dp peers hold the same ones
    oracle = full_grads(model)[:-EXPERTS] + by_ep[: 2 * EXPERTS]
    grads = [p.grad for p in model.parameters()]
    return Case(
        model,
        oracle,
        lambda **kw: total_grad_norm(grads, **kw),
        {},
        {"distinct_along": [(list(model.experts.parameters()), world["ep"])]},
        ["total_grad_norm: grads[24] (DTensor shape=(4, 4)", "rank 1 differs from rank 0"],
    )


class _Stage(nn.Module):
    """One pipeline stage; every stage has the same shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(IN_DIM, 16)
        self.block = Block()

    def forward(self, x: Tensor) -> Tensor:
        return self.block(self.embed(x))


def _stage_of_pipeline() -> tuple[nn.Module, DeviceMesh]:
    """A (pp=2, dp=2) world: this rank's stage, FSDP2 over its dp mesh, after one backward."""
    world = mesh((2, 2), ("pp", "dp"))
    stage, dp_rank = world.get_coordinate()  # type: ignore[misc]
    torch.manual_seed(stage)
    model = _Stage()
    fully_shard(model.block, mesh=world["dp"])
    fully_shard(model, mesh=world["dp"])
    batch = torch.randn(4, IN_DIM, generator=torch.Generator().manual_seed(10 + stage))
    model(batch.chunk(2)[dp_rank]).pow(2).mean().backward()
    return model, world


def equal_stages() -> Case:
    """Two stages of the same shapes, passed without pp_group."""
    model, world = _stage_of_pipeline()
    stage = world.get_coordinate()[0]  # type: ignore[index]
    by_stage: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(by_stage, (stage, full_grads(model)))
    oracle = [g for s in range(2) for g in next(v for t, v in by_stage if t == s)]
    return Case(
        model,
        oracle,
        lambda **kw: grad_norm_report(model.named_parameters(), **kw)["total"],
        {},
        {"pp_group": world["pp"]},
        ["grad_norm_report: embed.weight (DTensor shape=(16, 6)", "pass pp_group"],
    )


def experts_in_stages() -> Case:
    """pp_group passed, but each dp rank of a stage holds its own plain experts undeclared."""
    model, world = _stage_of_pipeline()
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    experts = [torch.randn(EXPERT_DIM, generator=generator) for _ in range(EXPERTS)]
    model.experts = nn.ParameterList([_with_grad(e) for e in experts])  # type: ignore[assignment]
    stage = world.get_coordinate()[0]  # type: ignore[index]
    by_stage: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(by_stage, (stage, full_grads(model)[:-EXPERTS]))
    oracle = [g for s in range(2) for g in next(v for t, v in by_stage if t == s)]
    oracle += _every_rank(experts)
    pp = {"pp_group": world["pp"]}
    return Case(
        model,
        oracle,
        lambda **kw: clip_grad_norm_(model.named_parameters(), 1e9, **kw),
        pp,
        {**pp, "distinct_along": [(list(model.experts.parameters()), world["dp"])]},
        ["clip_grad_norm_: experts.0 (tensor shape=(4,)", "distinct_along"],
    )


CASES: dict[str, Callable[[], Case]] = {
    "plain experts without distinct_along": plain_experts,
    "DTensor experts on a mesh without ep": dtensor_experts,
    "equal stages without pp_group": equal_stages,
    "experts inside pipeline stages": experts_in_stages,
}


def _refused_then_declared(name: str, check: bool) -> dict[str, Any]:
    case = CASES[name]()
    grads = [p.grad for p in case.model.parameters() if p.grad is not None]
    before = [local_bytes(g) for g in grads]
    with pytest.raises(ValueError) as raised:
        case.call(**case.mistaken, check=check)
    unchanged = all(torch.equal(b, local_bytes(g)) for b, g in zip(before, grads, strict=True))
    case.call(**case.corrected)  # the first call for the declared layout verifies it
    with WireRecorder() as wire:
        norm = case.call(**case.corrected)
    reference = torch.nn.utils.get_total_norm(case.oracle, 2.0)
    return {
        "message": str(raised.value),
        "names": case.names,
        "unchanged": unchanged,
        "ulps": ulp_distance(torch.as_tensor(norm), reference),
        "same_bits": same_bits_everywhere(torch.as_tensor(norm)),
        "collectives": wire.groups,
    }


# A corrected call's collectives once its layout is verified, by the size of their process group:
# the world's one all_reduce; where the dense parameters are sharded over dp of a (dp, ep) mesh,
# after one within ep, where their copies meet (the experts, declared, have none).
WIRE = {
    "plain experts without distinct_along": [WORLD],
    "DTensor experts on a mesh without ep": [2, WORLD],
    "equal stages without pp_group": [WORLD],
    "experts inside pipeline stages": [WORLD],
}


@pytest.mark.parametrize("check", [False, True], ids=["first call", "check mode"])
@pytest.mark.parametrize("name", CASES)
def test_copies_that_differ_raise_on_every_rank_until_declared(ranks, name, check):
    results = ranks.run(WORLD, _refused_then_declared, name, check)
    message = results[0]["message"]
    assert all(r["message"] == message for r in results), "ranks describe it differently"
    for text in results[0]["names"]:
        assert text in message, message
    assert "holds different values on ranks that the rank maps take for copies" in message
    assert message.endswith("No gradient was modified.")
    for rank, result in enumerate(results):
        assert result["unchanged"], f"rank {rank}: a gradient changed"
        assert result["ulps"] <= TOLERANCE_ULP, f"rank {rank}: {result['ulps']} ULP off"
        assert result["same_bits"]
        assert result["collectives"] == WIRE[name], f"rank {rank}: {result['collectives']}"


# --- models of their own, and copies with equal norms -------------------------------------------


def _own_model() -> nn.Module:
    torch.manual_seed(dist.get_rank())  # each rank its own weights and data
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model(torch.randn(5, 6)).pow(2).sum().backward()
    return model


def _models_of_their_own(check: bool) -> dict[str, Any]:
    model = _own_model()
    grads = [p.grad for p in model.parameters()]
    before = [local_bytes(g) for g in grads]
    with pytest.raises(ValueError) as raised:
        total_grad_norm(grads, check=check)
    unchanged = all(torch.equal(b, local_bytes(g)) for b, g in zip(before, grads, strict=True))
    with CommDebugMode() as comm:
        ours = total_grad_norm(grads, check=check, per_rank=True)
    torch_norm = torch.nn.utils.get_total_norm(grads)
    return {
        "message": str(raised.value),
        "unchanged": unchanged,
        "torch_bits": torch.equal(ours.view(torch.int32), torch_norm.view(torch.int32)),
        "collectives": comm.get_total_counts(),
    }


@pytest.mark.parametrize("check", [False, True], ids=["first call", "check mode"])
def test_models_of_their_own_raise_until_per_rank(ranks, check):
    results = ranks.run(WORLD, _models_of_their_own, check)
    message = results[0]["message"]
    assert all(r["message"] == message for r in results)
    assert message.startswith("total_grad_norm: grads[0] (tensor shape=(8, 6)")
    assert "4 of the 4 gradients with copies differ (4 gradients in all)" in message
    assert "Likely fix: if the ranks hold different pipeline stages, pass pp_group" in message
    assert "pass per_rank=True for each rank's own norm" in message
    for result in results:
        assert result["unchanged"]
        assert result["torch_bits"], "per_rank must give torch's norm of this rank's gradients"
        assert result["collectives"] == 0, "per_rank compares nothing across ranks, checked or not"


def _equal_norms(variant: int) -> dict[str, Any]:
    """Every rank holds values with the same norms (any p) as rank 0's, but other values."""
    base = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))
    change = {0: lambda t: t, 1: torch.neg, 2: lambda t: t.flip(0), 3: lambda t: t.roll(1, 1)}
    params = [_with_grad(change[(dist.get_rank() + variant) % WORLD](base))]
    norms = {p: float(torch.linalg.vector_norm(params[0].grad, p)) for p in (1, 2, float("inf"))}
    with pytest.raises(ValueError) as raised:
        clip_grad_norm_(params, 1.0)
    return {"message": str(raised.value), "norms": norms}


@pytest.mark.parametrize("variant", [0, 1])
def test_equal_norms_with_different_values_raise(ranks, variant):
    results = ranks.run(WORLD, _equal_norms, variant)
    for result in results:  # the same up to the order of the sums
        assert result["norms"] == pytest.approx(results[0]["norms"], rel=1e-6)
    message = results[0]["message"]
    assert all(r["message"] == message for r in results)
    assert message.startswith("clip_grad_norm_: parameters[0] (tensor shape=(6, 5)")
    # Every rank but the reference (rank 0) holds other values.
    assert "rank 1 differs from rank 0, rank 2 differs from rank 0, rank 3 differs" in message


# --- legitimate copies never raise ----------------------------------------------------------------


CONFIG = ModelConfig(lat=8, lon=16, dim=16, heads=2, hidden=32, depth=1)
STEPS = 20
COUNTED = (0, 1, STEPS - 1)  # the steps whose replica check's collectives are counted


def _trained(layout: str) -> tuple[list[float], list[int]]:
    """The demo's model trained STEPS steps on ``layout``, the gradients' copies compared on every
    call, and every copy of the parameters and optimizer state after every step; the norms, and
    the collectives of each replica check."""
    torch.manual_seed(0)
    model: nn.Module = TinyWeatherModel(CONFIG)
    dp, tp, domain = {"ddp": (4, 1, 1), "hsdp": (4, 1, 1), "fsdp_tp": (2, 2, 1)}.get(
        layout, (1, 2, 2)
    )
    world = mesh((dp, tp, domain), ("dp", "tp", "domain"))
    dp_rank = world.get_coordinate()[0]  # type: ignore[index]
    if layout == "ddp":
        model = DistributedDataParallel(model)
    elif layout == "hsdp":
        hsdp = mesh((2, 2), ("replicate", "shard"))
        fully_shard(model.blocks[0], mesh=hsdp)
        fully_shard(model, mesh=hsdp)
    else:
        parallelize(model, world["tp"], world["dp"])  # type: ignore[arg-type]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    weights = latitude_weights(CONFIG)
    rows = band(CONFIG.lat, domain, world.get_coordinate()[2])  # type: ignore[index]
    norms, checks = [], []
    for step in range(STEPS):
        x, y = global_batch(CONFIG, 2 * dp, 0, step, 0)
        x, y = x.chunk(dp)[dp_rank], y.chunk(dp)[dp_rank]
        band_loss(model(x), y, weights, rows, domain).backward()
        sync_domain_gradients(model, world["domain"])
        sync_replicated_gradients(model, world["tp"])
        norms.append(float(clip_grad_norm_(model.parameters(), 0.5, check=True)))
        optimizer.step()
        optimizer.zero_grad()
        if step in COUNTED:  # counting puts every op of the check through Python dispatch
            with CommDebugMode() as comm:
                verify_replicas(model, optimizer)
            checks.append(comm.get_total_counts())
        else:
            verify_replicas(model, optimizer)
    return norms, checks


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ddp", "hsdp", "fsdp_tp", "tp_domain"])
def test_legitimate_copies_never_raise(ranks, layout):
    results = ranks.run(WORLD, _trained, layout, timeout_s=180)
    norms = results[0][0]
    assert len(norms) == STEPS and all(norm > 0 for norm in norms)
    assert all(result[0] == norms for result in results), "ranks disagree on a norm"
    # Parameters, buffers and AdamW state stay bit-identical copies: one collective per check.
    assert all(result[1] == [1] * len(COUNTED) for result in results)
