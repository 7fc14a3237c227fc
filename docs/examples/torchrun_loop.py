"""A plain training loop on FSDP2 + tensor parallelism, with loss scaling and clipping.

Run on 4 processes, dp=2 x tp=2::

    torchrun --standalone --nproc-per-node 4 docs/examples/torchrun_loop.py               # CPU: gloo
    torchrun --standalone --nproc-per-node 4 docs/examples/torchrun_loop.py --device cuda  # 4 GPUs: NCCL

A LayerNorm and a Colwise/Rowwise MLP: the MLP's weights live on the (dp, tp) mesh, the
LayerNorm's on the dp mesh, where ``torch.nn.utils.clip_grad_norm_`` raises. The loop swaps in
this package's clip and GradScaler; rank 0 prints each step's loss, gradient norm and scale.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from credit.parallel.amp import GradScaler
from credit.parallel.collectives import clip_grad_norm_
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


def train(device: str, steps: int, max_norm: float) -> None:
    mesh = init_device_mesh(device, (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)  # the same initial weights on every rank
    model = Net().to(device)
    parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(mesh["dp"].get_local_rank())  # data by dp rank

    # --8<-- [start:loop]
    # fp16; GradScaler(device, scaling=False) only skips the non-finite steps (bf16)
    scaler = GradScaler(device)
    for step in range(steps):
        x, y = (torch.randn(BATCH, DIM, generator=generator).to(device) for _ in range(2))
        with torch.autocast(device, dtype=torch.float16, enabled=device == "cuda"):
            loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        norm = clip_grad_norm_(model, max_norm=max_norm)  # the model: errors name its parameters
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        # --8<-- [end:loop]
        if dist.get_rank() == 0:
            print(
                f"step {step}  loss {loss.item():.6f}  grad_norm {norm.item():.6f}  "
                f"scale {scaler.get_scale():g}"
            )
    verify_replicas(model, optimizer)  # every copy of every weight and AdamW state: the same bits
    if dist.get_rank() == 0:
        print(f"done: {steps} steps on 4 ranks, replicas verified")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--max-norm", type=float, default=0.25)
    args = parser.parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        train(args.device, args.steps, args.max_norm)
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
