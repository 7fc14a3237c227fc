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

from typing import Any

import torch
from torch import Tensor, nn

from credit.parallel._groups import GroupLike
from credit.parallel._inputs import DistinctAlong, TensorOrTensors
from credit.parallel.collectives import clip_grad_norm_ as _clip_grad_norm_

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    accelerator: Any,
    parameters: TensorOrTensors | nn.Module,
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
    (under ``if accelerator.sync_gradients:``), instead of it and of
    ``accelerator.unscale_gradients()``: a scaler unscales each optimizer once per step. Every
    rank must call it.

    Set this package's scaler before preparing the optimizer, so that the prepared optimizer's
    ``step()`` takes or skips the step on every rank together::

        accelerator.scaler = GradScaler("cuda")  # credit.parallel.amp; scaling=False for bf16
        optimizer = accelerator.prepare(optimizer)

    Args:
        accelerator: the ``accelerate.Accelerator``.
        parameters: the parameters whose ``.grad`` is clipped in place, or the module.
        max_norm: max norm of the gradients, in every form the clip takes.
        norm_type: p-norm exponent, a positive float or ``inf``. Default: 2.
        pp_group, distinct_along, check: see :func:`credit.parallel.collectives.total_grad_norm`
            (``distinct_along=[(experts.parameters(), ep_group)]`` for rank-local experts).

    Returns:
        The total norm before clipping, a plain scalar tensor, the same on every rank.

    Raises:
        TypeError, ValueError, RuntimeError: as
            :func:`credit.parallel.collectives.clip_grad_norm_`.
    """
    scaler = accelerator.scaler
    if scaler is not None:
        # The optimizers accelerate prepared, as its own unscale_gradients() reads them.
        for prepared in accelerator._optimizers:
            scaler.unscale_(_unwrapped(prepared))
    return _clip_grad_norm_(
        parameters,
        max_norm,
        norm_type,
        pp_group=pp_group,
        distinct_along=distinct_along,
        check=check,
    )


def _unwrapped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` wrappers: the one whose
    step the wrapper hands to the scaler."""
    from accelerate.optimizer import AcceleratedOptimizer

    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer
