"""Faults: non-finite gradients, a rank that dies mid-sync, and a layout mismatch left unchecked.

Non-finite norms run in the shared pool. The two process faults run in processes started here,
with their own TCPStore on 127.0.0.1 and a 5 s process-group timeout, because they kill a rank
(or gloo kills it) and must not take the shared pool down with them.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from credit.parallel._common.compat import local_tensor
from credit.parallel._common.launch import host_store
from credit.parallel.collectives import allreduce_grads_avg, clip_grad_norm_, total_grad_norm
from credit.parallel.norm_report import grad_norm_report
from testbed.layouts import build, full_grads, same_bits_everywhere

HOST = "127.0.0.1"
PROCESS_GROUP_TIMEOUT_S = 5.0
JOIN_DEADLINE_S = 120.0  # far past the group timeout: only a real hang reaches it
NONFINITE_RANK = 3  # (dp=1, tp=1) of the (2, 2) mesh


# --- non-finite norms (shared pool) -------------------------------------------------------------


def _bits(tensor: Tensor) -> Tensor:
    local = local_tensor(tensor)
    return local.detach().clone().contiguous().view(-1).view(torch.uint8)


def _poison_one_shard(model: nn.Module, value: float) -> str:
    """Put ``value`` into one TP-sharded gradient, on NONFINITE_RANK's local shard only.

    The gradient is sharded on both dims of the (dp, tp) mesh, so this rank's shard is counted
    by this rank alone: the norm sees the value only through the cross-rank reduction.
    """
    name, param = next(
        (n, p)
        for n, p in model.named_parameters()
        if isinstance(p.grad, DTensor) and p.grad.device_mesh.ndim == 2
    )
    assert param.grad is not None and param.grad._local_tensor.numel() > 0
    if dist.get_rank() == NONFINITE_RANK:
        param.grad._local_tensor.view(-1)[0] = value
    return name


def _clip_refusing_nonfinite(
    params: list[nn.Parameter], norm_type: float
) -> tuple[str | None, bool]:
    """Clip with ``error_if_nonfinite``: (the error's message or None, no gradient changed)."""
    before = [_bits(p.grad) for p in params]
    raised = None
    try:
        clip_grad_norm_(params, 1.0, norm_type, error_if_nonfinite=True)
    except RuntimeError as error:
        raised = str(error)
    unchanged = all(torch.equal(b, _bits(p.grad)) for b, p in zip(before, params, strict=True))
    return raised, unchanged


def _nonfinite_norm(value: float, norm_type: float) -> dict:
    model = build("fsdp_tp").model
    poisoned = _poison_one_shard(model, value)
    params = [p for p in model.parameters() if p.grad is not None]
    raised, unchanged = _clip_refusing_nonfinite(params, norm_type)
    norm = total_grad_norm([p.grad for p in params], norm_type)
    materialised = [g.clone() for g in full_grads(model)]
    reference = [nn.Parameter(torch.zeros(g.shape)) for g in materialised]
    for param, grad in zip(reference, materialised, strict=True):
        param.grad = grad
    torch_norm = torch.nn.utils.clip_grad_norm_(reference, 1.0, norm_type)
    clipped_norm = clip_grad_norm_(params, 1.0, norm_type)
    clipped_like_torch = True
    for ours, theirs in zip(full_grads(model), reference, strict=True):
        try:
            torch.testing.assert_close(ours, theirs.grad, rtol=0, atol=0, equal_nan=True)
        except AssertionError:
            clipped_like_torch = False
    return {
        "poisoned": poisoned,
        "raised": raised,
        "unchanged": unchanged,
        "norm": float(norm),
        "torch_norm": float(torch_norm),
        "clipped_norm": float(clipped_norm),
        "same_bits": same_bits_everywhere(norm),
        "clipped_like_torch": clipped_like_torch,
    }


@pytest.mark.parametrize(
    ("value", "norm_type"),
    [
        (math.inf, 2.0),
        (math.nan, 2.0),
        (math.inf, math.inf),
        (math.nan, math.inf),  # gloo's MAX alone would drop a NaN held by any rank but the first
    ],
)
def test_nonfinite_shard_on_one_rank(ranks, value, norm_type):
    results = ranks.run(4, _nonfinite_norm, value, norm_type)
    for rank, result in enumerate(results):
        # error_if_nonfinite: every rank raises, and no gradient changed
        assert result["raised"] is not None, f"rank {rank} did not raise"
        assert "is non-finite" in result["raised"]
        assert result["unchanged"], f"rank {rank}: a gradient changed"
        # without it: the non-finite norm on every rank, as torch gives on the full gradients
        expected = "nan" if math.isnan(value) else "inf"
        assert str(result["norm"]) == expected, result
        assert str(result["torch_norm"]) == expected, result
        assert str(result["clipped_norm"]) == expected, result
        assert result["same_bits"]
        assert result["clipped_like_torch"], f"rank {rank}: clipped gradients differ from torch"


# Copies of a shard that another rank also holds: under the old ownership rule only one rank
# counted each, so a value that diverged on another copy was invisible. Each is planted on one
# rank only, in the (dp=2, tp=2) "fsdp_tp" layout or the "tp" layout (plain grads beside TP).
COPIES = {
    # a plain gradient (replicated on every rank), on the last rank
    "plain gradient on the last rank": ("tp", 3, lambda g: not isinstance(g, DTensor)),
    # a dp-sharded gradient (FSDP2 only), on the tp peer that holds the second copy
    "dp shard on a tp peer": ("fsdp_tp", 1, lambda g: g.device_mesh.ndim == 1),
    # a Replicate placement (the rowwise bias), on the tp rank that repeats the shard
    "replicated shard on tp rank 1": ("fsdp_tp", 3, lambda g: "Replicate" in str(g.placements)),
}


def _nonfinite_in_a_copy(where: str, value: float, norm_type: float) -> dict:
    layout, rank, select = COPIES[where]
    model = build(layout).model
    params = [p for p in model.parameters() if p.grad is not None]
    grad = next(p.grad for p in params if select(p.grad) and local_tensor(p.grad).numel() > 0)
    if dist.get_rank() == rank:
        local_tensor(grad).view(-1)[0] = value
    raised, unchanged = _clip_refusing_nonfinite(params, norm_type)
    norm = total_grad_norm([p.grad for p in params], norm_type)
    report = grad_norm_report(model.named_parameters(), norm_type)
    return {
        "raised": raised,
        "unchanged": unchanged,
        "norm": str(float(norm)),
        "report": str(report["total"]),
        "same_bits": same_bits_everywhere(norm),
    }


@pytest.mark.parametrize("where", COPIES)
@pytest.mark.parametrize(
    ("value", "norm_type"), [(math.nan, 2.0), (math.inf, 1.0), (math.nan, math.inf)]
)
def test_a_nonfinite_copy_reaches_every_rank(ranks, where, value, norm_type):
    expected = "nan" if math.isnan(value) else "inf"
    for rank, result in enumerate(ranks.run(4, _nonfinite_in_a_copy, where, value, norm_type)):
        assert result["raised"] is not None and "is non-finite" in result["raised"], rank
        assert result["unchanged"], f"rank {rank}: a gradient changed"
        assert result["norm"] == result["report"] == expected, (rank, result)
        assert result["same_bits"]


# --- processes started here ---------------------------------------------------------------------


def _exit_mid_average(rank: int, world: int) -> str:
    """Six gradients, each its own all_reduce; the last rank leaves after the third."""
    grads = [torch.full((300,), float(rank + i)) for i in range(6)]
    cap_mb = 200 * 4 / 2**20  # below one gradient: each is reduced on its own, in order
    for layout in (grads[:3], grads):  # verified on every rank: later calls are not checked
        allreduce_grads_avg(layout, None, bucket_cap_mb=cap_mb)
    if rank == world - 1:
        allreduce_grads_avg(grads[:3], None, bucket_cap_mb=cap_mb)
        os._exit(17)
    allreduce_grads_avg(grads, None, bucket_cap_mb=cap_mb)
    return "finished"


def _exit_before_clip(rank: int, world: int) -> str:
    """A finished sync, then the last rank leaves before clip_grad_norm_'s all_reduce."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    world_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    param = nn.Parameter(distribute_tensor(torch.ones(8, 3), world_mesh, [Shard(0)]))
    param.grad = distribute_tensor(torch.ones(8, 3), world_mesh, [Shard(0)])
    allreduce_grads_avg([torch.ones(4)], None)
    if rank == world - 1:
        os._exit(17)
    clip_grad_norm_([param], 1.0)
    return "finished"


def _stall_in_average(rank: int, world: int, out_dir: Path) -> str:
    """The last rank stays alive but never joins the sync (stuck elsewhere, as in a hang)."""
    grads = [torch.ones(16)]
    if rank == world - 1:
        deadline = time.monotonic() + 6 * PROCESS_GROUP_TIMEOUT_S
        while time.monotonic() < deadline and not all(
            (out_dir / f"rank{r}.json").exists() for r in range(world - 1)
        ):
            time.sleep(0.1)
        os._exit(17)
    allreduce_grads_avg(grads, None)
    return "finished"


def _unchecked_mismatch(rank: int, world: int) -> str:
    """Ranks pass gradients of different sizes, with the check off, after the first call for
    each layout verified it (a layout that changes on some ranks only)."""
    for size in (5, 7):
        allreduce_grads_avg([torch.ones(size)], None, check=False)
    allreduce_grads_avg([torch.ones(5 + 2 * rank)], None, check=False)
    return "finished"


SCENARIOS: dict[str, Callable[..., str]] = {
    "exit mid average": _exit_mid_average,
    "stall in average": _stall_in_average,
    "exit before clip": _exit_before_clip,
    "unchecked mismatch": _unchecked_mismatch,
}


def _scenario_main(rank: int, world: int, port: int, scenario: str, out_dir: str) -> None:
    out = Path(out_dir)
    stderr = os.open(out / f"rank{rank}.stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(stderr, 2)  # gloo's abort message is written to fd 2
    torch.set_num_threads(1)
    store = dist.TCPStore(HOST, port, world, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=PROCESS_GROUP_TIMEOUT_S),
    )
    start = time.monotonic()
    try:
        body = SCENARIOS[scenario]
        extra = (out,) if body is _stall_in_average else ()
        outcome = {"returned": body(rank, world, *extra)}
    except Exception as error:
        outcome = {"raised": [c.__name__ for c in type(error).__mro__], "message": str(error)}
    outcome["seconds"] = time.monotonic() - start
    (out / f"rank{rank}.json").write_text(json.dumps(outcome))
    sys.stderr.flush()
    os._exit(0)  # skip destroy_process_group: the group is broken


def _run_scenario(scenario: str, world: int, out_dir: Path) -> dict[int, dict]:
    """Start ``world`` fresh processes on ``scenario``; each rank's exit code and outcome."""
    store = host_store(world, HOST)
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_scenario_main, args=(rank, world, store.port, scenario, str(out_dir)))
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + JOIN_DEADLINE_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
    for rank in hung:
        procs[rank].kill()
        procs[rank].join()
    assert not hung, f"{scenario}: ranks {hung} hung past {JOIN_DEADLINE_S} s"
    results = {}
    for rank, proc in enumerate(procs):
        outcome_file = out_dir / f"rank{rank}.json"
        outcome = json.loads(outcome_file.read_text()) if outcome_file.exists() else {}
        outcome["exitcode"] = proc.exitcode
        outcome["stderr"] = (out_dir / f"rank{rank}.stderr").read_text(errors="replace")
        results[rank] = outcome
    return results


@pytest.mark.slow
@pytest.mark.parametrize(
    ("scenario", "world"),
    [("exit mid average", 3), ("exit before clip", 3), ("stall in average", 2)],
)
def test_survivors_raise_when_a_rank_dies_or_stalls(tmp_path, scenario, world):
    """A dead peer is seen at once (its sockets close); a stalled one at the group's timeout."""
    results = _run_scenario(scenario, world, tmp_path)
    assert results[world - 1]["exitcode"] == 17
    for rank in range(world - 1):
        outcome = results[rank]
        assert outcome["exitcode"] == 0, outcome["stderr"][-2000:]
        assert "raised" in outcome, f"rank {rank} finished although a peer died: {outcome}"
        assert "RuntimeError" in outcome["raised"], outcome
        if scenario == "stall in average":
            assert "Timed out" in outcome["message"] or "timeout" in outcome["message"].lower()


@pytest.mark.slow
def test_unchecked_layout_mismatch_aborts_the_process(tmp_path):
    """The reason for the check mode; this fails the day gloo stops aborting on a mismatch."""
    results = _run_scenario("unchecked mismatch", 2, tmp_path)
    aborted = [r for r, outcome in results.items() if outcome["exitcode"] == -signal.SIGABRT]
    assert aborted, {r: (o["exitcode"], o["stderr"][-500:]) for r, o in results.items()}
    assert any("mismatch" in results[r]["stderr"] for r in aborted)
