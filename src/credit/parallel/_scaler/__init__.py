"""The GradScaler's world decision: its non-finite flags, answered by the norms or by one
collective of their own, its count of skipped steps, and the spike policies it holds.

``amp.GradScaler`` imports the names below.
"""

from credit.parallel._scaler.found_inf import StepFlags, check, check_and_unscale
from credit.parallel._scaler.skipped_steps import SkippedSteps
from credit.parallel._scaler.spike_policies import SpikePolicies

__all__ = ["SkippedSteps", "SpikePolicies", "StepFlags", "check", "check_and_unscale"]
