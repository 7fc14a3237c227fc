"""Bad arguments raise a clear error naming the argument or gradient, before anything changes.

Every bad call runs on real gloo ranks, all passing the same bad input (as a buggy trainer would),
and each rank checks that the call raised the right type with the right message, issued no
collective (counted by CommDebugMode, so no peer can be left waiting) and left every gradient
bit-for-bit as it was. A valid all_reduce afterwards shows that the group still works.

Devices: this machine has only CPUs, so the meta device stands in for a second device. A meta
tensor holds no data (a gloo all_reduce on one is a silent no-op, measured), so it is rejected by
name. A CPU + CUDA mix is legal, as in torch: the norm, the scaling and the averaging work per
(device, dtype) group. Whether a group's backend can reduce a given device is the backend's to say
(NCCL has no CPU path); checking that needs a GPU and is not exercised here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from credit.parallel.collectives import (
    all_reduce_avg,
    allreduce_grads_avg,
    clip_grad_norm_,
    clip_grads_with_norm_,
    get_total_norm,
    total_grad_norm,
)
from testbed.layouts import local_bytes, mesh


def _grads() -> list[Tensor]:
    generator = torch.Generator().manual_seed(dist.get_rank())
    return [torch.randn(4, 3, generator=generator), torch.randn(5, generator=generator)]


def _params() -> list[nn.Parameter]:
    params = [nn.Parameter(torch.zeros(g.shape)) for g in _grads()]
    for param, grad in zip(params, _grads(), strict=True):
        param.grad = grad
    return params


def _partial_grad() -> DTensor:
    """A DTensor gradient whose local values are unreduced partial sums over the 1D mesh."""
    local = torch.full((3,), float(dist.get_rank() + 1))
    return DTensor.from_local(local, mesh((dist.get_world_size(),), ("tp",)), [Partial()])


def _sharded_grad() -> DTensor:
    full = torch.arange(8.0)
    return distribute_tensor(full, mesh((dist.get_world_size(),), ("tp",)), [Shard(0)])


def _sparse_grad() -> Tensor:
    embedding = nn.Embedding(5, 3, sparse=True)
    embedding(torch.tensor([1, 3])).sum().backward()
    assert embedding.weight.grad is not None and embedding.weight.grad.is_sparse
    return embedding.weight.grad


def _meta_param() -> nn.Parameter:
    param = nn.Parameter(torch.zeros(3, device="meta"))
    param.grad = torch.ones(3, device="meta")
    return param


def _mesh_2d():
    return mesh((1, dist.get_world_size()), ("dp", "tp"))


def _param_with_grad(grad: DTensor) -> nn.Parameter:
    """A DTensor parameter of ``grad``'s global shape holding ``grad`` (Partial becomes Replicate)."""
    placements = [Replicate() if p.is_partial() else p for p in grad.placements]
    local = torch.zeros(grad._local_tensor.shape)
    param = nn.Parameter(
        DTensor.from_local(
            local, grad.device_mesh, placements, shape=grad.shape, stride=grad.stride()
        )
    )
    param.grad = grad
    return param


Case = tuple[list[Tensor], Callable[[], object]]
CASES: dict[str, tuple[Callable[[], Case], type[Exception], str]] = {}


def _case(name: str, error: type[Exception], pattern: str):
    """Register a bad call: it must raise ``error`` with a message matching ``pattern``."""

    def register(build: Callable[[], Case]) -> Callable[[], Case]:
        CASES[name] = (build, error, pattern)
        return build

    return register


# allreduce_grads_avg -------------------------------------------------------------------------


@_case("avg grads non-tensor", TypeError, r"grads\[1\] is a float, expected a torch.Tensor")
def _() -> Case:
    g = _grads()
    return g, lambda: allreduce_grads_avg([g[0], 1.5, g[1]], None)  # type: ignore[list-item]


@_case("avg grads not iterable", TypeError, r"grads must be a tensor or an iterable of tensors")
def _() -> Case:
    g = _grads()
    return g, lambda: allreduce_grads_avg(3.0, None)  # type: ignore[arg-type]


@_case("avg grads int", TypeError, r"grads\[1\] has dtype torch.int64; only floating-point")
def _() -> Case:
    g = _grads()
    return g, lambda: allreduce_grads_avg([g[0], torch.ones(3, dtype=torch.int64), g[1]], None)


@_case("avg grads bool", TypeError, r"grads\[1\] has dtype torch.bool; only floating-point")
def _() -> Case:
    g = _grads()
    return g, lambda: allreduce_grads_avg([g[0], torch.ones(3, dtype=torch.bool), g[1]], None)


@_case("avg grads sparse", ValueError, r"grads\[2\] has layout torch.sparse_coo; only dense")
def _() -> Case:
    g = [*_grads(), _sparse_grad()]
    return g, lambda: allreduce_grads_avg(g, None)


@_case("avg grads meta", ValueError, r"grads\[1\] is on the meta device and holds no data")
def _() -> Case:
    g = _grads()
    return g, lambda: allreduce_grads_avg([g[0], torch.ones(3, device="meta"), g[1]], None)


@_case(
    "avg group 2d mesh", ValueError, r"group must be a ProcessGroup or a 1D DeviceMesh, got a 2D"
)
def _() -> Case:
    g = _grads()
    return g, lambda: allreduce_grads_avg(g, _mesh_2d())


@_case("avg bucket cap zero", ValueError, r"bucket_cap_mb must be positive, got 0")
def _() -> Case:
    g = _grads()
    return g, lambda: allreduce_grads_avg(g, None, bucket_cap_mb=0)


# all_reduce_avg ------------------------------------------------------------------------------


@_case("avg one int", TypeError, r"tensor\[0\] has dtype torch.int32; only floating-point")
def _() -> Case:
    t = torch.arange(3, dtype=torch.int32)
    return [t], lambda: all_reduce_avg(t)


@_case("avg one bool", TypeError, r"tensor\[0\] has dtype torch.bool; only floating-point")
def _() -> Case:
    t = torch.ones(3, dtype=torch.bool)
    return [t], lambda: all_reduce_avg(t)


@_case("avg one non-tensor", TypeError, r"tensor must be a torch.Tensor, got float")
def _() -> Case:
    return _grads(), lambda: all_reduce_avg(2.5)  # type: ignore[arg-type]


@_case("avg one 2d mesh", ValueError, r"group must be a ProcessGroup or a 1D DeviceMesh, got a 2D")
def _() -> Case:
    t = _grads()[0]
    return [t], lambda: all_reduce_avg(t, _mesh_2d())


# total_grad_norm -----------------------------------------------------------------------------


@_case("norm grads non-tensor", TypeError, r"grads\[1\] is a str, expected a torch.Tensor")
def _() -> Case:
    g = _grads()
    return g, lambda: total_grad_norm([g[0], "g1"])  # type: ignore[list-item]


@_case("norm grads sparse", ValueError, r"grads\[1\] has layout torch.sparse_coo")
def _() -> Case:
    g = [_grads()[0], _sparse_grad()]
    return g, lambda: total_grad_norm(g)


@_case("norm grads meta", ValueError, r"grads\[1\] is on the meta device")
def _() -> Case:
    g = _grads()
    return g, lambda: total_grad_norm([g[0], torch.ones(2, device="meta")])


@_case("norm type string", TypeError, r"norm_type must be a real number or 'inf', got 'two'")
def _() -> Case:
    g = _grads()
    return g, lambda: total_grad_norm(g, "two")


@_case("norm type tensor", TypeError, r"norm_type must be a real number or 'inf', got tensor")
def _() -> Case:
    g = _grads()
    return g, lambda: total_grad_norm(g, torch.tensor(2.0))  # type: ignore[arg-type]


@_case("norm type bool", TypeError, r"norm_type must be a real number or 'inf', got True")
def _() -> Case:
    g = _grads()
    return g, lambda: total_grad_norm(g, True)


@_case("norm type nan", ValueError, r"norm_type must not be NaN")
def _() -> Case:
    g = [_sharded_grad()]
    return g, lambda: total_grad_norm(g, math.nan)


@_case("norm type negative distributed", ValueError, r"norm_type must be positive or inf")
def _() -> Case:
    g = [_sharded_grad()]
    return g, lambda: total_grad_norm(g, -1.0)


@_case("norm pp group 2d mesh", ValueError, r"pp_group must be a ProcessGroup or a 1D DeviceMesh")
def _() -> Case:
    g = [_sharded_grad()]
    return g, lambda: total_grad_norm(g, pp_group=_mesh_2d())


# clip_grad_norm_ -----------------------------------------------------------------------------


@_case("clip parameters non-tensor", TypeError, r"parameters\[1\] is a str, expected a torch")
def _() -> Case:
    p = _params()
    return [q.grad for q in p], lambda: clip_grad_norm_([p[0], "p1", p[1]], 1.0)  # type: ignore[list-item]


@_case("clip parameters not iterable", TypeError, r"parameters must be a tensor or an iterable")
def _() -> Case:
    return [q.grad for q in _params()], lambda: clip_grad_norm_(None, 1.0)  # type: ignore[arg-type]


@_case("clip max_norm nan", ValueError, r"max_norm must be a non-negative number, got nan")
def _() -> Case:
    p = _params()
    return [q.grad for q in p], lambda: clip_grad_norm_(p, math.nan)


@_case("clip max_norm negative", ValueError, r"max_norm must be a non-negative number, got -1.0")
def _() -> Case:
    p = _params()
    return [q.grad for q in p], lambda: clip_grad_norm_(p, -1.0)


@_case(
    "clip max_norm two elements", ValueError, r"max_norm must be a scalar, got a tensor of shape"
)
def _() -> Case:
    p = _params()
    return [q.grad for q in p], lambda: clip_grad_norm_(p, torch.tensor([1.0, 2.0]))


@_case("clip max_norm complex tensor", TypeError, r"max_norm must be a real number")
def _() -> Case:
    p = _params()
    return [q.grad for q in p], lambda: clip_grad_norm_(p, torch.tensor(1.0 + 1.0j))


@_case("clip max_norm string", TypeError, r"max_norm must be a float or a scalar tensor")
def _() -> Case:
    p = _params()
    return [q.grad for q in p], lambda: clip_grad_norm_(p, "1")  # type: ignore[arg-type]


@_case("clip norm type nan", ValueError, r"norm_type must not be NaN")
def _() -> Case:
    p = [*_params(), _param_with_grad(_sharded_grad())]
    return [q.grad for q in p], lambda: clip_grad_norm_(p, 1.0, math.nan)


@_case("clip sparse grad", ValueError, r"grads\[2\] has layout torch.sparse_coo")
def _() -> Case:
    embedding = nn.Embedding(5, 3, sparse=True)
    embedding(torch.tensor([1, 3])).sum().backward()
    p = [*_params(), embedding.weight]
    return [q.grad for q in p], lambda: clip_grad_norm_(p, 1.0)


@_case("clip meta grad", ValueError, r"grads\[1\] is on the meta device")
def _() -> Case:
    p = _params()
    return [q.grad for q in p], lambda: clip_grad_norm_([p[0], _meta_param(), p[1]], 1.0)


@_case("clip max_norm meta tensor", RuntimeError, r"max_norm is on the meta device")
def _() -> Case:
    p = _params()
    return [q.grad for q in p], lambda: clip_grad_norm_(p, torch.tensor(1.0, device="meta"))


@_case("clip max_norm bool tensor", TypeError, r"max_norm must be a real number, got a tensor")
def _() -> Case:
    p = _params()
    return [q.grad for q in p], lambda: clip_grad_norm_(p, torch.tensor(True))


# get_total_norm and clip_grads_with_norm_ ------------------------------------------------------


@_case("get_total_norm tensors meta", ValueError, r"tensors\[1\] is on the meta device")
def _() -> Case:
    g = _grads()
    return g, lambda: get_total_norm([g[0], torch.ones(2, device="meta")])


@_case("get_total_norm type string", TypeError, r"norm_type must be a real number or 'inf'")
def _() -> Case:
    g = _grads()
    return g, lambda: get_total_norm(g, "two")


@_case("split clip max_norm negative", ValueError, r"max_norm must be a non-negative number")
def _() -> Case:
    p = _params()
    return [q.grad for q in p], lambda: clip_grads_with_norm_(p, -1.0, torch.tensor(2.0))


@_case("split clip total_norm float", TypeError, r"total_norm must be a tensor .*got float")
def _() -> Case:
    p = _params()
    return [q.grad for q in p], lambda: clip_grads_with_norm_(p, 1.0, 2.0)  # type: ignore[arg-type]


@_case("split clip meta grad", ValueError, r"grads\[1\] is on the meta device")
def _() -> Case:
    p = _params()
    grads = [q.grad for q in p]
    return grads, lambda: clip_grads_with_norm_([p[0], _meta_param(), p[1]], 1.0, torch.ones(()))


def _bad_call_raises_before_anything(name: str) -> tuple[str, str, bool, int]:
    build = CASES[name][0]
    watched, call = build()
    before = [local_bytes(t) for t in watched]
    raised: Exception | None = None
    with CommDebugMode() as comm:
        try:
            call()
        except Exception as error:  # checked against CASES by the test
            raised = error
    assert raised is not None, f"{name}: no error"
    unchanged = all(
        torch.equal(old, local_bytes(t)) for old, t in zip(before, watched, strict=True)
    )
    # The group still works: nobody is stuck in a collective the others skipped.
    probe = torch.tensor([1.0])
    dist.all_reduce(probe)
    assert probe.item() == dist.get_world_size()
    return type(raised).__name__, str(raised), unchanged, comm.get_total_counts()


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_argument_raises_on_every_rank_before_anything_changes(ranks, name):
    _, error, pattern = CASES[name]
    for kind, message, unchanged, collectives in ranks.run(
        2, _bad_call_raises_before_anything, name
    ):
        assert kind == error.__name__, f"{name}: {kind}: {message}"
        assert re.search(pattern, message), message
        assert unchanged, f"{name}: a gradient changed"
        assert collectives == 0, f"{name}: {collectives} collective(s) issued before raising"


def test_torch_silently_flips_or_poisons_grads_on_bad_max_norm():
    """Why max_norm is checked: torch's clip multiplies by the clamped coefficient unchecked."""
    grads = [torch.tensor([3.0, -4.0])]
    flipped = [nn.Parameter(torch.zeros(2))]
    flipped[0].grad = grads[0].clone()
    torch.nn.utils.clip_grad_norm_(flipped, -1.0)
    assert flipped[0].grad is not None
    assert torch.all(torch.sign(flipped[0].grad) == -torch.sign(grads[0]))  # direction reversed
    poisoned = [nn.Parameter(torch.zeros(2))]
    poisoned[0].grad = grads[0].clone()
    torch.nn.utils.clip_grad_norm_(poisoned, math.nan)
    assert poisoned[0].grad is not None and torch.isnan(poisoned[0].grad).all()


def _partial_grads_average_linearly() -> tuple[bool, float, str]:
    """A Partial DTensor on the tp dim, averaged over the dp dim of a (dp=2, tp=2) mesh.

    Averaging is linear, so averaging the unreduced partial values over dp and then summing them
    over tp (``full_tensor``) equals averaging the reduced values. Integer-valued inputs make every
    sum and halving exact, so the two orders must agree bit for bit.
    """
    world = mesh((2, 2), ("dp", "tp"))
    rank = dist.get_rank()
    local = torch.arange(6, dtype=torch.float32).reshape(2, 3) * (rank + 1) + rank
    partial = DTensor.from_local(local.clone(), world["tp"], [Partial()])
    reduced = DTensor.from_local(local.clone(), world["tp"], [Partial()]).redistribute(
        world["tp"], [Replicate()]
    )
    scalar = DTensor.from_local(torch.tensor(float(rank)), world["tp"], [Partial()])
    allreduce_grads_avg([partial], world["dp"], check=True)
    allreduce_grads_avg([reduced], world["dp"], check=True)
    all_reduce_avg(scalar, world["dp"])
    same = torch.equal(partial.full_tensor(), reduced.full_tensor())
    return same, scalar.full_tensor().item(), str(partial.placements)


def test_partial_dtensor_grads_are_averaged_linearly(ranks):
    for same, scalar, placements in ranks.run(4, _partial_grads_average_linearly):
        assert same, "averaging the partial values differs from averaging the reduced ones"
        # mean over dp of the tp-sum of the ranks' values: ((0 + 1) + (2 + 3)) / 2
        assert scalar == 3.0
        assert placements == "(Partial(sum),)"
