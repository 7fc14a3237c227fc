"""The spike policies a GradScaler holds, by optimizer: whose skip each step's answer takes in.

A policy (``credit.parallel.spikes.SpikePolicy``) decides during the step, in its clip; the
scaler asks here, at ``step``, whether an optimizer's policy decided a spike, and hands the
world's non-finite answers back at ``update``, when the policy's histories take in the step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch
from torch import Tensor


class Policy(Protocol):
    """What the scaler asks of a spike policy."""

    def _held_by(self, scaler: object, unscale_first: bool) -> None: ...

    def _unscaled(self) -> None: ...

    def _skip_flag(self) -> Tensor | None: ...

    def _report_spike(self) -> None: ...

    def _settle(self, non_finite: Tensor | None) -> None: ...


class SpikePolicies:
    """One scaler's policies: one for every optimizer, or one per optimizer.

    Args:
        spikes: a policy, a mapping from optimizers to policies, or None.
        scaler: the scaler holding them (a policy is held by one scaler).
        scaling: whether the scaler scales the loss: a policy's clip then waits for
            ``unscale_``.

    Raises:
        TypeError: ``spikes`` is none of these.
    """

    def __init__(self, spikes: object, scaler: object, scaling: bool) -> None:
        self._every: Policy | None = None
        self._by_optimizer: dict[int, tuple[torch.optim.Optimizer, Policy]] = {}
        if isinstance(spikes, Mapping):
            for optimizer, policy in spikes.items():
                _check(policy, f"spikes[{type(optimizer).__name__}]")
                if not isinstance(optimizer, torch.optim.Optimizer):
                    raise TypeError(f"spikes' keys must be optimizers, got {optimizer!r}")
                self._by_optimizer[id(optimizer)] = (optimizer, policy)
        elif spikes is not None:
            _check(spikes, "spikes")
            self._every = spikes  # type: ignore[assignment]
        self._unscaled: set[int] = set()  # optimizers unscaled since the last update
        for policy in self._policies():
            policy._held_by(scaler, unscale_first=scaling)

    def unscaled(self, key: int) -> None:
        """Tell the policies that optimizer ``key``'s gradients are unscaled: a policy may clip
        once all its optimizers are (any one, for the policy of every optimizer)."""
        self._unscaled.add(key)
        for policy in self._policies():
            keys = self._keys_of(policy)
            if keys is None or self._unscaled.issuperset(keys):
                policy._unscaled()

    def flag(self, key: int) -> Tensor | None:
        """1.0 when the policy of optimizer ``key`` decided this step a spike; None without one."""
        policy = self._policy(key)
        return None if policy is None else policy._skip_flag()

    def report(self, key: int) -> None:
        """Report the spike that optimizer ``key`` skipped (its answer was read already)."""
        policy = self._policy(key)
        if policy is not None:
            policy._report_spike()

    def settle(self, non_finite: dict[int, Tensor]) -> dict[int, Tensor]:
        """Hand each policy the world's non-finite answer of its optimizers, and return the spike
        flag of each of those optimizers (for the count of skipped steps)."""
        flags: dict[int, Tensor] = {}
        for policy in self._policies():
            keys = [key for key in non_finite if self._policy(key) is policy]
            flag = policy._skip_flag()
            if flag is not None:
                flags.update(dict.fromkeys(keys, flag))
            answers = [non_finite[key] for key in keys]
            device = answers[0].device if answers else None
            together = torch.stack([a.to(device) for a in answers]).amax() if answers else None
            policy._settle(together)
        self._unscaled.clear()
        return flags

    def _keys_of(self, policy: Policy) -> list[int] | None:
        """The optimizers ``policy`` decides for, or None when it decides for every one."""
        if self._every is not None:
            return None
        return [key for key, (_, held) in self._by_optimizer.items() if held is policy]

    def policy_of(self, optimizer: torch.optim.Optimizer | None) -> Policy | None:
        """The policy deciding for ``optimizer``, or for every optimizer when it is None."""
        if optimizer is None:
            return self._every
        return self._policy(id(optimizer))

    def _policy(self, key: int) -> Policy | None:
        if self._every is not None:
            return self._every
        held = self._by_optimizer.get(key)
        return None if held is None else held[1]

    def _policies(self) -> list[Policy]:
        if self._every is not None:
            return [self._every]
        unique: dict[int, Policy] = {}
        for _, policy in self._by_optimizer.values():
            unique.setdefault(id(policy), policy)
        return list(unique.values())


def _check(policy: object, argument: str) -> None:
    if not all(hasattr(policy, name) for name in ("_skip_flag", "_settle", "_held_by")):
        raise TypeError(f"{argument} must be a SpikePolicy, got {type(policy).__name__}")
