"""Gradient spikes: the histories of a step's norm and loss, and the decision each step takes.

``world_loss`` takes the step's loss from the ranks that give one; ``decide`` reads a step
against the histories before it; ``after_step`` enters a taken step into
them; ``report_spike`` tells rank 0 of a skipped one. The public ``SpikePolicy`` strings them
together; the ``GradScaler`` skips the steps they decide.
"""

from credit.parallel._spikes.decision import Decision, Observed, decide
from credit.parallel._spikes.loss import WorldLoss, world_loss
from credit.parallel._spikes.report import report_spike
from credit.parallel._spikes.settings import SpikeSettings, checked_settings
from credit.parallel._spikes.state import (
    NON_FINITE,
    RESTARTS,
    SPIKE,
    SpikeState,
    after_step,
    initial,
    loaded,
    state_dict,
)

__all__ = [
    "NON_FINITE",
    "RESTARTS",
    "SPIKE",
    "Decision",
    "Observed",
    "SpikeSettings",
    "SpikeState",
    "WorldLoss",
    "after_step",
    "checked_settings",
    "decide",
    "initial",
    "loaded",
    "report_spike",
    "state_dict",
    "world_loss",
]
