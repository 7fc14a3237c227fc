"""The framework adapters without their frameworks, in one process (a world of one): what they
clip, against this package's clip and torch's. The frameworks themselves run in
integration_tests/ (``make test-integrations``)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor, nn

from credit.parallel.collectives import clip_grad_norm_
from credit.parallel.integrations import accelerate, torchtitan
from credit.parallel.integrations.lightning import MeshSafeGradientClipping

MAX_NORM = 0.1


class Module(MeshSafeGradientClipping, nn.Module):
    """A LightningModule's shape: the mixin first, and Lightning's own clip (recorded)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 2)
        self.lightning_clips: list[tuple[object, ...]] = []
        self.second(self.first(torch.randn(3, 4))).square().sum().backward()

    def clip_gradients(self, *args: object) -> None:
        self.lightning_clips.append(args)


def _grads(module: nn.Module) -> list[Tensor]:
    return [p.grad.clone() for p in module.parameters() if p.grad is not None]


def _same_bits(a: list[Tensor], b: list[Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_lightning_hook_clips_by_norm_as_the_clip_does():
    module, reference = Module(), Module()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    module.configure_gradient_clipping(optimizer, MAX_NORM, None)
    expected = clip_grad_norm_(reference.parameters(), MAX_NORM)
    assert module.last_grad_norm is not None and torch.equal(module.last_grad_norm, expected)
    assert expected > MAX_NORM
    assert _same_bits(_grads(module), _grads(reference))
    assert not module.lightning_clips


def test_lightning_hook_clips_the_optimizers_parameters_only():
    module, reference = Module(), Module()
    optimizer = torch.optim.SGD(module.second.parameters(), lr=0.1)
    norm = module.clip_grad_norm_(optimizer, MAX_NORM, norm_type=1.0)
    assert torch.equal(norm, clip_grad_norm_(reference.second.parameters(), MAX_NORM, 1.0))
    assert _same_bits(_grads(module.first), _grads(Module().first))
    assert _same_bits(_grads(module.second), _grads(reference.second))


def test_lightning_hook_leaves_clipping_by_value_to_lightning_and_no_value_to_nothing():
    module = Module()
    before = _grads(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    module.configure_gradient_clipping(optimizer, 0.5, "value")
    module.configure_gradient_clipping(optimizer, None, None)
    module.configure_gradient_clipping(optimizer, 0.0, "norm")
    assert module.lightning_clips == [(optimizer, 0.5, "value")]
    assert module.last_grad_norm is None
    assert _same_bits(_grads(module), before)


def test_torchtitan_signature_gives_the_clips_bits_and_torchs():
    module, reference, theirs = Module(), Module(), Module()
    norm = torchtitan.clip_grad_norm_(
        list(module.parameters()), MAX_NORM, 2.0, False, None, pp_mesh=None, ep_enabled=True
    )
    assert torch.equal(norm, clip_grad_norm_(reference.parameters(), MAX_NORM))
    assert torch.equal(norm, torch.nn.utils.clip_grad_norm_(theirs.parameters(), MAX_NORM))
    assert _same_bits(_grads(module), _grads(theirs))


def test_accelerate_clip_without_a_scaler_is_the_clip():
    module, reference = Module(), Module()
    accelerator = SimpleNamespace(scaler=None, _optimizers=[])
    norm = accelerate.clip_grad_norm_(accelerator, module, MAX_NORM)
    assert torch.equal(norm, clip_grad_norm_(reference, MAX_NORM))
    assert _same_bits(_grads(module), _grads(reference))
