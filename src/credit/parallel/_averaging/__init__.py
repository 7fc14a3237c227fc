"""Gradient averaging over a process group: buckets, and the averaging inside backward.

``collectives`` and ``grad_sync`` import the names below; the modules' own names stay inside.
"""

from credit.parallel._averaging.average import DEFAULT_BUCKET_CAP_MB, average_grads, average_tensor
from credit.parallel._averaging.in_backward import (
    Backend,
    backend_for,
    first_averaged_in_backward,
    register_averaged_in_backward,
    unregister_averaged_in_backward,
)

__all__ = [
    "DEFAULT_BUCKET_CAP_MB",
    "Backend",
    "average_grads",
    "average_tensor",
    "backend_for",
    "first_averaged_in_backward",
    "register_averaged_in_backward",
    "unregister_averaged_in_backward",
]
