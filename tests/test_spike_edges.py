"""The spike policy at its edges, in one process: what the scaler hands back, and bounds that
would silently stop training.

Multi-rank edges (losses some ranks lack, arguments one rank gets wrong) are in
``test_spikes_edges_ranks.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from credit.parallel.amp import GradScaler
from credit.parallel.spikes import SpikePolicy


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1.0)


def test_the_scaler_hands_back_the_policy_it_holds():
    policy = SpikePolicy()
    scaler = GradScaler("cpu", scaling=False, spikes=policy)
    assert scaler.spike_policy() is policy
    assert scaler.spike_policy(_optimizer()) is policy
    assert GradScaler("cpu").spike_policy() is None


def test_the_scaler_hands_back_each_optimizers_policy():
    first, second = _optimizer(), _optimizer()
    a, b = SpikePolicy(), SpikePolicy()
    scaler = GradScaler("cpu", scaling=False, spikes={first: a, second: b})
    assert scaler.spike_policy(first) is a
    assert scaler.spike_policy(second) is b
    assert scaler.spike_policy(_optimizer()) is None
    assert scaler.spike_policy() is None  # no policy decides for every optimizer


@pytest.mark.parametrize("max_norm", [0, 0.0])
def test_a_zero_max_norm_is_refused_before_any_gradient_changes(max_norm):
    param = nn.Parameter(torch.ones(3))
    param.grad = torch.full((3,), 2.0)
    policy = SpikePolicy(skip=False, adaptive_clip="zscore")
    with pytest.raises(ValueError, match=r"max_norm=0 .*max_norm=None"):
        policy.clip_grad_norm_([param], max_norm=max_norm)
    assert torch.equal(param.grad, torch.full((3,), 2.0))
    assert policy.metrics() == {}
