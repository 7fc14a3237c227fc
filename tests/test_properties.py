"""Property tests: random layouts, shapes, strides, dtypes and norm types against an oracle.

Hypothesis draws each example here, in the test process (20 examples, derandomised, no example
database), and ``ranks.run`` sends it to 4 gloo ranks, which build the same DTensors from it with
``distribute_tensor`` (local splits, no communication) on cached meshes. An example is a layout:
a 1D (4,) or 2D (2, 2) mesh and up to five gradients, each plain or on the root mesh or one of its
1D submeshes, sharded or replicated per mesh dim, of sizes 0, 1, 2 and odd sizes that shard
unevenly, contiguous or not. Every layout is checked in every dtype (float32, float64, bfloat16,
bfloat16 accumulated in float32) and norm type (0.5, 1, 2, 3, inf); every averaging example with
every bucket cap, down to one element per bucket.

Norms. Oracle: ``torch.nn.utils.get_total_norm`` on the full (materialised) gradients, which every
rank generates from the example's seed. Tolerances:

- float32 / float64: at most 16 ULPs of the result's dtype. Both computations take the same
  per-element powers; they differ in how the sum of p-th powers is grouped (per shard and per rank
  here, per tensor in torch) and in the extra p-th power and p-th root taken around the cross-rank
  sum. Each regrouped sum of non-negative terms is within a few roundings of the other, and the
  power and root amplify an error at most max(p, 1 / p) = 3 times for p in [0.5, 3]; 300 random
  examples showed at most 2 ULPs (5 for bf16 gradients normed in float32, compared with float64).
  A shard counted twice or missed moves the norm by about its share of the total, orders of
  magnitude more (mutating the ownership rule to count every replica fails 8 of the 20 examples).
- the inf norm: exactly equal; a max is exact in any order.
- bfloat16: the norm is accumulated and returned in bf16, as torch does, so it is compared with the
  float64 reference of the same bf16 values within 8 bf16 ULPs relative (8 * 2**-8): each of the
  about five roundings to bf16 (per-shard norm, per-rank norm, p-th power, cross-rank sum, p-th
  root) is within half a bf16 ULP and the power and root amplify an earlier error at most p or
  1 / p times. With ``dtype=torch.float32`` the bf16 gradients are normed in float32 and compared
  with the float64 reference within the float32 tolerance above.

Clipping: given the norm, scaling is elementwise by one coefficient, so the clipped gradients must
have the same bits as ``torch.nn.utils.clip_grads_with_norm_`` on the full gradients.

Averaging. Oracle: the float64 mean of the values all_gathered from the group before the call.
Tolerance: ``n * eps * mean(|x_i|)`` elementwise, for a group of n ranks and the dtype's eps. The
backend adds n values with n - 1 roundings of at most eps / 2 of the running sum of magnitudes,
then divides by n (exact for n a power of two), so the error is below ``(n - 1) / 2 * eps *
mean(|x_i|)``; the bound doubles that. A value copied back to the wrong place is off by about
``mean(|x_i|)``. Every rank of the group must also end with the same bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from credit.parallel.collectives import allreduce_grads_avg, clip_grad_norm_, total_grad_norm
from testbed.layouts import mesh, same_bits_everywhere

WORLD = 4
MESHES = {"1d": ((4,), ("dp",)), "2d": ((2, 2), ("dp", "tp"))}
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
SIZES = st.sampled_from([0, 1, 2, 3, 5, 7])  # empty, single, and odd sizes that shard unevenly
FLOAT_ULPS = 16
BF16_RELATIVE = 8 * 2.0**-8
NORM_TYPES = (0.5, 1.0, 2.0, 3.0, math.inf)
# (gradient dtype, accumulation dtype): every example is checked in each
NORM_DTYPES = (
    (torch.float32, None),
    (torch.float64, None),
    (torch.bfloat16, None),
    (torch.bfloat16, torch.float32),
)
BUCKET_CAPS_MB = (1e-6, 3e-5, 1e-4, 25.0)  # 1e-6 MiB holds one element: one tensor per bucket
EXAMPLES = settings(
    max_examples=20,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# --- examples (drawn in the test process) -------------------------------------------------------


@dataclass(frozen=True)
class GradSpec:
    shape: tuple[int, ...]
    mesh: str  # "plain", "root", or a 1D submesh name ("dp", "tp")
    shard_dims: tuple[int | None, ...]  # per mesh dim: the tensor dim it shards, None = Replicate
    contiguous: bool


@dataclass(frozen=True)
class NormExample:
    mesh: str
    grads: tuple[GradSpec, ...]
    seed: int


@st.composite
def _grad_specs(draw: st.DrawFn, mesh_kind: str) -> GradSpec:
    shape = tuple(draw(st.lists(SIZES, min_size=1, max_size=2)))
    places = ["plain", "root"] if mesh_kind == "1d" else ["plain", "root", "dp", "tp"]
    where = draw(st.sampled_from(places))
    mesh_dims = {"plain": 0, "root": len(MESHES[mesh_kind][0])}.get(where, 1)
    dim_choice = st.sampled_from([*range(len(shape)), None])  # mostly sharded
    shard_dims = tuple(draw(dim_choice) for _ in range(mesh_dims))
    return GradSpec(shape, where, shard_dims, draw(st.booleans()))


@st.composite
def _norm_examples(draw: st.DrawFn) -> NormExample:
    mesh_kind = draw(st.sampled_from(sorted(MESHES)))
    return NormExample(
        mesh=mesh_kind,
        grads=tuple(draw(st.lists(_grad_specs(mesh_kind), min_size=1, max_size=5))),
        seed=draw(st.integers(0, 2**16)),
    )


# --- building the gradients (on every rank) ----------------------------------------------------


def _values(shape: tuple[int, ...], dtype: torch.dtype, *seed: int) -> Tensor:
    generator = torch.Generator().manual_seed(sum(part * 7919**k for k, part in enumerate(seed)))
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)


def _strided_copy(tensor: Tensor) -> Tensor:
    """The same values in a non-contiguous tensor (every other element of a wider buffer)."""
    wide = torch.empty(*tensor.shape, 2, dtype=tensor.dtype)[..., 0]
    wide.copy_(tensor)
    return wide


def _placements(shard_dims: tuple[int | None, ...]) -> list[Placement]:
    return [Replicate() if dim is None else Shard(dim) for dim in shard_dims]


def _as_grad(full: Tensor, spec: GradSpec, mesh_kind: str) -> Tensor:
    if spec.mesh == "plain":
        return full.clone() if spec.contiguous else _strided_copy(full)
    root = mesh(*MESHES[mesh_kind])
    device_mesh = root if spec.mesh == "root" else root[spec.mesh]
    placements = _placements(spec.shard_dims)
    sharded = distribute_tensor(full, device_mesh, placements, src_data_rank=None)
    local = sharded._local_tensor.clone()
    if not spec.contiguous:
        local = _strided_copy(local)
    return DTensor.from_local(
        local, device_mesh, placements, shape=full.shape, stride=full.stride()
    )


def _parameter(grad: Tensor) -> nn.Parameter:
    if isinstance(grad, DTensor):
        zeros = torch.zeros(grad._local_tensor.shape, dtype=grad.dtype)
        data = DTensor.from_local(
            zeros, grad.device_mesh, grad.placements, shape=grad.shape, stride=grad.stride()
        )
    else:
        data = torch.zeros(grad.shape, dtype=grad.dtype)
    param = nn.Parameter(data)
    param.grad = grad
    return param


def _same_bits(a: Tensor, b: Tensor) -> bool:
    """Bitwise equality (NaN-safe, any strides)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(_raw(a), _raw(b))


def _raw(tensor: Tensor) -> Tensor:
    dense = torch.empty(tensor.numel(), dtype=tensor.dtype)
    dense.copy_(tensor.reshape(-1))
    return dense.view(torch.uint8)


def _ulps(a: Tensor, b: Tensor) -> int:
    """Distance in units in the last place of the dtype (finite, non-negative a and b)."""
    as_int = {torch.float32: torch.int32, torch.float64: torch.int64}[a.dtype]
    return abs(int(a.reshape(1).view(as_int)) - int(b.to(a.dtype).reshape(1).view(as_int)))


def _torch_norm(tensors: list[Tensor], norm_type: float) -> Tensor:
    if norm_type == math.inf:  # torch's foreach max raises on empty tensors; they add nothing
        tensors = [t for t in tensors if t.numel() > 0]
    return torch.nn.utils.get_total_norm(tensors, norm_type)


def _norm_and_clip_match_torch(
    example: NormExample, dtype: torch.dtype, accumulate: torch.dtype | None, norm_type: float
) -> dict:
    full = [_values(s.shape, dtype, example.seed, i) for i, s in enumerate(example.grads)]
    grads = [_as_grad(f, s, example.mesh) for f, s in zip(full, example.grads, strict=True)]
    ours = total_grad_norm(grads, norm_type, dtype=accumulate)

    reference64 = _torch_norm([f.double() for f in full], norm_type)
    result: dict = {"case": (str(dtype), str(accumulate), norm_type)}
    if dtype == torch.bfloat16 and accumulate is None:
        assert ours.dtype == torch.bfloat16
        result["relative"] = abs(float(ours) - float(reference64)) / max(float(reference64), 1e-30)
    elif dtype == torch.bfloat16:
        result["ulps"] = _ulps(ours, reference64.float())
    else:
        result["ulps"] = _ulps(ours, _torch_norm(full, norm_type))
    if norm_type == math.inf and accumulate is None:  # a max is exact in any order
        result["exact"] = float(ours) == float(_torch_norm(full, norm_type))

    max_norm = float(reference64) / 2
    params = [_parameter(g) for g in grads]
    clipped_norm = clip_grad_norm_(params, max_norm, norm_type, dtype=accumulate)
    expected = [f.clone() for f in full]
    torch.nn.utils.clip_grads_with_norm_([_parameter(e) for e in expected], max_norm, clipped_norm)
    # each rank's shard of torch's clipped full gradient (a local split, no collective)
    clipped = [g._local_tensor if isinstance(g, DTensor) else g for g in grads]
    expected = [
        distribute_tensor(e, g.device_mesh, g.placements, src_data_rank=None)._local_tensor
        if isinstance(g, DTensor)
        else e
        for e, g in zip(expected, grads, strict=True)
    ]
    result["same_bits"] = same_bits_everywhere(ours)
    result["clip_norm_equal"] = torch.equal(clipped_norm, ours)
    result["clip_exact"] = all(_same_bits(c, e) for c, e in zip(clipped, expected, strict=True))
    return result


def _every_dtype_and_norm_type(example: NormExample) -> list[dict]:
    return [
        _norm_and_clip_match_torch(example, dtype, accumulate, norm_type)
        for dtype, accumulate in NORM_DTYPES
        for norm_type in NORM_TYPES
    ]


@pytest.mark.slow
@EXAMPLES
@given(example=_norm_examples())
def test_norm_and_clip_match_the_materialised_reference(ranks, example):
    for results in ranks.run(WORLD, _every_dtype_and_norm_type, example):
        for result in results:
            if "relative" in result:
                assert result["relative"] <= BF16_RELATIVE, result
            else:
                assert result["ulps"] <= FLOAT_ULPS, result
            assert result.get("exact", True), result
            assert result["same_bits"], f"ranks got different norms: {result}"
            assert result["clip_norm_equal"], f"clip_grad_norm_ returned another norm: {result}"
            assert result["clip_exact"], f"clipped gradients differ from torch's: {result}"


# --- averaging ---------------------------------------------------------------------------------

STRIDES = ("contiguous", "transposed", "stepped", "dtensor")


@dataclass(frozen=True)
class AvgExample:
    group: str  # "world" or "dp" (the dp dim of a (2, 2) mesh, orthogonal to the tp sharding)
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    strides: tuple[str, ...]
    tiled: bool  # every tensor of a dtype a consecutive view of one buffer (contiguous_grads_)
    seed: int


@st.composite
def _avg_examples(draw: st.DrawFn) -> AvgExample:
    count = draw(st.integers(1, 6))
    group = draw(st.sampled_from(["world", "dp"]))
    strides = STRIDES if group == "dp" else STRIDES[:-1]
    return AvgExample(
        group=group,
        shapes=tuple(tuple(draw(st.lists(SIZES, min_size=1, max_size=2))) for _ in range(count)),
        dtypes=tuple(draw(st.sampled_from(sorted(DTYPES))) for _ in range(count)),
        strides=tuple(draw(st.sampled_from(strides)) for _ in range(count)),
        tiled=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def _laid_out(values: Tensor, stride: str) -> Tensor:
    if stride == "transposed" and values.dim() == 2:
        return values.t().contiguous().t()
    if stride in ("transposed", "stepped"):
        return _strided_copy(values)
    return values.clone()


def _tile(tensors: list[Tensor]) -> list[Tensor]:
    """Each dtype's tensors as consecutive views of one contiguous buffer, values kept."""
    tiled: list[Tensor] = list(tensors)
    for dtype in {t.dtype for t in tensors}:
        indices = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        buffer = torch.empty(sum(tensors[i].numel() for i in indices), dtype=dtype)
        pieces = buffer.split([tensors[i].numel() for i in indices])
        for i, piece in zip(indices, pieces, strict=True):
            tiled[i] = piece.view(tensors[i].shape)
            tiled[i].copy_(tensors[i])
    return tiled


def _rank_grads(example: AvgExample) -> list[Tensor]:
    root = mesh(*MESHES["2d"])
    coordinate = root.get_coordinate()
    assert coordinate is not None
    rank = dist.get_rank()
    grads = []
    for i, (shape, name, stride) in enumerate(
        zip(example.shapes, example.dtypes, example.strides, strict=True)
    ):
        dtype = DTYPES[name]
        if stride == "dtensor":  # sharded over tp; the dp peers hold same-shaped local shards
            full = _values(shape, dtype, example.seed, i, coordinate[0])
            grads.append(distribute_tensor(full, root["tp"], [Shard(0)], src_data_rank=None))
        else:
            grads.append(_laid_out(_values(shape, dtype, example.seed, i, rank), stride))
    if example.tiled and not any(isinstance(g, DTensor) for g in grads):
        grads = _tile(grads)
    return grads


def _gather(tensor: Tensor, group: dist.ProcessGroup | None) -> list[Tensor]:
    out = [torch.empty(tensor.shape, dtype=tensor.dtype) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, tensor.contiguous(), group=group)
    return out


def _average_matches_gathered_mean(example: AvgExample, bucket_cap_mb: float) -> list[str]:
    group = None if example.group == "world" else mesh(*MESHES["2d"]).get_group("dp")
    size = dist.get_world_size(group)
    grads = _rank_grads(example)
    local = [g._local_tensor if isinstance(g, DTensor) else g for g in grads]
    layout = [(t.data_ptr(), t.stride()) for t in local]
    gathered = [torch.stack([v.double() for v in _gather(t, group)]) for t in local]
    allreduce_grads_avg(grads, group, bucket_cap_mb=bucket_cap_mb)
    problems = []
    for i, (t, values) in enumerate(zip(local, gathered, strict=True)):
        eps = torch.finfo(t.dtype).eps
        bound = size * eps * values.abs().mean(0)
        error = (t.double() - values.mean(0)).abs()
        if not bool((error <= bound).all()):
            problems.append(f"cap {bucket_cap_mb}, grad {i}: error {error.max()} > {bound.max()}")
        if (t.data_ptr(), t.stride()) != layout[i]:
            problems.append(f"cap {bucket_cap_mb}, grad {i}: not averaged in place")
        after = _gather(t, group)
        if not all(_same_bits(a, after[0]) for a in after):
            problems.append(f"cap {bucket_cap_mb}, grad {i}: ranks of the group disagree")
    return problems


def _average_with_every_cap(example: AvgExample) -> list[str]:
    return [p for cap in BUCKET_CAPS_MB for p in _average_matches_gathered_mean(example, cap)]


@pytest.mark.slow
@EXAMPLES
@given(example=_avg_examples())
def test_average_matches_the_gathered_mean(ranks, example):
    for problems in ranks.run(WORLD, _average_with_every_cap, example):
        assert not problems, problems
