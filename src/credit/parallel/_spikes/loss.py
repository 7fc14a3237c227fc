"""The step's loss as a fact of the world: whether the policy's steps give one, and its average
over the ranks that give it.

A rank may have no loss (a pipeline stage before the last, a rank whose loss lives elsewhere),
so whether a step has a loss is decided by the world, never by one rank. Every rank of a policy
that reads the loss sends three numbers in one all_reduce, loss or not: the sum of the losses
given, how many ranks gave one, and how many gave something that is not one real number. The
first step's all_reduce is sent by every rank whatever it holds, and read on the host: it tells
every rank whether any gives a loss. A policy whose first step had none sends no more of them.

What only some ranks see (a loss that is not one number, a step on which no rank gives one) is
raised alike on every rank where the answer is read: at the first step, and wherever the
collective runs on the CPU (reading there costs no sync). On a GPU after the first step nothing
is read: such a step's average is NaN on every rank, so the scaler skips it as non-finite, and
the rank whose loss was wrong logs why.
"""

from __future__ import annotations

import logging
import math
import numbers
import warnings
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor

from credit.parallel._common.groups import world_of_one

# The records carry the name of the public module, which users configure.
logger = logging.getLogger("credit.parallel.spikes")

_WHAT = "SpikePolicy.clip_grad_norm_"


@dataclass(frozen=True)
class WorldLoss:
    """The step's loss, the same on every rank.

    Attributes:
        read: whether the policy's steps give a loss (on some rank), decided at its first step.
        value: the loss averaged over the ranks that gave one (a float32 scalar on the device),
            or None when the policy reads no loss.
    """

    read: bool
    value: Tensor | None


@dataclass(frozen=True)
class _Problem:
    """Why a rank's ``loss`` is not one real number."""

    error: type[Exception]
    text: str


def world_loss(loss: object, read: bool | None, device: torch.device) -> WorldLoss:
    """The step's loss from this rank's ``loss`` (None where the rank has none).

    Args:
        loss: this rank's loss: a tensor of one element, a real number, or None.
        read: whether the policy's steps give a loss, or None at its first step.
        device: where the world's collectives take their tensors.

    Raises:
        ValueError, TypeError: on every rank alike where the answer is read (see the module's
            docstring): a rank's ``loss`` is not one real number, or no rank gives one on a step
            of a policy that reads the loss.
    """
    if read is False:
        if loss is not None:
            warnings.warn(
                f"{_WHAT}: the loss is ignored: no rank gave one at this policy's first step, "
                "so its decisions read the norm alone. Give the loss from the first step (None "
                "on the ranks that have none)",
                UserWarning,
                stacklevel=4,
            )
        return WorldLoss(False, None)
    problem = _problem_of(loss)
    summed = _all_reduced(_message(loss, problem, device))
    if read is None or device.type == "cpu":
        given = _read(summed, problem, first=read is None)
        if given == 0:
            return WorldLoss(False, None)
    elif problem is not None:
        logger.error("%s: this rank's %s; the step is skipped as non-finite", _WHAT, problem.text)
    return WorldLoss(True, (summed[0] / summed[1]).float())


def _problem_of(loss: object) -> _Problem | None:
    if loss is None:
        return None
    if isinstance(loss, Tensor):
        if loss.numel() != 1:
            return _Problem(
                ValueError, f"loss must hold one element, got shape {tuple(loss.shape)}"
            )
        if not (loss.is_floating_point() or loss.dtype in (torch.int32, torch.int64)):
            return _Problem(TypeError, f"loss must be a real number, got a {loss.dtype} tensor")
        return None
    if isinstance(loss, bool) or not isinstance(loss, numbers.Real):
        return _Problem(
            TypeError, f"loss must be a tensor of one element or a number, got {loss!r:.60}"
        )
    return None


def _message(loss: object, problem: _Problem | None, device: torch.device) -> Tensor:
    """This rank's three numbers: its loss (NaN for a wrong one, 0 for none), whether it gave
    one, whether it was wrong. Built with no host read and no blocking copy: a number, or a CPU
    tensor beside GPU collectives, travels as a kernel's argument."""
    on_device = isinstance(loss, Tensor) and (loss.device.type != "cpu" or device.type == "cpu")
    if problem is None and on_device:
        value = cast(Tensor, loss).detach().reshape(()).to(device, torch.float64, copy=True)
    else:
        number = math.nan if problem else 0.0 if loss is None else float(cast(float, loss))
        value = torch.full((), number, dtype=torch.float64, device=device)
    given = float(loss is not None and problem is None)
    return torch.stack([value, value.new_full((), given), value.new_full((), float(bool(problem)))])


def _all_reduced(message: Tensor) -> Tensor:
    if not world_of_one():
        dist.all_reduce(message)
    return message


def _read(summed: Tensor, problem: _Problem | None, first: bool) -> int:
    """Read the world's answer on the host and raise alike on every rank where it says so;
    how many ranks gave a loss."""
    _, given, wrong = summed.tolist()
    if wrong:
        _raise_everywhere(problem)
    if given == 0 and not first:
        raise ValueError(
            f"{_WHAT}: no rank gave a loss, though this policy's first step had one: give the "
            "loss on every step (None only on the ranks that have none, as pipeline stages "
            "before the last). No gradient was modified."
        )
    return int(given)


def _raise_everywhere(problem: _Problem | None) -> None:
    """Gather every rank's problem (the failure path only) and raise the same error on all."""
    everyone: list[_Problem | None] = [problem]
    if not world_of_one():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, problem)
    wrong = [(rank, p) for rank, p in enumerate(everyone) if p is not None]
    first = wrong[0][1]
    described = "; ".join(f"rank {rank}: {p.text}" for rank, p in wrong)
    raise first.error(f"{_WHAT}: {described}. No gradient was modified.")
