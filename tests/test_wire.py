"""The norm's wire at 1,024 simulated ranks: how many collectives a call issues, the elements each
carries, and that neither grows with the world.

One process plays one rank of a fake world (torch's fake backend: collectives return at once and
move no data) and records every collective a call issues with the elements it sends
(``testbed.world_layouts.WireRecorder``). The gradients are a 4-layer Llama-like model's (39 gradients)
in four layouts: FSDP2 x TP on (dp, tp=8), HSDP x TP on (rep, shard, tp=8), four pipeline stages
on (pp=4, dp, tp=8), and experts declared with ``distinct_along`` beside dense parameters
sharded over the world (``testbed/world_layouts.py`` says how each is built).

Worlds: rank 0 and the last rank of 1,024 ranks, and rank 0 of 128 ranks. The wire must be the
same at both sizes: along the data-parallel dim for FSDP2 x TP, pipeline stages and experts;
along HSDP's replicas (``hsdp-tp-8``, a shard group of 8: rep 2 then 16) and along its shard
group (8 at 128 ranks, 64 at 1,024: ``hsdp-tp-8`` then ``hsdp-tp``). Each world is set up in a
fresh spawned process, as in ``tests/test_scale.py``.

Under pipeline stages a fake world shows one stage's share of the comparison only: the slots of
the other stages come back in an all_reduce, which the fake backend leaves as this rank sent it.
"""

from __future__ import annotations

import multiprocessing

import pytest

from testbed.world_layouts import (
    MODELS,
    Collective,
    describe,
    groups_of_a_dp_mesh_among_two_dims,
    wire_in_fake_world,
)

# Slow, every test (make test-fast leaves them out): a fresh process builds each simulated world.
pytestmark = pytest.mark.slow

MODEL = "4-layer"
GRADIENTS = MODELS[MODEL].gradients
LARGE, SMALL = 1024, 128
# The unflattened views first: equal meshes built earlier in the process would lend them their
# holdings (kept per mesh and placements), and with them the earlier meshes' roots.
LAYOUTS = ("fsdp-tp-unflattened", "fsdp-tp", "hsdp-tp", "hsdp-tp-8", "pipeline", "experts")
WORLDS = {"first": (LARGE, 0), "last": (LARGE, LARGE - 1), "small": (SMALL, 0)}
STEADY = ("total_grad_norm", "clip_grad_norm_")
# No collective carries more than this many numbers: 16 a gradient of the model, and a few.
BOUND = 16 * GRADIENTS + 64

# The groups a later call's collectives run on, in order, at 1,024 ranks: the copies compared in
# their own groups (tp, and HSDP's replicas: 2 on (rep, shard=64, tp), 16 on (rep, shard=8, tp)),
# then the world's one all_reduce. Experts have no copies: the world's alone.
STEADY_GROUPS = {
    "fsdp-tp": [8, LARGE],
    "fsdp-tp-unflattened": [8, LARGE],
    "hsdp-tp": [2, 8, LARGE],
    "hsdp-tp-8": [16, 8, LARGE],
    "pipeline": [8, LARGE],
    "experts": [LARGE],
}
# A first call proves the layout before the norm: the self-check over the world, the copies in
# their groups, one all_reduce of three flags (none of the two last without copies). Under
# pipeline stages, once per pp group, the stages' lowest ranks first, and the proof after the norm.
FIRST_CALL = {
    "fsdp-tp": 5,
    "fsdp-tp-unflattened": 5,
    "hsdp-tp": 7,
    "hsdp-tp-8": 7,
    "pipeline": 6,
    "experts": 2,
}

# (layout at 1,024 ranks, the same layout at 128): the world grows along the dim named.
GROWTH = {
    "fsdp-tp, dp": ("fsdp-tp", "fsdp-tp"),
    "fsdp-tp unflattened, dp": ("fsdp-tp-unflattened", "fsdp-tp-unflattened"),
    "hsdp-tp, replicas": ("hsdp-tp-8", "hsdp-tp-8"),
    "hsdp-tp, shard group": ("hsdp-tp", "hsdp-tp-8"),
    "pipeline, dp": ("pipeline", "pipeline"),
    "experts, efsdp": ("experts", "experts"),
}


@pytest.fixture(scope="module")
def wires() -> dict[str, dict[str, dict[str, list[Collective]]]]:
    # One fresh process per fake world (maxtasksperchild=1), as tests/test_scale.py does.
    context = multiprocessing.get_context("spawn")
    with context.Pool(len(WORLDS), maxtasksperchild=1) as pool:
        pending = {
            name: pool.apply_async(wire_in_fake_world, (*world, LAYOUTS, MODEL))
            for name, world in WORLDS.items()
        }
        return {name: result.get(timeout=180) for name, result in pending.items()}


def _elements(collectives: list[Collective]) -> list[tuple[str, int, str]]:
    return [(c.op, c.elements, c.dtype) for c in collectives]


def test_every_layout_fits_the_worlds(wires):
    assert set(wires["first"]) == set(wires["last"]) == set(LAYOUTS)
    assert set(wires["small"]) == set(LAYOUTS) - {"hsdp-tp"}  # a shard group of 64 x tp 8


@pytest.mark.parametrize("rank", ["first", "last"])
@pytest.mark.parametrize("call", STEADY)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_later_call_issues_one_world_collective_at_1024_ranks(wires, layout, call, rank):
    found = wires[rank][layout][call]
    assert [c.group for c in found] == STEADY_GROUPS[layout], describe(found)


@pytest.mark.parametrize("rank", ["first", "last"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_collectives_of_a_first_call_at_1024_ranks(wires, layout, rank):
    found = wires[rank][layout]["first call"]
    assert len(found) == FIRST_CALL[layout], describe(found)


# Not under pipeline stages: there each rank sizes the norm's vector from the stages' slot counts
# that an all_reduce brings back (``_norm/pipeline.py``), and the fake backend brings back each
# rank's own, so ranks of different stages size it differently in a fake world alone.
@pytest.mark.parametrize("layout", [layout for layout in LAYOUTS if layout != "pipeline"])
@pytest.mark.parametrize("call", ["first call", *STEADY])
def test_every_rank_sends_the_same_elements(wires, layout, call):
    # A collective whose size differs between ranks would hang or mix numbers on a real backend.
    assert _elements(wires["first"][layout][call]) == _elements(wires["last"][layout][call])


@pytest.mark.parametrize("call", STEADY)
@pytest.mark.parametrize("growth", GROWTH)
def test_the_wire_does_not_grow_with_the_world(wires, growth, call):
    large, small = GROWTH[growth]
    at_large, at_small = wires["first"][large][call], wires["small"][small][call]
    assert _elements(at_large) == _elements(at_small), (
        f"{LARGE} ranks: {describe(at_large)}; {SMALL} ranks: {describe(at_small)}"
    )


@pytest.mark.parametrize("growth", GROWTH)
def test_a_first_calls_wire_does_not_grow_with_the_world(wires, growth):
    large, small = GROWTH[growth]
    at_large = wires["first"][large]["first call"]
    at_small = wires["small"][small]["first call"]
    assert _elements(at_large) == _elements(at_small), (
        f"{LARGE} ranks: {describe(at_large)}; {SMALL} ranks: {describe(at_small)}"
    )


@pytest.mark.parametrize("call", ["first call", *STEADY])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_no_collective_carries_more_than_16_numbers_a_gradient(wires, layout, call):
    found = wires["first"][layout][call]
    assert found, "no collective recorded"
    assert max(c.elements for c in found) <= BOUND, (
        f"{describe(found)}: more than {BOUND} ({GRADIENTS} gradients)"
    )


def test_copies_across_two_dims_of_the_root_meet_in_both_groups():
    # FSDP2 on the dp mesh of (dp, cp=2, tp=2): each shard's 4 copies are its cp x tp peers,
    # summed over cp then tp, then the world's all_reduce; the same at 64 and 1,024 ranks.
    context = multiprocessing.get_context("spawn")
    with context.Pool(2, maxtasksperchild=1) as pool:
        pending = [
            pool.apply_async(groups_of_a_dp_mesh_among_two_dims, (world, world - 1))
            for world in (64, LARGE)
        ]
        found = [result.get(timeout=180) for result in pending]
    assert found == [[2, 2, 64], [2, 2, LARGE]], found
