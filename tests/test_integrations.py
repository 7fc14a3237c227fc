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
from credit.parallel.spikes import SpikePolicy

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


# --- a SpikePolicy through each adapter ----------------------------------------------------------


def _adaptive() -> SpikePolicy:
    """An adaptive clip alone, still in its warm-up: it clips to the ceiling only."""
    return SpikePolicy(skip=False, adaptive_clip="zscore")


def _set_grads(module: nn.Module, factor: float) -> None:
    """Gradients set by hand (no autograd): the same values times ``factor`` at every step."""
    for index, p in enumerate(module.parameters()):
        p.grad = torch.linspace(-1.0, 1.0, p.numel()).reshape(p.shape) * (index + 1) * factor


def test_adapters_clip_through_an_adaptive_policy_as_the_clip_does_during_its_warmup():
    """max_norm is the policy's ceiling: during the warm-up each adapter clips as the clip does
    and returns its norm, and the policy saw the step."""
    reference = Module()
    expected = clip_grad_norm_(reference.parameters(), MAX_NORM)
    lightning, accelerated, titan = Module(), Module(), Module()
    lightning.grad_spike_policy = _adaptive()
    lightning.configure_gradient_clipping(torch.optim.SGD(lightning.parameters()), MAX_NORM)
    accelerator = SimpleNamespace(scaler=None, _optimizers=[])
    policy = _adaptive()
    norms = [
        lightning.last_grad_norm,
        accelerate.clip_grad_norm_(accelerator, accelerated, MAX_NORM, spikes=policy),
        torchtitan.clip_grad_norm_(list(titan.parameters()), MAX_NORM, spikes=_adaptive()),
    ]
    for norm, module in zip(norms, (lightning, accelerated, titan), strict=True):
        assert norm is not None and torch.equal(norm, expected)
        assert _same_bits(_grads(module), _grads(reference))
    assert torch.equal(policy.metrics()["norm"], expected)


def test_lightning_hook_runs_the_policy_without_gradient_clip_val_and_before_clipping_by_value():
    """The policy sees every step: with no gradient_clip_val (no ceiling: nothing clipped during
    the warm-up), and before Lightning's clip by value."""
    module = Module()
    before = _grads(module)
    module.grad_spike_policy = policy = _adaptive()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    module.configure_gradient_clipping(optimizer, None, None)
    assert policy.metrics()["clip_bound"] == math.inf
    assert _same_bits(_grads(module), before)
    norm = module.last_grad_norm
    module.last_grad_norm = None
    module.configure_gradient_clipping(optimizer, 0.5, "value")
    assert module.lightning_clips == [(optimizer, 0.5, "value")]
    assert module.last_grad_norm is not None and torch.equal(module.last_grad_norm, norm)


def test_lightning_mixin_skips_a_spike_through_the_plugins_scaler():
    """A world of one: the policy held by the precision plugin's scaler (the Trainer's shape,
    attached by hand) skips the step whose gradients are 1000 times larger than the warm-up's,
    and takes the steps around it."""
    module = _Bare()
    module.grad_spike_policy = policy = SpikePolicy(warmup=2)
    scaler = GradScaler("cpu", scaling=False, spikes=policy)
    module.trainer = SimpleNamespace(precision_plugin=SimpleNamespace(scaler=scaler))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    moved = []
    for factor in (1.0, 1.1, 1000.0, 1.05):
        _set_grads(module, factor)
        before = [p.detach().clone() for p in module.parameters()]
        scaler.unscale_(optimizer)
        module.configure_gradient_clipping(optimizer, None, None)
        scaler.step(optimizer)
        scaler.update()
        moved.append(not _same_bits([p.detach() for p in module.parameters()], before))
    assert moved == [True, True, False, True]
    assert policy.skipped_spikes == 1 and scaler.skipped_steps == 1


@pytest.mark.parametrize("plugin_scaler", [None, "another"], ids=["no scaler", "another scaler"])
def test_lightning_mixin_refuses_a_skipping_policy_the_plugins_scaler_does_not_hold(plugin_scaler):
    module = _Bare()
    module.grad_spike_policy = policy = SpikePolicy()
    GradScaler("cpu", scaling=False, spikes=policy)  # held, but not by the plugin's scaler
    scaler = None if plugin_scaler is None else GradScaler("cpu", scaling=False)
    module.trainer = SimpleNamespace(precision_plugin=SimpleNamespace(scaler=scaler))
    before = _grads(module)
    with pytest.raises(ValueError, match=r"plugin\.scaler = GradScaler\(device, scaling=False"):
        module.configure_gradient_clipping(torch.optim.SGD(module.parameters()), MAX_NORM)
    assert module.last_grad_norm is None and policy.metrics() == {}
    assert _same_bits(_grads(module), before)


@pytest.mark.parametrize(
    ("policy", "loss", "error", "message"),
    [
        ("not a policy", None, TypeError, "must be a credit.parallel.spikes.SpikePolicy"),
        (None, 1.0, ValueError, "loss is tested by a SpikePolicy only"),
        (SpikePolicy(), None, RuntimeError, r"GradScaler\(\.\.\., spikes=policy\)"),
    ],
    ids=["not a policy", "loss without one", "skipping outside a Trainer, no scaler"],
)
def test_lightning_mixin_policy_misuse_raises_and_clips_nothing(policy, loss, error, message):
    module = _Bare()
    module.grad_spike_policy = policy
    before = _grads(module)
    with pytest.raises(error, match=message):
        module.clip_grad_norm_(torch.optim.SGD(module.parameters()), MAX_NORM, loss=loss)
    assert module.last_grad_norm is None
    assert _same_bits(_grads(module), before)


def _accelerator(scaler: object, prepared_with: object) -> tuple[Module, SimpleNamespace]:
    """A module, and an accelerator whose prepared optimizer steps through ``prepared_with``
    (accelerate's AcceleratedOptimizer holds the scaler set when it was prepared)."""
    module = Module()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    optimizer.scaler = prepared_with  # type: ignore[attr-defined]
    return module, SimpleNamespace(scaler=scaler, _optimizers=[optimizer])


@pytest.mark.parametrize("case", ["no scaler", "another scaler", "prepared before"], ids=str)
def test_accelerate_clip_refuses_a_skipping_policy_its_optimizers_step_would_not_take(case):
    spikes = SpikePolicy()
    holding = GradScaler("cpu", scaling=False, spikes=spikes)
    scaler = {"no scaler": None, "another scaler": GradScaler("cpu", scaling=False)}.get(
        case, holding
    )
    module, accelerator = _accelerator(scaler, None if case == "prepared before" else scaler)
    before = _grads(module)
    with pytest.raises(ValueError, match=r"accelerator\.scaler = GradScaler\(device, scaling"):
        accelerate.clip_grad_norm_(accelerator, module, MAX_NORM, spikes=spikes)
    assert _same_bits(_grads(module), before) and spikes.metrics() == {}


@pytest.mark.parametrize(
    ("max_norm", "spikes", "loss", "error", "message"),
    [
        (torch.tensor(1.0), _adaptive(), None, TypeError, "max_norm must be a number"),
        (MAX_NORM, "not a policy", None, TypeError, "spikes must be a"),
        (MAX_NORM, None, 1.0, ValueError, "loss is tested by a SpikePolicy only"),
    ],
    ids=["tensor max_norm", "not a policy", "loss without one"],
)
def test_accelerate_clip_checks_the_policys_arguments_before_unscaling(
    max_norm, spikes, loss, error, message
):
    scaler = GradScaler("cpu", init_scale=8.0)
    module, optimizer = _scaled_module(scaler)
    scaled = _grads(module)
    accelerator = SimpleNamespace(scaler=scaler, _optimizers=[optimizer])
    with pytest.raises(error, match=message):
        accelerate.clip_grad_norm_(accelerator, module, max_norm, spikes=spikes, loss=loss)
    assert _same_bits(_grads(module), scaled)


def test_torchtitan_clip_with_a_skipping_policy_no_scaler_holds_raises_and_clips_nothing():
    module = Module()
    before = _grads(module)
    with pytest.raises(RuntimeError, match="a SpikePolicy that skips steps decides for a Grad"):
        torchtitan.clip_grad_norm_(list(module.parameters()), MAX_NORM, spikes=SpikePolicy())
    with pytest.raises(TypeError, match="spikes must be a"):
        torchtitan.clip_grad_norm_(list(module.parameters()), MAX_NORM, spikes=object())  # type: ignore[arg-type]
    assert _same_bits(_grads(module), before)
