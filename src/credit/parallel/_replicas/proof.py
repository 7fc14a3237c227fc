"""The replica check's proof: the digests, weighted into one all_reduce, and its verdict.

Every compared tensor's four 64-bit digests (``digests``), weighted by the plan's coefficients,
are added to the plan's constant (presence terms, the self-check, the error count); the sums of
the world vanish where every copy holds its group's reference's bits. The verdict is the call's
one host read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor

from credit.parallel._common.groups import moves_data
from credit.parallel._replicas.arguments import Request
from credit.parallel._replicas.digests import LANES
from credit.parallel._replicas.plan import ReplicaPlan


@dataclass(frozen=True)
class Verdict:
    """What the proof's all_reduce told.

    Attributes:
        proven: every copy holds its group's reference's bits, and no rank counted an error.
        prints: this rank's digests of the compared tensors (None without any), for the diagnosis.
    """

    proven: bool
    prints: Tensor | None


def prove(request: Request, plan: ReplicaPlan) -> Verdict:
    """The digests of this rank's compared tensors, summed over the world with the plan's
    constant in one all_reduce, and read once."""
    vector = plan.constant.clone()  # presence terms, self-check, error count
    if request.outside is not None:
        vector[-1] += 1
    prints = None
    if plan.compared:
        prints = plan.digests([request.local[i] for i in plan.compared])
        vector[:LANES] += (plan.coefficients * prints).sum(0)
    dist.all_reduce(vector, op=dist.ReduceOp.SUM)
    # The verdict: the one host sync. The fake backend of the scale tests moves no data.
    return Verdict(not bool(vector.any()) or not moves_data(), prints)
