"""Correctness beside the timing: what ours returns against torch and the baselines."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from baselines import norm_per_mesh_group, torch_clip
from layouts import ulp_distance
from report import Row
from torch import Tensor, nn

from credit.parallel._compat import local_tensor
from credit.parallel.collectives import clip_grad_norm_, total_grad_norm


def _local_copies(params: Sequence[Tensor]) -> list[Tensor]:
    return [local_tensor(param.grad).detach().clone() for param in params if param.grad is not None]


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
    flag = torch.tensor([int(same)], device=ours.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    holds = bool(flag.item())
    label = "same bits as torch (norm and clipped grads, every rank)"
    return Row(label, "yes" if holds else "no", "check", "same bits", holds)


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
    flag = torch.tensor([int(same)], device=mine[0].device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    holds = bool(flag.item())
    label = "same gradient bits as the explicit sync (every rank)"
    return Row(label, "yes" if holds else "no", "check", "same bits", holds)
