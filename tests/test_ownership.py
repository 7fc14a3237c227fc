"""The norm on every way torch and its trainers build meshes, against the materialised gradients.

A matrix of constructions (a sliced N-D mesh; ``_flatten``; ``_unflatten`` of a 1-D world into
separate dense and expert views, as torchtitan builds them; equal but distinct mesh objects; a mesh
over part of the world, from ``DeviceMesh.from_group``) and parallelisms (FSDP2; HSDP; TP; FSDP2 +
TP with modules outside the plan; SequenceParallel; experts on a second view, declared with
``distinct_along``), not the full product: every construction and every parallelism at least once,
the norm types 0.5, 1, 2, 3 and inf spread over them, at 4 and 8 ranks. Pipeline stages (pp as a
mesh dim, and as a ProcessGroup with a frozen stage) are covered in test_pipeline.py.

Oracle: ``torch.nn.utils.get_total_norm`` on every gradient's ``full_tensor()`` (for experts,
every expert-parallel rank's experts, gathered). Tolerance 8 float32 ULP: each copy of a shard
contributes ``1 / copies`` of its p-th power, so the sums run in another order than the oracle's
and the weights of copies that are not a power of two round once; a copy counted twice or missed
is off by far more (checked: the unflattened layouts were 20% off before rank maps decided the
copies). Every rank must get the same bits, in one collective over the world per call once the
layout is known (two with Partial gradients, whose addends are summed first), after one
all_reduce within each process group where copies of a shard meet (tp, HSDP's replicas; none for
the inf norm, which compares nothing).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

from credit.parallel.collectives import clip_grad_norm_, total_grad_norm
from testbed.layouts import (
    DIM,
    TP_PLAN,
    TinyNet,
    full_grads,
    grads,
    mesh,
    run_step,
    same_bits_everywhere,
    ulp_distance,
)
from testbed.world_layouts import WireRecorder

TOLERANCE_ULP = 8


@dataclass
class Case:
    """One layout on the current world, with its gradients in place.

    Attributes:
        model: the module whose parameters carry the gradients.
        oracle: every distinct gradient materialised (the same list on every rank).
        distinct_along: the argument that declares rank-local gradients, if any.
        partial: the sizes of the process groups over which Partial gradients are summed, one
            all_reduce each, first.
        copy_groups: the sizes of the process groups in which the copies of shards are compared,
            one all_reduce each, before the world's one (none for the inf norm).
        groups_or_slots: groups that may hold the copies, or not: a dp view unflattened from a
            1-D world has a root with a tp dim or not depending on the views torch made before
            in the process; either way the copies are compared (in the group, or in slots of the
            world's all_reduce).
    """

    model: nn.Module
    oracle: list[Tensor]
    distinct_along: list[tuple[Any, Any]] | None = None
    partial: tuple[int, ...] = ()
    copy_groups: tuple[int, ...] = ()
    groups_or_slots: tuple[int, ...] = ()

    def wires(self, norm_type: float) -> list[list[int]]:
        """The sizes of the process groups of the collectives a norm call may issue once the
        layout is known, in order: the Partial sums, the copies' groups, then the world's."""
        if norm_type == math.inf:
            return [[*self.partial, dist.get_world_size()]]
        found = [[*self.partial, *self.copy_groups, dist.get_world_size()]]
        if self.groups_or_slots:
            found.append([*self.partial, *self.groups_or_slots, dist.get_world_size()])
        return found


# --- constructions ------------------------------------------------------------------------------


@functools.cache
def unflattened_world() -> DeviceMesh:
    """torchtitan's root: one 1-D mesh over the world, every other mesh a view of it."""
    return mesh((dist.get_world_size(),), ("world",))


@functools.cache
def dense_view() -> DeviceMesh:
    """The dense view (dp, tp) of the 1-D world, with tp of size 2."""
    return unflattened_world()._unflatten(0, (dist.get_world_size() // 2, 2), ("dp", "tp"))


@functools.cache
def sparse_view() -> DeviceMesh:
    """The expert view (efsdp, ep) of the same 1-D world, with ep of size 2."""
    return unflattened_world()._unflatten(0, (dist.get_world_size() // 2, 2), ("efsdp", "ep"))


@functools.cache
def flattened_dp() -> tuple[DeviceMesh, DeviceMesh]:
    """(dp, tp) where dp is ``_flatten`` of two dims of an (a, b, tp) mesh (8 ranks)."""
    world = mesh((2, 2, 2), ("a", "b", "tp"))
    return world["a", "b"]._flatten("dp"), world["tp"]


@functools.cache
def equal_but_distinct() -> tuple[DeviceMesh, DeviceMesh]:
    """Two equal (dp, tp) meshes that are distinct objects (as torch's caches may hand out)."""
    first = mesh((dist.get_world_size() // 2, 2), ("dp", "tp"))
    groups = [first.get_group("dp"), first.get_group("tp")]
    second = DeviceMesh.from_group(groups, "cpu", mesh=first.mesh, mesh_dim_names=("dp", "tp"))
    assert second == first and second is not first
    return first, second


@functools.cache
def half_of_the_world() -> DeviceMesh:
    """A 1-D mesh over this rank's half of the world, from a process group: two such meshes,
    each holding a replica of the model."""
    world = dist.get_world_size()
    halves = [list(range(world // 2)), list(range(world // 2, world))]
    groups = [dist.new_group(ranks) for ranks in halves]  # every rank creates every group
    mine = groups[dist.get_rank() * 2 // world]
    assert mine is not None
    return DeviceMesh.from_group(mine, "cpu", mesh_dim_names=("dp",))


# --- layouts ------------------------------------------------------------------------------------


def _model(seed: int = 0) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet()


def _fsdp_tp(dp: DeviceMesh, tp: DeviceMesh) -> Case:
    """TP on the blocks' projections, FSDP2 on dp; norms, embed and head outside the TP plan."""
    model = _model()
    for block in model.blocks:
        parallelize_module(block, tp, TP_PLAN)
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    dp_rank, dp_size = dp.get_local_rank(), dp.size()
    run_step(model, 0, dp_rank, dp_size)
    # The rowwise biases replicated on tp: compared within tp; so are the copies of the dp
    # mesh's shards on their tp peers, through the tp dim of the mesh dp was sliced from, or of
    # the tp mesh (an unflattened view's root is the 1-D world, with no such dim).
    return Case(model, full_grads(model), copy_groups=(tp.size(),))


def _shard_per_block(model: nn.Module, mesh: DeviceMesh) -> None:
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _fsdp_alone(dp: DeviceMesh, seed: int = 0) -> Case:
    model = _model(seed)
    _shard_per_block(model, dp)
    run_step(model, 0, dp.get_local_rank(), dp.size())
    return Case(model, full_grads(model))


def unflattened_fsdp_tp() -> Case:
    dense = dense_view()
    return _fsdp_tp(dense["dp"], dense["tp"])


def unflattened_fsdp() -> Case:
    """FSDP2 alone on the dense view's dp dim: the tp peers hold identical copies, compared
    within tp where the view's root has a tp dim, else in the world's all_reduce."""
    return dataclasses.replace(_fsdp_alone(dense_view()["dp"]), groups_or_slots=(2,))


def flattened_fsdp_tp() -> Case:
    dp, tp = flattened_dp()
    return _fsdp_tp(dp, tp)


def equal_meshes_fsdp_tp() -> Case:
    """Block 0 on one mesh object, block 1 and the root on an equal but distinct one."""
    first, second = equal_but_distinct()
    model = _model()
    for block, world in zip(model.blocks, (first, second), strict=True):
        parallelize_module(block, world["tp"], TP_PLAN)
        fully_shard(block, mesh=world["dp"])
    fully_shard(model, mesh=second["dp"])
    run_step(model, 0, first["dp"].get_local_rank(), first["dp"].size())
    return Case(model, full_grads(model), copy_groups=(2,))  # within tp, as _fsdp_tp


def half_world_fsdp() -> Case:
    """FSDP2 on a mesh over half the world; both halves see the same batches. No group this
    rank holds joins the two halves' copies: they are compared in the world's all_reduce."""
    return _fsdp_alone(half_of_the_world())


def sliced_hsdp() -> Case:
    world = mesh((2, dist.get_world_size() // 2), ("replicate", "shard"))
    model = _model()
    _shard_per_block(model, world)
    run_step(model, 0, dist.get_rank(), dist.get_world_size())
    # The copies along the replicate dim are compared within it.
    return Case(model, full_grads(model), copy_groups=(world["replicate"].size(),))


def sliced_tp() -> Case:
    """TP on block 0 only: DTensor gradients beside plain ones, every rank the same batch. The
    copies span the world: they are compared in the world's all_reduce."""
    model = _model()
    parallelize_module(model.blocks[0], mesh((dist.get_world_size(),), ("tp",)), TP_PLAN)
    run_step(model, 0, 0, 1)
    return Case(model, full_grads(model))


class _SequenceParallelNet(nn.Module):
    """A norm under SequenceParallel (its gradients stay Partial) beside a plain head."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.second = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.second(self.norm(x))
        # Every rank applies the head to the whole sequence: its gradients are replicas.
        return self.head(h.full_tensor() if isinstance(h, DTensor) else h)


def sliced_sequence_parallel() -> Case:
    tp = mesh((dist.get_world_size(),), ("tp",))
    torch.manual_seed(0)
    model = _SequenceParallelNet()
    parallelize_module(model, tp, {"norm": SequenceParallel(), "second": SequenceParallel()})
    sequence = torch.randn(2, 2 * tp.size(), DIM, generator=torch.Generator().manual_seed(1))
    model(sequence.chunk(tp.size(), dim=1)[tp.get_local_rank()]).pow(2).mean().backward()
    assert all(p.grad.placements[0].is_partial() for p in model.norm.parameters())
    # The Partial addends summed over tp (the world) first; the copies span the world.
    return Case(model, full_grads(model), partial=(tp.size(),))


EXPERTS, EXPERT_DIM = 2, 4  # experts per expert-parallel rank


def _unflattened_with_experts(kind: str) -> Case:
    """Dense parameters under FSDP2 on the dense view beside experts on the sparse view.

    Each ep rank holds its own experts (different values), as DeepSpeed holds plain experts and
    Transformer Engine's grouped experts are DTensors on a mesh without the ep dim ("efsdp"
    here). Their copies differ along ep, which only ``distinct_along`` can tell the norm.
    """
    case = dataclasses.replace(_fsdp_alone(dense_view()["dp"]), groups_or_slots=(2,))
    sparse = sparse_view()
    ep_rank = sparse["ep"].get_local_rank()
    generator = torch.Generator().manual_seed(100 + ep_rank)
    experts = nn.ParameterList()
    for _ in range(EXPERTS):
        full = torch.randn(EXPERT_DIM, EXPERT_DIM, generator=generator)
        if kind == "plain":
            experts.append(nn.Parameter(torch.zeros_like(full)))
            experts[-1].grad = full
        else:
            zeros = distribute_tensor(torch.zeros_like(full), sparse["efsdp"], [Shard(0)])
            experts.append(nn.Parameter(zeros))
            experts[-1].grad = distribute_tensor(full, sparse["efsdp"], [Shard(0)])
    case.model.experts = experts  # type: ignore[assignment]
    mine = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in experts]
    by_ep: list[tuple[int, list[Tensor]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(by_ep, (ep_rank, mine))
    every_expert = dict(entry for entry in by_ep if entry is not None)
    case.oracle += [grad for rank in sorted(every_expert) for grad in every_expert[rank]]
    case.distinct_along = [(list(experts), sparse["ep"])]
    return case


def unflattened_plain_experts() -> Case:
    return _unflattened_with_experts("plain")


def unflattened_dtensor_experts() -> Case:
    return _unflattened_with_experts("dtensor")


# (layout, world size, norm types): every construction and every parallelism at least once.
MATRIX: list[tuple[Callable[[], Case], int, tuple[float, ...]]] = [
    (unflattened_fsdp_tp, 4, (2.0, 0.5)),
    (unflattened_fsdp_tp, 8, (3.0, math.inf)),
    (unflattened_fsdp, 4, (1.0, 2.0)),
    (unflattened_plain_experts, 4, (2.0, math.inf)),
    (unflattened_dtensor_experts, 8, (0.5, 2.0)),
    (flattened_fsdp_tp, 8, (1.0, 2.0)),
    (equal_meshes_fsdp_tp, 4, (3.0, 2.0)),
    (half_world_fsdp, 8, (2.0, 0.5)),
    (sliced_hsdp, 4, (math.inf, 1.0)),
    (sliced_tp, 4, (0.5, 3.0)),
    (sliced_sequence_parallel, 4, (2.0, math.inf)),
]


def _norms_against_the_oracle(build: Callable[[], Case], norm_types: tuple[float, ...]) -> list:
    case = build()
    params = [p for p in case.model.parameters() if p.grad is not None]
    kwargs = {"distinct_along": case.distinct_along}
    total_grad_norm(grads(case.model), 2.0, **kwargs)  # the layout's first call verifies it
    results = []
    for norm_type in norm_types:
        with WireRecorder() as wire:
            ours = total_grad_norm(grads(case.model), norm_type, **kwargs)
        reference = torch.nn.utils.get_total_norm(case.oracle, norm_type)
        results.append(
            (
                norm_type,
                ulp_distance(ours, reference),
                same_bits_everywhere(ours),
                wire.groups,
                case.wires(norm_type),
            )
        )
    # The clip scales every gradient by the coefficient of that same norm.
    reference = torch.nn.utils.get_total_norm(case.oracle, 2.0)
    before = [g.clone() for g in full_grads(case.model)]
    max_norm = float(reference) / 4
    with WireRecorder() as wire:
        total = clip_grad_norm_(params, max_norm, **kwargs)
    results.append(("clip", ulp_distance(total, reference), True, wire.groups, case.wires(2.0)))
    coefficient = max_norm / (float(total) + 1e-6)
    for old, new in zip(before, full_grads(case.model), strict=True):
        # One float32 rounding of the product: within 2e-6 relative.
        torch.testing.assert_close(new, old * coefficient, rtol=2e-6, atol=1e-9)
    return results


@pytest.mark.parametrize(
    ("build", "world", "norm_types"),
    MATRIX,
    ids=[f"{build.__name__}-{world}" for build, world, _ in MATRIX],
)
def test_norm_matches_the_materialised_gradients(ranks, build, world, norm_types):
    for rank, results in enumerate(ranks.run(world, _norms_against_the_oracle, build, norm_types)):
        for norm_type, ulps, same_bits, groups, expected in results:
            label = f"rank {rank} p={norm_type}"
            assert ulps <= TOLERANCE_ULP, f"{label}: {ulps} ULP from the materialised norm"
            assert same_bits, f"{label}: ranks disagree"
            # The size of each collective's process group: the world's all_reduce once.
            assert groups in expected, f"{label}: collectives on groups {groups}, not {expected}"
