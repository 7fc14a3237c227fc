"""What a spike policy carries from step to step, and how a settled step changes it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from credit.parallel._spikes import history as _history
from credit.parallel._spikes.decision import Decision
from credit.parallel._spikes.settings import SpikeSettings

# Places in ``SpikeState.counts``: steps skipped for a NaN or inf, steps skipped as spikes, spikes
# in a row until now, and restarts of the histories.
NON_FINITE, SPIKE, IN_A_ROW, RESTARTS = range(4)
_FIELDS = ("values", "count", "mean", "var")  # of a saved ValueHistory


@dataclass(frozen=True)
class SpikeState:
    """A policy's histories and counts, the same on every rank.

    Attributes:
        norms: the history of the gradient norm.
        losses: the history of the loss, or None until a step gives one.
        counts: steps skipped for a NaN or inf, steps skipped as spikes, spikes in a row until
            now, and restarts of the histories: four int64 counts on the device.
        steps: how many steps the policy has seen (``clip_grad_norm_`` calls).
    """

    norms: _history.ValueHistory
    losses: _history.ValueHistory | None
    counts: Tensor
    steps: int

    def on(self, device: torch.device) -> SpikeState:
        """The same state on ``device`` (no copy where it is already there)."""
        if self.counts.device == device:
            return self
        losses = None if self.losses is None else self.losses.to(device)
        return SpikeState(self.norms.to(device), losses, self.counts.to(device), self.steps)


def initial(settings: SpikeSettings, device: torch.device) -> SpikeState:
    """The state of a policy that has seen nothing."""
    counts = torch.zeros(4, dtype=torch.int64, device=device)
    return SpikeState(_history.empty(settings, device), None, counts, 0)


def settled(
    settings: SpikeSettings, state: SpikeState, decision: Decision, non_finite: Tensor | None
) -> SpikeState:
    """``state`` after the step of ``decision``, which the world's ``non_finite`` answer (1.0 when
    a gradient held a NaN or inf; None without a scaler) skipped or not. Only a taken step enters
    the histories; ``restart_after`` spikes in a row start them over (the norm found a new
    level)."""
    observed = decision.observed
    bad = ~torch.isfinite(observed.norm)
    if observed.loss is not None:
        bad = bad | ~torch.isfinite(observed.loss)
    if non_finite is not None:
        bad = bad | (non_finite.to(bad.device) > 0)
    spike = decision.spike & ~bad
    take = ~bad & ~spike
    in_a_row = torch.where(spike, state.counts[IN_A_ROW] + 1, state.counts[IN_A_ROW] * bad)
    restart = in_a_row >= (settings.restart_after or torch.iinfo(torch.int64).max)
    counts = state.counts + torch.stack([bad, spike, spike, restart]).to(torch.int64)
    counts[IN_A_ROW] = torch.where(restart, 0, in_a_row)
    norms = _history.entered(settings, state.norms, decision.entering, take)
    losses = state.losses
    if observed.loss is not None:
        losses = _history.empty(settings, bad.device) if losses is None else losses
        losses = _history.entered(settings, losses, observed.loss, take)
    return SpikeState(
        _history.restarted(norms, restart),
        None if losses is None else _history.restarted(losses, restart),
        counts,
        state.steps,
    )


def state_dict(settings: SpikeSettings, state: SpikeState) -> dict[str, Any]:
    """``state`` as plain values and CPU tensors (copies), with the settings it only fits. Every
    entry is there whatever the state holds, so that ``torch.distributed.checkpoint``, which
    loads into the entries of a fresh policy's state dict, finds them all (``losses`` is an empty
    history, with ``has_losses`` 0, until a loss is given)."""
    losses = state.losses
    if losses is None:
        losses = _history.empty(settings, state.counts.device)
    return {
        **settings.fingerprint(),
        "steps": state.steps,
        "counts": state.counts.to("cpu", copy=True),
        "norms": _saved(state.norms),
        "losses": _saved(losses),
        "has_losses": int(state.losses is not None),
    }


def loaded(settings: SpikeSettings, saved: dict[str, Any]) -> SpikeState:
    """The state :func:`state_dict` saved (on the CPU until the next step moves it).

    Raises:
        ValueError: the state was saved under other settings (naming them), or an entry is
            missing.
    """
    fingerprint = settings.fingerprint()
    theirs = {key: saved[key] for key in ("history", "window", "warmup") if key in saved}
    if theirs != fingerprint:
        raise ValueError(
            f"the SpikePolicy state was saved with {theirs} and is loaded into a policy with "
            f"{fingerprint}: build the policy with the saved settings"
        )
    try:
        return SpikeState(
            _restored(saved["norms"]),
            _restored(saved["losses"]) if saved["has_losses"] else None,
            torch.as_tensor(saved["counts"], dtype=torch.int64).clone(),
            int(saved["steps"]),
        )
    except KeyError as missing:
        raise ValueError(f"the SpikePolicy state has no entry {missing}") from None


def _saved(history: _history.ValueHistory) -> dict[str, Tensor]:
    return {
        name: tensor.to("cpu", copy=True)
        for name, tensor in zip(_FIELDS, history.tensors(), strict=True)
    }


def _restored(saved: dict[str, Tensor]) -> _history.ValueHistory:
    return _history.ValueHistory(*(torch.as_tensor(saved[name]).clone() for name in _FIELDS))
