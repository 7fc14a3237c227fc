"""A history of one value per step (a gradient norm, a loss), kept on the device.

Both kinds hold a buffer of past values and how many entered, and answer the mean and standard
deviation a z-score is taken against:

- ``"ema"``: the first ``warmup`` values fill the buffer; their mean and (population) variance
  start an exponential moving average, which every later value updates:
  ``mean = alpha * mean + (1 - alpha) * x``, ``var = alpha * var + (1 - alpha) * (x - mean)**2``
  (with the updated mean), as ZClip does.
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
        values: the warm-up values (``"ema"``) or the ring of the last values (``"window"``),
            float32.
        count: how many values entered so far, an int64 scalar.
        mean: the moving average (``"ema"``, after the warm-up), a float32 scalar.
        var: the moving variance (``"ema"``, after the warm-up), a float32 scalar.
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
    size = settings.warmup if settings.history == "ema" else settings.window
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
    size = history.values.numel()
    positions = torch.arange(size, device=history.values.device)
    if settings.history == "window":
        slot = history.count % size
        values = torch.where(take & (positions == slot), value, history.values)
        return ValueHistory(values, history.count + take, history.mean, history.var)
    warming = history.count < settings.warmup
    filled = torch.where(positions == history.count.clamp(max=size - 1), value, history.values)
    values = torch.where(take & warming, filled, history.values)
    count = history.count + take
    starts = take & warming & (count == settings.warmup)
    first_mean = filled.mean()
    first_var = (filled - first_mean).square().mean()
    moves = take & ~warming
    alpha = settings.alpha
    mean = alpha * history.mean + (1 - alpha) * value
    var = alpha * history.var + (1 - alpha) * (value - mean).square()
    return ValueHistory(
        values,
        count,
        torch.where(starts, first_mean, torch.where(moves, mean, history.mean)),
        torch.where(starts, first_var, torch.where(moves, var, history.var)),
    )


def restarted(settings: SpikeSettings, history: ValueHistory, when: Tensor) -> ValueHistory:
    """``history`` emptied where ``when`` (a bool scalar), else unchanged."""
    empty_history = empty(settings, history.values.device)
    return ValueHistory(
        *(
            torch.where(when, fresh, kept)
            for fresh, kept in zip(empty_history.tensors(), history.tensors(), strict=True)
        )
    )
