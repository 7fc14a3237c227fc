"""One step's decision: whether it is a spike to skip, and where the clip stands.

Every input is the same bits on every rank (the norm of this package, the loss averaged over the
world, the history built from them), so every rank decides alike without a collective of its
own; every output stays on the device.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from credit.parallel._spikes import history as _history
from credit.parallel._spikes.settings import SpikeSettings


@dataclass(frozen=True)
class Observed:
    """What one step shows the policy, the same on every rank.

    Attributes:
        values: the total gradient norm, and the loss averaged over the world (0 where not
            given): float32, ``(2,)``.
        with_loss: whether the step gave a loss.
        ceiling: the fixed ``max_norm`` of the step's clip, or None.
        groups: the step's per-group norms (``grad_norm_report``), for the report; or None.
        step: how many steps the policy has seen, this one included.
    """

    values: Tensor
    with_loss: bool
    ceiling: float | None
    groups: Mapping[str, float] | None
    step: int

    @property
    def norm(self) -> Tensor:
        return self.values[0]

    @property
    def loss(self) -> Tensor | None:
        return self.values[1] if self.with_loss else None


@dataclass(frozen=True)
class Decision:
    """One step's decision, on the device.

    Attributes:
        observed: what the step showed.
        moments: the history's means and standard deviations before the step.
        z: the z-scores of the norm (and the loss) against them, the warm-up's widened (NaN
            until the history decides).
        finite: whether the norm (and the loss) are finite (a bool scalar).
        spike: whether the step is a spike: an outlier, with a finite norm and loss.
        skip: whether the scaler skips the step: a spike, or a norm or loss that is not finite
            (1.0 or 0.0, the float the scaler's answer takes, made once).
        bound: the ``max_norm`` the step's clip uses (inf: no clipping), or None when the policy
            clips nothing at all.
        entering: what the history takes in if the step is taken: the norm (ZClip's: the
            adaptive threshold on a clipped step), and the loss.
    """

    observed: Observed
    moments: _history.Moments
    z: Tensor
    finite: Tensor
    spike: Tensor
    skip: Tensor
    bound: Tensor | float | None
    entering: Tensor

    def skip_limit(self, settings: SpikeSettings) -> Tensor:
        """The norm above which the step is skipped (inf while nothing can be)."""
        limit = torch.full((), math.inf, device=self.z.device)
        if settings.skip:
            limit = _history.limit(settings, self.moments, settings.skip_sigma)[0]
        if settings.skip_above is not None:
            limit = limit.clamp(max=settings.skip_above)
        return limit


def decide(settings: SpikeSettings, history: _history.ValueHistory, observed: Observed) -> Decision:
    """The decision of one step, from the history before it."""
    values = observed.values
    moments = _history.moments(settings, history)
    z = _history.zscore(settings, moments, values)
    finite = torch.isfinite(values).all()
    outlier = torch.zeros((), dtype=torch.bool, device=values.device)
    if settings.skip:
        outlier = (z > settings.skip_sigma).any()  # NaN before the history decides: never
    if settings.skip_above is not None:
        outlier = outlier | (observed.norm > settings.skip_above)
    bound, entering = _clip(settings, moments, z, observed)
    spike = finite & outlier
    return Decision(observed, moments, z, finite, spike, (spike | ~finite).float(), bound, entering)


def _clip(
    settings: SpikeSettings, moments: _history.Moments, z: Tensor, observed: Observed
) -> tuple[Tensor | float | None, Tensor]:
    """The clip's ``max_norm`` and what the history takes in (ZClip's rules)."""
    if settings.adaptive_clip is None:
        return observed.ceiling, observed.values
    norm_z, mean = z[0], moments.mean[0]
    clips = (norm_z > settings.clip_z) & moments.ready[0]  # ZClip's: never during the warm-up
    if settings.adaptive_clip == "mean":
        threshold = mean
    else:  # the further out, the lower: mean + clip_z * std / (z / clip_z)
        threshold = mean + settings.clip_z**2 * moments.std[0] / norm_z
    bound = torch.where(clips, threshold, math.inf)
    if observed.ceiling is not None:
        bound = bound.clamp(max=observed.ceiling)
    norm = torch.where(clips, threshold, observed.norm)
    return bound, torch.stack([norm, observed.values[1]])
