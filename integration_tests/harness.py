"""What the integration tests share: the frameworks, 4 gloo ranks, the layout and the oracles.

Each test starts 4 real gloo ranks on this machine (torch's elastic launcher, forked from the
test process, listening on 127.0.0.1 only) and runs a framework's own training path in them.
The layout is the issue's: dp=2 x tp=2, a LayerNorm and a Colwise/Rowwise MLP, TP on the
``tp`` mesh and FSDP2 on ``dp``: the TP weights' gradients live on the 2D (dp, tp) mesh, the
LayerNorm's on the 1D dp mesh. The oracle of every norm is the float64 norm of the materialised
gradients (``full_tensor()``).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from credit.parallel._common.launch import init_process_group, launch_local

# Set by .ci/run: a framework missing there fails its tests instead of skipping them.
REQUIRE_ENV = "CREDIT_PARALLEL_REQUIRE_FRAMEWORKS"
WORLD = 4
DP = TP = 2
DIM, HIDDEN = 8, 16
# The norm of float32 gradients against the float64 norm of the same values: a few float32 ULPs.
NORM_RTOL = 4e-6
MIXED_MESH_ERROR = "must have the same mesh"


def framework(name: str) -> ModuleType:
    """Import a framework the tests run against: skipped where it is missing, failed in CI."""
    if os.environ.get(REQUIRE_ENV) == "1":
        return importlib.import_module(name)
    return pytest.importorskip(name)


def load_example(name: str) -> ModuleType:
    """The script ``docs/examples/<name>.py`` as a module (its ``main`` not run)."""
    path = Path(__file__).resolve().parents[1] / "docs" / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_ranks(entry: Callable[..., Any], *args: Any) -> list[Any]:
    """``entry(*args)`` on 4 gloo ranks; what each rank returned, by rank."""
    results = launch_local(entry, args, WORLD)
    return [results[rank] for rank in range(WORLD)]


def start_rank(seed: int = 0) -> int:
    """Join the ranks' process group (bound to loopback) with a fixed seed; this rank."""
    init_process_group("gloo")
    torch.manual_seed(seed)
    return dist.get_rank()


class Net(nn.Module):
    """A LayerNorm and an MLP: the MLP is tensor-parallel, the LayerNorm is not."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


def parallelize(net: Net, dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> Net:
    """TP on the MLP over ``tp_mesh`` (Colwise, then Rowwise), then FSDP2 over ``dp_mesh``."""
    parallelize_module(net, tp_mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    fully_shard(net, mesh=dp_mesh)
    return net


def batches(steps: int, dp_rank: int, batch: int = 4) -> list[tuple[Tensor, Tensor]]:
    """The same seeded global batches on every rank; this dp rank's half of each."""
    generator = torch.Generator().manual_seed(1234)
    data = [
        (
            torch.randn(DP * batch, DIM, generator=generator),
            torch.randn(DP * batch, DIM, generator=generator),
        )
        for _ in range(steps)
    ]
    mine = slice(dp_rank * batch, (dp_rank + 1) * batch)
    return [(x[mine], y[mine]) for x, y in data]


def full(tensor: Tensor) -> Tensor:
    """The whole tensor, in float64: gathered from every shard of a DTensor."""
    whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return whole.detach().to(torch.float64)


def materialised_norm(parameters: Iterable[Tensor], norm_type: float = 2.0) -> float:
    """The oracle: the norm of the gradients gathered whole, in float64 (a collective per
    DTensor gradient: every rank must call it)."""
    grads = [full(p.grad) for p in parameters if p.grad is not None]
    norms = torch.stack([torch.linalg.vector_norm(g, norm_type) for g in grads])
    return torch.linalg.vector_norm(norms, norm_type).item()


def plant_inf(parameter: Tensor) -> None:
    """An inf in the first element of this rank's shard of ``parameter``'s gradient."""
    grad = parameter.grad
    assert grad is not None
    local = grad.to_local() if isinstance(grad, DTensor) else grad
    with torch.no_grad():
        local.view(-1)[0] = math.inf


def bits(value: Tensor | float) -> str:
    """A float's exact value (hex): equal strings are equal bits of a float32 or float64."""
    return float(value).hex()


def local_digest(parameters: Iterable[Tensor]) -> str:
    """SHA-256 of this rank's shards of ``parameters``: equal before and after a skipped step."""
    digest = hashlib.sha256()
    for p in parameters:
        local = p.to_local() if isinstance(p, DTensor) else p
        digest.update(local.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def same_on_every_rank(values: Sequence[Any]) -> Any:
    """The one value every rank holds; AssertionError naming the ranks where they differ."""
    assert all(value == values[0] for value in values), f"ranks differ: {list(values)}"
    return values[0]


def assert_norm(norm: float, oracle: float) -> None:
    """``norm`` (ours, float32) equals the float64 norm of the materialised gradients within a
    few float32 ULPs."""
    assert math.isclose(norm, oracle, rel_tol=NORM_RTOL), f"norm {norm!r}, materialised {oracle!r}"
