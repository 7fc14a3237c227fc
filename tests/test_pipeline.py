"""total_grad_norm and clip_grad_norm_ across pipeline stages (``pp_group``).

A small model is split by hand into two stages; each stage runs its own forward/backward (no
pipeline schedule is needed: the norm only sees each stage's gradients). Layouts:

- "pp_dp": a (pp=2, dp=2) mesh, FSDP2 per stage on mesh["dp"], pp_group = mesh["pp"];
- "pp_dp_tp": a (pp=2, dp=2, tp=2) mesh, TP on mesh["tp"] and FSDP2 on mesh["dp"] per stage;
- "pp_meshes": a separate DeviceMesh per stage built from explicit ranks, pp_group a new_group;
- "pp_plain": plain gradients (replicated over dp) and a pp_group, no DTensors.

Oracle: torch.nn.utils.get_total_norm on every stage's full_tensor() gradients, gathered to every
rank. Tolerance 8 float32 ULP: the distributed norm sums p-th powers in another order (per shard,
then across ranks) and takes a p-th root, each step rounding once; counting a replica twice or
missing a stage is off by far more (a stage holds well over 1% of the squared norm).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import parallelize_module

from credit.parallel.collectives import clip_grad_norm_, total_grad_norm
from testbed.layouts import IN_DIM, TP_PLAN, Block, full_grads, grads, mesh, same_bits_everywhere
from testbed.layouts import ulp_distance as ulps
from testbed.world_layouts import WireRecorder

NORM_TYPES = (1.0, 2.0, 3.0, math.inf)
DIM = 16
TOLERANCE_ULP = 8


class FirstStage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(IN_DIM, DIM)
        self.blocks = nn.ModuleDict({"0": Block()})

    def forward(self, x: Tensor) -> Tensor:
        return self.blocks["0"](self.embed(x))


class LastStage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({"1": Block()})
        self.head = nn.Linear(DIM, 1)  # a 1-row weight: one dp rank gets an empty shard

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks["1"](x))


@functools.cache
def stage_meshes() -> tuple[DeviceMesh, DeviceMesh]:
    """One 1D dp mesh per stage from explicit ranks (every rank builds both, in the same order)."""
    assert dist.get_world_size() == 4
    return (
        DeviceMesh("cpu", [0, 1], mesh_dim_names=("dp",)),
        DeviceMesh("cpu", [2, 3], mesh_dim_names=("dp",)),
    )


@functools.cache
def pp_groups() -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """The pipeline groups {0, 2} and {1, 3} of a 4-rank world whose stage is rank // 2."""
    assert dist.get_world_size() == 4
    groups = (dist.new_group([0, 2]), dist.new_group([1, 3]))
    assert all(group is not None for group in groups)
    return groups  # type: ignore[return-value]


def build_pipeline(layout: str, seed: int = 0) -> tuple[nn.Module, int, Any]:
    """Build this rank's stage of ``layout``, run its backward; return (stage model, stage, pp_group)."""
    rank = dist.get_rank()
    if layout == "pp_dp":
        world_mesh = mesh((2, 2), ("pp", "dp"))
        stage, dp_rank = world_mesh.get_coordinate()  # type: ignore[misc]
        dp_mesh, tp_mesh, pp_group = world_mesh["dp"], None, world_mesh["pp"]
    elif layout == "pp_dp_tp":
        world_mesh = mesh((2, 2, 2), ("pp", "dp", "tp"))
        stage, dp_rank, _ = world_mesh.get_coordinate()  # type: ignore[misc]
        dp_mesh, tp_mesh, pp_group = world_mesh["dp"], world_mesh["tp"], world_mesh["pp"]
    elif layout in ("pp_meshes", "pp_plain"):
        stage, dp_rank = divmod(rank, 2)
        dp_mesh = stage_meshes()[stage] if layout == "pp_meshes" else None
        tp_mesh, pp_group = None, pp_groups()[dp_rank]
    else:
        raise ValueError(f"unknown layout {layout!r}")
    torch.manual_seed(seed + stage)
    model = FirstStage() if stage == 0 else LastStage()
    if tp_mesh is not None:
        for block in model.blocks.values():
            parallelize_module(block, tp_mesh, TP_PLAN)
    if dp_mesh is not None:
        for block in model.blocks.values():
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    # Plain replicas see the whole batch, so their gradients are identical without a DP sync.
    dp_size = 2 if dp_mesh is not None else 1
    generator = torch.Generator().manual_seed(seed + 10 + stage)
    batch = torch.randn(4 * dp_size, IN_DIM if stage == 0 else DIM, generator=generator)
    model(batch.chunk(dp_size)[dp_rank % dp_size]).pow(2).mean().backward()
    return model, stage, pp_group


def all_stages(stage: int, values: list[Any]) -> list[Any]:
    """Concatenate every stage's ``values`` (taken from the first rank of each stage), in stage order."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (stage, values))
    by_stage: dict[int, list[Any]] = {}
    for rank_stage, rank_values in gathered:
        by_stage.setdefault(rank_stage, rank_values)
    return [value for s in sorted(by_stage) for value in by_stage[s]]


def _norms_match_all_stages(
    layout: str, as_process_group: bool
) -> list[tuple[float, int, bool, list[int]]]:
    """Per norm type: the ULPs from the oracle, whether every rank got the same bits, and the
    size of the process group of each collective the norm issued, in order."""
    model, stage, pp_group = build_pipeline(layout)
    if as_process_group and isinstance(pp_group, DeviceMesh):
        pp_group = pp_group.get_group()
    reference_grads = all_stages(stage, [g.clone() for g in full_grads(model)])
    total_grad_norm(grads(model), pp_group=pp_group)  # the layout's first call verifies it
    results = []
    for norm_type in NORM_TYPES:
        with WireRecorder() as wire:
            ours = total_grad_norm(grads(model), norm_type, pp_group=pp_group)
        reference = torch.nn.utils.get_total_norm(reference_grads, norm_type)
        assert not isinstance(ours, DTensor)
        results.append((norm_type, ulps(ours, reference), same_bits_everywhere(ours), wire.groups))
    return results


# Collectives per norm once the layout is verified: the world's one all_reduce, whatever the
# stages' meshes and however pp_group is given (no copies within a stage: FSDP2 over the stage's
# dp, or plain replicas over the stage, compared in the world's all_reduce).
@pytest.mark.parametrize(
    ("layout", "as_process_group"),
    [("pp_dp", False), ("pp_dp", True), ("pp_meshes", False), ("pp_plain", False)],
)
def test_norm_covers_every_stage(ranks, layout, as_process_group):
    for rank_results in ranks.run(4, _norms_match_all_stages, layout, as_process_group):
        for norm_type, distance, same_bits, groups in rank_results:
            assert distance <= TOLERANCE_ULP, f"{layout} p={norm_type}: {distance} ULP off"
            assert same_bits, f"{layout} p={norm_type}: ranks disagree"
            assert groups == [4], f"{layout} p={norm_type}: collectives on groups {groups}"


def test_norm_covers_every_stage_with_fsdp_and_tp(ranks):
    """8 ranks as pp=2 x dp=2 x tp=2: grads on the 2D (dp, tp) and 1D dp meshes of each stage."""
    for rank_results in ranks.run(8, _norms_match_all_stages, "pp_dp_tp", False):
        for norm_type, distance, same_bits, groups in rank_results:
            assert distance <= TOLERANCE_ULP, f"p={norm_type}: {distance} ULP off"
            assert same_bits, f"p={norm_type}: ranks disagree"
            # The copies (the rowwise biases replicated on tp, the dp mesh's shards on their tp
            # peers) compared within tp (2 ranks), then the world's one all_reduce (8); the inf
            # norm compares nothing.
            expected = [8] if norm_type == math.inf else [2, 8]
            assert groups == expected, f"p={norm_type}: collectives on groups {groups}"


def _norm_without_pp_group(layout: str) -> tuple[int, str]:
    """Guards the oracle (one stage alone is measurably off), and the self-check: without
    pp_group the stages' different gradients cannot add up to whole copies, so every rank raises
    instead of returning a wrong number."""
    model, stage, _ = build_pipeline(layout)
    reference = torch.nn.utils.get_total_norm(all_stages(stage, full_grads(model)), 2.0)
    stage_only = torch.nn.utils.get_total_norm(full_grads(model), 2.0)
    with pytest.raises(RuntimeError, match="cannot count gradient") as raised:
        total_grad_norm(grads(model), 2.0)
    return ulps(stage_only, reference), str(raised.value)


def test_leaving_pp_group_out_raises_on_every_rank(ranks):
    results = ranks.run(4, _norm_without_pp_group, "pp_dp")
    assert all(one_stage > 1000 for one_stage, _ in results)
    messages = {message for _, message in results}
    assert len(messages) == 1, messages
    assert "pass pipeline stages as pp_group" in messages.pop()


def _clip_scales_every_stage(layout: str, norm_type: float) -> tuple[bool, int]:
    model, stage, pp_group = build_pipeline(layout)
    before = [g.clone() for g in full_grads(model)]
    reference = torch.nn.utils.get_total_norm(all_stages(stage, before), norm_type)
    max_norm = float(reference) / 4
    total = clip_grad_norm_(model.parameters(), max_norm, norm_type, pp_group=pp_group)
    coefficient = max_norm / (total + 1e-6)
    for old, new in zip(before, full_grads(model), strict=True):
        # One float32 rounding of the product: within 2e-6 relative.
        torch.testing.assert_close(new, old * coefficient, rtol=2e-6, atol=1e-9)
    return same_bits_everywhere(total), ulps(total, reference)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clip_scales_every_stage_by_the_global_coefficient(ranks, norm_type):
    for same_bits, distance in ranks.run(4, _clip_scales_every_stage, "pp_dp", norm_type):
        assert same_bits
        assert distance <= TOLERANCE_ULP


def _stage_without_dtensor_grads(
    kind: str, pp_as: str, check: bool
) -> list[tuple[float, int, bool, int]]:
    """Stage 0 is FSDP2-sharded; stage 1 is frozen (no grads) or holds plain grads only."""
    pp_dp = mesh((2, 2), ("pp", "dp"))
    pp_group = pp_dp["pp"] if pp_as == "mesh" else pp_groups()[pp_dp.get_coordinate()[1]]
    coordinate = pp_dp.get_coordinate()
    assert coordinate is not None
    stage = coordinate[0]
    torch.manual_seed(stage)
    model = nn.Linear(8, 8)
    if stage == 0:
        fully_shard(model, mesh=pp_dp["dp"])
    if stage == 0 or kind == "plain":
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(stage))).sum().backward()
    stage_grads = grads(model)
    reference_grads = all_stages(stage, [g.clone() for g in full_grads(model)])
    total_grad_norm(stage_grads, pp_group=pp_group)  # the layout's first call verifies it
    results = []
    for norm_type in (2.0, math.inf):
        with CommDebugMode() as comm:
            ours = total_grad_norm(stage_grads, norm_type, pp_group=pp_group, check=check)
        reference = torch.nn.utils.get_total_norm(reference_grads, norm_type)
        results.append(
            (norm_type, ulps(ours, reference), same_bits_everywhere(ours), comm.get_total_counts())
        )
    return results


# A frozen or plain stage issues the same collectives as the FSDP2 stage, however pp_group is
# given and with the check on (which compares each stage's layout within the stage, and verifies
# the copies after the norm), or all hang.
@pytest.mark.parametrize(
    ("kind", "pp_as", "check"),
    [
        ("frozen", "mesh", False),
        ("frozen", "process group", False),
        ("plain", "process group", False),
        ("frozen", "process group", True),
    ],
)
def test_stage_without_dtensor_grads_joins_the_same_collective(ranks, kind, pp_as, check):
    results = ranks.run(4, _stage_without_dtensor_grads, kind, pp_as, check, timeout_s=60)
    for rank_results in results:
        for norm_type, distance, same_bits, collectives in rank_results:
            assert distance <= TOLERANCE_ULP, f"{kind} p={norm_type}: {distance} ULP"
            assert same_bits
            # with the check: its refusals' flag, layout digest and verification of the copies
            assert collectives == 1 + 3 * check


def _stages_with_different_dtypes() -> tuple[int, bool, str]:
    """Stage 0 holds bf16 plain grads, stage 1 none at all: their collectives must still match."""
    pp_dp = mesh((2, 2), ("pp", "dp"))
    coordinate = pp_dp.get_coordinate()
    assert coordinate is not None
    stage = coordinate[0]
    torch.manual_seed(0)  # the ranks of a stage hold replicas of the same parameters
    model = nn.Linear(8, 8).to(torch.bfloat16)
    if stage == 0:
        model(torch.randn(4, 8, dtype=torch.bfloat16)).float().pow(2).sum().backward()
    stage_grads = grads(model)
    reference_grads = all_stages(stage, [g.double() for g in stage_grads])
    ours = total_grad_norm(stage_grads, 2.0, pp_group=pp_dp["pp"])
    reference = torch.nn.utils.get_total_norm(reference_grads, 2.0)
    # NormEvent in bf16, as torch norms bf16 gradients: within 8 bf16 ULPs relative (8 * 2**-8) of
    # the fp64 reference, each of the few roundings to bf16 (per-gradient norm, result) being
    # within half a bf16 ULP (see test_properties.py).
    close = abs(float(ours) - float(reference)) <= 8 * 2**-8 * float(reference)
    return stage, close and same_bits_everywhere(ours.double()), str(ours.dtype)


def test_stages_with_different_dtypes_or_no_grads_reduce_together(ranks):
    """The stage without gradients returns the bf16 stage's dtype: every rank the same bits."""
    results = ranks.run(4, _stages_with_different_dtypes, timeout_s=60)
    assert all(ok for _, ok, _ in results)
    assert {stage: dtype for stage, _, dtype in results} == {
        0: "torch.bfloat16",
        1: "torch.bfloat16",
    }
