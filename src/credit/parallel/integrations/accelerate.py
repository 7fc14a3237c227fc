"""accelerate: ``accelerator.clip_grad_norm_`` with this package's norm.

accelerate 1.15's ``Accelerator.clip_grad_norm_`` groups gradients by mesh and is right on FSDP2
+ TP, but it takes the ranks outside a gradient's mesh for copies: on experts held per
expert-parallel rank (FSDP2 on a mesh beside the dense one) it returns a different norm on each
expert-parallel rank, and it has no way to declare them. It also unscales only where accelerate
made the scaler itself (fp16 on an accelerator device), so a scaler set by hand, such as
``credit.parallel.amp.GradScaler`` skipping non-finite bf16 steps, is never unscaled.
:func:`clip_grad_norm_` unscales through whatever scaler the accelerator holds, refuses
parameters that no prepared optimizer holds while a scaler is set (their gradients would stay
scaled), clips with :func:`credit.parallel.collectives.clip_grad_norm_` (or a
:class:`~credit.parallel.spikes.SpikePolicy`'s clip, whose skipped spikes the prepared optimizer
takes through the scaler), and on request hands the norm to ``accelerator.log``. This module does
not import accelerate.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch
from torch import Tensor, nn

from credit.parallel import _norm
from credit.parallel._common import inputs as _inputs
from credit.parallel._common.compat import unscaled_since_update
from credit.parallel._common.groups import GroupLike
from credit.parallel._common.inputs import DistinctAlong, TensorOrTensors
from credit.parallel.collectives import clip_grad_norm_ as _clip_grad_norm_
from credit.parallel.spikes import SpikePolicy

__all__ = ["clip_grad_norm_"]

# How many parameters outside every prepared optimizer the error names.
_NAMED = 3


def clip_grad_norm_(
    accelerator: Any,
    parameters: TensorOrTensors | nn.Module | Iterable[tuple[str, Tensor]],
    max_norm: float | Tensor | None,
    norm_type: float = 2.0,
    *,
    pp_group: GroupLike = None,
    distinct_along: DistinctAlong | None = None,
    check: bool | None = None,
    log_as: str | None = None,
    log_step: int | None = None,
    spikes: SpikePolicy | None = None,
    loss: Tensor | float | None = None,
) -> Tensor:
    """``accelerator.clip_grad_norm_(parameters, max_norm)`` on any mix of meshes.

    Unscales the gradients of every optimizer passed to ``accelerator.prepare`` through
    ``accelerator.scaler`` when one is set, then clips with
    :func:`credit.parallel.collectives.clip_grad_norm_`. Call it where accelerate's clip goes
    (under ``if accelerator.sync_gradients:``), instead of accelerate's. An optimizer already
    unscaled since the scaler's last ``update()`` (by ``accelerator.unscale_gradients()``, or by
    an earlier call that raised) is not unscaled again, and the arguments are checked before
    anything is unscaled, so a call that raised can be made again in the same step. Every rank
    must call it.

    Set this package's scaler before preparing the optimizer, so that the prepared optimizer's
    ``step()`` takes or skips the step on every rank together::

        accelerator.scaler = GradScaler("cuda")  # credit.parallel.amp; scaling=False for bf16
        optimizer = accelerator.prepare(optimizer)

    While a scaler is set, every parameter to clip that requires a gradient (or holds one) must
    belong to a prepared optimizer: only those are unscaled, and only their steps go through
    the scaler.

    With ``spikes``, the clip is the policy's
    (:meth:`~credit.parallel.spikes.SpikePolicy.clip_grad_norm_`, ``max_norm`` its fixed ceiling
    or None). A policy that skips steps decides for the scaler holding it, so it needs
    ``accelerator.scaler`` to be this package's ``GradScaler`` built with ``spikes=policy`` and set
    before the optimizer was prepared: the prepared optimizer's ``step()`` then skips the spikes
    on every rank (``optimizer.step_was_skipped``). An adaptive clip alone (``skip=False``) needs
    no scaler::

        spikes = SpikePolicy()  # credit.parallel.spikes
        accelerator.scaler = GradScaler("cuda", scaling=False, spikes=spikes)
        optimizer = accelerator.prepare(optimizer)
        ...
        clip_grad_norm_(accelerator, model, 1.0, spikes=spikes, loss=loss)

    With ``log_as``, the norm is also handed to ``accelerator.log`` as ``{log_as: norm}`` where
    ``accelerator.trackers`` is not empty (accelerate fills it on the main process only, in
    ``init_trackers``). ``accelerator.log`` takes Python numbers: that costs a host read of the
    norm on that process (on a GPU, a wait for the clip's kernels), and nothing on the others.
    Without ``log_as`` nothing is read or logged.

    Args:
        accelerator: the ``accelerate.Accelerator``.
        parameters: the parameters whose ``.grad`` is clipped in place, or the module (or its
            ``named_parameters()``), whose names the errors then use.
        max_norm: max norm of the gradients, in every form the clip takes.
        norm_type: p-norm exponent, a positive float or ``inf``. Default: 2.
        pp_group, distinct_along, check: see :func:`credit.parallel.collectives.total_grad_norm`
            (``distinct_along=[(experts.parameters(), ep_group)]`` for rank-local experts).
        log_as: the key under which ``accelerator.log`` records the norm (before clipping), such
            as ``"grad_norm"``. Default: None, not logged: accelerate's clip logs nothing and
            reads nothing, and a tracker that counts its own steps (wandb, without ``step``)
            would count each extra ``log`` call as a step.
        log_step: the ``step`` passed to ``accelerator.log`` (its default, None, lets each
            tracker count). Only with ``log_as``.
        spikes: the :class:`~credit.parallel.spikes.SpikePolicy` that clips, once per optimizer
            step, or None. Default: None.
        loss: this rank's loss, which ``spikes`` tests as it tests the norm; only with
            ``spikes``. Default: None.

    Returns:
        The total norm before clipping, a plain scalar tensor, the same on every rank.

    Raises:
        TypeError: ``accelerator`` is not an ``Accelerator`` (None, or the parameters passed
            first as to torch's clip), ``log_as`` is not a string or ``log_step`` not an int, or
            as :func:`credit.parallel.collectives.clip_grad_norm_`.
        ValueError: ``accelerator.scaler`` is set and no prepared optimizer holds a parameter
            to clip, ``log_as`` is empty, ``log_step`` is given without ``log_as``, ``loss``
            without ``spikes``, or ``spikes`` skips steps and ``accelerator.scaler`` (or the
            scaler a prepared optimizer holding a parameter to clip steps through) is not an
            enabled ``GradScaler`` holding it; or as
            :func:`credit.parallel.collectives.clip_grad_norm_`. Raised before any gradient is
            unscaled or clipped, and before any collective.
        RuntimeError: as :func:`credit.parallel.collectives.clip_grad_norm_` or
            :meth:`credit.parallel.spikes.SpikePolicy.clip_grad_norm_`.
    """
    scaler = _scaler_of(accelerator)
    _check_logging(log_as, log_step)
    params, names = _inputs.parameter_list(parameters)
    _check_bound(max_norm, spikes, loss)
    options = _norm.NormOptions(
        norm_type=norm_type,
        pp_group=pp_group,
        distinct_along=_reusable(distinct_along),
        check=check,
    )
    _check_norm(params, options)
    if spikes is not None and spikes.skips:
        _check_skipping(accelerator, scaler, spikes, params)
    if _is_enabled(scaler):
        _unscale_prepared(accelerator, scaler, params, names)
    named = params if names is None else list(zip(names, params, strict=True))
    norm = _clip(named, max_norm, options, spikes, loss)
    if log_as is not None:
        _log(accelerator, log_as, norm, log_step)
    return norm


def _check_norm(params: list[Tensor], options: _norm.NormOptions) -> None:
    """Check the gradients of ``params`` and the norm's options as the clip will check them
    (with no collective), before anything is unscaled.

    Raises:
        TypeError, ValueError: as :func:`credit.parallel.collectives.clip_grad_norm_`.
    """
    grads = [grad for p in params if (grad := p.grad) is not None]
    _inputs.check_grads(grads, "parameters")
    _norm.checked_options(grads, options)


def _clip(
    named: list[Tensor] | list[tuple[str, Tensor]],
    max_norm: float | Tensor | None,
    options: _norm.NormOptions,
    spikes: SpikePolicy | None,
    loss: Tensor | float | None,
) -> Tensor:
    """The clip, :func:`credit.parallel.collectives.clip_grad_norm_` or the policy's, on
    arguments checked by :func:`clip_grad_norm_`."""
    if spikes is None:
        return _clip_grad_norm_(
            named,
            cast("float | Tensor", max_norm),  # checked: None only with spikes
            options.norm_type,
            pp_group=options.pp_group,
            distinct_along=options.distinct_along,
            check=options.check,
        )
    return spikes.clip_grad_norm_(
        named,
        cast("float | None", max_norm),  # checked: no tensor with spikes
        options.norm_type,
        loss=loss,
        pp_group=options.pp_group,
        distinct_along=options.distinct_along,
        check=options.check,
    )


def _scaler_of(accelerator: Any) -> Any:
    """``accelerator.scaler`` (None when accelerate set none).

    Raises:
        TypeError: ``accelerator`` has no scaler and no prepared optimizers: not an Accelerator.
    """
    if not (hasattr(accelerator, "scaler") and hasattr(accelerator, "_optimizers")):
        raise TypeError(
            "accelerator must be the accelerate.Accelerator whose optimizer was prepared, got "
            f"{type(accelerator).__name__}: call clip_grad_norm_(accelerator, parameters, "
            "max_norm), as accelerator.clip_grad_norm_(parameters, max_norm)"
        )
    return accelerator.scaler


def _is_enabled(scaler: Any) -> bool:
    """Whether ``scaler`` is set and enabled (a disabled torch scaler unscales nothing)."""
    if scaler is None:
        return False
    is_enabled = getattr(scaler, "is_enabled", None)
    return bool(is_enabled()) if callable(is_enabled) else True


def _unscale_prepared(
    accelerator: Any, scaler: Any, params: list[Tensor], names: list[str] | None
) -> None:
    """Unscale the gradients of every prepared optimizer not unscaled since the scaler's last
    ``update()``, once every parameter to clip is known to belong to one.

    Raises:
        ValueError: as :func:`_check_prepared`, before anything is unscaled.
    """
    # The optimizers accelerate prepared, as its own unscale_gradients() reads them.
    optimizers = [_unwrapped(prepared) for prepared in accelerator._optimizers]
    _check_prepared(params, names, optimizers, bool(getattr(scaler, "scaling", True)))
    for optimizer in optimizers:
        if not unscaled_since_update(scaler, optimizer):
            scaler.unscale_(optimizer)


def _check_bound(max_norm: object, spikes: object, loss: object) -> None:
    """Check ``max_norm``, ``spikes`` and ``loss`` of :func:`clip_grad_norm_`, as the clip (or
    the policy) would check them after unscaling.

    Raises:
        TypeError: ``spikes`` is not a ``SpikePolicy``, or ``max_norm`` is a tensor with one.
        ValueError: ``loss`` without ``spikes``; or as the clip checks ``max_norm``.
    """
    if spikes is None:
        if loss is not None:
            raise ValueError("loss is tested by a SpikePolicy only: pass spikes=, or drop loss")
        _inputs.clip_bound(max_norm)
        return
    if not isinstance(spikes, SpikePolicy):
        raise TypeError(
            f"spikes must be a credit.parallel.spikes.SpikePolicy or None, got "
            f"{type(spikes).__name__}"
        )
    if isinstance(max_norm, Tensor):
        raise TypeError("with spikes, max_norm must be a number (or None), got a tensor")
    if max_norm is not None:
        _inputs.clip_bound(max_norm)


def _check_skipping(
    accelerator: Any, scaler: Any, spikes: SpikePolicy, params: list[Tensor]
) -> None:
    """Refuse a policy that skips steps where the prepared optimizer's ``step()`` would not go
    through a scaler holding it: the spikes it decides would be stepped. It reads only the
    accelerator's settings, the same on every rank.

    Raises:
        ValueError: naming what to set, and in which order.
    """
    wanted = {id(p) for p in params}
    stale = [
        prepared
        for prepared in accelerator._optimizers
        if getattr(prepared, "scaler", None) is not scaler
        and any(id(p) in wanted for group in prepared.param_groups for p in group["params"])
    ]
    held = _is_enabled(scaler) and spikes.scaler is scaler
    if held and not stale:
        return
    problem = (
        f"accelerator.scaler ({type(scaler).__name__}) is not a GradScaler holding it"
        if not held
        else "an optimizer holding parameters to clip was prepared before accelerator.scaler "
        "was set, and steps through no scaler"
    )
    raise ValueError(
        f"spikes skips steps, and {problem}: the spikes it decides would be stepped anyway. "
        "Set accelerator.scaler = GradScaler(device, scaling=False, spikes=spikes) "
        "(credit.parallel.amp; scaling=True for fp16) before accelerator.prepare(optimizer), "
        "or pass SpikePolicy(skip=False, adaptive_clip='zscore') for an adaptive clip alone. "
        "No gradient was modified."
    )


def _check_logging(log_as: object, log_step: object) -> None:
    """Check the logging arguments of :func:`clip_grad_norm_`.

    Raises:
        TypeError: ``log_as`` is not a string, or ``log_step`` not an int.
        ValueError: ``log_as`` is empty, or ``log_step`` is given without ``log_as``.
    """
    if log_as is not None and not isinstance(log_as, str):
        raise TypeError(
            f"log_as must be the key accelerator.log records the norm under, such as "
            f"'grad_norm', or None, got {type(log_as).__name__}"
        )
    if log_as == "":
        raise ValueError("log_as must be a non-empty key, such as 'grad_norm', or None")
    if log_step is not None and (isinstance(log_step, bool) or not isinstance(log_step, int)):
        raise TypeError(f"log_step must be an int or None, got {type(log_step).__name__}")
    if log_step is not None and log_as is None:
        raise ValueError(
            f"log_step={log_step} was given without log_as, so nothing would be logged: pass "
            "log_as='grad_norm' (the key accelerator.log records the norm under) as well"
        )


def _check_prepared(
    params: list[Tensor],
    names: list[str] | None,
    optimizers: list[torch.optim.Optimizer],
    scaling: bool,
) -> None:
    """Refuse parameters to clip that no prepared optimizer holds, while a scaler is set: only a
    prepared optimizer's gradients are unscaled here, and only its step goes through the scaler.

    Raises:
        ValueError: naming the first such parameters and the two ways out.
    """
    # It depends on the parameters passed, their requires_grad and the prepared optimizers'
    # parameters (a gradient counts only on a parameter that requires none, set by hand), not on
    # which gradients the data produced: what the same script builds alike on every rank, so
    # every rank of a well-formed run raises here or none does, before any collective.
    held = {
        id(p)
        for optimizer in optimizers
        for group in optimizer.param_groups
        for p in group["params"]
    }
    outside = [
        index
        for index, p in enumerate(params)
        if (p.requires_grad or p.grad is not None) and id(p) not in held
    ]
    if not outside:
        return
    named = [names[i] if names is not None else f"parameters[{i}]" for i in outside[:_NAMED]]
    more = f" and {len(outside) - _NAMED} more" if len(outside) > _NAMED else ""
    wrong = (
        "accelerator.backward scaled their gradients and nothing here would unscale them: the "
        "norm would be the scale times the real one"
        if scaling
        else "their optimizer's step would not go through the scaler, which would then skip no "
        "step of theirs that holds a NaN or inf"
    )
    raise ValueError(
        f"accelerator.scaler is set, and no optimizer passed to accelerator.prepare holds "
        f"{len(outside)} of the parameters to clip ({', '.join(named)}{more}): {wrong}. Pass "
        "their optimizer through accelerator.prepare (with accelerator.scaler set before), or "
        "unscale first (accelerator.scaler.unscale_(optimizer)) and clip with "
        "credit.parallel.collectives.clip_grad_norm_. No gradient was modified."
    )


def _log(accelerator: Any, key: str, norm: Tensor, step: int | None) -> None:
    """``accelerator.log({key: norm}, step=step)`` where trackers are set: a host read there."""
    # accelerate fills accelerator.trackers on the main process only: the other processes read
    # nothing, and no collective depends on it.
    if getattr(accelerator, "trackers", None):
        accelerator.log({key: norm.item()}, step=step)


def _reusable(distinct_along: DistinctAlong | None) -> DistinctAlong | None:
    """``distinct_along`` with its iterables as lists, checked here and read again by the clip
    (``[(experts.parameters(), ep_group)]`` holds a generator). What is not a list of pairs is
    left as it is, for the clip's checks to name."""
    if isinstance(distinct_along, (Tensor, str, bytes)) or not isinstance(distinct_along, Iterable):
        return distinct_along
    return [
        (list(pair[0]), pair[1])
        if isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], Iterator)
        else pair
        for pair in distinct_along
    ]


def _unwrapped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` wrappers (optimizers
    that hold another as ``.optimizer``): the one whose step the wrapper hands to the scaler."""
    while isinstance(inner := getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = inner
    return optimizer
