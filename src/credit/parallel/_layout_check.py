"""Opt-in check that every rank passes the same gradient layout, before any data moves.

Ranks that disagree on the number, shape or dtype of the tensors they reduce issue mismatched
collectives: gloo aborts the process, NCCL hangs or corrupts. The check reduces a digest of each
rank's layout with one small all_reduce (MAX of the digest and of its negation, so every rank
learns both the largest and the smallest digest); only when they differ, which every rank then
knows, are the full layouts gathered to name the first differing gradient. Over several groups
(the dims of a mesh that does not span the world) the reductions run one after the other and
nobody raises before all of them are done, so every rank reaches the same verdict and no rank is
left waiting in a collective its peers have abandoned.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

ENV_VAR = "CREDIT_PARALLEL_CHECK"

Groups = ProcessGroup | None | Sequence[ProcessGroup | None]


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


def _as_list(groups: Groups) -> list[ProcessGroup | None]:
    if groups is None or isinstance(groups, ProcessGroup):
        return [groups]
    return list(groups)


def verify_same_layout(
    layout: list[str],
    groups: Groups,
    device: torch.device,
    what: str,
    settings: str = "",
) -> None:
    """Raise RuntimeError on every rank of ``groups`` unless all ranks passed the same layout.

    Args:
        layout: one description per gradient, e.g. ``"shape=(4, 8) dtype=torch.float32"``.
        groups: the group whose ranks must agree (None for the world), or a sequence of groups
            that together connect them (the dims of a mesh): one small all_reduce per group.
        device: where the digest tensor lives (CUDA for NCCL groups).
        what: the function being checked, for the message.
        settings: arguments that must also agree (e.g. ``"bucket_cap_mb=25"``).

    Raises:
        RuntimeError: on every rank of ``groups``, naming the first difference.
    """
    group_list = _as_list(groups)
    if not group_list:
        return
    count, digest = len(layout), _digest(settings, layout)
    extremes = torch.tensor([count, digest, -count, -digest], dtype=torch.int64, device=device)
    for group in group_list:
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    largest, negated_smallest = extremes[:2], extremes[2:]
    if torch.equal(largest, -negated_smallest):
        return
    everyone = _gather_layouts((settings, layout), group_list)
    raise RuntimeError(_describe_mismatch(everyone, what))


def _gather_layouts(
    mine: tuple[str, list[str]], groups: list[ProcessGroup | None]
) -> dict[int, tuple[str, list[str]]]:
    """Every rank's (settings, layout), gathered group after group so that all ranks see all."""
    known = {dist.get_rank(): mine}
    for group in groups:
        gathered: list[dict[int, tuple[str, list[str]]] | None] = [None] * dist.get_world_size(
            group
        )
        dist.all_gather_object(gathered, known, group=group)
        for other in gathered:
            known.update(other or {})
    return known


def _describe_mismatch(everyone: dict[int, tuple[str, list[str]]], what: str) -> str:
    """The first difference from the lowest rank's layout: the same text on every rank."""
    first_rank = min(everyone)
    first_settings, first = everyone[first_rank]
    for rank in sorted(everyone):
        settings, other = everyone[rank]
        if settings != first_settings:
            return (
                f"{what}: ranks passed different arguments, so their collectives would not "
                f"match: rank {first_rank} has {first_settings}, rank {rank} has {settings}. "
                "No gradient was modified."
            )
        for index in range(max(len(first), len(other))):
            ours = first[index] if index < len(first) else "nothing"
            theirs = other[index] if index < len(other) else "nothing"
            if ours != theirs:
                return (
                    f"{what}: ranks passed different gradient layouts, so their collectives "
                    f"would not match. First difference at gradient {index} (counting the "
                    f"gradients that are not None): rank {first_rank} has {ours}, rank {rank} "
                    f"has {theirs} (rank {first_rank} passed {len(first)} gradients, rank "
                    f"{rank} passed {len(other)}). No gradient was modified."
                )
    return f"{what}: ranks passed different gradient layouts. No gradient was modified."
