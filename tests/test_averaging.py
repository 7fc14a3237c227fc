"""allreduce_grads_avg and all_reduce_avg on real gloo groups, against an all_gather oracle.

Oracle: the group's original values, all-gathered, summed in the tensor's dtype and divided by
the group size. Tolerances, and why there are (almost) none:
- groups of 2: a sum of two values is correctly rounded whatever the order and the division by 2
  is exact, so the result must have exactly the oracle's bits, for random values in every dtype;
- groups of 4: gloo's ring sums each chunk starting from a different rank, so the order of the
  additions differs from element to element. With dyadic values of few significant bits every
  partial sum is exact in any order (and /4 is exact), so the bits must still match exactly. For
  random values the result must lie within n ULPs of the mean magnitude of the exact mean
  (recursive summation of n terms errs by at most (n-1)/2 ULP of sum|x|, the result's rounding
  by 1/2 ULP more), and every rank must hold the same bits.
gloo's ReduceOp.AVG is a SUM followed by a division, so the native path and the SUM-then-divide
fallback must give the same bits.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

import credit.parallel._common.groups as groups_module
from credit.parallel.collectives import all_reduce_avg, allreduce_grads_avg
from testbed.layouts import TinyNet, mesh, run_step

INTEGER_VIEW = {2: torch.int16, 4: torch.int32, 8: torch.int64}
# 128 bytes: 32 fp32, 64 bf16 or 16 fp64 elements per bucket, so the grads below need several.
TINY_BUCKET_MB = 128 / 2**20


# ---------------------------------------------------------------------------------------------
# helpers


class _AllReduces(TorchDispatchMode):
    """Records the reduce op of every c10d all_reduce issued inside the block (observation only)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.c10d.allreduce_.default:
            self.ops.append(_OP_NAMES[int(args[2].op())])
        return func(*args, **(kwargs or {}))


_OP_NAMES = {int(op): name for name, op in (("SUM", dist.ReduceOp.SUM), ("AVG", dist.ReduceOp.AVG))}


def _bits(tensor: Tensor) -> Tensor:
    return tensor.detach().contiguous().view(INTEGER_VIEW[tensor.element_size()])


def _same_bits(a: Tensor, b: Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


@functools.cache
def _pairs() -> tuple[ProcessGroup, ...]:
    """Groups {0, 1} and {2, 3}; every rank creates both, once per worker process."""
    return tuple(dist.new_group([first, first + 1]) for first in range(0, dist.get_world_size(), 2))


def _my_pair() -> ProcessGroup:
    return _pairs()[dist.get_rank() // 2]


def _groups() -> list[tuple[str, ProcessGroup | DeviceMesh | None, bool]]:
    """(name, group as the caller passes it, whether its values must be dyadic for exactness)."""
    world = dist.get_world_size()
    return [
        ("world (None)", None, True),
        ("pair ProcessGroup", _my_pair(), False),
        ("pair DeviceMesh", mesh((world // 2, 2), ("dp", "tp"))["tp"], False),
        ("world DeviceMesh", mesh((world,), ("dp",)), True),
    ]


def _process_group(group: ProcessGroup | DeviceMesh | None) -> ProcessGroup | None:
    return group.get_group() if isinstance(group, DeviceMesh) else group


def _gather(tensor: Tensor, group: ProcessGroup | None) -> list[Tensor]:
    flat = tensor.detach().contiguous().reshape(-1)
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    if flat.numel() > 0:
        dist.all_gather(out, flat, group=group)
    return [t.reshape(tensor.shape) for t in out]


def _mean_in_dtype(values: list[Tensor]) -> Tensor:
    total = values[0].clone()
    for value in values[1:]:
        total += value
    return total / len(values)


def _check_average(
    result: Tensor, originals: list[Tensor], dyadic: bool, group: ProcessGroup | None, what: str
) -> None:
    """``result`` against the mean of the group's ``originals``; every rank holds the same bits."""
    n = len(originals)
    assert result.shape == originals[0].shape, f"{what}: shape changed"
    if n == 2 or dyadic:
        expected = _mean_in_dtype(originals)
        assert _same_bits(result, expected), f"{what}: {result} != {expected}"
    else:
        exact = sum(o.double() for o in originals) / n
        magnitude = sum(o.double().abs() for o in originals) / n
        bound = n * torch.finfo(result.dtype).eps * magnitude
        error = (result.double() - exact).abs()
        assert bool((error <= bound).all()), f"{what}: off by {float((error - bound).max())}"
    for other in _gather(result, group):
        assert _same_bits(other, result), f"{what}: ranks of the group disagree"


def _values(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator, dyadic: bool):
    if dyadic:  # |k/8| < 8 with k an integer: sums of 4 are exact even in bf16 (8 bits)
        return (torch.randint(-63, 64, shape, generator=generator) / 8).to(dtype)
    return (torch.randn(shape, generator=generator) * 3).to(dtype)


def _dense_grads(seed: int, dyadic: bool) -> list[Tensor | None]:
    """Mixed dtypes, non-contiguous and empty grads, a None, a scalar; different on every rank."""
    generator = torch.Generator().manual_seed(seed * 100 + dist.get_rank())

    def v(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> Tensor:
        return _values(shape, dtype, generator, dyadic)

    return [
        v((5, 7)),  # contiguous, larger than a tiny bucket: reduced in place
        v((9,), torch.bfloat16),
        v((4, 3), torch.float64),
        v((6, 4)).t(),  # transposed
        v((8, 6))[::2, 1:4],  # sliced, strided
        v((0, 5)),  # empty
        None,
        v((0,), torch.bfloat16),
        v((300,)),
        v((10,), torch.float64)[2:7],  # a contiguous view at an offset
        v((3, 5), torch.bfloat16).t(),
        v(()),  # a 0-dim tensor
    ]


# Collectives per call, as _buckets documents them (cap = 128 bytes): fp32: 2 direct ((5, 7) and
# (300,)) + 2 buckets ([24], [12 + 1]); bf16: 1 bucket (9 + 15); fp64: 2 buckets ([12], [5]).
TINY_BUCKET_ALL_REDUCES = 7
DEFAULT_BUCKET_ALL_REDUCES = 3  # one bucket per dtype


def _dense_grads_averaged(seed: int) -> None:
    for name, group, dyadic in _groups():
        process_group = _process_group(group)
        for cap_mb, expected_calls in (
            (TINY_BUCKET_MB, TINY_BUCKET_ALL_REDUCES),
            (25.0, DEFAULT_BUCKET_ALL_REDUCES),
        ):
            # The first call for a layout verifies it in one more all_reduce: count later calls.
            allreduce_grads_avg(_dense_grads(seed, dyadic), group, bucket_cap_mb=cap_mb)
            grads = _dense_grads(seed, dyadic)
            originals = [None if g is None else g.clone() for g in grads]
            addresses = [None if g is None else (g.data_ptr(), g.stride()) for g in grads]
            with _AllReduces() as recorded:
                allreduce_grads_avg(grads, group, bucket_cap_mb=cap_mb)
            assert len(recorded.ops) == expected_calls, f"{name} cap={cap_mb}: {recorded.ops}"
            for index, (grad, original) in enumerate(zip(grads, originals, strict=True)):
                if grad is None:
                    continue
                what = f"{name} cap={cap_mb} grad {index} {grad.dtype} {tuple(grad.shape)}"
                assert (grad.data_ptr(), grad.stride()) == addresses[index], f"{what}: not in place"
                _check_average(grad, _gather(original, process_group), dyadic, process_group, what)


def _tiled_views_averaged(seed: int) -> None:
    """Views that tile one buffer are averaged through it; partial or reordered tilings are not
    mistaken for one."""
    group = _my_pair()
    generator = torch.Generator().manual_seed(seed * 100 + dist.get_rank())
    for name, slices, expected_calls in (
        ("tiling in order", [(0, 10), (10, 20)], 1),
        ("tiling reordered", [(10, 20), (0, 10)], 1),  # one bucket of the two
        ("partial cover", [(0, 10)], 1),
    ):
        buffer = torch.randn(20, generator=generator)
        before = buffer.clone()
        views = [buffer[start:stop].view(2, 5) for start, stop in slices]
        scratch = torch.zeros(20)  # the first call for a layout verifies it: count later calls
        scratch_views = [scratch[start:stop].view(2, 5) for start, stop in slices]
        allreduce_grads_avg(scratch_views, group, bucket_cap_mb=TINY_BUCKET_MB * 4)
        with _AllReduces() as recorded:
            allreduce_grads_avg(views, group, bucket_cap_mb=TINY_BUCKET_MB * 4)
        assert len(recorded.ops) == expected_calls, f"{name}: {recorded.ops}"
        covered = torch.zeros(20, dtype=torch.bool)
        for start, stop in slices:
            covered[start:stop] = True
        assert _same_bits(buffer[~covered], before[~covered]), f"{name}: touched the rest"
        for view, (start, stop) in zip(views, slices, strict=True):
            originals = _gather(before[start:stop].view(2, 5), group)
            _check_average(view, originals, False, group, name)


def test_dense_grads_of_mixed_dtypes_and_layouts_are_averaged_in_buckets(ranks):
    ranks.run(4, _dense_grads_averaged, 1)


def test_views_of_one_buffer_are_averaged(ranks):
    ranks.run(4, _tiled_views_averaged, 2)


# ---------------------------------------------------------------------------------------------
# DTensor grads averaged on their local shards over an orthogonal group


def _from_local(
    local: Tensor, device_mesh: DeviceMesh, placements: list, shape: tuple[int, ...]
) -> DTensor:
    stride = torch.empty(shape).stride()
    return DTensor.from_local(
        local, device_mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride
    )


def _dtensor_grads(generator: torch.Generator) -> list[Tensor]:
    """DTensors sharded over dp (empty, strided, uneven shards), one on the 2D mesh, one plain."""
    world_mesh = mesh((dist.get_world_size() // 2, 2), ("dp", "tp"))
    dp_mesh = world_mesh["dp"]
    dp = dp_mesh.get_local_rank()
    head_rows = 1 if dp == 0 else 0  # a (1, 3) weight over dp=2: dp rank 1 holds an empty shard
    return [
        _from_local(torch.randn(head_rows, 3, generator=generator), dp_mesh, [Shard(0)], (1, 3)),
        _from_local(torch.randn(3, 4, generator=generator).t(), dp_mesh, [Shard(1)], (4, 6)),
        _from_local(
            torch.randn(3 - dp, generator=generator).to(torch.bfloat16), dp_mesh, [Shard(0)], (5,)
        ),
        _from_local(
            torch.randn(2, 4, generator=generator, dtype=torch.float64),
            world_mesh,
            [Shard(0), Replicate()],
            (4, 4),
        ),
        torch.randn(5, generator=generator),
    ]


def _fsdp_grads(seed: int) -> list[Tensor]:
    """Real FSDP2 gradients on the dp submesh; every rank sees its own data, as domain peers do."""
    world_mesh = mesh((dist.get_world_size() // 2, 2), ("dp", "tp"))
    torch.manual_seed(seed)
    model = TinyNet()
    for block in model.blocks:
        fully_shard(block, mesh=world_mesh["dp"])
    fully_shard(model, mesh=world_mesh["dp"])
    run_step(model, seed, dp_rank=dist.get_rank(), dp_size=dist.get_world_size())
    return [p.grad for p in model.parameters() if p.grad is not None]


def _dtensor_grads_averaged(seed: int) -> None:
    world_mesh = mesh((dist.get_world_size() // 2, 2), ("dp", "tp"))
    tp_group = world_mesh.get_group("tp")
    generator = torch.Generator().manual_seed(seed * 100 + dist.get_rank())
    fsdp_grads = _fsdp_grads(seed)
    for name, group in (("tp DeviceMesh", world_mesh["tp"]), ("tp ProcessGroup", tp_group)):
        for grads in (_dtensor_grads(generator), fsdp_grads):
            local = [g._local_tensor if isinstance(g, DTensor) else g for g in grads]
            if grads is not fsdp_grads:
                assert not local[1].is_contiguous(), "from_local should keep the strided shard"
            originals = [_gather(t, tp_group) for t in local]
            layouts = [(t.data_ptr(), t.shape, t.stride()) for t in local]
            allreduce_grads_avg(grads, group, bucket_cap_mb=TINY_BUCKET_MB)
            for index, grad in enumerate(grads):
                now = grad._local_tensor if isinstance(grad, DTensor) else grad
                what = f"{name} grad {index} {type(grad).__name__} {tuple(now.shape)}"
                assert now is local[index], f"{what}: the local tensor was replaced"
                assert (now.data_ptr(), now.shape, now.stride()) == layouts[index], what
                _check_average(now, originals[index], False, tp_group, what)


def test_dtensor_grads_are_averaged_on_their_local_shards(ranks):
    ranks.run(4, _dtensor_grads_averaged, 3)


# ---------------------------------------------------------------------------------------------
# all_reduce_avg: native AVG and the SUM-then-divide fallback


_SUPPORTS_NATIVE_AVG = groups_module.supports_native_avg


def _no_native_avg(group: object, device: torch.device) -> bool:
    return False


def _all_reduce_avg_both_paths(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed * 100 + dist.get_rank())
    for name, group, _ in _groups():
        process_group = _process_group(group)
        dyadic = dist.get_world_size(process_group) > 2
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            for shape in ((7, 3), ()):  # a () tensor: a loss being averaged for logging
                original = _values(shape, dtype, generator, dyadic)
                what = f"{name} {dtype} {shape}"
                native = original.clone()
                with _AllReduces() as recorded:
                    all_reduce_avg(native, group)
                assert recorded.ops == ["AVG"], f"{what}: {recorded.ops}"
                fallback = original.clone()
                # The fallback, as on a backend without AVG (MPI, UCC).
                groups_module.supports_native_avg = _no_native_avg
                try:
                    with _AllReduces() as recorded:
                        all_reduce_avg(fallback, group)
                finally:
                    groups_module.supports_native_avg = _SUPPORTS_NATIVE_AVG
                assert recorded.ops == ["SUM"], f"{what}: {recorded.ops}"
                assert _same_bits(native, fallback), f"{what}: native {native} != {fallback}"
                originals = _gather(original, process_group)
                _check_average(native, originals, dyadic, process_group, what)
        # random values on the whole world: the bound, and the same bits on every rank
        original = _values((64,), torch.float32, generator, dyadic=False)
        averaged = original.clone()
        all_reduce_avg(averaged, group)
        _check_average(averaged, _gather(original, process_group), False, process_group, name)


def _all_reduce_avg_dtensor(seed: int) -> None:
    """A DTensor is averaged on its local shard: a dp-sharded value over the tp group."""
    world_mesh = mesh((dist.get_world_size() // 2, 2), ("dp", "tp"))
    generator = torch.Generator().manual_seed(seed * 100 + dist.get_rank())
    local = torch.randn(3, 4, generator=generator)
    value = _from_local(local, world_mesh["dp"], [Shard(0)], (6, 4))
    originals = _gather(local, world_mesh.get_group("tp"))
    all_reduce_avg(value, world_mesh["tp"])
    assert isinstance(value, DTensor) and value._local_tensor.shape == (3, 4)
    _check_average(value._local_tensor, originals, False, world_mesh.get_group("tp"), "DTensor")


def _all_reduce_avg_cases(seed: int) -> None:
    _all_reduce_avg_both_paths(seed)
    _all_reduce_avg_dtensor(seed)


def test_all_reduce_avg_native_and_fallback_give_the_same_bits(ranks):
    ranks.run(4, _all_reduce_avg_cases, 4)


def _avg_native_flag_is_restored() -> bool:
    return groups_module.supports_native_avg is _SUPPORTS_NATIVE_AVG


def test_the_fallback_switch_was_restored(ranks):
    assert all(ranks.run(4, _avg_native_flag_is_restored))
