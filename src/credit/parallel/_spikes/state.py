"""What a spike policy carries from step to step, and how the end of a step changes it."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from credit.parallel._spikes import history as _history
from credit.parallel._spikes.decision import Decision
from credit.parallel._spikes.settings import SpikeSettings

# Places in ``SpikeState.counts``: steps skipped for a NaN or inf, steps skipped as spikes, and
# restarts of the history.
NON_FINITE, SPIKE, RESTARTS = range(3)
_FIELDS = ("values", "count", "length", "below", "mean", "var")  # of a saved ValueHistory


@dataclass(frozen=True)
class SpikeState:
    """A policy's history and counts, the same on every rank.

    Attributes:
        history: the history of the gradient norm and of the loss (0 where the steps give none).
        counts: steps skipped for a NaN or inf, steps skipped as spikes, restarts of the history:
            three int64 counts on the device.
        in_a_row: spikes in a row until now, an int64 scalar on the device.
        steps: how many steps the policy has seen (``clip_grad_norm_`` calls).
        with_loss: whether its steps give a loss; None before the first.
    """

    history: _history.ValueHistory
    counts: Tensor
    in_a_row: Tensor
    steps: int
    with_loss: bool | None

    def on(self, device: torch.device) -> SpikeState:
        """The same state on ``device`` (no copy where it is already there)."""
        if self.counts.device == device:
            return self
        history = self.history.to(device)
        return replace(
            self, history=history, counts=self.counts.to(device), in_a_row=self.in_a_row.to(device)
        )


def initial(settings: SpikeSettings, device: torch.device) -> SpikeState:
    """The state of a policy that has seen nothing."""
    counts = torch.zeros(3, dtype=torch.int64, device=device)
    in_a_row = torch.zeros((), dtype=torch.int64, device=device)
    return SpikeState(_history.empty(settings, 2, device), counts, in_a_row, 0, None)


def after_step(
    settings: SpikeSettings, state: SpikeState, decision: Decision, non_finite: Tensor | None
) -> SpikeState:
    """``state`` after the step of ``decision``, which the world's ``non_finite`` answer (1.0 when
    a gradient held a NaN or inf; None without a scaler) skipped or not. Only a taken step enters
    the history; ``restart_after`` spikes in a row start it over (the norm found a new level)."""
    bad = ~decision.finite
    spike = decision.spike
    if non_finite is not None:
        answered = non_finite.to(bad.device) > 0
        bad, spike = bad | answered, spike & ~answered
    take = ~(bad | spike)
    history = _history.entered(
        settings, state.history, decision.entering, take, decision.moments, decision.z
    )
    in_a_row = (state.in_a_row + 1) * spike + state.in_a_row * bad  # a taken step ends the run
    restart = torch.zeros_like(spike)
    if settings.restart_after is not None:
        restart = in_a_row >= settings.restart_after
        in_a_row = in_a_row * ~restart
        history = _history.restarted(history, restart)
    counts = state.counts + torch.stack([bad, spike, restart])
    return replace(state, history=history, counts=counts, in_a_row=in_a_row)


def state_dict(settings: SpikeSettings, state: SpikeState) -> dict[str, Any]:
    """``state`` as plain values and CPU tensors (copies), with the settings it only fits."""
    return {
        **settings.fingerprint(),
        "with_loss": -1 if state.with_loss is None else int(state.with_loss),
        "steps": state.steps,
        "counts": state.counts.to("cpu", copy=True),
        "in_a_row": state.in_a_row.to("cpu", copy=True),
        "statistics": {
            name: tensor.to("cpu", copy=True)
            for name, tensor in zip(_FIELDS, state.history.tensors(), strict=True)
        },
    }


def loaded(settings: SpikeSettings, saved: dict[str, Any]) -> SpikeState:
    """The state :func:`state_dict` saved (on the CPU until the next step moves it).

    Raises:
        ValueError: the state was saved under other settings (naming them), or by a version whose
            history kept no ring of values for the moving average (no ``length`` entry), or an
            entry is missing.
    """
    fingerprint = settings.fingerprint()
    theirs = {key: saved[key] for key in ("history", "window", "warmup") if key in saved}
    if theirs != fingerprint:
        raise ValueError(
            f"the SpikePolicy state was saved with {theirs} and is loaded into a policy with "
            f"{fingerprint}: build the policy with the saved settings"
        )
    if "statistics" in saved and "length" not in saved["statistics"]:
        raise ValueError(
            "the SpikePolicy state has no entry 'length': it was saved by an earlier version, "
            "whose histories keep no ring of their last values and cannot be continued; load "
            "the rest of the checkpoint without it, and the policy starts a new warm-up"
        )
    try:
        statistics = saved["statistics"]
        with_loss = int(saved["with_loss"])
        return SpikeState(
            _history.ValueHistory(*(torch.as_tensor(statistics[n]).clone() for n in _FIELDS)),
            torch.as_tensor(saved["counts"], dtype=torch.int64).clone(),
            torch.as_tensor(saved["in_a_row"], dtype=torch.int64).clone(),
            int(saved["steps"]),
            None if with_loss < 0 else bool(with_loss),
        )
    except KeyError as missing:
        raise ValueError(f"the SpikePolicy state has no entry {missing}") from None
