"""Bucketed averaging on real gloo ranks: exact copy-back, collectives per bucket, the zero-copy
path, and the memory bound.

Oracle for values: each rank fills every tensor from a generator seeded by (its rank, the
tensor's index), so every rank can rebuild its peers' inputs and average them itself. Averages
are taken over groups of two ranks: gloo's sum is then one addition, which is commutative, and
the division by 2 is the same operation the library applies, so the expected result is exact to
the bit, in every dtype (bf16 and fp16 sums round once, the same way in gloo and in torch).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from credit.parallel._averaging import buckets as _buckets
from credit.parallel.collectives import allreduce_grads_avg, contiguous_grads_
from testbed.layouts import TinyNet, run_step
from testbed.memory import extra_memory

MiB = 2**20
_INT_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16}


@functools.cache
def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    # Dim names of our own: torch may give a DTensor an equal mesh (same ranks and name) sliced
    # from another test's root mesh, which would confuse that test's norms.
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _values(rank: int, index: int, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + index)
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)


def _fill(tensors: list[Tensor]) -> None:
    """Write this rank's values into every tensor in place (local shard for a DTensor)."""
    for index, tensor in enumerate(tensors):
        local = _local(tensor)
        local.copy_(_values(dist.get_rank(), index, tuple(local.shape), local.dtype))


def _expected(tensors: list[Tensor], peers: list[int]) -> list[Tensor]:
    """The average over ``peers`` (two ranks) of what each of them wrote with ``_fill``."""
    assert len(peers) == 2
    out = []
    for index, tensor in enumerate(tensors):
        local = _local(tensor)
        a, b = (_values(peer, index, tuple(local.shape), local.dtype) for peer in peers)
        out.append((a + b) / 2)
    return out


def _local(tensor: Tensor) -> Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _same_bits(a: Tensor, b: Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    view = _INT_VIEW[a.element_size()]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def _count(call) -> int:
    with CommDebugMode() as mode:
        call()
    return mode.get_total_counts()


# ---------------------------------------------------------------------------------------------
# Exact copy-back: empty, strided, mixed-dtype tensors and real FSDP2 local shards


def _odd_tensors() -> tuple[list[Tensor], Tensor]:
    """Plain tensors of every awkward kind, interleaved dtypes; also the base of a slice."""
    sliced_base = torch.full((6, 9), 7.0)
    tensors = [
        torch.empty(0),
        torch.empty(5, 7).t(),  # transposed
        sliced_base[:, 1::3],  # strided slice inside a larger tensor
        torch.empty(3, 0, dtype=torch.float64),
        torch.empty(4, 5, dtype=torch.float64),
        torch.empty(2, 3, 4).permute(2, 0, 1),
        torch.empty(6, 4, dtype=torch.bfloat16).t(),
        torch.empty(33, dtype=torch.float16),
        torch.empty((), dtype=torch.float32),  # a 0-dim tensor
        torch.empty(200, 100).t(),  # non-contiguous and large: the division fused in the copy
        torch.empty(17, dtype=torch.bfloat16),
    ]
    return tensors, sliced_base


def _fsdp_domain_grads() -> tuple[list[Tensor], DeviceMesh]:
    """Real FSDP2 grads on the dp dim of a (dp=2, domain=2) mesh; the 1-row head weight leaves
    dp rank 1 (both of its domain peers) an empty local shard."""
    mesh = _mesh((2, 2), ("bk_dp", "bk_domain"))
    torch.manual_seed(0)
    model = TinyNet()
    for block in model.blocks:
        fully_shard(block, mesh=mesh["bk_dp"])
    fully_shard(model, mesh=mesh["bk_dp"])
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    run_step(model, seed=0, dp_rank=coordinate[0], dp_size=2)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return grads, mesh


def _copy_back_is_exact(cap_bytes: int) -> dict[str, object]:
    dtensors, mesh = _fsdp_domain_grads()
    plain, sliced_base = _odd_tensors()
    tensors = [t for pair in zip(plain, dtensors[: len(plain)], strict=False) for t in pair]
    tensors += dtensors[len(plain) :]
    _fill(tensors)
    domain = mesh.get_group("bk_domain")
    expected = _expected(tensors, dist.get_process_group_ranks(domain))
    pointers = [_local(t).data_ptr() for t in tensors]
    strides = [_local(t).stride() for t in tensors]
    allreduce_grads_avg(tensors, domain, bucket_cap_mb=cap_bytes / MiB)
    locals_ = [_local(t) for t in tensors]
    outside = sliced_base.clone()
    outside[:, 1::3] = 7.0
    return {
        "exact": [_same_bits(t, e) for t, e in zip(locals_, expected, strict=True)],
        "in place": [t.data_ptr() for t in locals_] == pointers,
        "strides kept": [t.stride() for t in locals_] == strides,
        "rest of the sliced tensor untouched": bool((outside == 7.0).all()),
        "empty dtensor shards": sum(_local(t).numel() == 0 for t in dtensors),
        "digest": [float(t.double().sum()) for t in locals_],
    }


@pytest.mark.parametrize("cap_bytes", [64, 1024, 25 * MiB], ids=["64B", "1KiB", "25MiB"])
def test_copy_back_through_buckets_is_exact(ranks, cap_bytes):
    results = ranks.run(4, _copy_back_is_exact, cap_bytes)
    for rank, result in enumerate(results):
        assert all(result["exact"]), f"rank {rank}: {result['exact']}"
        assert result["in place"] and result["strides kept"], rank
        assert result["rest of the sliced tensor untouched"], rank
    # dp rank 1 (world ranks 2 and 3) holds the empty shard of the 1-row head weight.
    assert results[2]["empty dtensor shards"] >= 1
    # Domain peers (ranks 0-1, 2-3) end with the same values.
    assert results[0]["digest"] == results[1]["digest"]
    assert results[2]["digest"] == results[3]["digest"]


# ---------------------------------------------------------------------------------------------
# Collectives per call as a function of the cap


def _cap_test_tensors() -> list[Tensor]:
    """12 contiguous fp32 of 256 (1 KiB each), one transposed fp32 16x16, 3 fp64 of 128 (1 KiB
    each), and 2 empty tensors, interleaved."""
    tensors: list[Tensor] = [torch.empty(256) for _ in range(12)]
    tensors.insert(5, torch.empty(16, 16).t())
    for position in (2, 9, 14):
        tensors.insert(position, torch.empty(128, dtype=torch.float64))
    tensors.insert(0, torch.empty(0))
    tensors.append(torch.empty(0, 4, dtype=torch.float64))
    return tensors


# cap -> collectives, worked out by hand from the rule: a contiguous tensor of at least `cap`
# elements is reduced alone; the other non-empty ones fill buckets in order (per dtype), a bucket
# closing when the next tensor would take it past `cap` elements; empty tensors cost nothing.
CAP_TO_COLLECTIVES = {
    64 * 1024: 2,  # fp32: all 13 (13 KiB) in one bucket; fp64: 3 KiB in one
    4 * 1024: 5,  # fp32 cap 1024 elements: 4 + 4 + 4 + 1 tensors; fp64 cap 512: one bucket
    3 * 1024: 6,  # fp32 cap 768: 3 + 3 + 3 + 3 + 1; fp64 cap 384: exactly 3 x 128 in one
    1024: 16,  # fp32 cap 256: 12 alone in place + the transposed one; fp64 cap 128: 3 alone
    512: 16,  # fp32 cap 128: the same, the transposed one (256 > cap) in a bucket of its own
}


def _collectives_for_cap(cap_bytes: int) -> tuple[int, int, bool]:
    tensors = _cap_test_tensors()

    def call() -> None:
        allreduce_grads_avg(tensors, None, bucket_cap_mb=cap_bytes / MiB)

    first = _count(call)
    _fill(tensors)
    expected = _expected(tensors, [0, 1])
    count = _count(call)
    exact = all(_same_bits(t, e) for t, e in zip(tensors, expected, strict=True))
    return first, count, exact


@pytest.mark.parametrize("cap_bytes", sorted(CAP_TO_COLLECTIVES))
def test_one_collective_per_bucket(ranks, cap_bytes):
    for first, count, exact in ranks.run(2, _collectives_for_cap, cap_bytes):
        # The first call for a layout verifies it across the group in one small all_reduce more.
        assert first == CAP_TO_COLLECTIVES[cap_bytes] + 1
        assert count == CAP_TO_COLLECTIVES[cap_bytes]
        assert exact


# ---------------------------------------------------------------------------------------------
# Memory, measured with the profiler
#
# torch keeps no allocator statistics on CPU, so calls run under
# torch.profiler.profile(profile_memory=True), which records every allocation and free torch
# makes on the calling thread. The call's peak extra memory is the highest running sum of those
# events; its largest block is the largest single allocation. (gloo's own transfer buffers are
# not torch allocations and are not counted; they are the same for any way of averaging.)


def _memory_of(call) -> tuple[int, int]:
    """(peak extra bytes, largest single allocation) of ``call``, as the benchmark measures it."""
    use = extra_memory(call, torch.device("cpu"))
    return use.peak_bytes, use.largest_bytes


CAP = 256 * 1024  # 64 Ki floats
# Slack for allocations that do not scale with the data: views and the division into the
# destination allocate no storage, but ATen's copy out of a transposed tensor uses a scratch
# block of 60 x 60 floats (14,400 bytes), freed at once.
SLACK = 64 * 1024


def _memory_bound() -> dict[str, int | bool]:
    # 40 grads of 64 KiB (2.5 MiB): half transposed, so they go through the buckets; 4 per bucket.
    tensors = [
        torch.empty(128, 128) if index % 2 else torch.empty(128, 128).t() for index in range(40)
    ]
    total = sum(t.numel() * t.element_size() for t in tensors)
    _fill(tensors)
    expected = _expected(tensors, [0, 1])
    _buckets.release_buffers()
    cold_peak, cold_largest = _memory_of(
        lambda: allreduce_grads_avg(tensors, None, bucket_cap_mb=CAP / MiB)
    )
    kept = _buckets.kept_buffer_bytes()
    exact = all(_same_bits(t, e) for t, e in zip(tensors, expected, strict=True))
    warm_peak, _ = _memory_of(lambda: allreduce_grads_avg(tensors, None, bucket_cap_mb=CAP / MiB))
    # The control: the same measurement sees the full copy a flatten makes.
    flatten_peak, _ = _memory_of(lambda: torch._utils._flatten_dense_tensors(tensors))
    _buckets.release_buffers()
    return {
        "total": total,
        "cold peak": cold_peak,
        "cold largest": cold_largest,
        "kept": kept,
        "warm peak": warm_peak,
        "flatten peak": flatten_peak,
        "exact": exact,
    }


def test_extra_memory_is_two_buckets_not_a_copy(ranks):
    for result in ranks.run(2, _memory_bound):
        assert result["exact"]
        assert result["flatten peak"] >= result["total"]  # the method sees a full copy
        assert result["cold peak"] <= 2 * CAP + SLACK
        assert result["cold largest"] <= CAP
        assert result["kept"] <= 2 * CAP
        assert result["warm peak"] <= SLACK  # buffers reused: nothing new per call
        assert result["cold peak"] < result["total"] / 4


# ---------------------------------------------------------------------------------------------
# Zero copy: gradients laid out by contiguous_grads_


def _zero_copy() -> dict[str, object]:
    shapes = [(3, 5), (0,), (7,), (4, 4, 2), (1,)]
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    (buffer,) = contiguous_grads_(params)
    grads = [p.grad for p in params]
    allreduce_grads_avg(grads, None)  # the first call for a layout also verifies it
    _fill(grads)
    expected = _expected(grads, [0, 1])
    pointer = buffer.data_ptr()
    _buckets.release_buffers()
    holder: dict[str, int] = {}

    def call() -> None:
        holder["count"] = _count(lambda: allreduce_grads_avg(grads, None))

    peak, _ = _memory_of(call)
    result: dict[str, object] = {
        "count": holder["count"],
        "peak": peak,
        "kept": _buckets.kept_buffer_bytes(),
        "exact": all(_same_bits(g, e) for g, e in zip(grads, expected, strict=True)),
        "buffer in place": buffer.data_ptr() == pointer,
        "grads still views": all(p.grad._base is buffer for p in params),
    }
    # The control: once one grad no longer lives in the buffer, the bucket path takes over.
    params[2].grad = params[2].grad.clone()
    allreduce_grads_avg([p.grad for p in params], None)
    result["kept after fallback"] = _buckets.kept_buffer_bytes()
    _buckets.release_buffers()
    return result


def test_contiguous_grads_reduce_in_place_with_one_collective(ranks):
    for result in ranks.run(2, _zero_copy):
        assert result["exact"]
        assert result["count"] == 1
        assert result["buffer in place"] and result["grads still views"]
        assert result["kept"] == 0 and result["peak"] <= SLACK  # no bucket, no copy
        assert result["kept after fallback"] > 0


# ---------------------------------------------------------------------------------------------
# Buffers and their cached views across calls of changing layouts


def _changing_layouts() -> dict[str, object]:
    _buckets.release_buffers()
    exact = []
    # 20 layouts (more than the views kept per buffer), sizes growing then shrinking, so buffers
    # grow mid-way and cached views of the old buffers must not be used again.
    sizes = [*range(1, 11), *range(30, 10, -2)]
    for step, size in enumerate(sizes):
        tensors = [torch.empty(size, 3), torch.empty(3, size).t(), torch.empty(size + step)]
        _fill(tensors)
        expected = _expected(tensors, [0, 1])
        allreduce_grads_avg(tensors, None, bucket_cap_mb=200 / MiB)  # several buckets each
        exact.append(all(_same_bits(t, e) for t, e in zip(tensors, expected, strict=True)))
    slots = [slot for slots in _buckets._bucket_buffers.values() for slot in slots]
    result = {
        "exact": exact,
        "kept": _buckets.kept_buffer_bytes(),
        "layouts kept per buffer": max(len(slot.views) for slot in slots),
    }
    _buckets.release_buffers()
    return result


def test_buffers_and_cached_views_follow_changing_layouts(ranks):
    for result in ranks.run(2, _changing_layouts):
        assert all(result["exact"]), result["exact"]
        # The largest bucket: a single tensor above the cap (30 x 3 floats, transposed) = 360 B.
        assert result["kept"] <= 2 * 360
        assert result["layouts kept per buffer"] <= _buckets._MAX_LAYOUTS_PER_BUFFER
