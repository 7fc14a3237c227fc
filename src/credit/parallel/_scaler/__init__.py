"""The GradScaler's world decision: its non-finite flags, answered by the norms or by one
collective of their own, its count of skipped steps, and the spike policies it holds (reached
through the protocols ``HeldPolicy`` and ``PolicyLink``, which the spike policy implements).

``amp.GradScaler`` and ``spikes.SpikePolicy`` import the names below.
"""

from credit.parallel._scaler.found_inf import StepFlags, check, check_and_unscale
from credit.parallel._scaler.skipped_steps import SkippedSteps
from credit.parallel._scaler.spike_policies import HeldPolicy, PolicyLink, SpikePolicies

__all__ = [
    "HeldPolicy",
    "PolicyLink",
    "SkippedSteps",
    "SpikePolicies",
    "StepFlags",
    "check",
    "check_and_unscale",
]
