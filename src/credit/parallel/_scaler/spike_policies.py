"""The spike policies a GradScaler holds, by optimizer: whose skip each step's answer takes in.

The scaler and a policy meet through the two protocols below, and through nothing else: the
scaler attaches itself to each policy it is given (:class:`HeldPolicy`, which
``credit.parallel.spikes.SpikePolicy`` implements) and from then on speaks to the
:class:`PolicyLink` the policy hands back. A policy decides during the step, in its clip; the
scaler asks the link, at ``step``, whether the policy decided a spike, and hands it the world's
non-finite answer at ``update``, when the policy's histories take in the step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor


@runtime_checkable
class PolicyLink(Protocol):
    """What the scaler asks of a policy it holds, once attached: the policy's side of a step."""

    def gradients_unscaled(self) -> None:
        """The scaler unscaled the gradients of every optimizer the policy decides for."""

    def skip_flag(self) -> Tensor | None:
        """1.0 when the policy skips the undecided step, 0.0 when not; None without one."""

    def report_spike(self) -> None:
        """Report the undecided step's spike, which the scaler skipped."""

    def end_step(self, non_finite: Tensor | None) -> None:
        """Enter the undecided step, which the world's ``non_finite`` answer skipped or not."""


@runtime_checkable
class HeldPolicy(Protocol):
    """What a GradScaler's ``spikes`` must be: a policy the scaler attaches itself to."""

    def attach_scaler(self, scaler: object, *, unscale_first: bool) -> PolicyLink:
        """Be held by ``scaler`` (which scales, and unscales before the clip, when
        ``unscale_first``), and return the link the scaler speaks to from then on."""


class SpikePolicies:
    """One scaler's policies: one for every optimizer, or one per optimizer.

    Args:
        spikes: a policy, a mapping from optimizers to policies, or None.
        scaler: the scaler holding them (a policy is held by one scaler).
        scaling: whether the scaler scales the loss: a policy's clip then waits for
            ``unscale_``.

    Raises:
        TypeError: ``spikes`` is none of these.
        ValueError: a policy is held by another scaler already.
    """

    def __init__(self, spikes: object, scaler: object, scaling: bool) -> None:
        self._every: HeldPolicy | None = None
        self._by_optimizer: dict[int, tuple[torch.optim.Optimizer, HeldPolicy]] = {}
        if isinstance(spikes, Mapping):
            for optimizer, policy in spikes.items():
                held = _checked(policy, f"spikes[{type(optimizer).__name__}]")
                if not isinstance(optimizer, torch.optim.Optimizer):
                    raise TypeError(f"spikes' keys must be optimizers, got {optimizer!r}")
                self._by_optimizer[id(optimizer)] = (optimizer, held)
        elif spikes is not None:
            self._every = _checked(spikes, "spikes")
        self._unscaled: set[int] = set()  # optimizers unscaled since the last update
        self._links = {
            id(policy): policy.attach_scaler(scaler, unscale_first=scaling)
            for policy in self._policies()
        }

    def unscaled(self, key: int) -> None:
        """Tell the policies that optimizer ``key``'s gradients are unscaled: a policy may clip
        once all its optimizers are (any one, for the policy of every optimizer)."""
        self._unscaled.add(key)
        for policy in self._policies():
            keys = self._keys_of(policy)
            if keys is None or self._unscaled.issuperset(keys):
                self._links[id(policy)].gradients_unscaled()

    def flag(self, key: int) -> Tensor | None:
        """1.0 when the policy of optimizer ``key`` decided this step a spike; None without one."""
        link = self._link(key)
        return None if link is None else link.skip_flag()

    def report(self, key: int) -> None:
        """Report the spike that optimizer ``key`` skipped (its answer was read already)."""
        link = self._link(key)
        if link is not None:
            link.report_spike()

    def end_step(self, non_finite: dict[int, Tensor]) -> dict[int, Tensor]:
        """Hand each policy the world's non-finite answer of its optimizers, and return the spike
        flag of each of those optimizers (for the count of skipped steps)."""
        flags: dict[int, Tensor] = {}
        for policy in self._policies():
            link = self._links[id(policy)]
            keys = [key for key in non_finite if self._policy(key) is policy]
            flag = link.skip_flag()
            if flag is not None:
                flags.update(dict.fromkeys(keys, flag))
            link.end_step(_together([non_finite[key] for key in keys]))
        self._unscaled.clear()
        return flags

    def policy_of(self, optimizer: torch.optim.Optimizer | None) -> HeldPolicy | None:
        """The policy deciding for ``optimizer``, or for every optimizer when it is None."""
        if optimizer is None:
            return self._every
        return self._policy(id(optimizer))

    def _keys_of(self, policy: HeldPolicy) -> list[int] | None:
        """The optimizers ``policy`` decides for, or None when it decides for every one."""
        if self._every is not None:
            return None
        return [key for key, (_, held) in self._by_optimizer.items() if held is policy]

    def _policy(self, key: int) -> HeldPolicy | None:
        if self._every is not None:
            return self._every
        held = self._by_optimizer.get(key)
        return None if held is None else held[1]

    def _link(self, key: int) -> PolicyLink | None:
        policy = self._policy(key)
        return None if policy is None else self._links[id(policy)]

    def _policies(self) -> list[HeldPolicy]:
        if self._every is not None:
            return [self._every]
        unique: dict[int, HeldPolicy] = {}
        for _, policy in self._by_optimizer.values():
            unique.setdefault(id(policy), policy)
        return list(unique.values())


def _together(answers: list[Tensor]) -> Tensor | None:
    """One non-finite answer for several optimizers (1.0 when any is 1.0), or None for none."""
    if not answers:
        return None
    device = answers[0].device
    return torch.stack([answer.to(device) for answer in answers]).amax()


def _checked(policy: object, argument: str) -> HeldPolicy:
    """``policy``, which must implement :class:`HeldPolicy` (TypeError naming ``argument``)."""
    if not isinstance(policy, HeldPolicy):
        raise TypeError(f"{argument} must be a SpikePolicy, got {type(policy).__name__}")
    return policy
