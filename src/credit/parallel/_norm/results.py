"""What a norm's collective returns: named, immutable results, read by the steps after it."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from credit.parallel._norm.hooks import Normed
from credit.parallel._norm.plan import NormPlan
from credit.parallel._norm.stacking import Stacking
from credit.parallel._norm.stage_slots import Regions


@dataclass(frozen=True)
class StageDecisions:
    """What the pipeline stages decided together in a norm's all_reduce, read on the host.

    Attributes:
        layout_failed: some stage's layout cannot be reduced, or the stages' shards do not add up
            to whole gradients.
        unverified_anywhere: some stage met its layout for the first time (or checks it).
        copies_differ: copies differed on some stage while the norm is finite.
        regions: every stage's slots of copies, grown by this call's counts (``stage_slots``).
    """

    layout_failed: bool
    unverified_anywhere: bool
    copies_differ: bool
    regions: Regions


@dataclass(frozen=True)
class Reduced:
    """The result of a norm.

    Attributes:
        total: the norm of all the gradients, as a plain scalar in the result dtype.
        entries: the global norm of each stacked gradient (in ``stacking.stacked``), or of each
            segment under pipeline stages.
        present: under pipeline stages, how many ranks hold gradients of each segment; None where
            ``entries`` are per gradient.
        local: each gradient's local tensor, in input order.
        stacking: the gradients' stacking order, and index tensors into it.
        local_norms: this rank's norm of each local tensor (before any reduction), in stacking
            order; None without any.
        answers_world: whether listeners may read the world's answers from it (see
            ``hooks.Normed``).
        host: under pipeline stages, ``entries``, the total (before its cast to the result
            dtype) and ``present``, as read on the host with the stages' decisions.
        plan: the layout's plan, for a norm over ranks.
        differ: whether the ranks taken for copies held different values on this call while
            every value was finite (the total is NaN then): a boolean scalar on the device,
            the same on every rank; None where nothing has copies or the verdict was read.
        stages: under pipeline stages, what the stages decided together.
    """

    total: Tensor
    entries: Tensor
    present: Tensor | None
    local: list[Tensor]
    stacking: Stacking
    local_norms: Tensor | None = None
    answers_world: bool = False
    host: list[float] | None = None
    plan: NormPlan | None = None
    differ: Tensor | None = None
    stages: StageDecisions | None = None

    def normed(self) -> Normed:
        """What the listeners (``hooks``) read of this norm."""
        per_gradient = self.answers_world and self.present is None and self.stacking.stacked
        return Normed(
            local=self.local,
            local_norms=self.local_norms,
            stacked_inputs=self.stacking.stacked if self.local_norms is not None else [],
            entries=self.entries if per_gradient else None,
            total=self.total,
            answers_world=self.answers_world,
            positions=self.stacking.positions,
        )
