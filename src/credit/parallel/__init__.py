"""Gradient synchronisation and mixed-mesh-safe clipping for FSDP2, TP and domain parallelism."""

from credit.parallel.collectives import (
    all_reduce_avg,
    allreduce_grads_avg,
    clip_grad_norm_,
    contiguous_grads_,
    total_grad_norm,
)
from credit.parallel.domain import sync_domain_gradients
from credit.parallel.mesh import ParallelMesh, build_device_mesh
from credit.parallel.norm_report import grad_norm_report
from credit.parallel.tensor_parallel import is_tp_sharded, sync_replicated_gradients

__all__ = [
    "ParallelMesh",
    "all_reduce_avg",
    "allreduce_grads_avg",
    "build_device_mesh",
    "clip_grad_norm_",
    "contiguous_grads_",
    "grad_norm_report",
    "is_tp_sharded",
    "sync_domain_gradients",
    "sync_replicated_gradients",
    "total_grad_norm",
]
