"""torchtitan 0.3's three SPMD backends on 4 CPU ranks: the parameter layouts its own
parallelize functions give its llama3 and qwen3 MoE debug models, the clip (ours and the one
its trainer calls), this package's GradScaler and the replica check on them.

``ParallelismConfig.spmd_backend`` selects how torchtitan lays parameters out:

- ``"partial_dtensor"``: DTensors on the model-parallel axes, FSDP2 on its ``fsdp`` view.
- ``"full_dtensor"``: every parameter a DTensor on the full dense mesh ``(dp_shard, tp)``,
  FSDP2 given the dense mesh and ``DataParallelMeshDims(shard="dp_shard")``.
- ``"spmd_types"`` (the default): FSDP2 given the same dense mesh, with the parameters plain
  tensors annotated with SPMD types, which ``fully_shard`` is to turn into DTensors on it, placed
  by the same ``SpmdLayout`` objects: the ``"full_dtensor"`` layout. torch 2.13's ``fully_shard``
  cannot ("all parameters must be DTensors on the full SPMD mesh"), on any device: a test below
  holds that, so that the day it builds, its layout joins the others here.

What is torchtitan's: ``ParallelDims.build_mesh`` (device type set to "cpu"), the model builders
(``model_registry("debugmodel")`` of ``torchtitan.models.llama3``, ``"debugmodel_moe"`` of
``torchtitan.models.qwen3``: every dense weight under TP, routed experts on the ``(efsdp, ep)``
mesh), the sharding configs (``update_from_config``), ``parallelize_fn`` (TP and FSDP2),
``init_weights``, and ``torchtitan.distributed.utils.clip_grad_norm_``. What is not: the
gradients. FlexAttention, which its debug models use, has no backward on the CPU, so each step
plants a gradient on every parameter with the parameter's own layout (an element-wise function
of the parameter and the step: copies of a parameter get equal copies of its gradient).
torchtitan's modules import triton at import time (its async expert-parallel kernels); the
integration venv installs a triton release that imports on a CPU-only machine, none of whose
kernels run.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from harness import (
    assert_norm,
    bits,
    framework,
    local_digest,
    materialised_norm,
    plant_inf,
    run_ranks,
    same_on_every_rank,
    start_rank,
)
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from credit.parallel.amp import GradScaler
from credit.parallel.integrations.torchtitan import clip_grad_norm_
from credit.parallel.replicas import verify_replicas

framework("torchtitan")
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.distributed import parallel_dims, utils  # noqa: E402

BACKENDS = ["partial_dtensor", "full_dtensor"]
MODELS = {"llama3": "debugmodel", "qwen3": "debugmodel_moe"}
LAYERS = 2
STEPS = 3
# torch's float32 norm kernel on one rank's shard of a qwen3 expert weight (3.1 million elements)
# is 6.5e-5 off the float64 norm of the same values (measured: 1492.5066 against 1492.4088).
# Ours and torchtitan's both start from that kernel on the shards, so they agree with each other
# within a few float32 ULPs (harness.NORM_RTOL) and with the float64 norm within this.
FLOAT32_KERNEL_RTOL = 1e-4
MAX_NORM = 0.05
INIT_SCALE = 1024.0
PLANTED_STEP = 1
PLANTED_RANK = 3


def _parallel_dims(backend: str, ep: int) -> Any:
    """torchtitan's ParallelDims for dp_shard=2 x tp=2 on 4 ranks (ep=2 borrows from both), its
    meshes built on the CPU."""
    parallel_dims.device_type = "cpu"
    dims = parallel_dims.ParallelDims(
        dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, ep=ep, world_size=4, spmd_backend=backend
    )
    dims.build_mesh()
    return dims


def _titan_model(backend: str, name: str) -> tuple[nn.Module, bool]:
    """torchtitan's debug model ``name``, parallelized by its own functions under ``backend``,
    initialised by its ``init_weights``."""
    import importlib

    spec = importlib.import_module(f"torchtitan.models.{name}").model_registry(MODELS[name])
    spec.model.layers = spec.model.layers[:LAYERS]  # its first layers: the same layouts, sooner
    ep = 2 if "moe" in MODELS[name] else 1
    dims = _parallel_dims(backend, ep)
    utils.set_spmd_backend(backend)
    parallelism = ParallelismConfig(
        tensor_parallel_degree=2,
        data_parallel_shard_degree=2,
        expert_parallel_degree=ep,
        spmd_backend=backend,
    )
    config = SimpleNamespace(parallelism=parallelism)
    spec.model.update_from_config(config=config)
    with torch.device("meta"):
        model = spec.model.build()
    model = spec.parallelize_fn(
        model,
        parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder=".",
    )
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model, ep > 1


@torch.no_grad()
def _plant_grads(model: nn.Module, step: int, scaled_one: Tensor) -> None:
    """A gradient on every parameter with its layout: an element-wise function of it, times the
    scaler's ``scale(1)`` as a scaled loss's backward gives it."""
    factor = float(scaled_one) / 64
    for parameter in model.parameters():
        parameter.grad = torch.sin(parameter.detach() * (step + 2) + 1) * factor


def _counted(clip: Any, *args: Any, **kwargs: Any) -> tuple[float, int]:
    with CommDebugMode() as comms:
        norm = clip(*args, **kwargs)
    return float(norm), comms.get_total_counts()


def _run(backend: str, name: str) -> dict[str, Any]:
    start_rank()
    model, ep_enabled = _titan_model(backend, name)
    params = list(model.parameters())
    layouts = sorted(
        {
            (tuple(p.device_mesh.mesh_dim_names or ()), str(p.placements))
            for p in params
            if isinstance(p, DTensor)
        }
    )
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    scaler = GradScaler("cpu", init_scale=INIT_SCALE)
    target = next(p for n, p in model.named_parameters() if n.endswith("wo.weight"))
    steps = []
    for step in range(STEPS):
        _plant_grads(model, step, scaler.scale(torch.ones(())))
        if step == PLANTED_STEP and dist.get_rank() == PLANTED_RANK:
            plant_inf(target)
        scaler.unscale_(optimizer)
        materialised = materialised_norm(params)
        # max_norm 1e9: torchtitan's clip multiplies by exactly 1, leaving the gradients as they are.
        theirs, their_comms = _counted(
            utils.clip_grad_norm_, params, 1e9, foreach=True, ep_enabled=ep_enabled
        )
        ours, our_comms = _counted(
            clip_grad_norm_, params, MAX_NORM, foreach=True, ep_enabled=ep_enabled
        )
        before = local_digest(params)
        scaler.step(optimizer)
        scaler.update()
        steps.append(
            {
                "materialised": materialised,
                "theirs": theirs,
                "ours": bits(ours),
                "comms": (their_comms, our_comms),
                "clipped": materialised_norm(params),
                "skipped": scaler.last_step_skipped,
                "scale": scaler.get_scale(),
                "moved": before != local_digest(params),
            }
        )
        optimizer.zero_grad()
    verify_replicas(model, optimizer)  # raises on every rank where a copy differs
    return {"layouts": layouts, "steps": steps}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_torchtitan_backend_layouts_clip_skip_and_stay_replicas(backend, name):
    """On each backend's layout of each debug model: ours and torchtitan's clip give the float64
    norm of the gathered gradients, ours the same bits on every rank in 2 all_reduces (within tp,
    where the copies of shards are compared, then over the world), and 3 more on the layout's
    first call (torchtitan's: 2, and 4 with experts); an inf in rank 3's TP shard of an
    attention output projection makes every rank skip that step and halve the scale, no weight
    moves; after the steps every copy of every parameter and AdamW state is bit-identical."""
    runs = run_ranks(_run, backend, name)
    layouts = same_on_every_rank([run["layouts"] for run in runs])
    dense = "('fsdp', 'tp')" if backend == "partial_dtensor" else "('dp_shard', 'tp')"
    assert {str(mesh) for mesh, _ in layouts} == (
        {dense, "('efsdp', 'ep')"} if name == "qwen3" else {dense}
    ), layouts
    scale = INIT_SCALE
    for step in range(STEPS):
        records = [run["steps"][step] for run in runs]
        ours = float.fromhex(same_on_every_rank([record["ours"] for record in records]))
        skipped = same_on_every_rank([record["skipped"] for record in records])
        assert same_on_every_rank([record["scale"] for record in records]) == (
            scale / 2 if step == PLANTED_STEP else scale
        )
        scale = records[0]["scale"]
        their_comms, our_comms = same_on_every_rank([record["comms"] for record in records])
        # Ours: within tp, then over the world; on the layout's first call its proof before them
        # (the self-check over the world, the copies within tp, their flags over the world).
        assert our_comms == (3 + 2 if step == 0 else 2), our_comms
        # torchtitan's: a full_tensor() of the norm per mesh dim; with experts, per group of meshes.
        assert their_comms == (4 if name == "qwen3" else 2), their_comms
        if step == PLANTED_STEP:
            assert skipped and not math.isfinite(ours)
            assert not any(record["moved"] for record in records)
            continue
        assert not skipped and all(record["moved"] for record in records)
        oracle = records[0]["materialised"]
        assert math.isclose(ours, oracle, rel_tol=FLOAT32_KERNEL_RTOL), (ours, oracle)
        for record in records:
            assert_norm(ours, record["theirs"])
            assert math.isclose(record["clipped"], MAX_NORM, rel_tol=FLOAT32_KERNEL_RTOL)


def _spmd_types(name: str) -> str:
    start_rank()
    try:
        _titan_model("spmd_types", name)
    except ValueError as error:
        return str(error)
    return "built"


@pytest.mark.parametrize("name", list(MODELS))
def test_torchtitan_spmd_types_layout_is_refused_by_this_torchs_fully_shard(name):
    """torchtitan's default backend leaves its parameters plain tensors with SPMD annotations,
    which torch 2.13's fully_shard refuses on every rank. When this fails, the layout builds:
    add "spmd_types" to BACKENDS."""
    for error in run_ranks(_spmd_types, name):
        assert "all parameters must be DTensors on the full SPMD mesh" in error, error
