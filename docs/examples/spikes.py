"""Gradient spikes on FSDP2 + TP: skipped steps and an adaptive clip, alike on every rank.

Run on 4 processes, dp=2 x tp=2::

    torchrun --standalone --nproc-per-node 4 docs/examples/spikes.py               # CPU: gloo
    torchrun --standalone --nproc-per-node 4 docs/examples/spikes.py --device cuda  # 4 GPUs: NCCL

A LayerNorm and a Colwise/Rowwise MLP, trained with AdamW and a learning-rate warm-up in bf16's
way (``GradScaler(scaling=False)``: nothing scaled, a NaN or inf skipped). A
:class:`~credit.parallel.spikes.SpikePolicy` takes the clip's place: it skips a step whose
gradient norm or loss lies more than 6 standard deviations above its moving average, and clips a
norm more than 2.5 above it to a bound that follows the norm (ZClip's adaptive clip). Two events
are planted in dp rank 1's batch: at ``--spike-step`` its targets are multiplied by
``--spike-scale`` (a spike: every rank skips the step, the schedule waits, the history does not
take it in); at ``--bump-step`` they are shifted by ``--bump-shift`` (a bump: clipped, and taken).
After ``--resume-step`` the scaler's and the policy's states go through ``torch.save`` into new
objects, as a resumed run loads them. Rank 0 prints every step; at the end every copy of every
weight and AdamW state is proven bit-identical.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from credit.parallel.amp import GradScaler
from credit.parallel.replicas import verify_replicas
from credit.parallel.spikes import SpikePolicy

DIM, HIDDEN, BATCH = 16, 64, 64
LR, LR_WARMUP = 1e-2, 10
MAX_NORM = 5.0  # a fixed ceiling under the adaptive clip


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(self.norm(x))))


def resumed(
    scaler: GradScaler, spikes: SpikePolicy, args: argparse.Namespace
) -> tuple[GradScaler, SpikePolicy]:
    """The scaler and policy a run resumed from their checkpoint builds, after ``update()`` (the
    model and optimizer, which ``torch.distributed.checkpoint`` would save, are left as they are).

    Returns:
        A new scaler holding a new policy, both loaded from the states of ``scaler`` and ``spikes``.
    """
    buffer = io.BytesIO()
    torch.save({"scaler": scaler.state_dict(), "spikes": spikes.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    spikes = SpikePolicy(adaptive_clip="zscore", warmup=args.warmup)  # the run's settings
    spikes.load_state_dict(saved["spikes"])
    scaler = GradScaler(args.device, scaling=False, spikes=spikes)
    scaler.load_state_dict(saved["scaler"])
    return scaler, spikes


def batch(
    generator: torch.Generator, step: int, mesh: DeviceMesh, args: argparse.Namespace
) -> tuple[Tensor, Tensor]:
    """This dp rank's batch (tp peers draw the same); dp rank 1's targets scaled at the planted
    spike, shifted at the planted bump."""
    x, y = (torch.randn(BATCH, DIM, generator=generator) for _ in range(2))
    if mesh["dp"].get_local_rank() == 1:
        if step == args.spike_step:
            y = y * args.spike_scale
        if step == args.bump_step:
            y = y + args.bump_shift
    return x.to(args.device), y.to(args.device)


def train(
    args: argparse.Namespace,
) -> tuple[GradScaler, SpikePolicy, nn.Module, torch.optim.Optimizer]:
    """Train for ``args.steps`` steps; return the scaler, the policy, the model and the optimizer."""
    device = args.device
    mesh = init_device_mesh(device, (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)  # the same initial weights on every rank
    model = Net().to(device)
    parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda n: min(1.0, (n + 1) / LR_WARMUP)
    )
    generator = torch.Generator().manual_seed(mesh["dp"].get_local_rank())  # data by dp rank

    # --8<-- [start:step]
    # skip a step whose norm or loss z-score exceeds 6, clip a norm whose z-score exceeds 2.5
    spikes = SpikePolicy(adaptive_clip="zscore", warmup=args.warmup)
    scaler = GradScaler(device, scaling=False, spikes=spikes)  # bf16: nothing scaled
    for step in range(args.steps):
        x, y = batch(generator, step, mesh, args)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        norm = spikes.clip_grad_norm_(model, max_norm=MAX_NORM, loss=loss)
        scaler.step(optimizer)  # skipped on every rank when the policy decided a spike
        scaler.update()  # the policy's histories take the step in, unless it was skipped
        optimizer.zero_grad()
        if not scaler.last_step_skipped:  # the same on every rank
            scheduler.step()
        # --8<-- [end:step]
        if dist.get_rank() == 0:
            print(_step_line(step, norm, spikes, scaler, scheduler))
        if step == args.resume_step:
            scaler, spikes = resumed(scaler, spikes, args)
    return scaler, spikes, model, optimizer


def _step_line(
    step: int,
    norm: Tensor,
    spikes: SpikePolicy,
    scaler: GradScaler,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> str:
    """Rank 0's line for a step: the world's loss (the policy averaged it), the norm before the
    clip, the z-scores (NaN during the warm-up), the clip's bound and the learning rate."""
    figures = {name: float(value) for name, value in spikes.metrics().items()}
    line = (
        f"step {step}  loss {figures['loss']:.6f}  grad_norm {norm.item():.6f}  "
        f"norm_z {figures['norm_z']:.2f}  loss_z {figures['loss_z']:.2f}  "
        f"clip_bound {figures['clip_bound']:.4g}  lr {scheduler.get_last_lr()[0]:.4g}"
    )
    return line + ("  SKIPPED" if scaler.last_step_skipped else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=8, help="values before the policy decides")
    parser.add_argument("--spike-step", type=int, default=16)
    parser.add_argument("--spike-scale", type=float, default=100.0)
    parser.add_argument("--bump-step", type=int, default=20)
    parser.add_argument("--bump-shift", type=float, default=0.7)
    parser.add_argument("--resume-step", type=int, default=12)
    args = parser.parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")  # the skip's report
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        scaler, spikes, model, optimizer = train(args)
        verify_replicas(model, optimizer)  # every copy of every weight and AdamW state
        skipped = spikes.skipped_spikes
        if args.warmup <= args.spike_step < args.steps and skipped < 1:
            raise RuntimeError(f"the spike planted at step {args.spike_step} was not skipped")
        if dist.get_rank() == 0:
            print(
                f"done: {args.steps} steps on 4 ranks, {skipped} skipped as spikes "
                f"({scaler.skipped_steps} skipped in all), replicas verified"
            )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # The run is over. On gloo, torch's worker threads can still be releasing the last
    # collective's tensors when Python shuts down, and taking the GIL then aborts the finished
    # run ("terminate called without an active exception"): leave without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
