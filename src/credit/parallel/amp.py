"""A GradScaler whose decision to take or skip a step is the world's, on any mix of meshes.

``torch.amp.GradScaler`` decides per rank whether a step holds a NaN or inf. On DTensor
gradients, DTensor's handler for the check reduces the flag over the mesh of the first gradient
of each (device, dtype) group only: with FSDP2 + TP, an inf in one rank's TP shard makes its dp
peers skip and back off while the other ranks step, and the replicas drift apart for good. Here
every rank checks its local shards, and the answer is reduced over the world: read from the norm
that follows (``clip_grad_norm_``, ``total_grad_norm`` or ``grad_norm_report`` of this package)
when it covers the optimizer's gradients, whose reduced values are non-finite on every rank as
soon as one rank holds a non-finite value, or by one small all_reduce of its own when the scaler
needs the answer and no norm gave it (see ``found_inf``). Every rank then takes the same
decision and keeps the same scale; the norms return what they return without a scaler. The
skipped steps are counted and reported by a helper the scaler holds (``skipped_steps``).

It is a subclass, as torch's own ShardedGradScaler is: it overrides ``unscale_``, ``step``,
``update``, ``state_dict``, ``load_state_dict`` and the protected ``_check_inf_per_device`` and
``_maybe_opt_step``, and reads the protected state ``_per_optimizer_states``, ``_scale``,
``_device`` and ``_enabled``, all alike on torch 2.10 to 2.15.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.amp.grad_scaler import OptState

from credit.parallel import _scaler
from credit.parallel._common.compat import local_tensor
from credit.parallel.spikes import SpikePolicy

__all__ = ["GradScaler"]


class GradScaler(torch.amp.GradScaler):
    """Drop-in ``torch.amp.GradScaler`` that takes or skips every step on all ranks together.

    Same constructor and methods as torch's; swap the import. ``found_inf`` is the same on every
    rank for any mix of meshes (FSDP2, TP, HSDP, plain gradients), pipeline stages and
    ``distinct_along`` groups, so every rank skips the same steps, keeps the same scale, and
    replicas stay bit-identical. Where torch's scaler is already right (every gradient on one
    mesh over the world), the scales, skips and parameters have its bits.

    Per step, with the trainer's usual sequence::

        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        norm = clip_grad_norm_(model.parameters(), max_norm)  # credit.parallel.collectives
        scaler.step(optimizer)
        scaler.update()

    ``unscale_`` checks the local shards and issues no collective. A norm of this package over the
    world that covers the optimizer's gradients answers for every rank from its own reduced values
    (a NaN or inf in any gradient makes its norm non-finite on every rank), and returns exactly
    what it returns without a scaler; ``step`` and ``update`` issue none: the norm's collectives
    per step. A norm over part of the gradients leaves the answer to a later norm; without one,
    ``step`` (or ``update``, when ``step`` was not called) issues one small all_reduce. Each
    optimizer gets its own answer, as with torch's scaler, and two scalers never answer each
    other's optimizers. A clip whose coefficient is not finite (a NaN or negative tensor
    ``max_norm``, or a NaN norm) makes the gradients it scales NaN, so their optimizers skip.
    Fused optimizers (``fused=True``) take the answer on the device, without a host sync.

    With ``scaling=False`` (bf16 or float32 training) nothing is scaled: the scaler only skips
    steps whose gradients hold a NaN or inf, decided on every rank alike, and counts them. Its
    check rides on the clip's norm, so it costs no pass over the gradients when a clip follows
    ``unscale_``. It works on whatever device the gradients live on: ``device`` names the device
    of a scale, and there is none. With scaling on, the scale is created on the loss's device,
    as torch's; where torch's scaler disables itself (``"cuda"`` on a machine without CUDA,
    leaving non-finite steps to make the weights NaN), this one follows the loss and the
    gradients onto the CPU, scales and skips as on a GPU, and warns that it did (a
    ``UserWarning``, once per call site).

    On a step skipped by a non-fused optimizer (whose step reads the answer on the host anyway),
    the scaler logs a warning naming the parameters whose gradients held a NaN or inf when
    ``unscale_`` checked them and the ranks that held them, on the world's rank 0, for the 1st,
    2nd, 4th, 8th, ... skipped step (one more all_gather, on those steps only).

    With ``spikes``, a :class:`~credit.parallel.spikes.SpikePolicy` (whose ``clip_grad_norm_``
    takes the place of the clip) also skips the steps it decides are spikes, on every rank alike:
    the step's answer is then "a NaN or inf, or a spike", on the device, so fused optimizers take
    it without a host sync. A spike leaves the scale alone (only a NaN or inf backs it off), and
    at :meth:`update` the policy's histories take in the step if neither skipped it. A skipped
    spike counts in ``skipped_steps`` and ``last_step_skipped``; the policy counts by cause.

    :meth:`state_dict` holds torch's five entries and ``scaling``, ``skipped_steps`` and
    ``reported_skips``, so a resumed run counts on and reports on where it stopped; it works as a
    stateful object of ``torch.distributed.checkpoint`` (the policy has a state of its own).

    Args:
        device, init_scale, growth_factor, backoff_factor, growth_interval, enabled: as for
            ``torch.amp.GradScaler``.
        scaling: scale the loss (fp16). False: no scaling, only the skipping of non-finite
            steps (bf16, float32).
        model: the module whose parameters the optimizers update, only to name them in the
            skipped-step report. Without it, the report takes the names an optimizer built from
            ``model.named_parameters()`` keeps (its ``param_names``), and otherwise names a
            parameter by its place in the optimizer and its shape.
        spikes: a :class:`~credit.parallel.spikes.SpikePolicy` deciding for every optimizer this
            scaler steps, or a mapping from each optimizer to the policy deciding for it (two
            optimizers clipped apart). A policy is held by one scaler.

    Attributes:
        scaling: whether the loss is scaled.
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        scaling: bool = True,
        model: nn.Module | None = None,
        spikes: SpikePolicy | Mapping[torch.optim.Optimizer, SpikePolicy] | None = None,
    ) -> None:
        super().__init__(
            _checked_device(device, scaling, enabled),
            init_scale if scaling else 1.0,
            growth_factor,
            backoff_factor,
            growth_interval,
            enabled,
        )
        if spikes is not None and not enabled:
            raise ValueError(
                "GradScaler(enabled=False) steps every optimizer and skips nothing, spikes "
                "included: pass enabled=True (scaling=False to skip without scaling)"
            )
        self.scaling = scaling
        self._flags = _scaler.StepFlags()  # one per optimizer, from unscale_ to update()
        self._step_answers: dict[int, Tensor] = {}  # each optimizer's, made once a step
        self._skipped_steps = _scaler.SkippedSteps(model)
        self._spikes = _scaler.SpikePolicies(spikes, self, scaling)

    # --- scaling off ---------------------------------------------------------------------------

    def scale(self, outputs: Any) -> Any:
        """Multiply ``outputs`` by the scale factor, as torch's (unchanged with ``scaling=False``)."""
        if self._enabled and not self.scaling:
            return outputs
        return super().scale(outputs)

    def _scale_tracker(self, optimizer: torch.optim.Optimizer) -> None:
        """With ``scaling=False`` the loss never passes through :meth:`scale`: the scale (1.0,
        which fused optimizers read) goes beside the gradients."""
        if self._scale is None and not self.scaling:
            self._lazy_init_scale_growth_tracker(_grads_device(optimizer))

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale factor, as torch's ``unscale_``.

        Checks the local shards for NaN and inf, without a collective: the answer is reduced over
        the world by the next norm of this package that covers them (or by :meth:`step`). With
        ``scaling=False`` nothing is divided and the check itself is left to that norm.
        """
        if not self._enabled:
            return
        self._scale_tracker(optimizer)
        scale, _ = self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update(). "
                "Call scaler.update() once per iteration, after scaler.step(optimizer), and "
                "unscale_(optimizer) at most once between two update() calls"
            )
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError(
                "unscale_() is being called after step(), with no update() in between: "
                "scaler.update() was not called after the last scaler.step(optimizer). Call it "
                "once per iteration, after the step of every optimizer the scaler steps"
            )
        grads = _local_grads(optimizer, allow_fp16=not self.scaling)
        local = None
        if self.scaling:
            # FP32 division can be imprecise for certain compile options: the reciprocal in FP64.
            local = _scaler.check_and_unscale(grads, scale.double().reciprocal().float())
        self._flags.expect(id(optimizer), grads, scale.device, local)
        state["found_inf_per_device"] = {scale.device: torch.zeros_like(scale)}
        state["stage"] = OptState.UNSCALED
        self._spikes.unscaled(id(optimizer))

    # --- the world's answer --------------------------------------------------------------------

    def _step_answer(self, key: int) -> Tensor:
        """Whether optimizer ``key`` skips its step: the world's non-finite answer, or a spike of
        its policy (1.0 or 0.0, which fused optimizers compare with 1), written where torch's
        step reads it. Made once a step, at its first call; later calls of the step return it.
        ``update`` writes the non-finite answer alone back for the scale."""
        answer = self._step_answers.get(key)
        if answer is None:
            answer = self._flags.world_answer(key)
            spike = self._spikes.flag(key)
            if spike is not None:
                answer = torch.maximum(answer, spike.to(answer.device))
            self._step_answers[key] = answer
            self._per_optimizer_states[key]["found_inf_per_device"] = {answer.device: answer}
        return answer

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """A fused optimizer's step without ``unscale_``: check, then reduce over the world."""
        self._scale_tracker(optimizer)
        scale, _ = self._check_scale_growth_tracker("_check_inf_per_device")
        grads = _local_grads(optimizer, allow_fp16=True)
        local = _scaler.check(grads, scale.device)
        self._flags.expect(id(optimizer), grads, scale.device, local)
        self._step_answer(id(optimizer))
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> float | None:
        """Unscale if needed, then step ``optimizer`` unless a gradient holds a NaN or inf on any
        rank; as torch's ``step``, arguments forwarded to ``optimizer.step``.

        Returns:
            What ``optimizer.step`` returned, or None when the step was skipped.
        """
        if self._enabled:
            self._scale_tracker(optimizer)
            if self._per_optimizer_states[id(optimizer)]["stage"] is OptState.UNSCALED:
                self._step_answer(id(optimizer))
        return super().step(optimizer, *args, **kwargs)

    def _maybe_opt_step(
        self,
        optimizer: torch.optim.Optimizer,
        optimizer_state: dict[str, Any],
        *args: Any,
        **kwargs: Any,
    ) -> float | None:
        key = id(optimizer)
        if self._step_answer(key).item():  # the host sync torch's own step makes here
            flag = self._flags.get(key)
            assert flag is not None  # the step's answer read it
            if self._flags.world_answer(key).item():  # a second read, on a skipped step only
                self._skipped_steps.report(optimizer, flag)
            else:
                self._spikes.report(key)
            return None
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | Tensor | None = None) -> None:
        """Update the scale factor as torch's ``update`` (not with ``scaling=False``), and count
        the skipped step.

        An optimizer whose gradients were unscaled but not stepped (a custom step that calls
        ``step`` only when the norm is finite) counts with the world's answer, as in torch.
        """
        if not self._enabled:
            return
        if new_scale is not None and not self.scaling:
            raise ValueError("a GradScaler with scaling=False keeps its scale at 1.0")
        non_finite = {key: self._flags.world_answer(key) for key in self._flags.optimizers()}
        for key, answer in non_finite.items():  # the scale backs off for a NaN or inf alone
            self._per_optimizer_states[key]["found_inf_per_device"] = {answer.device: answer}
        spikes = self._spikes.end_step(non_finite)
        self._flags.clear()
        self._step_answers.clear()
        answers = _answers(self._per_optimizer_states, spikes)
        if answers:
            self._skipped_steps.count(answers)
        elif new_scale is None:
            raise AssertionError("No inf checks were recorded prior to update.")
        if self.scaling:
            super().update(new_scale)
        else:
            self._per_optimizer_states = defaultdict(
                lambda: {"stage": OptState.READY, "found_inf_per_device": {}}
            )

    # --- what the trainer may ask --------------------------------------------------------------

    def get_scale(self) -> float:
        """The current scale, as torch's (1.0 with ``scaling=False``)."""
        return super().get_scale() if self.scaling else 1.0

    @property
    def skipped_steps(self) -> int:
        """How many steps were skipped so far, the same on every rank (reads the device);
        resumed from :meth:`load_state_dict`."""
        return self._skipped_steps.total

    @property
    def last_step_skipped(self) -> bool:
        """Whether the step before the last :meth:`update` was skipped, the same on every rank
        (reads the device): step an LR scheduler only when it was not. With several optimizers,
        whether any of them skipped it: ask :meth:`step_skipped` of each.
        """
        return self._skipped_steps.last_skipped

    def step_skipped(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s step before the last :meth:`update` was skipped (a NaN or
        inf, or a spike of its policy), the same on every rank (reads the device): with several
        optimizers, each one's scheduler steps on its own answer.

        Raises:
            ValueError: ``optimizer`` was not unscaled or stepped through this scaler in that
                step.
        """
        return self._skipped_steps.skipped(id(optimizer))

    def spike_policy(self, optimizer: torch.optim.Optimizer | None = None) -> SpikePolicy | None:
        """The :class:`~credit.parallel.spikes.SpikePolicy` this scaler holds: the one deciding
        for ``optimizer``, or, without one, the policy deciding for every optimizer. None where
        no policy decides (for ``optimizer``, or, given a mapping, without one).

        A trainer that receives a scaler built elsewhere (a factory, a framework) reaches its
        policy here: to call the policy's clip, read its metrics, or save its state beside the
        scaler's.
        """
        policy = self._spikes.policy_of(optimizer)
        assert policy is None or isinstance(policy, SpikePolicy)  # the constructor checked
        return policy

    # --- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch's five entries (``scale`` is 1.0 with ``scaling=False``), and ``scaling``,
        ``skipped_steps`` and ``reported_skips`` (how many skipped steps the report has seen).
        Empty when the scaler is disabled, as torch's. Call it after :meth:`update`."""
        state = super().state_dict()
        if state:
            state.update(scaling=self.scaling, **self._skipped_steps.state_dict())
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state from :meth:`state_dict`, or from ``torch.amp.GradScaler.state_dict``
        (which scales, and counts nothing).

        Raises:
            ValueError: the state was saved with scaling on and this scaler has it off, or the
                reverse: the saved scale would divide gradients that were never multiplied.
            RuntimeError: the state is empty (saved by a disabled scaler), as torch's.
        """
        if not self._enabled:
            return
        saved_scaling = bool(state_dict.get("scaling", True))
        if state_dict and saved_scaling != self.scaling:
            raise ValueError(
                f"the GradScaler state was saved with scaling={saved_scaling} (scale "
                f"{state_dict.get('scale')}) and is loaded into a GradScaler with "
                f"scaling={self.scaling}; build the scaler with scaling={saved_scaling}, or "
                "start this one from its own initial state"
            )
        super().load_state_dict(state_dict)
        self._skipped_steps.load_state_dict(state_dict)


def _checked_device(device: str, scaling: bool, enabled: bool) -> str:
    """The device name handed to torch's constructor, which disables a ``"cuda"`` scaler on a
    machine without CUDA (skipping included, with only a warning). The scale is created where
    the loss (or, with ``scaling=False``, the gradients) lives, so on such a machine the scaler
    follows the tensors it is given onto the CPU instead, and warns (Python's warning: once per
    call site)."""
    if not (enabled and device == "cuda" and not torch.cuda.is_available()):
        return device
    if scaling:
        warnings.warn(
            'GradScaler("cuda"): CUDA is not available; the scale follows the loss and the '
            'gradients onto their device (pass device="cpu" to say so)',
            UserWarning,
            stacklevel=3,
        )
    return "cpu"


def _answers(states: dict[int, dict[str, Any]], spikes: dict[int, Tensor]) -> dict[int, Tensor]:
    """Each optimizer's answer of the step (1.0: skipped), from the answers torch's states hold
    and the spike flags of the policies."""
    answers = {}
    for key, state in states.items():
        found = list(state["found_inf_per_device"].values())
        if len(found) == 1:
            answers[key] = found[0]
        elif found:
            device = found[0].device
            answers[key] = torch.stack([answer.to(device) for answer in found]).amax()
    for key, flag in spikes.items():
        answer = answers.get(key)
        answers[key] = flag if answer is None else torch.maximum(answer, flag.to(answer.device))
    return answers


def _grads_device(optimizer: torch.optim.Optimizer) -> torch.device:
    """Where the optimizer's gradients live (the CPU when none has one yet)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is not None:
                return local_tensor(param.grad).device
    return torch.device("cpu")


def _local_grads(optimizer: torch.optim.Optimizer, allow_fp16: bool) -> list[Tensor]:
    """The gradients of ``optimizer``'s parameters, DTensors' as their local shards."""
    grads = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is None:
                continue
            grad = local_tensor(param.grad)
            if not allow_fp16 and grad.dtype == torch.float16:
                raise ValueError("Attempting to unscale FP16 gradients.")
            grads.append(grad._values() if grad.is_sparse else grad)
    return grads
