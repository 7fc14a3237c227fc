"""Every check that the arguments alone decide comes before any collective, on every rank.

One process plays rank 1 of a fake world of four ranks (torch's fake backend, a (dp=2, tp=2)
mesh), so that every public function takes its distributed path; every collective of
``torch.distributed`` is then replaced by one that raises :class:`CollectiveCalled`, and torch's
``CommDebugMode`` counts the collectives that go around it (DTensor's, c10d's ops). Each public
function is called with each bad argument, in the check mode and outside it: it must raise its
documented TypeError, ValueError or RuntimeError, naming the argument, and issue no collective.
A check made after a collective would let a rank that raised leave the others waiting in it.

Each mode runs in a fresh spawned process, as ``tests/test_scale.py`` runs its fake worlds.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from credit.parallel.collectives import (
    all_reduce_avg,
    allreduce_grads_avg,
    clip_grad_norm_,
    clip_grads_with_norm_,
    get_total_norm,
    total_grad_norm,
)
from credit.parallel.grad_sync import sync_domain_gradients, sync_replicated_gradients
from credit.parallel.integrations import accelerate, torchtitan
from credit.parallel.integrations.lightning import MeshSafeGradientClipping
from credit.parallel.norm_report import grad_norm_report
from credit.parallel.replicas import verify_replicas
from credit.parallel.spikes import SpikePolicy

WORLD, RANK = 4, 1
# Every collective and point-to-point call of torch.distributed, whichever the library calls.
COLLECTIVES = (
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "irecv",
    "isend",
    "monitored_barrier",
    "recv",
    "recv_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "send_object_list",
)
POSITIVE = r"norm_type must be positive or inf"
NOT_A_NUMBER = r"norm_type must be a real number or 'inf'"
PP_2D = r"pp_group must be a ProcessGroup or a 1D DeviceMesh"

# name: (error, pattern its message matches), for every case :func:`_calls` builds.
EXPECTED: dict[str, tuple[str, str]] = {
    "total_grad_norm: norm_type a string": ("TypeError", NOT_A_NUMBER),
    "total_grad_norm: norm_type NaN": ("ValueError", r"norm_type must not be NaN"),
    "total_grad_norm: norm_type negative, DTensor": ("ValueError", POSITIVE),
    "total_grad_norm: norm_type 0, pipeline stages": ("ValueError", POSITIVE),
    "total_grad_norm: norm_type 0, distinct_along": ("ValueError", POSITIVE),
    "total_grad_norm: pp_group a 2D mesh": ("ValueError", PP_2D),
    "total_grad_norm: pp_group not a group": ("TypeError", r"pp_group must be a ProcessGroup"),
    "total_grad_norm: pp_group of 3 ranks in 4": ("ValueError", r"does not divide the world size"),
    "total_grad_norm: distinct_along not pairs": (
        "TypeError",
        r"distinct_along must be an iterable of \(tensors, group\) pairs",
    ),
    "total_grad_norm: distinct_along[0] not a pair": (
        "TypeError",
        r"distinct_along\[0\] must be a \(tensors, group\) pair",
    ),
    "total_grad_norm: distinct_along group a 2D mesh": (
        "ValueError",
        r"distinct_along\[0\] must be a ProcessGroup or a 1D DeviceMesh",
    ),
    "total_grad_norm: per_rank with a DTensor": ("ValueError", r"grads\[0\] is a DTensor"),
    "total_grad_norm: per_rank with pp_group": ("ValueError", r"per_rank=True .* pp_group"),
    "total_grad_norm: grads not tensors": ("TypeError", r"grads\[1\] is a str"),
    "get_total_norm: norm_type a string": ("TypeError", NOT_A_NUMBER),
    "get_total_norm: norm_type negative, DTensor": ("ValueError", POSITIVE),
    "get_total_norm: tensors not tensors": ("TypeError", r"tensors\[0\] is a int"),
    "clip_grad_norm_: max_norm NaN": ("ValueError", r"max_norm must be a non-negative number"),
    "clip_grad_norm_: max_norm a string": ("TypeError", r"max_norm must be a float or a scalar"),
    "clip_grad_norm_: max_norm of two elements": ("ValueError", r"max_norm must be a scalar"),
    "clip_grad_norm_: norm_type negative, DTensor": ("ValueError", POSITIVE),
    "clip_grad_norm_: norm_type 0, pipeline stages": ("ValueError", POSITIVE),
    "clip_grad_norm_: parameters None": ("TypeError", r"parameters must be a tensor or an"),
    "clip_grad_norm_: pp_group a 2D mesh": ("ValueError", PP_2D),
    "clip_grads_with_norm_: total_norm not a tensor": ("TypeError", r"total_norm must be a"),
    "all_reduce_avg: tensor not a tensor": ("TypeError", r"tensor must be a torch.Tensor"),
    "all_reduce_avg: an integer tensor": ("TypeError", r"tensor\[0\] has dtype torch.int64"),
    "all_reduce_avg: group a 2D mesh": ("ValueError", r"group must be a ProcessGroup or a 1D"),
    "allreduce_grads_avg: bucket_cap_mb 0": ("ValueError", r"bucket_cap_mb must be positive"),
    "allreduce_grads_avg: grads not tensors": ("TypeError", r"grads\[1\] is a str"),
    "allreduce_grads_avg: group a 2D mesh": ("ValueError", r"group must be a ProcessGroup or a 1D"),
    "sync_domain_gradients: model_or_params not tensors": (
        "TypeError",
        r"model_or_params must be a tensor or an iterable",
    ),
    "sync_replicated_gradients: model_or_params not tensors": (
        "TypeError",
        r"model_or_params must be a tensor or an iterable",
    ),
    "grad_norm_report: norm_type 0": ("ValueError", POSITIVE),
    "grad_norm_report: norm_type a string": ("TypeError", NOT_A_NUMBER),
    "grad_norm_report: named_parameters a tensor": (
        "TypeError",
        r"named_parameters must be an iterable of \(name, tensor\) pairs",
    ),
    "grad_norm_report: group_by gives an int": ("TypeError", r"group_by returned int"),
    "grad_norm_report: a group named total": ("ValueError", r"'total', which is reserved"),
    "grad_norm_report: groups repeats a name": ("ValueError", r"groups must be distinct names"),
    "grad_norm_report: groups misses a group": ("ValueError", r"groups does not name"),
    "grad_norm_report: pp_group a 2D mesh": ("ValueError", PP_2D),
    "SpikePolicy.clip_grad_norm_: max_norm 0": ("ValueError", r"SpikePolicy's max_norm=0"),
    "SpikePolicy.clip_grad_norm_: max_norm a tensor": (
        "TypeError",
        r"SpikePolicy's max_norm must be a number",
    ),
    "SpikePolicy.clip_grad_norm_: groups not a report": (
        "TypeError",
        r"groups must be the step's grad_norm_report",
    ),
    "SpikePolicy.clip_grad_norm_: norm_type negative, DTensor": ("ValueError", POSITIVE),
    "SpikePolicy.clip_grad_norm_: norm_type a string": ("TypeError", NOT_A_NUMBER),
    "SpikePolicy.clip_grad_norm_: pp_group a 2D mesh": ("ValueError", PP_2D),
    "SpikePolicy.clip_grad_norm_: skips without a GradScaler": (
        "RuntimeError",
        r"decides for a GradScaler",
    ),
    "verify_replicas: model not a module": ("TypeError", r"model must be a torch.nn.Module"),
    "verify_replicas: optimizer not an optimizer": (
        "TypeError",
        r"optimizer must be a torch.optim.Optimizer",
    ),
    "verify_replicas: repair_from without repair": ("ValueError", r"pass it with repair=True"),
    "verify_replicas: pp_group a 2D mesh": ("ValueError", PP_2D),
    "accelerate.clip_grad_norm_: norm_type negative, DTensor": ("ValueError", POSITIVE),
    "accelerate.clip_grad_norm_: pp_group a 2D mesh": ("ValueError", PP_2D),
    "accelerate.clip_grad_norm_: max_norm NaN": ("ValueError", r"max_norm must be a non-negative"),
    "accelerate.clip_grad_norm_: log_as empty": ("ValueError", r"log_as must be a non-empty key"),
    "lightning clip_grad_norm_: norm_type negative, DTensor": ("ValueError", POSITIVE),
    "lightning clip_grad_norm_: max_norm NaN": ("ValueError", r"max_norm must be a non-negative"),
    "torchtitan.clip_grad_norm_: norm_type negative, DTensor": ("ValueError", POSITIVE),
    "torchtitan.clip_grad_norm_: pp_mesh a 2D mesh": ("ValueError", PP_2D),
    "torchtitan.clip_grad_norm_: norm_type negative, with spikes": ("ValueError", POSITIVE),
}


class CollectiveCalled(RuntimeError):
    """What every collective raises while the checks are tested."""


class _Clipping(MeshSafeGradientClipping, nn.Module):
    """The Lightning mixin outside a Trainer (its clip, with nothing to log to)."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__()
        self.weights = nn.ParameterList(params)


def _with_grad(grad: Tensor) -> nn.Parameter:
    param = nn.Parameter(torch.zeros_like(grad))
    param.grad = grad
    return param


def _calls() -> dict[str, Callable[[], object]]:
    """Each case's call, on gradients and groups of the fake world (built before any collective
    is replaced)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh["dp"], mesh["tp"]
    three = dist.new_group([0, 1, 2])
    sharded = DTensor.from_local(torch.ones(2, 3), dp, [Shard(0)], run_check=False)
    plain = torch.ones(3)
    params = [_with_grad(torch.ones(3)), _with_grad(sharded)]
    plain_params = [_with_grad(torch.ones(3))]
    named = [("weight", params[0]), ("sharded", params[1])]
    accelerator = SimpleNamespace(scaler=None, _optimizers=[])
    module = _Clipping(params)
    optimizer = torch.optim.SGD(params, lr=0.1)

    def adaptive() -> SpikePolicy:
        return SpikePolicy(skip=False, adaptive_clip="zscore")

    return {
        "total_grad_norm: norm_type a string": lambda: total_grad_norm([sharded], "two"),
        "total_grad_norm: norm_type NaN": lambda: total_grad_norm([sharded], math.nan),
        "total_grad_norm: norm_type negative, DTensor": lambda: total_grad_norm(
            [sharded, plain], -1.0
        ),
        "total_grad_norm: norm_type 0, pipeline stages": lambda: total_grad_norm(
            [plain], 0.0, pp_group=tp
        ),
        "total_grad_norm: norm_type 0, distinct_along": lambda: total_grad_norm(
            [plain], 0.0, distinct_along=[([plain], dp)]
        ),
        "total_grad_norm: pp_group a 2D mesh": lambda: total_grad_norm([sharded], pp_group=mesh),
        "total_grad_norm: pp_group not a group": lambda: total_grad_norm(
            [sharded],
            pp_group="pp",  # type: ignore[arg-type]
        ),
        "total_grad_norm: pp_group of 3 ranks in 4": lambda: total_grad_norm(
            [sharded], pp_group=three
        ),
        "total_grad_norm: distinct_along not pairs": lambda: total_grad_norm(
            [plain],
            distinct_along=5,  # type: ignore[arg-type]
        ),
        "total_grad_norm: distinct_along[0] not a pair": lambda: total_grad_norm(
            [plain],
            distinct_along=[(plain,)],  # type: ignore[list-item]
        ),
        "total_grad_norm: distinct_along group a 2D mesh": lambda: total_grad_norm(
            [plain], distinct_along=[([plain], mesh)]
        ),
        "total_grad_norm: per_rank with a DTensor": lambda: total_grad_norm(
            [sharded], per_rank=True
        ),
        "total_grad_norm: per_rank with pp_group": lambda: total_grad_norm(
            [plain], pp_group=tp, per_rank=True
        ),
        "total_grad_norm: grads not tensors": lambda: total_grad_norm(
            [plain, "g"]  # type: ignore[list-item]
        ),
        "get_total_norm: norm_type a string": lambda: get_total_norm([sharded], "two"),
        "get_total_norm: norm_type negative, DTensor": lambda: get_total_norm([sharded], -2.0),
        "get_total_norm: tensors not tensors": lambda: get_total_norm([1]),  # type: ignore[list-item]
        "clip_grad_norm_: max_norm NaN": lambda: clip_grad_norm_(params, math.nan),
        "clip_grad_norm_: max_norm a string": lambda: clip_grad_norm_(
            params,
            "1",  # type: ignore[arg-type]
        ),
        "clip_grad_norm_: max_norm of two elements": lambda: clip_grad_norm_(params, torch.ones(2)),
        "clip_grad_norm_: norm_type negative, DTensor": lambda: clip_grad_norm_(params, 1.0, -1.0),
        "clip_grad_norm_: norm_type 0, pipeline stages": lambda: clip_grad_norm_(
            plain_params, 1.0, 0.0, pp_group=tp
        ),
        "clip_grad_norm_: parameters None": lambda: clip_grad_norm_(
            None,  # type: ignore[arg-type]
            1.0,
        ),
        "clip_grad_norm_: pp_group a 2D mesh": lambda: clip_grad_norm_(params, 1.0, pp_group=mesh),
        "clip_grads_with_norm_: total_norm not a tensor": lambda: clip_grads_with_norm_(
            params,
            1.0,
            2.0,  # type: ignore[arg-type]
        ),
        "all_reduce_avg: tensor not a tensor": lambda: all_reduce_avg(1.0),  # type: ignore[arg-type]
        "all_reduce_avg: an integer tensor": lambda: all_reduce_avg(
            torch.ones(2, dtype=torch.long)
        ),
        "all_reduce_avg: group a 2D mesh": lambda: all_reduce_avg(torch.ones(2), mesh),
        "allreduce_grads_avg: bucket_cap_mb 0": lambda: allreduce_grads_avg(
            [plain], tp, bucket_cap_mb=0
        ),
        "allreduce_grads_avg: grads not tensors": lambda: allreduce_grads_avg(
            [plain, "g"],  # type: ignore[list-item]
            tp,
        ),
        "allreduce_grads_avg: group a 2D mesh": lambda: allreduce_grads_avg([plain], mesh),
        "sync_domain_gradients: model_or_params not tensors": lambda: sync_domain_gradients(
            5,  # type: ignore[arg-type]
            tp,
        ),
        "sync_replicated_gradients: model_or_params not tensors": lambda: sync_replicated_gradients(
            5,  # type: ignore[arg-type]
            tp,
        ),
        "grad_norm_report: norm_type 0": lambda: grad_norm_report(named, 0.0),
        "grad_norm_report: norm_type a string": lambda: grad_norm_report(named, "two"),
        "grad_norm_report: named_parameters a tensor": lambda: grad_norm_report(
            plain  # type: ignore[arg-type]
        ),
        "grad_norm_report: group_by gives an int": lambda: grad_norm_report(
            named,
            group_by=lambda name, param: 1,  # type: ignore[arg-type,return-value]
        ),
        "grad_norm_report: a group named total": lambda: grad_norm_report(
            named, group_by=lambda name, param: "total"
        ),
        "grad_norm_report: groups repeats a name": lambda: grad_norm_report(
            named, groups=["replicated", "fsdp", "fsdp"]
        ),
        "grad_norm_report: groups misses a group": lambda: grad_norm_report(
            named, groups=["replicated"]
        ),
        "grad_norm_report: pp_group a 2D mesh": lambda: grad_norm_report(named, pp_group=mesh),
        "SpikePolicy.clip_grad_norm_: max_norm 0": lambda: adaptive().clip_grad_norm_(params, 0.0),
        "SpikePolicy.clip_grad_norm_: max_norm a tensor": lambda: adaptive().clip_grad_norm_(
            params,
            torch.tensor(1.0),  # type: ignore[arg-type]
        ),
        "SpikePolicy.clip_grad_norm_: groups not a report": lambda: adaptive().clip_grad_norm_(
            params,
            groups=[1.0],  # type: ignore[arg-type]
        ),
        "SpikePolicy.clip_grad_norm_: norm_type negative, DTensor": lambda: (
            adaptive().clip_grad_norm_(params, 1.0, -1.0, loss=torch.ones(()))
        ),
        "SpikePolicy.clip_grad_norm_: norm_type a string": lambda: adaptive().clip_grad_norm_(
            params, None, "two"
        ),
        "SpikePolicy.clip_grad_norm_: pp_group a 2D mesh": lambda: adaptive().clip_grad_norm_(
            params, pp_group=mesh
        ),
        "SpikePolicy.clip_grad_norm_: skips without a GradScaler": lambda: (
            SpikePolicy().clip_grad_norm_(params, 1.0)
        ),
        "verify_replicas: model not a module": lambda: verify_replicas(
            params  # type: ignore[arg-type]
        ),
        "verify_replicas: optimizer not an optimizer": lambda: verify_replicas(
            module,
            params,  # type: ignore[arg-type]
        ),
        "verify_replicas: repair_from without repair": lambda: verify_replicas(
            module, repair_from=0
        ),
        "verify_replicas: pp_group a 2D mesh": lambda: verify_replicas(module, pp_group=mesh),
        "accelerate.clip_grad_norm_: norm_type negative, DTensor": lambda: (
            accelerate.clip_grad_norm_(accelerator, params, 1.0, -1.0)
        ),
        "accelerate.clip_grad_norm_: pp_group a 2D mesh": lambda: accelerate.clip_grad_norm_(
            accelerator, params, 1.0, pp_group=mesh
        ),
        "accelerate.clip_grad_norm_: max_norm NaN": lambda: accelerate.clip_grad_norm_(
            accelerator, params, math.nan
        ),
        "accelerate.clip_grad_norm_: log_as empty": lambda: accelerate.clip_grad_norm_(
            accelerator, params, 1.0, log_as=""
        ),
        "lightning clip_grad_norm_: norm_type negative, DTensor": lambda: module.clip_grad_norm_(
            optimizer, 1.0, -1.0
        ),
        "lightning clip_grad_norm_: max_norm NaN": lambda: module.clip_grad_norm_(
            optimizer, math.nan
        ),
        "torchtitan.clip_grad_norm_: norm_type negative, DTensor": lambda: (
            torchtitan.clip_grad_norm_(params, 1.0, -1.0)
        ),
        "torchtitan.clip_grad_norm_: pp_mesh a 2D mesh": lambda: torchtitan.clip_grad_norm_(
            params, 1.0, pp_mesh=mesh
        ),
        "torchtitan.clip_grad_norm_: norm_type negative, with spikes": lambda: (
            torchtitan.clip_grad_norm_(params, 1.0, -1.0, spikes=adaptive())
        ),
    }


@contextmanager
def _collectives_raise() -> Iterator[None]:
    """Every collective of ``torch.distributed`` raises :class:`CollectiveCalled`."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise CollectiveCalled("a collective was issued before the arguments were checked")

    modules = (dist, dist.distributed_c10d)
    saved = [
        (m, name, getattr(m, name)) for m in modules for name in COLLECTIVES if hasattr(m, name)
    ]
    for module, name, _ in saved:
        setattr(module, name, refuse)
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def outcomes_in_fake_world(check: bool) -> dict[str, tuple[str, str, int]]:
    """Each case's error (its type's name and message) and the collectives counted around the
    replaced ones, on rank 1 of a fake world of four (run in a fresh process)."""
    os.environ["CREDIT_PARALLEL_CHECK"] = "1" if check else "0"
    dist.init_process_group("fake", store=FakeStore(), rank=RANK, world_size=WORLD)
    try:
        calls = _calls()
        found = {}
        with _collectives_raise():
            for name, call in calls.items():
                with CommDebugMode() as counted:
                    try:
                        call()
                        error = ("no error", "")
                    except Exception as raised:  # every error is recorded, the sentinel too
                        error = (type(raised).__name__, str(raised))
                found[name] = (*error, counted.get_total_counts())
        return found
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def outcomes() -> dict[str, dict[str, tuple[str, str, int]]]:
    context = multiprocessing.get_context("spawn")
    modes = {"check mode": True, "default": False}
    with context.Pool(len(modes), maxtasksperchild=1) as pool:
        pending = {
            mode: pool.apply_async(outcomes_in_fake_world, (on,)) for mode, on in modes.items()
        }
        return {mode: result.get(timeout=300) for mode, result in pending.items()}


def test_every_case_ran(outcomes):
    for found in outcomes.values():
        assert sorted(found) == sorted(EXPECTED)


@pytest.mark.parametrize("mode", ["check mode", "default"])
@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_the_argument_is_refused_before_any_collective(outcomes, mode, case):
    kind, message, collectives = outcomes[mode][case]
    expected_kind, pattern = EXPECTED[case]
    assert (kind, collectives) == (expected_kind, 0), message
    assert re.search(pattern, message), message
