"""Lightning: ``Trainer(gradient_clip_val=...)`` on any mix of meshes.

Lightning clips through its precision plugin, which calls ``torch.nn.utils.clip_grad_norm_``: with
``ModelParallelStrategy`` (tensor-parallel weights on the ``(data_parallel, tensor_parallel)``
mesh, everything else FSDP2 on ``data_parallel``) that raises "All operands in aten.stack.default
must have the same mesh". Mixed into a ``LightningModule``, :class:`MeshSafeGradientClipping`
clips by norm with :func:`credit.parallel.collectives.clip_grad_norm_` instead, and logs the norm
through Lightning's ``self.log``. This module does not import Lightning.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor, nn

from credit.parallel._common.inputs import DistinctAlong
from credit.parallel.collectives import clip_grad_norm_

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

        Args:
            optimizer: the optimizer about to step.
            gradient_clip_val: the Trainer's ``gradient_clip_val``; None or 0 clips nothing.
            gradient_clip_algorithm: the Trainer's ``gradient_clip_algorithm``: ``"norm"``
                (also when None, as in Lightning) or ``"value"``, in any case.

        Raises:
            ValueError: ``gradient_clip_algorithm`` is neither ``"norm"`` nor ``"value"``.
            TypeError: clipping by value in a class without Lightning's ``clip_gradients`` (the
                mixin is not in a ``LightningModule``), or as :meth:`clip_grad_norm_`.
        """
        algorithm = _algorithm(gradient_clip_algorithm)
        if algorithm == "value":
            # Lightning's own clip by value: element-wise, right on every mesh.
            _lightning_clip(self)(optimizer, gradient_clip_val, gradient_clip_algorithm)
        elif gradient_clip_val:
            self.clip_grad_norm_(optimizer, gradient_clip_val)

    def clip_grad_norm_(
        self, optimizer: torch.optim.Optimizer, max_norm: float | Tensor, norm_type: float = 2.0
    ) -> Tensor:
        """Clip the gradients of ``optimizer``'s parameters to ``max_norm`` on any mix of meshes.

        :func:`credit.parallel.collectives.clip_grad_norm_` on the parameters of every parameter
        group of ``optimizer``, named after the module's parameters in its messages, with
        :attr:`grad_clip_distinct_along`; the norm is then logged on the step, unless
        :attr:`log_grad_norm` is False (see the class). Every rank must call it, from a hook that
        logs on the step when the norm is logged (the training step, ``on_before_optimizer_step``,
        ``configure_gradient_clipping``: not ``on_train_epoch_end``).

        Args:
            optimizer: the optimizer whose parameters' gradients are clipped in place (Lightning's
                wrapped optimizer too).
            max_norm: max norm of the gradients, in every form the clip takes.
            norm_type: p-norm exponent, a positive float or ``inf``. Default: 2.

        Returns:
            The total norm before clipping (also kept as :attr:`last_grad_norm`).

        Raises:
            TypeError: ``optimizer`` is not an optimizer (parameters, a module), or
                :attr:`grad_norm_name` is not a string while logging is on (both before anything
                is clipped), or as :func:`credit.parallel.collectives.clip_grad_norm_`.
            ValueError: :attr:`grad_norm_name` is empty while logging is on (before anything is
                clipped), or as :func:`credit.parallel.collectives.clip_grad_norm_`.
            RuntimeError: as :func:`credit.parallel.collectives.clip_grad_norm_`.
            MisconfigurationException: Lightning's, from ``self.log``, where the hook does not
                log on the step.
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
        if self.log_grad_norm:
            _check_name(self.grad_norm_name)
        names = {id(p): name for name, p in cast(nn.Module, self).named_parameters()}
        named = [
            (names.get(id(p), f"param_groups[{group}][{index}]"), p)
            for group, settings in enumerate(param_groups)
            for index, p in enumerate(settings["params"])
        ]
        norm = clip_grad_norm_(
            named, max_norm, norm_type, distinct_along=self.grad_clip_distinct_along
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
