"""Replicas that stay replicas: prove every copy of every parameter, buffer and optimizer state
bit-identical, on any mix of meshes, in one small collective, and repair the copies that differ.

Legitimate replicas (DDP, HSDP's replicate dim, TP-replicated norms, domain peers) are
bit-identical after every optimizer step. They drift apart through a scaler that decides per mesh,
a rank restored from the wrong checkpoint shard, a nondeterministic kernel or silent data
corruption, and from then on every step is wrong on some ranks while the loss says nothing.

Which ranks hold copies of what is read from the rank maps, as the norm reads them
(``_ownership``): a DTensor's placements on its mesh, plain tensors as copies over the stage, and
what ``distinct_along`` declares rank-local; a Partial DTensor's local values are addends of a
pending sum, not copies. Each rank digests the local tensors that have copies elsewhere
(``_digests``: four 64-bit lanes ``D`` of their raw bits, on their device). In every group of ``c``
copies one member is the reference (the copy in the stage's lowest rank's mesh copy, at coordinate
0 of its Replicate dims). Each other member ``i`` sends ``-u_i (D_i + p)`` and the reference
``(U - u_ref)(D_ref + p)``, ``U`` the sum of every member's weight, so the group's sum is
``sum_{i != ref} u_i (D_ref - D_i)``: zero when every copy has the reference's bits. Lane 0 weighs
every member alike (``u_i = w``, an odd number of the group), which keeps a lone differing copy
certain to show; lanes 1 to 3 weigh each member on its own, ``u_i = 2 G(S_i) + 1`` with ``G`` the
sum of pseudo-random words over the ranks of the member's share ``S_i`` (its ranks of the group's
universe, which the shares partition, so that every member can compute ``U``), which keeps
differences spread over several members from cancelling. ``p``, a pseudo-random constant of the
group, makes a missing copy (optimizer state created on some copies only) count as a differing
one. One all_reduce of six int64 numbers (those sums, the layout's self-check, an error count)
proves every copy of every tensor at once. Only a failure gathers what each rank holds, to name
the tensors and ranks, or to repair them from a copy a strict majority holds (or that the caller
names) in one more all_reduce, all or nothing across ranks; that gather also proves that the
ranks passed the same ``repair``, ``repair_from`` and ``buffers``. The guide states what is
certain and what is probable, with the proof.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.nn.parallel import DistributedDataParallel

from credit.parallel import (
    _digests,
    _inputs,
    _ownership,
    _replica_diagnosis,
    _replica_messages,
    _replica_repair,
)
from credit.parallel._compat import local_tensor, uncompiled
from credit.parallel._groups import (
    GroupLike,
    collective_device,
    group_size,
    is_distributed,
    moves_data,
    resolve_group,
)
from credit.parallel._ownership import CopyGroup, Holding, Stages
from credit.parallel._replica_messages import WHAT
from credit.parallel._replica_records import Entry, Held, Mismatch
from credit.parallel._scoped import ScopedCache

__all__ = ["Mismatch", "ReplicaMismatchError", "ReplicaReport", "verify_replicas"]

logger = logging.getLogger(__name__)

# Layouts whose plans are kept (a trainer checks one model, or a few).
_MAX_PLANS = 16
LANES = _digests.LANES


class ReplicaMismatchError(RuntimeError):
    """Copies of parameters, buffers or optimizer state differ: raised on every rank alike.

    Attributes:
        mismatches: every group of copies that differ, with its ranks, and the source a repair
            would take (None where nothing tells which copy is right).
    """

    def __init__(self, message: str, mismatches: tuple[Mismatch, ...]) -> None:
        super().__init__(message)
        self.mismatches = mismatches


@dataclass(frozen=True)
class ReplicaReport:
    """What :func:`verify_replicas` looked at on this rank, and what it repaired.

    Attributes:
        tensors: parameters, buffers and optimizer state tensors of this rank's stage.
        compared: those with copies on other ranks, whose bits were proven equal.
        compared_bytes: the bytes of this rank's copies that were read.
        buffers: whether buffers were checked.
        repaired: the groups of copies that differed (or lacked a copy) and now hold their
            source's bits, each saying how its source was decided (empty when every copy
            agreed), the same on every rank.
    """

    tensors: int
    compared: int
    compared_bytes: int
    buffers: bool
    repaired: tuple[Mismatch, ...] = ()


@torch.no_grad()
def verify_replicas(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    distinct_along: _inputs.DistinctAlong | None = None,
    pp_group: GroupLike = None,
    buffers: bool | None = None,
    repair: bool = False,
    repair_from: int | Iterable[int] | None = None,
) -> ReplicaReport:
    """Prove that every copy of every parameter, buffer and optimizer state holds the same bits.

    Copies are found as the norm finds them: DTensors by their placements on their meshes (FSDP2,
    HSDP's replicate dim, TP, any mix, meshes built any way), plain tensors as copies over the
    world, or over the pipeline stage with ``pp_group``, unless ``distinct_along`` declares them
    rank-local. A DTensor with a Partial placement holds addends of a pending sum, not copies: it
    is not compared. Optimizer state follows its parameter's layout; a plain state of a DTensor
    parameter (AdamW's 0-dim ``step``) is a copy on every rank that holds the parameter. Tensors
    are matched by name: state without copies may exist on some ranks only (an idle expert's),
    while a copy of state that some members of its group lack is a mismatch.

    The comparison is bit-exact, of each tensor's elements in row-major order whatever its memory
    format: copies with the same values compare equal however they are laid out (channels_last,
    transposed, expanded, views into a flat buffer), and a repair keeps each copy's strides.
    Certain: one differing copy in a group (one flipped bit in one element, or two elements of at
    most 4 bytes swapped, in tensors of the sizes the guide states) is detected. Probable: any
    other difference, and differences on several copies at once (which may cancel in a sum),
    escape with a probability of about 2^-48 or less (the guide states the bounds and the proof).

    Costs one all_reduce of six int64 numbers and about two passes over the local tensors that
    have copies (sharded tensors without copies are not read), on their device, with one host
    sync for the verdict; under ``pp_group`` the first call also learns the ranks of its stage
    (one more all_reduce, once). Call it on every rank, between optimizer steps, with the same
    ``repair``, ``repair_from`` and ``buffers`` (a failure checks that they agree).

    Args:
        model: the model (FSDP2, DDP, TP or plain, or these compiled); its parameters and buffers
            are checked.
        optimizer: its state tensors are checked too (exp_avg, exp_avg_sq, step, ...).
        distinct_along: ``(tensors, group)`` pairs declaring parameters or buffers whose copies
            differ along ``group``, as for :func:`~credit.parallel.collectives.total_grad_norm`:
            experts held per expert-parallel rank, a per-band latitude weight under domain
            parallelism. Their state follows them.
        pp_group: ProcessGroup or 1D DeviceMesh of this rank's pipeline peers (one rank per
            stage): copies are then sought within each stage.
        buffers: check the buffers. Default: yes, unless ``model`` is (or compiles) a
            DistributedDataParallel that broadcasts them at every forward
            (``broadcast_buffers=True``), whose running statistics legitimately differ across
            ranks between forwards.
        repair: instead of raising, copy over the copies that differ (and create the missing
            copies of optimizer state) the copy a strict majority of their group holds; where
            no strict majority exists, the copy of the first rank of ``repair_from`` in the group.
            One more all_reduce, of those tensors only. All or nothing: every copy is repaired
            on every rank, or none is and every rank raises; no write changes a tensor through
            memory it shares with the copy. The report lists them.
        repair_from: with ``repair``, the ranks whose copies are right where a group has no
            strict majority (two copies, two against two), for instance the ranks that just
            reloaded a checkpoint. A group with neither is not repaired: nothing tells which copy
            is right, and overwriting the other would lose it if it were the right one.

    Returns:
        A :class:`ReplicaReport`; its ``repaired`` is empty unless ``repair`` found differences.

    Raises:
        TypeError: ``model`` is not a module, ``optimizer`` not an optimizer, or ``repair_from``
            not a rank or ranks.
        ValueError: ``repair_from`` without ``repair``, or naming no rank (before any
            collective); ``repair_from`` naming ranks outside the world, ``repair``,
            ``repair_from`` or ``buffers`` different across ranks (naming each rank's value), a
            tensor sparse, quantized or on the meta device (on any rank), or a mesh,
            ``pp_group`` or ``distinct_along`` group that does not fit the others (raised on
            every rank).
        ReplicaMismatchError: copies differ (and ``repair`` is off), or ``repair`` found a group
            of copies that differ and nothing that tells which is right, or a copy that cannot
            take its source's bits (a copy that broadcasts a dim along which its source varies,
            or whose elements share memory), or a copy that shares memory with another tensor
            of its rank where writing it would change that tensor (memory shared on some ranks
            only, as ``m.ema = m.w.detach()`` makes it, or a source whose bits there are not
            that tensor's); raised on every rank with the same message, naming each differing
            tensor and its ranks, and the tensors that share memory. Nothing is modified.
        RuntimeError: the ranks of a stage hold different parameters or buffers, or a tensor's
            copies do not add up to whole copies on every rank (raised on every rank).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    sources = _repair_sources(repair_from, repair)
    with_buffers = buffers if buffers is not None else not _broadcasts_buffers(model)
    entries, params = _entries(model, optimizer, with_buffers)
    if not is_distributed() or dist.get_world_size() == 1:
        return ReplicaReport(len(entries), 0, 0, with_buffers)
    # Raised on every rank through the error count: another rank may name ranks of the world.
    outside = None
    if any(rank >= dist.get_world_size() for rank in sources):
        outside = (
            f"repair_from names ranks {list(sources)}, not all in a world of "
            f"{dist.get_world_size()} ranks"
        )
    process_group = resolve_group(pp_group, "pp_group")
    pp = process_group if group_size(process_group) > 1 else None
    marks = _inputs.distinct_groups(
        distinct_along, [entry.owner for entry in entries] + list(params.values())
    )
    distinct = marks[: len(entries)] if marks is not None else None
    local = [local_tensor(entry.tensor) for entry in entries]
    plan = _plan(entries, local, distinct, pp, _invalid(entries, local))
    vector = plan.constant.clone()
    if outside is not None:
        vector[-1] += 1
    prints = None
    if plan.compared:
        prints = plan.digests([local[i] for i in plan.compared])
        vector[:LANES] += (plan.coefficients * prints).sum(0)
    dist.all_reduce(vector, op=dist.ReduceOp.SUM)
    report = ReplicaReport(len(entries), len(plan.compared), plan.digests.nbytes, with_buffers)
    if not bool(vector.any()) or not moves_data():  # the verdict: the one host sync
        return report
    param_marks = marks[len(entries) :] if marks is not None else [None] * len(params)
    mine = Held(
        entries=tuple(entries),
        local=tuple(local),
        held=tuple(plan.held),
        groups=tuple(plan.groups),
        compared=tuple(plan.compared),
        at=plan.at,
        lowest=min(plan.stage),
        params=params,
        param_marks=dict(zip(params, param_marks, strict=True)),
    )
    digests = dict(zip(plan.compared, prints.tolist(), strict=True)) if prints is not None else {}
    arguments = {
        "repair": repair,
        "repair_from": list(sources) if sources else None,
        "buffers": with_buffers,
    }
    error = outside if outside is not None else plan.error
    failure = _replica_diagnosis.diagnose(mine, digests, error, sources, arguments)
    mismatches = tuple(slot.mismatch for slot in failure.slots)
    if not repair:
        buffer_names = {name for name, _ in model.named_buffers()} if with_buffers else set()
        message = _replica_messages.describe(failure, buffer_names)
        raise ReplicaMismatchError(message, mismatches)
    if any(m.reference is None for m in mismatches):
        raise ReplicaMismatchError(_replica_messages.refusal(failure, sources), mismatches)
    states = optimizer.state if optimizer is not None else {}
    unrepaired = _replica_repair.repair(failure, mine, states, plan.device)
    if unrepaired is not None:
        raise ReplicaMismatchError(unrepaired, mismatches)
    if dist.get_rank() == 0:
        logger.warning("%s repaired %s", WHAT, _replica_messages.listed(mismatches))
    return ReplicaReport(
        len(entries), len(plan.compared), plan.digests.nbytes, with_buffers, mismatches
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


# ---------------------------------------------------------------------------------------------
# what is checked


def _broadcasts_buffers(model: nn.Module) -> bool:
    inner = uncompiled(model)
    return isinstance(inner, DistributedDataParallel) and bool(inner.broadcast_buffers)


def _entries(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, with_buffers: bool
) -> tuple[list[Entry], dict[str, Tensor]]:
    """Every parameter, buffer and optimizer state tensor, with its name, kind and owner; and
    the optimizer's parameters by name (those missing from ``model`` named by their place in
    its ``param_groups``)."""
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
    return entries, params


def _invalid(entries: list[Entry], locals_: list[Tensor]) -> str | None:
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


# ---------------------------------------------------------------------------------------------
# the plan of one layout, kept between calls


@dataclass(eq=False)
class _Plan:
    """How this rank's tensors enter the comparison, computed on a layout's first call.

    ``held`` keeps the Holding objects alive, so the ids in the cache key stay theirs.
    """

    held: list[Holding]
    at: Stages
    stage: frozenset[int]  # the ranks of this rank's stage
    groups: list[CopyGroup | None]
    compared: list[int]  # the tensors with copies (groups larger than one, no Partial dims)
    digests: _digests.Plan  # the compared tensors' digests, planned for their layout
    coefficients: Tensor  # (compared, LANES) int64 on device: each member's weights
    constant: Tensor  # the vector before the digests: presence terms, self-check, error count
    device: torch.device
    error: str | None


# The plans of the layouts met under the current process group, the most recent kept.
_plans: ScopedCache[tuple, _Plan] = ScopedCache(_MAX_PLANS)


def _plan(
    entries: list[Entry],
    local: list[Tensor],
    distinct: list[frozenset[int] | None] | None,
    pp_group: ProcessGroup | None,
    invalid: str | None,
) -> _Plan:
    held = [_ownership.holding(entry.tensor) for entry in entries]
    at = _ownership.stages_of(pp_group)
    marks = distinct if distinct is not None else [None] * len(entries)
    names = tuple((entry.name, entry.kind) for entry in entries)
    key = (tuple(map(id, held)), at, tuple(marks), names, invalid)
    found = _plans.get(key)
    if found is not None:
        return found
    device = collective_device([t for t in local if not t.is_meta][:1])
    stage = _ownership.stage_ranks(at, pp_group, device)
    errors = (_ownership.layout_error(h, at, d) for h, d in zip(held, marks, strict=True))
    error = invalid or next((e for e in errors if e is not None), None)
    groups = [
        None if error is not None else _ownership.copy_group(h, at, min(stage), d)
        for h, d in zip(held, marks, strict=True)
    ]
    members = [
        (i, entry.name, h, group)
        for i, (entry, h, group) in enumerate(zip(entries, held, groups, strict=True))
        if group is not None and group.size > 1 and not h.partial_dims
    ]
    if error is None:
        error = next((why for _, n, h, g in members if (why := _outside(n, h, g, stage))), None)
    if error is not None:
        groups, members = [None] * len(entries), []
    compared = [i for i, _, _, _ in members]
    coefficients, presence = _weights([m[1:] for m in members], at, stage)
    # The self-check of the tensors every rank of the stage holds (optimizer state need not be:
    # a missing copy shows through its group's presence terms), weighted by name.
    coverage = sum(
        _digests.signed(
            _digests.odd_weight("coverage", at.index, e.name) * _ownership.coverage(h, at)
        )
        for e, h in zip(entries, held, strict=True)
        if e.kind != "state"
    )
    constant = torch.tensor([*presence, _digests.signed(coverage), int(error is not None)])
    plan = _Plan(
        held=held,
        at=at,
        stage=stage,
        groups=groups,
        compared=compared,
        digests=_digests.plan([local[i] for i in compared], device),
        coefficients=coefficients.to(device),
        constant=constant.to(device),
        device=device,
        error=error,
    )
    _plans.put(key, plan)
    return plan


def _outside(name: str, held: Holding, group: CopyGroup, stage: frozenset[int]) -> str | None:
    """Why the copies of ``name`` cannot be weighed (its share reaches out of the universe its
    group's members cover), or None."""
    if group.share <= _ownership.universe(group, held, stage):
        return None
    return (
        f"{name} ({held.description}): its distinct_along group holds ranks of other pipeline "
        f"stages (ranks {sorted(group.share)}; this stage: ranks {sorted(stage)})"
    )


# ---------------------------------------------------------------------------------------------
# the members' weights


def _weights(
    members: list[tuple[str, Holding, CopyGroup]], at: Stages, stage: frozenset[int]
) -> tuple[Tensor, list[int]]:
    """The coefficients of this rank's copies (each a tensor's name, holding and copy group),
    int64 ``(len(members), LANES)``, and the presence terms they add to the sums (``LANES``
    ints): ``sum coefficient * p``, ``p = mix(seed)`` per group and lane.

    A member ``i`` of a group of ``c`` copies has weight ``u_i`` per lane; it sends ``-u_i`` times
    its digest, the reference ``U - u_ref`` (``U``: the sum of every member's weight). Lane 0:
    ``u_i = w``, an odd number of the group. Lanes 1 to 3: ``u_i = 2 G(S_i) + 1``, where
    ``G(S) = sum_{r in S} gamma(r)`` over the member's share ``S_i`` of the group's universe,
    with ``gamma(r) = F(pos(r) + 1) - F(pos(r))``, ``pos`` the rank's place in the sorted
    universe, ``F(0) = 0`` and ``F(x) = mix(seed + x * golden)`` (splitmix64) for ``x > 0``. A run
    of consecutive places ``[a, b)`` sums to ``F(b) - F(a)``, and the universe of ``n`` ranks to
    ``F(n)``: the reference computes ``U = 2 F(n) + c`` without visiting the universe.
    """
    count = len(members)
    seeds = torch.tensor([_seeds(at.index, n, g.key) for n, _, g in members], dtype=torch.int64)
    seeds = seeds.view(count, LANES)
    coefficients = torch.zeros(count, LANES, dtype=torch.int64)
    rows, places, signs, constants = [], [], [], []
    positions: dict[frozenset[int], dict[int, int]] = {}
    for row, (name, h, group) in enumerate(members):
        weight = _digests.odd_weight("copies", at.index, name, *group.key)
        coefficients[row, 0] = _digests.signed(
            weight * (group.size - 1 if group.is_reference else -1)
        )
        universe = _ownership.universe(group, h, stage)
        if universe not in positions:
            positions[universe] = {r: i for i, r in enumerate(sorted(universe))}
        place = positions[universe]
        # -2 G(S_i) - 1 on every member; the reference adds 2 F(n) + c.
        runs = _runs(sorted(place[r] for r in group.share))
        points = [(b, -1) for _, b in runs] + [(a, 1) for a, _ in runs if a > 0]
        constant = -1
        if group.is_reference:
            points.append((len(universe), 1))
            constant += group.size
        rows += [row] * len(points)
        places += [x for x, _ in points]
        signs += [sign for _, sign in points]
        constants.append(constant)
    if count:
        values = _digests.mix(seeds[rows, 1:] + torch.tensor(places)[:, None] * _digests.GOLDEN)
        sums = torch.zeros(count, LANES - 1, dtype=torch.int64)
        sums.index_add_(0, torch.tensor(rows), values * torch.tensor(signs)[:, None])
        coefficients[:, 1:] = 2 * sums + torch.tensor(constants)[:, None]
    presence = (coefficients * _digests.mix(seeds)).sum(0)
    return coefficients, presence.tolist()


def _runs(places: list[int]) -> list[tuple[int, int]]:
    """Sorted ``places`` as maximal runs ``[a, b)`` of consecutive integers."""
    runs = []
    for _, run in itertools.groupby(enumerate(places), key=lambda item: item[1] - item[0]):
        values = [place for _, place in run]
        runs.append((values[0], values[-1] + 1))
    return runs


def _seeds(stage: int, name: str, key: tuple[int, ...]) -> list[int]:
    """``LANES`` 64-bit seeds of one group (as int64s), the same in every process."""
    digest = hashlib.blake2b(repr(("copies", stage, name, key)).encode(), digest_size=8 * LANES)
    return [
        _digests.signed(int.from_bytes(digest.digest()[8 * k : 8 * k + 8], "little"))
        for k in range(LANES)
    ]
