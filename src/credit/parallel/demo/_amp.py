"""Loss scaling in the demo: who scales and decides each run's steps, and the planted inf.

The parallel run uses :class:`credit.parallel.amp.GradScaler` (holding the spike policy of
``--spike-step``, with ``scaling=False`` without ``--amp``); the single-process replica uses
torch's own scaler (right in one process); the contrast run, torch's scaler on the parallel layout.
Each run's :class:`StepScaler` hides which, so the training loops read the same either way.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from credit.parallel._common.compat import local_tensor
from credit.parallel.amp import GradScaler
from credit.parallel.demo._cli import Options
from credit.parallel.demo._spikes import demo_policy
from credit.parallel.grad_sync import is_tp_sharded
from credit.parallel.spikes import SpikePolicy

INIT_SCALE = 2.0**10
GROWTH_INTERVAL = 2  # short, so that the scale grows within the demo's steps


class StepScaler:
    """Scales the loss and takes or skips the optimizer step, as ``scaler`` does.

    Args:
        scaler: a GradScaler (this package's or torch's), or None for plain steps.
        skip_nonfinite: with no scaler, skip a step whose clipped norm is not finite (the
            replica's counterpart of ``GradScaler(scaling=False)``).
        policy: the spike policy ``scaler`` holds, whose clip the run calls; or None.
    """

    def __init__(
        self,
        scaler: torch.amp.GradScaler | None,
        skip_nonfinite: bool = False,
        policy: SpikePolicy | None = None,
    ) -> None:
        self.scaler = scaler
        self.skip_nonfinite = skip_nonfinite
        self.policy = policy

    @property
    def active(self) -> bool:
        return self.scaler is not None or self.skip_nonfinite

    def scale(self, loss: Tensor) -> Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, norm: Tensor, spike: bool = False) -> bool:
        """Step ``optimizer`` unless the step must be skipped; return whether it was.

        ``spike``: skip it as a spike, decided by the caller (the replica's mirror of the policy;
        this package's scaler takes its own policy's decision). The scale goes on as after a clean
        step: a spike is no overflow.
        """
        if self.scaler is None:
            skipped = spike or (self.skip_nonfinite and not bool(torch.isfinite(norm)))
            if not skipped:
                optimizer.step()
            return skipped
        if spike:
            self.scaler.update()  # unscale_ found no inf: the growth interval counts the step
            return True
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        if isinstance(self.scaler, GradScaler):
            return self.scaler.last_step_skipped
        return self.scaler.get_scale() < before  # torch's: a skipped step backs the scale off

    def get_scale(self) -> float:
        return self.scaler.get_scale() if self.scaler is not None else 1.0


def for_parallel_run(options: Options, model: nn.Module, device: torch.device) -> StepScaler:
    """This package's GradScaler: scaling for fp16, skipping only for bf16 (and for a spike
    policy without ``--amp``); it names ``model``'s parameters when it reports a skipped step,
    and holds the policy of ``--spike-step``."""
    policy = demo_policy() if options.spike_step is not None else None
    if options.amp == "off" and policy is None:
        return StepScaler(None)
    if options.amp != "fp16":
        return StepScaler(
            GradScaler(device.type, scaling=False, model=model, spikes=policy), policy=policy
        )
    scaler = GradScaler(
        device.type, INIT_SCALE, growth_interval=GROWTH_INTERVAL, model=model, spikes=policy
    )
    return StepScaler(scaler, policy=policy)


def for_replica(options: Options, device: torch.device) -> StepScaler:
    """torch's GradScaler in one process for fp16; skipping non-finite steps for bf16 and with a
    spike policy (as ``GradScaler(scaling=False)`` does)."""
    if options.amp == "fp16":
        return StepScaler(_torch_scaler(device, INIT_SCALE))
    skips = options.amp == "bf16" or options.spike_step is not None
    return StepScaler(None, skip_nonfinite=skips)


def for_contrast(options: Options, device: torch.device) -> StepScaler:
    """torch's GradScaler on the parallel layout (from a scale of 1 for bf16: only its
    decisions matter)."""
    return StepScaler(_torch_scaler(device, INIT_SCALE if options.amp == "fp16" else 1.0))


def _torch_scaler(device: torch.device, init_scale: float) -> torch.amp.GradScaler:
    return torch.amp.GradScaler(device.type, init_scale, growth_interval=GROWTH_INTERVAL)


def planted_parameter(model: nn.Module) -> str:
    """The parameter whose gradient gets the inf: the first TP-sharded one, else the largest
    (whose FSDP2 shard is not empty on any rank, unlike a 1-row weight's)."""
    named = list(model.named_parameters())
    sharded = [name for name, param in named if is_tp_sharded(param)]
    return sharded[0] if sharded else max(named, key=lambda item: item[1].numel())[0]


def plant_inf(model: nn.Module, name: str) -> None:
    """An inf in the first element of parameter ``name``'s gradient (of this rank's shard)."""
    grad = dict(model.named_parameters())[name].grad
    assert grad is not None
    local_tensor(grad).view(-1)[0] = math.inf
