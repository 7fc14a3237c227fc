"""build_device_mesh on 1, 2, 4 and 8 real gloo ranks: every (dp, tp, domain) that fits.

Oracle for the layout: row-major (dp, tp, domain), so global rank r sits at
(r // (tp * domain), (r // domain) % tp, r % domain), and each submesh holds the ranks that differ
from r only along its dims. The process groups are checked twice: by their rank lists and by an
all_reduce of the ranks' ids over each (a sum of small integers, exact).
"""

from __future__ import annotations

import functools
import itertools
import re

import pytest
import torch
import torch.distributed as dist

from credit.parallel.parallel_mesh import ParallelMesh, build_device_mesh

WORLD_SIZES = (1, 2, 4, 8)


def _combinations(world: int) -> list[tuple[int, int, int]]:
    sizes = [s for s in range(1, world + 1) if world % s == 0]
    return [c for c in itertools.product(sizes, repeat=3) if c[0] * c[1] * c[2] == world]


@functools.cache
def _mesh(dp: int | None, tp: int, domain: int, device_type: str | None) -> ParallelMesh:
    """Built once per worker process: workers are reused, so process groups must not pile up."""
    return build_device_mesh(dp, tp, domain, device_type=device_type)


def _expected_ranks(
    shape: tuple[int, int, int], coordinate: tuple[int, ...], dims: tuple[int, ...]
):
    """Global ranks of the submesh over ``dims`` through ``coordinate``, as a nested list."""
    grid = torch.arange(shape[0] * shape[1] * shape[2]).view(shape)
    index = tuple(slice(None) if dim in dims else coordinate[dim] for dim in range(3))
    return grid[index].tolist()


def _problems(pm: ParallelMesh, shape: tuple[int, int, int], device_type: str) -> list[str]:
    """Every way ``pm`` differs from the row-major (dp, tp, domain) layout of ``shape``."""
    rank = dist.get_rank()
    _, tp, domain = shape
    coordinate = (rank // (tp * domain), (rank // domain) % tp, rank % domain)
    problems = []
    found = pm.world.get_coordinate()
    if found is None or tuple(found) != coordinate:
        problems.append(f"coordinate {found} != {coordinate}")
    subs = {
        "world": (pm.world, (0, 1, 2)),
        "dp": (pm.dp, (0,)),
        "tp": (pm.tp, (1,)),
        "domain": (pm.domain, (2,)),
        "dp_tp": (pm.dp_tp, (0, 1)),
    }
    for name, (mesh, dims) in subs.items():
        expected = _expected_ranks(shape, coordinate, dims)
        names = tuple(("dp", "tp", "domain")[d] for d in dims)
        if mesh.mesh.tolist() != expected:
            problems.append(f"{name}: ranks {mesh.mesh.tolist()} != {expected}")
        if mesh.mesh_dim_names != names or mesh.device_type != device_type:
            problems.append(f"{name}: dims {mesh.mesh_dim_names} on {mesh.device_type}")
        if mesh.shape != tuple(shape[d] for d in dims):
            problems.append(f"{name}: shape {mesh.shape}")
        if len(dims) == 1:
            problems += _group_problems(name, mesh.get_group(), expected)
    return problems


def _group_problems(name: str, group: dist.ProcessGroup, expected: list[int]) -> list[str]:
    problems = []
    if dist.get_process_group_ranks(group) != expected:
        problems.append(f"{name}: group ranks {dist.get_process_group_ranks(group)}")
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total, group=group)
    if int(total) != sum(expected):
        problems.append(f"{name}: all_reduce over the group gave {int(total)}")
    return problems


def _check_every_combination() -> list[tuple[tuple[int, int, int], list[str]]]:
    world = dist.get_world_size()
    report = []
    for index, shape in enumerate(_combinations(world)):
        dp, tp, domain = shape
        if world == 1:  # the default device type; the other worlds pin "cpu"
            pm = _mesh(None, tp, domain, None)
            device_type = "cuda" if torch.cuda.is_available() else "cpu"
        else:  # every other combination infers dp from the world size
            pm = _mesh(dp if index % 2 else None, tp, domain, "cpu")
            device_type = "cpu"
        report.append((shape, _problems(pm, shape, device_type)))
    return report


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_every_combination_is_row_major_with_named_dims(ranks, world):
    results = ranks.run(world, _check_every_combination)
    for rank, report in enumerate(results):
        assert [shape for shape, _ in report] == _combinations(world)
        for shape, problems in report:
            assert problems == [], f"rank {rank}, (dp, tp, domain) = {shape}: {problems}"


def _errors() -> list[str]:
    messages = []
    for dp, tp, domain in [(2, 3, 1), (4, 2, 2), (None, 3, 1), (None, 4, 4), (1, 1, 1)]:
        with pytest.raises(ValueError) as error:
            build_device_mesh(dp, tp, domain, device_type="cpu")
        messages.append(str(error.value))
    return messages


def test_sizes_that_do_not_fit_the_world_raise_with_the_arithmetic(ranks):
    for messages in ranks.run(8, _errors):
        assert messages == [
            "dp * tp * domain = 2 * 3 * 1 = 6 does not equal the world size 8",
            "dp * tp * domain = 4 * 2 * 2 = 16 does not equal the world size 8",
            "tp * domain = 3 * 1 = 3 does not divide the world size 8, so dp cannot be inferred",
            "tp * domain = 4 * 4 = 16 does not divide the world size 8, so dp cannot be inferred",
            "dp * tp * domain = 1 * 1 * 1 = 1 does not equal the world size 8",
        ]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tp": 0},
        {"domain": -2},
        {"dp": 0},
        {"tp": 2.0},
        {"domain": True},
        {"dp": "2"},
    ],
)
def test_sizes_that_are_not_positive_ints_raise(kwargs):
    name, value = next(iter(kwargs.items()))
    with pytest.raises(
        ValueError, match=re.escape(f"{name} must be a positive int, got {value!r}")
    ):
        build_device_mesh(**kwargs)


def test_without_a_process_group_it_says_so():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        build_device_mesh(tp=1)
