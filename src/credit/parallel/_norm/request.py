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
from credit.parallel._common.stages import stages_of


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


@dataclass(frozen=True, kw_only=True)
class NormOptions:
    """The options of a norm, as the public functions take them, before any check.

    Built by keyword at the public edge and passed down as one value; :func:`norm_request` checks
    them. Each attribute is the public argument of the same name (see ``total_grad_norm``).
    """

    norm_type: float | str = 2.0
    error_if_nonfinite: bool = False
    foreach: bool | None = None
    pp_group: GroupLike = None
    distinct_along: DistinctAlong | None = None
    dtype: torch.dtype | None = None
    check: bool | None = None
    per_rank: bool = False


@dataclass(frozen=True)
class CheckedOptions:
    """What the arguments alone decide of a norm, checked (see :func:`checked_options`).

    Attributes:
        norm_type: the p of the p-norm (``math.inf`` for the max norm).
        pp_group: this rank's pipeline group, or None (none, or a group of one rank).
        distinct: for each gradient, the ranks along which its copies differ (None: replicas),
            or None when no gradient is declared distinct.
        alone: the norm needs no collective (no process group, a world of one, or ``per_rank``).
    """

    norm_type: float
    pp_group: ProcessGroup | None
    distinct: list[frozenset[int] | None] | None
    alone: bool


def checked_options(grads: list[Tensor], options: NormOptions) -> CheckedOptions:
    """Every check of a norm that its arguments alone decide, with no collective: the same on
    every rank of a well-formed call, so a bad call raises on every rank before any collective.

    ``norm_type`` must be positive or inf unless the gradients are plain replicas (plain tensors,
    none declared distinct, one pipeline stage), whose norm is the reference copy's, as torch's;
    a norm that needs no collective takes any ``norm_type``, as torch does.

    Raises:
        TypeError, ValueError: as ``total_grad_norm`` documents, naming the argument.
    """
    if options.per_rank:
        check_per_rank(grads, options.pp_group, options.distinct_along)
    pp_group = resolve_group(options.pp_group, "pp_group")
    staged = pp_group if group_size(pp_group) > 1 else None
    if staged is not None:
        stages_of(staged)  # ValueError where its size does not divide the world's
    distinct = distinct_groups(options.distinct_along, grads)
    norm_type = checked_norm_type(options.norm_type)
    alone = options.per_rank or world_of_one()
    if norm_type <= 0 and not alone and not _plain_replicas(grads, staged, distinct):
        raise ValueError(
            f"norm_type must be positive or inf for distributed grads, got {norm_type}"
        )
    return CheckedOptions(norm_type, staged, distinct, alone)


def local_grads(
    grads: list[Tensor], argument: str, what: str, *, on_every_rank: bool
) -> list[Tensor]:
    """Each gradient's local tensor, checked: a gradient no norm can take (:func:`local_refusal`)
    raises on the ranks that hold it; with ``on_every_rank`` (the check mode, with a collective),
    every rank raises the refusal of the lowest rank that has one (one small all_reduce), after
    every check of the arguments.

    Raises:
        TypeError, ValueError: as ``total_grad_norm`` documents.
    """
    local = [local_tensor(grad) for grad in grads]
    refusal = local_refusal(local, argument)
    if on_every_rank:
        refuse_on_every_rank(refusal, collective_device([t for t in local if not t.is_meta]), what)
    elif refusal is not None:
        kind, message = refusal
        raise kind(message)
    return local


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
    options: NormOptions,
    what: str,
    *,
    label: Callable[[int], str] | None = None,
    argument: str = "grads",
) -> NormRequest:
    """The norm's request: its options checked (:func:`checked_options`), then its gradients
    (:func:`local_grads`), before any other collective.

    Args:
        grads: the gradients to norm.
        options: the public function's norm options.
        what: the public function, for messages.
        label: names gradient ``i`` in messages. Default: ``{argument}[i]``.
        argument: the public function's argument that holds the gradients, for messages.

    Raises:
        TypeError, ValueError: as for ``total_grad_norm``.
    """
    checked = checked_options(grads, options)
    check_mode = check_enabled(options.check) and is_distributed()
    on_every_rank = check_mode and not checked.alone
    return NormRequest(
        grads=grads,
        local=local_grads(grads, argument, what, on_every_rank=on_every_rank),
        norm_type=checked.norm_type,
        foreach=options.foreach,
        dtype=options.dtype,
        pp_group=checked.pp_group,
        distinct=checked.distinct,
        check=check_mode,
        per_rank=options.per_rank,
        alone=checked.alone,
        error_if_nonfinite=options.error_if_nonfinite,
        what=what,
        label=label if label is not None else functools.partial(_argument_label, argument),
    )


def parameters_request(parameters: Parameters, options: NormOptions, what: str) -> NormRequest:
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
    return norm_request(grads, options, what, label=label)


def _plain_replicas(
    grads: list[Tensor],
    pp_group: ProcessGroup | None,
    distinct: list[frozenset[int] | None] | None,
) -> bool:
    """Whether the gradients are plain replicas (DDP): plain tensors, none declared distinct, in
    one pipeline stage; the plan's ``Kind.REPLICAS``, decided from the arguments alone."""
    return pp_group is None and distinct is None and not any(isinstance(g, DTensor) for g in grads)


def _argument_label(argument: str, index: int) -> str:
    return f"{argument}[{index}]"
