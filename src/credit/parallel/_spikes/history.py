"""A history of one value per step (a gradient norm, a loss), kept on the device.

Both kinds hold a buffer of past values and how many entered, and answer the mean and standard
deviation a z-score is taken against:

- ``"ema"``: the mean and (population) variance of the first ``warmup`` values, kept as they
  come (Welford's updates), start an exponential moving average, which every later value
  updates: ``mean = alpha * mean + (1 - alpha) * x``,
  ``var = alpha * var + (1 - alpha) * (x - mean)**2`` (with the updated mean), as ZClip does.
- ``"window"``: the buffer is a ring of the last ``window`` values, whose mean and sample standard
  deviation (``n - 1``) are taken, as OLMo-core's skipped steps do.

Every function is elementwise on the device: which value enters, and whether the warm-up is over,
are tensors, never read on the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from credit.parallel._spikes.settings import SpikeSettings


@dataclass(frozen=True)
class ValueHistory:
    """The past values of one quantity.

    Attributes:
        values: the ring of the last values (``"window"``; empty for ``"ema"``), float32.
        count: how many values entered so far, an int64 scalar.
        mean: the mean of the warm-up's values, then the moving average (``"ema"``), a float32
            scalar.
        var: their population variance, then the moving variance (``"ema"``), a float32
            scalar.
    """

    values: Tensor
    count: Tensor
    mean: Tensor
    var: Tensor

    def to(self, device: torch.device) -> ValueHistory:
        """The same history on ``device``."""
        return ValueHistory(*(t.to(device) for t in self.tensors()))

    def tensors(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return (self.values, self.count, self.mean, self.var)


@dataclass(frozen=True)
class Moments:
    """What a history says of the next value: its mean, standard deviation, and whether the
    warm-up is over (a bool scalar)."""

    mean: Tensor
    std: Tensor
    ready: Tensor


def empty(settings: SpikeSettings, device: torch.device) -> ValueHistory:
    """A history with no value yet."""
    size = 0 if settings.history == "ema" else settings.window
    zero = torch.zeros((), dtype=torch.float32, device=device)
    return ValueHistory(
        torch.zeros(size, dtype=torch.float32, device=device),
        torch.zeros((), dtype=torch.int64, device=device),
        zero,
        zero.clone(),
    )


def moments(settings: SpikeSettings, history: ValueHistory) -> Moments:
    """The mean and standard deviation of ``history`` (meaningless until ``ready``)."""
    ready = history.count >= settings.warmup
    if settings.history == "ema":
        return Moments(history.mean, history.var.sqrt(), ready)
    positions = torch.arange(settings.window, device=history.values.device)
    valid = positions < history.count
    n = history.count.clamp(min=2, max=settings.window).to(torch.float32)
    mean = torch.where(valid, history.values, 0.0).sum() / n
    deviations = torch.where(valid, history.values - mean, 0.0)
    return Moments(mean, (deviations.square().sum() / (n - 1)).sqrt(), ready)


def zscore(settings: SpikeSettings, moments: Moments, value: Tensor) -> Tensor:
    """How many standard deviations ``value`` lies above the mean (``eps`` added to the std);
    NaN until the warm-up is over."""
    z = (value - moments.mean) / (moments.std + settings.eps)
    return torch.where(moments.ready, z, math.nan)


def entered(
    settings: SpikeSettings, history: ValueHistory, value: Tensor, take: Tensor
) -> ValueHistory:
    """``history`` with ``value`` entered where ``take`` (a bool scalar), else unchanged."""
    count = history.count + take
    if settings.history == "window":
        positions = torch.arange(settings.window, device=value.device)
        slot = history.count % settings.window
        values = torch.where(take & (positions == slot), value, history.values)
        return ValueHistory(values, count, history.mean, history.var)
    delta = value - history.mean
    warming = history.count < settings.warmup
    # Welford's running mean and population variance during the warm-up; the moving ones after.
    n = count.clamp(min=1).to(torch.float32)
    mean = torch.where(
        warming, history.mean + delta / n, history.mean + (1 - settings.alpha) * delta
    )
    var = torch.where(
        warming,
        history.var + (delta * (value - mean) - history.var) / n,
        settings.alpha * history.var + (1 - settings.alpha) * (value - mean).square(),
    )
    return ValueHistory(
        history.values,
        count,
        torch.where(take, mean, history.mean),
        torch.where(take, var, history.var),
    )


def restarted(history: ValueHistory, when: Tensor) -> ValueHistory:
    """``history`` started over where ``when`` (a bool scalar), else unchanged: with no value
    counted, the window's old values are out of it, and a new warm-up starts the average over."""
    count = history.count * ~when
    return ValueHistory(history.values, count, history.mean, history.var)
