"""The clip's last step: every gradient scaled on its local tensor by torch's coefficient.

Shared by ``clip_grad_norm_`` and ``clip_grads_with_norm_``: ``min(max_norm / (total + 1e-6), 1)``
with torch's bits, multiplied in torch's (device, dtype) groups; the listeners
(``hooks``) learn of the coefficient.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from credit.parallel._common.compat import use_foreach
from credit.parallel._norm import hooks as _hooks
from credit.parallel._norm.stacking import Stacking


def scale_(
    local: list[Tensor],
    stacking: Stacking,
    total: Tensor,
    max_norm: float | Tensor,
    foreach: bool | None,
) -> None:
    """torch's ``clip_grads_with_norm_`` on the local tensors ``local``, grouped by (device,
    dtype) as ``stacking`` groups them; the listeners learn of the coefficient."""
    if not local:
        return
    clip_coef_clamped = clip_coefficient(max_norm, total)
    for device, indices in stacking.groups:
        device_grads = local if stacking.whole else [local[i] for i in indices]
        coef = clip_coef_clamped.to(device)
        if use_foreach(foreach, device_grads, device):
            torch._foreach_mul_(device_grads, coef)
        else:
            for grad in device_grads:
                grad.mul_(coef)
    for listener in _hooks.attached():
        listener.scaled(local, clip_coef_clamped)


def clip_coefficient(max_norm: float | Tensor, total: Tensor) -> Tensor:
    """torch's ``min(max_norm / (total + 1e-6), 1)``, with torch's bits: a 0-dim tensor of
    ``total``'s dtype on ``total``'s device.

    torch takes ``float(max_norm)``, and ``float / tensor`` is ``tensor.reciprocal() * float``,
    the float rounded to the operation's math dtype (float64 for float64, else float32) and the
    product rounded to the tensor's dtype. A tensor ``max_norm`` (0-dim, see
    ``inputs.clip_bound``) enters the same product as its second operand, converted to the
    math dtype by the kernel, so it is never read on the host, and a CPU one is never copied to
    the device: a 0-dim CPU tensor is a scalar operand of a CUDA kernel, read at launch as
    torch's float is. The reciprocal is made 1-element so that, in type promotion, the 0-dim
    operand takes its dtype whatever its own (float64 or an integer included). A NaN or negative
    tensor gives a NaN coefficient (every gradient NaN, never flipped): the product is
    multiplied by 1 or NaN, which changes no other bit.
    """
    denominator = total + 1e-6
    if not isinstance(max_norm, Tensor):
        return torch.clamp(float(max_norm) / denominator, max=1.0)
    bound = max_norm
    if bound.device != denominator.device and bound.device.type != "cpu":
        bound = bound.to(denominator.device)  # a CUDA one for CPU gradients: float() reads it too
    math_dtype = torch.float64 if denominator.dtype == torch.float64 else torch.float32
    reciprocal = denominator.reciprocal().to(math_dtype).reshape(1)
    coefficient = reciprocal * bound * torch.where(bound >= 0, 1.0, math.nan)
    return torch.clamp(coefficient.to(denominator.dtype), max=1.0).reshape(())
