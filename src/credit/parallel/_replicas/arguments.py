"""The replica check's arguments, checked once, in one place, before anything is read or sent.

:func:`request` turns what a caller passes to :func:`~credit.parallel.replicas.verify_replicas`
into a :class:`Request`: the tensors the check looks at (parameters, buffers unless DDP broadcasts
them, optimizer state), named, with their local tensors, the pipeline group and the
``distinct_along`` groups, and what a failure needs (``repair``'s arguments, the optimizer's
parameters and state). What every rank sees alike is raised here; what some ranks only may see (a
rank of ``repair_from`` outside the world, a tensor that cannot be digested) is carried to the
collective's error count, so that no rank waits alone in it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.nn.parallel import DistributedDataParallel

from credit.parallel._common import inputs as _inputs
from credit.parallel._common.compat import local_tensor, uncompiled
from credit.parallel._common.groups import (
    GroupLike,
    collective_device,
    group_size,
    resolve_group,
    world_of_one,
)
from credit.parallel._replicas.records import Entry

_CPU = torch.device("cpu")


@dataclass(frozen=True)
class Request:
    """The checked arguments of one call.

    Attributes:
        entries: every parameter, buffer and optimizer state tensor the check looks at.
        params: the optimizer's parameters by name (those missing from the model named by their
            place in its ``param_groups``).
        states: the optimizer's ``state`` (where a repair puts the copies it creates), or empty.
        buffers: whether buffers are checked.
        repair: whether copies that differ are repaired.
        repair_from: the ranks whose copies are right where a group has no strict majority, in
            the caller's order, each once.
        distributed: whether other ranks hold copies; the fields below are set only then.
        local: the local tensor of each entry.
        pp_group: the pipeline group, None without pipeline stages.
        distinct: per entry, the ranks along which its copies differ, or None without
            ``distinct_along``.
        param_distinct: the same per optimizer parameter.
        device: where the collective's vector lives: beside the first local tensor with data.
        outside: why ``repair_from`` cannot be honoured (it names ranks outside the world), or
            None.
        invalid: why a tensor cannot be digested (sparse, quantized, on the meta device), or None.
    """

    entries: tuple[Entry, ...]
    params: Mapping[str, Tensor]
    states: MutableMapping[Tensor, dict]
    buffers: bool
    repair: bool
    repair_from: tuple[int, ...]
    distributed: bool = False
    local: tuple[Tensor, ...] = ()
    pp_group: ProcessGroup | None = None
    distinct: tuple[frozenset[int] | None, ...] | None = None
    param_distinct: tuple[frozenset[int] | None, ...] | None = None
    device: torch.device = _CPU
    outside: str | None = None
    invalid: str | None = None


def request(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    distinct_along: _inputs.DistinctAlong | None,
    pp_group: GroupLike,
    buffers: bool | None,
    repair: bool,
    repair_from: int | Iterable[int] | None,
) -> Request:
    """The arguments of :func:`~credit.parallel.replicas.verify_replicas`, checked.

    Raises:
        TypeError: ``model`` is not a module, ``optimizer`` not an optimizer, ``repair_from``
            not a rank or ranks, ``pp_group`` or ``distinct_along`` not groups.
        ValueError: ``repair_from`` without ``repair``, or naming no rank or a negative one; a
            DeviceMesh of ``pp_group`` or ``distinct_along`` that is not 1D.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    sources = _repair_sources(repair_from, repair)
    entries, params, with_buffers = _entries(model, optimizer, buffers)
    states = optimizer.state if optimizer is not None else {}
    alone = Request(tuple(entries), params, states, with_buffers, repair, sources)
    if world_of_one():
        return alone
    return _among_ranks(alone, distinct_along, pp_group)


def _among_ranks(
    alone: Request, distinct_along: _inputs.DistinctAlong | None, pp_group: GroupLike
) -> Request:
    """``alone`` with what a check across ranks adds: the groups, and the local tensors."""
    world = dist.get_world_size()
    outside = None
    # Raised on every rank through the error count: another rank may name ranks of the world.
    if any(rank >= world for rank in alone.repair_from):
        outside = (
            f"repair_from names ranks {list(alone.repair_from)}, not all in a world of "
            f"{world} ranks"
        )
    process_group = resolve_group(pp_group, "pp_group")
    pp = process_group if group_size(process_group) > 1 else None
    owners = [entry.owner for entry in alone.entries] + list(alone.params.values())
    marks = _inputs.distinct_groups(distinct_along, owners)
    count = len(alone.entries)
    local = tuple(local_tensor(entry.tensor) for entry in alone.entries)
    first = next((tensor for tensor in local if not tensor.is_meta), None)
    return dataclasses.replace(
        alone,
        distributed=True,
        local=local,
        pp_group=pp,
        distinct=tuple(marks[:count]) if marks is not None else None,
        param_distinct=tuple(marks[count:]) if marks is not None else None,
        device=collective_device([first] if first is not None else []),
        outside=outside,
        invalid=_invalid(alone.entries, local),
    )


def _repair_sources(repair_from: int | Iterable[int] | None, repair: bool) -> tuple[int, ...]:
    """``repair_from`` as a tuple of ranks, in the caller's order, each once.

    Raises:
        TypeError: it is not a rank or an iterable of ranks.
        ValueError: it is given without ``repair``, names no rank, or a negative one.
    """
    if repair_from is None:
        return ()
    if not repair:
        raise ValueError(
            "repair_from names the ranks whose copies a repair takes where a group has no "
            "strict majority: pass it with repair=True"
        )
    items = [repair_from] if isinstance(repair_from, int) else repair_from
    if isinstance(repair_from, (str, bytes, Tensor)) or not isinstance(items, Iterable):
        raise TypeError(f"repair_from must be a rank or an iterable of ranks, got {repair_from!r}")
    ranks = list(items)
    if not ranks:
        raise ValueError(
            "repair_from names no rank: pass None, or the ranks whose copies are right"
        )
    for rank in ranks:
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"repair_from must hold ranks (ints), got {rank!r}")
        if rank < 0:
            raise ValueError(f"repair_from holds {rank}, which is no rank")
    return tuple(dict.fromkeys(ranks))


def _broadcasts_buffers(model: nn.Module) -> bool:
    inner = uncompiled(model)
    return isinstance(inner, DistributedDataParallel) and bool(inner.broadcast_buffers)


def _entries(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, buffers: bool | None
) -> tuple[list[Entry], dict[str, Tensor], bool]:
    """Every parameter, buffer and optimizer state tensor, with its name, kind and owner; the
    optimizer's parameters by name (those missing from ``model`` named by their place in its
    ``param_groups``); and whether buffers are checked: ``buffers``, by default unless ``model``
    is a DDP that broadcasts them."""
    with_buffers = buffers if buffers is not None else not _broadcasts_buffers(model)
    named = list(model.named_parameters())
    entries = [Entry(name, param, "parameter", param, name) for name, param in named]
    if with_buffers:
        entries += [Entry(name, b, "buffer", b, name) for name, b in model.named_buffers()]
    params: dict[str, Tensor] = {}
    if optimizer is not None:
        names = {id(param): name for name, param in named}
        for group_index, group in enumerate(optimizer.param_groups):
            for index, param in enumerate(group["params"]):
                owner = names.get(id(param), f"param_groups[{group_index}][{index}]")
                params[owner] = param
                state = optimizer.state.get(param, {})
                for key in sorted(state, key=str):
                    if isinstance(state[key], Tensor):
                        name = f"{key} of {owner}"
                        entries.append(Entry(name, state[key], "state", param, owner, key))
    return entries, params, with_buffers


def _invalid(entries: tuple[Entry, ...], locals_: tuple[Tensor, ...]) -> str | None:
    """Why a tensor cannot be digested (it is sparse, quantized or on the meta device), or None;
    raised on every rank through the collective's error count."""
    for entry, local in zip(entries, locals_, strict=True):
        if local.layout != torch.strided or local.is_meta or local.is_quantized:
            where = (
                "on the meta device"
                if local.is_meta
                else f"quantized ({local.dtype})"
                if local.is_quantized
                else f"of layout {local.layout}"
            )
            return f"{entry.name} is {where}; only dense tensors with data are compared"
    return None
