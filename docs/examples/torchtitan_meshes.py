"""torchtitan's meshes (``ParallelDims``, dp_shard=2 x tp=2) and its clip swapped for this package's.

Run on 4 processes::

    torchrun --standalone --nproc-per-node 4 docs/examples/torchtitan_meshes.py               # CPU: gloo
    torchrun --standalone --nproc-per-node 4 docs/examples/torchtitan_meshes.py --device cuda  # 4 GPUs

torchtitan's trainer itself, with the clip swapped, is ``torchtitan_trainer.py``. This script
keeps what the clip sees: torchtitan's ``ParallelDims``
meshes (views unflattened from a 1-D world, ``spmd_backend="partial_dtensor"``), a small model
laid out in its style (the norm under SequenceParallel, the MLP Colwise/Rowwise, FSDP2 on its
``fsdp`` view), and the clip its trainer calls, under the same signature, with this package's
norm: one all_reduce per step where torchtitan's issues two.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torchtitan.distributed import parallel_dims

from credit.parallel.integrations.torchtitan import clip_grad_norm_
from credit.parallel.replicas import verify_replicas

DIM, HIDDEN, BATCH, SEQ = 16, 64, 4, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    # torchtitan builds its meshes on torchtitan.tools.utils.device_type: "cuda" on a machine
    # without an accelerator. Name the CPU here (ParallelDims also starts the process group).
    parallel_dims.device_type = args.device
    dims = parallel_dims.ParallelDims(
        dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, ep=1, world_size=4,
        spmd_backend="partial_dtensor",
    )  # fmt: skip
    dims.build_mesh()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = Block().to(args.device)
    plan = {
        "norm": SequenceParallel(),
        "fc1": ColwiseParallel(input_layouts=Shard(1)),
        "fc2": RowwiseParallel(output_layouts=Shard(1)),
    }
    parallelize_module(model, dims.get_mesh("tp"), plan)
    fully_shard(model, mesh=dims.get_mesh("fsdp"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dp_rank, tp_rank = dims.get_mesh("fsdp").get_local_rank(), dims.get_mesh("tp").get_local_rank()
    generator = torch.Generator().manual_seed(dp_rank)  # data by dp rank
    for step in range(args.steps):
        x, y = (torch.randn(BATCH, SEQ, DIM, generator=generator) for _ in "xy")
        half = slice(tp_rank * SEQ // 2, (tp_rank + 1) * SEQ // 2)  # SequenceParallel's input
        loss = F.mse_loss(model(x[:, half].to(args.device)), y[:, half].to(args.device))
        loss.backward()
        # --8<-- [start:clip]
        grad_norm = clip_grad_norm_(  # was: dist_utils.clip_grad_norm_(
            list(model.parameters()),
            0.25,  # self.config.training.max_norm
            foreach=True,
            pp_mesh=dims.get_optional_mesh("pp"),
            ep_enabled=dims.ep_enabled,
        )
        # --8<-- [end:clip]
        optimizer.step()
        optimizer.zero_grad()
        if dist.get_rank() == 0:
            print(f"step {step}  loss {loss.item():.6f}  grad_norm {grad_norm.item():.6f}")
    verify_replicas(model, optimizer)  # every copy of every weight and AdamW state
    if dist.get_rank() == 0:
        print(f"done: {args.steps} steps on 4 ranks, replicas verified")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # The run is over. On gloo, torch's worker threads can still be releasing the last
    # collective's tensors when Python shuts down, and taking the GIL then aborts the finished
    # run ("terminate called without an active exception"): leave without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
