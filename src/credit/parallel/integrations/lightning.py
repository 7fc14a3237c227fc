"""Lightning: ``Trainer(gradient_clip_val=...)`` on any mix of meshes.

Lightning clips through its precision plugin, which calls ``torch.nn.utils.clip_grad_norm_``: with
``ModelParallelStrategy`` (tensor-parallel weights on the ``(data_parallel, tensor_parallel)``
mesh, everything else FSDP2 on ``data_parallel``) that raises "All operands in aten.stack.default
must have the same mesh". Mixed into a ``LightningModule``, :class:`MeshSafeGradientClipping`
clips by norm with :func:`credit.parallel.collectives.clip_grad_norm_` instead (or with a
:class:`~credit.parallel.spikes.SpikePolicy`, which also skips gradient spikes), and logs the norm
through Lightning's ``self.log``. This module does not import Lightning.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor, nn

from credit.parallel._common.inputs import DistinctAlong
from credit.parallel.collectives import clip_grad_norm_
from credit.parallel.spikes import SpikePolicy

__all__ = ["MeshSafeGradientClipping"]


class MeshSafeGradientClipping:
    """``LightningModule`` mixin: clipping by norm with this package's clip, on any mesh.

    List it before ``LightningModule``::

        class Model(MeshSafeGradientClipping, L.LightningModule): ...

    In automatic optimization, ``Trainer(gradient_clip_val=1.0)`` then works as Lightning
    documents it: the mixin's :meth:`configure_gradient_clipping` clips the optimizer's
    parameters by norm with :func:`~credit.parallel.collectives.clip_grad_norm_`, after Lightning
    has unscaled fp16 gradients (with ``credit.parallel.amp.GradScaler`` as the precision
    plugin's scaler, its all_reduce also carries the scaler's skip decision). Clipping by value
    (``gradient_clip_algorithm="value"``) stays Lightning's: it is element-wise and works on any
    mesh. In manual optimization, call :meth:`clip_grad_norm_` where Lightning's documentation
    calls ``self.clip_gradients``, between ``self.manual_backward(loss)`` and ``optimizer.step()``
    (with an fp16 scaler, in ``on_before_optimizer_step``, where the gradients are unscaled).

    A subclass that overrides ``configure_gradient_clipping`` itself calls
    :meth:`clip_grad_norm_` from it.

    With :attr:`grad_spike_policy` set, every clip by norm is the policy's
    (:meth:`~credit.parallel.spikes.SpikePolicy.clip_grad_norm_`, ``gradient_clip_val`` its fixed
    ceiling), and the hook calls it at every step, with no ``gradient_clip_val`` too (the policy
    must see every step), and before Lightning's clip by value. A policy that skips steps decides
    for the ``GradScaler`` of this package that holds it, which must be the precision plugin's
    scaler, the one Lightning steps the optimizer through: ``MixedPrecision("16-mixed", device,
    scaler=GradScaler(device, spikes=policy))``. Lightning's ``MixedPrecision`` refuses a scaler
    for ``"bf16-mixed"`` in its constructor only, and steps through one set afterwards:
    ``plugin.scaler = GradScaler(device, scaling=False, spikes=policy)``. Lightning's float32
    plugin steps through no scaler: there, only an adaptive clip (``skip=False``) works.

    Each clip by norm logs the norm before clipping through Lightning's ``self.log``, on the step
    (``on_step=True, on_epoch=False``), from the hook that clipped, under :attr:`grad_norm_name`:
    the Trainer's loggers receive it (TensorBoard, CSV, ...), ``trainer.callback_metrics`` hold
    it, and the progress bar shows it with :attr:`grad_norm_prog_bar`. The norm is the same bits
    on every rank, so every rank logs it with ``sync_dist=False`` and ``rank_zero_only=True``:
    Lightning reduces nothing and runs no collective for it.

    What logging costs: ``self.log`` keeps the tensor on its device (a copy of a 0-dim tensor, no
    host read). Lightning reads it on the host (``.item()``) when it hands the step's metrics to
    the Trainer's loggers, every ``log_every_n_steps`` steps (50 by default), on every rank; at
    the end of every step when it is on the progress bar; and where a callback monitors it. With
    none of these, it is never read.

    A second clip in the same hook of a step (several optimizers in manual optimization) replaces
    the first's value: switch logging off and log each returned norm under a name of its own.
    Outside a ``LightningModule`` (no ``log`` method), nothing is logged.

    Attributes:
        grad_spike_policy: a :class:`~credit.parallel.spikes.SpikePolicy` that every clip by norm
            goes through, or None. Default: None.
        grad_clip_distinct_along: ``distinct_along`` pairs passed to every clip, for parameters
            whose copies differ along a group their mesh does not show (experts held per
            expert-parallel rank): a list of ``(parameters, group)``, set in ``configure_model``.
            Default: None.
        last_grad_norm: the total norm of the last clip, before clipping (a plain scalar
            tensor, the same on every rank). None before the first clip.
        log_grad_norm: whether each clip by norm logs the norm through ``self.log`` (a switch
            named as Lightning names its own, ``LearningRateMonitor(log_momentum=...)``).
            Default: True.
        grad_norm_name: the name the norm is logged under; ``{norm_type}`` in it becomes the
            clip's ``norm_type`` as a float. Default: ``"grad_{norm_type}_norm_total"``, so
            ``grad_2.0_norm_total``: the name ``lightning.pytorch.utilities.grad_norm`` gives the
            same total (a chart or a callback's ``monitor`` set up for it reads this one).
        grad_norm_prog_bar: whether the norm is also on the progress bar (``self.log``'s
            ``prog_bar``; a host read at every step). Default: False.
    """

    grad_spike_policy: SpikePolicy | None = None
    grad_clip_distinct_along: DistinctAlong | None = None
    last_grad_norm: Tensor | None = None
    log_grad_norm: bool = True
    grad_norm_name: str = "grad_{norm_type}_norm_total"
    grad_norm_prog_bar: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Refuse a class in which another ``configure_gradient_clipping`` (``LightningModule``'s,
        when the mixin is listed after it) comes before the mixin's: the Trainer would call that
        one, and torch's clip would raise its mixed-mesh error with no hint.

        Raises:
            TypeError: naming the class whose hook wins and the order of bases that works.
        """
        super().__init_subclass__(**kwargs)
        for base in cls.__mro__[1:]:
            if base is MeshSafeGradientClipping:
                return
            if "configure_gradient_clipping" in vars(base) and not issubclass(
                base, MeshSafeGradientClipping
            ):
                mixins = [b for b in cls.__bases__ if issubclass(b, MeshSafeGradientClipping)]
                bases = [*mixins, *(b for b in cls.__bases__ if b not in mixins)]
                raise TypeError(
                    f"{cls.__qualname__}: {base.__qualname__}.configure_gradient_clipping comes "
                    "before MeshSafeGradientClipping's in the method resolution order, so the "
                    "Trainer's gradient_clip_val would bypass the mixin (Lightning's own hook "
                    "calls torch's clip, which raises on mixed meshes). List the mixin first: "
                    f"class {cls.__name__}({', '.join(b.__name__ for b in bases)}). A hook of "
                    "your own goes in a subclass of MeshSafeGradientClipping and calls "
                    "self.clip_grad_norm_(optimizer, max_norm)"
                )

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Lightning's hook: clip by norm with :meth:`clip_grad_norm_`, by value as Lightning does.

        With :attr:`grad_spike_policy` set, the policy's clip runs at every step: with
        ``gradient_clip_val`` as its ceiling when clipping by norm, without a ceiling before
        Lightning's clip by value, and without one when ``gradient_clip_val`` is None or 0.

        Args:
            optimizer: the optimizer about to step.
            gradient_clip_val: the Trainer's ``gradient_clip_val``; None or 0 clips nothing
                (but the policy's adaptive clip, where one is set).
            gradient_clip_algorithm: the Trainer's ``gradient_clip_algorithm``: ``"norm"``
                (also when None, as in Lightning) or ``"value"``, in any case.

        Raises:
            ValueError: ``gradient_clip_algorithm`` is neither ``"norm"`` nor ``"value"``, or as
                :meth:`clip_grad_norm_`.
            TypeError: clipping by value in a class without Lightning's ``clip_gradients`` (the
                mixin is not in a ``LightningModule``), or as :meth:`clip_grad_norm_`.
        """
        algorithm = _algorithm(gradient_clip_algorithm)
        has_policy = self.grad_spike_policy is not None
        if algorithm == "value":
            # Lightning's own clip by value: element-wise, right on every mesh.
            clip_by_value = _lightning_clip(self)
            if has_policy:
                self.clip_grad_norm_(optimizer, None)
            clip_by_value(optimizer, gradient_clip_val, gradient_clip_algorithm)
        elif gradient_clip_val or has_policy:
            self.clip_grad_norm_(optimizer, gradient_clip_val or None)

    def clip_grad_norm_(
        self,
        optimizer: torch.optim.Optimizer,
        max_norm: float | Tensor | None,
        norm_type: float = 2.0,
        *,
        loss: Tensor | float | None = None,
    ) -> Tensor:
        """Clip the gradients of ``optimizer``'s parameters to ``max_norm`` on any mix of meshes.

        :func:`credit.parallel.collectives.clip_grad_norm_` on the parameters of every parameter
        group of ``optimizer``, named after the module's parameters in its messages, with
        :attr:`grad_clip_distinct_along`, or :attr:`grad_spike_policy`'s clip on them where one
        is set; the norm is then logged on the step, unless :attr:`log_grad_norm` is False (see
        the class). Every rank must call it, from a hook that logs on the step when the norm is
        logged (the training step, ``on_before_optimizer_step``,
        ``configure_gradient_clipping``: not ``on_train_epoch_end``).

        Args:
            optimizer: the optimizer whose parameters' gradients are clipped in place (Lightning's
                wrapped optimizer too).
            max_norm: max norm of the gradients, in every form the clip takes; with a policy, a
                number (its fixed ceiling) or None (none).
            norm_type: p-norm exponent, a positive float or ``inf``. Default: 2.
            loss: this rank's loss, which the policy tests as it tests the norm (manual
                optimization); only with :attr:`grad_spike_policy`. Default: None.

        Returns:
            The total norm before clipping (also kept as :attr:`last_grad_norm`).

        Raises:
            TypeError: ``optimizer`` is not an optimizer (parameters, a module),
                :attr:`grad_norm_name` is not a string while logging is on, or
                :attr:`grad_spike_policy` is not a ``SpikePolicy`` (all before anything is
                clipped), or as :func:`credit.parallel.collectives.clip_grad_norm_`.
            ValueError: :attr:`grad_norm_name` is empty while logging is on, a ``loss`` is given
                without a policy, or the policy skips steps and the Trainer's precision plugin
                steps through no ``GradScaler`` holding it (all before anything is clipped), or
                as :func:`credit.parallel.collectives.clip_grad_norm_`.
            RuntimeError: as :func:`credit.parallel.collectives.clip_grad_norm_` or
                :meth:`credit.parallel.spikes.SpikePolicy.clip_grad_norm_`.
            MisconfigurationException: Lightning's, from ``self.log``, where the hook does not
                log on the step.
        """
        param_groups = _param_groups(optimizer)
        policy = _checked_policy(self, self.grad_spike_policy, loss)
        if self.log_grad_norm:
            _check_name(self.grad_norm_name)
        names = {id(p): name for name, p in cast(nn.Module, self).named_parameters()}
        named = [
            (names.get(id(p), f"param_groups[{group}][{index}]"), p)
            for group, settings in enumerate(param_groups)
            for index, p in enumerate(settings["params"])
        ]
        distinct_along = self.grad_clip_distinct_along
        if policy is None:
            bound = cast("float | Tensor", max_norm)  # the clip refuses None, naming it
            norm = clip_grad_norm_(named, bound, norm_type, distinct_along=distinct_along)
        else:
            ceiling = cast("float | None", max_norm)  # the policy refuses a tensor, naming it
            norm = policy.clip_grad_norm_(
                named, ceiling, norm_type, loss=loss, distinct_along=distinct_along
            )
        self.last_grad_norm = norm
        if self.log_grad_norm:
            self._log_grad_norm(norm, norm_type)
        return norm

    def _log_grad_norm(self, norm: Tensor, norm_type: float) -> None:
        """Log ``norm`` on this step through Lightning's ``self.log``, if the class has one.

        Args:
            norm: the clip's total norm, the same bits on every rank.
            norm_type: the clip's p-norm exponent, for :attr:`grad_norm_name`.
        """
        log = getattr(self, "log", None)
        if not callable(log):
            return  # not a LightningModule: no logger to log to
        log(
            self.grad_norm_name.replace("{norm_type}", str(float(norm_type))),
            norm,
            prog_bar=self.grad_norm_prog_bar,
            on_step=True,
            on_epoch=False,
            # The same bits on every rank: nothing to reduce, no collective.
            sync_dist=False,
            rank_zero_only=True,
            # Read only for an epoch's mean, which is not taken; given, Lightning looks for none
            # (and a training_step taking dataloader_iter needs it).
            batch_size=1,
        )


def _param_groups(optimizer: object) -> list[dict[str, Any]]:
    """``optimizer.param_groups``.

    Raises:
        TypeError: ``optimizer`` has none: parameters or a module passed as to torch's clip.
    """
    param_groups = getattr(optimizer, "param_groups", None)
    if not isinstance(param_groups, list):
        raise TypeError(
            "MeshSafeGradientClipping.clip_grad_norm_ takes the optimizer whose parameters "
            f"it clips, as Lightning's self.clip_gradients does, got a "
            f"{type(optimizer).__name__}: pass self.optimizers() (in manual optimization) "
            "or the hook's optimizer; to clip other parameters, call "
            "credit.parallel.collectives.clip_grad_norm_(parameters, max_norm)"
        )
    return param_groups


def _checked_policy(module: object, policy: object, loss: object) -> SpikePolicy | None:
    """:attr:`MeshSafeGradientClipping.grad_spike_policy`, checked against what steps the
    optimizer: the same on every rank (the Trainer's settings), so every rank raises or none.

    Raises:
        TypeError: ``policy`` is neither None nor a ``SpikePolicy``.
        ValueError: a ``loss`` without a policy, or a policy that skips steps while a Trainer
            runs ``module`` and its precision plugin's scaler does not hold the policy.
    """
    if policy is None:
        if loss is not None:
            raise ValueError(
                "loss is tested by a SpikePolicy only: set grad_spike_policy, or drop loss"
            )
        return None
    if not isinstance(policy, SpikePolicy):
        raise TypeError(
            "grad_spike_policy must be a credit.parallel.spikes.SpikePolicy or None, got "
            f"{type(policy).__name__}"
        )
    plugin = _precision_plugin(module)
    # Outside a Trainer the policy's own check stands: one that skips needs a GradScaler.
    if plugin is None or not policy.skips or _holds(getattr(plugin, "scaler", None), policy):
        return policy
    raise ValueError(
        "grad_spike_policy skips steps, and the Trainer's precision plugin "
        f"({type(plugin).__name__}) steps the optimizer through no GradScaler holding it: the "
        "spikes it decides would be stepped anyway. Give the policy to credit.parallel.amp's "
        "GradScaler and that scaler to the plugin: for fp16, plugins=[MixedPrecision("
        '"16-mixed", device, scaler=GradScaler(device, spikes=policy))]; for bf16, '
        'plugin = MixedPrecision("bf16-mixed", device), then plugin.scaler = '
        "GradScaler(device, scaling=False, spikes=policy) (MixedPrecision refuses a bf16 "
        "scaler in its constructor only). Lightning's float32 plugin steps through no scaler: "
        "there, use an adaptive clip alone, SpikePolicy(skip=False, adaptive_clip='zscore'). "
        "No gradient was modified."
    )


def _precision_plugin(module: object) -> object | None:
    """The precision plugin of the Trainer running ``module``, or None outside a Trainer."""
    try:
        trainer = getattr(module, "trainer", None)
    except RuntimeError:  # LightningModule.trainer raises when no Trainer is attached
        return None
    return getattr(trainer, "precision_plugin", None)


def _holds(scaler: object, policy: SpikePolicy) -> bool:
    """Whether ``scaler`` is an enabled ``GradScaler`` of this package that holds ``policy``."""
    is_enabled = getattr(scaler, "is_enabled", None)
    return scaler is not None and policy.scaler is scaler and callable(is_enabled) and is_enabled()


def _check_name(name: object) -> None:
    """Refuse a :attr:`MeshSafeGradientClipping.grad_norm_name` that no metric can be named.

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: ``name`` is empty.
    """
    if not isinstance(name, str) or not name:
        error = ValueError if isinstance(name, str) else TypeError
        raise error(
            "grad_norm_name must be a non-empty str, the name self.log logs the gradient norm "
            f"under (default 'grad_{{norm_type}}_norm_total'), got {name!r}; to log nothing, "
            "set log_grad_norm = False"
        )


def _algorithm(gradient_clip_algorithm: object) -> str:
    """``"norm"`` or ``"value"``, as Lightning reads the Trainer's setting (None is ``"norm"``).

    Raises:
        ValueError: any other value, named.
    """
    if gradient_clip_algorithm is None:
        return "norm"
    # Lightning passes its GradClipAlgorithmType, a str enum; users pass strings.
    algorithm = str(getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm)).lower()
    if algorithm not in ("norm", "value"):
        raise ValueError(
            "gradient_clip_algorithm must be 'norm' or 'value' (None means 'norm', as in "
            f"Lightning), got {gradient_clip_algorithm!r}"
        )
    return algorithm


def _lightning_clip(module: object) -> Callable[..., None]:
    """``LightningModule.clip_gradients`` of ``module``, which clips by value.

    Raises:
        TypeError: ``module`` has none: the mixin is outside a ``LightningModule``.
    """
    clip = getattr(module, "clip_gradients", None)
    if not callable(clip):
        raise TypeError(
            f"clipping by value goes through LightningModule.clip_gradients, which "
            f"{type(module).__name__} lacks: mix MeshSafeGradientClipping into a LightningModule "
            "(class Model(MeshSafeGradientClipping, LightningModule)), or clip by value with "
            "torch.nn.utils.clip_grad_value_, which works on any mesh"
        )
    return cast(Callable[..., None], clip)
