"""Per-group gradient norms for logging, reduced together in one collective.

Each rank takes, for every group, the norm of the local shards it counts (the ownership rules of
:func:`~credit.parallel.collectives.total_grad_norm`: every distinct shard counted once), raises it
to the p-th power and packs all groups into one small vector; one all_reduce (SUM, or MAX for the
inf norm) over the same groups as ``total_grad_norm`` then yields every group's norm and the total
on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from credit.parallel import _inputs, _norms
from credit.parallel._groups import GroupLike, resolve_group
from credit.parallel.tensor_parallel import _is_shard, is_tp_sharded

__all__ = ["DEFAULT_GROUPS", "TOTAL", "grad_norm_report"]

TOTAL = "total"
DEFAULT_GROUPS = ("tp_sharded", "fsdp", "replicated")

GroupBy = Callable[[str, Tensor], str]


@torch.no_grad()
def grad_norm_report(
    named_parameters: Iterable[tuple[str, Tensor]],
    norm_type: float | str = 2.0,
    *,
    group_by: GroupBy | None = None,
    groups: Sequence[str] | None = None,
    pp_group: GroupLike = None,
    dtype: torch.dtype | None = None,
    foreach: bool | None = None,
) -> dict[str, float]:
    """Gradient norm of each group of parameters and of all of them, for logging.

    Works on any mix of plain and DTensor gradients (FSDP2, TP, both) like
    :func:`~credit.parallel.collectives.total_grad_norm`, and costs the same collectives: one
    all_reduce of a vector holding every group's contribution (plus one over ``pp_group`` when
    the stages use separate meshes). Parameters without a gradient are skipped.

    By default gradients are grouped by layout: ``"tp_sharded"`` (a DTensor sharded along a mesh
    dim named ``"tp"``), ``"fsdp"`` (any other sharded DTensor, e.g. FSDP2 on a dp mesh) and
    ``"replicated"`` (plain tensors and fully replicated DTensors); groups without gradients on
    any rank are left out. ``group_by`` groups by name instead (e.g. per block).

    With ``pp_group`` and ``group_by``, stages hold different groups: unless ``groups`` names
    them all, they are first gathered over ``pp_group`` (one ``all_gather_object``).

    The values are read back to the host once (a device sync): call it on logging steps only.

    Args:
        named_parameters: ``(name, parameter)`` pairs, e.g. ``model.named_parameters()``.
        norm_type: p-norm exponent, a positive float or ``inf``. Default: 2.
        group_by: ``(name, parameter) -> group name``; None groups by layout (see above). It
            must give the same name for a parameter on every rank.
        groups: every group name, in report order, the same on every rank. Groups without
            gradients report 0. Default: the names ``group_by`` returns, in order of first
            appearance (stage order under ``pp_group``), or the layout groups.
        pp_group: ProcessGroup or 1D DeviceMesh of pipeline stages, as for ``total_grad_norm``.
        dtype: accumulate the norms in this dtype (e.g. ``torch.float32`` for bf16 gradients).
        foreach: use the foreach kernels; None uses them where the device supports them.

    Returns:
        ``{group: norm, ..., "total": norm}`` as Python floats, identical on every rank. The
        total is the norm of all the gradients; it agrees with ``total_grad_norm`` to a few
        rounding steps (the p-th powers are summed per group first).

    Raises:
        TypeError: an entry is not a ``(str, Tensor)`` pair, a gradient is not floating point, a
            group name is not a string, or ``norm_type`` is not a number.
        ValueError: ``norm_type`` is not positive, a gradient is sparse or Partial, a group is
            named ``"total"``, ``groups`` repeats a name or misses a parameter's group, or the
            gradients' meshes share no root.

    Example::

        >>> def by_block(name, param):
        ...     parts = name.split(".")
        ...     return ".".join(parts[:2]) if parts[0] == "blocks" else parts[0]
        >>> loss.backward()
        >>> report = grad_norm_report(model.named_parameters(), group_by=by_block)
        >>> report  # the same on every rank
        {'embed': 0.31, 'blocks.0': 1.27, 'blocks.1': 0.88, 'head': 0.05, 'total': 1.58}
        >>> logger.info("grad norms %s", report)
    """
    order = _inputs.norm_order(norm_type)
    if not order > 0:
        raise ValueError(f"norm_type must be positive or inf, got {order}")
    named = _named_grads(named_parameters)
    grads = [grad for _, grad, _ in named]
    _inputs.check_grads(grads, "grads")
    keys = [_group_name(group_by, name, param) for name, _, param in named]
    plan = _norms.plan(grads, pp_group)
    pp_process_group = resolve_group(pp_group, "pp_group") if plan.groups else None
    names = _report_names(keys, group_by, groups, pp_process_group)
    by_name = _counted_by_name(names, keys, plan.local, plan.counted)
    # float64 on every rank: stages may hold gradients of different dtypes, or none.
    like = torch.empty(0, dtype=torch.float64, device=plan.device)
    vector = _contributions(by_name, set(keys), order, foreach, dtype, like)
    op = dist.ReduceOp.MAX if order == math.inf else dist.ReduceOp.SUM
    for group in plan.groups:
        dist.all_reduce(vector, op=op, group=group)
    return _report(names, vector, order, keep_all=group_by is not None or groups is not None)


def _counted_by_name(
    names: list[str], keys: list[str], local: list[Tensor], counted: list[bool]
) -> dict[str, list[Tensor]]:
    """The local tensors this rank counts, per group name (every name present, in order)."""
    by_name: dict[str, list[Tensor]] = {name: [] for name in names}
    for key, tensor, is_counted in zip(keys, local, counted, strict=True):
        if is_counted:
            by_name[key].append(tensor)
    return by_name


def _named_grads(
    named_parameters: Iterable[tuple[str, Tensor]],
) -> list[tuple[str, Tensor, Tensor]]:
    """``(name, grad, param)`` for every parameter with a gradient; TypeError on bad entries."""
    if isinstance(named_parameters, Tensor) or not isinstance(named_parameters, Iterable):
        raise TypeError(
            "named_parameters must be an iterable of (name, tensor) pairs, "
            f"got {type(named_parameters).__name__}"
        )
    named = []
    for index, entry in enumerate(named_parameters):
        if not (
            isinstance(entry, tuple)
            and len(entry) == 2
            and isinstance(entry[0], str)
            and isinstance(entry[1], Tensor)
        ):
            raise TypeError(
                f"named_parameters[{index}] must be a (str, Tensor) pair, got {entry!r:.80}"
            )
        name, param = entry
        if param.grad is not None:
            named.append((name, param.grad, param))
    return named


def _group_name(group_by: GroupBy | None, name: str, param: Tensor) -> str:
    key = group_by(name, param) if group_by is not None else _layout_group(param.grad)
    if not isinstance(key, str):
        raise TypeError(f"group_by returned {type(key).__name__} for {name!r}, expected a str")
    if key == TOTAL:
        raise ValueError(f"group_by put {name!r} in a group named {TOTAL!r}, which is reserved")
    return key


def _layout_group(grad: Tensor | None) -> str:
    if grad is not None and is_tp_sharded(grad):
        return "tp_sharded"
    if isinstance(grad, DTensor) and any(map(_is_shard, grad.placements)):
        return "fsdp"
    return "replicated"


def _report_names(
    keys: list[str],
    group_by: GroupBy | None,
    groups: Sequence[str] | None,
    pp_group: ProcessGroup | None,
) -> list[str]:
    """The group names in report order, the same on every rank."""
    if groups is not None:
        names = list(groups)
        if not all(isinstance(name, str) for name in names):
            raise TypeError("groups must be a sequence of str")
        if len(set(names)) != len(names) or TOTAL in names:
            raise ValueError(f"groups must be distinct names other than {TOTAL!r}, got {names}")
        missing = [key for key in dict.fromkeys(keys) if key not in names]
        if missing:
            raise ValueError(f"groups does not name the group(s) {missing} of some parameters")
        return names
    if group_by is None:
        return list(DEFAULT_GROUPS)
    names = list(dict.fromkeys(keys))
    if pp_group is None:
        return names
    per_stage: list[list[str] | None] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(per_stage, names, group=pp_group)
    return list(dict.fromkeys(name for stage in per_stage for name in stage or ()))


def _contributions(
    by_name: dict[str, list[Tensor]],
    present: set[str],
    order: float,
    foreach: bool | None,
    dtype: torch.dtype | None,
    like: Tensor,
) -> Tensor:
    """One vector, with the dtype and device of ``like``: this rank's p-th power per group (the
    norm itself for p = 1 or inf), then a 1 or 0 per group for holding gradients of it."""
    zero, one = like.new_zeros(()), like.new_ones(())
    powers = []
    for tensors in by_name.values():
        norm = _norms.local_norm(tensors, order, foreach, dtype)
        value = zero if norm is None else norm.to(like)
        powers.append(value if order in (1.0, math.inf) else value**order)
    flags = [one if name in present else zero for name in by_name]
    return torch.stack(powers + flags) if powers else like


def _report(names: list[str], vector: Tensor, order: float, keep_all: bool) -> dict[str, float]:
    count = len(names)
    powers, present = vector[:count], vector[count:]
    if order == math.inf:
        norms = powers
        total = powers.max() if count else vector.new_zeros(())
    else:
        norms = powers if order == 1.0 else powers ** (1.0 / order)
        total = powers.sum() if order == 1.0 else powers.sum() ** (1.0 / order)
    values = torch.cat([norms, total.reshape(1)]).tolist()
    flags = present.tolist()
    report = {
        name: value
        for name, value, flag in zip(names, values, flags, strict=False)
        if keep_all or flag
    }
    report[TOTAL] = values[-1]
    return report
