"""How each kind of model averages its gradients over the domain group inside backward.

The machinery behind :func:`credit.parallel.grad_sync.sync_domain_gradients_in_backward`: one
:class:`Backend` per kind of model (FSDP2, DDP, a plain model), and the registry of parameters that
a live handle averages, which the explicit sync consults to refuse averaging twice. The registry is
kept here and reached only through :func:`register_averaged_in_backward`,
:func:`unregister_averaged_in_backward` and :func:`first_averaged_in_backward`.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel
from torch.utils.weak import WeakIdKeyDictionary

from credit.parallel._averaging.average import average_grads, average_tensor
from credit.parallel._common.compat import queue_at_end_of_backward

# Parameters whose gradients a live handle averages inside backward, mapped to the handle; weakly
# held, so a model dropped without remove() is not kept alive.
_averaged_in_backward: WeakIdKeyDictionary = WeakIdKeyDictionary()


class Backend(Protocol):
    """How one kind of model averages over the domain group inside backward."""

    kind: str

    def attach(self) -> None: ...

    def detach(self) -> None: ...

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None: ...


def backend_for(model: nn.Module, group: ProcessGroup | None) -> Backend:
    """The backend for ``model``: DDP, FSDP2 (any unit inside), or a plain model."""
    if isinstance(model, DistributedDataParallel):
        return DDPBackend(model, group)
    if any(isinstance(module, FSDPModule) for module in model.modules()):
        return FSDP2Backend(model, group)
    return PlainBackend(model, group)


def register_averaged_in_backward(params: list[Tensor], handle: object) -> None:
    """Record that ``handle`` averages the gradients of ``params`` inside backward."""
    for param in params:
        _averaged_in_backward[param] = handle


def unregister_averaged_in_backward(params: list[Tensor]) -> None:
    """Forget ``params``: no handle averages them inside backward any more."""
    for param in params:
        _averaged_in_backward.pop(param, None)


def first_averaged_in_backward(params: list[Tensor]) -> int | None:
    """The index of the first of ``params`` that a live handle averages inside backward."""
    if not _averaged_in_backward:
        return None
    return next((i for i, param in enumerate(params) if param in _averaged_in_backward), None)


class FSDP2Backend:
    """FSDP2: the average runs in every unit's all-reduce hook, on its reduce-scatter output."""

    kind = "fsdp2"

    def __init__(self, model: nn.Module, group: ProcessGroup | None) -> None:
        if not isinstance(model, FSDPModule):
            raise ValueError(
                "sync_domain_gradients_in_backward: the model holds FSDP2 units but is not one "
                "itself; fully_shard the root module too, so that every parameter's gradient "
                "goes through a unit's reduction"
            )
        self._model: FSDPModule = model
        self._group = group
        self._units = [module for module in model.modules() if isinstance(module, FSDPModule)]

    def attach(self) -> None:
        for unit in self._units:
            unit.set_all_reduce_hook(self._average)

    def detach(self) -> None:
        for unit in self._units:
            unit.set_all_reduce_hook(None)  # type: ignore[arg-type]  # torch's documented reset

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        self._model.set_requires_gradient_sync(requires_gradient_sync)

    def _average(self, reduce_output: Tensor) -> None:
        # Flat, padded, in the reduce dtype; padding averages to zero and is never read.
        average_tensor(reduce_output, self._group)


class _DDPState:
    """What DDP's comm hook reads at each bucket; the hook itself cannot be unregistered."""

    def __init__(self, dp_group: ProcessGroup) -> None:
        self.dp_group = dp_group
        self.domain_group: ProcessGroup | None = None

    def average_over_domain(self, reduced: torch.futures.Future[Any]) -> Tensor:
        bucket = reduced.value()[0]
        if self.domain_group is not None:
            average_tensor(bucket, self.domain_group)
        return bucket


def _ddp_comm_hook(state: _DDPState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """DDP's own averaging over its group (divide, then sum), then the domain average."""
    buffer = bucket.buffer()
    buffer.div_(state.dp_group.size())
    work = dist.all_reduce(buffer, group=state.dp_group, async_op=True)
    assert work is not None
    return work.get_future().then(state.average_over_domain)


# DDP checks the hook's annotations against the classes themselves; this module's are strings.
_ddp_comm_hook.__annotations__.update(
    bucket=dist.GradBucket, state=_DDPState, **{"return": torch.futures.Future[Tensor]}
)


# One comm hook per DDP model, for its lifetime: a later handle reuses it.
_ddp_states: weakref.WeakKeyDictionary[nn.Module, _DDPState] = weakref.WeakKeyDictionary()


class DDPBackend:
    """DDP: the average runs in a comm hook, chained after each bucket's all_reduce over dp."""

    kind = "ddp"

    def __init__(self, model: DistributedDataParallel, group: ProcessGroup | None) -> None:
        self._model, self._group = model, group

    def attach(self) -> None:
        state = _ddp_states.get(self._model)
        if state is None:
            state = _DDPState(self._model.process_group)
            self._model.register_comm_hook(state, _ddp_comm_hook)
            _ddp_states[self._model] = state
        state.domain_group = self._group

    def detach(self) -> None:
        _ddp_states[self._model].domain_group = None

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        self._model.require_backward_grad_sync = requires_gradient_sync


class PlainBackend:
    """A plain model: the bucketed average runs once per backward, at its end."""

    kind = "plain"

    def __init__(self, model: nn.Module, group: ProcessGroup | None) -> None:
        self._model, self._group = model, group
        self._params: list[Tensor] = [p for p in model.parameters() if p.requires_grad]
        self._hooks: list[Any] = []
        self._requires_sync = True
        self._queued = False

    def attach(self) -> None:
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._params]
        # A backward that raised drops its queued callback: the next forward starts afresh.
        self._hooks.append(self._model.register_forward_pre_hook(self._forget_queued))

    def detach(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        self._requires_sync = requires_gradient_sync

    def _forget_queued(self, _module: nn.Module, _args: object) -> None:
        self._queued = False

    def _on_grad(self, _param: Tensor) -> None:
        if self._requires_sync and not self._queued:
            self._queued = True
            queue_at_end_of_backward(self._average)

    def _average(self) -> None:
        self._queued = False
        average_grads([param.grad for param in self._params], self._group)
