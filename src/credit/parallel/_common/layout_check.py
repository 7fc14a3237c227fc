"""Opt-in check that every rank passes the same gradient layout, before any data moves.

Ranks that disagree on the number, shape or dtype of the tensors they reduce issue mismatched
collectives: gloo aborts the process, NCCL hangs or corrupts. The check reduces a digest of each
rank's layout with one small all_reduce (MAX of the digest and of its negation, so every rank
learns both the largest and the smallest digest); only when they differ, which every rank then
knows, are the full layouts gathered to name the first differing gradient.

Pipeline stages hold different gradients by design: each stage's digests travel in a slot of
their own, so ranks are compared with the other ranks of their stage only, while the settings
(arguments such as the norm type) are compared across all stages.

Averaging also runs the check, without the opt-in, on the first call for each layout and group.

A gradient that one rank refuses on its own (left on the meta device, sparse, of an integer dtype)
would make that rank raise while the others wait in the next collective: before the norms' check,
:func:`refuse_on_every_rank` hands the refusal of the lowest such rank to every rank.
"""

from __future__ import annotations

import hashlib
import os

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

ENV_VAR = "CREDIT_PARALLEL_CHECK"


def check_enabled(check: bool | None) -> bool:
    """``check`` if given, else whether ``CREDIT_PARALLEL_CHECK`` is set to a true value."""
    if check is not None:
        return check
    return os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


def _digest(settings: str, layout: list[str]) -> int:
    """A 62-bit digest, so that its negation fits in an int64."""
    text = "\n".join([settings, *layout])
    raw = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little") >> 2


# Fills the slots of the stages a rank is not in; MAX over it leaves the other stages' values.
_NEUTRAL = torch.iinfo(torch.int64).min


def verify_same_layout(
    layout: list[str],
    group: ProcessGroup | None,
    device: torch.device,
    what: str,
    settings: str = "",
    stage: tuple[int, int] = (0, 1),
    hint: str = "",
) -> None:
    """Raise RuntimeError on every rank of ``group`` unless the ranks of each stage passed the
    same layout and all ranks the same settings.

    Args:
        layout: one description per gradient, e.g. ``"shape=(4, 8) dtype=torch.float32"``.
        group: the group whose ranks are compared (None for the world).
        device: where the digest tensor lives (CUDA for NCCL groups).
        what: the function being checked, for the message.
        settings: arguments that must also agree (e.g. ``"bucket_cap_mb=25"``).
        stage: ``(this rank's stage, number of stages)``; layouts are compared within a stage.
        hint: a likely cause, appended to the message of a layout difference.

    Raises:
        RuntimeError: on every rank of ``group``, naming the first difference.
    """
    index, count = stage
    slots = torch.full((count + 1, 4), _NEUTRAL, dtype=torch.int64)
    slots[index] = torch.tensor(_extremes(len(layout), _digest("", layout)))
    slots[count] = torch.tensor(_extremes(0, _digest(settings, [])))
    slots = slots.to(device)
    dist.all_reduce(slots, op=dist.ReduceOp.MAX, group=group)
    largest, negated_smallest = slots[:, :2], slots[:, 2:]
    held = slots[:, 0] != _NEUTRAL  # a stage no rank of ``group`` is in
    if torch.equal(largest[held], -negated_smallest[held]):
        return
    everyone = _gather_layouts((index, settings, layout), group)
    message = _describe_mismatch(everyone, what)
    raise RuntimeError(f"{message} {hint}" if hint else message)


def _extremes(count: int, digest: int) -> list[int]:
    return [count, digest, -count, -digest]


def _gather_layouts(
    mine: tuple[int, str, list[str]], group: ProcessGroup | None
) -> dict[int, tuple[int, str, list[str]]]:
    """Every rank's (stage, settings, layout), by global rank."""
    gathered: list[tuple[int, tuple[int, str, list[str]]] | None] = [None] * dist.get_world_size(
        group
    )
    dist.all_gather_object(gathered, (dist.get_rank(), mine), group=group)
    return dict(entry for entry in gathered if entry is not None)


def _describe_mismatch(everyone: dict[int, tuple[int, str, list[str]]], what: str) -> str:
    """The first difference from the lowest rank of each stage: the same text on every rank."""
    first_rank = min(everyone)
    first_settings = everyone[first_rank][1]
    for rank in sorted(everyone):
        stage, settings, _ = everyone[rank]
        if settings != first_settings:
            return (
                f"{what}: ranks passed different arguments, so their collectives would not "
                f"match: rank {first_rank} has {first_settings}, rank {rank} has {settings}. "
                "No gradient was modified."
            )
    staged = any(stage for stage, _, _ in everyone.values())
    for rank in sorted(everyone):
        stage, _, other = everyone[rank]
        reference = min(r for r in everyone if everyone[r][0] == stage)
        first = everyone[reference][2]
        for index in range(max(len(first), len(other))):
            ours = first[index] if index < len(first) else "nothing"
            theirs = other[index] if index < len(other) else "nothing"
            if ours != theirs:
                within = f" of pipeline stage {stage}" if staged else ""
                return (
                    f"{what}: ranks{within} passed different gradient layouts, so their "
                    f"collectives would not match. First difference at gradient {index} "
                    f"(counting the gradients that are not None): rank {reference} has {ours}, "
                    f"rank {rank} has {theirs} (rank {reference} passed {len(first)} gradients, "
                    f"rank {rank} passed {len(other)}). No gradient was modified."
                )
    return f"{what}: ranks passed different gradient layouts. No gradient was modified."


def refuse_on_every_rank(
    refusal: tuple[type[Exception], str] | None, device: torch.device, what: str
) -> None:
    """Raise the refusal of the lowest rank that has one, on every rank of the world.

    One all_reduce (MAX) of one int64 tells every rank which rank that is; only when there is one
    does that rank's message follow (a broadcast), so every rank raises the same error.

    Args:
        refusal: this rank's ``(exception type, message)``, or None.
        device: where the flag lives (beside this rank's gradients, the CUDA device under NCCL).
        what: the function being checked, for the message.

    Raises:
        The refusal's exception type, on every rank, naming the rank that refused.
    """
    world = dist.get_world_size()
    rank = dist.get_rank()
    flag = torch.tensor([world - rank if refusal is not None else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    refusing = world - int(flag.item())
    if refusing == world:
        return
    shared = [refusal]
    dist.broadcast_object_list(shared, src=refusing, device=device)
    kind, message = shared[0]  # type: ignore[misc]
    raise kind(f"{what}: on rank {refusing}, {message}. No gradient was modified.")
