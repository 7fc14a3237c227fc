"""Correctness beside the timing: what ours returns against torch and the baselines."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from baselines import norm_per_mesh_group, torch_clip
from report import Row
from torch import Tensor, nn

from credit.parallel._common.compat import local_tensor
from credit.parallel.collectives import clip_grad_norm_, total_grad_norm
from testbed.layouts import ulp_distance
from testbed.world_layouts import describe, wire


def _local_copies(params: Sequence[Tensor]) -> list[Tensor]:
    return [local_tensor(param.grad).detach().clone() for param in params if param.grad is not None]


def _local_weights(params: Sequence[Tensor]) -> list[Tensor]:
    return [local_tensor(param.detach()).clone() for param in params]


def _restore(params: Sequence[Tensor], saved: list[Tensor]) -> None:
    grads = [local_tensor(param.grad) for param in params if param.grad is not None]
    torch._foreach_copy_(grads, saved)


def _same_bits(a: list[Tensor], b: list[Tensor]) -> bool:
    return all(
        x.shape == y.shape and torch.equal(x.view(torch.int32), y.view(torch.int32))
        for x, y in zip(a, b, strict=True)
    )


def same_bits_as_torch(params: Sequence[Tensor], max_norm: float) -> Row:
    """Whether ours and torch's clip give the same bits, norm and clipped grads, on every rank.

    The gradients are left as they were.
    """
    saved = _local_copies(params)
    ours = clip_grad_norm_(params, max_norm).reshape(1)
    ours_grads = _local_copies(params)
    _restore(params, saved)
    theirs = torch_clip(params, max_norm).reshape(1)
    same = _same_bits([ours, *ours_grads], [theirs, *_local_copies(params)])
    _restore(params, saved)
    label = "same bits as torch (norm and clipped grads, every rank)"
    return _check_row(label, _on_every_rank(same, ours.device))


def torch_clip_fails(params: Sequence[Tensor], max_norm: float) -> str:
    """What torch's clip does on this layout, in one line (the gradients are left as they were)."""
    saved = _local_copies(params)
    try:
        torch_clip(params, max_norm)
    except Exception as error:  # the failure this library exists for
        first_line = (str(error).strip().splitlines() or [""])[0]
        return f"torch.nn.utils.clip_grad_norm_ raises {type(error).__name__}: {first_line[:90]}"
    finally:
        _restore(params, saved)
    return "torch.nn.utils.clip_grad_norm_ ran on this layout"


def ulps_from_norm_per_mesh_group(grads: Sequence[Tensor]) -> Row:
    """float32 ULPs between ours and the norm per mesh group (goal: at most 8)."""
    ulps = ulp_distance(total_grad_norm(grads), norm_per_mesh_group(grads))
    return Row(
        "norm: ULPs between ours and one norm per mesh group", ulps, "count", "<= 8", ulps <= 8
    )


def same_grads(ours: nn.Module, theirs: nn.Module) -> Row:
    """Whether two models hold the same gradient bits (local shards), on every rank."""
    mine = _local_copies(list(ours.parameters()))
    same = _same_bits(mine, _local_copies(list(theirs.parameters())))
    label = "same gradient bits as the explicit sync (every rank)"
    return _check_row(label, _on_every_rank(same, mine[0].device))


def steps_taken_alike(
    steps: dict[str, Callable[[], object]], params: dict[str, list[Tensor]]
) -> Row:
    """Whether, on every rank, the variants start from the same weights and gradients, and one
    call of each step is a step taken, to the same weights in all, leaving the gradients as they
    were.

    Args:
        steps: variant -> its training step, each on its own copy of the model.
        params: variant -> the parameters its step updates.
    """
    start = [(_local_weights(p), _local_copies(p)) for p in params.values()]
    for step in steps.values():
        step()
    end = [(_local_weights(p), _local_copies(p)) for p in params.values()]
    (weights, grads), (stepped, kept) = start[0], end[0]
    same = (
        all(_same_bits(weights + grads, w + g) for w, g in start[1:])
        and all(_same_bits(stepped + kept, w + g) for w, g in end[1:])
        and not _same_bits(weights, stepped)
        and _same_bits(grads, kept)
    )
    label = "one step of each: taken, same weights in all, grads kept (every rank)"
    return _check_row(label, _on_every_rank(same, grads[0].device))


def replicas_found_equal(steps: dict[str, Callable[[], object]], all_compared: bool) -> Row:
    """Whether every variant of the replica check finds the copies equal, and ours compared every
    tensor (each is a copy on every rank)."""
    verdicts = [step() for step in steps.values()]
    holds = all_compared and all(v is not False for v in verdicts)
    return _check_row("every variant finds every copy equal; ours compares every tensor", holds)


def wire_of(
    call: Callable[[], object], expected: list[tuple[int, int]], device: torch.device
) -> Row:
    """Whether ``call`` issues, on every rank, exactly the all_reduces ``expected`` lists in
    order, each as (float64 elements, ranks in its group); ``device`` is the ranks'."""
    seen = wire(call)
    holds = [(c.op, c.elements, c.dtype, c.group) for c in seen] == [
        ("c10d::allreduce_", elements, "torch.float64", ranks) for elements, ranks in expected
    ]
    goal = " + ".join(f"{elements:,} over {ranks}" for elements, ranks in expected)
    return Row(
        "ours's collectives per call (float64 elements, ranks)",
        describe(seen),
        "check",
        f"== {goal}",
        _on_every_rank(holds, device),
    )


def _on_every_rank(holds: bool, device: torch.device) -> bool:
    """Whether ``holds`` is true on every rank (one all_reduce)."""
    flag = torch.tensor([int(holds)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _check_row(label: str, holds: bool) -> Row:
    return Row(label, "yes" if holds else "no", "check", "same bits", holds)
