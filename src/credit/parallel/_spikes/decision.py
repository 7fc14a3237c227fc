"""One step's decision: whether it is a spike to skip, and where the clip stands.

Every input is the same bits on every rank (the norm of this package, the loss averaged over the
world, the histories built from them), so every rank decides alike without a collective of its
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
        norm: the total gradient norm, a float32 scalar.
        loss: the loss averaged over the world, a float32 scalar; None when not given.
        ceiling: the fixed ``max_norm`` of the step's clip, or None.
        groups: the step's per-group norms (``grad_norm_report``), for the report; or None.
        step: how many steps the policy has seen, this one included.
    """

    norm: Tensor
    loss: Tensor | None
    ceiling: float | None
    groups: Mapping[str, float] | None
    step: int


@dataclass(frozen=True)
class Decision:
    """One step's decision, on the device.

    Attributes:
        observed: what the step showed.
        norm_z: the norm's z-score against its history (NaN during the warm-up).
        loss_z: the loss's z-score (NaN during its warm-up), or None without a loss.
        spike: whether to skip the step: an outlier, with a finite norm and loss (a bool scalar).
        skip_limit: the norm above which the step is skipped (inf while nothing can be).
        bound: the ``max_norm`` the step's clip uses (inf: no clipping), or None when the policy
            clips nothing at all.
        entering: the norm the history takes in if the step is taken (ZClip's: the adaptive
            threshold on a clipped step, else the norm).
    """

    observed: Observed
    norm_z: Tensor
    loss_z: Tensor | None
    spike: Tensor
    skip_limit: Tensor
    bound: Tensor | float | None
    entering: Tensor


def decide(
    settings: SpikeSettings,
    norms: _history.ValueHistory,
    losses: _history.ValueHistory | None,
    observed: Observed,
) -> Decision:
    """The decision of one step, from the histories before it."""
    norm = observed.norm
    moments = _history.moments(settings, norms)
    norm_z = _history.zscore(settings, moments, norm)
    outlier = torch.zeros((), dtype=torch.bool, device=norm.device)
    skip_limit = torch.full((), math.inf, device=norm.device)
    if settings.skip:
        outlier = moments.ready & (norm_z > settings.skip_sigma)
        limit = moments.mean + settings.skip_sigma * (moments.std + settings.eps)
        skip_limit = torch.where(moments.ready, limit, skip_limit)
    if settings.skip_above is not None:
        outlier = outlier | (norm > settings.skip_above)
        skip_limit = skip_limit.clamp(max=settings.skip_above)
    finite = torch.isfinite(norm)
    loss_z = None
    if observed.loss is not None:
        losses = _history.empty(settings, norm.device) if losses is None else losses
        loss_moments = _history.moments(settings, losses)
        loss_z = _history.zscore(settings, loss_moments, observed.loss)
        if settings.skip:
            outlier = outlier | (loss_moments.ready & (loss_z > settings.skip_sigma))
        finite = finite & torch.isfinite(observed.loss)
    bound, entering = _clip(settings, moments, norm_z, observed)
    return Decision(observed, norm_z, loss_z, finite & outlier, skip_limit, bound, entering)


def _clip(
    settings: SpikeSettings, moments: _history.Moments, norm_z: Tensor, observed: Observed
) -> tuple[Tensor | float | None, Tensor]:
    """The clip's ``max_norm`` and the norm the history takes in (ZClip's rules)."""
    norm = observed.norm
    if settings.adaptive_clip is None:
        return observed.ceiling, norm
    clips = moments.ready & (norm_z > settings.clip_z)
    if settings.adaptive_clip == "mean":
        threshold = moments.mean
    else:  # the further out, the lower: mean + clip_z * std / (z / clip_z)
        threshold = moments.mean + settings.clip_z**2 * moments.std / norm_z
    bound = torch.where(clips, threshold, math.inf)
    if observed.ceiling is not None:
        bound = bound.clamp(max=observed.ceiling)
    return bound, torch.where(clips, threshold, norm)
