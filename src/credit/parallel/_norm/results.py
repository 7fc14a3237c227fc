"""What a norm's collective returns: named, immutable results, read by the steps after it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from credit.parallel._norm.hooks import NormEvent
from credit.parallel._norm.pipeline import Regions
from credit.parallel._norm.plan import NormPlan
from credit.parallel._norm.stacking import Stacking


@dataclass(frozen=True)
class StageDecisions:
    """What the pipeline stages decided together in a norm's all_reduce, read on the host.

    Attributes:
        result_dtype: the promotion of the stages' votes for the result dtype (the gradients'
            dtype where no stage voted), the same on every rank.
        layout_failed: some stage's layout cannot be reduced, or the stages' shards do not add up
            to whole gradients.
        unverified_anywhere: some stage met its layout for the first time (or checks it).
        copies_differ: copies differed on some stage while the norm is finite.
        listeners_answered: no rank left a listener's question unanswered (``hooks``).
        regions: every stage's slots of copies, as every rank agreed them before this call
            (``pipeline``).
        slot_counts: each stage's count of slots on this call, which grow the regions.
    """

    result_dtype: torch.dtype
    layout_failed: bool
    unverified_anywhere: bool
    copies_differ: bool
    listeners_answered: bool
    regions: Regions
    slot_counts: tuple[float, ...]


@dataclass(frozen=True)
class StagesRead:
    """What a norm across pipeline stages brought back beside its total.

    Attributes:
        present: how many ranks hold gradients of each segment, on the device.
        numbers: each segment's norm, the total (before its cast to the result dtype) and
            ``present``, as read on the host with the decisions.
        decisions: what the stages decided together.
    """

    present: Tensor
    numbers: list[float]
    decisions: StageDecisions


@dataclass(frozen=True)
class Reduced:
    """The result of a norm.

    Attributes:
        total: the norm of all the gradients, as a plain scalar in the result dtype.
        entries: the global norm of each stacked gradient (in ``stacking.stacked``), or of each
            segment under pipeline stages.
        local: each gradient's local tensor, in input order.
        stacking: the gradients' stacking order, and index tensors into it.
        local_norms: this rank's norm of each local tensor (before any reduction), in stacking
            order; None without any.
        answers_world: whether listeners may read the world's answers from it (see
            ``hooks.NormEvent``).
        plan: the layout's plan, for a norm over ranks.
        differ: whether the ranks taken for copies held different values on this call while
            every value was finite (the total is NaN then): a boolean scalar on the device,
            the same on every rank; None where nothing has copies or the verdict was read.
        stages: under pipeline stages, what the stages brought back and decided together; None
            within a stage (``entries`` are then per gradient).
    """

    total: Tensor
    entries: Tensor
    local: list[Tensor]
    stacking: Stacking
    local_norms: Tensor | None = None
    answers_world: bool = False
    plan: NormPlan | None = None
    differ: Tensor | None = None
    stages: StagesRead | None = None

    def normed(self) -> NormEvent:
        """What the listeners (``hooks``) read of this norm."""
        per_gradient = self.answers_world and self.stages is None and self.stacking.stacked
        return NormEvent(
            local=self.local,
            local_norms=self.local_norms,
            stacked_inputs=self.stacking.stacked if self.local_norms is not None else [],
            entries=self.entries if per_gradient else None,
            total=self.total,
            answers_world=self.answers_world,
            positions=self.stacking.positions,
        )
