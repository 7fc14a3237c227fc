"""The gradient norm over any mix of meshes and pipeline stages, and the clip that follows it.

``reduce`` runs the norm's steps in order (``steps``); the public functions, the scaler and the
integrations import the names below, never the steps' modules.
"""

from credit.parallel._norm.clip import scale_
from credit.parallel._norm.hooks import NormEvent, attach, detach
from credit.parallel._norm.request import (
    NormOptions,
    NormRequest,
    checked_norm_type,
    checked_options,
    norm_request,
    parameters_request,
)
from credit.parallel._norm.results import Reduced
from credit.parallel._norm.stacking import stacking_of
from credit.parallel._norm.steps import reduce
from credit.parallel._norm.verdict import raise_if_copies_differ

__all__ = [
    "NormEvent",
    "NormOptions",
    "NormRequest",
    "Reduced",
    "attach",
    "checked_norm_type",
    "checked_options",
    "detach",
    "norm_request",
    "parameters_request",
    "raise_if_copies_differ",
    "reduce",
    "scale_",
    "stacking_of",
]
