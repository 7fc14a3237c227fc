"""Collectives per call at simulated worlds of 16, 64 and 1024 ranks (torch's fake backend).

The counting is the scale tests' (``testbed/fake_world.py``): one rank of each world counts the
collectives of every call on FSDP2 + TP gradients, in a fresh process per world.
"""

from __future__ import annotations

import logging
import multiprocessing

from report import Result, Row

from testbed.fake_world import EXPECTED_BUCKETS, counts_in_fake_world

# (dp, tp) of each world; dp is at least 4, so that each of the two pipeline stages has copies
# in groups of their own on tp.
WORLDS = ((4, 4), (8, 8), (128, 8))
# (what the fake world calls it, what the report calls it, the collectives expected).
# A norm: the world's all_reduce, after one within tp where the copies are compared; a layout's
# first call proves it before, in three (the self-check, the copies within tp, their flags).
NORM, PROOF = 2, 3
CALLS = (
    ("first call for a layout", "total_grad_norm, first call for a layout", PROOF + NORM),
    ("total_grad_norm p=2", "total_grad_norm, a later call", NORM),
    ("total_grad_norm p=inf", "total_grad_norm, inf norm", 1),
    ("total_grad_norm, unflattened world", "total_grad_norm, meshes unflattened from 1-D", NORM),
    ("clip_grad_norm_", "clip_grad_norm_", NORM),
    ("total_grad_norm with pp_group", "total_grad_norm with pp_group (2 stages)", NORM),
    (
        "AMP step (unscale_, clip, step, update)",
        "GradScaler's unscale_ + clip_grad_norm_ + step + update",
        NORM,
    ),
    (
        "allreduce_grads_avg, first call for a layout",
        "allreduce_grads_avg over tp, 1000-byte buckets, first call for a layout",
        EXPECTED_BUCKETS + 1,
    ),
    ("allreduce_grads_avg", "allreduce_grads_avg over tp, 1000-byte buckets", EXPECTED_BUCKETS),
    (
        "verify_replicas (parameters and AdamW state)",
        "verify_replicas of the parameters and their AdamW state",
        1,
    ),
)


def _quiet() -> None:
    # torch warns that its own norm (the counting's control) redistributes in two all_reduces.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def simulated(timeout_s: float) -> Result:
    """Count the collectives at every world of :data:`WORLDS`, one fresh process each.

    Args:
        timeout_s: how long to wait for the counts.
    """
    # A world torn down leaves state in torch's mesh and group caches: one process per world.
    context = multiprocessing.get_context("spawn")
    with context.Pool(len(WORLDS), _quiet, maxtasksperchild=1) as pool:
        pending = [pool.apply_async(counts_in_fake_world, (dp, tp, 0)) for dp, tp in WORLDS]
        counts = [result.get(timeout=timeout_s) for result in pending]
    sizes = " / ".join(str(count["world"]) for count in counts)
    result = Result(
        "simulated",
        "simulated",
        "simulated worlds",
        f"collectives per call at simulated worlds of {sizes} ranks (fake backend)",
    )
    for name, label, want in CALLS:
        seen = [count[name] for count in counts]
        result.rows.append(
            Row(
                f"{label}: at {sizes} ranks",
                " / ".join(map(str, seen)),
                "count",
                f"{want} at every size",
                all(value == want for value in seen),
            )
        )
    largest = counts[-1]
    first, later = largest["first call for a layout"], largest["total_grad_norm p=2"]
    result.rows.append(
        Row(
            f"norm setup at {largest['world']} ranks: collectives of the first call / a later call",
            f"{first} / {later}",
            "count",
            f"{PROOF + NORM} / {NORM}",
            (first, later) == (PROOF + NORM, NORM),
        )
    )
    result.notes.append(
        "one rank of a (dp, tp) mesh of (4, 4), (8, 8) and (128, 8); 100 gradients: dp-sharded "
        "on the 1D dp mesh, colwise, rowwise and replicated on the 2D mesh, plain ones beside; "
        "with pp_group, a (2, dp/2, tp) mesh as (pp, dp, tp)"
    )
    return result
