"""A GradScaler's non-finite flags: one per optimizer, answered for the world by a norm or by one
collective of its own.

At ``unscale_`` a :class:`~credit.parallel.amp.GradScaler` leaves one :class:`Flag` per optimizer:
the local gradients it checked and this rank's answer. Its :class:`StepFlags` listen to the norms
and clips of the package (``hooks``) while a flag is live:

- A norm over the world answers a flag when its gradients hold every gradient of the flag on this
  rank (found by identity, or by memory for a detached view): the flag is up when the world's norm
  of any of them is non-finite, which a NaN or inf in any copy or shard on any rank makes it. This
  reads the norm's reduced values; the norm computes nothing more and returns what it returns
  without a scaler. A flag the norm does not cover stays pending, for a later norm or for one
  all_reduce of its own at ``step``.
- Under pipeline stages a norm reduces one number per stage: it answers the flags only when no rank
  has a flag it does not cover (a slot of its collective counts them), and all of them alike:
  whether the norm is finite.
- A clip whose coefficient is not finite (a NaN or negative ``max_norm``, or a NaN norm) writes NaN
  into every gradient it scales: every flag holding one of them is spoiled, and its step skipped.
- Every norm that runs while a flag is live is kept, for a skipped step's report: the first norm
  that saw a gradient tells whether it was non-finite then, before any clip changed it.

Which norm answers a flag depends on the order of the calls and on the gradients passed, which
every rank of a stage shares (the norm's own collectives require it), never on values: the ranks
issue the same collectives. A flag that no norm answered costs one all_reduce when the scaler
needs its answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from credit.parallel import _norm
from credit.parallel._common.compat import group_by_device_and_dtype
from credit.parallel._common.groups import world_of_one


def check(grads: list[Tensor], device: torch.device) -> Tensor:
    """1.0 when a NaN or inf is in ``grads``, else 0.0: a float32 scalar on ``device``."""
    return check_and_unscale(grads, torch.ones((), dtype=torch.float32, device=device))


def check_and_unscale(grads: list[Tensor], inv_scale: Tensor) -> Tensor:
    """Multiply ``grads`` by ``inv_scale`` in place with torch's AMP kernel, per (device, dtype),
    and return this rank's answer: 1.0 when a NaN or inf is in ``grads``, else 0.0, a float32
    scalar on ``inv_scale``'s device."""
    found = torch.zeros((), dtype=torch.float32, device=inv_scale.device)
    for (device, _), group in group_by_device_and_dtype(grads).items():
        found_here = torch.zeros((), dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(group, found_here, inv_scale.to(device))
        found = torch.maximum(found, found_here.to(found.device))
    return found


@dataclass(eq=False)
class Flag:
    """Whether one optimizer's gradients hold a NaN or inf, on this rank and in the world.

    Attributes:
        grads: the local gradients (DTensors' local shards) the flag covers.
        device: where the answers live (the scaler's device).
        local: this rank's answer, 1.0 when a gradient holds a NaN or inf; None until checked.
        world: the answer of every rank together (the same on every rank), once known.
        spoiled: 1.0 when a clip wrote NaN into one of ``grads`` since ``unscale_``; None while
            no clip touched them. Already folded into ``local`` or ``world``; kept for the report.
        seen: the norms that ran while the flag was live, the first first.
    """

    grads: list[Tensor]
    device: torch.device
    local: Tensor | None = None
    world: Tensor | None = None
    spoiled: Tensor | None = None
    seen: list[_norm.NormEvent] = field(default_factory=list)


class StepFlags:
    """One scaler's flags, by optimizer, answered by the norms while any is live.

    It attaches itself to the norms (``hooks``) when a flag is expected and detaches when
    the flags are cleared, so norms outside a scaler's step pay nothing, and two scalers never
    read or answer each other's flags.
    """

    def __init__(self) -> None:
        self._flags: dict[int, Flag] = {}

    def expect(
        self, key: int, grads: list[Tensor], device: torch.device, local: Tensor | None
    ) -> None:
        """Register the flag of optimizer ``key``, which the next norm covering it answers."""
        self._flags[key] = Flag(grads, device, local)
        _norm.attach(self)

    def get(self, key: int) -> Flag | None:
        return self._flags.get(key)

    def optimizers(self) -> list[int]:
        """The optimizers with a flag, in the order their flags were expected."""
        return list(self._flags)

    def clear(self) -> None:
        """Drop every flag (at ``update``) and stop listening."""
        self._flags.clear()
        _norm.detach(self)

    def world_answer(self, key: int) -> Tensor:
        """The answer of every rank for optimizer ``key``: a norm's, or one all_reduce (MAX) of
        its own now."""
        flag = self._flags[key]
        if flag.world is None:
            answer = local_answer(flag).clone()
            if not world_of_one():
                dist.all_reduce(answer, op=dist.ReduceOp.MAX)
            flag.world = answer
        return flag.world

    # --- the norms' listener ------------------------------------------------------------------

    def unanswered(self, local: list[Tensor]) -> int:
        where = _Where(local)
        return sum(where.inputs(flag.grads) is None for flag in self._pending())

    def normed(self, normed: _norm.NormEvent) -> None:
        for flag in self._flags.values():
            flag.seen.append(normed)
        pending = self._pending()
        if not (normed.answers_world and pending):
            return
        where = _Where(normed.local)
        for flag in pending:
            inputs = where.inputs(flag.grads)
            if inputs is not None:
                flag.world = _nonfinite(normed, inputs).to(flag.device)

    def scaled(self, local: list[Tensor], coefficient: Tensor) -> None:
        if not self._flags:
            return
        where = _Where(local)
        spoils = (~torch.isfinite(coefficient)).to(torch.float32)
        for flag in self._flags.values():
            if not any(where.find(grad) is not None for grad in flag.grads):
                continue
            here = spoils.to(flag.device)
            flag.spoiled = here if flag.spoiled is None else torch.maximum(flag.spoiled, here)
            # A pending flag carries it in its own answer to the world; a flag with no local
            # answer yet checks its gradients, NaN now, when asked.
            if flag.world is not None:
                flag.world = torch.maximum(flag.world, here)
            elif flag.local is not None:
                flag.local = torch.maximum(flag.local, here)

    def _pending(self) -> list[Flag]:
        return [flag for flag in self._flags.values() if flag.world is None]


def local_answer(flag: Flag) -> Tensor:
    """This rank's answer, checked now if it was left to a norm."""
    if flag.local is None:
        flag.local = check(flag.grads, flag.device)
    return flag.local


def nonfinite(flag: Flag) -> list[bool]:
    """Which of ``flag.grads`` held a NaN or inf on this rank (for a skipped step's report): as
    the first norm that saw each one found it, before any clip scaled it; a gradient no norm saw
    is read now (no norm of the package changed it)."""
    seen = [_Seen(normed) for normed in flag.seen]
    found = []
    for grad in flag.grads:
        local_norm = next((n for s in seen if (n := s.local_norm(grad)) is not None), None)
        tensor = local_norm if local_norm is not None else grad
        found.append(not bool(torch.isfinite(tensor).all()))
    return found


def _nonfinite(normed: _norm.NormEvent, inputs: list[int]) -> Tensor:
    """Whether the world's norm of any gradient ``inputs`` of ``normed`` is non-finite: 1.0 or 0.0
    (the total's answer under pipeline stages, which reduce no norm per gradient)."""
    if normed.entries is None:
        return (~torch.isfinite(normed.total)).to(torch.float32)
    if not inputs:
        return torch.zeros((), dtype=torch.float32, device=normed.total.device)
    entries = normed.entries.index_select(0, normed.positions(inputs))
    return (~torch.isfinite(entries)).any().to(torch.float32)


def _memory(tensor: Tensor) -> tuple:
    """Where ``tensor``'s elements are. The storage and offset, not ``data_ptr()``, which is 0 for
    every empty tensor: an empty shard must be found too, or ranks would read different entries."""
    storage = tensor.untyped_storage().data_ptr()
    return (
        tensor.device,
        tensor.dtype,
        storage,
        tensor.storage_offset(),
        tensor.shape,
        tensor.stride(),
    )


class _Where:
    """Where each tensor of a norm's (or a clip's) list is: by identity, or by memory, which a
    detached view (``param.grad.detach()``) shares with its gradient."""

    def __init__(self, tensors: list[Tensor]) -> None:
        self._tensors = tensors
        self._by_id = {id(tensor): index for index, tensor in enumerate(tensors)}
        self._by_memory: dict[tuple, int] | None = None

    def find(self, tensor: Tensor) -> int | None:
        """The input index of ``tensor``, or None when the list does not hold it."""
        index = self._by_id.get(id(tensor))
        if index is not None:
            return index
        if self._by_memory is None:
            self._by_memory = {_memory(t): i for i, t in enumerate(self._tensors)}
        return self._by_memory.get(_memory(tensor))

    def inputs(self, grads: list[Tensor]) -> list[int] | None:
        """The input index of each of ``grads``, or None when one is missing. Every rank then reads
        the entries of the same gradients, whichever of them it holds an empty shard of."""
        found = []
        for grad in grads:
            index = self.find(grad)
            if index is None:
                return None
            found.append(index)
        return found


class _Seen:
    """This rank's norm of each gradient one norm saw, found as :class:`_Where` finds them."""

    def __init__(self, normed: _norm.NormEvent) -> None:
        self._where = _Where(normed.local)
        self._norms = normed.local_norms
        self._position = {index: position for position, index in enumerate(normed.stacked_inputs)}

    def local_norm(self, grad: Tensor) -> Tensor | None:
        """This rank's norm of ``grad``, or None when the norm did not see it."""
        index = self._where.find(grad)
        if index is None or self._norms is None:
            return None
        return self._norms[self._position[index]]
