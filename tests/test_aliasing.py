"""allreduce_grads_avg when gradients share memory, and the first-call layout verification.

Each case lists tensors that alias each other (the same tensor twice, views of a larger tensor,
views of a base that is not listed) over both paths: in place (contiguous, at least the cap) and
through buckets. The oracle is the mean of the original values, all_gathered before the call:
every element of memory that some listed tensor reaches must end equal to the mean of its
original values (averaged exactly once), every other element unchanged. Over two ranks the
expected bits are exact (0 ULP): gloo's sum is one correctly rounded addition, the same in either
order, and the halving is exact, as the library's division is. Every rank must also hold the same
bits.

The verification: the first call for a layout and group costs one small all_reduce more, later
calls none; ranks that disagree (a group that is not orthogonal to FSDP2's sharding, aliasing on
one rank only) raise on every rank before any data moves.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.debug import CommDebugMode

from credit.parallel.collectives import allreduce_grads_avg, contiguous_grads_

MiB = 2**20
CAP_BYTES = 1024  # 256 fp32, 128 fp64, 512 bf16 elements per bucket
_INT_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16}

# A case: a generator -> (the tensors that own the memory, the list passed to the call).
Case = Callable[[torch.Generator], tuple[list[Tensor], list[Tensor]]]


def _randn(generator: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)


def _grid(base: Tensor) -> Tensor:
    return base.view(10, 100)


CASES: dict[str, Case] = {
    # a tied embedding reached through two modules: in place, twice
    "the same tensor twice, above the cap": lambda g: ([a := _randn(g, 1000)], [a, a]),
    "the same tensor twice, below the cap": lambda g: ([a := _randn(g, 50)], [a, a]),
    "the same tensors repeated among others": lambda g: (
        [a := _randn(g, 1000), b := _randn(g, 100), c := _randn(g, 30)],
        [a, b, a, c, a, b],
    ),
    "a large tensor and a view of it": lambda g: ([a := _randn(g, 40, 25)], [a, a[3:9]]),
    "a strided view before the large tensor": lambda g: ([a := _randn(g, 40, 25)], [a[::2], a]),
    "a large tensor and its transpose": lambda g: ([a := _randn(g, 40, 25)], [a.t(), a]),
    "a large tensor, a view and a detached copy of it": lambda g: (
        [a := _randn(g, 40, 25)],
        [a[5:], a.detach(), a[1, 2:4]],
    ),
    "views of a large base, in buckets": lambda g: (
        [base := _randn(g, 1000)],
        [
            base[0:100],
            base[100:150],
            base[0:100],
            _grid(base)[1:, 90:95],  # interleaved with the next one, no element in common
            _grid(base)[1:, 95:100],
            base[200:210],
        ],
    ),
    "a view wholly inside a strided view": lambda g: (
        [base := _randn(g, 1000)],
        [_grid(base)[3, 5:10], _grid(base)[:, 0:20], _grid(base)[2:4, 1:3]],
    ),
    "a mix of paths and dtypes": lambda g: (
        [
            a := _randn(g, 600),
            b := _randn(g, 30, 40),
            c := _randn(g, 50, dtype=torch.float64),
            d := _randn(g, 700, dtype=torch.bfloat16),
        ],
        [a, b.t(), a[100:200], c, b.t(), d, d[:5], c[10:], a[::3]],
    ),
}


def _same_bits(a: Tensor, b: Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    view = _INT_VIEW[a.element_size()]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def _gathered(tensor: Tensor) -> list[Tensor]:
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(out, tensor.contiguous())
    return out


def _reached(owner: Tensor, grads: list[Tensor]) -> Tensor:
    """Which elements of ``owner`` (contiguous) some tensor of ``grads`` reaches."""
    mask = torch.zeros(owner.numel(), dtype=torch.bool)
    address = owner.untyped_storage().data_ptr()
    for grad in grads:
        if grad.untyped_storage().data_ptr() == address:
            offset = grad.storage_offset() - owner.storage_offset()
            mask.as_strided(grad.shape, grad.stride(), offset).fill_(True)
    return mask


def _count(call: Callable[[], object]) -> int:
    with CommDebugMode() as mode:
        call()
    return mode.get_total_counts()


def _average_case(name: str) -> dict[str, object]:
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    owners, grads = CASES[name](generator)
    flat = [owner.contiguous().view(-1) for owner in owners]
    assert all(f.data_ptr() == o.data_ptr() for f, o in zip(flat, owners, strict=True))
    originals = [f.clone() for f in flat]
    means = [sum(_gathered(f)) / 2 for f in originals]
    allreduce_grads_avg(grads, None, bucket_cap_mb=CAP_BYTES / MiB)
    exact, everywhere = [], []
    for now, before, mean in zip(flat, originals, means, strict=True):
        reached = _reached(now, grads)
        exact.append(_same_bits(now, torch.where(reached, mean.to(now.dtype), before)))
        everywhere.append(all(_same_bits(now[reached], peer[reached]) for peer in _gathered(now)))
    return {"exact": exact, "same bits on every rank": everywhere}


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_element_is_averaged_exactly_once(ranks, name):
    for rank, result in enumerate(ranks.run(2, _average_case, name)):
        assert all(result["exact"]), f"rank {rank}: {result}"
        assert all(result["same bits on every rank"]), f"rank {rank}: {result}"


def _tiled_with_a_repeat() -> dict[str, object]:
    params = [nn.Parameter(torch.zeros(shape)) for shape in ((3, 5), (7,), (4, 4))]
    contiguous_grads_(params)
    grads = [p.grad for p in params]
    listed = [*grads, grads[1], grads[0][1]]
    allreduce_grads_avg(listed, None)  # the first call for this layout verifies it
    generator = torch.Generator().manual_seed(7 + dist.get_rank())
    for grad in grads:
        grad.copy_(_randn(generator, *grad.shape))
    means = [sum(_gathered(g)) / 2 for g in grads]
    count = _count(lambda: allreduce_grads_avg(listed, None))
    return {
        "count": count,
        "exact": all(_same_bits(g, m) for g, m in zip(grads, means, strict=True)),
    }


def test_views_repeated_over_a_tiled_buffer_keep_the_single_collective(ranks):
    for result in ranks.run(2, _tiled_with_a_repeat):
        assert result == {"count": 1, "exact": True}


# ---------------------------------------------------------------------------------------------
# Overlaps that cannot be resolved: an error on every rank, nothing modified

OVERLAPS: dict[str, tuple[Callable[[Tensor], list[Tensor]], tuple[int, int]]] = {
    "rows 0-2 and rows 2-4": (lambda a: [a[0:3], a[2:5]], (0, 1)),
    "a column and a row": (lambda a: [a[7, 1:5], a[:, 0], a[1]], (1, 2)),
    "float32 memory seen as bfloat16": (
        lambda a: [a.view(-1)[:4].view(torch.bfloat16), a.view(-1)],
        (0, 1),
    ),
}


def _overlap_raises(name: str, on_ranks: tuple[int, ...]) -> dict[str, object]:
    make, _ = OVERLAPS[name]
    a = _randn(torch.Generator().manual_seed(dist.get_rank()), 40, 25)
    other = _randn(torch.Generator().manual_seed(50), 40, 25)
    grads = make(a)
    if dist.get_rank() not in on_ranks:  # the same shapes, in separate memory
        grads = [g.clone() if i else g for i, g in enumerate(grads)]
    before = [a.clone(), *(g.clone() for g in grads)]
    message, kind = "", ""
    with CommDebugMode() as mode:
        try:
            allreduce_grads_avg(grads, None, bucket_cap_mb=CAP_BYTES / MiB, check=False)
        except (ValueError, RuntimeError) as error:
            kind, message = type(error).__name__, str(error)
    unchanged = all(_same_bits(x, y) for x, y in zip(before, [a, *grads], strict=True))
    probe = other.clone()
    allreduce_grads_avg([probe], None)  # the group still works
    return {
        "kind": kind,
        "message": message,
        "unchanged": unchanged,
        "collectives": mode.get_total_counts(),
        "group works": _same_bits(probe, other),
    }


@pytest.mark.parametrize("name", sorted(OVERLAPS))
def test_partial_overlap_raises_on_every_rank_and_changes_nothing(ranks, name):
    first, second = OVERLAPS[name][1]
    results = ranks.run(2, _overlap_raises, name, (0, 1))
    for result in results:
        assert result["kind"] == "ValueError", result
        assert f"grads[{first}] and grads[{second}]" in result["message"]
        assert "share memory" in result["message"]
        assert result["unchanged"] and result["group works"], result
        assert result["collectives"] == 1  # the verification only: every rank got this far
    assert results[0]["message"] == results[1]["message"]


def test_overlap_on_one_rank_only_raises_on_every_rank(ranks):
    results = ranks.run(2, _overlap_raises, "rows 0-2 and rows 2-4", (1,))
    assert {r["message"] for r in results} == {results[0]["message"]}
    for result in results:
        assert result["kind"] == "RuntimeError", result
        assert "First difference at gradient 1 " in result["message"]
        assert (
            "rank 1 has local shape=(3, 25) dtype=torch.float32 (shares memory with gradient 0)"
            in (result["message"])
        )
        assert result["unchanged"] and result["group works"], result


# ---------------------------------------------------------------------------------------------
# The first-call layout verification


@functools.cache
def _dp_mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("alias_dp",))


def _fsdp_grads_over_their_own_group(rows: int) -> dict[str, object]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, rows), nn.Linear(rows, 6))
    fully_shard(model, mesh=_dp_mesh())
    model(torch.randn(2, 4)).sum().backward()
    grads = [p.grad for p in model.parameters()]
    before = [g.to_local().clone() for g in grads]
    message = ""
    try:
        allreduce_grads_avg(grads, _dp_mesh(), check=False)
    except (RuntimeError, ValueError) as error:
        message = f"{type(error).__name__}: {error}"
    after = [g.to_local() for g in grads]
    return {
        "message": message,
        "unchanged": all(_same_bits(x, y) for x, y in zip(before, after, strict=True)),
    }


def test_group_not_orthogonal_to_uneven_fsdp_shards_raises_on_every_rank(ranks):
    results = ranks.run(2, _fsdp_grads_over_their_own_group, 3)  # 3 rows over 2 ranks
    message = results[0]["message"]
    assert all(r["message"] == message for r in results)
    assert message.startswith(
        "RuntimeError: allreduce_grads_avg: ranks passed different gradient layouts"
    )
    assert "First difference at gradient 0 " in message
    assert "rank 0 has local shape=(2, 4) " in message
    assert "rank 1 has local shape=(1, 4) " in message
    assert "orthogonal to the sharding" in message
    assert all(r["unchanged"] for r in results)


def test_group_not_orthogonal_to_even_fsdp_shards_raises_on_every_rank(ranks):
    # Even shards have the same shapes everywhere: only the rank map shows they differ.
    results = ranks.run(2, _fsdp_grads_over_their_own_group, 4)
    message = results[0]["message"]
    assert all(r["message"] == message for r in results)
    assert message.startswith(
        "ValueError: allreduce_grads_avg: averaging grads[0] over this group would mix different "
        "shards of it"
    )
    assert "orthogonal to the sharding" in message
    assert all(r["unchanged"] for r in results)


@functools.cache
def _pair() -> ProcessGroup:
    return dist.new_group([0, 1])


def _collectives_per_call() -> dict[str, int]:
    generator = torch.Generator().manual_seed(dist.get_rank())
    # fp32: one in place, two buckets; fp64: one bucket. 2000 bytes: a cap no other test uses.
    tensors = [_randn(generator, 600), *(_randn(generator, 20, 15).t() for _ in range(2))]
    tensors += [_randn(generator, 40, dtype=torch.float64)]

    def call(group: ProcessGroup | None, check: bool | None = None) -> int:
        return _count(
            lambda: allreduce_grads_avg(tensors, group, bucket_cap_mb=2000 / MiB, check=check)
        )

    return {
        "first call": call(None),
        "second call": call(None),
        "with check=True": call(None, check=True),
        "after the check": call(None),
        "the same layout, another group: first call": call(_pair()),
        "the same layout, another group: second call": call(_pair()),
    }


def test_the_first_call_for_a_layout_costs_one_more_collective(ranks):
    data = 4
    for counts in ranks.run(2, _collectives_per_call):
        assert counts == {
            "first call": data + 1,
            "second call": data,
            "with check=True": data + 1,
            "after the check": data,
            "the same layout, another group: first call": data + 1,
            "the same layout, another group: second call": data,
        }
