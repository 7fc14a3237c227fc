"""total_grad_norm and clip_grad_norm_ on every layout, against the materialised gradients.

Oracle: torch.nn.utils.get_total_norm on the full_tensor() of every gradient. Tolerance 8 float32
ULP: the distributed norm sums p-th powers in a different order (per shard, then across ranks) and
takes a p-th root, each step rounding once; a wrong count (a replica counted twice, a shard missed)
is off by far more.
"""

import math

import pytest
import torch
from torch.distributed.tensor import DTensor

from credit.parallel.collectives import clip_grad_norm_, total_grad_norm
from testbed.layouts import LAYOUTS, build, full_grads, grads, same_bits_everywhere, ulp_distance

NORM_TYPES = (0.5, 1.0, 2.0, 3.0, math.inf)


def _norms_match_reference(layout: str) -> list[tuple[float, int, bool]]:
    built = build(layout)
    reference_grads = full_grads(built.model)
    results = []
    for norm_type in NORM_TYPES:
        ours = total_grad_norm(grads(built.model), norm_type)
        reference = torch.nn.utils.get_total_norm(reference_grads, norm_type)
        assert not isinstance(ours, DTensor)
        results.append((norm_type, ulp_distance(ours, reference), same_bits_everywhere(ours)))
    return results


@pytest.mark.parametrize("layout", LAYOUTS)
def test_total_norm_matches_materialised_reference(ranks, layout):
    for rank_results in ranks.run(4, _norms_match_reference, layout):
        for norm_type, ulps, same_bits in rank_results:
            assert ulps <= 8, f"{layout} p={norm_type}: {ulps} ULP from the reference"
            assert same_bits, f"{layout} p={norm_type}: ranks disagree"


def _clip_scales_every_grad_by_one_coefficient(layout: str, norm_type: float) -> None:
    built = build(layout)
    before = full_grads(built.model)
    before = [g.clone() for g in before]
    reference = torch.nn.utils.get_total_norm(before, norm_type)
    max_norm = float(reference) / 4
    total = clip_grad_norm_(built.model.parameters(), max_norm, norm_type)
    coefficient = max_norm / (total + 1e-6)
    for old, new in zip(before, full_grads(built.model), strict=True):
        torch.testing.assert_close(new, old * coefficient, rtol=2e-6, atol=1e-9)
    assert same_bits_everywhere(total)


@pytest.mark.parametrize("layout", ["fsdp_tp", "tp", "hsdp"])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clip_scales_every_grad_by_the_global_coefficient(ranks, layout, norm_type):
    ranks.run(4, _clip_scales_every_grad_by_one_coefficient, layout, norm_type)


def _torch_clip_raises_on_mixed_layout(layout: str) -> str:
    built = build(layout)
    with pytest.raises(Exception) as raised:
        torch.nn.utils.clip_grad_norm_(built.model.parameters(), 1.0)
    return str(raised.value)


@pytest.mark.parametrize("layout", ["fsdp_tp", "tp"])
def test_torch_clip_still_fails_on_mixed_layouts(ranks, layout):
    """The reason this library exists; this test fails the day torch handles these layouts."""
    messages = ranks.run(4, _torch_clip_raises_on_mixed_layout, layout)
    assert all(messages)
