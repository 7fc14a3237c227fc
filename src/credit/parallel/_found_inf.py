"""The world's answer to "does any gradient hold a NaN or inf?", carried by the norm where it can.

A :class:`~credit.parallel.amp.GradScaler` leaves, at ``unscale_``, one :class:`Pending` flag per
optimizer: the local gradients it checked and this rank's answer. A norm that reduces its
gradients over the world (``clip_grad_norm_``, ``total_grad_norm``, ``grad_norm_report``) is
non-finite on every rank as soon as one rank holds a NaN or inf in any gradient it covers, so it
settles every pending flag with ``not isfinite(norm)``: a device tensor, no collective and no host
sync of its own. A rank whose norm does not cover all the gradients of a pending flag adds a NaN
to its own contribution when its flag is up, so the answer stays right whatever the ranks passed
(the norm of that step is then NaN, and the step is skipped). Whether a norm settles the pending
flags depends on the order of the calls alone, the same on every rank, never on what one rank
holds, so the ranks always issue the same collectives. A flag that no norm settled costs one
all_reduce of its own when the scaler needs it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from credit.parallel._foreach import group_by_device_and_dtype
from credit.parallel._groups import is_distributed

if TYPE_CHECKING:
    from credit.parallel._norms import Reduced


@dataclass(eq=False)
class Pending:
    """A scaler's flag for one optimizer, waiting for the world's answer.

    Attributes:
        grads: the local gradients (DTensors' local shards) the flag covers.
        device: where the flag lives (the scaler's device).
        local: this rank's answer, 1.0 when a gradient holds a NaN or inf; None until checked.
        world: the answer of every rank together (the same on every rank), once known.
        norms: where a norm settled the flag, the local tensors it normed and this rank's norm
            of each (kept, not computed: only a skipped step's report reads them).
    """

    grads: list[Tensor]
    device: torch.device
    local: Tensor | None = None
    world: Tensor | None = None
    norms: tuple[list[Tensor], Tensor] | None = None


_pending: list[Pending] = []


def expect(grads: list[Tensor], device: torch.device, local: Tensor | None) -> Pending:
    """Register a flag that the next norm over the world may settle."""
    pending = Pending(grads, device, local)
    _pending.append(pending)
    return pending


def forget(pending: Pending) -> None:
    if pending in _pending:
        _pending.remove(pending)


def local_answer(pending: Pending) -> Tensor:
    """This rank's answer, checked now if it was left to the norm."""
    if pending.local is None:
        pending.local = check(pending.grads, pending.device)
    return pending.local


def check(grads: list[Tensor], device: torch.device) -> Tensor:
    """1.0 when a NaN or inf is in ``grads``, else 0.0: a float32 scalar on ``device``."""
    return check_and_unscale(grads, torch.ones((), dtype=torch.float32, device=device))


def check_and_unscale(grads: list[Tensor], inv_scale: Tensor) -> Tensor:
    """Multiply ``grads`` by ``inv_scale`` in place with torch's AMP kernel, per (device, dtype),
    and return this rank's answer: 1.0 when a NaN or inf is in ``grads``, else 0.0, a float32
    scalar on ``inv_scale``'s device."""
    found = torch.zeros((), dtype=torch.float32, device=inv_scale.device)
    for (device, _), group in group_by_device_and_dtype(grads).items():
        found_here = torch.zeros((), dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(group, found_here, inv_scale.to(device))
        found = torch.maximum(found, found_here.to(found.device))
    return found


@dataclass(frozen=True)
class Fold:
    """The flags a norm is about to settle, and what this rank adds to its contribution."""

    waiting: list[Pending]
    poison: Tensor | None  # NaN where an uncovered flag is up, else 0.0; None when all covered


def fold(local: list[Tensor]) -> Fold | None:
    """Before a norm over the world of ``local``: the flags it will settle (None: none waits)."""
    waiting = [pending for pending in _pending if pending.world is None]
    if not waiting:
        return None
    held = {id(tensor) for tensor in local}
    uncovered = [p for p in waiting if not all(id(grad) in held for grad in p.grads)]
    if not uncovered:
        return Fold(waiting, None)
    device = local[0].device if local else uncovered[0].device
    up = torch.stack([local_answer(p).to(device) for p in uncovered]).amax()
    return Fold(waiting, torch.where(up > 0, math.nan, 0.0))


def settle(folded: Fold, reduced: Reduced) -> None:
    """Answer every flag of ``folded`` from a norm reduced over the world."""
    normed = None
    if reduced.local_norms is not None and reduced.local_inputs is not None:
        normed = [reduced.local[i] for i in reduced.local_inputs], reduced.local_norms
    answer = (~torch.isfinite(reduced.total)).to(torch.float32)
    for pending in folded.waiting:
        pending.world = answer.to(pending.device)
        pending.norms = normed
        forget(pending)


def nonfinite(pending: Pending) -> list[bool]:
    """Which of ``pending.grads`` hold a NaN or inf on this rank (for a skipped step's report):
    read from the norm that settled the flag, which the clip may have scaled by NaN since."""
    seen: dict[int, bool] = {}
    if pending.norms is not None:
        tensors, norms = pending.norms
        seen = dict(zip(map(id, tensors), (~torch.isfinite(norms)).tolist(), strict=True))
    return [
        seen[id(grad)] if id(grad) in seen else not bool(torch.isfinite(grad).all())
        for grad in pending.grads
    ]


def world_answer(pending: Pending) -> Tensor:
    """The answer of every rank: settled by a norm, or one all_reduce (MAX) of its own now."""
    if pending.world is None:
        answer = local_answer(pending).clone()
        if is_distributed() and dist.get_world_size() > 1:
            dist.all_reduce(answer, op=dist.ReduceOp.MAX)
        pending.world = answer
    forget(pending)
    return pending.world
