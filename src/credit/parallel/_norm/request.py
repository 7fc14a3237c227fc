"""The norm's first step: its request, every argument checked once, before any collective.

A check depends only on arguments that are the same on every rank of a well-formed call, so a bad
call raises everywhere; a gradient refused on one rank only raises on every rank in the check mode.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from credit.parallel._common.compat import local_tensor
from credit.parallel._common.groups import (
    GroupLike,
    collective_device,
    group_size,
    is_distributed,
    resolve_group,
    world_of_one,
)
from credit.parallel._common.inputs import (
    DistinctAlong,
    Parameters,
    distinct_groups,
    local_refusal,
    parameter_label,
    parameter_list,
    warn_no_grads,
)
from credit.parallel._common.layout_check import check_enabled, refuse_on_every_rank


def checked_norm_type(norm_type: object) -> float:
    """``norm_type`` as a float; TypeError for non-numbers, ValueError for NaN."""
    if isinstance(norm_type, str) and norm_type.lower() in ("inf", "+inf", "infinity"):
        return math.inf
    if isinstance(norm_type, bool) or not isinstance(norm_type, numbers.Real):
        raise TypeError(f"norm_type must be a real number or 'inf', got {norm_type!r}")
    value = float(norm_type)
    if math.isnan(value):
        raise ValueError("norm_type must not be NaN")
    return value


def norm_grads(
    grads: list[Tensor],
    argument: str,
    what: str,
    per_rank: bool,
    pp_group: GroupLike,
    distinct_along: DistinctAlong | None,
    *,
    on_every_rank: bool,
) -> tuple[list[Tensor], ProcessGroup | None, list[frozenset[int] | None] | None]:
    """The gradients of a norm checked: their local tensors, the pipeline group resolved, and
    :func:`distinct_groups`.

    A gradient no norm can take (:func:`local_refusal`) raises on the ranks that hold it; with
    ``on_every_rank`` (the check mode), every rank raises the refusal of the lowest rank that has
    one, before any other collective (one small all_reduce).

    Raises:
        TypeError, ValueError: as ``total_grad_norm`` documents.
    """
    local = [local_tensor(grad) for grad in grads]
    refusal = local_refusal(local, argument)
    if on_every_rank and not per_rank and not world_of_one():
        refuse_on_every_rank(refusal, collective_device([t for t in local if not t.is_meta]), what)
    elif refusal is not None:
        kind, message = refusal
        raise kind(message)
    if per_rank:
        check_per_rank(grads, pp_group, distinct_along)
    pp_process_group = resolve_group(pp_group, "pp_group")
    return local, pp_process_group, distinct_groups(distinct_along, grads)


def check_per_rank(
    grads: list[Tensor], pp_group: GroupLike, distinct_along: DistinctAlong | None
) -> None:
    """ValueError unless ``per_rank=True`` fits: plain gradients, no pp_group, no distinct_along."""
    if pp_group is not None or distinct_along is not None:
        raise ValueError(
            "per_rank=True norms each rank's own gradients alone, so it takes neither pp_group "
            "nor distinct_along"
        )
    for index, grad in enumerate(grads):
        if isinstance(grad, DTensor):
            raise ValueError(
                f"grads[{index}] is a DTensor, whose mesh spreads it over several ranks; "
                "per_rank=True is for the plain gradients of models that each rank trains on its own"
            )


@dataclass(frozen=True)
class NormRequest:
    """The arguments of one norm call, checked and resolved.

    Attributes:
        grads: the gradients, plain or DTensor, None entries dropped.
        local: each gradient's local tensor (a DTensor's shard), in input order.
        norm_type: the p of the p-norm (``math.inf`` for the max norm).
        foreach: use the foreach kernels (None: where the device supports them).
        dtype: accumulation dtype of the per-gradient norms, or None for torch's.
        pp_group: this rank's pipeline group, or None.
        distinct: for each gradient, the ranks along which its copies differ (None: replicas),
            or None when no gradient is declared distinct.
        check: verify the layout across ranks and the copies on this call.
        per_rank: each rank norms its own gradients alone (ranks that train independent models).
        alone: the norm needs no collective (no process group, a world of one, or ``per_rank``).
        error_if_nonfinite: raise on every rank when the total is not finite.
        what: the public function, for messages.
        label: names gradient ``i`` in messages (its parameter's name, or its place in the call).
    """

    grads: list[Tensor]
    local: list[Tensor]
    norm_type: float
    foreach: bool | None
    dtype: torch.dtype | None
    pp_group: ProcessGroup | None
    distinct: list[frozenset[int] | None] | None
    check: bool
    per_rank: bool
    alone: bool
    error_if_nonfinite: bool
    what: str
    label: Callable[[int], str]


def norm_request(
    grads: list[Tensor],
    what: str,
    norm_type: float | str,
    error_if_nonfinite: bool,
    foreach: bool | None,
    pp_group: GroupLike,
    distinct_along: DistinctAlong | None,
    dtype: torch.dtype | None,
    check: bool | None,
    per_rank: bool,
    *,
    label: Callable[[int], str] | None = None,
    argument: str = "grads",
) -> NormRequest:
    """The norm arguments, checked before any collective and resolved.

    Args:
        grads: the gradients to norm.
        what: the public function, for messages.
        norm_type, error_if_nonfinite, foreach, pp_group, distinct_along, dtype, check, per_rank:
            as for ``total_grad_norm``.
        label: names gradient ``i`` in messages. Default: ``{argument}[i]``.
        argument: the public function's argument that holds the gradients, for messages.

    Raises:
        TypeError, ValueError: as for ``total_grad_norm``.
    """
    check_mode = check_enabled(check) and is_distributed()
    local, pp_process_group, distinct = norm_grads(
        grads, argument, what, per_rank, pp_group, distinct_along, on_every_rank=check_mode
    )
    return NormRequest(
        grads=grads,
        local=local,
        norm_type=checked_norm_type(norm_type),
        foreach=foreach,
        dtype=dtype,
        pp_group=pp_process_group if group_size(pp_process_group) > 1 else None,
        distinct=distinct,
        check=check_mode,
        per_rank=per_rank,
        alone=per_rank or world_of_one(),
        error_if_nonfinite=error_if_nonfinite,
        what=what,
        label=label if label is not None else functools.partial(_argument_label, argument),
    )


def parameters_request(
    parameters: Parameters,
    what: str,
    norm_type: float | str,
    error_if_nonfinite: bool,
    foreach: bool | None,
    pp_group: GroupLike,
    distinct_along: DistinctAlong | None,
    dtype: torch.dtype | None,
    check: bool | None,
    per_rank: bool,
) -> NormRequest:
    """The request of a clip: the gradients of ``parameters`` (tensors, a module, or
    ``(name, parameter)`` pairs), named after their parameters in messages. Warns when
    parameters were given and none has a gradient (see ``warn_no_grads``).

    Raises:
        TypeError, ValueError: as :func:`norm_request`, or ``parameters`` is not one of these.
    """
    params, names = parameter_list(parameters)
    grads = [grad for p in params if (grad := p.grad) is not None]
    if params and not grads:
        warn_no_grads(params, what)
    label = functools.partial(parameter_label, params, names)
    return norm_request(
        grads,
        what,
        norm_type,
        error_if_nonfinite,
        foreach,
        pp_group,
        distinct_along,
        dtype,
        check,
        per_rank,
        label=label,
    )


def _argument_label(argument: str, index: int) -> str:
    return f"{argument}[{index}]"
