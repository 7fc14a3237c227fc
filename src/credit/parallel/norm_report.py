"""Per-group gradient norms for logging, from the same collectives as the total norm.

The gradients go through the norm pipeline of
:func:`~credit.parallel.collectives.total_grad_norm` (every distinct element counted once, every
NaN seen): within one pipeline stage it yields each gradient's global norm, and each group's norm
is the norm of its gradients' entries; across pipeline stages each rank sends one number per
group. Either way one all_reduce over the world gives every group's norm and the total on every
rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from credit.parallel import _norm
from credit.parallel._common.compat import is_shard
from credit.parallel._common.groups import GroupLike
from credit.parallel._common.inputs import DistinctAlong
from credit.parallel.grad_sync import is_tp_sharded

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
    distinct_along: DistinctAlong | None = None,
    dtype: torch.dtype | None = None,
    foreach: bool | None = None,
    check: bool | None = None,
    per_rank: bool = False,
) -> dict[str, float]:
    """Gradient norm of each group of parameters and of all of them, for logging.

    Works on any mix of plain and DTensor gradients (FSDP2, TP, both) like
    :func:`~credit.parallel.collectives.total_grad_norm`, through the same pipeline and at the
    same cost: one all_reduce for all the groups. Parameters without a gradient are skipped.

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
        pp_group: ProcessGroup or 1D DeviceMesh of pipeline peers, as for ``total_grad_norm``.
        distinct_along: ``(parameters, group)`` pairs, as for ``total_grad_norm``.
        dtype: accumulate the norms in this dtype (e.g. ``torch.float32`` for bf16 gradients).
        foreach: use the foreach kernels; None uses them where the device supports them.
        check: verify the layout across ranks first, as for ``total_grad_norm``.
        per_rank: report this rank's own plain gradients alone, as for ``total_grad_norm``.

    Returns:
        ``{group: norm, ..., "total": norm}`` as Python floats, identical on every rank. The
        total is ``total_grad_norm``'s, bit for bit within one pipeline stage; across stages
        it agrees to a few rounding steps (the p-th powers are summed per group first).

    Raises:
        TypeError: an entry is not a ``(str, Tensor)`` pair, a gradient is not floating point, a
            group name is not a string, or ``norm_type`` is not a number.
        ValueError: ``norm_type`` is not positive, a gradient is sparse, a group is named
            ``"total"``, ``groups`` repeats a name or misses a parameter's group, or the layout
            cannot be reduced (as for ``total_grad_norm``).
        RuntimeError: as for ``total_grad_norm``.

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
    p = _norm.checked_norm_type(norm_type)
    if not p > 0:  # each group's norm is taken of the p-th powers of its gradients' norms
        raise ValueError(f"norm_type must be positive or inf, got {p}")
    named = _named_grads(named_parameters)
    keys = [_group_name(group_by, name, param) for name, _, param in named]
    listed = _listed_groups(groups, keys)
    options = _norm.NormOptions(
        norm_type=norm_type,
        foreach=foreach,
        pp_group=pp_group,
        distinct_along=distinct_along,
        dtype=dtype,
        check=check,
        per_rank=per_rank,
    )
    grads = [grad for _, grad, _ in named]
    request = _norm.norm_request(
        grads, options, "grad_norm_report", label=lambda index: named[index][0]
    )
    names = listed if listed is not None else _report_names(keys, group_by, request.pp_group)
    segment_of = [names.index(key) for key in keys]
    reduced = _norm.reduce(request, segment_of, len(names))
    values, present = _read(reduced, request, segment_of, len(names))
    keep_all = group_by is not None or groups is not None
    report = {
        name: value
        for name, value, held in zip(names, values, present, strict=False)
        if keep_all or held
    }
    report[TOTAL] = values[-1]
    return report


def _read(
    reduced: _norm.Reduced, request: _norm.NormRequest, segment_of: list[int], count: int
) -> tuple[list[float], list[bool]]:
    """Each group's norm and the total, read on the host once, and whether each group has
    gradients on some rank."""
    total = reduced.total
    if reduced.stages is not None:  # stages: each group's norm and the total came back already
        numbers = reduced.stages.numbers
        norms_and_total = torch.tensor(numbers[: count + 1], dtype=torch.float64)
        present = [held > 0 for held in numbers[count + 1 :]]
        return norms_and_total.to(total.dtype).tolist(), present
    norms, present = _group_norms(reduced, segment_of, count, request.norm_type)
    values = torch.cat([norms.to(total), total.reshape(1)]).tolist()  # the one read
    if not math.isfinite(values[-1]):  # copies that differ leave a NaN total
        _norm.raise_if_copies_differ(reduced, request)
    return values, present


def _group_norms(
    reduced: _norm.Reduced, segment_of: list[int], count: int, norm_type: float
) -> tuple[Tensor, list[bool]]:
    """Each group's norm from the per-gradient norms, and whether the group has gradients.

    The positions of each group's norms are index tensors kept with the layout's stacking, built on
    the device the first time this grouping is asked for.
    """
    entries = reduced.entries
    members: list[list[int]] = [[] for _ in range(count)]
    for position, index in enumerate(reduced.stacking.stacked):
        members[segment_of[index]].append(position)
    held = [positions for positions in members if positions]
    indices = iter(reduced.stacking.indices(("groups", tuple(segment_of)), lambda: held))
    norms = [
        torch.linalg.vector_norm(entries.index_select(0, next(indices)), norm_type)
        if positions
        else entries.new_zeros(())
        for positions in members
    ]
    present = [bool(positions) for positions in members]
    return (torch.stack(norms) if norms else entries.new_zeros(0)), present


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
    if isinstance(grad, DTensor) and any(map(is_shard, grad.placements)):
        return "fsdp"
    return "replicated"


def _listed_groups(groups: Sequence[str] | None, keys: list[str]) -> list[str] | None:
    """``groups`` checked against the parameters' group names ``keys``, as a list (None for
    None): the report's names, in order.

    Raises:
        TypeError: a name is not a string.
        ValueError: ``groups`` repeats a name, names ``"total"``, or misses one of ``keys``.
    """
    if groups is None:
        return None
    names = list(groups)
    if not all(isinstance(name, str) for name in names):
        raise TypeError("groups must be a sequence of str")
    if len(set(names)) != len(names) or TOTAL in names:
        raise ValueError(f"groups must be distinct names other than {TOTAL!r}, got {names}")
    missing = [key for key in dict.fromkeys(keys) if key not in names]
    if missing:
        raise ValueError(f"groups does not name the group(s) {missing} of some parameters")
    return names


def _report_names(
    keys: list[str], group_by: GroupBy | None, pp_group: ProcessGroup | None
) -> list[str]:
    """The group names in report order, the same on every rank, where ``groups`` lists none:
    the layout groups, or the names ``group_by`` gave (gathered over the pipeline stages)."""
    if group_by is None:
        return list(DEFAULT_GROUPS)
    names = list(dict.fromkeys(keys))
    if pp_group is None:
        return names
    per_stage: list[list[str] | None] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(per_stage, names, group=pp_group)
    return list(dict.fromkeys(name for stage in per_stage for name in stage or ()))
