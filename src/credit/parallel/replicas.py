"""Replicas that stay replicas: prove every copy of every parameter, buffer and optimizer state
bit-identical, on any mix of meshes, in one small collective, and repair the copies that differ.

Legitimate replicas (DDP, HSDP's replicate dim, TP-replicated norms, domain peers) are
bit-identical after every optimizer step. They drift apart through a scaler that decides per mesh,
a rank restored from the wrong checkpoint shard, a nondeterministic kernel or silent data
corruption, and from then on every step is wrong on some ranks while the loss says nothing.

Which ranks hold copies of what is read from the rank maps, as the norm reads them
(``ownership``): a DTensor's placements on its mesh, plain tensors as copies over the stage, and
what ``distinct_along`` declares rank-local; a Partial DTensor's local values are addends of a
pending sum, not copies. Each rank digests the local tensors that have copies elsewhere
(``digests``: four 64-bit lanes ``D`` of their raw bits, on their device). In every group of ``c``
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

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from credit.parallel import _replicas
from credit.parallel._common import inputs as _inputs
from credit.parallel._common.groups import GroupLike
from credit.parallel._replicas import Mismatch

__all__ = ["Mismatch", "ReplicaMismatchError", "ReplicaReport", "verify_replicas"]

logger = logging.getLogger(__name__)


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
    request = _replicas.request(
        model,
        optimizer,
        distinct_along=distinct_along,
        pp_group=pp_group,
        buffers=buffers,
        repair=repair,
        repair_from=repair_from,
    )
    if not request.distributed:
        return ReplicaReport(len(request.entries), 0, 0, request.buffers)
    plan = _replicas.plan(request)
    proof = _replicas.prove(request, plan)
    report = ReplicaReport(
        len(request.entries), len(plan.compared), plan.digests.nbytes, request.buffers
    )
    if proof.proven:
        return report
    settled = _replicas.settle(request, plan, proof.prints)
    if settled.error is not None:
        raise ReplicaMismatchError(settled.error, settled.mismatches)
    if dist.get_rank() == 0:
        logger.warning("%s repaired %s", _replicas.WHAT, _replicas.listed(settled.mismatches))
    return dataclasses.replace(report, repaired=settled.mismatches)
