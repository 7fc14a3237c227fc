"""Never a wrong number on any call: the copies are compared on every call, not once per shape.

A layout's plan (its weights, its copy counts) is built once and kept, and the first call for it
proves the copies with full fingerprints. What a later call passes may still be other tensors of
the same shapes: a second model, replicas that drifted, a NaN on one rank. Every call therefore
compares the copies' local norms, in the process groups where they meet (tp, HSDP's replicas:
one all_reduce each, whose verdict rides on the world's as a flag) or else inside the world's one
all_reduce; copies that differ make the norm NaN on every rank and, where reading is free (here,
on the CPU) or the caller reads anyway (``error_if_nonfinite``), raise the named ValueError on
every rank before any gradient changes.

Each case runs on real gloo ranks, with real FSDP2 and DTensors: it first proves a layout with
legitimate copies, then hands the norm tensors of the same shapes that are not copies, and
asserts the same error on every rank and gradients left untouched. The oracle for the legitimate
calls is torch's norm of the materialised gradients (``full_tensor()``), within 8 float32 ULP as
in test_ownership.py, the same bits on every rank. The last case re-forms the process group in
the same processes (an in-process restart) and asserts that nothing proven under the old group
is trusted under the new one.
"""

from __future__ import annotations

import math
import os
import tempfile
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from support.multirank import RankPool
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from credit.parallel._common.scoped import ScopedCache
from credit.parallel.collectives import clip_grad_norm_, total_grad_norm
from credit.parallel.replicas import ReplicaMismatchError, verify_replicas
from testbed.layouts import error_of, local_bytes, mesh, same_bits_everywhere, ulp_distance

TOLERANCE_ULP = 8
COPIES_DIFFER = "holds different values on ranks that the rank maps take for copies"


def _linear(seed: int) -> nn.Linear:
    """An 8x8 linear layer with weights from ``seed`` and gradients from one backward."""
    torch.manual_seed(seed)
    layer = nn.Linear(8, 8)
    (layer(torch.ones(2, 8)) ** 2).sum().backward()
    return layer


def _grads(module: nn.Module) -> list[Tensor]:
    return [p.grad for p in module.parameters() if p.grad is not None]


def _snapshot(grads: list[Tensor]) -> list[Tensor]:
    return [local_bytes(grad) for grad in grads]


def _unchanged(grads: list[Tensor], before: list[Tensor]) -> bool:
    return all(torch.equal(local_bytes(g), b) for g, b in zip(grads, before, strict=True))


def _refused_everywhere(results: list[tuple[str, str] | None], what: str) -> None:
    """Every rank raised the same ValueError about copies that differ, naming ``what``."""
    assert all(result is not None for result in results), results
    kinds = {result[0] for result in results if result is not None}
    messages = {result[1] for result in results if result is not None}
    assert kinds == {"ValueError"}, results
    assert len(messages) == 1, f"ranks raised different messages: {messages}"
    (message,) = messages
    assert COPIES_DIFFER in message, message
    assert what in message, message
    assert "No gradient was modified" in message, message


def _matches_oracle(ours: Tensor, full: list[Tensor], norm_type: float) -> None:
    reference = torch.nn.utils.get_total_norm(full, norm_type)
    assert ulp_distance(ours, reference) <= TOLERANCE_ULP, (ours, reference)
    assert same_bits_everywhere(ours)


# ---------------------------------------------------------------------------------------------
# 1. Two models of the same shapes: the second is no copy, whatever the first proved


def _twin_models(norm_type: float) -> list:
    teacher = _linear(0)  # seeded alike: copies on every rank
    student = _linear(100 + dist.get_rank())  # seeded per rank: not copies
    _matches_oracle(total_grad_norm(_grads(teacher), norm_type), _grads(teacher), norm_type)
    before = _snapshot(_grads(student))
    norm = error_of(lambda: total_grad_norm(_grads(student), norm_type))
    clip = error_of(
        lambda: clip_grad_norm_(student.named_parameters(), 1.0, norm_type, error_if_nonfinite=True)
    )
    clip_default = error_of(lambda: clip_grad_norm_(student.named_parameters(), 1.0, norm_type))
    untouched = _unchanged(_grads(student), before)
    # The proven layout still works for the teacher afterwards.
    _matches_oracle(total_grad_norm(_grads(teacher), norm_type), _grads(teacher), norm_type)
    return [norm, clip, clip_default, untouched]


@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["l2", "inf"])
def test_a_second_model_of_the_same_shapes_is_compared(ranks, norm_type):
    results = ranks.run(2, _twin_models, norm_type)
    for index in range(3):
        _refused_everywhere([r[index] for r in results], "")
    assert "weight" in results[0][1][1], "the clip names the parameter"
    assert all(r[3] for r in results), "no gradient changed on any rank"


# ---------------------------------------------------------------------------------------------
# 2. The same with DTensors: a Replicate DTensor, FSDP2 on dp x tp, pipeline stages


def _replicated(tp: DeviceMesh, seed: int) -> Tensor:
    torch.manual_seed(seed)
    return distribute_tensor(torch.randn(6, 4), tp, [Replicate()])


def _replicate_dtensor_peers_differ() -> list:
    tp = mesh((4,), ("tp",))
    proven = _replicated(tp, 0)
    _matches_oracle(total_grad_norm([proven]), [proven.full_tensor()], 2.0)
    torch.manual_seed(dist.get_rank())  # each tp rank its own values under a Replicate placement
    differing = DTensor.from_local(torch.randn(6, 4), tp, [Replicate()], run_check=False)
    return [error_of(lambda: total_grad_norm([differing]))]


def _fsdp_model(dp_tp: DeviceMesh, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    fully_shard(model, mesh=dp_tp["dp"])
    (model(torch.ones(4, 8)) ** 2).sum().backward()
    return model


def _fsdp_tp_peers_differ() -> list:
    dp_tp = mesh((2, 2), ("dp", "tp"))
    coordinate = dp_tp.get_coordinate()
    assert coordinate is not None
    proven = _fsdp_model(dp_tp, 0)  # the tp peers of each dp shard hold copies
    full = [g.full_tensor() for g in _grads(proven)]
    _matches_oracle(total_grad_norm(_grads(proven)), full, 2.0)
    halves = _fsdp_model(dp_tp, 10 + coordinate[1])  # undeclared halves: tp peers differ
    before = _snapshot(_grads(halves))
    error = error_of(lambda: clip_grad_norm_(halves.named_parameters(), 1.0))
    return [error, _unchanged(_grads(halves), before)]


def _pipeline_stages_differ() -> list:
    pp_dp = mesh((2, 2), ("pp", "dp"))
    coordinate = pp_dp.get_coordinate()
    assert coordinate is not None
    stage = coordinate[0]
    pp_group = pp_dp["pp"].get_group()
    proven = _linear(stage)  # dp replicas within each stage
    first = total_grad_norm(_grads(proven), pp_group=pp_group)
    assert same_bits_everywhere(first)
    drifting = _linear(stage + 10 * coordinate[1])  # dp peers of a stage differ
    return [error_of(lambda: total_grad_norm(_grads(drifting), pp_group=pp_group))]


@pytest.mark.parametrize(
    "body",
    [_replicate_dtensor_peers_differ, _fsdp_tp_peers_differ, _pipeline_stages_differ],
    ids=["replicate_dtensor", "fsdp_dp_x_tp", "pipeline"],
)
def test_dtensors_of_a_proven_shape_are_compared(ranks, body):
    results = ranks.run(4, body)
    _refused_everywhere([r[0] for r in results], "")
    if len(results[0]) > 1:
        assert all(r[1] for r in results), "no gradient changed on any rank"


# ---------------------------------------------------------------------------------------------
# 3. Replicas that drift after the first call


def _drift(kind: str) -> list:
    if kind == "plain":
        layer = _linear(0)
        grads = _grads(layer)
        total_grad_norm(grads)  # proven
        if dist.get_rank() == 1:  # a boundary step run under no_sync by mistake, on one rank
            for grad in grads:
                grad.mul_(1.01)
        before = _snapshot(grads)
        error = error_of(lambda: clip_grad_norm_(layer.parameters(), 1.0))
    else:
        tp = mesh((4,), ("tp",))
        grads = [_replicated(tp, 0)]
        total_grad_norm(grads)  # proven
        if dist.get_rank() == 2:
            grads[0]._local_tensor.mul_(1.01)  # a Replicate DTensor drifting by 1 %
        before = _snapshot(grads)
        error = error_of(lambda: total_grad_norm(grads))
    return [error, _unchanged(grads, before)]


@pytest.mark.parametrize("kind", ["plain", "replicate_dtensor"])
def test_replicas_that_drift_after_the_first_call_raise_on_every_rank(ranks, kind):
    results = ranks.run(4, _drift, kind)
    _refused_everywhere([r[0] for r in results], "")
    assert all(r[1] for r in results), "no gradient changed on any rank"


# ---------------------------------------------------------------------------------------------
# 4. A NaN or inf in one rank's copy of a plain replica reaches every rank


def _nonfinite_on_one_rank(value: float, norm_type: float) -> list:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    (model(torch.ones(2, 8)) ** 2).sum().backward()
    grads = _grads(model)
    first = total_grad_norm(grads, norm_type)  # the layout's first call proves the copies
    if dist.get_rank() == 3:  # after the sync: a faulty device, a rank-local hook
        grads[0][1, 2] = value
    norm = total_grad_norm(grads, norm_type)
    before = _snapshot(grads)
    raised = error_of(
        lambda: clip_grad_norm_(model.parameters(), 1.0, norm_type, error_if_nonfinite=True)
    )
    return [local_bytes(first), norm.item(), raised, _unchanged(grads, before)]


@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["l2", "inf"])
@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
def test_a_nonfinite_copy_on_one_rank_reaches_every_rank(ranks, value, norm_type):
    results = ranks.run(4, _nonfinite_on_one_rank, value, norm_type)
    for first, norm, raised, untouched in results:
        assert torch.equal(first, results[0][0])
        if math.isnan(value):
            assert math.isnan(norm), results
        else:
            assert norm == math.inf, results
        assert raised is not None and raised[0] == "RuntimeError", raised
        assert "non-finite" in raised[1]
        assert untouched


# ---------------------------------------------------------------------------------------------
# 5. A process group formed again in the same processes starts from nothing proven


def _reform(path: str, world: int, rank: int) -> None:
    dist.destroy_process_group()
    store = dist.FileStore(path, world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )


def _restart_in_process(directory: str) -> list:
    # Four ranks prove a layout of plain replicas and the replica check of a model.
    layer = _linear(0)
    optimizer = torch.optim.AdamW(layer.parameters())
    total_grad_norm(_grads(layer))
    verify_replicas(layer, optimizer)
    old_rank = dist.get_rank()
    if old_rank == 0:  # rank 0 leaves; the others form a group of three, re-ranked 0 to 2
        dist.destroy_process_group()
        return ["left"]
    _reform(os.path.join(directory, "three"), 3, old_rank - 1)
    # Same shapes, other values on each rank: not copies, under the new group as under the old.
    with torch.no_grad():
        for param in layer.parameters():
            param.add_(float(old_rank))
            param.grad.add_(float(old_rank))  # type: ignore[union-attr]
    norm = error_of(lambda: total_grad_norm(_grads(layer)))
    replicas = error_of(lambda: verify_replicas(layer, optimizer))
    dist.destroy_process_group()
    return [norm, replicas]


@pytest.mark.slow
def test_a_group_formed_again_in_process_starts_from_nothing_proven():
    pool = RankPool(4)  # its own workers: the group they end with is not the pool's
    try:
        with tempfile.TemporaryDirectory() as directory:
            results = pool.run(_restart_in_process, directory)
    finally:
        pool.stop()
    assert results[0] == ["left"]
    _refused_everywhere([r[0] for r in results[1:]], "")
    for _, replicas in results[1:]:
        assert replicas is not None and replicas[0] == ReplicaMismatchError.__name__, replicas
    assert len({r[1] for r in results[1:]}) == 1, "the replica check raised alike on every rank"


# ---------------------------------------------------------------------------------------------
# On a GPU the verdict stays on the device: a NaN norm without a sync, the error where it reads

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device (torch.cuda.is_available() is False)"
)


def _verdict_on_the_device() -> list:
    torch.cuda.set_device(0)  # the ranks share one GPU
    teacher, student = _linear(0).cuda(), _linear(100 + dist.get_rank()).cuda()
    total_grad_norm(_grads(teacher))  # proves the layout of both
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            norm = total_grad_norm(_grads(student))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchronizing CUDA operation" in str(w.message)]
    before = _snapshot(_grads(student))
    raised = error_of(
        lambda: clip_grad_norm_(student.named_parameters(), 1.0, error_if_nonfinite=True)
    )
    return [syncs, math.isnan(norm.item()), raised, _unchanged(_grads(student), before)]


@needs_cuda
def test_on_a_gpu_copies_that_differ_give_nan_without_a_sync_and_raise_where_it_reads(ranks):
    results = ranks.run(2, _verdict_on_the_device)
    assert all(r[0] == [] for r in results), [r[0] for r in results]
    assert all(r[1] for r in results), "the norm is NaN on every rank"
    _refused_everywhere([r[2] for r in results], "weight")
    assert all(r[3] for r in results), "no gradient changed on any rank"


def test_a_scoped_cache_keeps_the_most_recently_used_entries():
    """Without a process group (this process has none), a ScopedCache is a plain LRU cache; the
    re-formed group above shows it dropping everything when the group changes."""
    assert not dist.is_initialized()
    cache: ScopedCache[str, int] = ScopedCache(2)
    assert cache.put("a", 1) == 1
    cache.put("b", 2)
    assert cache.get("a") == 1  # "a" is now the most recently used
    cache.put("c", 3)
    assert cache.get("b") is None
    assert (cache.get("a"), cache.get("c")) == (1, 3)
