"""torchtune's ``full_finetune_distributed`` model setup with tensor parallelism (dp=2 x tp=2).

Run on 4 processes::

    torchrun --standalone --nproc-per-node 4 docs/examples/torchtune_tp.py               # CPU: gloo
    torchrun --standalone --nproc-per-node 4 docs/examples/torchtune_tp.py --device cuda  # 4 GPUs

The recipe's model setup with ``tensor_parallel_dim=2`` (``prepare_mha_for_tp``, its Llama 3 TP
plan, ``training.shard_model`` on the dp mesh) on a 2-layer Llama 3 from torchtune's builder, with
random weights and tokens in place of a checkpoint and a dataset, and the recipe's step with its
``torch.nn.utils.clip_grad_norm_`` line swapped for this package's: torch's raises on this layout
(torchtune's issue 2420).
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module
from torchtune import training
from torchtune.models.llama3 import base_llama_tp_plan, llama3

from credit.parallel.collectives import clip_grad_norm_
from credit.parallel.replicas import verify_replicas

VOCAB, SEQ, BATCH = 256, 32, 2


def tensor_parallel_llama3(mesh: DeviceMesh, device: str) -> nn.Module:
    """The recipe's ``_setup_model`` with ``tensor_parallel_dim=2`` on a (dp, tp) ``mesh``: a
    2-layer Llama 3 with the same seeded weights on every rank, TP'd, then FSDP2 on dp."""
    torch.manual_seed(0)
    with torch.device(device):
        model = llama3(
            vocab_size=VOCAB,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            embed_dim=64,
            max_seq_len=SEQ,
        )
    model = training.prepare_mha_for_tp(model, mesh["tp"])
    parallelize_module(model, mesh["tp"], parallelize_plan=base_llama_tp_plan())
    training.shard_model(
        model=model,
        shard_conditions=[partial(training.get_shard_conditions, names_to_match=None)],
        cpu_offload=False,
        reshard_after_forward=True,
        dp_mesh=mesh["dp"],
    )
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    mesh = init_device_mesh(args.device, (2, 2), mesh_dim_names=("dp", "tp"))
    model = tensor_parallel_llama3(mesh, args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(mesh["dp"].get_local_rank())  # data by dp rank
    for step in range(args.steps):
        tokens = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=generator).to(args.device)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        # --8<-- [start:clip]
        grad_norm = clip_grad_norm_(  # was: torch.nn.utils.clip_grad_norm_(
            model.parameters(),
            max_norm=0.5,  # float(self._clip_grad_norm)
        )
        # a plain tensor, the same on every rank: the recipe's full_tensor() branch never runs
        # --8<-- [end:clip]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
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
