"""The history of a step's quantities (the gradient norm, and the loss where given), kept on the
device, one column per quantity.

Both kinds count the values that entered and answer the mean and standard deviation a z-score
is taken against:

- ``"ema"``: the mean and (population) variance of the first ``warmup`` values, kept as they
  come (Welford's updates), start an exponential moving average, which every later value
  updates: ``mean = alpha * mean + (1 - alpha) * x``,
  ``var = alpha * var + (1 - alpha) * (x - mean)**2`` (with the updated mean), as ZClip does.
- ``"window"``: a ring of the last ``window`` values, whose mean and sample standard deviation
  (``n - 1``) are taken, as OLMo-core's skipped steps do.

Every function is elementwise on the device: which values enter, and whether the warm-up is over,
are tensors, never read on the host. The quantities share each operation, so a loss costs no
kernel of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from credit.parallel._spikes.settings import SpikeSettings


@dataclass(frozen=True)
class ValueHistory:
    """The past values of ``k`` quantities.

    Attributes:
        values: the ring of the last values (``"window"``), ``(window, k)``; ``(0, k)`` for
            ``"ema"``. float32.
        count: how many steps entered so far, an int64 scalar.
        mean: the mean of the warm-up's values, then the moving average (``"ema"``), ``(k,)``.
        var: their population variance, then the moving variance (``"ema"``), ``(k,)``.
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
    """What a history says of the next values: their means and standard deviations, ``(k,)``,
    and whether the warm-up is over (a bool scalar)."""

    mean: Tensor
    std: Tensor
    ready: Tensor


def empty(settings: SpikeSettings, quantities: int, device: torch.device) -> ValueHistory:
    """A history of ``quantities`` columns with no value yet."""
    rows = 0 if settings.history == "ema" else settings.window
    zeros = torch.zeros(quantities, dtype=torch.float32, device=device)
    return ValueHistory(
        torch.zeros(rows, quantities, dtype=torch.float32, device=device),
        torch.zeros((), dtype=torch.int64, device=device),
        zeros,
        zeros.clone(),
    )


def moments(settings: SpikeSettings, history: ValueHistory) -> Moments:
    """The means and standard deviations of ``history`` (meaningless until ``ready``)."""
    ready = history.count >= settings.warmup
    if settings.history == "ema":
        return Moments(history.mean, history.var.sqrt(), ready)
    positions = torch.arange(settings.window, device=history.values.device).unsqueeze(1)
    valid = positions < history.count
    n = history.count.clamp(min=2, max=settings.window).to(torch.float32)
    mean = torch.where(valid, history.values, 0.0).sum(0) / n
    deviations = torch.where(valid, history.values - mean, 0.0)
    return Moments(mean, (deviations.square().sum(0) / (n - 1)).sqrt(), ready)


def zscore(settings: SpikeSettings, moments: Moments, values: Tensor) -> Tensor:
    """How many standard deviations each of ``values`` lies above its mean (``eps`` added to the
    std); NaN until the warm-up is over."""
    z = (values - moments.mean) / (moments.std + settings.eps)
    return torch.where(moments.ready, z, math.nan)


def entered(
    settings: SpikeSettings, history: ValueHistory, values: Tensor, take: Tensor
) -> ValueHistory:
    """``history`` with ``values`` (one per column) entered where ``take`` (a bool scalar)."""
    count = history.count + take
    if settings.history == "window":
        positions = torch.arange(settings.window, device=values.device).unsqueeze(1)
        slot = take & (positions == history.count % settings.window)
        return ValueHistory(
            torch.where(slot, values, history.values), count, history.mean, history.var
        )
    # One update for both phases: mean += weight * delta, var = keep * (var + spread * delta**2).
    # The warm-up's n-th value (Welford): weight 1/n, keep (n-1)/n, spread 1/n. The moving
    # average's (the new mean's distance to x is alpha * delta): 1 - alpha, alpha, (1 - alpha) *
    # alpha.
    alpha = settings.alpha
    warming = history.count < settings.warmup
    inverse = (history.count + 1).to(torch.float32).reciprocal()
    weight = torch.where(warming, inverse, 1 - alpha)
    keep = torch.where(warming, 1 - inverse, alpha)
    spread = torch.where(warming, inverse, (1 - alpha) * alpha)
    delta = values - history.mean
    # where, not a product with take: an untaken step's values may be inf or NaN.
    mean = torch.where(take, history.mean + weight * delta, history.mean)
    var = torch.where(take, keep * (history.var + spread * delta.square()), history.var)
    return ValueHistory(history.values, count, mean, var)


def restarted(history: ValueHistory, when: Tensor) -> ValueHistory:
    """``history`` started over where ``when`` (a bool scalar), else unchanged: with no value
    counted, the window's old values are out of it, and a new warm-up starts the average over."""
    return ValueHistory(history.values, history.count * ~when, history.mean, history.var)
