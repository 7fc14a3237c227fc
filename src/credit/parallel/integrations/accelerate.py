"""accelerate: ``accelerator.clip_grad_norm_`` with this package's norm.

accelerate 1.15's ``Accelerator.clip_grad_norm_`` groups gradients by mesh and is right on FSDP2
+ TP, but it takes the ranks outside a gradient's mesh for copies: on experts held per
expert-parallel rank (FSDP2 on a mesh beside the dense one) it returns a different norm on each
expert-parallel rank, and it has no way to declare them. It also unscales only where accelerate
made the scaler itself (fp16 on an accelerator device), so a scaler set by hand, such as
``credit.parallel.amp.GradScaler`` skipping non-finite bf16 steps, is never unscaled.
:func:`clip_grad_norm_` unscales through whatever scaler the accelerator holds and clips with
:func:`credit.parallel.collectives.clip_grad_norm_`. This module does not import accelerate.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from credit.parallel import _norm
from credit.parallel._common import inputs as _inputs
from credit.parallel._common.compat import unscaled_since_update
from credit.parallel._common.groups import GroupLike
from credit.parallel._common.inputs import DistinctAlong, TensorOrTensors
from credit.parallel.collectives import clip_grad_norm_ as _clip_grad_norm_

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    accelerator: Any,
    parameters: TensorOrTensors | nn.Module | Iterable[tuple[str, Tensor]],
    max_norm: float | Tensor,
    norm_type: float = 2.0,
    *,
    pp_group: GroupLike = None,
    distinct_along: DistinctAlong | None = None,
    check: bool | None = None,
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

    Args:
        accelerator: the ``accelerate.Accelerator``.
        parameters: the parameters whose ``.grad`` is clipped in place, or the module (or its
            ``named_parameters()``), whose names the errors then use.
        max_norm: max norm of the gradients, in every form the clip takes.
        norm_type: p-norm exponent, a positive float or ``inf``. Default: 2.
        pp_group, distinct_along, check: see :func:`credit.parallel.collectives.total_grad_norm`
            (``distinct_along=[(experts.parameters(), ep_group)]`` for rank-local experts).

    Returns:
        The total norm before clipping, a plain scalar tensor, the same on every rank.

    Raises:
        TypeError: ``accelerator`` is not an ``Accelerator`` (None, or the parameters passed
            first as to torch's clip), or as :func:`credit.parallel.collectives.clip_grad_norm_`.
        ValueError, RuntimeError: as :func:`credit.parallel.collectives.clip_grad_norm_`.
    """
    scaler = _scaler_of(accelerator)
    params, names = _inputs.parameter_list(parameters)
    _inputs.clip_bound(max_norm)
    _norm.checked_norm_type(norm_type)
    grads = [grad for p in params if (grad := p.grad) is not None]
    _inputs.check_grads(grads, "parameters")
    distinct_along = _reusable(distinct_along)
    _inputs.distinct_groups(distinct_along, grads)
    if scaler is not None:
        # The optimizers accelerate prepared, as its own unscale_gradients() reads them.
        for prepared in accelerator._optimizers:
            optimizer = _unwrapped(prepared)
            if not unscaled_since_update(scaler, optimizer):
                scaler.unscale_(optimizer)
    return _clip_grad_norm_(
        params if names is None else list(zip(names, params, strict=True)),
        max_norm,
        norm_type,
        pp_group=pp_group,
        distinct_along=distinct_along,
        check=check,
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
