"""The copies' bound as documented: copies that differ beyond it never yield a number, copies
within it yield the same number on every rank.

The guide states the test (``docs/guide.rst``, "Copies proven by value"): for each group of ``c``
copies and each fingerprint column, the spread ``sqrt(sum (f_i - mean f)**2)`` must not exceed
``tau * mean norm``. One copy that differs from the others by ``e`` has spread
``e * sqrt((c - 1) / c)``, between ``e / sqrt(2)`` and ``e``: it is caught whenever
``e > sqrt(2) * tau * mean norm``, whichever copy it is and however many copies there are, and
passes when ``e < tau * mean norm``. So each case below scales one copy by ``1 + 2 tau`` (caught)
or ``1 + tau / 2`` (within; ``1 + tau / 8`` on a first call, whose projections a scaled copy
moves by up to a few times its norm's change), for 2, 3 and 4 copies, the reference copy (rank 0, the stage's
lowest rank) and another, float32, bfloat16 and float16, on the layout's first call and on a
later one. Within the bound every rank returns the reference copy's norm, the same bits on every
rank (the oracle: torch's ``get_total_norm`` of rank 0's gradients).

Then the layouts users train on, each on real gloo ranks: a bfloat16 copy x1.5 under a
Replicate DTensor, a float32 FSDP2 shard on dp of (dp=2, tp=2) off by ``6 tau``, a bf16 DDP
model whose boundary backward ran under ``no_sync()``, a second bf16 model initialised per rank;
the report's groups on plain replicas (a NaN in one rank's copy, copies within the bound); and
the no-false-alarm runs: bf16 DDP and FSDP2 x TP with SequenceParallel over many steps, measuring
how far legitimate copies' local norms really are apart (the margin the guide quotes).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from support.copies_bound import (
    DTYPES,
    bf16_ddp_steps,
    bf16_fsdp_tp_sp_steps,
    legitimate_everywhere,
    refused_everywhere,
)
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

from credit.parallel._norm.copies import fingerprints, tolerance
from credit.parallel.collectives import clip_grad_norm_, total_grad_norm
from credit.parallel.norm_report import grad_norm_report
from testbed.layouts import error_of, local_bytes, mesh, same_bits_everywhere

# ---------------------------------------------------------------------------------------------
# 1. The bound: 2, 3 and 4 copies, the reference and another copy, three dtypes, two calls


def _scaled_copy(
    dtype_name: str, deviant: int, factor_in_tau: float, later: bool, case: int
) -> list:
    """Plain replicas of three gradients; ``deviant``'s copy of the first scaled by
    ``1 + factor_in_tau * tau``, on the layout's first call or after a clean call proved it.
    ``case`` picks a shape no other case of the session uses: each meets its layout first."""
    dtype = DTYPES[dtype_name]
    generator = torch.Generator().manual_seed(case)
    grads = [torch.randn(4 + case, 37, generator=generator).to(dtype) for _ in range(3)]
    if later:
        assert same_bits_everywhere(total_grad_norm(grads))
    if dist.get_rank() == deviant:
        grads[0].mul_(1 + factor_in_tau * tolerance(dtype))
    reference = grads if dist.get_rank() == 0 else None
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, reference)
    oracle = torch.nn.utils.get_total_norm(gathered[0])
    outcome = error_of(lambda: total_grad_norm(grads))
    norm = None if outcome is not None else total_grad_norm(grads)
    return [outcome, None if norm is None else (local_bytes(norm), local_bytes(oracle))]


@pytest.mark.parametrize("copies", [2, 3, 4])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_one_copy_beyond_the_bound_raises_and_within_it_every_rank_agrees(
    ranks, copies, dtype_name
):
    case = 8 * list(DTYPES).index(dtype_name)
    for deviant in (0, copies - 1):  # the reference copy, and another
        for later in (False, True):
            caught = ranks.run(copies, _scaled_copy, dtype_name, deviant, 2.0, later, case)
            refused_everywhere([r[0] for r in caught])
            # A first call compares projections too, which a scaled copy moves by the scale
            # times each projection (up to a few times the norm): there, within is 1 + tau / 8.
            within_factor = 0.5 if later else 0.125
            within = ranks.run(
                copies, _scaled_copy, dtype_name, deviant, within_factor, later, case + 1
            )
            for outcome, bits in within:
                assert outcome is None, outcome
                ours, oracle = bits
                assert torch.equal(ours, within[0][1][0]), "the same bits on every rank"
                assert torch.equal(ours, oracle), "the reference copy's norm, torch's bits"
            case += 2


# ---------------------------------------------------------------------------------------------
# 2. The layouts users train on


def _replicate_dtensor_x1_5(dtype: torch.dtype) -> list:
    tp = mesh((4,), ("tp",))
    torch.manual_seed(0)
    grad = distribute_tensor(torch.randn(16, 16).to(dtype), tp, [Replicate()])
    total_grad_norm([grad])  # proven
    if dist.get_rank() == 3:
        grad._local_tensor.mul_(1.5)
    return [error_of(lambda: total_grad_norm([grad]))]


def _fsdp_shard_off_by_six_tau(dtype: torch.dtype) -> list:
    dp_tp = mesh((2, 2), ("dp", "tp"))
    torch.manual_seed(0)
    grad = distribute_tensor(torch.randn(8, 32).to(dtype), dp_tp["dp"], [Shard(0)])
    total_grad_norm([grad])  # proven: the tp peers of each dp shard are copies
    if dist.get_rank() == 3:
        grad._local_tensor.mul_(1 + 6 * tolerance(dtype))
    return [error_of(lambda: total_grad_norm([grad]))]


def _ddp_boundary_under_no_sync(dtype: torch.dtype) -> list:
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4)).to(dtype))
    optimizer = torch.optim.AdamW(model.parameters(), eps=1e-4)  # an eps float16 can hold
    batch = torch.randn(4 * dist.get_world_size(), 16).to(dtype)
    mine = batch.chunk(dist.get_world_size())[dist.get_rank()]
    model(mine).float().pow(2).mean().backward()  # a synced step proves the layout
    clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    with model.no_sync():  # the boundary step by mistake: each rank keeps its own batch's grads
        model(mine * 2).float().pow(2).mean().backward()
    return [error_of(lambda: clip_grad_norm_(model.parameters(), 1.0))]


def _second_model_per_rank(dtype: torch.dtype) -> list:
    torch.manual_seed(0)
    first = nn.Linear(16, 16).to(dtype)
    first(torch.ones(2, 16).to(dtype)).float().pow(2).sum().backward()
    total_grad_norm([p.grad for p in first.parameters()])  # proves the shapes
    torch.manual_seed(1 + dist.get_rank())
    second = nn.Linear(16, 16).to(dtype)
    second(torch.ones(2, 16).to(dtype)).float().pow(2).sum().backward()
    return [error_of(lambda: clip_grad_norm_(second.parameters(), 1.0))]


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize(
    "body",
    [
        _replicate_dtensor_x1_5,
        _fsdp_shard_off_by_six_tau,
        _ddp_boundary_under_no_sync,
        _second_model_per_rank,
    ],
    ids=["replicate_dtensor_x1.5", "fsdp_dp_x_tp_6tau", "ddp_no_sync", "second_model"],
)
def test_copies_that_users_get_wrong_raise_on_every_rank(ranks, body, dtype_name):
    refused_everywhere([r[0] for r in ranks.run(4, body, DTYPES[dtype_name])])


# ---------------------------------------------------------------------------------------------
# 3. The report's groups on plain replicas: the same value on every rank


def _report_on_plain_replicas(poison: float | None) -> list:
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("fc1", nn.Linear(8, 8))
    model.add_module("fc2", nn.Linear(8, 2))
    model(torch.ones(2, 8)).pow(2).sum().backward()
    total_grad_norm([p.grad for p in model.parameters()])  # proven
    weight = model.fc1.weight.grad
    assert weight is not None
    if dist.get_rank() == 3:
        if poison is None:  # within the tolerance: not bit-identical, not beyond the bound
            weight.mul_(1 + 2e-6)
        else:
            weight[1, 2] = poison
    report = grad_norm_report(model.named_parameters(), group_by=lambda name, _: name.split(".")[0])
    total = total_grad_norm([p.grad for p in model.parameters()])
    return [report, local_bytes(total)]


@pytest.mark.parametrize("poison", [None, math.nan], ids=["within", "nan"])
def test_the_report_on_plain_replicas_is_the_same_on_every_rank(ranks, poison):
    results = ranks.run(4, _report_on_plain_replicas, poison)
    groups, total = results[0]
    for other_groups, other_total in results[1:]:
        assert other_groups.keys() == groups.keys()
        for name, value in groups.items():
            same = other_groups[name] == value or (
                math.isnan(value) and math.isnan(other_groups[name])
            )
            assert same, (name, value, other_groups[name])
        assert torch.equal(other_total, total)
    if poison is not None:
        fc1 = [name for name in groups if "fc1" in name]
        assert fc1, groups.keys()
        assert all(math.isnan(groups[name]) for name in fc1), groups
        assert all(math.isfinite(groups[name]) for name in groups if "fc2" in name), groups


# ---------------------------------------------------------------------------------------------
# 4. No false alarm over many steps of real bf16 training, and the margin measured


@pytest.mark.parametrize("body", [bf16_ddp_steps, bf16_fsdp_tp_sp_steps], ids=["ddp", "fsdp_tp_sp"])
def test_legitimate_bf16_copies_never_raise_over_many_steps(ranks, body):
    legitimate_everywhere(ranks.run(4, body, timeout_s=180))


def test_reduce_order_roundings_stay_far_below_tau():
    """What legitimate copies differ by when computed apart: eight addends summed in another
    order (as two groups' collectives may), or with one rounding, in the reduce dtype; the
    fingerprints' largest difference, relative to the norm, over 50 tensors of 33 to 165,000
    elements. The guide quotes these margins: about 75x in float32, 5x in bfloat16, 3.5x in
    float16 on this machine."""
    for dtype in DTYPES.values():
        worst = 0.0
        for seed in range(50):
            generator = torch.Generator().manual_seed(seed)
            rows = (1, 7, 64, 1000, 5000)[seed % 5]
            parts = [torch.randn(rows, 33, generator=generator).to(dtype) for _ in range(8)]
            forward, backward = parts[0].clone(), parts[-1].clone()
            for part in parts[1:]:
                forward = forward + part
            for part in reversed(parts[:-1]):
                backward = backward + part
            once = torch.stack(parts).float().sum(0).to(dtype)
            prints = fingerprints([forward, backward, once], torch.device("cpu"))
            for a, b in ((0, 1), (0, 2), (1, 2)):
                worst = max(worst, float((prints[a] - prints[b]).abs().max() / prints[a][0]))
        assert 0.0 < worst <= tolerance(dtype) / 2, (dtype, worst)
