"""The replica check's failed proof, settled the same way on every rank.

Only a call whose sums did not vanish comes here: every rank gathers what every other holds and
diagnoses the same groups of copies that differ (``diagnosis``); then, the same on every
rank, the failure is told (``messages``), or the copies are repaired from their sources
(``repair``), all or nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from credit.parallel._replicas import diagnosis as _diagnosis
from credit.parallel._replicas import messages as _messages
from credit.parallel._replicas import repair as _repair
from credit.parallel._replicas.arguments import Request
from credit.parallel._replicas.plan import ReplicaPlan
from credit.parallel._replicas.records import Held, Mismatch


@dataclass(frozen=True)
class Settled:
    """How a failed proof ended, the same on every rank.

    Attributes:
        mismatches: every group of copies that differed (or lacked a copy).
        error: the message of the error to raise, nothing modified; or None, every copy then
            holding its source's bits.
    """

    mismatches: tuple[Mismatch, ...]
    error: str | None


def settle(request: Request, plan: ReplicaPlan, prints: Tensor | None) -> Settled:
    """Diagnose the copies that differ, then tell them, or repair them where ``request`` asks.

    Args:
        request: the call's arguments.
        plan: the plan of its layout.
        prints: the digests of this rank's compared tensors (None where it compares none).

    Raises:
        ValueError: the ranks passed different arguments, or a rank's tensors or layout cannot
            be compared.
        RuntimeError: the ranks of a stage hold different parameters or buffers, or a tensor's
            copies do not add up to whole copies.
    """
    param_distinct = request.param_distinct or (None,) * len(request.params)
    mine = Held(
        entries=request.entries,
        local=request.local,
        held=plan.held,
        groups=plan.groups,
        compared=plan.compared,
        stages=plan.stages,
        lowest=min(plan.stage),
        params=request.params,
        param_marks=dict(zip(request.params, param_distinct, strict=True)),
    )
    digests = dict(zip(plan.compared, prints.tolist(), strict=True)) if prints is not None else {}
    error = request.outside if request.outside is not None else plan.error
    agreed = _agreed(request)
    failure = _diagnosis.diagnose(mine, digests, error, request.repair_from, agreed)
    mismatches = tuple(slot.mismatch for slot in failure.slots)
    decided = all(m.reference is not None for m in mismatches)
    if request.repair and decided:
        unrepaired = _repair.repair(failure, mine, request.states, plan.device)
        return Settled(mismatches, unrepaired)
    if request.repair:
        return Settled(mismatches, _messages.refusal(failure, request.repair_from))
    buffer_names = {entry.name for entry in request.entries if entry.kind == "buffer"}
    return Settled(mismatches, _messages.describe(failure, buffer_names))


def _agreed(request: Request) -> dict[str, object]:
    """The arguments that must be the same on every rank, by name, as the error names them."""
    return {
        "repair": request.repair,
        "repair_from": list(request.repair_from) if request.repair_from else None,
        "buffers": request.buffers,
    }
