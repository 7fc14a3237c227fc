"""Lightning 2.6: ModelParallelStrategy (dp=2 x tp=2) on 4 CPU ranks, Lightning's own clip
beside MeshSafeGradientClipping, in automatic and manual optimization, fp32, bf16-mixed and
fp16 with this package's GradScaler as the precision plugin's scaler, and with rank-local
experts declared to the mixin; the norm the mixin logs through ``self.log``, as the Trainer's
metrics and a CSV logger hold it, and nothing logged once switched off.

Lightning runs its own loop: the Trainer in each rank (torch's elastic launcher starts them, as
torchrun would), ``configure_model`` applying TP and FSDP2 on ``self.device_mesh``, its hooks
(``on_before_optimizer_step`` sees the gradients after the AMP plugin unscaled them and before
the clip) recording what the tests compare.
"""

from __future__ import annotations

import csv
import logging
import math
import statistics
from pathlib import Path
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
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

from credit.parallel.amp import GradScaler
from credit.parallel.integrations.lightning import MeshSafeGradientClipping
from credit.parallel.replicas import verify_replicas
from credit.parallel.spikes import SpikePolicy

L = framework("lightning")

STEPS = 4
# Below every step's norm: every step clips, so a wrong norm moves the weights.
MAX_NORM = 0.05
CLIP_VALUE = 0.01  # below every step's largest gradient element
PLANTED_STEP = 1  # fp16: rank 3 plants an inf in its TP shard after this step's backward
PLANTED_RANK = 3
# The name the mixin logs the norm under: Lightning's grad_norm utility's name for the total.
LOGGED = "grad_2.0_norm_total"
# Host reads of a tensor's value: item(), float(), bool(), equal().
READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default}


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
        _record_logged(self)


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

    def on_train_batch_end(self, outputs: Any, batch: Any, index: int) -> None:
        _record_logged(self)


class _HostReads(TorchDispatchMode):
    """Counts the host reads of tensor values (``item()``, ``float()``...) made while entered."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.reads += func in READS
        return func(*args, **(kwargs or {}))


class Logged(Clipped):
    """The mixin's logging, the norm on the progress bar too; the host reads of each call of
    the mixin's clip_grad_norm_ (its clip, then its self.log) counted."""

    grad_norm_prog_bar = True

    def clip_grad_norm_(self, optimizer: Any, max_norm: Any, norm_type: float = 2.0) -> Tensor:
        with _HostReads() as counted:
            norm = super().clip_grad_norm_(optimizer, max_norm, norm_type)
        self.records[-1]["reads"] = counted.reads
        return norm


class Unlogged(Logged):
    """The same, with the mixin's logging switched off."""

    log_grad_norm = False


def _record_logged(module: Regression) -> None:
    """What the Trainer holds of the logged norm after this step, on this rank, by kind of
    metric (absent: None)."""
    trainer = module.trainer
    held = {
        "logged": trainer.callback_metrics.get(LOGGED),
        "to loggers": trainer.logged_metrics.get(LOGGED),
        "progress bar": trainer.progress_bar_metrics.get(LOGGED),
    }
    module.records[-1].update(
        {kind: value if value is None else bits(value) for kind, value in held.items()}
    )


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
    """Lightning's fit of ``model`` on this rank, the Trainer built as a user builds it (no
    logger unless ``trainer_args`` name one)."""
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
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **{"logger": False, **trainer_args},
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


def _logged_to_csv(switched_on: bool, save_dir: str) -> tuple[list[dict[str, Any]], list[dict]]:
    """A fit with Lightning's CSV logger, flushed at every step; this rank's records and the
    rows the logger wrote (rank 0's file; none on the other ranks)."""
    start_rank()
    logger = L.pytorch.loggers.CSVLogger(save_dir, name="logs", version=0)
    model = Logged() if switched_on else Unlogged()
    records = _fit(model, gradient_clip_val=MAX_NORM, logger=logger, log_every_n_steps=1)
    path = Path(logger.log_dir) / "metrics.csv"
    if dist.get_rank() != 0 or not path.exists():
        return records, []
    with path.open(newline="") as file:
        return records, list(csv.DictReader(file))


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
        # The norm the mixin logged through self.log, as the Trainer's callback_metrics hold it.
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


# --- a SpikePolicy through the mixin ---------------------------------------------------------

# The policy's warm-up: steps 0 to 2 enter its history, step 3 (the last) holds the spike.
WARMUP = 3
SPIKE_FACTOR = 1e3  # rank 3's TP shard of fc1's gradient made this many times larger


class _Spiked(Clipped):
    """The mixin with ``grad_spike_policy`` set, and a spike planted at step ``WARMUP``."""

    def __init__(self, policy: SpikePolicy) -> None:
        super().__init__()
        self.grad_spike_policy = policy

    def on_after_backward(self) -> None:
        if self.global_step == WARMUP and self.global_rank == PLANTED_RANK:
            grad = self.net.fc1.weight.grad
            (grad.to_local() if isinstance(grad, DTensor) else grad).mul_(SPIKE_FACTOR)


class Spiky(_Spiked):
    """What the scaler and the policy did at each step, too."""

    def on_train_batch_end(self, outputs: Any, batch: Any, index: int) -> None:
        super().on_train_batch_end(outputs, batch, index)
        _record_scaler(self)
        assert self.grad_spike_policy is not None
        self.records[-1]["spikes"] = self.grad_spike_policy.skipped_spikes


def _spiky(precision: str) -> list[dict[str, Any]]:
    """The policy given to this package's scaler, the scaler to Lightning's MixedPrecision."""
    start_rank()
    policy = SpikePolicy(warmup=WARMUP)
    MixedPrecision = L.pytorch.plugins.MixedPrecision
    if precision == "16-mixed":
        scaler = GradScaler("cpu", init_scale=1024.0, spikes=policy)
        plugin = MixedPrecision(precision, "cpu", scaler=scaler)
    else:
        plugin = MixedPrecision(precision, "cpu")  # which refuses a scaler for bf16-mixed
        plugin.scaler = GradScaler("cpu", scaling=False, spikes=policy)
    return _fit(Spiky(policy), gradient_clip_val=MAX_NORM, plugins=[plugin])


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_spike_policy_skips_a_planted_spike_on_every_rank(precision):
    """grad_spike_policy, and this package's scaler holding it as the plugin's (for bf16, set
    after the plugin is built): the step after the warm-up, whose gradient has a spike in rank
    3's TP shard, is skipped on all 4 ranks, no weight moves and the scale stays; every other
    step clips and steps; every step's norm is the materialised norm, logged as before."""
    runs = run_ranks(_spiky, precision)
    scale = 1024.0 if precision == "16-mixed" else 1.0
    for step in range(STEPS):
        norm = float.fromhex(same_on_every_rank([records[step]["norm"] for records in runs]))
        assert_norm(norm, runs[0][step]["materialised"])
        assert same_on_every_rank([records[step]["logged"] for records in runs]) == bits(norm)
        assert same_on_every_rank([records[step]["scale"] for records in runs]) == scale
        skipped = same_on_every_rank([records[step]["skipped"] for records in runs])
        spikes = same_on_every_rank([records[step]["spikes"] for records in runs])
        moved = [records[step]["before"] != records[step]["after"] for records in runs]
        if step == WARMUP:
            assert skipped and spikes == 1 and not any(moved)
        else:
            assert not skipped and spikes == 0 and all(moved)


def _float32() -> tuple[str, list[dict[str, Any]]]:
    """In float32: a policy that skips, refused; then an adaptive clip alone, with no
    gradient_clip_val."""
    start_rank()
    try:
        _fit(_Spiked(SpikePolicy(warmup=WARMUP)), gradient_clip_val=MAX_NORM)
        refused = "no error"
    except ValueError as error:
        refused = str(error)
    policy = SpikePolicy(skip=False, adaptive_clip="mean", warmup=WARMUP)
    return refused, _fit(_Spiked(policy))


def test_spike_policy_in_float32_clips_adaptively_and_refuses_to_skip():
    """Lightning's float32 plugin steps through no scaler: a policy that skips is refused on
    every rank, naming the plugins that work. An adaptive clip alone clips nothing during the
    warm-up and clips the spike to the mean of the warm-up's norms (ZClip's "mean" mode)."""
    runs = run_ranks(_float32)
    refused = same_on_every_rank([refused for refused, _ in runs])
    for fix in ('MixedPrecision("16-mixed"', "plugin.scaler = GradScaler", "skip=False"):
        assert fix in refused, refused
    fits = [records for _, records in runs]
    norms = []
    for step in range(STEPS):
        norms.append(float.fromhex(same_on_every_rank([r[step]["norm"] for r in fits])))
        assert_norm(norms[step], fits[0][step]["materialised"])
    clipped = [same_on_every_rank([r[step]["clipped"] for r in fits]) for step in range(STEPS)]
    for step in range(WARMUP):
        assert math.isclose(clipped[step], norms[step], rel_tol=1e-5)
    assert norms[WARMUP] > 10 * max(norms[:WARMUP])
    assert math.isclose(clipped[WARMUP], statistics.fmean(norms[:WARMUP]), rel_tol=1e-5)


@pytest.fixture(scope="module")
def csv_fits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list]:
    """The fits with Lightning's CSV logger, logging on and off: by switch, each rank's records
    (by rank) and the rows rank 0's logger wrote."""
    fits = {}
    for switch in ("on", "off"):
        runs = run_ranks(_logged_to_csv, switch == "on", str(tmp_path_factory.mktemp(switch)))
        fits[switch] = [[records for records, _ in runs], runs[0][1]]
    return fits


def test_mixin_logs_the_clips_norm_to_the_trainer_and_its_logger_on_every_step(csv_fits):
    """Every step's norm, the bits the clip returned: in the Trainer's metrics on every rank (for
    callbacks, for the loggers, and on the progress bar, as asked) and in the rows Lightning's
    CSV logger wrote on rank 0."""
    runs, rows = csv_fits["on"]
    rows = [row for row in rows if row.get(LOGGED)]
    assert all(len(records) == STEPS for records in runs) and len(rows) == STEPS, rows
    for step in range(STEPS):
        norm = same_on_every_rank([records[step]["norm"] for records in runs])
        for kind in ("logged", "to loggers", "progress bar"):
            assert same_on_every_rank([records[step][kind] for records in runs]) == norm, kind
        assert bits(float(rows[step][LOGGED])) == norm and int(rows[step]["step"]) == step


def test_mixin_switched_off_logs_nothing(csv_fits):
    """log_grad_norm = False: the clip clips as before, and no metric of the norm reaches the
    Trainer, its callbacks, its progress bar or its logger."""
    runs, rows = csv_fits["off"]
    assert all(len(records) == STEPS for records in runs)
    for step in range(STEPS):
        norm = float.fromhex(same_on_every_rank([records[step]["norm"] for records in runs]))
        assert_norm(norm, runs[0][step]["materialised"])
        clipped = same_on_every_rank([records[step]["clipped"] for records in runs])
        assert math.isclose(clipped, MAX_NORM, rel_tol=1e-4), (step, clipped)
        for kind in ("logged", "to loggers", "progress bar"):
            assert all(records[step][kind] is None for records in runs), kind
    assert not any(row.get(LOGGED) for row in rows), rows


def test_host_read_counter_sees_a_read():
    """The control of the check below: float() of a tensor is one host read."""
    with _HostReads() as counted:
        float(torch.tensor(1.5))
    assert counted.reads == 1


def test_mixin_logging_reads_nothing_on_the_host(csv_fits):
    """The mixin's clip_grad_norm_ reads the host as often with logging on as off, on every rank
    at every step (self.log keeps the tensor; the CSV logger reads it later, at its flush), and
    the norms are the same bits."""
    on, off = csv_fits["on"][0], csv_fits["off"][0]
    for step in range(STEPS):
        for rank in range(len(on)):
            assert on[rank][step]["reads"] == off[rank][step]["reads"], (step, rank)
            assert on[rank][step]["norm"] == off[rank][step]["norm"], (step, rank)


class _Unattached(MeshSafeGradientClipping, Regression):
    """The mixin on a LightningModule that no Trainer runs."""


@pytest.mark.parametrize(("name", "error"), [(None, TypeError), ("", ValueError)])
def test_mixin_refuses_a_metric_name_that_names_nothing_before_clipping(name, error):
    module = _Unattached()
    module.grad_norm_name = name
    # Gradients set by hand: autograd run in this process would break backward in the ranks
    # that later tests fork from it (torch's autograd engine is not fork-safe).
    for param in module.parameters():
        param.grad = torch.randn_like(param)
    before = [p.grad.clone() for p in module.parameters()]
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    with pytest.raises(error, match="grad_norm_name must be a non-empty str"):
        module.clip_grad_norm_(optimizer, MAX_NORM)
    assert module.last_grad_norm is None
    assert all(torch.equal(p.grad, g) for p, g in zip(module.parameters(), before, strict=True))


def test_mixin_listed_after_lightning_module_is_refused_at_class_definition():
    """Listed after LightningModule, the mixin's hook would be bypassed and torch's mixed-mesh
    error would follow: the class is refused when it is defined, naming the order that works."""
    with pytest.raises(TypeError, match=r"class Late\(MeshSafeGradientClipping, Regression\)"):

        class Late(Regression, MeshSafeGradientClipping):
            pass
