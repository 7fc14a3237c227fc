"""grad_norm_report: per-group norms and the total, from the norm's collectives, on real layouts.

Oracle: torch.nn.utils.get_total_norm on each group's full_tensor() gradients, with the groups
decided independently of the library (by parameter name, from the known TP plan and wrapping of
testbed/layouts.py). Tolerance 8 float32 ULP, as for total_grad_norm: the sums of p-th powers run in
another order (per shard, per group, then across ranks), each step rounding once; a gradient in the
wrong group or counted twice is off by far more.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_pipeline import all_stages, build_pipeline
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from credit.parallel.collectives import total_grad_norm
from credit.parallel.norm_report import grad_norm_report
from testbed.layouts import TinyNet, build, run_step
from testbed.layouts import ulp_distance as _ulp_distance
from testbed.world_layouts import WireRecorder

NORM_TYPES = (1.0, 2.0, math.inf)
TOLERANCE_ULP = 8
# The parameters TP_PLAN shards along "tp": colwise weights and biases, rowwise weights.
TP_SHARDED = re.compile(r"blocks\.(\d)\.((q|w1)\.(weight|bias)|(o|w2)\.weight)")


def ulps(a: float | Tensor, b: float | Tensor) -> int:
    return _ulp_distance(torch.as_tensor(a), torch.as_tensor(b))


def by_block(name: str, param: Tensor) -> str:
    """Per-prefix grouping: "blocks.0", "blocks.1", or the top-level module ("embed", "head")."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "blocks" else parts[0]


def expected_layout_group(layout: str, name: str) -> str:
    """The default group of a parameter, from the layout's TP plan and wrapping alone."""
    match = TP_SHARDED.fullmatch(name)
    tp_blocks = {"fsdp_tp": ("0", "1"), "tp": ("0",)}.get(layout, ())
    if match and match.group(1) in tp_blocks:
        return "tp_sharded"
    return "fsdp" if layout in ("fsdp_tp", "pp_dp") else "replicated"


def _materialised(model: nn.Module) -> list[tuple[str, Tensor]]:
    return [
        (name, p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
        for name, p in model.named_parameters()
        if p.grad is not None
    ]


def block_label(name: str) -> str:
    return by_block(name, torch.empty(0))


def _reference(named: list[tuple[str, Tensor]], label, norm_type: float) -> dict[str, float]:
    grouped: dict[str, list[Tensor]] = {}
    for name, grad in named:
        grouped.setdefault(label(name), []).append(grad)
    reference = {k: float(torch.nn.utils.get_total_norm(v, norm_type)) for k, v in grouped.items()}
    reference["total"] = float(torch.nn.utils.get_total_norm([g for _, g in named], norm_type))
    return reference


def _report_on_layout(layout: str, grouping: str) -> list[tuple[Any, ...]]:
    model = build(layout).model
    named = _materialised(model)
    group_by = by_block if grouping == "block" else None
    label = block_label if group_by else functools.partial(expected_layout_group, layout)
    grad_norm_report(model.named_parameters(), group_by=group_by)  # the layout's first call
    results = []
    for norm_type in NORM_TYPES:
        with WireRecorder() as wire:
            report = grad_norm_report(model.named_parameters(), norm_type, group_by=group_by)
        total = float(total_grad_norm([p.grad for _, p in model.named_parameters()], norm_type))
        reference = _reference(named, label, norm_type)
        results.append((norm_type, report, reference, total, wire.groups))
    return results


def check_reports(
    per_rank: list[list[tuple[Any, ...]]], collectives: Callable[[float], list[int]]
) -> None:
    """Every rank got the same report, each value within tolerance, from collectives on process
    groups of the sizes ``collectives(norm_type)`` lists, in order."""
    for rank_results in per_rank:
        for norm_type, report, reference, total, groups in rank_results:
            assert report == per_rank[0][NORM_TYPES.index(norm_type)][1], "ranks disagree"
            assert set(report) == set(reference), report
            for group, value in report.items():
                distance = ulps(value, reference[group])
                assert distance <= TOLERANCE_ULP, f"p={norm_type} {group}: {distance} ULP off"
            assert ulps(report["total"], total) <= TOLERANCE_ULP, (report["total"], total)
            expected = collectives(norm_type)
            assert groups == expected, f"p={norm_type}: collectives on groups {groups}"


@pytest.mark.parametrize("layout", ["fsdp_tp", "tp"])
@pytest.mark.parametrize("grouping", ["layout", "block"])
def test_report_matches_materialised_groups(ranks, layout, grouping):
    per_rank = ranks.run(4, _report_on_layout, layout, grouping)
    # FSDP2 + TP on (dp=2, tp=2): the copies (the rowwise biases replicated on tp, the dp mesh's
    # shards on their tp peers) compared within tp, then the world's one all_reduce; the inf norm
    # compares nothing. TP over the world: its copies span the world, compared in its all_reduce.
    in_groups = [2] if layout == "fsdp_tp" else []
    check_reports(per_rank, lambda p: [4] if p == math.inf else [*in_groups, 4])
    report = per_rank[0][0][1]
    if grouping == "layout":
        other = "fsdp" if layout == "fsdp_tp" else "replicated"
        assert list(report) == ["tp_sharded", other, "total"]
    else:
        assert list(report) == ["embed", "blocks.0", "blocks.1", "head", "total"]


STAGE_GROUPS = ("embed", "blocks.0", "blocks.1", "head")


def _report_on_pipeline(layout: str, grouping: str) -> list[tuple[Any, ...]]:
    model, stage, pp_group = build_pipeline(layout)
    named = all_stages(stage, [(n, g.clone()) for n, g in _materialised(model)])
    kwargs: dict[str, Any] = {"pp_group": pp_group}
    label = functools.partial(expected_layout_group, "pp_dp")
    if grouping != "layout":
        label = block_label
        kwargs["group_by"] = by_block
        if grouping == "block_named":
            kwargs["groups"] = STAGE_GROUPS
    grad_norm_report(model.named_parameters(), **kwargs)  # the layout's first call verifies it
    results = []
    for norm_type in NORM_TYPES:
        with WireRecorder() as wire:
            report = grad_norm_report(model.named_parameters(), norm_type, **kwargs)
        grads = [p.grad for _, p in model.named_parameters()]
        total = float(total_grad_norm(grads, norm_type, pp_group=pp_group))
        results.append((norm_type, report, _reference(named, label, norm_type), total, wire))
    return [(*r[:4], r[4].groups) for r in results]


# Collectives once the layout is verified, by the size of their process group: the world's one
# all_reduce, whatever the stages' meshes (FSDP2 over each stage's dp: no copies); the names of
# group_by's groups are first gathered over pp_group (2 ranks) unless passed as ``groups``
# (all_gather_object: an all_gather of sizes, then of the pickled names).
@pytest.mark.parametrize(
    ("layout", "grouping", "collectives"),
    [
        ("pp_dp", "layout", [4]),
        ("pp_dp", "block_named", [4]),
        ("pp_dp", "block", [2, 2, 4]),
        ("pp_meshes", "block_named", [4]),
    ],
)
def test_report_covers_every_stage(ranks, layout, grouping, collectives):
    per_rank = ranks.run(4, _report_on_pipeline, layout, grouping)
    check_reports(per_rank, lambda p: collectives)
    expected = ["fsdp", "total"] if grouping == "layout" else [*STAGE_GROUPS, "total"]
    assert list(per_rank[0][0][1]) == expected


def _local_model() -> nn.Module:
    torch.manual_seed(0)
    model = TinyNet()
    run_step(model, seed=0, dp_rank=0, dp_size=1)
    return model


def test_report_without_a_process_group_is_local():
    model = _local_model()
    assert not dist.is_initialized()
    named = _materialised(model)
    for norm_type in NORM_TYPES:
        report = grad_norm_report(model.named_parameters(), norm_type, group_by=by_block)
        reference = _reference(named, block_label, norm_type)
        assert list(report) == list(reference)
        for group, value in report.items():
            assert ulps(value, reference[group]) <= TOLERANCE_ULP, (group, value)
        default = grad_norm_report(model.named_parameters(), norm_type)
        assert list(default) == ["replicated", "total"]
        assert ulps(default["replicated"], reference["total"]) <= TOLERANCE_ULP


def test_named_groups_keep_their_order_and_report_zero_when_empty():
    model = _local_model()
    groups = ["head", "unused", "embed", "blocks.1", "blocks.0"]
    report = grad_norm_report(model.named_parameters(), group_by=by_block, groups=groups)
    assert list(report) == [*groups, "total"]
    assert report["unused"] == 0.0 and report["head"] > 0.0


def test_bf16_gradients_with_float32_accumulation():
    model = _local_model().to(torch.bfloat16)
    named = [
        (n, p.grad.to(torch.float64)) for n, p in model.named_parameters() if p.grad is not None
    ]
    report = grad_norm_report(model.named_parameters(), group_by=by_block, dtype=torch.float32)
    reference = _reference(named, block_label, 2.0)
    for group, value in report.items():
        # bf16 values and their squares are exact in float64; float32 accumulation of these
        # few hundred terms stays within the 8 ULP tolerance (see test_precision.py).
        assert ulps(value, reference[group]) <= TOLERANCE_ULP, (group, value)


def _named_total(name: str, param: Tensor) -> str:
    return "total"


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"norm_type": 0.0}, ValueError, "positive"),
        ({"group_by": _named_total}, ValueError, "reserved"),
        ({"group_by": lambda n, p: 3}, TypeError, "expected a str"),
        ({"group_by": by_block, "groups": ["embed", "head"]}, ValueError, "blocks.0"),
        ({"group_by": by_block, "groups": ["embed", "embed"]}, ValueError, "distinct"),
        ({"groups": ["total"]}, ValueError, "distinct"),
        ({"pp_group": "pp"}, TypeError, "pp_group"),
    ],
)
def test_bad_arguments_raise_before_any_collective(kwargs, error, match):
    model = _local_model()
    with pytest.raises(error, match=match):
        grad_norm_report(model.named_parameters(), **kwargs)


@pytest.mark.parametrize(
    "entries",
    [torch.zeros(2), [("w", 1.0)], [(0, torch.zeros(2))], [torch.zeros(2)]],
)
def test_entries_must_be_name_tensor_pairs(entries):
    with pytest.raises(TypeError, match="named_parameters"):
        grad_norm_report(entries)


def test_parameters_without_gradients_report_only_a_zero_total():
    frozen = nn.Parameter(torch.ones(2))
    assert grad_norm_report([("w", frozen)]) == {"total": 0.0}
    assert grad_norm_report([("w", frozen)], groups=["w"]) == {"w": 0.0, "total": 0.0}
