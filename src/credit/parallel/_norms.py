"""Gradient norms over any mix of meshes and pipeline stages, in one collective.

The one norm pipeline, behind ``total_grad_norm``, ``clip_grad_norm_`` and ``grad_norm_report``:

1. Each rank takes the norm of each of its local shards with torch's kernels, in torch's
   (device, dtype) order, after completing Partial gradients (``_partial``).
2. Each contribution is weighted by ``1 / copies`` of its shard (``_ownership``), so one all_reduce
   over the world counts every distinct element once, and a NaN or inf in any copy reaches every
   rank. The inf norm needs no weights: the largest copy is the largest element.
3. Within a single stage every rank holds the same gradients, so the all_reduce completes the vector
   of per-gradient p-th powers (MAX for inf) and the norm of that vector is the total: torch's
   operations in torch's order, so a layout without copies (FSDP2 over the whole world) gives
   torch's bits.
4. Pipeline stages hold different gradients, so each rank sends one float64 number per segment
   (the whole norm, or one per report group), the self-check's terms beside them, in the same
   all_reduce.
5. The first call for a layout (and every call in check mode) also proves it, in one more
   all_reduce: the self-check of the copy counts and the comparison of the copies' values
   (``_copies``). Under pipeline stages it follows the norm's all_reduce, which tells every rank
   whether any stage meets its layout for the first time.
6. Listeners (``_norm_hooks``) read every norm's result, the GradScaler's flags among them; they
   never change what the norm computes.

Every rank issues the same collectives, decided by the world, ``pp_group`` and the layout that all
ranks of a stage share, never by what one rank happens to hold.
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from credit.parallel import _copies, _inputs, _norm_hooks, _ownership, _partial
from credit.parallel._compat import foreach_norm, local_tensor
from credit.parallel._foreach import group_indices_by_device_and_dtype, use_foreach
from credit.parallel._groups import (
    GroupLike,
    collective_device,
    group_size,
    is_distributed,
    moves_data,
    resolve_group,
)
from credit.parallel._inputs import DistinctAlong
from credit.parallel._layout_check import check_enabled, verify_same_layout
from credit.parallel._ownership import Holding, Stages

# Layouts whose plans are kept (a training loop uses one or two: the clip's and the report's).
_MAX_LAYOUTS = 64


@dataclass(frozen=True)
class NormRequest:
    """The arguments of one norm call, checked and resolved.

    Attributes:
        order: the p of the p-norm (``math.inf`` for the max norm).
        foreach: use the foreach kernels (None: where the device supports them).
        dtype: accumulation dtype of the per-gradient norms, or None for torch's.
        pp_group: this rank's pipeline group, or None.
        distinct: for each gradient, the ranks along which its copies differ (None: replicas),
            or None when no gradient is declared distinct.
        check: verify the layout across ranks and the copies on this call.
        per_rank: each rank norms its own gradients alone (ranks that train independent models).
        what: the public function, for messages.
        label: names gradient ``i`` in messages (its parameter's name, or its place in the call).
    """

    order: float
    foreach: bool | None
    dtype: torch.dtype | None
    pp_group: ProcessGroup | None
    distinct: list[frozenset[int] | None] | None
    check: bool
    per_rank: bool
    what: str
    label: Callable[[int], str]


def request(
    grads: list[Tensor],
    norm_type: float | str,
    foreach: bool | None,
    pp_group: GroupLike,
    distinct_along: DistinctAlong | None,
    dtype: torch.dtype | None,
    check: bool | None,
    what: str = "total_grad_norm",
    *,
    per_rank: bool = False,
    label: Callable[[int], str] | None = None,
) -> NormRequest:
    """The norm arguments, checked before any collective and resolved.

    Args:
        grads: the gradients to norm.
        norm_type, foreach, pp_group, distinct_along, dtype, check, per_rank: as for
            ``total_grad_norm``.
        what: the public function, for messages.
        label: names gradient ``i`` in messages. Default: ``grads[i]``.

    Raises:
        TypeError, ValueError: as for ``total_grad_norm``.
    """
    order = _inputs.norm_order(norm_type)
    _inputs.check_grads(grads, "grads")
    if per_rank:
        _inputs.check_per_rank(grads, pp_group, distinct_along)
    pp_process_group = resolve_group(pp_group, "pp_group")
    return NormRequest(
        order=order,
        foreach=foreach,
        dtype=dtype,
        pp_group=pp_process_group if group_size(pp_process_group) > 1 else None,
        distinct=_inputs.distinct_groups(distinct_along, grads),
        check=check_enabled(check) and is_distributed(),
        per_rank=per_rank,
        what=what,
        label=label if label is not None else _grad_label,
    )


def _grad_label(index: int) -> str:
    return f"grads[{index}]"


@dataclass
class Reduced:
    """The result of the pipeline.

    Attributes:
        total: the norm of all the gradients, as a plain scalar in the result dtype.
        entries: the global norm of each entry: each gradient (in ``entry_inputs`` order) within a
            single stage, or each segment under pipeline stages.
        entry_inputs: the input index of each entry (single stage), or None (segments).
        present: under pipeline stages, how many ranks hold gradients of each segment.
        local: each gradient's local tensor, in input order.
        groups: the indices of ``local`` by (device, dtype), in torch's order, with the device.
        local_norms: this rank's norm of each local tensor (before any reduction), in torch's
            stacking order, and ``local_inputs`` the input index of each; None without any.
        answers_world: whether listeners may read the world's answers from it (see
            ``_norm_hooks.Normed``).
    """

    total: Tensor
    entries: Tensor
    entry_inputs: list[int] | None
    present: Tensor | None
    local: list[Tensor]
    groups: list[tuple[torch.device, list[int]]]
    local_norms: Tensor | None = None
    local_inputs: list[int] | None = None
    answers_world: bool = False


def reduce(
    grads: list[Tensor],
    request: NormRequest,
    segment_of: list[int] | None = None,
    segment_count: int = 1,
) -> Reduced:
    """Run the pipeline on ``grads`` (see the module docstring).

    Args:
        grads: gradients, plain or DTensor, checked by ``_inputs.check_grads``.
        request: the call's arguments.
        segment_of: under pipeline stages, the segment of each gradient (default: all in one).
        segment_count: the number of segments, the same on every rank.

    Raises:
        ValueError: the gradients' layout cannot be reduced (raised on every rank).
        RuntimeError: the self-check or the check mode failed (raised on every rank).
    """
    reduced = _reduce(grads, request, segment_of, segment_count)
    listeners = _norm_hooks.attached()
    if listeners:
        normed = _norm_hooks.Normed(
            local=reduced.local,
            local_norms=reduced.local_norms,
            stacked_inputs=reduced.local_inputs or [],
            entries=reduced.entries if reduced.answers_world and reduced.entry_inputs else None,
            total=reduced.total,
            answers_world=reduced.answers_world,
        )
        for listener in listeners:
            listener.normed(normed)
    return reduced


def _reduce(
    grads: list[Tensor], request: NormRequest, segment_of: list[int] | None, segment_count: int
) -> Reduced:
    local = [local_tensor(g) for g in grads]
    if not is_distributed() or dist.get_world_size() == 1 or request.per_rank:
        return _local_norms(local, request, _result_dtype(grads, request.dtype))
    at = _ownership.stages_of(request.pp_group)
    held = [_ownership.holding(g) for g in grads]
    if request.check:
        _check_same_layout(held, request, at, collective_device(local))
    # Plain replicas (DDP), once proven to be copies: each rank's norm is the norm, as torch
    # takes it, with no collective.
    replicas = at.count == 1 and request.distinct is None and all(h.mesh is None for h in held)
    if not replicas and not request.order > 0:
        raise ValueError(
            f"norm_type must be positive or inf for distributed grads, got {request.order}"
        )
    layout = _layout(held, local, at, request.distinct)
    result_dtype = request.dtype or layout.grads_dtype
    if at.count == 1 and (not layout.verified or request.check):  # the same on every rank
        _verify(layout, local, request, at)
    if replicas:
        return _local_norms(local, request, _result_dtype(grads, request.dtype))
    if at.count == 1:
        return _single_stage(local, layout, request, result_dtype)
    segments = segment_of if segment_of is not None else [0] * len(grads)
    return _pipeline(local, layout, request, at, result_dtype, segments, segment_count)


def _result_dtype(grads: list[Tensor], dtype: torch.dtype | None) -> torch.dtype:
    """The dtype torch's stacked norm would have; the same on every rank of one layout."""
    if dtype is not None:
        return dtype
    return _promoted({g.dtype for g in grads})


def _promoted(dtypes: set[torch.dtype]) -> torch.dtype:
    if not dtypes:
        return torch.get_default_dtype()
    return functools.reduce(torch.promote_types, dtypes).to_real()


# ---------------------------------------------------------------------------------------------
# local norms: torch's get_total_norm


def _local_norms(local: list[Tensor], request: NormRequest, result_dtype: torch.dtype) -> Reduced:
    groups = _torch_order(local)
    stacked, inputs = _stacked_norms(local, groups, request)
    if stacked is None:
        zero = torch.zeros((), dtype=result_dtype)
        return Reduced(zero, zero.new_zeros(0), [], None, local, groups)
    total = torch.linalg.vector_norm(stacked, request.order)
    return Reduced(total, stacked, inputs, None, local, groups, stacked, inputs)


def _torch_order(local: list[Tensor]) -> list[tuple[torch.device, list[int]]]:
    """The indices of ``local`` grouped by (device, dtype), in the order torch stacks norms."""
    if not local:
        return []
    grouped = group_indices_by_device_and_dtype(local)
    return [(device, indices) for (device, _), indices in grouped.items()]


def _stacked_norms(
    local: list[Tensor], groups: list[tuple[torch.device, list[int]]], request: NormRequest
) -> tuple[Tensor | None, list[int]]:
    """Each local tensor's norm, stacked in torch's order, and the input index of each entry.

    Empty tensors get a zero under the inf norm, where torch's kernels raise on them: a 1-row
    weight sharded over two ranks leaves one of them an empty shard.
    """
    if not local:
        return None, []
    order, dtype = request.order, request.dtype
    norms: list[Tensor] = []
    inputs: list[int] = []
    for device, indices in groups:
        tensors = [local[i] for i in indices]
        if order == math.inf and any(t.numel() == 0 for t in tensors):
            keep = [t.numel() > 0 for t in tensors]
            kept = iter(_norms_of([t for t in tensors if t.numel()], request, device))
            zero = torch.zeros((), dtype=dtype or tensors[0].dtype.to_real(), device=device)
            norms.extend(next(kept) if k else zero for k in keep)
        else:
            norms.extend(_norms_of(tensors, request, device))
        inputs.extend(indices)
    first_device = local[0].device
    if any(device != first_device for device, _ in groups):  # .to() is a dispatch per norm
        norms = [n.to(first_device) for n in norms]
    return torch.stack(norms), inputs


def _norms_of(tensors: list[Tensor], request: NormRequest, device: torch.device) -> list[Tensor]:
    if not tensors:
        return []
    order, dtype = request.order, request.dtype
    if use_foreach(request.foreach, tensors, device):
        return foreach_norm(tensors, order, dtype)
    return [torch.linalg.vector_norm(t, order, dtype=dtype) for t in tensors]


# ---------------------------------------------------------------------------------------------
# the plan of one layout, kept between calls


@dataclass(eq=False)
class _Layout:
    """What a layout's reduction needs, computed on its first call.

    ``held`` keeps the Holding objects alive, so the ids in the cache key stay theirs.
    """

    held: list[Holding]
    distinct: list[frozenset[int] | None]
    groups: list[tuple[torch.device, list[int]]]
    grads_dtype: torch.dtype  # the promotion of the gradients' dtypes, as torch's norm has it
    weights: list[float]  # per input gradient
    error: str | None
    coverage: list[int]  # per input gradient
    has_partial: bool
    verified: bool = False
    _weight_tensors: dict[tuple, Tensor | None] = field(default_factory=dict)

    def weight_tensor(
        self, inputs: list[int], dtype: torch.dtype, device: torch.device
    ) -> Tensor | None:
        """The weights in stacking order, as a tensor (None when every weight is 1)."""
        key = (dtype, device)
        if key not in self._weight_tensors:
            stacked = [self.weights[i] for i in inputs]
            trivial = all(w == 1.0 for w in stacked)
            self._weight_tensors[key] = (
                None if trivial else torch.tensor(stacked, dtype=dtype, device=device)
            )
        return self._weight_tensors[key]


_layouts: OrderedDict[tuple, _Layout] = OrderedDict()


def _layout(
    held: list[Holding],
    local: list[Tensor],
    at: Stages,
    distinct: list[frozenset[int] | None] | None,
) -> _Layout:
    key = (tuple(map(id, held)), at, tuple(distinct) if distinct is not None else None)
    found = _layouts.get(key)
    if found is not None:
        _layouts.move_to_end(key)
        return found
    distinct = distinct if distinct is not None else [None] * len(held)
    errors = (_ownership.layout_error(h, at, d) for h, d in zip(held, distinct, strict=True))
    error = next((e for e in errors if e is not None), None) or _partial.unsupported(held)
    layout = _Layout(
        held=held,
        distinct=distinct,
        groups=_torch_order(local),
        grads_dtype=_promoted({h.dtype for h in held}),
        weights=[_ownership.weight(h, at, d) for h, d in zip(held, distinct, strict=True)],
        error=error,
        coverage=[_ownership.coverage(h, at) for h in held],
        has_partial=any(h.partial_dims for h in held),
    )
    _layouts[key] = layout
    if len(_layouts) > _MAX_LAYOUTS:
        _layouts.popitem(last=False)
    return layout


# ---------------------------------------------------------------------------------------------
# a single stage: the per-gradient vector


def _single_stage(
    local: list[Tensor],
    layout: _Layout,
    request: NormRequest,
    result_dtype: torch.dtype,
) -> Reduced:
    device = collective_device(local)
    completed = _partial.complete(local, layout.held) if layout.has_partial else local
    stacked, inputs = _stacked_norms(completed, layout.groups, request)
    if stacked is None:  # no gradients on any rank (the layout is shared)
        zero = torch.zeros((), dtype=result_dtype, device=device)
        return Reduced(zero, zero.new_zeros(0), [], None, local, layout.groups)
    order = request.order
    if order == math.inf:
        entries = _max_over_ranks(stacked.to(result_dtype))
    else:
        weights = layout.weight_tensor(
            inputs, torch.promote_types(result_dtype, torch.float32), device
        )
        # Copies weighted by fractions are summed in float32 at least; without copies the vector
        # is reduced in torch's dtype, as torch reduces it.
        reduce_dtype = result_dtype if weights is None else weights.dtype
        # DTensor skips the power for p=1, and so do we, to keep its bits.
        powered = stacked.to(reduce_dtype) ** order if order != 1 else stacked.to(reduce_dtype)
        if weights is not None:
            powered = powered * weights
        dist.all_reduce(powered, op=dist.ReduceOp.SUM)
        entries = powered ** (1.0 / order) if order != 1 else powered
    total = torch.linalg.vector_norm(entries, order).to(result_dtype)
    return Reduced(
        total,
        entries,
        inputs,
        None,
        local,
        layout.groups,
        local_norms=stacked,
        local_inputs=inputs,
        answers_world=True,
    )


def _max_over_ranks(norms: Tensor) -> Tensor:
    """The element-wise max of ``norms`` over the world; NaN wherever any rank has one.

    gloo's MAX keeps its first operand when the other is NaN, so each entry's NaN flag travels
    beside it, in the same collective.
    """
    nan = torch.isnan(norms)
    both = torch.stack([torch.where(nan, 0.0, norms), nan.to(norms.dtype)])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return torch.where(both[1] > 0, math.nan, both[0])


# ---------------------------------------------------------------------------------------------
# the first call for a layout: the self-check and the copies


def _verify(layout: _Layout, local: list[Tensor], request: NormRequest, at: Stages) -> None:
    """Prove the layout in one float64 all_reduce, raising on every rank when it fails.

    Two things are proven: the self-check (every rank of a stage holds a shard of every gradient
    on its own copy of the mesh: the terms of ``_ownership.coverage`` sum to zero), and that the
    ranks taken for copies of a shard hold the same values (``_copies``). Sums run per gradient
    within a stage, per stage across stages. A NaN or inf leaves the copies unproven until a
    later call: the norm is not finite then anyway. Every rank must call it together: within a
    stage on the first call for the layout they share, across stages when any stage asks (see
    :func:`_pipeline`).
    """
    device = collective_device(local)
    if at.count == 1:
        slot_count = len(layout.held)
        coverage = torch.tensor(layout.coverage, dtype=torch.float64, device=device)
    else:  # the stages hold different gradients: one sum per stage
        slot_count = at.count
        coverage = torch.zeros(slot_count, dtype=torch.float64, device=device)
        coverage[at.index] = sum(layout.coverage)
    copies = (
        None if layout.error is not None else _copies_plan(layout, at, request.pp_group, device)
    )
    fingerprints = torch.zeros(slot_count, _copies.WIDTH, dtype=torch.float64, device=device)
    nonfinite = False
    if copies is not None:
        fingerprints, nonfinite = _copies.terms(copies, local, device)
    flags = torch.tensor([layout.error is not None, nonfinite], dtype=torch.float64, device=device)
    vector = torch.cat([coverage, flags, fingerprints.flatten()])
    dist.all_reduce(vector, op=dist.ReduceOp.SUM)
    if not moves_data():
        layout.verified = True
        return
    coverage, flags, fingerprints = vector.split([slot_count, 2, fingerprints.numel()])
    if bool(coverage.abs().ge(0.5).any()) or flags[0] > 0:  # integers, exact in float64
        _raise_layout_failure(layout, at, request.what)
    if flags[1] > 0:
        return
    assert copies is not None
    if not _copies.agree(fingerprints.view(slot_count, _copies.WIDTH)):
        mine = _copies.records(copies, layout.held, local, at.index, request.label)
        _copies.raise_mismatch(mine, at.index, len(layout.held), request.what)
    layout.verified = True


def _copies_plan(
    layout: _Layout, at: Stages, pp_group: ProcessGroup | None, device: torch.device
) -> _copies.Plan:
    lowest = _ownership.lowest_rank_of_stage(at, pp_group, device)
    groups = [
        _ownership.copy_group(held, at, lowest, distinct)
        for held, distinct in zip(layout.held, layout.distinct, strict=True)
    ]
    if at.count == 1:
        return _copies.plan(layout.held, groups, list(range(len(groups))), len(groups))
    return _copies.plan(layout.held, groups, [at.index] * len(groups), at.count)


# ---------------------------------------------------------------------------------------------
# pipeline stages: one float64 number per segment


# The result dtypes a stage can vote for; the stages agree on their promotion, so that every rank
# returns the same dtype and bits even where stages hold gradients of different dtypes (or none).
_RESULT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _pipeline(
    local: list[Tensor],
    layout: _Layout,
    request: NormRequest,
    at: Stages,
    result_dtype: torch.dtype,
    segment_of: list[int],
    segment_count: int,
) -> Reduced:
    device = collective_device(local)
    order = request.order
    values = torch.zeros(segment_count, dtype=torch.float64, device=device)
    present = torch.zeros_like(values)
    votes = torch.zeros(len(_RESULT_DTYPES), dtype=torch.float64, device=device)
    local_norms, inputs = None, None
    if local and layout.error is None:  # a broken layout sends zeros beside its flag
        completed = _partial.complete(local, layout.held) if layout.has_partial else local
        stacked, inputs = _stacked_norms(completed, layout.groups, request)
        assert stacked is not None
        local_norms = stacked
        stacked = stacked.to(values)
        segments = torch.tensor([segment_of[i] for i in inputs], device=device)
        present[segments] = 1.0
        votes[_RESULT_DTYPES.index(result_dtype)] = 1.0
        if order == math.inf:
            values.scatter_reduce_(0, segments, stacked, reduce="amax")
        else:
            weights = stacked.new_tensor([layout.weights[i] for i in inputs])
            values.index_add_(0, segments, stacked**order * weights)
    broken = values.new_tensor([float(layout.error is not None)])
    # Stages hold different layouts, seen for the first time on different calls: any stage's
    # first call (or the check mode) makes every rank verify, after this collective.
    unverified = values.new_tensor([float(not layout.verified or request.check)])
    # What the listeners could not answer from this stage's gradients; with none anywhere, every
    # rank lets them read the answers (the slot is there, and zero, without listeners).
    unanswered = values.new_tensor(
        [float(sum(listener.unanswered(local) for listener in _norm_hooks.attached()))]
    )
    if order == math.inf:
        nan = torch.isnan(values)
        vector = torch.cat(
            [
                torch.where(nan, 0.0, values),
                nan.to(values),
                present,
                votes,
                broken,
                unverified,
                unanswered,
            ]
        )
        dist.all_reduce(vector, op=dist.ReduceOp.MAX)
        values, nan, present, votes, checks, unverified, unanswered = vector.split(
            [segment_count] * 3 + [len(votes), 1, 1, 1]
        )
        entries = torch.where(nan > 0, math.nan, values)
        total = entries.max()  # NaN if any entry is
    else:
        # The self-check's terms sum to zero over the world when every stage holds whole copies.
        residual = values.new_tensor([sum(layout.coverage)])
        vector = torch.cat([values, present, votes, residual, broken, unverified, unanswered])
        dist.all_reduce(vector, op=dist.ReduceOp.SUM)
        values, present, votes, checks, unverified, unanswered = vector.split(
            [segment_count] * 2 + [len(votes), 2, 1, 1]
        )
        entries = values ** (1.0 / order)
        total = values.sum() ** (1.0 / order)
    if bool(checks.ne(0).any()) and moves_data():
        _raise_layout_failure(layout, at, request.what)
    if bool(unverified > 0):
        _verify(layout, local, request, at)
    if request.dtype is None:
        voted = [dtype for dtype, vote in zip(_RESULT_DTYPES, votes.tolist(), strict=True) if vote]
        result_dtype = (
            functools.reduce(torch.promote_types, voted, voted[0]) if voted else result_dtype
        )
    return Reduced(
        total.to(result_dtype),
        entries,
        None,
        present,
        local,
        layout.groups,
        local_norms=local_norms,
        local_inputs=inputs,
        answers_world=not bool(unanswered > 0),
    )


# ---------------------------------------------------------------------------------------------
# failures, described the same way on every rank


def _raise_layout_failure(layout: _Layout, at: Stages, what: str) -> None:
    """Gather every rank's view of the layout and raise the same error on every rank."""
    mine = (
        at.index,
        at.is_reference,
        layout.error,
        [(h.description, len(h.mesh_ranks), h.replicas, h.global_numel) for h in layout.held],
        layout.coverage,
    )
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for rank, (_, _, error, _, _) in enumerate(everyone):
        if error is not None:
            raise ValueError(f"{what}: {error} (rank {rank}). No gradient was modified.")
    raise RuntimeError(_describe_missing_copies(everyone, at, what))


def _describe_missing_copies(everyone: list, at: Stages, what: str) -> str:
    for stage in range(at.count):
        ranks = [view for view in everyone if view[0] == stage]
        reference = next((view for view in ranks if view[1]), ranks[0] if ranks else None)
        if reference is None:
            continue
        for index, (description, mesh_size, replicas, numel) in enumerate(reference[3]):
            held = sum(
                view[4][index] + (at.size * replicas * numel if view[1] else 0)
                for view in ranks
                if index < len(view[4])
            )
            expected = at.size * replicas * numel
            if held != expected:
                return (
                    f"{what}: cannot count gradient {index} ({description}) exactly once: "
                    f"its mesh has {mesh_size} ranks, so the {at.size} ranks of "
                    f"{'stage ' + str(stage) if at.count > 1 else 'the world'} should hold "
                    f"{at.size // max(mesh_size, 1)} copies of it, but they hold "
                    f"{held / (mesh_size * replicas * numel) if numel else 0:g}. Every rank "
                    "of a stage must hold every gradient of the stage, each on its own copy of "
                    "the mesh; pass pipeline stages as pp_group. No gradient was modified."
                )
    return (
        f"{what}: the ranks' gradients do not add up to whole copies of each gradient. "
        "No gradient was modified."
    )


# ---------------------------------------------------------------------------------------------
# check mode


def _check_same_layout(
    held: list[Holding], request: NormRequest, at: Stages, device: torch.device
) -> None:
    layout = [h.description for h in held]
    settings = (
        f"norm_type={request.order} dtype={request.dtype} stages={at.count} "
        f"per_rank={request.per_rank}"
    )
    verify_same_layout(layout, None, device, request.what, settings, stage=(at.index, at.count))
