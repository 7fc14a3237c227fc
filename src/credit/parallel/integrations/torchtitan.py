"""torchtitan: its ``clip_grad_norm_``, under its signature, with this package's norm.

torchtitan's trainer clips with ``torchtitan.distributed.utils.clip_grad_norm_(parameters,
max_norm, foreach=True, pp_mesh=..., ep_enabled=...)``: torch's ``get_total_norm`` and a
``full_tensor()`` per mesh (one all_reduce per sharded mesh dim), one more all_reduce over the
pipeline mesh, and with expert parallelism one norm per group of meshes. :func:`clip_grad_norm_`
takes the same arguments and gives the same norm in one all_reduce, pipeline stages included,
on any mix of meshes, and with ``spikes=`` clips through a
:class:`~credit.parallel.spikes.SpikePolicy`. This module does not import torchtitan.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from credit.parallel.collectives import clip_grad_norm_ as _clip_grad_norm_
from credit.parallel.spikes import SpikePolicy

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    parameters: Tensor | Iterable[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    pp_mesh: DeviceMesh | None = None,
    ep_enabled: bool = False,
    *,
    spikes: SpikePolicy | None = None,
) -> Tensor:
    """Drop-in for ``torchtitan.distributed.utils.clip_grad_norm_``.

    :func:`credit.parallel.collectives.clip_grad_norm_` with ``pp_group=pp_mesh``: one all_reduce
    per call however many meshes and stages the gradients span. Experts need no flag: under
    torchtitan's expert parallelism they are DTensors sharded along the ``ep`` dim of their
    mesh, which the norm reads, so ``ep_enabled`` is accepted for the signature and changes
    nothing. Every rank must call it.

    With ``spikes``, the clip is the policy's
    (:meth:`~credit.parallel.spikes.SpikePolicy.clip_grad_norm_`, with ``pp_group=pp_mesh``):
    ``max_norm`` becomes its fixed ceiling. torchtitan's trainer steps its optimizers with no
    scaler: an adaptive clip alone (``SpikePolicy(skip=False, adaptive_clip="zscore")``) works
    as it is, and a policy that skips steps needs the optimizers' step to go through this
    package's ``GradScaler(scaling=False, spikes=policy)`` (``scaler.step(optimizer)``, then
    ``scaler.update()``); without one holding it, the policy raises at the clip.

    Args:
        parameters: tensor or iterable of tensors whose ``.grad`` is clipped in place.
        max_norm: max norm of the gradients.
        norm_type: p-norm exponent, a positive float or ``inf``. Default: 2.
        error_if_nonfinite: raise RuntimeError on every rank when the total norm is nan or inf.
        foreach: use the foreach kernels; None uses them where the device supports them.
        pp_mesh: the pipeline-parallel mesh (1D, one rank per stage), or None without pipeline
            parallelism.
        ep_enabled: torchtitan's flag for expert parallelism; not needed here.
        spikes: the :class:`~credit.parallel.spikes.SpikePolicy` that clips, once per optimizer
            step (``functools.partial(clip_grad_norm_, spikes=policy)`` where torchtitan calls
            the clip), or None. Default: None.

    Returns:
        The total norm before clipping, a plain scalar tensor, the same on every rank.

    Raises:
        TypeError, ValueError, RuntimeError: as
            :func:`credit.parallel.collectives.clip_grad_norm_`, or with ``spikes``, as
            :meth:`credit.parallel.spikes.SpikePolicy.clip_grad_norm_` (a RuntimeError for a
            policy that skips steps and that no ``GradScaler`` holds); ``spikes`` is not a
            ``SpikePolicy`` (TypeError).
    """
    if spikes is None:
        return _clip_grad_norm_(
            parameters, max_norm, norm_type, error_if_nonfinite, foreach, pp_group=pp_mesh
        )
    if not isinstance(spikes, SpikePolicy):
        raise TypeError(
            f"spikes must be a credit.parallel.spikes.SpikePolicy or None, got "
            f"{type(spikes).__name__}"
        )
    return spikes.clip_grad_norm_(
        parameters, max_norm, norm_type, error_if_nonfinite, foreach, pp_group=pp_mesh
    )
