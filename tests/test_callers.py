"""sync_domain_gradients, sync_replicated_gradients and is_tp_sharded on real layouts of 8 ranks.

Every layout runs on the (dp=2, tp=2, domain=2) mesh of build_device_mesh, the data sharded by the
(dp, domain) coordinate: domain peers compute different latitude bands, tp peers see the same
data. Layouts: "fsdp_tp" (TP on the first block, FSDP2 on dp), "tp" (the same TP without FSDP2:
TP DTensor grads beside plain ones, averaged over dp with allreduce_grads_avg), "ddp"
(DistributedDataParallel on dp, plain grads). The embedding, norms, second block and head are left
out of the TP plan. Each layout runs once (a module fixture); the tests check parts of its result.

Oracles: the mean of the local gradients gathered over the group before the sync, and torch's
get_total_norm on the full_tensor()-materialised gradients for the clip. Averages over a group of
two are compared bit for bit: (a + b) / 2 is one correctly rounded addition (the same in either
order) and an exact halving, so every correct implementation gets torch's bits.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard
from torch.nn.parallel import DistributedDataParallel

from credit.parallel.collectives import allreduce_grads_avg, clip_grad_norm_
from credit.parallel.grad_sync import (
    is_tp_sharded,
    sync_domain_gradients,
    sync_replicated_gradients,
)
from credit.parallel.parallel_mesh import ParallelMesh, build_device_mesh
from testbed.layouts import IN_DIM, TP_PLAN, TinyNet, full_grads, same_bits_everywhere, ulp_distance

SEED = 7
LAYOUTS = ("fsdp_tp", "tp", "ddp")
TP_SHARDED = sorted(
    f"blocks.0.{name}"
    for name in ("q.weight", "q.bias", "o.weight", "w1.weight", "w1.bias", "w2.weight")
)
EXPECTED_SHARDED = {"fsdp_tp": TP_SHARDED, "tp": TP_SHARDED, "ddp": []}


@functools.cache
def _mesh() -> ParallelMesh:
    """Built once per worker process: workers are reused, so process groups must not pile up."""
    return build_device_mesh(2, 2, 2, device_type="cpu")


@functools.cache
def _named_mesh(names: tuple[str, ...] | None) -> DeviceMesh:
    """A 1D mesh over the whole world: it reuses the default group, creating none."""
    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=names)


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _same_bits(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.int32), b.contiguous().view(torch.int32)
    )


def _gather(tensor: Tensor, mesh: DeviceMesh) -> list[Tensor]:
    out = [torch.empty_like(tensor) for _ in range(mesh.size())]
    dist.all_gather(out, tensor.contiguous(), group=mesh.get_group())
    return out


def _all_same(tensors: list[Tensor]) -> bool:
    return all(_same_bits(t, tensors[0]) for t in tensors)


def _build(layout: str) -> tuple[nn.Module, ParallelMesh]:
    """``layout`` of TinyNet with the gradients of one backward (dp-averaged) in place."""
    pm = _mesh()
    torch.manual_seed(SEED)
    model: nn.Module = TinyNet()
    if layout in ("fsdp_tp", "tp"):
        parallelize_module(model.blocks[0], pm.tp, TP_PLAN)
    if layout == "fsdp_tp":
        for block in model.blocks:
            fully_shard(block, mesh=pm.dp)
        fully_shard(model, mesh=pm.dp)
    elif layout == "ddp":
        model = DistributedDataParallel(model, process_group=pm.dp.get_group())
    coordinate = pm.world.get_coordinate()
    assert coordinate is not None
    dp_rank, _, domain_rank = coordinate
    batch = torch.randn(2, 2, 4, IN_DIM, generator=torch.Generator().manual_seed(SEED))
    model(batch[dp_rank, domain_rank]).pow(2).mean().backward()
    if layout == "tp":  # no FSDP2 or DDP to average over dp: do what a trainer would
        allreduce_grads_avg([p.grad for p in model.parameters()], pm.dp)
    return model, pm


def _check_domain_sync(
    layout: str, model: nn.Module, pm: ParallelMesh, names: list[str], params: list[Tensor]
) -> dict:
    before = [_local(p.grad).clone() for p in params]
    gathered = [_gather(t, pm.domain) for t in before]
    expected = [torch.stack(g).mean(0) for g in gathered]
    # Each layout passes the model and group in another accepted form.
    if layout == "fsdp_tp":
        sync_domain_gradients(model, pm.domain)
    elif layout == "tp":
        sync_domain_gradients(model.parameters(), pm.domain.get_group())
    else:
        sync_domain_gradients(list(model.parameters()), pm.domain)
    after = [_local(p.grad) for p in params]
    return {
        "domain_peers_differed": sum(not _all_same(g) for g in gathered),
        "domain_not_mean": [
            n for n, a, e in zip(names, after, expected, strict=True) if not _same_bits(a, e)
        ],
        "domain_disagree": [
            n for n, a in zip(names, after, strict=True) if not _all_same(_gather(a, pm.domain))
        ],
    }


def _check_replicated_sync(
    layout: str, model: nn.Module, pm: ParallelMesh, names: list[str], params: list[Tensor]
) -> dict:
    tp_rank = pm.tp.get_local_rank()
    replicated = [name not in EXPECTED_SHARDED[layout] for name in names]
    for index, (param, is_replicated) in enumerate(zip(params, replicated, strict=True)):
        if is_replicated:  # what non-deterministic kernels would do, only larger
            grad = _local(param.grad)
            noise = torch.randn(grad.shape, generator=torch.Generator().manual_seed(index))
            grad.add_(noise, alpha=1e-3 * (tp_rank + 1))
    before = [_local(p.grad).clone() for p in params]
    gathered = [_gather(t, pm.tp) for t in before]
    expected = [torch.stack(g).mean(0) for g in gathered]
    if layout == "tp":
        sync_replicated_gradients(model.parameters(), pm.tp.get_group())
    else:
        sync_replicated_gradients(model, pm.tp)
    after = [_local(p.grad) for p in params]
    rows = list(zip(names, replicated, before, expected, after, strict=True))
    return {
        "tp_replicas_differed": sum(
            not _all_same(g) for g, r in zip(gathered, replicated, strict=True) if r
        ),
        "tp_shards_differ": sum(
            not _all_same(g) for g, r in zip(gathered, replicated, strict=True) if not r
        ),
        "replicated_not_mean": [n for n, r, _, e, a in rows if r and not _same_bits(a, e)],
        "replicated_disagree": [
            n for n, r, _, _, a in rows if r and not _all_same(_gather(a, pm.tp))
        ],
        "sharded_changed": [n for n, r, b, _, a in rows if not r and not _same_bits(a, b)],
    }


def _check_clip(model: nn.Module) -> dict:
    reference = torch.nn.utils.get_total_norm(full_grads(model), 2.0)
    total = clip_grad_norm_(model.parameters(), float(reference) / 4)
    return {
        "clip_ulps": ulp_distance(total, reference),
        "clip_same_bits": same_bits_everywhere(total),
    }


def _sync_then_clip(layout: str) -> dict:
    model, pm = _build(layout)
    named = [(n.removeprefix("module."), p) for n, p in model.named_parameters()]
    names = [n for n, p in named if p.grad is not None]
    params = [p for _, p in named if p.grad is not None]
    result = {"sharded": sorted(n for n, p in zip(names, params, strict=True) if is_tp_sharded(p))}
    result |= _check_domain_sync(layout, model, pm, names, params)
    result |= _check_replicated_sync(layout, model, pm, names, params)
    result |= _check_clip(model)
    return result


@pytest.fixture(scope="module", params=LAYOUTS)
def synced(request, ranks) -> tuple[str, list[dict]]:
    """One run of domain sync -> replicated sync -> clip per layout, checked by the tests below."""
    return request.param, ranks.run(8, _sync_then_clip, request.param)


def test_is_tp_sharded_finds_exactly_the_tp_plan(synced):
    layout, results = synced
    for result in results:
        assert result["sharded"] == EXPECTED_SHARDED[layout]


def test_domain_sync_gives_every_rank_the_domain_mean(synced):
    _, results = synced
    for rank, result in enumerate(results):
        assert result["domain_peers_differed"] > 0, f"rank {rank}: the test data is too uniform"
        assert result["domain_not_mean"] == [], f"rank {rank}: not the domain mean"
        assert result["domain_disagree"] == [], f"rank {rank}: domain peers disagree"


def test_replicated_sync_averages_only_what_tp_does_not_shard(synced):
    layout, results = synced
    for rank, result in enumerate(results):
        assert result["tp_replicas_differed"] > 0, f"rank {rank}: no noise reached the replicas"
        if EXPECTED_SHARDED[layout]:  # averaging would change them: shards differ across peers
            assert result["tp_shards_differ"] > 0
        assert result["replicated_not_mean"] == [], f"rank {rank}: not the tp mean"
        assert result["replicated_disagree"] == [], f"rank {rank}: tp peers disagree"
        assert result["sharded_changed"] == [], f"rank {rank}: TP-sharded grads were touched"


def test_sync_then_clip_gives_torchs_norm_on_every_rank(synced):
    """Tolerance 8 float32 ULP, as in test_mixed_meshes: the distributed norm sums the squares in
    another order (per shard, then across ranks), each step rounding once; a shard counted twice
    or missed is off by far more."""
    _, results = synced
    for rank, result in enumerate(results):
        assert result["clip_ulps"] <= 8, f"rank {rank}: {result['clip_ulps']} ULP from torch"
        assert result["clip_same_bits"], f"rank {rank}: ranks got different norms"


def _dtensor(mesh: DeviceMesh, placements: tuple, values: Tensor | None = None) -> DTensor:
    local = values if values is not None else torch.zeros(2, 4)
    return DTensor.from_local(local, mesh, placements, run_check=False)


def _placement_cases() -> list[tuple[str, bool]]:
    pm = _mesh()
    strided = _StridedShard(0, split_factor=2)
    cases = [
        ("dp_tp (Shard, Shard)", _dtensor(pm.dp_tp, (Shard(0), Shard(1))), "tp"),
        ("dp_tp (_StridedShard, Shard)", _dtensor(pm.dp_tp, (strided, Shard(0))), "tp"),
        ("dp_tp (Shard, _StridedShard)", _dtensor(pm.dp_tp, (Shard(0), strided)), "tp"),
        ("dp_tp (Shard, Replicate)", _dtensor(pm.dp_tp, (Shard(0), Replicate())), "tp"),
        ("dp_tp (Shard, Replicate) on dp", _dtensor(pm.dp_tp, (Shard(0), Replicate())), "dp"),
        ("dp_tp (Replicate, Partial)", _dtensor(pm.dp_tp, (Replicate(), Partial())), "tp"),
        ("tp (Shard)", _dtensor(pm.tp, (Shard(0),)), "tp"),
        ("tp (_StridedShard)", _dtensor(pm.tp, (strided,)), "tp"),
        ("tp (Replicate)", _dtensor(pm.tp, (Replicate(),)), "tp"),
        ("dp (Shard)", _dtensor(pm.dp, (Shard(0),)), "tp"),
        ("domain (Shard)", _dtensor(pm.domain, (Shard(0),)), "tp"),
        ("world (R, Shard, R)", _dtensor(pm.world, (Replicate(), Shard(1), Replicate())), "tp"),
        ("world (Shard, R, Shard)", _dtensor(pm.world, (Shard(0), Replicate(), Shard(1))), "tp"),
        ("model (Shard)", _dtensor(_named_mesh(("model",)), (Shard(0),)), "tp"),
        ("model (Shard) on model", _dtensor(_named_mesh(("model",)), (Shard(0),)), "model"),
        ("unnamed (Shard)", _dtensor(_named_mesh(None), (Shard(0),)), "tp"),
        ("plain", torch.zeros(2, 4), "tp"),
        ("plain Parameter", nn.Parameter(torch.zeros(2, 4)), "tp"),
        ("DTensor Parameter", nn.Parameter(_dtensor(pm.tp, (Shard(0),))), "tp"),
    ]
    return [(name, is_tp_sharded(tensor, tp_dim)) for name, tensor, tp_dim in cases]


EXPECTED_PLACEMENT_CASES = [
    ("dp_tp (Shard, Shard)", True),
    ("dp_tp (_StridedShard, Shard)", True),
    ("dp_tp (Shard, _StridedShard)", True),
    ("dp_tp (Shard, Replicate)", False),
    ("dp_tp (Shard, Replicate) on dp", True),
    ("dp_tp (Replicate, Partial)", False),
    ("tp (Shard)", True),
    ("tp (_StridedShard)", True),
    ("tp (Replicate)", False),
    ("dp (Shard)", False),
    ("domain (Shard)", False),
    ("world (R, Shard, R)", True),
    ("world (Shard, R, Shard)", False),
    ("model (Shard)", False),
    ("model (Shard) on model", True),
    ("unnamed (Shard)", False),
    ("plain", False),
    ("plain Parameter", False),
    ("DTensor Parameter", True),
]


def _edge_cases() -> dict:
    """is_tp_sharded placements; the tp dim taken from the group's name; no-ops; bad groups."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model_mesh = _named_mesh(("model",))
    shard, replicate = (Shard(0),), (Replicate(),)
    # (whether the parameter is a DTensor, placements of its gradient on the "model" mesh; None
    # for a plain gradient). Plain parameters with DTensor gradients: the gradient decides.
    kinds = [(True, shard), (True, replicate), (False, None), (False, shard), (False, replicate)]
    params = []
    # Small integers: every sum is exact, so the mean over 8 ranks is too.
    for index, (dtensor_param, placements) in enumerate(kinds):
        grad = torch.full((2, 4), float(rank + index))
        if placements is not None:
            grad = _dtensor(model_mesh, placements, grad)
        param = nn.Parameter(grad.detach().clone() if dtensor_param else torch.zeros(grad.shape))
        param.grad = grad
        params.append(param)
    sync_domain_gradients(params, None)
    sync_replicated_gradients(params, None)
    untouched_by_none = all(float(_local(p.grad)[0, 0]) == rank + i for i, p in enumerate(params))
    sync_replicated_gradients(params, model_mesh)  # tp_dim "model", from the mesh's name
    mean = (world - 1) / 2
    raised = []
    for call in (sync_domain_gradients, sync_replicated_gradients):
        with pytest.raises(ValueError, match="1D DeviceMesh") as error:
            call(params, _mesh().dp_tp)
        raised.append(str(error.value))
    return {
        "placements": _placement_cases(),
        "untouched_by_none": untouched_by_none,
        "after_named_tp_sync": [float(_local(p.grad)[0, 0]) for p in params],
        "expected_after": [rank + 0, mean + 1, mean + 2, rank + 3, mean + 4],
        "raised": raised,
    }


def test_is_tp_sharded_placements_and_group_edge_cases(ranks):
    for result in ranks.run(8, _edge_cases):
        assert result["placements"] == EXPECTED_PLACEMENT_CASES
        assert result["untouched_by_none"], "a None group must mean no domain/TP, not the world"
        assert result["after_named_tp_sync"] == result["expected_after"]
        assert all("dims ('dp', 'tp')" in message for message in result["raised"])


def test_bad_arguments_raise_without_a_process_group():
    assert not dist.is_initialized()  # these checks run before anything needs a group
    linear = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="ProcessGroup"):
        sync_domain_gradients(linear, "domain")
    with pytest.raises(TypeError, match="tp_group"):
        sync_replicated_gradients(linear, 2)
    with pytest.raises(TypeError, match=r"model_or_params\[1\]"):
        sync_domain_gradients([linear.weight, 3.0], None)
