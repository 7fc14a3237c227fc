"""Lightning 2.6: ModelParallelStrategy (dp=2 x tp=2) on 4 CPU ranks, Lightning's own clip
beside MeshSafeGradientClipping, in automatic and manual optimization, fp32, bf16-mixed and
fp16 with this package's GradScaler as the precision plugin's scaler, and with rank-local
experts declared to the mixin.

Lightning runs its own loop: the Trainer in each rank (torch's elastic launcher starts them, as
torchrun would), ``configure_model`` applying TP and FSDP2 on ``self.device_mesh``, its hooks
(``on_before_optimizer_step`` sees the gradients after the AMP plugin unscaled them and before
the clip) recording what the tests compare.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import (
    DIM,
    DP,
    MIXED_MESH_ERROR,
    TP,
    Net,
    assert_norm,
    bits,
    framework,
    full,
    local_digest,
    materialised_norm,
    parallelize,
    plant_inf,
    run_ranks,
    same_on_every_rank,
    start_rank,
)
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from credit.parallel.amp import GradScaler
from credit.parallel.integrations.lightning import MeshSafeGradientClipping
from credit.parallel.replicas import verify_replicas

L = framework("lightning")

STEPS = 4
# Below every step's norm: every step clips, so a wrong norm moves the weights.
MAX_NORM = 0.05
CLIP_VALUE = 0.01  # below every step's largest gradient element
PLANTED_STEP = 1  # fp16: rank 3 plants an inf in its TP shard after this step's backward
PLANTED_RANK = 3


class Regression(L.LightningModule):
    """Lightning's way to the issue's layout: TP then FSDP2 on the strategy's mesh."""

    # The mixin's, where it is mixed in: the groups of rank-local experts, for the replica check.
    grad_clip_distinct_along: Any = None

    def __init__(self) -> None:
        super().__init__()
        self.net = Net()
        self.records: list[dict[str, Any]] = []

    def configure_model(self) -> None:
        mesh = self.device_mesh
        parallelize(self.net, mesh["data_parallel"], mesh["tensor_parallel"])

    def training_step(self, batch: tuple[Tensor, Tensor], index: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def on_train_end(self) -> None:
        # Every copy of every parameter and AdamW state, bit-identical (raises on every rank).
        verify_replicas(
            self, self.trainer.optimizers[0], distinct_along=self.grad_clip_distinct_along
        )

    def oracle(self) -> float:
        """The norm of the gradients, materialised."""
        return materialised_norm(self.parameters())


class Clipped(MeshSafeGradientClipping, Regression):
    """Automatic optimization: the Trainer's gradient_clip_val, clipped by the mixin."""

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.records.append(
            {"materialised": self.oracle(), "before": local_digest(self.parameters())}
        )

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
    ) -> None:
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        assert self.last_grad_norm is not None
        self.records[-1].update(norm=bits(self.last_grad_norm), clipped=self.oracle())

    def on_train_batch_end(self, outputs: Any, batch: Any, index: int) -> None:
        # The Integrations page's logging of the norm.
        self.log("grad_norm", self.last_grad_norm)
        self.records[-1].update(logged=bits(self.trainer.callback_metrics["grad_norm"]))


class ClippedByValue(MeshSafeGradientClipping, Regression):
    """gradient_clip_algorithm="value": left to Lightning's own clip, element-wise."""

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
    ) -> None:
        largest = max(full(p.grad).abs().max().item() for p in self.parameters())
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        clipped = max(full(p.grad).abs().max().item() for p in self.parameters())
        self.records.append(
            {"largest": largest, "clipped": clipped, "norm taken": self.last_grad_norm is not None}
        )


class Experts(Clipped):
    """Rank-local experts beside the dense layout: each expert-parallel rank trains its own
    expert (seeded by its ep rank), FSDP2-sharded over an edp mesh, declared to the mixin."""

    def __init__(self) -> None:
        super().__init__()
        self.expert = nn.Linear(DIM, DIM)

    def configure_model(self) -> None:
        super().configure_model()
        expert_mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("edp", "ep"))
        self.ep_group = expert_mesh["ep"]
        torch.manual_seed(100 + self.ep_group.get_local_rank())
        self.expert.reset_parameters()
        fully_shard(self.expert, mesh=expert_mesh["edp"])
        self.grad_clip_distinct_along = [(list(self.expert.parameters()), self.ep_group)]

    def training_step(self, batch: tuple[Tensor, Tensor], index: int) -> Tensor:
        return super().training_step(batch, index) + self.expert(batch[0]).square().mean()

    def oracle(self) -> float:
        """The dense gradients' norm and every ep rank's expert's, materialised."""
        experts = torch.tensor(
            materialised_norm(self.expert.parameters()) ** 2, dtype=torch.float64
        )
        dist.all_reduce(experts, group=self.ep_group.get_group())
        return math.sqrt(materialised_norm(self.net.parameters()) ** 2 + experts.item())


class _ManualOptimization(MeshSafeGradientClipping, Regression):
    """Manual optimization: each step zeroes the gradients and runs backward itself."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def _backward(self, batch: tuple[Tensor, Tensor], index: int) -> Any:
        """The step's backward; returns the optimizer to step."""
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(super().training_step(batch, index))
        return optimizer


class Manual(_ManualOptimization):
    """Manual optimization: the mixin's clip where Lightning's docs call self.clip_gradients."""

    def training_step(self, batch: tuple[Tensor, Tensor], index: int) -> None:
        optimizer = self._backward(batch, index)
        materialised = self.oracle()
        norm = self.clip_grad_norm_(optimizer, MAX_NORM)
        self.records.append(
            {"materialised": materialised, "norm": bits(norm), "clipped": self.oracle()}
        )
        optimizer.step()


def _record_scaler(module: Regression) -> None:
    """The step's outcome: whether the scaler skipped it, its scale, this rank's weights."""
    scaler = module.trainer.precision_plugin.scaler
    module.records[-1].update(
        skipped=scaler.last_step_skipped,
        scale=scaler.get_scale(),
        after=local_digest(module.parameters()),
    )


class Planted(Clipped):
    """fp16 through Lightning's MixedPrecision plugin: an inf planted in rank 3's TP shard."""

    def on_after_backward(self) -> None:
        if self.global_step == PLANTED_STEP and self.global_rank == PLANTED_RANK:
            plant_inf(self.net.fc1.weight)

    def on_train_batch_end(self, outputs: Any, batch: Any, index: int) -> None:
        super().on_train_batch_end(outputs, batch, index)
        _record_scaler(self)


class ManualPlanted(_ManualOptimization):
    """fp16 in manual optimization: the clip in on_before_optimizer_step, which Lightning calls
    inside optimizer.step() once it has unscaled the gradients."""

    def training_step(self, batch: tuple[Tensor, Tensor], index: int) -> None:
        optimizer = self._backward(batch, index)
        if index == PLANTED_STEP and self.global_rank == PLANTED_RANK:
            plant_inf(self.net.fc1.weight)
        optimizer.step()

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        record = {"materialised": self.oracle(), "before": local_digest(self.parameters())}
        record["norm"] = bits(self.clip_grad_norm_(optimizer, MAX_NORM))
        self.records.append(record)

    def on_train_batch_end(self, outputs: Any, batch: Any, index: int) -> None:
        _record_scaler(self)


def _fit(model: Regression, **trainer_args: Any) -> list[dict[str, Any]]:
    """Lightning's fit of ``model`` on this rank, the Trainer built as a user builds it."""
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    generator = torch.Generator().manual_seed(1234)
    data = TensorDataset(
        torch.randn(64, 8, generator=generator), torch.randn(64, 8, generator=generator)
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=DP * TP,
        strategy=L.pytorch.strategies.ModelParallelStrategy(
            data_parallel_size=DP, tensor_parallel_size=TP
        ),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_args,
    )
    trainer.fit(model, DataLoader(data, batch_size=4))
    return model.records


def _own_clip() -> str:
    start_rank()
    try:
        _fit(Regression(), gradient_clip_val=1.0)
    except RuntimeError as error:
        return str(error)
    return "no error"


def _clipped(precision: str) -> list[dict[str, Any]]:
    start_rank()
    return _fit(Clipped(), gradient_clip_val=MAX_NORM, precision=precision)


def _by_value() -> list[dict[str, Any]]:
    start_rank()
    return _fit(ClippedByValue(), gradient_clip_val=CLIP_VALUE, gradient_clip_algorithm="value")


def _manual() -> list[dict[str, Any]]:
    start_rank()
    return _fit(Manual())


def _experts() -> list[dict[str, Any]]:
    start_rank()
    return _fit(Experts(), gradient_clip_val=MAX_NORM)


def _planted(manual: bool) -> list[dict[str, Any]]:
    start_rank()
    plugin = L.pytorch.plugins.MixedPrecision(
        "16-mixed", "cpu", scaler=GradScaler("cpu", init_scale=1024.0)
    )
    if manual:
        return _fit(ManualPlanted(), plugins=[plugin])
    return _fit(Planted(), gradient_clip_val=MAX_NORM, plugins=[plugin])


def _assert_clipped_like_the_materialised_norm(runs: list[list[dict[str, Any]]]) -> None:
    assert all(len(records) == STEPS for records in runs)
    for step in range(STEPS):
        norm = float.fromhex(same_on_every_rank([records[step]["norm"] for records in runs]))
        assert_norm(norm, runs[0][step]["materialised"])
        assert norm > MAX_NORM
        if "logged" in runs[0][step]:  # automatic optimization: the norm logged by self.log
            assert same_on_every_rank([records[step]["logged"] for records in runs]) == bits(norm)
        clipped = same_on_every_rank([records[step]["clipped"] for records in runs])
        assert math.isclose(clipped, MAX_NORM, rel_tol=1e-4), (step, clipped)


def test_lightning_own_clip_raises_on_the_tp_fsdp2_layout():
    """Trainer(gradient_clip_val=1.0) calls torch's clip through the precision plugin: on the
    issue's layout every rank raises the mixed-mesh error."""
    errors = run_ranks(_own_clip)
    assert all(MIXED_MESH_ERROR in error for error in errors), errors


def test_mixin_clips_to_the_materialised_norm_in_fp32():
    _assert_clipped_like_the_materialised_norm(run_ranks(_clipped, "32-true"))


def test_mixin_clips_to_the_materialised_norm_in_bf16_mixed():
    _assert_clipped_like_the_materialised_norm(run_ranks(_clipped, "bf16-mixed"))


def test_mixin_leaves_clipping_by_value_to_lightning():
    """Clipping by value is element-wise: Lightning's own works on the mixed meshes, and the
    mixin leaves it to Lightning (no norm taken)."""
    runs = run_ranks(_by_value)
    for step in range(STEPS):
        largest = same_on_every_rank([records[step]["largest"] for records in runs])
        clipped = same_on_every_rank([records[step]["clipped"] for records in runs])
        assert largest > CLIP_VALUE and clipped == pytest.approx(CLIP_VALUE)
        assert not any(records[step]["norm taken"] for records in runs)


def test_mixin_clips_in_manual_optimization():
    _assert_clipped_like_the_materialised_norm(run_ranks(_manual))


def test_mixin_clips_rank_local_experts_declared_through_distinct_along():
    """Each ep rank's own expert, FSDP2 on an edp mesh beside the strategy's: the norm covers the
    dense part and every rank's expert, the same bits on every rank."""
    _assert_clipped_like_the_materialised_norm(run_ranks(_experts))


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_fp16_planted_inf_skips_the_step_on_every_rank(manual):
    """16-mixed with this package's GradScaler as the MixedPrecision plugin's scaler: Lightning
    unscales, the mixin clips (its all_reduce carries the skip decision), Lightning's plugin
    steps through the scaler. The step holding rank 3's inf is skipped on all 4 ranks, the
    scale halves once, no weight moves; every other step clips and steps."""
    runs = run_ranks(_planted, manual)
    for step in range(STEPS):
        skipped = same_on_every_rank([records[step]["skipped"] for records in runs])
        scale = same_on_every_rank([records[step]["scale"] for records in runs])
        norm = float.fromhex(same_on_every_rank([records[step]["norm"] for records in runs]))
        moved = [records[step]["before"] != records[step]["after"] for records in runs]
        if step == PLANTED_STEP:
            assert skipped and scale == 512.0 and math.isinf(norm)
            assert not any(moved)
        else:
            assert not skipped and scale == (1024.0 if step < PLANTED_STEP else 512.0)
            assert_norm(norm, runs[0][step]["materialised"])
            assert all(moved)


def test_mixin_listed_after_lightning_module_is_refused_at_class_definition():
    """Listed after LightningModule, the mixin's hook would be bypassed and torch's mixed-mesh
    error would follow: the class is refused when it is defined, naming the order that works."""
    with pytest.raises(TypeError, match=r"class Late\(MeshSafeGradientClipping, Regression\)"):

        class Late(Regression, MeshSafeGradientClipping):
            pass
