"""Lightning's ModelParallelStrategy (dp=2 x tp=2) with ``Trainer(gradient_clip_val=...)``.

Run with Lightning's own launcher, which starts the 4 processes itself::

    python docs/examples/lightning_fsdp_tp.py                           # 4 CPU processes: gloo
    python docs/examples/lightning_fsdp_tp.py --device cuda             # 4 GPUs: NCCL
    python docs/examples/lightning_fsdp_tp.py --precision bf16-mixed
    python docs/examples/lightning_fsdp_tp.py --precision 16-mixed      # this package's GradScaler

(or under ``torchrun --nproc-per-node 4``, which Lightning detects). ``configure_model`` applies
TP to the MLP and FSDP2 over the data-parallel dim: Lightning's own ``gradient_clip_val`` would
call torch's clip and raise the mixed-mesh error; the mixin clips with this package's instead,
and logs each step's norm through ``self.log`` (as ``grad_2.0_norm_total``), which each step's
line prints.
"""

from __future__ import annotations

import argparse
import os
import sys

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

from credit.parallel.amp import GradScaler
from credit.parallel.integrations.lightning import MeshSafeGradientClipping
from credit.parallel.replicas import verify_replicas

DIM, HIDDEN = 16, 64


# --8<-- [start:module]
class Model(MeshSafeGradientClipping, L.LightningModule):  # the mixin first
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.LayerNorm(DIM), nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM)
        )

    def configure_model(self) -> None:
        plan = {"1": ColwiseParallel(), "3": RowwiseParallel()}
        parallelize_module(self.net, self.device_mesh["tensor_parallel"], plan)
        fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: tuple[Tensor, Tensor], index: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def on_train_batch_end(self, outputs: dict, batch: object, index: int) -> None:
        # The mixin logged this step's clip norm with self.log: every logger given to the Trainer
        # receives it, and the Trainer's metrics hold it (a tensor, the same on every rank).
        grad_norm = self.trainer.callback_metrics["grad_2.0_norm_total"]
        # --8<-- [end:module]
        self.print(
            f"step {self.global_step - 1}  loss {outputs['loss'].item():.6f}  grad_norm {grad_norm.item():.6f}"
        )

    def on_train_end(self) -> None:
        verify_replicas(self, self.trainer.optimizers[0])  # every copy: the same bits
        self.print(f"done: {self.trainer.global_step} steps on 4 ranks, replicas verified")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--precision", choices=("32-true", "bf16-mixed", "16-mixed"), default="32-true"
    )
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    # Lightning's launcher gives the processes it starts every core, and the one it runs in
    # one thread: CPU kernels then round differently on different ranks, and the copies of the
    # LayerNorm drift apart by an ULP a step. The same thread count everywhere keeps them equal.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, DIM), torch.randn(64, DIM))
    # --8<-- [start:trainer]
    precision: dict = {"precision": args.precision}
    if args.precision == "16-mixed":  # ModelParallelStrategy refuses it; the plugin takes it
        scaler = GradScaler(args.device)
        precision = {"plugins": [MixedPrecision("16-mixed", args.device, scaler=scaler)]}
    trainer = L.Trainer(
        accelerator="gpu" if args.device == "cuda" else "cpu",
        devices=4,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2),
        gradient_clip_val=0.25,  # clipped by credit.parallel.collectives.clip_grad_norm_
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        **precision,
    )
    trainer.fit(Model(), DataLoader(data, batch_size=8))
    # --8<-- [end:trainer]


if __name__ == "__main__":
    main()
    # The run is over. On gloo, torch's worker threads can still be releasing the last
    # collective's tensors when Python shuts down, and taking the GIL then aborts the finished
    # run ("terminate called without an active exception"): leave without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
