"""The copies' bound under pipeline stages (``pp_group``): the same test as within one stage.

Each stage holds its own parameters, replicated over the ``dp`` ranks of the stage (stage ``s`` is
ranks ``s * dp`` to ``s * dp + dp - 1``, its reference copy the lowest of them). Every group of
copies meets the bound of the guide ("Copies proven by value"), whatever the number of groups and
stages: one copy off by ``e`` is caught when ``e > sqrt(2) * tau * mean norm`` and passes below
``tau * mean norm``. So, as ``test_copies_bound.py`` does within one stage, each case scales one
copy of one gradient by ``1 + 2 tau`` (caught) or ``1 + tau / 2`` (within; ``1 + tau / 8`` on a
first call, whose projections a scaled copy moves by up to a few times its norm's change), for
pp=2 x dp=2 (``pp_group`` a ProcessGroup) and pp=2 x dp=4 (a mesh dimension), float32, bfloat16
and float16, 1, 10 and 100 gradients a stage, the reference copy of stage 1 and its last copy, on
the layout's first call and on a later one.

Within the bound every rank returns the same bits: the norm of the reference copies. The oracle is
torch's ``get_total_norm`` of the reference copies of every stage; ours sums their per-gradient
norms (torch's kernels, in the gradients' dtype) in float64 and rounds once to that dtype, where
torch's accumulates in float32 and rounds: at most one ULP of the dtype apart.

Then the faults users meet (a bfloat16 copy x1.5, a boundary step under ``no_sync()``, a second
model initialised per rank, float32 copies 10 and 100 tau apart), the layouts that change in one
stage while the other's does not (the vector every rank sends keeps one length, one collective a
call once both are proven), and no false alarm over many steps of real bf16 training with DDP,
and with FSDP2 x TP and SequenceParallel, inside each stage.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support.copies_bound import (
    DTYPES,
    bf16_ddp_steps,
    bf16_fsdp_tp_sp_steps,
    legitimate_everywhere,
    refused_everywhere,
    stage_groups,
    stage_of,
)
from torch import Tensor, nn
from torch.distributed.tensor.debug import CommDebugMode
from torch.nn.parallel import DistributedDataParallel

from credit.parallel._norm.copies import tolerance
from credit.parallel.collectives import clip_grad_norm_, total_grad_norm
from credit.parallel.norm_report import grad_norm_report
from testbed.layouts import error_of, local_bytes, mesh, same_bits_everywhere

STAGES = 2


def _stage() -> tuple[int, int, int]:
    """This rank's stage, its place in the stage, and the ranks a stage holds."""
    return stage_of(STAGES)


def _pp_group(pp_as: str) -> Any:
    """This rank's pipeline group, as a ProcessGroup or as the "pp" dimension of a mesh."""
    if pp_as == "mesh":
        return mesh((STAGES, dist.get_world_size() // STAGES), ("pp", "dp"))["pp"]
    return stage_groups(STAGES)[0][_stage()[1]]


def _reference_norm(stage_grads: list[Tensor]) -> Tensor:
    """torch's norm of the reference copies (each stage's lowest rank's) of every stage."""
    stage, place, _ = _stage()
    mine = [g.detach().clone() for g in stage_grads] if place == 0 else None
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (stage, mine))
    references = [grads for _, grads in sorted(gathered, key=lambda v: v[0]) if grads is not None]
    return torch.nn.utils.get_total_norm([g for grads in references for g in grads])


def _observed(call: Callable[[], Tensor], stage_grads: list[Tensor]) -> tuple[list, int]:
    """What one call did: the error it raised, or the norm it returned with its oracle and
    whether every rank returned the same bits; and how many collectives it issued. Every rank
    must call it together."""
    oracle = _reference_norm(stage_grads)
    with CommDebugMode() as comm:
        try:
            norm = call()
        except Exception as error:
            return [(type(error).__name__, str(error)), None], comm.get_total_counts()
    bits = (local_bytes(norm), local_bytes(oracle), same_bits_everywhere(norm))
    return [None, bits], comm.get_total_counts()


def _reference_copy_everywhere(results: list, dtype: torch.dtype) -> None:
    for error, bits in results:
        assert error is None, error
        ours, oracle, same_bits = bits
        assert same_bits, "the same bits on every rank"
        ours, oracle = (b.view(dtype).double() for b in (ours, oracle))
        assert abs(ours - oracle) <= torch.finfo(dtype).eps * oracle, (ours, oracle)


# ---------------------------------------------------------------------------------------------
# 1. The bound: two world sizes, three dtypes, 1, 10 and 100 gradients a stage, two copies, two
# calls


def _stage_grads(dtype: torch.dtype, count: int, case: int) -> list[Tensor]:
    """This stage's gradients: shapes of their own per case and stage (each case meets its layout
    first), the same values on every copy of the stage."""
    stage = _stage()[0]
    generator = torch.Generator().manual_seed(1000 * case + stage)
    return [torch.randn(3 + case, 7 + stage, generator=generator).to(dtype) for _ in range(count)]


def _scaled_copies(pp_as: str) -> dict[str, list]:
    """Every case of the bound on this world: the outcome of each on this rank."""
    pp_group, world = _pp_group(pp_as), dist.get_world_size()
    deviants = {"reference": world // STAGES, "last": world - 1}  # of stage 1
    outcomes = {}
    cases = itertools.product(DTYPES, (1, 10, 100), deviants, (False, True), ("caught", "within"))
    for case, (dtype_name, count, deviant, later, kind) in enumerate(cases):
        dtype = DTYPES[dtype_name]
        grads = _stage_grads(dtype, count, case)
        if later:
            total_grad_norm(grads, pp_group=pp_group)  # proves the layout
        factor = 2.0 if kind == "caught" else 0.5 if later else 0.125
        if dist.get_rank() == deviants[deviant]:
            grads[count // 2].mul_(1 + factor * tolerance(dtype))
        call = functools.partial(total_grad_norm, grads, pp_group=pp_group)
        outcomes[f"{kind} {dtype_name} {count} {deviant} later={later}"] = _observed(call, grads)[0]
    return outcomes


@pytest.mark.slow
@pytest.mark.parametrize(("world", "pp_as"), [(4, "process group"), (8, "mesh")])
def test_every_group_of_copies_meets_the_bound_under_pipeline_stages(ranks, world, pp_as):
    results = ranks.run(world, _scaled_copies, pp_as, timeout_s=240)
    for name in results[0]:
        outcomes = [rank_results[name] for rank_results in results]
        if name.startswith("caught"):
            refused_everywhere([error for error, _ in outcomes])
        else:
            _reference_copy_everywhere(outcomes, DTYPES[name.split()[1]])


# ---------------------------------------------------------------------------------------------
# 2. The faults users meet, inside the stages


def _layers(count: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(count // 2)]).bfloat16()


def _ddp_boundary_under_no_sync(count: int) -> list:
    stage, place, dp = _stage()
    pp_groups, stage_ranks = stage_groups(STAGES)
    pp_group = pp_groups[place]
    model = DistributedDataParallel(_layers(count, stage), process_group=stage_ranks[stage])
    batch = torch.randn(4 * dp, 16, generator=torch.Generator().manual_seed(stage)).bfloat16()
    mine = batch.chunk(dp)[place]
    model(mine).float().pow(2).mean().backward()  # a synced step proves the layout
    clip_grad_norm_(model.parameters(), 1.0, pp_group=pp_group)
    model.zero_grad()
    with model.no_sync():  # the boundary step by mistake: each rank keeps its own batch's grads
        model(mine * 2).float().pow(2).mean().backward()
    return [error_of(lambda: clip_grad_norm_(model.parameters(), 1.0, pp_group=pp_group))]


def _second_model_per_rank(count: int) -> list:
    pp_group = _pp_group("mesh")
    first = _layers(count, _stage()[0])
    first(torch.ones(2, 16).bfloat16()).float().pow(2).sum().backward()
    total_grad_norm([p.grad for p in first.parameters()], pp_group=pp_group)  # proves the shapes
    second = _layers(count, 100 + dist.get_rank())
    second(torch.ones(2, 16).bfloat16()).float().pow(2).sum().backward()
    return [error_of(lambda: clip_grad_norm_(second.parameters(), 1.0, pp_group=pp_group))]


def _one_copy_scaled(dtype_name: str, count: int, factor: float, later: bool) -> list:
    dtype, pp_group = DTYPES[dtype_name], _pp_group("process group")
    case = 500 + count + int(later) + (10 if dtype == torch.float32 else 0)
    grads = _stage_grads(dtype, count, case)
    if later:
        total_grad_norm(grads, pp_group=pp_group)
    if dist.get_rank() == 1:  # a copy of stage 0 other than its reference
        grads[-1].mul_(factor)
    return [error_of(lambda: total_grad_norm(grads, pp_group=pp_group))]


FAULTS = {
    **{
        f"bf16 x1.5, {n} a stage, {'later' if later else 'first'} call": (
            _one_copy_scaled,
            ("bfloat16", n, 1.5, later),
        )
        for n in (1, 10, 100)
        for later in (False, True)
    },
    **{f"bf16 DDP no_sync, {n} a stage": (_ddp_boundary_under_no_sync, (n,)) for n in (10, 100)},
    **{f"second bf16 model, {n} a stage": (_second_model_per_rank, (n,)) for n in (10, 100)},
    **{
        f"fp32 x(1 + {k} tau), {n} a stage": (
            _one_copy_scaled,
            ("float32", n, 1 + k * tolerance(torch.float32), True),
        )
        for k, n in ((10, 10), (10, 100), (100, 100))
    },
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_the_faults_users_meet_raise_on_every_rank_under_pipeline_stages(ranks, fault):
    body, args = FAULTS[fault]
    refused_everywhere([r[0] for r in ranks.run(4, body, *args)])


def test_a_second_model_raises_at_eight_ranks_under_pipeline_stages(ranks):
    refused_everywhere([r[0] for r in ranks.run(8, _second_model_per_rank, 100)])


# ---------------------------------------------------------------------------------------------
# 3. One stage changes its layout while the other's does not


def _as_parameters(grads: list[Tensor]) -> list[tuple[str, nn.Parameter]]:
    named = []
    for index, grad in enumerate(grads):
        parameter = nn.Parameter(torch.zeros_like(grad))
        parameter.grad = grad
        named.append((f"p{index}", parameter))
    return named


def _stages_that_change() -> dict[str, tuple[list, int]]:
    """Stage 0 moves between layouts of 3 and 40 gradients and none at all, while stage 1 keeps
    one of 5; then both stages alternate between two models each; a report over part of stage
    0's gradients. Then a copy that differs, in a stage that keeps its layout on a call where the
    other meets one with more groups than any before, and in a stage that changed, at steady
    state."""
    stage, place, _ = _stage()
    pp_group = stage_groups(STAGES, "changing layouts")[0][place]
    sets = {name: _stage_grads(torch.float32, n, 700 + n) for name, n in (("3", 3), ("40", 40))}
    sets.update(none=[], fixed=_stage_grads(torch.float32, 5, 705))
    sets["second"] = _stage_grads(torch.float32, 12, 712)
    sequence = ["3/fixed", "40/fixed", "3/fixed", "40/fixed", "none/fixed", "3/fixed"]
    sequence += ["40/second", "3/fixed", "40/second", "3/fixed"]  # two models alternating
    found = {}

    def norm_of(stage_grads: list[Tensor]) -> tuple[list, int]:
        call = functools.partial(total_grad_norm, stage_grads, pp_group=pp_group)
        return _observed(call, stage_grads)

    for step, names in enumerate(sequence):
        found[f"{step}: {names}"] = norm_of(sets[names.split("/")[stage]])
    part = sets["40"][:7] if stage == 0 else sets["fixed"]
    report = functools.partial(grad_norm_report, _as_parameters(part), pp_group=pp_group)
    found["a report over part of stage 0"] = _observed(
        lambda: torch.tensor(report()["total"]), part
    )
    new = _stage_grads(torch.float32, 60, 760)  # more groups than stage 0 had
    faulty = [g.clone() for g in sets["fixed"]]
    if dist.get_rank() == 3:
        faulty[2].mul_(1 + 2 * tolerance(torch.float32))
    found["stage 1 differs as stage 0 meets a new layout"] = norm_of(new if stage == 0 else faulty)
    faulty = [g.clone() for g in sets["40"]]
    if dist.get_rank() == 1:
        faulty[30].mul_(1 + 2 * tolerance(torch.float32))
    found["stage 0 differs at steady state"] = norm_of(faulty if stage == 0 else sets["fixed"])
    return found


def test_one_stage_changing_its_layout_keeps_every_rank_in_step(ranks):
    results = ranks.run(4, _stages_that_change, timeout_s=120)
    for name in results[0]:
        outcomes = [rank_results[name] for rank_results in results]
        collectives = {count for _, count in outcomes}
        assert len(collectives) == 1, f"{name}: {collectives}"
        if "differs" in name:
            refused_everywhere([error for (error, _), _ in outcomes])
        else:
            _reference_copy_everywhere([outcome for outcome, _ in outcomes], torch.float32)
    calls = [count for name, (_, count) in results[0].items() if ":" in name]
    # A new layout in any stage (none at all included) costs the proof, and the first call with
    # a pipeline group the stages' lowest ranks; layouts seen before, of any size, one
    # collective.
    assert calls == [3, 2, 1, 1, 2, 1, 2, 1, 1, 1], calls


# ---------------------------------------------------------------------------------------------
# 4. No false alarm over many steps of real bf16 training inside each stage


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "body"),
    [(4, bf16_ddp_steps), (8, bf16_fsdp_tp_sp_steps)],
    ids=["ddp", "fsdp_tp_sp"],
)
def test_legitimate_bf16_copies_never_raise_inside_pipeline_stages(ranks, world, body):
    legitimate_everywhere(ranks.run(world, body, STAGES, timeout_s=240))


# ---------------------------------------------------------------------------------------------
# 5. A NaN or inf in any copy reaches every rank, as it is


def _nonfinite_in_a_copy(value: float) -> float:
    grads = _stage_grads(torch.float32, 3, 900)
    pp_group = _pp_group("process group")
    total_grad_norm(grads, pp_group=pp_group)
    if dist.get_rank() == 3:  # a copy of stage 1 other than its reference
        grads[1][0, 0] = value
    return float(total_grad_norm(grads, pp_group=pp_group))


@pytest.mark.parametrize("value", [math.inf, math.nan], ids=["inf", "nan"])
def test_a_nonfinite_copy_reaches_every_rank_under_pipeline_stages(ranks, value):
    """The reference copy gives the norm of plain replicas; another copy's inf still makes it
    inf (torch's norm of that copy), not NaN."""
    norms = ranks.run(4, _nonfinite_in_a_copy, value)
    assert all(math.isinf(n) if math.isinf(value) else math.isnan(n) for n in norms), norms
