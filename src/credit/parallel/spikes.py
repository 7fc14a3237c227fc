"""Gradient spikes handled by the world: a skipped step and an adaptive clip, decided alike on
every rank, with no host read.

A :class:`SpikePolicy` takes the place of the clip in a trainer's step. Its
:meth:`~SpikePolicy.clip_grad_norm_` takes this package's norm (the same bits on every rank, on
any mix of meshes), reads it against the norm's recent history, clips, and leaves the decision
to take or skip the step to the :class:`~credit.parallel.amp.GradScaler` it was given to::

    spikes = SpikePolicy()                                # skip at z > 6 over an EMA
    scaler = GradScaler("cuda", scaling=False, spikes=spikes)  # bf16; scaling=True for fp16
    for batch in loader:
        loss = model(batch)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        spikes.clip_grad_norm_(model.parameters(), max_norm=1.0, loss=loss)
        scaler.step(optimizer)                            # skipped on every rank on a spike
        scaler.update()
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from credit.parallel import _norm, _scaler, _spikes
from credit.parallel._common import inputs as _inputs
from credit.parallel._common.groups import GroupLike, collective_device
from credit.parallel._common.inputs import DistinctAlong, TensorOrTensors

__all__ = ["SpikePolicy"]


class SpikePolicy:
    """Skip gradient spikes, and clip to a threshold that follows the norm's history.

    Each step's total gradient norm (and loss, when given) is compared with its history: an
    exponential moving average of its mean and variance (``history="ema"``, ZClip's, with
    ``alpha``) or the mean and standard deviation of the last ``window`` values
    (``history="window"``, OLMo-core's). Two modes, which combine:

    - **skip** (on by default): a step whose norm, or loss, lies more than ``skip_sigma``
      standard deviations above the mean, or whose norm exceeds ``skip_above`` (Megatron-LM's
      fixed threshold), is skipped on every rank by the ``GradScaler`` the policy was given to.
    - **adaptive clip** (``adaptive_clip="zscore"`` or ``"mean"``): a norm more than ``clip_z``
      standard deviations above the mean is clipped to ``mean + clip_z**2 * std / z`` (ZClip's
      "adaptive_scaling") or to the mean, under the fixed ``max_norm`` of the call if one is given.

    Every statistic is a function of values that are the same bits on every rank (this package's
    norm, the loss averaged over the ranks that give one), so every rank takes the same decision
    without a collective of its own, and on a GPU nothing is read back to the host after the
    first step: the decision reaches a fused optimizer on the device, as the scaler's non-finite
    skip does. A step skipped as a spike or for a NaN or inf, and a step during which a value is
    not finite, enters no history. Past the published formulas, so that a spike inside the
    warm-up or early training's fast fall does not blind them: a value further than twice
    ``skip_sigma`` robust standard deviations from the median is left out of the histories'
    statistics; from 8 values on, the warm-up skips gross outliers (its band widened by
    ``sqrt(warmup / n)`` with ``n`` values in); and 16 values in a row below the mean start a
    history over from them. A norm (or loss) that stays out for ``restart_after`` spikes in a
    row has found a new level, not a spike: the history then starts over, with a new warm-up,
    rather than skip every step from then on. A spike is not an overflow: the fp16 loss scale
    stays as it is (its growth interval counts the step, whose gradients were finite).

    Defaults and their sources: ``skip_sigma=6`` and ``window=128`` (OLMo-core's skipped steps),
    ``alpha=0.97``, ``clip_z=2.5`` and a warm-up of 25 steps for the moving average (ZClip, Kumar
    et al. 2025); the window decides on its ``window // 2``-th value, as OLMo-core's.

    Args:
        skip: skip the steps whose norm or loss z-score exceeds ``skip_sigma``. Default: True.
        skip_sigma: the z-score above which a step is skipped. Default: 6.
        skip_above: also skip every step whose norm exceeds this number, or None.
        adaptive_clip: ``"zscore"``, ``"mean"`` or None (no adaptive clip). Default: None.
        clip_z: the z-score above which the adaptive clip clips. Default: 2.5.
        history: ``"ema"`` or ``"window"``. Default: ``"ema"``.
        alpha: the moving average's decay, in (0, 1). Default: 0.97.
        window: how many past values the window keeps, at least 2. Default: 128.
        warmup: how many values enter a history before its published statistics decide.
            Default: 25 (``"ema"``), or ``window // 2 - 1`` and at least 2 (``"window"``: 63).
        eps: added to the standard deviation in every z-score. Default: 1e-6.
        restart_after: how many spikes in a row start the histories over (None: never).
            Default: 16.

    Raises:
        TypeError, ValueError: an argument has the wrong type or is out of its range (a negative
            threshold, a window of 0, a non-finite alpha), naming it.
    """

    def __init__(
        self,
        *,
        skip: bool = True,
        skip_sigma: float = 6.0,
        skip_above: float | None = None,
        adaptive_clip: str | None = None,
        clip_z: float = 2.5,
        history: str = "ema",
        alpha: float = 0.97,
        window: int = 128,
        warmup: int | None = None,
        eps: float = 1e-6,
        restart_after: int | None = 16,
    ) -> None:
        self.settings = _spikes.checked_settings(
            skip,
            skip_sigma,
            skip_above,
            adaptive_clip,
            clip_z,
            history,
            alpha,
            window,
            warmup,
            eps,
            restart_after,
        )
        self._state: _spikes.SpikeState | None = None  # after the last entered step
        self._last: _spikes.Decision | None = None  # the last step's, for metrics()
        self._link: _ScalerLink | None = None  # the holding scaler's side of the step

    @property
    def scaler(self) -> object | None:
        """The :class:`~credit.parallel.amp.GradScaler` holding this policy (which skips the steps
        it decides are spikes), or None."""
        return None if self._link is None else self._link.scaler

    @property
    def skips(self) -> bool:
        """Whether the policy may skip a step (a z-score skip or ``skip_above``)."""
        return self.settings.skip or self.settings.skip_above is not None

    @torch.no_grad()
    def clip_grad_norm_(
        self,
        parameters: TensorOrTensors | nn.Module | Iterable[tuple[str, Tensor]],
        max_norm: float | None = None,
        norm_type: float | str = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
        *,
        loss: Tensor | float | None = None,
        pp_group: GroupLike = None,
        distinct_along: DistinctAlong | None = None,
        dtype: torch.dtype | None = None,
        check: bool | None = None,
        groups: Mapping[str, float] | None = None,
    ) -> Tensor:
        """Take the step's norm, decide on it, and clip: in place of
        :func:`credit.parallel.collectives.clip_grad_norm_`, once per optimizer step, on every
        rank, after ``scaler.unscale_`` and before ``scaler.step``.

        The norm is :func:`~credit.parallel.collectives.clip_grad_norm_`'s, in its one
        collective (which also answers the scaler's non-finite check); a ``loss`` adds one small
        all_reduce before it (its average over the ranks that give one: riding on the norm's
        collective would move the norm's bits), which every rank sends at the policy's first
        step, loss or not, and reads on the host. The gradients are then scaled by
        ``min(bound / (norm + 1e-6), 1)``, where the bound is ``max_norm``, the adaptive
        threshold, or the lower of the two; with neither, nothing is clipped. After the first
        step nothing is read back to the host (on the CPU, the loss's all_reduce is read: it
        costs no sync there).

        Args:
            parameters: as for :func:`~credit.parallel.collectives.clip_grad_norm_`.
            max_norm: a fixed bound of the clip (a number > 0), or None for none.
            norm_type, error_if_nonfinite, foreach, pp_group, distinct_along, dtype, check: as for
                :func:`~credit.parallel.collectives.clip_grad_norm_`.
            loss: this rank's loss (a tensor of one element, or a number), or None where the rank
                has none (pipeline stages before the last): the losses given are averaged over
                the ranks that gave them, and tested as the norm is. Whether the steps give a
                loss is decided by the world at the policy's first step: a loss first given later
                is ignored, with a warning. A NaN or inf loss skips the step (counted in
                ``skipped_non_finite``).
            groups: the step's :func:`~credit.parallel.norm_report.grad_norm_report`, whose
                largest groups the report of a skipped spike names.

        Call it once per optimizer step, after ``scaler.unscale_`` (with fp16's scaling, a call
        before it raises): a second call before the scaler's ``update()`` raises, and the
        step's first decision stands.

        Returns:
            The total norm of the gradients before clipping, as the clip returns it.

        Raises:
            TypeError, ValueError, RuntimeError: as
                :func:`~credit.parallel.collectives.clip_grad_norm_`; ``max_norm`` is not a
                number, or 0 (TypeError, ValueError); ``groups`` is not a mapping of names to
                numbers (TypeError); the policy skips steps and no ``GradScaler`` holds it, its
                scaler scales and has not unscaled the gradients, or the step was clipped
                already (RuntimeError). Each is raised before any collective. And alike on every
                rank, where the loss's all_reduce is read (the first step, or on the CPU): a
                rank's ``loss`` is not one real number (ValueError, TypeError, naming the
                ranks), or no rank gives a loss after a first step that had one (ValueError).
                No gradient is modified.
        """
        ceiling = _ceiling(max_norm)
        _check_groups(groups)
        self._begin_step()
        options = _norm.NormOptions(
            norm_type=norm_type,
            error_if_nonfinite=error_if_nonfinite,
            foreach=foreach,
            pp_group=pp_group,
            distinct_along=distinct_along,
            dtype=dtype,
            check=check,
        )
        request = _norm.parameters_request(parameters, options, "SpikePolicy.clip_grad_norm_")
        device = collective_device(request.local)
        state = self._state_on(device)
        world_loss = _spikes.world_loss(loss, state.with_loss, device)
        reduced = _norm.reduce(request)
        total = reduced.total
        state = state.on(total.device)
        observed = _spikes.Observed(
            _observed_values(total, world_loss), world_loss.read, ceiling, groups, state.steps + 1
        )
        decision = _spikes.decide(self.settings, state.history, observed)
        if decision.bound is not None:
            bound = _inputs.clip_bound(decision.bound)
            _norm.scale_(reduced.local, reduced.stacking, total, bound, foreach)
        self._state = replace(state, steps=observed.step, with_loss=world_loss.read)
        self._last = decision
        if self._link is None:
            self._enter(decision, None)  # without a scaler, nothing but the clip ends the step
        else:
            self._link.pending = decision  # entered at the scaler's update()
        return total

    # --- what the trainer may read ---------------------------------------------------------

    def metrics(self) -> dict[str, Tensor]:
        """The last step's figures, as device scalars (no host read): ``norm``, ``norm_z``,
        ``skip_limit`` (the norm above which it would have been skipped), ``clip_bound`` (the
        clip's ``max_norm``, inf for none), ``spike`` (1.0 when it was decided a spike), and
        ``loss`` and ``loss_z`` where a loss was given. The z-scores are NaN until the history
        decides (8 values in; during the warm-up they are taken against its widened band).
        Empty before the first step."""
        decision = self._last
        if decision is None:
            return {}
        observed = decision.observed
        bound = decision.bound if decision.bound is not None else float("inf")
        figures = {
            "norm": observed.norm,
            "norm_z": decision.z[0],
            "skip_limit": decision.skip_limit(self.settings),
            "clip_bound": torch.as_tensor(bound, dtype=torch.float32, device=observed.norm.device),
            "spike": decision.spike.float(),
        }
        if observed.with_loss:
            figures.update(loss=observed.values[1], loss_z=decision.z[1])
        return figures

    @property
    def skipped_spikes(self) -> int:
        """How many steps were skipped as spikes (reads the device)."""
        return self._skipped(_spikes.SPIKE)

    @property
    def skipped_non_finite(self) -> int:
        """How many steps seen by the policy were skipped for a NaN or inf (reads the device)."""
        return self._skipped(_spikes.NON_FINITE)

    @property
    def restarts(self) -> int:
        """How many times ``restart_after`` spikes in a row started the histories over (reads
        the device)."""
        return self._skipped(_spikes.RESTARTS)

    # --- checkpoints -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The histories and counts (CPU tensors and numbers, the same on every rank), and the
        settings they only fit; a stateful object of ``torch.distributed.checkpoint``. Call it
        after the scaler's ``update()``.

        Raises:
            RuntimeError: a step is still undecided (called between the clip and ``update()``).
        """
        if self._link is not None and self._link.pending is not None:
            raise RuntimeError(
                "SpikePolicy.state_dict() was called between clip_grad_norm_ and the "
                "GradScaler's update(): call it after update(), so the step is in the state"
            )
        state = self._state or _spikes.initial(self.settings, torch.device("cpu"))
        return _spikes.state_dict(self.settings, state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from a state of :meth:`state_dict`: the decisions of a run resumed at step k are
        those of the run that went straight through, given the same norms. (Under DDP, the first
        step after a restart sums the gradients in another bucket order, as DDP rebuilds its
        buckets after its first iteration: its norm may differ from the straight run's by a few
        ULPs.)

        Raises:
            ValueError: the state was saved under another ``history``, ``window`` or ``warmup``,
                or an entry is missing.
        """
        self._state = _spikes.loaded(self.settings, state_dict)
        self._last = None
        if self._link is not None:
            self._link.pending = None

    # --- the GradScaler's side -------------------------------------------------------------

    def attach_scaler(self, scaler: object, *, unscale_first: bool) -> _scaler.PolicyLink:
        """Be held by ``scaler``: the :class:`~credit.parallel.amp.GradScaler` built with
        ``spikes=policy`` calls it once, and from then on takes the steps' decisions through the
        link returned (the scaler's contract with a policy). A trainer does not call it.

        Args:
            scaler: the scaler holding the policy.
            unscale_first: whether the scaler scales the loss: the clip then raises when it
                comes before ``scaler.unscale_``.

        Returns:
            The policy's side of each step: whether it skips the step, the report of a skipped
            spike, and the step's end, when the world's non-finite answer is known.

        Raises:
            ValueError: another scaler holds the policy already.
        """
        if self._link is not None and self._link.scaler is not scaler:
            raise ValueError("this SpikePolicy is already held by another GradScaler")
        if self._link is None:
            self._link = _ScalerLink(scaler, self.settings, self._enter)
        self._link.unscale_first = unscale_first
        return self._link

    def _enter(self, decision: _spikes.Decision, non_finite: Tensor | None) -> None:
        """Enter the step of ``decision``, which the world's ``non_finite`` answer (None without
        a scaler) skipped or not, into the state."""
        assert self._state is not None  # the clip that decided set it
        self._state = _spikes.after_step(self.settings, self._state, decision, non_finite)

    # --- helpers ---------------------------------------------------------------------------

    def _begin_step(self) -> None:
        """Refuse a call the step's sequence does not allow, before any collective."""
        link = self._link
        if link is None:
            if self.skips:
                raise RuntimeError(
                    "a SpikePolicy that skips steps decides for a GradScaler: build it with "
                    "GradScaler(..., spikes=policy) (scaling=False for bf16 or float32), or "
                    "pass skip=False and no skip_above for an adaptive clip alone"
                )
            return
        if link.pending is not None:
            raise RuntimeError(
                "SpikePolicy.clip_grad_norm_ was called twice in one step (since the "
                "GradScaler's last update()): the policy decides once a step, on the norm of "
                "every gradient the step updates. Clip all of them in one call, give each "
                "optimizer clipped apart its own policy (GradScaler(spikes={optimizer: "
                "policy})), and call scaler.update() after every step. No gradient was modified."
            )
        if link.unscale_first and not link.unscaled:
            raise RuntimeError(
                "SpikePolicy.clip_grad_norm_ came before scaler.unscale_(optimizer): the "
                "gradients still carry the loss scale, so the policy would read (and keep in its "
                "history) the norm multiplied by it. Call scaler.unscale_(optimizer) for every "
                "optimizer whose gradients the clip covers, then the policy's clip. No gradient "
                "was modified."
            )

    def _state_on(self, device: torch.device) -> _spikes.SpikeState:
        if self._state is None:
            return _spikes.initial(self.settings, device)
        return self._state.on(device)

    def _skipped(self, count: int) -> int:
        return 0 if self._state is None else int(self._state.counts[count].item())


class _ScalerLink:
    """A policy's side of the steps of the GradScaler holding it (``_scaler.PolicyLink``): the
    step decided and not yet entered, and whether the scaler unscaled its gradients.

    Attributes:
        scaler: the scaler holding the policy.
        unscale_first: whether the scaler scales: the clip waits for ``unscale_``.
        unscaled: whether the scaler unscaled this step's gradients.
        pending: the decision of the step the clip took, until the scaler's ``update``.
    """

    def __init__(
        self,
        scaler: object,
        settings: _spikes.SpikeSettings,
        enter: Callable[[_spikes.Decision, Tensor | None], None],
    ) -> None:
        self.scaler = scaler
        self.unscale_first = False
        self.unscaled = False
        self.pending: _spikes.Decision | None = None
        self._settings = settings
        self._enter = enter

    def gradients_unscaled(self) -> None:
        """The scaler unscaled the gradients of this step (all of this policy's optimizers)."""
        self.unscaled = True

    def skip_flag(self) -> Tensor | None:
        """1.0 when the undecided step is skipped (a spike, or a norm or loss that is not
        finite), 0.0 when not; None without one."""
        return None if self.pending is None else self.pending.skip

    def report_spike(self) -> None:
        """Warn on rank 0 of the undecided step's spike, which the scaler skipped."""
        if self.pending is not None:
            _spikes.report_spike(self._settings, self.pending)

    def end_step(self, non_finite: Tensor | None) -> None:
        """End the step: enter the undecided one, which the world's ``non_finite`` answer
        skipped or not."""
        self.unscaled = False
        if self.pending is not None:
            self._enter(self.pending, non_finite)
            self.pending = None


def _ceiling(max_norm: object) -> float | None:
    if max_norm is None:
        return None
    if isinstance(max_norm, Tensor):
        raise TypeError("SpikePolicy's max_norm must be a number (or None), got a tensor")
    bound = _inputs.clip_bound(max_norm)
    assert isinstance(bound, float)
    if bound == 0.0:
        raise ValueError(
            "SpikePolicy's max_norm=0 would zero every gradient: pass max_norm=None for no "
            "fixed bound (a config's 0.0, as CREDIT's grad_max_norm, means no clipping)"
        )
    return bound


def _check_groups(groups: object) -> None:
    """``groups`` is None or a ``grad_norm_report``: names to numbers (the same on every rank,
    so every rank raises alike, before any collective)."""
    if groups is None:
        return
    if isinstance(groups, Mapping) and all(
        isinstance(name, str) and isinstance(norm, numbers.Real) and not isinstance(norm, bool)
        for name, norm in groups.items()
    ):
        return
    raise TypeError(
        "groups must be the step's grad_norm_report, a mapping of group names to numbers, "
        f"got {groups!r:.80}"
    )


def _observed_values(total: Tensor, loss: _spikes.WorldLoss) -> Tensor:
    """The norm and the loss averaged over the world (0 without one): a float32 pair on the
    norm's device."""
    norm = total.float()
    value = torch.zeros_like(norm) if loss.value is None else loss.value.to(norm.device)
    return torch.stack([norm, value])
