"""sync_domain_gradients_in_backward on real gloo ranks, against the explicit sync_domain_gradients.

Each body builds the same model twice with the same wrapping (real ``fully_shard``,
``parallelize_module`` or DDP): one trains with the explicit sync after backward, the other with
the domain average registered inside backward. Every domain rank backpropagates through data of
its own (its "band"), over two micro-steps: the first without gradient sync, the second on the
accumulation boundary.

Oracle: the explicit path's gradients, bit for bit. Both modes apply the same element-wise
operations to the same values: the data-parallel reduction (FSDP2's reduce-scatter, DDP's
divide-then-sum) leaves the same local values, then one sum over the two domain ranks (correctly
rounded whatever the order) and one division by 2 (exact). Domain traffic is counted by group
across every thread (DDP's comm hook runs its callbacks on the backend's thread), all
collectives by CommDebugMode; the clip's by the size of their process group.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn.parallel import DistributedDataParallel

from credit.parallel import _averaging
from credit.parallel.collectives import clip_grad_norm_, total_grad_norm
from credit.parallel.grad_sync import (
    DomainSyncHandle,
    sync_domain_gradients,
    sync_domain_gradients_in_backward,
    sync_replicated_gradients,
)
from testbed.layouts import TP_PLAN, TinyNet, mesh, run_step
from testbed.world_layouts import WireRecorder

ACCUM = 2


# ---------------------------------------------------------------------------------------------
# helpers (run on every rank)


@contextlib.contextmanager
def _domain_traffic(group: ProcessGroup) -> Iterator[list[int]]:
    """Counts, in a one-item list, the all_reduces over ``group`` issued in the block by any
    thread (the library and DDP's comm hook call ``dist.all_reduce``)."""
    ranks = dist.get_process_group_ranks(group)
    seen = [0]
    original = dist.all_reduce

    def counting(tensor: Tensor, *args: object, **kwargs: object) -> object:
        chosen = kwargs.get("group", args[1] if len(args) > 1 else None)
        if chosen is not None and dist.get_process_group_ranks(chosen) == ranks:  # type: ignore[arg-type]
            seen[0] += 1
        return original(tensor, *args, **kwargs)  # type: ignore[arg-type]

    dist.all_reduce = counting  # type: ignore[assignment]
    try:
        yield seen
    finally:
        dist.all_reduce = original


def _collectives(call: Callable[[], object]) -> int:
    with CommDebugMode() as mode:
        call()
    return mode.get_total_counts()


def _local_grads(model: nn.Module) -> list[Tensor]:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return [(g._local_tensor if isinstance(g, DTensor) else g).detach().clone() for g in grads]


def _same_bits(a: list[Tensor], b: list[Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and torch.equal(x.view(torch.int32), y.view(torch.int32))
        for x, y in zip(a, b, strict=True)
    )


def _backward(model: nn.Module, seed: int, domain_rank: int, dp: tuple[int, int]) -> None:
    """One micro-step on this domain rank's band: data differ across domain and dp ranks."""
    run_step(model, 1000 * seed + 17 * domain_rank, dp[0], dp[1])


def _train_step(
    model: nn.Module,
    set_sync: Callable[[bool], None],
    seed: int,
    domain_rank: int,
    dp: tuple[int, int],
    domain: ProcessGroup,
) -> list[int]:
    """Two micro-steps; the domain all_reduces issued in each backward."""
    counts = []
    for micro in range(ACCUM):
        set_sync(micro == ACCUM - 1)
        with _domain_traffic(domain) as seen:
            _backward(model, seed + micro, domain_rank, dp)
        counts.append(seen[0])
    return counts


@dataclass
class _Modes:
    """A model synced explicitly and its copy synced in backward by ``handle``.

    ``where`` is (domain group, domain rank, (dp rank, dp size), tp group or None).
    """

    explicit: nn.Module
    ours: nn.Module
    handle: DomainSyncHandle
    set_explicit_sync: Callable[[bool], None]
    where: tuple[ProcessGroup, int, tuple[int, int], ProcessGroup | None]


def _compare(modes: _Modes) -> dict[str, object]:
    """Everything the tests assert, as plain values: a step in each mode, then after remove()."""
    return {"kind": modes.handle.kind} | _check_against_explicit(modes) | _after_remove(modes)


def _check_against_explicit(modes: _Modes) -> dict[str, object]:
    """One step in each mode: bits, traffic, the clip and the refusals of double use."""
    explicit, ours, handle, set_explicit_sync = (
        modes.explicit,
        modes.ours,
        modes.handle,
        modes.set_explicit_sync,
    )
    domain, domain_rank, dp, tp = modes.where
    _train_step(explicit, set_explicit_sync, 1, domain_rank, dp, domain)
    explicit_after = _collectives(lambda: sync_domain_gradients(explicit, domain))
    sync_replicated_gradients(explicit, tp)
    traffic = _train_step(ours, handle.set_requires_gradient_sync, 1, domain_rank, dp, domain)
    sync_replicated_gradients(ours, tp)
    same = _same_bits(_local_grads(explicit), _local_grads(ours))
    total_grad_norm([p.grad for p in explicit.parameters() if p.grad is not None])  # layout seen
    explicit_norm = clip_grad_norm_(explicit.parameters(), 0.1)
    with WireRecorder() as wire:
        our_norm = clip_grad_norm_(ours.parameters(), 0.1)
    return {
        "same_bits": same,
        "traffic": traffic,
        "explicit_after": explicit_after,
        "clip_collectives": wire.groups,
        "same_norm": bool(torch.equal(explicit_norm, our_norm)),
        "clipped_same_bits": _same_bits(_local_grads(explicit), _local_grads(ours)),
        "twice": _error(lambda: sync_domain_gradients(ours, domain)),
        "twice_params": _error(lambda: sync_domain_gradients(list(ours.parameters()), domain)),
        "register_twice": _error(lambda: sync_domain_gradients_in_backward(ours, domain)),
    }


def _error(call: Callable[[], object]) -> str:
    try:
        call()
    except RuntimeError as error:
        return str(error)
    return ""


def _after_remove(modes: _Modes) -> dict[str, object]:
    """remove(), then a step on both models with the explicit sync: the same bits again."""
    explicit, ours, handle = modes.explicit, modes.ours, modes.handle
    domain, domain_rank, dp, tp = modes.where
    handle.remove()
    handle.remove()  # twice does nothing
    for model, set_sync in (
        (explicit, modes.set_explicit_sync),
        (ours, handle.set_requires_gradient_sync),
    ):
        model.zero_grad(set_to_none=True)
        traffic = _train_step(model, set_sync, 2, domain_rank, dp, domain)
        sync_domain_gradients(model, domain)
        sync_replicated_gradients(model, tp)
    return {
        "traffic_after_remove": traffic,
        "same_bits_after_remove": _same_bits(_local_grads(explicit), _local_grads(ours)),
    }


def _fsdp(model: nn.Module, dp_mesh: object, tp_mesh: object = None) -> nn.Module:
    for block in model.blocks:  # type: ignore[union-attr]
        if tp_mesh is not None:
            parallelize_module(block, tp_mesh, TP_PLAN)  # type: ignore[arg-type]
        fully_shard(block, mesh=dp_mesh)  # type: ignore[arg-type]
    fully_shard(model, mesh=dp_mesh)  # type: ignore[arg-type]
    return model


def _pair(build: Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module]:
    """Two copies of the same model, built the same way from the same seed."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(build())
    return models[0], models[1]


# ---------------------------------------------------------------------------------------------
# bodies


def _fsdp_body(with_tp: bool) -> dict[str, object]:
    if with_tp:
        world = mesh((2, 2, 2), ("dp", "tp", "domain"))
        tp_mesh, tp = world["tp"], world.get_group("tp")
    else:
        world = mesh((2, 2), ("dp", "domain"))
        tp_mesh, tp = None, None
    coordinate = world.get_coordinate()
    assert coordinate is not None
    domain = world.get_group("domain")
    where = (domain, coordinate[-1], (coordinate[0], 2), tp)
    explicit, ours = _pair(lambda: _fsdp(TinyNet(), world["dp"], tp_mesh))
    handle = sync_domain_gradients_in_backward(ours, world["domain"])
    assert isinstance(explicit, FSDPModule)
    result = _compare(_Modes(explicit, ours, handle, explicit.set_requires_gradient_sync, where))
    result["units"] = sum(isinstance(m, FSDPModule) for m in ours.modules())
    return result


def _ddp_body() -> dict[str, object]:
    world = mesh((2, 2), ("dp", "domain"))
    coordinate = world.get_coordinate()
    assert coordinate is not None
    domain, dp_group = world.get_group("domain"), world.get_group("dp")
    where = (domain, coordinate[1], (coordinate[0], 2), None)
    explicit, ours = _pair(lambda: DistributedDataParallel(TinyNet(), process_group=dp_group))
    handle = sync_domain_gradients_in_backward(ours, domain)

    def explicit_sync(flag: bool) -> None:
        explicit.require_backward_grad_sync = flag  # what no_sync() sets

    return _compare(_Modes(explicit, ours, handle, explicit_sync, where))


def _plain_body() -> dict[str, object]:
    world = mesh((2,), ("domain",))
    domain = world.get_group()
    where = (domain, dist.get_rank(), (0, 1), None)
    explicit, ours = _pair(TinyNet)
    handle = sync_domain_gradients_in_backward(ours, world)
    return _compare(_Modes(explicit, ours, handle, lambda flag: None, where))


def _failed_backward_body() -> tuple[bool, int]:
    """A backward that raised after the head's gradients were in: the next one still averages."""
    world = mesh((2,), ("domain",))
    explicit, ours = _pair(TinyNet)
    handle = sync_domain_gradients_in_backward(ours, world)

    def fail(_grad: Tensor) -> Tensor:
        raise ValueError("backward fails here")

    def arm(_module: nn.Module, _inputs: object, out: Tensor) -> None:
        out.register_hook(fail)

    tripwire = ours.blocks[0].register_forward_hook(arm)
    with contextlib.suppress(ValueError):
        _backward(ours, 0, dist.get_rank(), (0, 1))
    tripwire.remove()
    _backward(explicit, 1, dist.get_rank(), (0, 1))
    sync_domain_gradients(explicit, world)
    ours.zero_grad(set_to_none=True)
    with _domain_traffic(world.get_group()) as seen:
        _backward(ours, 1, dist.get_rank(), (0, 1))
    handle.remove()
    return _same_bits(_local_grads(explicit), _local_grads(ours)), seen[0]


def _no_group_body() -> tuple[str, bool, int]:
    """With no domain group nothing is registered; the explicit call stays allowed."""
    model = TinyNet()
    handle = sync_domain_gradients_in_backward(model, None)
    handle.set_requires_gradient_sync(False)
    run_step(model, 0, 0, 1)
    sync_domain_gradients(model, mesh((2,), ("domain",)))
    return handle.kind, handle.active, len(dist.get_process_group_ranks(dist.group.WORLD))


def _not_root_body() -> str:
    model = TinyNet()
    fully_shard(model.blocks[0], mesh=mesh((2,), ("dp",)))
    try:
        sync_domain_gradients_in_backward(model, mesh((2,), ("domain",)))
    except ValueError as error:
        return str(error)
    return ""


# ---------------------------------------------------------------------------------------------
# tests


def _check(
    results: list[dict[str, object]], kind: str, in_backward: list[int], clip: list[int]
) -> None:
    """``clip``: the size of the process group of each collective of the clip, in order."""
    for rank, result in enumerate(results):
        assert result["kind"] == kind
        assert result["same_bits"], f"rank {rank}: grads differ from the explicit path"
        # No domain traffic on the micro-step; on the boundary, inside backward.
        assert result["traffic"] == in_backward, rank
        # What the explicit path still runs after backward (one bucket; a first call for a
        # layout may check it first); the in-backward path runs nothing there.
        assert result["explicit_after"] >= 1
        assert result["clip_collectives"] == clip, rank
        assert result["same_norm"] and result["clipped_same_bits"], rank
        assert "averaged over the domain group inside backward already" in str(result["twice"])
        assert "averaged over the domain group inside backward already" in str(
            result["twice_params"]
        )
        assert "averaged inside backward already by another handle" in str(result["register_twice"])
        assert result["traffic_after_remove"] == [0, 0]
        assert result["same_bits_after_remove"], rank


def test_fsdp2_averages_inside_backward_with_the_explicit_bits(ranks) -> None:
    results = ranks.run(4, _fsdp_body, False)
    units = results[0]["units"]
    assert units == 3  # two blocks and the root: one domain all_reduce each, in backward
    # The clip: the dp mesh's shards' copies on their domain peers compared within domain, then
    # the world's one all_reduce.
    _check(results, "fsdp2", [0, units], [2, 4])


def test_fsdp2_with_tp_averages_inside_backward_with_the_explicit_bits(ranks) -> None:
    results = ranks.run(8, _fsdp_body, True)
    # The clip: the copies compared within tp and within domain (the rowwise biases replicated
    # on tp; the (dp, tp) shards on their domain peers; the dp mesh's shards on their tp and
    # domain peers), then the world's one all_reduce.
    _check(results, "fsdp2", [0, results[0]["units"]], [2, 2, 8])


def test_ddp_averages_inside_backward_with_the_explicit_bits(ranks) -> None:
    # TinyNet's 24 grads fit one DDP bucket: one domain all_reduce in the comm hook. The clip:
    # the world's one all_reduce, plain replicas included.
    _check(ranks.run(4, _ddp_body), "ddp", [0, 1], [4])


def test_plain_model_averages_at_the_end_of_backward_with_the_explicit_bits(ranks) -> None:
    _check(ranks.run(2, _plain_body), "plain", [0, 1], [2])


def test_a_failed_backward_does_not_stop_later_averages(ranks) -> None:
    assert ranks.run(2, _failed_backward_body) == [(True, 1)] * 2


def test_no_group_registers_nothing(ranks) -> None:
    assert ranks.run(2, _no_group_body) == [("plain", False, 2)] * 2


def test_fsdp2_units_under_an_unwrapped_root_are_refused(ranks) -> None:
    for message in ranks.run(2, _not_root_body):
        assert "fully_shard the root module too" in message


def test_a_model_must_be_a_module() -> None:
    with pytest.raises(TypeError, match=r"must be a torch\.nn\.Module"):
        sync_domain_gradients_in_backward([torch.zeros(1)], None)  # type: ignore[arg-type]


def test_the_registry_is_reached_through_its_functions_only() -> None:
    """A handle registers, forgets and looks up its parameters through ``_averaging``'s
    functions; the registry is no name of the face, and no module but its own names it."""
    params = [nn.Parameter(torch.zeros(2)) for _ in range(3)]
    handle = object()
    assert _averaging.first_averaged_in_backward(params) is None
    _averaging.register_averaged_in_backward(params[1:], handle)
    try:
        assert _averaging.first_averaged_in_backward(params) == 1
        assert _averaging.first_averaged_in_backward(params[:1]) is None
    finally:
        _averaging.unregister_averaged_in_backward(params[1:])
    assert _averaging.first_averaged_in_backward(params) is None
    face = {name: value for name, value in vars(_averaging).items() if not name.startswith("__")}
    assert not any(isinstance(value, MutableMapping) for value in face.values())
    package = Path(__file__).resolve().parents[1] / "src" / "credit" / "parallel"
    registry = re.compile(r"(?<!\w)_averaged_in_backward\b")
    naming = [path for path in package.rglob("*.py") if registry.search(path.read_text())]
    assert naming == [package / "_averaging" / "in_backward.py"]
