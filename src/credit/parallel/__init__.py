"""Gradient synchronisation and mixed-mesh-safe clipping for FSDP2, TP and domain parallelism."""

from credit.parallel.collectives import (
    all_reduce_avg,
    allreduce_grads_avg,
    clip_grad_norm_,
    contiguous_grads_,
    total_grad_norm,
)

__all__ = [
    "all_reduce_avg",
    "allreduce_grads_avg",
    "clip_grad_norm_",
    "contiguous_grads_",
    "total_grad_norm",
]
