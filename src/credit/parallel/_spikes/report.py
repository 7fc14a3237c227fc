"""The warning a skipped spike leaves on the world's rank 0."""

from __future__ import annotations

import logging

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
    """Warn, on the world's rank 0, that the step of ``decision`` was skipped as a spike: its
    step, norm, z-score and threshold, the loss's where given, the largest groups of the step's
    ``grad_norm_report`` where given. Reads the decision on the host (one read, rank 0 only):
    call it where the step's answer was read already."""
    if is_distributed() and dist.get_rank() != 0:
        return
    observed = decision.observed
    tensors = [observed.norm, decision.norm_z, decision.skip_limit]
    if observed.loss is not None and decision.loss_z is not None:
        tensors += [observed.loss, decision.loss_z]
    values = torch.stack([t.float().to(observed.norm.device) for t in tensors]).tolist()
    norm, norm_z, limit = values[:3]
    parts = [f"gradient norm {norm:.6g} (z-score {norm_z:.3g}, skipped above {limit:.6g})"]
    if len(values) > 3:
        parts.append(
            f"loss {values[3]:.6g} (z-score {values[4]:.3g}, limit {settings.skip_sigma:g})"
        )
    if observed.groups:
        largest = sorted(observed.groups.items(), key=lambda item: -item[1])[:_LARGEST_GROUPS]
        parts.append("largest groups: " + ", ".join(f"{k} {v:.6g}" for k, v in largest))
    logger.warning(
        "SpikePolicy skipped the %s step it saw as a spike: %s",
        ordinal(observed.step),
        "; ".join(parts),
    )
