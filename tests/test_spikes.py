"""The spike policy in one process: its decisions and thresholds against a float64 computation of
its rule, its arguments, its state, and its steps taken or skipped by the scaler.

The oracle below is written from the rule as the guide states it, not from the code: the
published formulas, ZClip's (Kumar et al. 2025) for the moving average (``mean = a*mean +
(1-a)*x``, ``var = a*var + (1-a)*(x - mean)**2`` with the new mean; clipping to
``mean + z_c**2 * std / z`` or to the mean above ``z_c``; the clipped value enters) and
OLMo-core's for the window (mean and sample standard deviation of the last values), with the
package's three departures: once 8 values are in, a value further than ``2 * skip_sigma``
robust standard deviations (interquartile range / 1.349) from the median is left out of the
values' statistics (the window's, the moving average's start: the mean and population variance
of the warm-up's values); the warm-up decides from 8 values on, its band widened by
``sqrt(warmup / n)``; 16 values in a row below the mean they were decided against keep only
those 16 (the moving average warms up again from them). Each step's norm is the norm of a
one-element gradient, exactly the value fed in (float32). The policy computes in float32: its
thresholds match the oracle's to a relative 2e-6 (a few float32 roundings of a moving average
that forgets at 0.97), and its decisions match exactly on sequences whose z-scores stay clear of
the limits (and of 0), and whose values stay clear of the outlier band, by more than that
rounding (asserted).

Multi-rank behaviour (layouts, fp16, resume at ranks) is in ``test_spikes_layouts.py``; the
departures' purpose (a spike inside the warm-up, early training's fall) in
``test_spike_history.py``.
"""

from __future__ import annotations

import ast
import collections
import logging
import math
import random
import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from credit.parallel import _scaler
from credit.parallel.amp import GradScaler
from credit.parallel.spikes import SpikePolicy

RTOL = 2e-6
MARGIN = 1e-3  # relative distance of every oracle z-score from a limit


def _norms(steps: int = 160, spikes: tuple[int, ...] = (3, 40, 90, 91, 130)) -> list[float]:
    """A drifting, noisy norm with planted spikes (fixed seed): the first before any decision,
    the others after the warm-ups (within the window's defaults')."""
    rng = random.Random(0)
    values = []
    for step in range(steps):
        value = (1.0 + 0.5 * math.sin(step / 25)) * math.exp(rng.gauss(0.0, 0.15))
        values.append(value * (30.0 if step in spikes else 1.0))
    return values


def _same_figures(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """The same figures, bit for bit (NaN z-scores of the warm-up included)."""
    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)) for k in a
    )


# The rule's constants, as the guide states them.
FIRST, FALL, BAND, IQR_TO_SIGMA = 8, 16, 2.0, 1.349


class _Oracle:
    """The rule in float64: what each step decides."""

    def __init__(self, policy: SpikePolicy, ceiling: float | None) -> None:
        self.s = policy.settings
        self.ceiling = math.inf if ceiling is None else ceiling
        self.rows = self.s.warmup if self.s.history == "ema" else self.s.window
        self.taken: list[float] = []  # every value entered, oldest first
        self.length = 0  # how many of the latest the history stands on
        self.below = 0
        self.mean = self.var = 0.0  # the moving average, once started
        self.zs: list[float] = []
        self.margins: list[float] = []  # relative distances of values from the outlier band

    def step(self, norm: float) -> tuple[bool, float]:
        s = self.s
        moments = self._moments()
        z = math.nan
        if moments is not None:
            mean, var, widen, ready = moments
            z = (norm - mean) / ((math.sqrt(var) + s.eps) * widen)
            self.zs.append(z)
        spike = (s.skip and z > s.skip_sigma) or (s.skip_above is not None and norm > s.skip_above)
        threshold, entering = math.inf, norm
        if s.adaptive_clip and moments is not None and ready and z > s.clip_z:
            std = math.sqrt(var)
            threshold = mean if s.adaptive_clip == "mean" else mean + s.clip_z**2 * std / z
            entering = threshold
        if not spike:
            self._enter(entering, z, moments)
        return spike, min(threshold, self.ceiling)

    def _moments(self) -> tuple[float, float, float, bool] | None:
        """The mean, variance, band's widening and whether the warm-up is over; None while
        nothing is decided."""
        s, ready = self.s, self.length >= self.s.warmup
        if not ready and self.length < FIRST:
            return None
        if s.history == "ema" and self.length > s.warmup:
            return self.mean, self.var, 1.0, True
        kept = self._kept()
        mean = sum(kept) / len(kept)
        squares = sum((x - mean) ** 2 for x in kept)
        population = s.history == "ema" and ready
        var = squares / len(kept) if population else squares / max(len(kept) - 1, 1)
        return mean, var, 1.0 if ready else math.sqrt(s.warmup / self.length), ready

    def _kept(self) -> list[float]:
        """The values the history stands on, gross outliers left out."""
        values = self.taken[-min(self.length, self.rows) :]
        ordered = sorted(values)
        lower, median, upper = (ordered[(len(values) - 1) * i // 4] for i in (1, 2, 3))
        spread = (upper - lower) / IQR_TO_SIGMA
        if len(values) < FIRST or spread == 0:
            return values
        reach = BAND * self.s.skip_sigma * spread
        self.margins += [abs(abs(x - median) - reach) / reach for x in values]
        return [x for x in values if abs(x - median) <= reach]

    def _enter(self, value: float, z: float, moments: tuple | None) -> None:
        a = self.s.alpha
        if self.s.history == "ema" and moments is not None and moments[3]:
            self.mean = a * moments[0] + (1 - a) * value
            self.var = a * moments[1] + (1 - a) * (value - self.mean) ** 2
        self.taken.append(value)
        self.length = min(self.length + 1, self.rows + 1)
        self.below = self.below + 1 if z < 0 else 0  # NaN: not below
        if self.below >= FALL:
            self.length, self.below = min(self.length, FALL, self.rows), 0


class _Run:
    """One parameter whose gradient is set to each norm in turn, stepped through a scaler."""

    def __init__(self, policy: SpikePolicy, fused: bool = False, scaled: bool = True) -> None:
        self.policy = policy
        self.param = nn.Parameter(torch.zeros(1))
        self.optimizer = torch.optim.SGD([self.param], lr=1.0, fused=fused or None)
        self.scaler = GradScaler("cpu", scaling=False, spikes=policy) if scaled else None

    def step(self, norm: float, max_norm: float | None = None, loss: float | None = None):
        self.param.grad = torch.tensor([norm], dtype=torch.float32)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        total = self.policy.clip_grad_norm_([self.param], max_norm, loss=loss)
        clipped = self.param.grad.clone()
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        return total, clipped


SETTINGS = {
    "zclip zscore": (dict(skip=False, adaptive_clip="zscore"), None),
    "zclip mean, ceiling": (dict(skip=False, adaptive_clip="mean"), 2.5),
    "ema skip": (dict(skip_sigma=4.0, warmup=10), None),
    "ema skip + zscore clip": (dict(skip_sigma=5.0, adaptive_clip="zscore"), 3.0),
    "window skip": (dict(history="window", window=32, skip_sigma=4.0), None),
    "window + fixed skip": (dict(history="window", window=16, warmup=4, skip_above=20.0), None),
    "window defaults": (dict(history="window"), None),
}


@pytest.mark.parametrize("name", SETTINGS)
def test_decisions_and_thresholds_match_the_published_formulas_in_float64(name):
    arguments, ceiling = SETTINGS[name]
    policy = SpikePolicy(**arguments)
    oracle = _Oracle(policy, ceiling)
    run = _Run(policy, scaled=policy.skips)
    decided = []
    for norm in _norms():
        spike, bound = oracle.step(norm)
        total, clipped = run.step(norm, ceiling)
        figures = policy.metrics()
        assert float(total) == float(torch.tensor(norm, dtype=torch.float32))
        assert bool(figures["spike"]) is spike
        assert float(figures["clip_bound"]) == pytest.approx(bound, rel=RTOL)
        expected = float(torch.tensor(norm, dtype=torch.float32)) * min(bound / (norm + 1e-6), 1)
        assert float(clipped) == pytest.approx(expected, rel=RTOL)
        decided.append(spike)
    limits = [policy.settings.skip_sigma, policy.settings.clip_z]
    assert all(abs(z - limit) > MARGIN * limit for z in oracle.zs for limit in limits)
    assert all(abs(z) > MARGIN for z in oracle.zs) and all(m > MARGIN for m in oracle.margins)
    assert policy.skipped_spikes == sum(decided)
    if policy.skips:
        assert run.scaler is not None and run.scaler.skipped_steps == sum(decided)
    assert any(decided) == policy.skips  # the planted spikes are caught where the policy skips


def test_a_skipped_spike_leaves_the_weights_and_warns_on_rank_0(caplog):
    run = _Run(SpikePolicy(warmup=5), fused=True)  # fused: the skip taken on the device
    for norm in [1.0, 1.1, 0.9, 1.0, 1.05, 0.95]:
        run.step(norm)
    before = run.param.detach().clone()
    with caplog.at_level(logging.WARNING, logger="credit.parallel.spikes"):
        run.step(100.0)
    assert torch.equal(run.param.detach(), before)
    assert run.scaler is not None and run.scaler.last_step_skipped
    assert caplog.messages == []  # a fused optimizer's skip reads nothing back, so no report
    run = _Run(SpikePolicy(warmup=5))
    for norm in [1.0, 1.1, 0.9, 1.0, 1.05, 0.95]:
        run.step(norm, loss=norm)
    with caplog.at_level(logging.WARNING, logger="credit.parallel.spikes"):
        run.step(100.0, loss=3.0)
    (message,) = caplog.messages
    assert message.startswith(
        "SpikePolicy skipped the 7th step it saw as a spike: gradient norm 100"
    )
    assert "; loss 3 (z-score " in message


def test_state_dict_resumes_with_the_decisions_of_a_straight_run():
    arguments = dict(adaptive_clip="zscore")
    straight, first = _Run(SpikePolicy(**arguments)), _Run(SpikePolicy(**arguments))
    norms = _norms(80, spikes=(30, 60))
    for norm in norms[:40]:
        straight.step(norm, loss=norm / 2)
        first.step(norm, loss=norm / 2)
    saved = first.policy.state_dict()
    resumed = _Run(SpikePolicy(**arguments))
    resumed.policy.load_state_dict(saved)
    for norm in norms[40:]:
        straight.step(norm, loss=norm / 2)
        resumed.step(norm, loss=norm / 2)
        assert _same_figures(straight.policy.metrics(), resumed.policy.metrics())
    assert straight.policy.skipped_spikes == resumed.policy.skipped_spikes == 2  # 30 and 60
    with pytest.raises(
        ValueError,
        match=re.escape("saved with {'history': 'ema', 'warmup': 25} and is loaded into a policy"),
    ):
        SpikePolicy(history="window", window=64).load_state_dict(saved)


def test_two_policies_never_touch_each_other():
    arguments = dict(adaptive_clip="zscore")
    alone = [_Run(SpikePolicy(**arguments)) for _ in range(2)]
    together = [_Run(SpikePolicy(**arguments)) for _ in range(2)]
    for step, norm in enumerate(_norms(40, spikes=(30,))):
        norms = (norm, norm * (3.0 if step % 3 else 2.0) / (30.0 if step == 30 else 1.0))
        for run, value in zip(alone, norms, strict=True):
            run.step(value)
        # Interleaved within the step: both unscale, both clip, both step, both update.
        for run, value in zip(together, norms, strict=True):
            run.param.grad = torch.tensor([value])
            run.scaler.unscale_(run.optimizer)  # type: ignore[union-attr]
        for run in together:
            run.policy.clip_grad_norm_([run.param])
        for run in together:
            run.scaler.step(run.optimizer)  # type: ignore[union-attr]
        for run in together:
            run.scaler.update()  # type: ignore[union-attr]
        for a, b in zip(alone, together, strict=True):
            assert _same_figures(a.policy.metrics(), b.policy.metrics())
            assert torch.equal(a.param, b.param)
    assert [r.policy.skipped_spikes for r in together] == [r.policy.skipped_spikes for r in alone]
    assert together[0].policy.skipped_spikes == 1 and together[1].policy.skipped_spikes == 0


@pytest.mark.parametrize(
    "arguments, error, match",
    [
        (dict(skip_sigma=-1.0), ValueError, "skip_sigma must be a finite number > 0"),
        (dict(skip_above=0.0), ValueError, "skip_above must be a finite number > 0"),
        (dict(clip_z=math.inf), ValueError, "clip_z must be finite"),
        (dict(alpha=math.nan), ValueError, "alpha must be finite"),
        (dict(alpha=1.0), ValueError, r"alpha must be in \(0, 1\)"),
        (dict(history="window", window=0), ValueError, "window must be at least 2"),
        (dict(window=2.5), TypeError, "window must be an int"),
        (dict(warmup=0), ValueError, "warmup must be at least 1"),
        (dict(history="window", window=8, warmup=9), ValueError, r"warmup \(9\) must not exceed"),
        (dict(history="median"), ValueError, "history must be one of 'ema', 'window'"),
        (dict(adaptive_clip="value"), ValueError, "adaptive_clip must be one of"),
        (dict(skip=1), TypeError, "skip must be a bool"),
        (dict(eps=-1e-6), ValueError, "eps must be a finite number >= 0"),
        (dict(restart_after=0), ValueError, "restart_after must be at least 1"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(arguments, error, match):
    with pytest.raises(error, match=match):
        SpikePolicy(**arguments)


def test_bad_calls_raise_before_any_gradient_is_modified():
    param = nn.Parameter(torch.zeros(3))
    param.grad = torch.full((3,), 5.0)
    with pytest.raises(RuntimeError, match=r"GradScaler\(..., spikes=policy\)"):
        SpikePolicy().clip_grad_norm_([param], 1.0)
    policy = SpikePolicy(skip=False, adaptive_clip="zscore")
    with pytest.raises(TypeError, match="max_norm must be a number"):
        policy.clip_grad_norm_([param], torch.tensor(1.0))
    with pytest.raises(ValueError, match="loss must hold one element"):
        policy.clip_grad_norm_([param], 1.0, loss=torch.ones(2))
    with pytest.raises(TypeError, match="loss must be a tensor of one element or a number"):
        policy.clip_grad_norm_([param], 1.0, loss="1.0")
    assert torch.equal(param.grad, torch.full((3,), 5.0)) and policy.metrics() == {}
    other = nn.Parameter(torch.ones(1))
    other.grad = torch.ones(1)
    policy.clip_grad_norm_([other], loss=1.0)
    with pytest.raises(ValueError, match="no rank gave a loss, though this policy's first step"):
        policy.clip_grad_norm_([param], 1.0)
    assert torch.equal(param.grad, torch.full((3,), 5.0))
    run = _Run(SpikePolicy())
    run.step(1.0)
    run.scaler.unscale_(run.optimizer)  # type: ignore[union-attr]
    run.policy.clip_grad_norm_([run.param])
    with pytest.raises(RuntimeError, match="call it after update"):
        run.policy.state_dict()
    run.scaler.step(run.optimizer)  # type: ignore[union-attr]
    run.scaler.update()  # type: ignore[union-attr]  (its flags stop listening to the norms)
    with pytest.raises(ValueError, match=r"enabled=False\) steps every optimizer"):
        GradScaler("cpu", enabled=False, spikes=SpikePolicy())
    with pytest.raises(ValueError, match="already held by another GradScaler"):
        GradScaler("cpu", scaling=False, spikes=run.policy)
    with pytest.raises(TypeError, match="spikes must be a SpikePolicy"):
        GradScaler("cpu", scaling=False, spikes=object())


def test_a_spike_keeps_the_fp16_scale_and_a_non_finite_step_enters_no_history():
    policy = SpikePolicy(warmup=4)
    param = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    scaler = GradScaler("cpu", init_scale=8.0, growth_interval=1000, spikes=policy)
    scales, counts, moments = [], [], []
    for norm in [1.0, 1.2, 0.8, 1.1, 0.9, 1e3, math.inf, math.nan, 1.0, 1e3, 1.05]:
        scaler.scale(torch.ones(()))
        param.grad = torch.tensor([norm * scaler.get_scale()])
        scaler.unscale_(optimizer)
        policy.clip_grad_norm_([param], loss=norm)
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
        statistics = policy.state_dict()["statistics"]
        counts.append(int(statistics["count"]))
        moments.append(torch.cat([statistics["mean"], statistics["var"]]))
    # The spikes keep the scale; the inf and the NaN back it off.
    assert scales == [8.0] * 6 + [4.0, 2.0, 2.0, 2.0, 2.0]
    assert counts == [1, 2, 3, 4, 5, 5, 5, 5, 6, 6, 7]  # no spike, inf or NaN entered
    assert torch.equal(moments[5], moments[7]) and torch.isfinite(moments[7]).all()
    assert (policy.skipped_spikes, policy.skipped_non_finite, scaler.skipped_steps) == (2, 2, 4)


@pytest.mark.parametrize("restart_after", [4, None])
def test_a_new_level_restarts_the_histories_instead_of_skipping_every_step(restart_after):
    run = _Run(SpikePolicy(warmup=5, restart_after=restart_after))
    level = [1.0, 1.1, 0.9, 1.05, 0.95, 1.0, 1.02, 0.98]
    skipped = []
    for norm in level + [10 * n for n in level * 3]:  # the norm jumps to a new level and stays
        run.step(norm)
        skipped.append(run.scaler.last_step_skipped)  # type: ignore[union-attr]
    if restart_after is None:
        assert skipped == [False] * 8 + [True] * 24 and run.policy.restarts == 0
    else:  # 4 skipped, then a new warm-up of 5 at the new level, whose steps are taken
        assert skipped == [False] * 8 + [True] * 4 + [False] * 20
        assert (run.policy.restarts, run.policy.skipped_spikes) == (1, 4)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")  # torch 2.10's checkpoint
def test_a_distributed_checkpoint_resumes_the_histories_a_fresh_policy_lacks(tmp_path):
    arguments = dict(adaptive_clip="zscore")
    straight, first = _Run(SpikePolicy(**arguments)), _Run(SpikePolicy(**arguments))
    norms = _norms(80, spikes=(30, 60))
    for norm in norms[:40]:
        for run in (straight, first):
            run.step(norm, loss=norm / 2)
    dcp.save({"spikes": first.policy}, checkpoint_id=tmp_path, no_dist=True)
    resumed = _Run(SpikePolicy(**arguments))  # has seen no loss: its state dict's template
    dcp.load({"spikes": resumed.policy}, checkpoint_id=tmp_path, no_dist=True)
    for norm in norms[40:]:
        for run in (straight, resumed):
            run.step(norm, loss=norm / 2)
        assert _same_figures(straight.policy.metrics(), resumed.policy.metrics())
    assert resumed.policy.skipped_spikes == 2


# --- the scaler's contract with the policy ----------------------------------------------------

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "credit" / "parallel"
SCALER_SIDE = ("amp.py", "_scaler/spike_policies.py", "_scaler/found_inf.py")
TORCH_INTERNALS = frozenset({"_values", "_amp_foreach_non_finite_check_and_unscale_"})


def _reached_underscores(path: Path) -> list[str]:
    """The underscore members ``path`` reads on anything but ``self`` and torch's internals."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")):
            continue
        if node.attr.startswith("__") or node.attr in TORCH_INTERNALS:
            continue
        if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def _attributes(path: Path) -> set[str]:
    return {n.attr for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Attribute)}


def _members(protocol: type) -> set[str]:
    return {name for name in vars(protocol) if not name.startswith("_")}


def test_the_scaler_reaches_a_policy_through_its_protocols_only():
    policy = SpikePolicy()
    assert isinstance(policy, _scaler.HeldPolicy)
    scaler = GradScaler("cpu", scaling=False, spikes=policy)
    link = policy.attach_scaler(scaler, unscale_first=False)  # the link the scaler holds
    assert isinstance(link, _scaler.PolicyLink) and policy.scaler is scaler
    assert _members(_scaler.HeldPolicy) == {"attach_scaler"}
    assert _members(_scaler.PolicyLink) == {
        "gradients_unscaled",
        "skip_flag",
        "report_spike",
        "end_step",
    }
    # The scaler's modules read no underscore member of anything but themselves, and what the
    # module holding the policies reads of a policy or its link is a protocol's member.
    for name in SCALER_SIDE:
        assert _reached_underscores(PACKAGE / name) == []
    policy_side = {name for name in dir(policy) + dir(link) if not name.startswith("_")}
    contract = _members(_scaler.HeldPolicy) | _members(_scaler.PolicyLink)
    assert _attributes(PACKAGE / "_scaler" / "spike_policies.py") & policy_side <= contract


def test_reading_a_policy_changes_nothing():
    """Its properties, metrics and state only read: a policy without a scaler enters each step at
    its clip, so a policy whose counts were read and one left alone go on alike, under a scaler
    given to them later too."""
    read, alone = (SpikePolicy(skip=False, adaptive_clip="zscore", warmup=2) for _ in range(2))
    params = [nn.Parameter(torch.zeros(1)) for _ in range(2)]
    for step, norm in enumerate([1.0, 1.1, math.nan, 0.9, 1.0, 40.0]):
        for policy, param in zip((read, alone), params, strict=True):
            param.grad = torch.tensor([norm])
            policy.clip_grad_norm_([param])
        before = dict(vars(read))
        counts = (read.skipped_spikes, read.skipped_non_finite, read.restarts)
        assert (read.scaler, read.skips) == (None, False)
        read.metrics()
        read.state_dict()
        assert vars(read).keys() == before.keys()
        assert all(vars(read)[key] is value for key, value in before.items())
        assert counts == (0, int(step >= 2), 0)  # the NaN step counted at its own clip
    runs = [_Run(policy) for policy in (read, alone)]
    for run in runs:
        run.step(1.05)  # the step before stands entered: a clip under the scaler is allowed
    assert _same_figures(runs[0].policy.metrics(), runs[1].policy.metrics())
    saved = [run.policy.state_dict() for run in runs]
    assert torch.equal(saved[0]["statistics"]["mean"], saved[1]["statistics"]["mean"])
    assert saved[0]["counts"].tolist() == saved[1]["counts"].tolist() == [1, 0, 0]


class _Ops(TorchDispatchMode):
    """How many times each aten op ran."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("fused", [False, True])
def test_the_step_answer_is_made_once_a_step(fused):
    """The world's non-finite answer and the policy's spike flag are combined once per optimizer
    and step (one maximum: unscale_ made the local check), taken or skipped, and read by
    ``step``, the optimizer's step and the skipped spike's report alike."""
    policy = SpikePolicy(warmup=5)
    param = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0, fused=fused or None)
    scaler = GradScaler("cpu", init_scale=4.0, growth_interval=1000, spikes=policy)
    for norm in [1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 100.0]:
        scaler.scale(torch.ones(()))
        param.grad = torch.tensor([norm * scaler.get_scale()])
        scaler.unscale_(optimizer)
        policy.clip_grad_norm_([param])
        before = param.detach().clone()
        with _Ops() as ops:
            scaler.step(optimizer)
        scaler.update()
        assert ops.counts["aten.maximum"] == 1
        assert torch.equal(param.detach(), before) is (norm == 100.0)
    assert (policy.skipped_spikes, scaler.skipped_steps, scaler.get_scale()) == (1, 1, 4.0)
