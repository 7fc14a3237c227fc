"""The planted gradient spike of ``--spike-step``: the policy that skips it, the replica's mirror
of that policy, and what the step would do to the weights without it.

The parallel run's :class:`~credit.parallel.spikes.SpikePolicy` decides on this package's norm,
the same bits on every rank; the replica, in one process, decides on torch's norm by
:class:`SpikeMirror`, the same steps on its own norms, so that the two decisions are reached
apart and compared.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from credit.parallel import _spikes
from credit.parallel.demo._cli import SPIKE_FACTOR, SPIKE_WARMUP
from credit.parallel.spikes import SpikePolicy


def demo_policy() -> SpikePolicy:
    """The demo's policy: SpikePolicy's defaults, with a warm-up that fits the demo's steps."""
    return SpikePolicy(warmup=SPIKE_WARMUP)


def spiked_shard(x: Tensor, dp: int, dp_rank: int) -> Tensor:
    """Data shard ``dp_rank`` of ``dp`` at the spike step: the last one's inputs scaled."""
    return x * SPIKE_FACTOR if dp_rank == dp - 1 else x


def spiked_batch(x: Tensor, dp: int) -> Tensor:
    """The global batch at the spike step, as the dp shards see it: the last shard scaled."""
    shards = list(x.chunk(dp))
    shards[-1] = shards[-1] * SPIKE_FACTOR
    return torch.cat(shards)


@dataclass(frozen=True)
class SpikeSeen:
    """The spike step as the replica saw it.

    Attributes:
        norm: torch's gradient norm, before the clip.
        zscore: the mirror's z-score of it (None during the warm-up).
        skipped: whether the mirror skipped the step as a spike.
        move: how far the step, taken, would move the weights (relative, see
            :func:`move_without_policy`).
        previous: the last step taken before it, and how far it moved the weights; or None.
    """

    norm: float
    zscore: float | None
    skipped: bool
    move: float
    previous: tuple[int, float] | None


class SpikeMirror:
    """The policy's rule on one process's norms: the package's own steps (``_spikes``), which
    take no collective, on the replica's norms instead of the parallel run's.

    Args:
        settings: the parallel run's policy's settings (``SpikePolicy.settings``).
    """

    def __init__(self, settings: _spikes.SpikeSettings) -> None:
        self.settings = settings
        self._state = _spikes.initial(settings, torch.device("cpu"))

    def decide(self, norm: Tensor) -> _spikes.Decision:
        """The decision on a step of norm ``norm``, from the steps taken before it."""
        value = norm.detach().float().cpu()
        observed = _spikes.Observed(
            torch.stack([value, torch.zeros_like(value)]), False, None, None, self._state.steps + 1
        )
        return _spikes.decide(self.settings, self._state.history, observed)

    def end_step(self, decision: _spikes.Decision, non_finite: bool) -> None:
        """Enter the step of ``decision`` if it was taken (``non_finite``: the scaler skipped it)."""
        answer = torch.tensor(float(non_finite))
        state = _spikes.after_step(self.settings, self._state, decision, answer)
        self._state = replace(state, steps=self._state.steps + 1)


def weights(model: nn.Module) -> Tensor:
    """Every parameter of ``model``, flattened into one detached copy."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def relative_move(before: Tensor, model: nn.Module) -> float:
    """``||w - before|| / ||before||`` over every parameter of ``model``."""
    return float(
        torch.linalg.vector_norm(weights(model) - before) / torch.linalg.vector_norm(before)
    )


def move_without_policy(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    build: Callable[[nn.Module], torch.optim.Optimizer],
) -> float:
    """How far the step would move ``model``'s weights if taken: on copies of the model (its
    gradients as they are, clipped) and of the optimizer (built by ``build``, its state loaded
    from ``optimizer``), which then step; ``model`` and ``optimizer`` are left as they are.

    Returns:
        The relative move ``||w_after - w_before|| / ||w_before||`` over every parameter.
    """
    twin = copy.deepcopy(model)  # without the gradients: deepcopy leaves them out
    for param, original in zip(twin.parameters(), model.parameters(), strict=True):
        param.grad = None if original.grad is None else original.grad.detach().clone()
    twin_optimizer = build(twin)
    twin_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # no shared state
    before = weights(twin)
    twin_optimizer.step()
    return relative_move(before, twin)
