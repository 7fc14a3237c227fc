"""What the tests of the copies' bound share (``test_copies_bound.py`` within one stage,
``test_copies_bound_pp.py`` across pipeline stages): the error they expect, the dtypes, the
pipeline stages' groups, and the no-false-alarm runs of real bf16 training whose copies are
legitimate.

Each training body trains :data:`STEPS` steps on every rank and returns how far the copies' local
norms were apart at most (relative to the largest) and the clip's norm of each step, as raw bytes.
With ``stages`` the world is split into pipeline stages (stage ``s``: ranks ``s * dp`` to
``s * dp + dp - 1``), each with parameters of its own, and the clip is given ``pp_group``.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

from credit.parallel._common.compat import local_tensor
from credit.parallel._norm.copies import tolerance
from credit.parallel.collectives import clip_grad_norm_
from credit.parallel.grad_sync import sync_replicated_gradients
from testbed.layouts import local_bytes, mesh

COPIES_DIFFER = "holds different values on ranks that the rank maps take for copies"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
STEPS = 12


def refused_everywhere(outcomes: list) -> None:
    """Every rank raised the same ValueError, naming copies that differ."""
    assert all(o is not None and o[0] == "ValueError" for o in outcomes), outcomes
    assert len({o[1] for o in outcomes}) == 1, "every rank raises the same message"
    assert COPIES_DIFFER in outcomes[0][1], outcomes[0][1]


def stage_of(stages: int) -> tuple[int, int, int]:
    """This rank's stage, its place in the stage, and the ranks a stage holds."""
    dp = dist.get_world_size() // stages
    return *divmod(dist.get_rank(), dp), dp


@functools.cache
def stage_groups(
    stages: int, use: str = ""
) -> tuple[tuple[ProcessGroup, ...], tuple[ProcessGroup, ...]]:
    """The pipeline group of each place in a stage (the ranks at that place in every stage) and
    the group of each stage's ranks; new ones for each ``use``, which meets them first. Every
    rank must ask together."""
    dp = dist.get_world_size() // stages
    pp = tuple(dist.new_group([s * dp + d for s in range(stages)]) for d in range(dp))
    within = tuple(dist.new_group(list(range(s * dp, s * dp + dp))) for s in range(stages))
    assert all(group is not None for group in pp + within)
    return pp, within  # type: ignore[return-value]


def legitimate_everywhere(results: list) -> None:
    """A training body's results: the copies stayed far within the bf16 tolerance (an eighth of
    it), and every rank returned the same norm at every step."""
    tau = tolerance(torch.bfloat16)
    for spread, norms in results:
        assert spread <= tau / 8, f"legitimate copies {spread:.2g} apart, tau {tau:.2g}"
        assert len(norms) == STEPS
        for step, norm in enumerate(norms):
            assert torch.equal(norm, results[0][1][step]), "the same norm on every rank"
            assert norm.numel() > 0


def relative_spread(norms: Tensor, group: ProcessGroup | None = None) -> float:
    """How far the copies' local norms ``norms`` (one per gradient) are apart over ``group``
    (default: the world), relative to the largest."""
    gathered = [torch.zeros_like(norms) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, norms, group=group)
    stacked = torch.stack(gathered).double()
    return float(((stacked.amax(0) - stacked.amin(0)) / stacked.amax(0).clamp_min(1e-30)).max())


def bf16_ddp_steps(stages: int = 1) -> list:
    """bf16 DDP over each stage's ranks."""
    stage, place, dp = stage_of(stages)
    pp_group = stage_group = None
    if stages > 1:
        pp_groups, stage_ranks = stage_groups(stages)
        pp_group, stage_group = pp_groups[place], stage_ranks[stage]
    torch.manual_seed(stage)  # DDP makes the stage's ranks copies of its lowest rank's model
    layers = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4)).bfloat16()
    model = DistributedDataParallel(layers, process_group=stage_group)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    spreads, norms = [], []
    for step in range(STEPS):
        batch = torch.randn(4 * dp, 16, generator=torch.Generator().manual_seed(step)).bfloat16()
        model(batch.chunk(dp)[place]).float().pow(2).mean().backward()
        local = torch.stack([p.grad.float().norm() for p in model.parameters()])
        spreads.append(relative_spread(local, stage_group))
        norms.append(local_bytes(clip_grad_norm_(model.parameters(), 1.0, pp_group=pp_group)))
        optimizer.step()
        optimizer.zero_grad()
    return [max(spreads), norms]


class SequenceParallelBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(x + self.down(torch.tanh(self.up(self.norm(x)))))


def bf16_fsdp_tp_sp_steps(stages: int = 1) -> list:
    """FSDP2 on dp=2 x TP with SequenceParallel on tp=2 inside each stage, bf16 parameters and
    reductions; the trainer's sequence (backward, sync_replicated_gradients, clip, step) on each
    tp rank's slice of the sequence. The head's tp peers are copies once synced: their spread is
    measured."""
    names = ("pp", "dp", "tp") if stages > 1 else ("dp", "tp")
    world = mesh((stages, 2, 2) if stages > 1 else (2, 2), names)
    *stage, dp_rank, tp_rank = world.get_coordinate()  # type: ignore[misc]
    torch.manual_seed(stage[0] if stage else 0)
    model = SequenceParallelBlock()
    plan = {
        "norm": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1)),
    }
    parallelize_module(model, world["tp"], plan)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    fully_shard(model, mesh=world["dp"], mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pp_group = world["pp"] if stages > 1 else None
    spreads, norms = [], []
    for step in range(STEPS):
        sequence = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(step))
        model(sequence.chunk(2)[dp_rank].chunk(2, dim=1)[tp_rank]).float().pow(2).mean().backward()
        sync_replicated_gradients(model, world["tp"])
        head = torch.stack([local_tensor(p.grad).float().norm() for p in model.head.parameters()])
        spreads.append(relative_spread(head, world["tp"].get_group()))
        norms.append(local_bytes(clip_grad_norm_(model.parameters(), 1.0, pp_group=pp_group)))
        optimizer.step()
        optimizer.zero_grad()
    return [max(spreads), norms]
