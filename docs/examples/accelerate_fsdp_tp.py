"""accelerate with FSDP2 + tensor parallelism built by hand (dp=2 x tp=2), bf16 or fp16.

Run on 4 processes::

    torchrun --standalone --nproc-per-node 4 docs/examples/accelerate_fsdp_tp.py               # CPU, bf16
    torchrun --standalone --nproc-per-node 4 docs/examples/accelerate_fsdp_tp.py --device cuda  # 4 GPUs
    torchrun --standalone --nproc-per-node 4 docs/examples/accelerate_fsdp_tp.py --device cuda --fp16
    accelerate launch --multi_gpu --num_processes 4 docs/examples/accelerate_fsdp_tp.py    # CPU too

(without a saved ``accelerate config``, ``accelerate launch`` needs ``--multi_gpu`` to start 4
processes, on a CPU as on GPUs). accelerate's ``ParallelismConfig`` route builds its meshes on
GPUs only, and preparing a model that TP and FSDP2 were applied to wraps it in DDP, which refuses
the mixed meshes: the mesh, TP and FSDP2 are applied by hand and only the optimizer is prepared.
The clip and the scaler are this package's; every rank takes or skips each step together, and
the norm goes to the run's trackers through ``accelerator.log``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

# --8<-- [start:setup]
from accelerate import Accelerator
from accelerate.tracking import GeneralTracker
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from credit.parallel.amp import GradScaler
from credit.parallel.integrations.accelerate import clip_grad_norm_

# --8<-- [end:setup]
from credit.parallel.replicas import verify_replicas

DIM, HIDDEN, BATCH = 16, 64, 8


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(self.norm(x))))


class LastLogged(GeneralTracker):
    """A tracker that keeps what ``accelerator.log`` gave it last (a run would log to
    ``"tensorboard"`` or ``"wandb"``): the step lines print the logged norm."""

    name = "last_logged"
    requires_logging_directory = False

    def __init__(self) -> None:
        super().__init__()
        self.values: dict[str, float] = {}

    @property
    def tracker(self) -> dict[str, float]:
        return self.values

    def log(self, values: dict, step: int | None = None, **kwargs: object) -> None:
        self.values = dict(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--fp16", action="store_true", help="fp16 with loss scaling (GPUs)")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    device, fp16 = args.device, args.fp16
    torch.manual_seed(0)  # the same initial weights on every rank
    model = Net()
    plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}

    # --8<-- [start:recipe]
    # First the Accelerator: on a CPU, cpu=True makes it start the process group (gloo).
    tracker = LastLogged()  # or log_with="tensorboard", project_dir="runs"
    accelerator = Accelerator(
        cpu=device == "cpu", mixed_precision="fp16" if fp16 else "bf16", log_with=[tracker]
    )
    accelerator.init_trackers("accelerate_fsdp_tp")  # the trackers start on the main process
    mesh = init_device_mesh(device, (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model.to(accelerator.device), mesh["tp"], plan)
    fully_shard(model, mesh=mesh["dp"])

    # Before prepare(optimizer). fp16 scales the loss; bf16 only skips non-finite steps.
    accelerator.scaler = GradScaler(device, scaling=fp16)
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    # --8<-- [end:recipe]

    generator = torch.Generator().manual_seed(mesh["dp"].get_local_rank())  # data by dp rank
    for step in range(args.steps):
        x, y = (torch.randn(BATCH, DIM, generator=generator).to(accelerator.device) for _ in "xy")
        # --8<-- [start:loop]
        with accelerator.autocast():  # the model is not prepared: its forward is not autocast
            loss = F.mse_loss(model(x), y)
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            # log_as: accelerator.log({"grad_norm": norm}, step=step) on the main process.
            clip_grad_norm_(accelerator, model, max_norm=0.25, log_as="grad_norm", log_step=step)
        optimizer.step()  # the scaler's step: skipped on every rank together
        optimizer.zero_grad()
        # --8<-- [end:loop]
        if accelerator.is_main_process:  # where the trackers are: the norm they were given
            print(
                f"step {step}  loss {loss.item():.6f}  grad_norm {tracker.values['grad_norm']:.6f}"
                f"  skipped {optimizer.step_was_skipped}"
            )
    verify_replicas(model, optimizer.optimizer)  # every copy of every weight and AdamW state
    accelerator.print(
        f"done: {args.steps} steps on {accelerator.num_processes} processes "
        f"({accelerator.distributed_type.value}), replicas verified"
    )
    accelerator.end_training()


if __name__ == "__main__":
    main()
    # The run is over. On gloo, torch's worker threads can still be releasing the last
    # collective's tensors when Python shuts down, and taking the GIL then aborts the finished
    # run ("terminate called without an active exception"): leave without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
