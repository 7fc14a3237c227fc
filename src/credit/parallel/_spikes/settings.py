"""What a spike policy was asked to do: its arguments, checked once, as one immutable object."""

from __future__ import annotations

import math
from dataclasses import dataclass

HISTORIES = ("ema", "window")
ADAPTIVE_CLIPS = ("zscore", "mean")


@dataclass(frozen=True)
class SpikeSettings:
    """A spike policy's arguments (see ``credit.parallel.spikes.SpikePolicy``), checked.

    Attributes:
        skip: whether an outlier step is skipped.
        skip_sigma: the z-score above which a step is an outlier.
        skip_above: a fixed norm above which a step is skipped, or None.
        adaptive_clip: ``"zscore"`` or ``"mean"``, or None for no adaptive clip.
        clip_z: the z-score above which the adaptive clip clips.
        history: ``"ema"`` or ``"window"``.
        alpha: the moving average's decay (``"ema"``).
        window: how many past values the rolling window keeps (``"window"``).
        warmup: how many values enter a history before its published statistics decide (the
            warm-up decides gross outliers from ``history.FIRST`` values on).
        eps: added to the standard deviation in every z-score.
        restart_after: how many spikes in a row start the histories over, or None for never.
    """

    skip: bool
    skip_sigma: float
    skip_above: float | None
    adaptive_clip: str | None
    clip_z: float
    history: str
    alpha: float
    window: int
    warmup: int
    eps: float
    restart_after: int | None

    def fingerprint(self) -> dict[str, object]:
        """The settings a saved history only fits when they are the same."""
        if self.history == "ema":
            return {"history": self.history, "warmup": self.warmup}
        return {"history": self.history, "window": self.window, "warmup": self.warmup}


def checked_settings(
    skip: bool,
    skip_sigma: float,
    skip_above: float | None,
    adaptive_clip: str | None,
    clip_z: float,
    history: str,
    alpha: float,
    window: int,
    warmup: int | None,
    eps: float,
    restart_after: int | None,
) -> SpikeSettings:
    """The arguments of a spike policy as :class:`SpikeSettings`.

    Raises:
        TypeError: an argument has the wrong type (naming it).
        ValueError: an argument is out of its range (naming it and the range).
    """
    if not isinstance(skip, bool):
        raise TypeError(f"skip must be a bool, got {type(skip).__name__}")
    _positive("skip_sigma", skip_sigma)
    if skip_above is not None:
        _positive("skip_above", skip_above)
    _choice("adaptive_clip", adaptive_clip, (None, *ADAPTIVE_CLIPS))
    _positive("clip_z", clip_z)
    _choice("history", history, HISTORIES)
    _number("alpha", alpha)
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    _count("window", window, least=2)
    if warmup is None:
        # OLMo-core's window decides on its (window // 2)-th value, against the ones before it;
        # a sample standard deviation needs two.
        warmup = 25 if history == "ema" else max(2, window // 2 - 1)
    _count("warmup", warmup, least=1 if history == "ema" else 2)
    if history == "window" and warmup > window:
        raise ValueError(f"warmup ({warmup}) must not exceed window ({window})")
    _number("eps", eps)
    if eps < 0.0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps}")
    if restart_after is not None:
        _count("restart_after", restart_after, least=1)
    return SpikeSettings(
        skip,
        float(skip_sigma),
        None if skip_above is None else float(skip_above),
        adaptive_clip,
        float(clip_z),
        history,
        float(alpha),
        window,
        warmup,
        float(eps),
        restart_after,
    )


def _number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")


def _positive(name: str, value: object) -> None:
    _number(name, value)
    if value <= 0:  # type: ignore[operator]
        raise ValueError(f"{name} must be a finite number > 0, got {value}")


def _count(name: str, value: object, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < least:
        raise ValueError(f"{name} must be at least {least}, got {value}")


def _choice(name: str, value: object, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
