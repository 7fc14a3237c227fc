"""torchtune 0.6 on 4 CPU ranks: the model setup of its ``full_finetune_distributed`` recipe with
tensor parallelism (``prepare_mha_for_tp``, ``parallelize_module`` with its Llama 3 TP plan,
``training.shard_model`` on the dp mesh) applied to a small Llama 3 built by
``torchtune.models.llama3.llama3`` (``docs/examples/torchtune_tp.py``'s), and the recipe's optimizer step: its
``torch.nn.utils.clip_grad_norm_`` line beside this package's clip swapped in.

The recipe itself is not run (it needs a checkpoint, a tokenizer and a dataset on disk); its
weights are the builder's seeded initialisation instead of a loaded checkpoint.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from harness import (
    MIXED_MESH_ERROR,
    assert_norm,
    bits,
    framework,
    load_example,
    materialised_norm,
    run_ranks,
    same_on_every_rank,
    start_rank,
)
from torch.distributed.device_mesh import init_device_mesh

from credit.parallel.collectives import clip_grad_norm_
from credit.parallel.replicas import verify_replicas

framework("torchtune")
EXAMPLE = load_example("torchtune_tp")

STEPS = 3
MAX_NORM = 0.05
VOCAB, SEQ, BATCH = EXAMPLE.VOCAB, EXAMPLE.SEQ, EXAMPLE.BATCH


def _recipe() -> dict[str, Any]:
    start_rank()
    # The recipe's _setup_model with tensor_parallel_dim=2 on 4 ranks, as the example builds it.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = EXAMPLE.tensor_parallel_llama3(mesh, "cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1234)
    dp_rank = mesh["dp"].get_local_rank()
    steps = []
    their_error = "no error"
    for step in range(STEPS):
        tokens = torch.randint(VOCAB, (2 * BATCH, SEQ + 1), generator=generator)
        mine = tokens[dp_rank * BATCH : (dp_rank + 1) * BATCH]
        logits = model(mine[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), mine[:, 1:].flatten()).backward()
        if step == 0:
            try:  # the recipe's own line
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            except RuntimeError as error:
                their_error = str(error)
        materialised = materialised_norm(model.parameters())
        # The line swapped in: a plain tensor, the same on every rank (no full_tensor() needed).
        grad_norm = clip_grad_norm_(model.parameters(), max_norm=MAX_NORM)
        steps.append(
            {
                "materialised": materialised,
                "norm": bits(grad_norm),
                "clipped": materialised_norm(model.parameters()),
            }
        )
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    verify_replicas(model, optimizer)
    return {"steps": steps, "their_error": their_error}


def test_torchtune_tp_recipe_clip_raises_ours_gives_the_materialised_norm():
    """torchtune's issue 2420: with TP the recipe's torch clip meets the norms (on the dp mesh
    only) beside the TP'd weights (on the (dp, tp) mesh) and raises on every rank. Ours gives
    the materialised norm, the same bits on every rank, and clips to max_norm; after the steps
    every copy of every parameter and AdamW state is bit-identical."""
    runs = run_ranks(_recipe)
    assert all(MIXED_MESH_ERROR in run["their_error"] for run in runs), runs[0]["their_error"]
    for step in range(STEPS):
        norm = float.fromhex(same_on_every_rank([run["steps"][step]["norm"] for run in runs]))
        assert_norm(norm, runs[0]["steps"][step]["materialised"])
        assert norm > MAX_NORM
        clipped = same_on_every_rank([run["steps"][step]["clipped"] for run in runs])
        assert math.isclose(clipped, MAX_NORM, rel_tol=1e-4)
