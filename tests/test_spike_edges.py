"""The spike policy at its edges, in one process: what the scaler hands back, and bounds that
would silently stop training.

Multi-rank edges (losses some ranks lack, arguments one rank gets wrong) are in
``test_spike_edges_ranks.py``.
"""

from __future__ import annotations

import logging
import math

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


def _param(value: float) -> nn.Parameter:
    param = nn.Parameter(torch.zeros(1))
    param.grad = torch.tensor([value])
    return param


def test_a_loss_first_given_after_a_step_without_one_is_ignored_with_a_warning():
    policy = SpikePolicy(skip=False, adaptive_clip="zscore")
    policy.clip_grad_norm_([_param(1.0)])
    with pytest.warns(UserWarning, match="the loss is ignored: no rank gave one at this policy's"):
        policy.clip_grad_norm_([_param(1.0)], loss=2.0)
    assert "loss" not in policy.metrics()
    assert policy.state_dict()["with_loss"] == 0


def test_a_policy_for_one_optimizer_needs_that_optimizer_unscaled_when_scaling():
    a, b = _param(1.0), _param(1.0)
    first, second = torch.optim.SGD([a], lr=1.0), torch.optim.SGD([b], lr=1.0)
    policy = SpikePolicy()
    scaler = GradScaler("cpu", spikes={second: policy})
    scaler.scale(torch.ones(()))  # the scale is made with the first loss
    scaler.unscale_(first)
    with pytest.raises(RuntimeError, match=r"came before scaler.unscale_\(optimizer\)"):
        policy.clip_grad_norm_([b])
    assert torch.equal(b.grad, torch.tensor([1.0])) and policy.metrics() == {}
    scaler.unscale_(second)
    policy.clip_grad_norm_([b])
    assert policy.metrics()["norm"].item() == pytest.approx(1.0 / 2.0**16)


def test_a_nan_loss_is_reported_as_a_non_finite_skip(caplog):
    policy = SpikePolicy(warmup=2)
    param = _param(1.0)
    optimizer = torch.optim.SGD([param], lr=1.0)
    scaler = GradScaler("cpu", scaling=False, spikes=policy)
    for loss in [1.0, 1.1, math.inf]:
        param.grad = torch.tensor([1.0])
        scaler.unscale_(optimizer)
        policy.clip_grad_norm_([param], loss=loss)
        with caplog.at_level(logging.WARNING, logger="credit.parallel.spikes"):
            scaler.step(optimizer)
        scaler.update()
    assert scaler.last_step_skipped and scaler.skipped_steps == 1
    assert (policy.skipped_non_finite, policy.skipped_spikes) == (1, 0)
    assert policy.metrics()["spike"].item() == 0.0
    assert "the loss averaged over the world is inf" in caplog.text
    with pytest.raises(ValueError, match="not unscaled or stepped through the GradScaler"):
        scaler.step_skipped(torch.optim.SGD([_param(1.0)], lr=1.0))
    assert scaler.step_skipped(optimizer)
