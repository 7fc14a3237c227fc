"""The history of a step's quantities (the gradient norm, and the loss where given), kept on the
device, one column per quantity.

Both kinds keep a ring of the last values taken (``warmup`` rows for ``"ema"``, ``window`` for
``"window"``) and, per column, how many of its latest values the history stands on (``length``).
Their statistics:

- ``"window"``: the mean and sample standard deviation (``n - 1``) of the last ``length`` values,
  as OLMo-core's skipped steps.
- ``"ema"``: ZClip's. The mean and population variance of the ``warmup`` values start an
  exponential moving average, which every later value updates:
  ``mean = alpha * mean + (1 - alpha) * x``, ``var = alpha * var + (1 - alpha) * (x - mean)**2``
  (with the updated mean).

Where both go past the published formulas:

- **Gross outliers are left out.** Once :data:`FIRST` values are in, a value further than
  :data:`BAND` times ``skip_sigma`` robust standard deviations (the interquartile range /
  1.349) from the values' median is left out of their mean and variance (the ring's statistics: the window's,
  and the moving average's start), so one outlier taken before any decision cannot widen the
  band for the rest of the run.
- **The warm-up decides gross outliers.** From :data:`FIRST` values on, the warm-up decides
  against the ring's statistics, with the band widened by ``sqrt(warmup / n)`` for ``n`` values
  in (the fewer, the wider), so that a spike inside the warm-up is skipped instead of entering.
- **A sustained fall restarts a history.** :data:`FALL` values in a row below the mean they were
  decided against (a norm that falls faster than the history forgets, as in early training)
  start that column over from its last :data:`FALL` values: the window forgets the older ones,
  the moving average warms up again from them. On stationary noise a run that long below the
  mean is rare (``p**16`` for ``p = P(x < mean)``, about 0.5 to 0.63).

Every function is elementwise on the device, with one small sort (the quartiles): which values
enter, and which phase a history is in, are tensors, never read on the host. The quantities
share each operation, so a loss costs no kernel of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from credit.parallel._spikes.settings import SpikeSettings

# Values in before the warm-up decides, and before gross outliers are left out of the ring's
# statistics: fewer give no reliable quartiles.
FIRST = 8
# Values in a row below the mean that restart a history from them (a sustained fall).
FALL = 16
# Left out of the ring's statistics: further than BAND * skip_sigma robust standard deviations
# from the median (outliers no one would call noise; on stationary noise the statistics are
# then those of the published formulas, measured in tests/test_spike_history.py).
BAND = 2.0
_IQR_TO_SIGMA = 1.349  # the normal distribution's interquartile range per standard deviation


@dataclass(frozen=True)
class ValueHistory:
    """The past values of ``k`` quantities.

    Attributes:
        values: the last values taken, newest first, ``(rows, k)`` float32: ``warmup`` rows
            (``"ema"``) or ``window`` (``"window"``).
        count: how many values entered in all, an int64 scalar.
        length: per column, how many of the ring's latest values the history stands on (at most
            ``rows + 1``: for ``"ema"``, more than ``warmup`` means the moving average has
            started), int64 ``(k,)``.
        below: per column, the values in a row taken below the mean they were decided against,
            int64 ``(k,)``.
        mean: the moving average (``"ema"``, once started), ``(k,)``.
        var: the moving variance (``"ema"``, once started), ``(k,)``.
    """

    values: Tensor
    count: Tensor
    length: Tensor
    below: Tensor
    mean: Tensor
    var: Tensor

    def to(self, device: torch.device) -> ValueHistory:
        """The same history on ``device``."""
        return ValueHistory(*(t.to(device) for t in self.tensors()))

    def tensors(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        return (self.values, self.count, self.length, self.below, self.mean, self.var)


@dataclass(frozen=True)
class Moments:
    """What a history says of the next values, per column ``(k,)``.

    Attributes:
        mean: the mean a value is compared with.
        var: the variance (the standard deviation is its square root).
        widen: the factor on the standard deviation: 1 past the warm-up, ``sqrt(warmup / n)``
            during it.
        ready: whether the warm-up is over (bool).
        deciding: whether the history decides at all: past the warm-up, or :data:`FIRST` values
            in (bool).
    """

    mean: Tensor
    var: Tensor
    widen: Tensor
    ready: Tensor
    deciding: Tensor

    @property
    def std(self) -> Tensor:
        return self.var.sqrt()


def empty(settings: SpikeSettings, quantities: int, device: torch.device) -> ValueHistory:
    """A history of ``quantities`` columns with no value yet."""
    rows = settings.warmup if settings.history == "ema" else settings.window
    zeros = torch.zeros(quantities, dtype=torch.float32, device=device)
    counts = torch.zeros(quantities, dtype=torch.int64, device=device)
    return ValueHistory(
        torch.zeros(rows, quantities, dtype=torch.float32, device=device),
        torch.zeros((), dtype=torch.int64, device=device),
        counts,
        counts.clone(),
        zeros,
        zeros.clone(),
    )


def moments(settings: SpikeSettings, history: ValueHistory) -> Moments:
    """The means and variances of ``history`` (meaningless where not ``deciding``)."""
    length, warmup = history.length, settings.warmup
    mean, squares, kept = _ring_statistics(settings, history)
    var = squares / (kept - 1).clamp(min=1)  # the sample variance
    ready = length >= warmup
    # inf where nothing is in: no decision then.
    widen = torch.where(ready, 1.0, math.sqrt(warmup) * length.to(torch.float32).rsqrt())
    if settings.history == "ema":
        # The warm-up's values all in: ZClip's start (their population variance); after it,
        # the moving average.
        started = length > warmup
        var = torch.where(ready, squares / kept.clamp(min=1), var)
        mean = torch.where(started, history.mean, mean)
        var = torch.where(started, history.var, var)
    return Moments(mean, var, widen, ready, ready | (length >= FIRST))


def zscore(settings: SpikeSettings, moments: Moments, values: Tensor) -> Tensor:
    """How many (widened) standard deviations each of ``values`` lies above its mean (``eps``
    added to the std); NaN where the history does not decide yet."""
    z = (values - moments.mean) / ((moments.std + settings.eps) * moments.widen)
    return torch.where(moments.deciding, z, math.nan)


def limit(settings: SpikeSettings, moments: Moments, sigma: float) -> Tensor:
    """The values above which the z-score exceeds ``sigma`` (inf where nothing is decided)."""
    bound = moments.mean + sigma * ((moments.std + settings.eps) * moments.widen)
    return torch.where(moments.deciding, bound, math.inf)


def entered(
    settings: SpikeSettings,
    history: ValueHistory,
    values: Tensor,
    take: Tensor,
    moments: Moments,
    z: Tensor,
) -> ValueHistory:
    """``history`` with ``values`` (one per column) entered where ``take`` (a bool scalar);
    ``moments`` and ``z`` are those the step was decided with."""
    rows = history.values.shape[0]
    shifted = torch.cat([values.unsqueeze(0), history.values[:-1]])
    ring = torch.where(take, shifted, history.values)
    length = torch.where(take, (history.length + 1).clamp(max=rows + 1), history.length)
    mean, var = history.mean, history.var
    if settings.history == "ema":
        alpha, moving = settings.alpha, take & moments.ready
        # where, not a product with take: an untaken step's values may be inf or NaN.
        mean = torch.where(moving, alpha * moments.mean + (1 - alpha) * values, mean)
        var = torch.where(moving, alpha * moments.var + (1 - alpha) * (values - mean).square(), var)
    below = torch.where(take, torch.where(z < 0, history.below + 1, 0), history.below)
    fall = below >= FALL
    length = torch.where(fall, length.clamp(max=min(FALL, rows)), length)
    below = torch.where(fall, 0, below)
    return ValueHistory(ring, history.count + take, length, below, mean, var)


def restarted(history: ValueHistory, when: Tensor) -> ValueHistory:
    """``history`` started over where ``when`` (a bool scalar), else unchanged: with no value
    counted, the ring's old values are out of it, and a new warm-up starts the average over."""
    keep = ~when
    return ValueHistory(
        history.values,
        history.count,
        history.length * keep,
        history.below * keep,
        history.mean,
        history.var,
    )


def _ring_statistics(
    settings: SpikeSettings, history: ValueHistory
) -> tuple[Tensor, Tensor, Tensor]:
    """The mean, the sum of squared deviations and the number of the ring's values each column
    stands on, gross outliers left out (once :data:`FIRST` values are in)."""
    ring = history.values
    rows = ring.shape[0]
    ages = torch.arange(rows, device=ring.device).unsqueeze(1)
    valid = ages < history.length  # (rows, k): the latest ``length`` values
    n = history.length.clamp(max=rows)
    # The lower quartile, median and upper quartile: one sort of the valid values, inf after.
    ordered = torch.where(valid, ring, math.inf).sort(dim=0).values
    quarters = (n - 1).clamp(min=0) * torch.arange(1, 4, device=ring.device).unsqueeze(1) // 4
    lower, median, upper = ordered.gather(0, quarters)
    spread = (upper - lower) / _IQR_TO_SIGMA
    # A spread of 0 (half the values alike) leaves nothing out.
    judged = (n >= FIRST) & (spread > 0)
    reach = torch.where(judged, (BAND * settings.skip_sigma) * spread, math.inf)
    kept = valid & ((ring - median).abs() <= reach)
    number = kept.sum(0).to(torch.float32)
    mean = torch.where(kept, ring, 0.0).sum(0) / number.clamp(min=1)
    squares = torch.where(kept, (ring - mean).square(), 0.0).sum(0)
    return mean, squares, number
