"""Opt-in check that every rank passes the same gradient layout, before any data moves.

Ranks that disagree on the number, shape or dtype of the tensors they reduce issue mismatched
collectives: gloo aborts the process, NCCL hangs or corrupts. The check compares a digest of each
rank's layout in one small all_gather; only when digests differ does it gather the full layouts
(every rank then knows, so every rank takes that path) to name the first differing gradient.
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


def _digest(layout: list[str]) -> int:
    raw = hashlib.blake2b("\n".join(layout).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little", signed=True)


def verify_same_layout(
    layout: list[str], group: ProcessGroup | None, device: torch.device, what: str
) -> None:
    """Raise RuntimeError on every rank of ``group`` unless all ranks passed the same ``layout``.

    Args:
        layout: one description per gradient, e.g. ``"shape=(4, 8) dtype=torch.float32"``.
        group: the ranks that must agree (None for the world).
        device: where the digest tensor lives (CUDA for NCCL groups).
        what: the function being checked, for the message.
    """
    mine = torch.tensor([len(layout), _digest(layout)], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    if all(torch.equal(other, gathered[0]) for other in gathered):
        return
    layouts: list[list[str] | None] = [None] * len(gathered)
    dist.all_gather_object(layouts, layout, group=group)
    raise RuntimeError(_describe_mismatch(layouts, group, what))  # type: ignore[arg-type]


def _describe_mismatch(layouts: list[list[str]], group: ProcessGroup | None, what: str) -> str:
    ranks = dist.get_process_group_ranks(group) if group is not None else range(len(layouts))
    first_rank, first = next(iter(ranks)), layouts[0]
    for rank, other in zip(ranks, layouts, strict=False):
        for index in range(max(len(first), len(other))):
            ours = first[index] if index < len(first) else "nothing"
            theirs = other[index] if index < len(other) else "nothing"
            if ours != theirs:
                return (
                    f"{what}: ranks passed different gradient layouts, so their collectives would "
                    f"not match. First difference at gradient {index}: rank {first_rank} has "
                    f"{ours}, rank {rank} has {theirs} (rank {first_rank} passed {len(first)} "
                    f"gradients, rank {rank} passed {len(other)}). No gradient was modified."
                )
    return f"{what}: ranks passed different gradient layouts. No gradient was modified."
