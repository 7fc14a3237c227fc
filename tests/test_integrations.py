"""The framework adapters without their frameworks, in one process (a world of one): what they
clip, against this package's clip and torch's. The frameworks themselves run in
integration_tests/ (``make test-integrations``)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import Tensor, nn

from credit.parallel.amp import GradScaler
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


# --- the mixin's misuses: each a clear error, nothing clipped -----------------------------------


class _HookFirst(nn.Module):
    """What ``LightningModule`` holds for the mixin: its own clipping hook and clip."""

    def configure_gradient_clipping(self, *args: object) -> None:
        raise AssertionError("the mixin's hook must win")

    def clip_gradients(self, *args: object) -> None:
        raise AssertionError("not reached")


def test_lightning_mixin_listed_after_the_module_is_refused_at_class_definition():
    with pytest.raises(TypeError, match=r"class Late\(MeshSafeGradientClipping, _HookFirst\)"):

        class Late(_HookFirst, MeshSafeGradientClipping):
            pass

    class Early(MeshSafeGradientClipping, _HookFirst):
        pass

    class OwnHook(Early):  # a hook of the user's own, in a subclass of the mixin
        def configure_gradient_clipping(self, *args: object) -> None:
            self.clip_grad_norm_(args[0], MAX_NORM)

    assert (
        OwnHook.configure_gradient_clipping
        is not MeshSafeGradientClipping.configure_gradient_clipping
    )


class _Bare(MeshSafeGradientClipping, nn.Module):
    """The mixin on a plain module: no Lightning clip to clip by value with."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 2)
        self.layer(torch.randn(3, 4)).square().sum().backward()


@pytest.mark.parametrize(
    ("module", "call", "error", "message"),
    [
        (
            Module,
            lambda m, o: m.clip_grad_norm_(m.parameters(), 1.0),
            TypeError,
            "self.optimizers()",
        ),
        (Module, lambda m, o: m.clip_grad_norm_(m, 1.0), TypeError, "got a Module"),
        (Module, lambda m, o: m.configure_gradient_clipping(o, 1.0, "nrom"), ValueError, "'nrom'"),
        (
            _Bare,
            lambda m, o: m.configure_gradient_clipping(o, 1.0, "value"),
            TypeError,
            "clip_grad_value_",
        ),
    ],
    ids=["parameters", "module", "misspelt algorithm", "by value outside Lightning"],
)
def test_lightning_mixin_misuse_raises_naming_the_fix_and_clips_nothing(
    module, call, error, message
):
    instance = module()
    before = _grads(instance)
    optimizer = torch.optim.SGD(instance.parameters(), lr=0.1)
    with pytest.raises(error, match=message):
        call(instance, optimizer)
    assert instance.last_grad_norm is None
    assert _same_bits(_grads(instance), before)


def test_lightning_mixin_takes_lightnings_algorithm_names_in_any_case():
    module = Module()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    module.configure_gradient_clipping(optimizer, MAX_NORM, "NORM")
    module.configure_gradient_clipping(optimizer, 0.5, "Value")
    assert module.last_grad_norm is not None
    assert module.lightning_clips == [(optimizer, 0.5, "Value")]


# --- accelerate: the accelerator checked, nothing unscaled twice --------------------------------


def _scaled_module(scaler: GradScaler) -> tuple[Module, torch.optim.Optimizer]:
    """A module whose gradients hold the scaled loss's (a world of one), and its optimizer."""
    module = Module()
    module.zero_grad()
    torch.manual_seed(1)
    scaler.scale(module.second(module.first(torch.randn(3, 4))).square().sum()).backward()
    return module, torch.optim.SGD(module.parameters(), lr=0.1)


@pytest.mark.parametrize("accelerator", [None, "parameters"], ids=["None", "parameters first"])
def test_accelerate_clip_refuses_what_is_not_an_accelerator(accelerator):
    module = Module()
    first = None if accelerator is None else module.parameters()
    with pytest.raises(TypeError, match=r"accelerator must be the accelerate\.Accelerator"):
        accelerate.clip_grad_norm_(first, module, MAX_NORM)


def test_accelerate_clip_checks_its_arguments_before_unscaling_and_may_be_called_again():
    scaler = GradScaler("cpu", init_scale=8.0)
    module, optimizer = _scaled_module(scaler)
    reference, _ = _scaled_module(GradScaler("cpu", init_scale=8.0))
    scaled = _grads(module)
    accelerator = SimpleNamespace(scaler=scaler, _optimizers=[optimizer])
    with pytest.raises(ValueError, match="max_norm"):
        accelerate.clip_grad_norm_(accelerator, module, -1.0)
    assert _same_bits(_grads(module), scaled)  # nothing unscaled
    norm = accelerate.clip_grad_norm_(accelerator, module, MAX_NORM)
    for p in reference.parameters():
        p.grad.div_(8.0)
    assert torch.equal(norm, clip_grad_norm_(reference, MAX_NORM))
    assert _same_bits(_grads(module), _grads(reference))


@pytest.mark.parametrize("scaler_type", [GradScaler, torch.amp.GradScaler], ids=["ours", "torch's"])
def test_accelerate_clip_does_not_unscale_an_optimizer_unscaled_this_step(scaler_type):
    """After ``accelerator.unscale_gradients()`` (the scaler's ``unscale_``), or after a call
    whose clip raised, the clip unscales nothing twice, with accelerate's own scaler too."""
    scaler = scaler_type("cpu", init_scale=8.0)
    module, optimizer = _scaled_module(scaler)
    scaler.unscale_(optimizer)
    unscaled = _grads(module)
    accelerator = SimpleNamespace(scaler=scaler, _optimizers=[optimizer])
    norm = accelerate.clip_grad_norm_(accelerator, module, math.inf)
    assert _same_bits(_grads(module), unscaled)
    assert math.isclose(
        float(norm),
        float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in unscaled]))),
        rel_tol=1e-6,
    )
    scaler.step(optimizer)
    scaler.update()
    assert scaler.get_scale() == 8.0
