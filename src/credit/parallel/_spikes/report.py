"""The warning a skipped spike leaves on the world's rank 0."""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from credit.parallel._common.groups import is_distributed
from credit.parallel._common.text import ordinal
from credit.parallel._spikes.decision import Decision
from credit.parallel._spikes.settings import SpikeSettings

# The records carry the name of the public module, which users configure.
logger = logging.getLogger("credit.parallel.spikes")

_LARGEST_GROUPS = 3


def report_spike(settings: SpikeSettings, decision: Decision) -> None:
    """Warn, on the world's rank 0, that the step of ``decision`` was skipped as a spike (its
    step, norm, z-score and threshold, the loss's where given, the largest groups of the step's
    ``grad_norm_report`` where given), or for a loss that was not finite. Reads the decision on
    the host (one read, rank 0 only): call it where the step's answer was read already."""
    if is_distributed() and dist.get_rank() != 0:
        return
    observed = decision.observed
    limit = decision.skip_limit(settings).reshape(1)
    norm, loss, norm_z, loss_z, limit = torch.cat([observed.values, decision.z, limit]).tolist()
    if not math.isfinite(loss):
        logger.warning(
            "SpikePolicy skipped the %s step it saw: the loss averaged over the world is %s "
            "(gradient norm %.6g); counted in skipped_non_finite",
            ordinal(observed.step),
            loss,
            norm,
        )
        return
    parts = [f"gradient norm {norm:.6g} (z-score {norm_z:.3g}, skipped above {limit:.6g})"]
    if observed.with_loss:
        parts.append(f"loss {loss:.6g} (z-score {loss_z:.3g}, limit {settings.skip_sigma:g})")
    if observed.groups:
        largest = sorted(observed.groups.items(), key=lambda item: -item[1])[:_LARGEST_GROUPS]
        parts.append("largest groups: " + ", ".join(f"{k} {v:.6g}" for k, v in largest))
    logger.warning(
        "SpikePolicy skipped the %s step it saw as a spike: %s",
        ordinal(observed.step),
        "; ".join(parts),
    )
