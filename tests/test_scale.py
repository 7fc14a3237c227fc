"""Collectives per call at simulated scale: a 1024-rank (dp=128 x tp=8) world in one process.

torch's fake backend lets one process act as one rank of a large world and count the collectives
each call issues; ``testbed/fake_world.py`` builds the gradients (DTensors in the layouts FSDP2 + TP
produce, plain replicated tensors beside them, an empty local shard) and does the counting, which
the benchmark reports too.

Each fake world is set up and torn down in a fresh spawned process, so it never meets the real
process groups of other tests.
"""

from __future__ import annotations

import multiprocessing

import pytest

from testbed.fake_world import EXPECTED_BUCKETS, counts_in_fake_world

# Slow, every test (make test-fast leaves them out): a fresh process builds each simulated world.
pytestmark = pytest.mark.slow

DP, TP = 128, 8
SMALL_WORLD = (4, TP)  # the same counts must come out of a 32-rank world (dp=2 per stage)

# A norm over these gradients: the world's one all_reduce, after one all_reduce within tp, where
# the copies (the gradients replicated on tp, and the dp mesh's shards on their tp peers) are
# compared in their own group (``tests/test_wire.py`` pins which group each runs on and what it
# carries).
NORM = 2
# A layout's first call proves it first: the self-check in one all_reduce, then the copies within
# tp, and one all_reduce of their three flags.
PROOF = 3


# (dp, tp, rank): rank 0 counts every shard it holds; the last rank, at coordinate (127, 7),
# counts none, and must still take part in exactly the same collectives.
WORLDS = {"first": (DP, TP, 0), "last": (DP, TP, DP * TP - 1), "small": (*SMALL_WORLD, 5)}


@pytest.fixture(scope="module")
def counts() -> dict[str, dict[str, int]]:
    # One fresh process per fake world (maxtasksperchild=1): a world torn down leaves state in
    # torch's mesh and group caches that a second world in the same process would trip on.
    context = multiprocessing.get_context("spawn")
    with context.Pool(len(WORLDS), maxtasksperchild=1) as pool:
        pending = {
            name: pool.apply_async(counts_in_fake_world, world) for name, world in WORLDS.items()
        }
        return {name: result.get(timeout=180) for name, result in pending.items()}


def test_the_fake_world_has_1024_ranks(counts):
    assert counts["first"]["world"] == counts["last"]["world"] == 1024


def test_counting_sees_the_collectives_inside_dtensor_ops(counts):
    assert counts["first"]["control: torch get_total_norm on the 2D mesh"] == 2


@pytest.mark.parametrize("rank", ["first", "last"])
@pytest.mark.parametrize("call", ["first call for a layout", "first call, unflattened world"])
def test_the_proof_of_a_layout_at_1024_ranks(counts, call, rank):
    assert counts[rank][call] == PROOF + NORM


@pytest.mark.parametrize("rank", ["first", "last"])
def test_first_call_with_pp_group_at_1024_ranks(counts, rank):
    # The norm, the proof of the layout, and the stages' lowest ranks (once per pp group).
    assert counts[rank]["first call with pp_group"] == NORM + PROOF + 1


@pytest.mark.parametrize("rank", ["first", "last"])
@pytest.mark.parametrize(
    "call",
    [
        "total_grad_norm p=2",
        "total_grad_norm, unflattened world",
        "clip_grad_norm_",
        "total_grad_norm with pp_group",
        # The clip's collectives carry the GradScaler's answer: nothing else is issued.
        "AMP step (unscale_, clip, step, update)",
        "AMP step with a SpikePolicy",
    ],
)
def test_the_norms_collectives_per_call_on_mixed_meshes_at_1024_ranks(counts, call, rank):
    assert counts[rank][call] == NORM


@pytest.mark.parametrize("rank", ["first", "last"])
@pytest.mark.parametrize(
    "call", ["total_grad_norm p=inf", "verify_replicas (parameters and AdamW state)"]
)
def test_one_collective_per_call_at_1024_ranks(counts, call, rank):
    # The inf norm compares nothing (the largest copy is the largest element).
    assert counts[rank][call] == 1


@pytest.mark.parametrize("rank", ["first", "last"])
def test_a_spike_policys_first_step_asks_the_world_for_a_loss_at_1024_ranks(counts, rank):
    assert counts[rank]["first AMP step with a SpikePolicy"] == NORM + 1


@pytest.mark.parametrize("rank", ["first", "last"])
def test_a_spike_policy_given_the_loss_adds_one_all_reduce_at_1024_ranks(counts, rank):
    # The loss's average over the world: it cannot ride in the norm's all_reduce without moving
    # the norm's bits (one more element moves gloo's chunking).
    assert counts[rank]["AMP step with a SpikePolicy given the loss"] == NORM + 1


@pytest.mark.parametrize("rank", ["first", "last"])
def test_one_collective_per_bucket_at_1024_ranks(counts, rank):
    assert EXPECTED_BUCKETS == 16
    # The first call for a layout verifies it across the group in one more small all_reduce.
    assert counts[rank]["allreduce_grads_avg, first call for a layout"] == EXPECTED_BUCKETS + 1
    assert counts[rank]["allreduce_grads_avg"] == EXPECTED_BUCKETS


def test_collectives_per_call_do_not_grow_with_the_world(counts):
    def calls(name: str) -> dict[str, int]:
        return {key: value for key, value in counts[name].items() if key != "world"}

    assert counts["small"]["world"] == 32
    assert calls("small") == calls("first") == calls("last")
