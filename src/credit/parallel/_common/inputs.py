"""Argument checks shared by the public functions.

Every check runs before any collective and before any gradient is touched, and depends only on
arguments that are the same on every rank of a well-formed call, so a bad call raises everywhere.
"""

from __future__ import annotations

import math
import numbers
import sys
import types
import warnings
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from credit.parallel._common.compat import local_tensor
from credit.parallel._common.groups import (
    GroupLike,
    group_ranks,
    is_distributed,
    resolve_group,
)

TensorOrTensors = Tensor | Iterable[Tensor]
# What a clip takes: tensors, a module, or (name, parameter) pairs.
Parameters = TensorOrTensors | nn.Module | Iterable[tuple[str, Tensor]]
DistinctAlong = Iterable[tuple[TensorOrTensors, GroupLike]]
# The package's own files, and the module of torch's ``no_grad`` decorator wrapping its functions:
# the frames a warning skips to land on its caller's line.
_PACKAGE = Path(__file__).resolve().parents[1]
_DECORATOR = "torch.utils._contextlib"
_NONE = type(None)


def tensor_list(tensors: TensorOrTensors | Iterable[Tensor | None], argument: str) -> list[Tensor]:
    """``tensors`` as a list, None entries dropped; TypeError naming the first non-tensor."""
    if isinstance(tensors, Tensor):
        return [tensors]
    if isinstance(tensors, (str, bytes)) or not isinstance(tensors, Iterable):
        raise TypeError(
            f"{argument} must be a tensor or an iterable of tensors, got {type(tensors).__name__}"
        )
    items = list(tensors)
    # The items' types first (one pass in C); the items are walked only to drop None entries or
    # to name the first non-tensor.
    kinds = set(map(type, items))
    if all(kind is _NONE or issubclass(kind, Tensor) for kind in kinds):
        return [item for item in items if item is not None] if _NONE in kinds else items
    for index, item in enumerate(items):
        if item is not None and not isinstance(item, Tensor):
            raise TypeError(
                f"{argument}[{index}] is a {type(item).__name__}, expected a torch.Tensor"
            )
    return [item for item in items if item is not None]  # an item whose __class__ is a tensor's


def module_parameters(model_or_params: nn.Module | TensorOrTensors) -> list[Tensor]:
    """The parameters of a module, or the given tensors, each once and in order."""
    if isinstance(model_or_params, nn.Module):
        return list(model_or_params.parameters())
    params = tensor_list(model_or_params, "model_or_params")
    # A tensor listed twice would be averaged twice; dict keys keep the first of each, in order.
    return list(dict.fromkeys(params))


def parameter_list(
    parameters: Parameters,
    *,
    warn_if_empty_generator: bool = True,
) -> tuple[list[Tensor], list[str] | None]:
    """``parameters`` as a list, and their names where it has them (a module, or ``(name,
    tensor)`` pairs such as ``model.named_parameters()``), with torch's warning for an empty
    generator where torch's function gives it (its ``clip_grad_norm_``, not its
    ``clip_grads_with_norm_``)."""
    if isinstance(parameters, nn.Module):
        named = list(parameters.named_parameters())
        return [param for _, param in named], [name for name, _ in named]
    is_generator = isinstance(parameters, types.GeneratorType)
    if isinstance(parameters, Iterable) and not isinstance(parameters, (Tensor, str, bytes)):
        parameters = list(parameters)
        if parameters and all(_is_named(item) for item in parameters):
            return [param for _, param in parameters], [name for name, _ in parameters]
    params = tensor_list(parameters, "parameters")
    if warn_if_empty_generator and is_generator and not params:
        warnings.warn(
            "`parameters` is an empty generator, no gradient clipping will occur.",
            stacklevel=_caller_stacklevel(),
        )
    return params, None


def warn_no_grads(params: list[Tensor], what: str) -> None:
    """Warn that no tensor of ``params`` (not empty) has a ``.grad``, as the clip ``what`` found:
    the norm is then 0 and nothing is clipped, which is right (torch does the same) but usually a
    slip. Tensors that are neither parameters nor trainable look like gradients passed as
    parameters (``[p.grad for p in model.parameters()]``); trainable ones without a gradient,
    like a clip before ``backward``. Frozen parameters (``requires_grad=False``) have no gradient
    by design: no warning. The warning is Python's, shown once per call site."""
    if not any(isinstance(p, nn.Parameter) or p.requires_grad for p in params):
        message = (
            f"{what} got {len(params)} tensors, none of them a parameter and none with a .grad: "
            "they look like gradients ([p.grad for p in model.parameters()]). Pass the "
            "parameters (model.parameters()), whose .grad is clipped; as called, the norm is 0 "
            "and nothing is clipped"
        )
    elif any(param.requires_grad for param in params):
        message = (
            f"{what} got {len(params)} parameters and none has a .grad on this rank: the norm is "
            "0 and nothing is clipped. Call it after backward (and before zero_grad)"
        )
    else:
        return
    warnings.warn(message, UserWarning, stacklevel=_caller_stacklevel())


def _caller_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning issued by the function calling this one point at
    the first frame outside the package (and outside torch's ``no_grad`` wrapper): the user's
    call, however deep the public function that warns, so that "once per call site" is per line
    of the user's code."""
    frame = sys._getframe(1)  # the function that warns: stacklevel 1
    level = 1
    while frame.f_back is not None and _inside(frame):
        frame, level = frame.f_back, level + 1
    return level


def _inside(frame: types.FrameType) -> bool:
    if frame.f_globals.get("__name__") == _DECORATOR:
        return True
    return Path(frame.f_code.co_filename).resolve().is_relative_to(_PACKAGE)


def _is_named(item: object) -> bool:
    return (
        isinstance(item, tuple)
        and len(item) == 2
        and isinstance(item[0], str)
        and isinstance(item[1], Tensor)
    )


def check_grads(grads: list[Tensor], argument: str) -> None:
    """Reject gradients no reduction here can handle, naming the first offender.

    Raises:
        ValueError: a gradient is sparse (or another non-strided layout) or on the meta device.
        TypeError: a gradient is not floating point (integer and bool included).
    """
    refusal = grads_refusal(grads, argument)
    if refusal is not None:
        kind, message = refusal
        raise kind(message)


def grads_refusal(grads: list[Tensor], argument: str) -> tuple[type[Exception], str] | None:
    """The error :func:`check_grads` raises for ``grads``, or None when it raises none.

    Reads a few attributes of each tensor, a DTensor's from its local shard (the same values,
    read several times faster): this runs on every call, over thousands of grads. What it refuses
    may differ across ranks (one rank's gradient left on the meta device): the check mode hands
    it to the other ranks (``layout_check.refuse_on_every_rank``).
    """
    return local_refusal([local_tensor(grad) for grad in grads], argument)


def local_refusal(local: list[Tensor], argument: str) -> tuple[type[Exception], str] | None:
    """:func:`grads_refusal` of local tensors (plain tensors, or DTensors' shards).

    The sets of layouts, dtypes and meta flags are read first, a set comprehension each (this
    runs on every norm, over thousands of gradients); only a list that holds an offender is
    walked again, to name the first.
    """
    layouts = {tensor.layout for tensor in local}
    dtypes = {tensor.dtype for tensor in local}
    meta = {tensor.is_meta for tensor in local}
    if (
        layouts <= {torch.strided}
        and all(dtype.is_floating_point or dtype.is_complex for dtype in dtypes)
        and True not in meta
    ):
        return None
    for index, grad in enumerate(local):
        if grad.layout != torch.strided:
            return ValueError, (
                f"{argument}[{index}] has layout {grad.layout}; only dense (strided) gradients "
                "are supported: densify it with .to_dense() first"
            )
        if not (grad.dtype.is_floating_point or grad.dtype.is_complex):
            return TypeError, (
                f"{argument}[{index}] has dtype {grad.dtype}; only floating-point tensors can be "
                "averaged or normed (integer and bool values would be truncated)"
            )
        if grad.is_meta:
            # A collective on a meta tensor is a silent no-op and its norm cannot be read back:
            # the "averaged" gradient would hold no data at all.
            return ValueError, (
                f"{argument}[{index}] is on the meta device and holds no data; materialise the "
                "module (e.g. module.to_empty(device=...)) before reducing its gradients"
            )
    return None


def clip_bound(max_norm: object) -> float | Tensor:
    """``max_norm`` checked, in the form the clip's coefficient takes it: a float, or a 0-dim view
    of a tensor's one element (see :func:`scalar_view`).

    torch takes ``float(max_norm)``: any real number, or a tensor of one element whatever its
    shape and dtype. A tensor's value is not read here (that would be a host sync on a GPU): the
    clip turns a NaN or negative one into NaN gradients.

    Raises:
        TypeError: ``max_norm`` is not a real number (a bool, a string, a complex tensor), or a
            DTensor whose value is not replicated.
        ValueError: a number ``max_norm`` is NaN or negative (torch would silently NaN or flip the
            gradients), or a tensor has more than one element (torch raises ValueError too).
        RuntimeError: a tensor is on the meta device (torch raises RuntimeError too).
    """
    if isinstance(max_norm, Tensor):
        return scalar_view(max_norm, "max_norm")
    if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real):
        raise TypeError(f"max_norm must be a float or a scalar tensor, got {max_norm!r}")
    value = float(max_norm)
    if math.isnan(value) or value < 0:
        raise ValueError(f"max_norm must be a non-negative number, got {value}")
    return value


def scalar_view(tensor: Tensor, argument: str) -> Tensor:
    """A 0-dim view of ``tensor``'s one real element, with no copy and no host read.

    A DTensor whose placements are all Replicate holds its value on every rank of its mesh: its
    local tensor is taken (the value torch's own clip multiplies by). One with a pending reduction
    (Partial) holds only a term of it, which only a collective could complete.

    Raises:
        TypeError: ``tensor`` is complex or bool, or a DTensor that is not replicated.
        ValueError: ``tensor`` has more than one element.
        RuntimeError: ``tensor`` is on the meta device.
    """
    if tensor.numel() != 1:
        raise ValueError(
            f"{argument} must be a scalar, got a tensor of shape {tuple(tensor.shape)}"
        )
    if tensor.is_complex() or tensor.dtype == torch.bool:
        raise TypeError(f"{argument} must be a real number, got a tensor of {tensor.dtype}")
    if isinstance(tensor, DTensor):
        if not all(placement.is_replicate() for placement in tensor.placements):
            raise TypeError(
                f"{argument} is a DTensor with placements {tensor.placements}: its value is "
                "spread over the ranks of its mesh, and reading it would take a collective. "
                f"Pass a plain tensor, e.g. {argument}.full_tensor(), or the norm of "
                "credit.parallel.collectives.get_total_norm, which is one on any mix of meshes"
            )
        tensor = local_tensor(tensor)
    if tensor.is_meta:
        raise RuntimeError(f"{argument} is on the meta device and holds no value")
    return tensor.detach().reshape(())


def distinct_groups(
    distinct_along: DistinctAlong | None, grads: list[Tensor]
) -> list[frozenset[int] | None] | None:
    """For each of ``grads``, the ranks of the group along which its copies differ (None: replicas).

    A pair names parameters (themselves, or their current ``.grad``) or gradients, so ``grads``
    may hold either. None when ``distinct_along`` is None or torch.distributed is not
    initialised.

    Raises:
        TypeError: ``distinct_along`` is not an iterable of ``(tensors, group)`` pairs.
    """
    if distinct_along is None or not is_distributed():
        return None
    if isinstance(distinct_along, (Tensor, str, bytes)) or not isinstance(distinct_along, Iterable):
        raise TypeError(
            "distinct_along must be an iterable of (tensors, group) pairs, "
            f"got {type(distinct_along).__name__}"
        )
    by_grad: dict[int, frozenset[int]] = {}
    for index, pair in enumerate(distinct_along):
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise TypeError(
                f"distinct_along[{index}] must be a (tensors, group) pair, got {pair!r:.80}"
            )
        tensors, group = pair
        ranks = frozenset(group_ranks(resolve_group(group, f"distinct_along[{index}]")))
        for tensor in tensor_list(tensors, f"distinct_along[{index}]"):
            by_grad[id(tensor)] = ranks
            if tensor.grad is not None:
                by_grad[id(tensor.grad)] = ranks
    distinct = [by_grad.get(id(grad)) for grad in grads]
    return [ranks if ranks is not None and len(ranks) > 1 else None for ranks in distinct]


def parameter_label(params: list[Tensor], names: list[str] | None, index: int) -> str:
    """Names the parameter of gradient ``index`` (counting the parameters with a gradient)."""
    position = [i for i, param in enumerate(params) if param.grad is not None][index]
    return names[position] if names is not None else f"parameters[{position}]"
