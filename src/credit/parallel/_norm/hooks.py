"""What other parts of the package may attach to every norm and clip: the listener protocol.

A norm reduces its gradients over the world in one collective, and a clip then scales them. Other
state of a training step can ride on that work instead of paying for collectives or passes of its
own: the GradScaler's non-finite flags (``found_inf``) read their answers from a norm's reduced
values and learn which gradients a clip has spoiled. The dependency runs one way: the norm and the
clip know this protocol only, and whoever needs them attaches a listener here.

Listeners never change what a norm computes or returns. Under pipeline stages they may add one
number to a slot that every norm's collective carries (see :meth:`NormListener.unanswered`), so
that every rank learns whether every listener can be answered; the slot is there, and sums to
zero, whether or not anything listens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from torch import Tensor


@dataclass(frozen=True)
class NormEvent:
    """What one norm call saw on this rank and, where it reduced over the world, found.

    Attributes:
        local: each gradient's local tensor, in input order.
        local_norms: this rank's norm of each local tensor, before any reduction, in stacking
            order; None when there were none.
        stacked_inputs: the input index of each stacked entry (of ``local_norms`` and
            ``entries``).
        entries: each gradient's norm over the world, in stacking order, where the norm reduced
            per gradient (one pipeline stage); None otherwise.
        total: the norm of all the gradients.
        answers_world: whether the listeners may read the world's answers from this norm: it
            reduced over the world, and (under pipeline stages) no rank had anything left
            unanswered. The same on every rank.
        positions: the places of some gradients (input indices) in the stacking order, as an
            index tensor beside ``entries``: kept with the layout, so that reading entries
            costs no copy from the host after the first time.
    """

    local: list[Tensor]
    local_norms: Tensor | None
    stacked_inputs: list[int]
    entries: Tensor | None
    total: Tensor
    answers_world: bool
    positions: Callable[[list[int]], Tensor]


class NormListener(Protocol):
    """Something that reads every norm and every clip of the package while it is attached."""

    def unanswered(self, local: list[Tensor]) -> int:
        """Under pipeline stages, before the norm's collective: how many of the listener's
        questions a norm of ``local`` could not answer on this rank (0 when it can answer all)."""
        ...

    def normed(self, normed: NormEvent) -> None:
        """After every norm, on every rank."""
        ...

    def scaled(self, local: list[Tensor], coefficient: Tensor) -> None:
        """After a clip multiplied the tensors ``local`` in place by ``coefficient`` (the same on
        every rank)."""
        ...


_attached: list[NormListener] = []


def attach(listener: NormListener) -> None:
    """Let ``listener`` read every norm and clip from now on (attaching twice does nothing)."""
    if not any(listener is other for other in _attached):
        _attached.append(listener)


def detach(listener: NormListener) -> None:
    """Stop notifying ``listener`` (detaching one that is not attached does nothing)."""
    _attached[:] = [other for other in _attached if other is not listener]


def attached() -> tuple[NormListener, ...]:
    """The listeners attached now, in the order they were attached."""
    return tuple(_attached)


def unanswered(local: list[Tensor]) -> int:
    """How many of the attached listeners' questions a norm of ``local`` leaves unanswered on this
    rank (see :meth:`NormListener.unanswered`); 0 without listeners."""
    return sum(listener.unanswered(local) for listener in _attached)


def notify(normed: Callable[[], NormEvent]) -> None:
    """Hand every attached listener what a norm saw, built by ``normed`` only if one listens."""
    if not _attached:
        return
    seen = normed()
    for listener in tuple(_attached):
        listener.normed(seen)
