"""What each run records per step, shared by the training loop and the report."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class History:
    """Per-step loss and pre-clip gradient norm of a run; with loss scaling or a spike policy, the
    scale after the step, whether the step was skipped, and whether as a spike; with replica
    checks, when each ran, what it cost, and what it found."""

    loss: list[float] = field(default_factory=list)
    norm: list[float] = field(default_factory=list)
    scale: list[float] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    spikes: list[bool] = field(default_factory=list)  # skipped as a spike (not a NaN or inf)
    checks: list[tuple[int, float]] = field(default_factory=list)  # (step, milliseconds)
    compared: int = 0  # tensors with copies on other ranks, per check
    tensors: int = 0
    diverged: str | None = None  # what the first failed check said

    def record(self, loss: float, norm: float) -> None:
        self.loss.append(loss)
        self.norm.append(norm)

    def record_scaler(self, scale: float, skipped: bool, spike: bool = False) -> None:
        self.scale.append(scale)
        self.skipped.append(skipped)
        self.spikes.append(spike)

    def record_check(self, step: int, milliseconds: float, compared: int, tensors: int) -> None:
        self.checks.append((step, milliseconds))
        self.compared, self.tensors = compared, tensors
