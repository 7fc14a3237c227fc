"""The GradScaler's world decision: its non-finite flags, answered by the norms or by one
collective of their own, and its count of skipped steps.

``amp.GradScaler`` imports the names below.
"""

from credit.parallel._scaler.found_inf import StepFlags, check, check_and_unscale
from credit.parallel._scaler.skipped_steps import SkippedSteps

__all__ = ["SkippedSteps", "StepFlags", "check", "check_and_unscale"]
