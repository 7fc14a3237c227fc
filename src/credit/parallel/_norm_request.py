"""The norm's first step: its arguments, every one checked here, once, before any collective.

The public functions (``total_grad_norm``, ``get_total_norm``, ``clip_grad_norm_``,
``grad_norm_report``) hand their arguments to one of the builders below and receive a
:class:`NormRequest`: the gradients with their local shards, and every setting resolved. The
steps after it (``_norms``) take it as it is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from credit.parallel import _inputs
from credit.parallel._groups import (
    GroupLike,
    group_size,
    is_distributed,
)
from credit.parallel._inputs import DistinctAlong
from credit.parallel._layout_check import check_enabled


@dataclass(frozen=True)
class NormRequest:
    """The arguments of one norm call, checked and resolved.

    Attributes:
        grads: the gradients, plain or DTensor, None entries dropped.
        local: each gradient's local tensor (a DTensor's shard), in input order.
        order: the p of the p-norm (``math.inf`` for the max norm).
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
    order: float
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
    order = _inputs.norm_order(norm_type)
    check_mode = check_enabled(check) and is_distributed()
    local, pp_process_group, distinct = _inputs.norm_grads(
        grads, argument, what, per_rank, pp_group, distinct_along, on_every_rank=check_mode
    )
    return NormRequest(
        grads=grads,
        local=local,
        order=order,
        foreach=foreach,
        dtype=dtype,
        pp_group=pp_process_group if group_size(pp_process_group) > 1 else None,
        distinct=distinct,
        check=check_mode,
        per_rank=per_rank,
        alone=per_rank or not is_distributed() or dist.get_world_size() == 1,
        error_if_nonfinite=error_if_nonfinite,
        what=what,
        label=label if label is not None else functools.partial(_argument_label, argument),
    )


def _argument_label(argument: str, index: int) -> str:
    return f"{argument}[{index}]"


def parameter_label(params: list[Tensor], names: list[str] | None, index: int) -> str:
    """Names the parameter of gradient ``index`` (counting the parameters with a gradient)."""
    position = [i for i, param in enumerate(params) if param.grad is not None][index]
    return names[position] if names is not None else f"parameters[{position}]"
