"""Copies compared in their own process groups: the same bound, the same verdict on every rank.

Where the copies of a shard meet in process groups a rank already holds (a mesh's Replicate dim;
for the copies of a smaller mesh, the dim of the mesh it was sliced from), the norm compares
them there, one all_reduce per group, and the world's all_reduce carries one flag
(``_norm/group_comparison.py``, the design page's "Where the copies are compared"). On 4 gloo
ranks, a (dp=2, tp=2) mesh:

- the bound of the guide, as ``test_copies_bound.py`` checks it for copies in slots: one copy
  scaled by ``1 + 2 tau`` raises the same ValueError on every rank, on a first and a later call,
  the reference copy or another, in each dtype; within ``tau / 2`` (``tau / 8`` on a first
  call, whose projections move more) every rank returns the same bits, within a few ULPs of
  torch's norm of the materialised gradients (the norm sums the copies' weighted squares in
  float64: 4 float32 ULPs at most, the gradients' own rounding);
- a NaN on one copy makes the norm NaN on every rank;
- groups that the rank maps take for copies but whose ranks hold other shards (a mesh built
  with its ranks in another order) raise the same RuntimeError on every rank, before any
  gradient changes;
- a mesh built from a process group of its own, with no mesh of the call holding its copies,
  is compared in slots of the world's all_reduce, as before, and still caught.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from support.copies_bound import DTYPES, refused_everywhere
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from credit.parallel._norm.copies import tolerance
from credit.parallel.collectives import total_grad_norm
from testbed.layouts import error_of, local_bytes, mesh, ulp_distance
from testbed.world_layouts import wire

WORLD = 4
TOLERANCE_ULP = 4


def _grads(dtype: torch.dtype, case: int) -> list[Tensor]:
    """A gradient replicated on tp of (dp=2, tp=2), and one sharded on the dp mesh sliced from
    it (its copies: the tp peers); shapes of their own per ``case``, so that each case meets its
    layout first."""
    world = mesh((2, 2), ("dp", "tp"))
    generator = torch.Generator().manual_seed(case)
    rows = 4 + 2 * case
    on_tp = torch.randn(rows, 8, generator=generator).to(dtype)
    on_dp = torch.randn(rows, 6, generator=generator).to(dtype)
    return [
        distribute_tensor(on_tp, world, [Shard(0), Replicate()]),
        distribute_tensor(on_dp, world["dp"], [Shard(0)]),
    ]


def _scaled_copy(
    dtype_name: str, which: int, deviant: int, factor_in_tau: float, later: bool, case: int
) -> dict:
    """Gradient ``which`` scaled by ``1 + factor_in_tau * tau`` on rank ``deviant``'s copy."""
    dtype = DTYPES[dtype_name]
    grads = _grads(dtype, case)
    oracle = torch.nn.utils.get_total_norm([g.full_tensor() for g in grads])
    if later:
        total_grad_norm(grads)  # proven
    if dist.get_rank() == deviant:
        grads[which]._local_tensor.mul_(1 + factor_in_tau * tolerance(dtype))
    before = [local_bytes(g._local_tensor) for g in grads]
    records = []
    outcome = error_of(lambda: records.extend(wire(lambda: total_grad_norm(grads))))
    norm = None if outcome is not None else total_grad_norm(grads)
    return {
        "outcome": outcome,
        "unchanged": all(
            torch.equal(b, local_bytes(g._local_tensor)) for b, g in zip(before, grads, strict=True)
        ),
        "norm": None if norm is None else local_bytes(norm),
        "ulps": None if norm is None else ulp_distance(norm.to(oracle.dtype), oracle),
        "relative": None
        if norm is None
        else float((norm.double() - oracle.double()).abs() / oracle),
        "groups": [c.group for c in records],
    }


@pytest.mark.parametrize("later", [False, True], ids=["first call", "later call"])
@pytest.mark.parametrize("which", [0, 1], ids=["replicated on tp", "dp mesh, tp peers"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_one_copy_beyond_the_bound_raises_in_its_group(ranks, dtype_name, which, later):
    case = 8 * list(DTYPES).index(dtype_name) + 4 * which + 2 * later
    for deviant in (0, 3):  # the reference copy of its group, and another group's other copy
        caught = ranks.run(WORLD, _scaled_copy, dtype_name, which, deviant, 2.0, later, case)
        refused_everywhere([(r["outcome"] or (None, ""))[:2] for r in caught])
        assert all(r["unchanged"] for r in caught), "a gradient changed"
        within_factor = 0.5 if later else 0.125
        within = ranks.run(
            WORLD, _scaled_copy, dtype_name, which, deviant, within_factor, later, case + 1
        )
        for result in within:
            assert result["outcome"] is None, result["outcome"]
            assert torch.equal(result["norm"], within[0]["norm"]), "the same bits on every rank"
            # One copy within the bound moves the norm by less than the bound.
            assert result["relative"] <= tolerance(DTYPES[dtype_name]), result["relative"]
        if later:  # one all_reduce within tp, then the world's
            assert all(r["groups"] == [2, WORLD] for r in within), within[0]["groups"]
        case += 16


@pytest.mark.parametrize("later", [False, True], ids=["first call", "later call"])
def test_copies_that_agree_give_the_norm_of_the_materialised_gradients(ranks, later):
    for result in ranks.run(WORLD, _scaled_copy, "float32", 0, 0, 0.0, later, 60 + later):
        assert result["outcome"] is None, result["outcome"]
        assert result["ulps"] <= TOLERANCE_ULP, result["ulps"]


def _nan_on_one_copy() -> bytes:
    grads = _grads(torch.float32, 40)
    total_grad_norm(grads)  # proven
    if dist.get_rank() == 1:
        grads[1]._local_tensor[0, 0] = float("nan")
    return local_bytes(total_grad_norm(grads)).numpy().tobytes()


def test_a_nan_on_one_copy_reaches_every_rank(ranks):
    norms = ranks.run(WORLD, _nan_on_one_copy)
    assert len(set(norms)) == 1, "the same bits on every rank"
    assert torch.frombuffer(bytearray(norms[0]), dtype=torch.float32).isnan().all()


def _other_shards_in_a_group() -> dict:
    """A dp mesh built directly, in reverse order on the second tp column: rank 3 holds shard 0
    and rank 1 shard 1, so the tp group {0, 1} of the (dp, tp) mesh holds shards 0 and 1."""
    world = mesh((2, 2), ("dp", "tp"))
    # Every rank builds both (their process groups are made by all ranks, in order).
    columns = [DeviceMesh("cpu", torch.tensor(c), mesh_dim_names=("dp",)) for c in ([0, 2], [3, 1])]
    dp = next(column for column in columns if column.get_coordinate() is not None)
    on_tp = distribute_tensor(torch.ones(4, 8), world, [Shard(0), Replicate()])
    coordinate = dp.get_coordinate()
    assert coordinate is not None
    local = torch.full((2, 6), float(coordinate[0] + 1))
    on_dp = DTensor.from_local(local, dp, [Shard(0)], run_check=False)
    before = local_bytes(local)
    outcome = error_of(lambda: total_grad_norm([on_tp, on_dp]))
    return {"outcome": outcome, "unchanged": torch.equal(before, local_bytes(local))}


def test_groups_that_hold_other_shards_raise_on_every_rank(ranks):
    results = ranks.run(WORLD, _other_shards_in_a_group)
    outcomes = [r["outcome"] for r in results]
    assert all(o is not None and o[0] == "RuntimeError" for o in outcomes), outcomes
    assert len({o[1] for o in outcomes}) == 1, "every rank raises the same message"
    message = outcomes[0][1]
    assert "gradient 1 (DTensor shape=(4, 6)" in message, message
    assert "slices of one DeviceMesh" in message, message
    assert message.endswith("No gradient was modified.")
    assert all(r["unchanged"] for r in results)


def _mesh_from_its_own_group(deviant: int) -> dict:
    """FSDP2's dp shards on a mesh made from a process group, with no other mesh in the call:
    no group in hand holds their copies (the tp peers), so they take slots as before."""
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    dp = DeviceMesh.from_group(dp_groups[dist.get_rank() % 2], "cpu", mesh_dim_names=("dp",))
    coordinate = dp.get_coordinate()
    assert coordinate is not None
    local = torch.full((2, 6), float(coordinate[0] + 1))
    if dist.get_rank() == deviant:
        local.mul_(1.5)
    grad = DTensor.from_local(local, dp, [Shard(0)], run_check=False)
    records: list = []
    outcome = error_of(lambda: records.extend(wire(lambda: total_grad_norm([grad]))))
    return {"outcome": outcome, "groups": [c.group for c in records]}


def test_a_mesh_from_its_own_group_is_compared_in_slots(ranks):
    clean = ranks.run(WORLD, _mesh_from_its_own_group, -1)
    assert all(r["outcome"] is None for r in clean), clean
    # The proof (its self-check and slots), then the norm: over the world alone.
    assert all(r["groups"] == [WORLD, WORLD] for r in clean), clean[0]["groups"]
    refused_everywhere([r["outcome"] for r in ranks.run(WORLD, _mesh_from_its_own_group, 3)])
