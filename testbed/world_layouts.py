"""Llama-like gradients at world scale on torch's fake backend, and the wire of a call.

One process plays one rank of a world of up to 65,536 ranks (``FakeStore`` + backend ``"fake"``,
as in ``testbed/fake_world.py``): collectives return at once and move no data, so what a call costs
this rank is its structure: the host work, the memory it keeps, and what it puts on the wire.
The gradients are DTensors built with ``DTensor.from_local`` in the layouts FSDP2 + TP produce
for a Llama-like model (the global shapes of Llama 3 8B or 70B, local shards of
:data:`LOCAL_NUMEL` elements: values do not matter here). Four layouts (:data:`LAYOUTS`):

- ``fsdp-tp``: a (dp, tp=8) mesh; colwise projections (wq, wk, wv, w1, w3 and the output, as
  torchtitan's ColwiseParallel shards them) on ``(Shard(0), Shard(0))``; rowwise ones (wo, w2) on
  ``(Shard(0), Shard(1))``; the token embedding (RowwiseParallel of an Embedding shards its rows)
  on ``(Shard(0), Shard(0))``; the RMSNorm weights on ``(Shard(0), Replicate())``.
- ``fsdp-tp-unflattened``: torchtitan's construction, (dp, tp=8) views unflattened from a 1-D
  world, the RMSNorm weights left out of the TP plan (dp-sharded on the 1-D dp view: their copies
  are their tp peers, whose group only the other gradients' 2-D view holds).
- ``hsdp-tp``: a (rep, shard=64, tp=8) mesh, the same placements with ``Replicate()`` prepended
  (``hsdp-tp-8``: a shard group of 8, so that small worlds fit).
- ``pipeline``: a (pp=4, dp, tp=8) mesh, ``pp_group`` its pp dim; each stage holds a quarter of
  the layers on its (dp, tp) mesh, the first stage the embedding, the last the final norm and
  the output.
- ``experts``: torchtitan's construction, views unflattened from a 1-D world: the dense
  parameters (embedding, attention, norms, output) dp-sharded over the whole world; each
  layer's w1, w2 and w3 are experts, different on each of the ep=8 ranks, dp-sharded over the
  efsdp dim of an (efsdp, ep) view and declared with ``distinct_along=[(experts, ep)]``.

:class:`WireRecorder` records the collectives a call issues, with the elements each carries.
Every world must be set up in a fresh process (see ``testbed/fake_world.py``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

LOCAL_NUMEL = 4  # elements of every local shard
TP, EP, STAGES = 8, 8, 4


@dataclass(frozen=True)
class Model:
    """A Llama-like model's shapes: per layer wq, wk, wv, wo, w1, w2, w3 and two RMSNorms; then
    the token embedding, the final norm and the output projection."""

    layers: int
    dim: int
    hidden: int
    kv_dim: int
    vocab: int

    @property
    def gradients(self) -> int:
        return 9 * self.layers + 3


MODELS = {
    "8b": Model(layers=32, dim=4096, hidden=14336, kv_dim=1024, vocab=128256),  # 291 gradients
    "70b": Model(layers=80, dim=8192, hidden=28672, kv_dim=1024, vocab=128256),  # 723
    "4-layer": Model(layers=4, dim=256, hidden=512, kv_dim=64, vocab=1024),  # 39
}

# How TP splits each kind of parameter on its tp dim (FSDP2 adds Shard(0) on dp).
COLWISE, ROWWISE, NORM = Shard(0), Shard(1), Replicate()


@dataclass(frozen=True)
class Param:
    """One parameter: its name, global shape, TP placement, and whether it is an expert."""

    name: str
    shape: tuple[int, ...]
    tp: Placement
    expert: bool = False


def layer_params(model: Model, layer: int, dim: int) -> list[Param]:
    """The nine parameters of layer ``layer``, with ``dim`` for the model's width."""
    kv, hidden = model.kv_dim, model.hidden
    return [
        Param(f"layers.{layer}.attention.wq", (dim, dim), COLWISE),
        Param(f"layers.{layer}.attention.wk", (kv, dim), COLWISE),
        Param(f"layers.{layer}.attention.wv", (kv, dim), COLWISE),
        Param(f"layers.{layer}.attention.wo", (dim, dim), ROWWISE),
        Param(f"layers.{layer}.feed_forward.w1", (hidden, dim), COLWISE, expert=True),
        Param(f"layers.{layer}.feed_forward.w2", (dim, hidden), ROWWISE, expert=True),
        Param(f"layers.{layer}.feed_forward.w3", (hidden, dim), COLWISE, expert=True),
        Param(f"layers.{layer}.attention_norm", (dim,), NORM),
        Param(f"layers.{layer}.ffn_norm", (dim,), NORM),
    ]


def model_params(model: Model, variant: int = 0, stage: int = 0, stages: int = 1) -> list[Param]:
    """The parameters of pipeline stage ``stage`` of ``stages`` (all of them for one stage).

    ``variant`` widens the model by ``8 * variant``: every global shape changes, a new layout
    for the norm (nothing of it cached) on the same meshes.
    """
    dim = model.dim + 8 * variant
    per_stage = math.ceil(model.layers / stages)
    layers = range(stage * per_stage, min((stage + 1) * per_stage, model.layers))
    params = [Param("tok_embeddings", (model.vocab, dim), COLWISE)] if stage == 0 else []
    for layer in layers:
        params += layer_params(model, layer, dim)
    if stage == stages - 1:
        params += [
            Param("norm", (dim,), NORM),
            Param("output", (model.vocab, dim), COLWISE),
        ]
    return params


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= size
    return tuple(reversed(strides))


def shard(param: Param, mesh: DeviceMesh, placements: Sequence[Placement], seed: int) -> DTensor:
    """A DTensor of ``param``'s global shape whose local shard has :data:`LOCAL_NUMEL` elements."""
    generator = torch.Generator().manual_seed(seed)
    local_shape = (LOCAL_NUMEL,) if len(param.shape) == 1 else (2, LOCAL_NUMEL // 2)
    local = torch.randn(local_shape, generator=generator)
    return DTensor.from_local(
        local,
        mesh,
        list(placements),
        run_check=False,
        shape=torch.Size(param.shape),
        stride=_contiguous_stride(param.shape),
    )


@dataclass
class Layout:
    """The gradients of one rank, the parameters that hold them, and the norm's arguments."""

    grads: list[Tensor]
    params: list[nn.Parameter]
    kwargs: dict[str, Any] = field(default_factory=dict)


def _with_params(grads: list[Tensor], kwargs: dict[str, Any] | None = None) -> Layout:
    params = []
    for grad in grads:
        param = nn.Parameter(torch.empty_like(grad))
        param.grad = grad
        params.append(param)
    return Layout(grads, params, kwargs or {})


@dataclass(frozen=True)
class Meshes:
    """A layout's meshes in the current world (built once, shared by its variants)."""

    layout: str
    meshes: dict[str, DeviceMesh]


def _fsdp_tp(
    params: list[Param], mesh: DeviceMesh, prefix: Sequence[Placement] = ()
) -> list[Tensor]:
    return [shard(p, mesh, [*prefix, Shard(0), p.tp], seed=i) for i, p in enumerate(params)]


def _norms_on_dp(params: list[Param], found: dict[str, DeviceMesh]) -> list[Tensor]:
    """torchtitan's construction, views unflattened from a 1-D world, with the RMSNorm weights
    left out of the TP plan: FSDP2 shards them on the 1-D dp view, their copies on tp peers."""
    return [
        shard(p, found["dp"], [Shard(0)], seed=i)
        if isinstance(p.tp, Replicate)
        else shard(p, found["dp_tp"], [Shard(0), p.tp], seed=i)
        for i, p in enumerate(params)
    ]


def build_meshes(layout: str, world: int) -> Meshes:
    """The meshes of ``layout`` (one of :data:`LAYOUTS`) in a world of ``world`` ranks."""
    if layout == "fsdp-tp":
        return Meshes(layout, {"dp_tp": _mesh((world // TP, TP), ("dp", "tp"))})
    if layout == "fsdp-tp-unflattened":
        world_1d = _mesh((world,), ("world",))
        dp_tp = world_1d._unflatten(0, (world // TP, TP), ("dp", "tp"))
        return Meshes(layout, {"dp_tp": dp_tp, "dp": dp_tp["dp"]})
    if layout.startswith("hsdp-tp"):
        group = HSDP_SHARD[layout]
        sizes = (world // (group * TP), group, TP)
        return Meshes(layout, {"hsdp": _mesh(sizes, ("rep", "shard", "tp"))})
    if layout == "pipeline":
        pp = _mesh((STAGES, world // (STAGES * TP), TP), ("pp", "dp", "tp"))
        return Meshes(layout, {"pp": pp["pp"], "dp_tp": pp["dp", "tp"]})
    if layout == "experts":
        world_1d = _mesh((world,), ("world",))
        sparse = world_1d._unflatten(0, (world // EP, EP), ("efsdp", "ep"))
        return Meshes(layout, {"dense": world_1d, "efsdp": sparse["efsdp"], "ep": sparse["ep"]})
    raise ValueError(f"unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")


def _mesh(sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    if math.prod(sizes) != dist.get_world_size() or min(sizes) < 1:
        raise ValueError(f"a {names} mesh of {sizes} does not fit {dist.get_world_size()} ranks")
    return init_device_mesh("cpu", sizes, mesh_dim_names=names)


def build_layout(meshes: Meshes, model: Model, variant: int = 0) -> Layout:
    """This rank's gradients of ``model`` in the layout of ``meshes`` (see the module's doc)."""
    found, layout = meshes.meshes, meshes.layout
    if layout == "fsdp-tp":
        return _with_params(_fsdp_tp(model_params(model, variant), found["dp_tp"]))
    if layout == "fsdp-tp-unflattened":
        return _with_params(_norms_on_dp(model_params(model, variant), found))
    if layout.startswith("hsdp-tp"):
        return _with_params(_fsdp_tp(model_params(model, variant), found["hsdp"], [Replicate()]))
    if layout == "pipeline":
        stage = found["pp"].get_local_rank()
        params = model_params(model, variant, stage, STAGES)
        return _with_params(_fsdp_tp(params, found["dp_tp"]), {"pp_group": found["pp"]})
    dense: list[Tensor] = []
    experts: list[Tensor] = []
    for index, param in enumerate(model_params(model, variant)):
        if param.expert:  # different values on each ep rank: seeded by the ep coordinate
            seed = 1000 * index + found["ep"].get_local_rank()
            experts.append(shard(param, found["efsdp"], [Shard(0)], seed))
        else:
            dense.append(shard(param, found["dense"], [Shard(0)], index))
    return _with_params(dense + experts, {"distinct_along": [(experts, found["ep"])]})


HSDP_SHARD = {"hsdp-tp": 64, "hsdp-tp-8": 8}
LAYOUTS = ("fsdp-tp", "fsdp-tp-unflattened", "hsdp-tp", "hsdp-tp-8", "pipeline", "experts")


def fixed_ranks(layout: str) -> int:
    """The ranks of ``layout``'s fixed dims: its world is a multiple of it, at least twice it
    (the data-parallel dim, or HSDP's replicas, of size 2 or more)."""
    if layout.startswith("hsdp-tp"):
        return HSDP_SHARD[layout] * TP
    return {"fsdp-tp": TP, "fsdp-tp-unflattened": TP, "pipeline": STAGES * TP, "experts": EP}[
        layout
    ]


def fits(layout: str, world: int) -> bool:
    """Whether a world of ``world`` ranks fits ``layout``."""
    return world % fixed_ranks(layout) == 0 and world >= 2 * fixed_ranks(layout)


def start_world(world: int, rank: int = 0) -> None:
    """Make this process rank ``rank`` of a fake world of ``world`` ranks."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


# --- the wire ---------------------------------------------------------------------------------

# The schema argument that holds what a rank sends, in the order looked for.
_SENT = ("input_tensors", "input_tensor", "input", "inputs", "tensors", "tensor", "self")
_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd")
# Operators of those namespaces that send nothing: waits, and the autograd wrapper of a result.
_NOT_SENT = ("wait", "_wrap_tensor_autograd")


@dataclass(frozen=True)
class Collective:
    """One collective as this rank issued it.

    Attributes:
        op: the operator (``"c10d::allreduce_"``, ``"_c10d_functional::all_reduce"``, ...).
        elements: elements of the tensors this rank sends.
        dtype: their dtype.
        group: ranks in its process group (0 where it could not be read).
    """

    op: str
    elements: int
    dtype: str
    group: int

    def __str__(self) -> str:
        dtype = self.dtype.replace("torch.", "")
        return f"{self.op.split('::')[-1]}({self.elements:,} {dtype}, group {self.group:,})"


def _tensors(value: object) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _group_size(value: object) -> int:
    if isinstance(value, torch.ScriptObject):
        return dist.ProcessGroup.unbox(value).size()
    if isinstance(value, str):  # functional collectives name their group
        return dist.distributed_c10d._resolve_process_group(value).size()  # type: ignore[arg-type]
    return 0


def _collective(func: Any, args: tuple, kwargs: dict) -> Collective:
    schema = func._schema
    named = dict(zip([a.name for a in schema.arguments], args, strict=False)) | kwargs
    sent = next((named[name] for name in _SENT if name in named), args[0] if args else None)
    tensors = _tensors(sent)
    group = next(
        (
            _group_size(named[a.name])
            for a in schema.arguments
            if a.name in ("process_group", "group_name", "group") and a.name in named
        ),
        0,
    )
    dtype = str(tensors[0].dtype) if tensors else "-"
    return Collective(schema.name, sum(t.numel() for t in tensors), dtype, group)


class WireRecorder(TorchDispatchMode):
    """Records every collective issued under it (c10d ops and functional collectives alike, the
    ops torch's ``CommDebugMode`` counts), with the elements it sends and its group's size."""

    def __init__(self) -> None:
        super().__init__()
        self.collectives: list[Collective] = []

    @property
    def groups(self) -> list[int]:
        """The size of each recorded collective's process group, in order."""
        return [c.group for c in self.collectives]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):  # no schema, no collective
            return func(*args, **(kwargs or {}))
        if any(t is DTensor for t in types):
            # Let DTensor run first: the collectives it desugars into come back here, as in
            # CommDebugMode (a mode sees an op before its tensor subclasses do).
            return NotImplemented
        kwargs = kwargs or {}
        name = func._schema.name
        if name.split("::")[0] in _NAMESPACES and not any(w in name for w in _NOT_SENT):
            self.collectives.append(_collective(func, args, kwargs))
        return func(*args, **kwargs)


def wire(call: Callable[[], object]) -> list[Collective]:
    """The collectives ``call`` issues, in order."""
    with WireRecorder() as recorder:
        call()
    return recorder.collectives


def describe(collectives: list[Collective]) -> str:
    """The collectives as one short text: ``allreduce_(16,931 float64, group 1,024)``."""
    return " + ".join(map(str, collectives)) or "none"


def as_dicts(collectives: list[Collective]) -> list[dict[str, Any]]:
    return [dataclasses.asdict(c) for c in collectives]


def _wire_of_calls(layout: Layout) -> dict[str, list[Collective]]:
    from credit.parallel.collectives import clip_grad_norm_, total_grad_norm

    def norm() -> None:
        total_grad_norm(layout.grads, **layout.kwargs)

    return {
        "first call": wire(norm),
        "total_grad_norm": wire(norm),
        "clip_grad_norm_": wire(lambda: clip_grad_norm_(layout.params, 1.0, **layout.kwargs)),
    }


def wire_in_fake_world(
    world: int, rank: int, layouts: Sequence[str], model: str
) -> dict[str, dict[str, list[Collective]]]:
    """Rank ``rank`` of a fake world of ``world`` ranks: per layout that fits it, the collectives
    of a first call of ``total_grad_norm`` (the first on its meshes), then of a later call, and
    of ``clip_grad_norm_`` (run in a fresh process).

    Returns:
        ``{layout: {"first call": [...], "total_grad_norm": [...], "clip_grad_norm_": [...]}}``.
    """
    start_world(world, rank)
    try:
        return {
            name: _wire_of_calls(build_layout(build_meshes(name, world), MODELS[model]))
            for name in layouts
            if fits(name, world)
        }
    finally:
        dist.destroy_process_group()


def groups_of_a_dp_mesh_among_two_dims(world: int, rank: int) -> list[int]:
    """Rank ``rank`` of a fake (dp, cp=2, tp=2) world: the group of each collective of a later
    norm of FSDP2 gradients on the dp mesh alone, whose copies span cp and tp (run in a fresh
    process)."""
    from credit.parallel.collectives import total_grad_norm

    start_world(world, rank)
    try:
        mesh = init_device_mesh("cpu", (world // 4, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
        shape = (2 * (world // 4), 3)
        grads = [
            DTensor.from_local(
                torch.ones(2, 3),
                mesh["dp"],
                [Shard(0)],
                run_check=False,
                shape=shape,
                stride=(3, 1),
            )
            for _ in range(3)
        ]
        total_grad_norm(grads)  # the layout's first call
        return [c.group for c in wire(lambda: total_grad_norm(grads))]
    finally:
        dist.destroy_process_group()
