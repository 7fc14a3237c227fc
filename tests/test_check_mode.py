"""The opt-in layout check: ranks that pass different gradient layouts get an error, not a crash.

Without the check, a count, shape or dtype mismatch across ranks makes gloo abort the process
(shown in test_faults.py) and NCCL hang. With ``check=True`` or ``CREDIT_PARALLEL_CHECK=1`` every
rank raises the same RuntimeError naming the first differing gradient, before any gradient is
touched, and the group keeps working. When the layouts agree the check costs a few small
collectives.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor.debug import CommDebugMode

from credit.parallel._common.layout_check import ENV_VAR, verify_same_layout
from credit.parallel.collectives import (
    allreduce_grads_avg,
    clip_grad_norm_,
    get_total_norm,
    total_grad_norm,
)
from credit.parallel.norm_report import grad_norm_report
from testbed.layouts import build, local_bytes
from testbed.world_layouts import WireRecorder

WORLD = 4
ODD_RANK = 3  # the rank whose layout differs
FUNCTIONS = ("allreduce_grads_avg", "total_grad_norm", "clip_grad_norm_")
KINDS = ("count", "shape", "dtype")


def _params(function: str) -> list[nn.Parameter]:
    """Parameters with gradients: plain ones (world group) to average, fsdp_tp ones to norm."""
    layout = "plain" if function == "allreduce_grads_avg" else "fsdp_tp"
    model = build(layout).model
    return [p for p in model.parameters() if p.grad is not None]


def _float64_copy(param: nn.Parameter) -> nn.Parameter:
    assert param.grad is not None
    copy = nn.Parameter(param.detach().to(torch.float64))
    copy.grad = param.grad.to(torch.float64)
    return copy


def _mismatched(params: list[nn.Parameter], kind: str) -> tuple[list[nn.Parameter], int]:
    """The odd rank's parameters for ``kind``, and the index of the first difference."""
    if kind == "count":
        return params[:-1], len(params) - 1
    if kind == "shape":  # two neighbours of different shapes swapped, as iterating a set would
        index = next(i for i in range(len(params) - 1) if params[i].shape != params[i + 1].shape)
        swapped = list(params)
        swapped[index], swapped[index + 1] = swapped[index + 1], swapped[index]
        return swapped, index
    return [*params[:1], _float64_copy(params[1]), *params[2:]], 1


def _call(function: str, params: list[nn.Parameter], check: bool | None) -> Tensor | None:
    grads = [p.grad for p in params]
    if function == "allreduce_grads_avg":
        allreduce_grads_avg(grads, None, check=check)
        return None
    if function == "total_grad_norm":
        return total_grad_norm(grads, 2.0, check=check)
    return clip_grad_norm_(params, 0.01, check=check)


def _mismatch_raises_everywhere(function: str, kind: str, via: str) -> dict:
    params = _params(function)
    mine, index = _mismatched(params, kind) if dist.get_rank() == ODD_RANK else (params, -1)
    watched = [p.grad for p in params] + [p.grad for p in mine]
    before = [local_bytes(g) for g in watched]
    previous = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = "1" if via == "env" else "0"
    try:
        with pytest.raises(RuntimeError) as raised:
            _call(function, mine, check=True if via == "argument" else None)
        unchanged = all(
            torch.equal(b, local_bytes(g)) for b, g in zip(before, watched, strict=True)
        )
        # The group keeps working: the agreed layout goes through, with the check on.
        result = _call(function, params, check=True if via == "argument" else None)
    finally:
        if previous is None:
            del os.environ[ENV_VAR]
        else:
            os.environ[ENV_VAR] = previous
    return {
        "message": str(raised.value),
        "unchanged": unchanged,
        "index": index,
        "shapes": [tuple(p.shape) for p in params],
        "result": None if result is None else result.item(),
    }


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("function", FUNCTIONS)
def test_mismatch_raises_on_every_rank_and_changes_nothing(ranks, function, kind):
    results = ranks.run(WORLD, _mismatch_raises_everywhere, function, kind, "argument")
    index = results[ODD_RANK]["index"]
    shapes = results[0]["shapes"]
    message = results[0]["message"]
    assert all(r["message"] == message for r in results), "ranks describe it differently"
    assert all(r["unchanged"] for r in results), "a gradient changed"
    assert len({r["result"] for r in results}) == 1, "the recovery call disagrees across ranks"
    assert message.startswith(f"{function}: ranks passed different gradient layouts")
    assert f"First difference at gradient {index} " in message
    assert "rank 0 has " in message and f"rank {ODD_RANK} has " in message
    if kind == "count":
        assert f"rank {ODD_RANK} has nothing" in message
        assert (
            f"rank 0 passed {len(shapes)} gradients, rank {ODD_RANK} passed {len(shapes) - 1})"
            in message
        )
    elif kind == "shape" and function != "allreduce_grads_avg":  # global shapes
        first, second = shapes[index], shapes[index + 1]
        assert re.search(rf"rank 0 has DTensor shape={re.escape(str(first))} ", message)
        assert re.search(rf"rank {ODD_RANK} has DTensor shape={re.escape(str(second))} ", message)
    elif kind == "shape":  # local shapes
        first, second = shapes[index], shapes[index + 1]
        assert f"rank 0 has local shape={first} " in message
        assert f"rank {ODD_RANK} has local shape={second} " in message
    else:
        assert re.search(r"rank 0 has .*dtype=torch\.float32", message)
        assert re.search(rf"rank {ODD_RANK} has .*dtype=torch\.float64", message)


@pytest.mark.parametrize("function", FUNCTIONS)
def test_environment_variable_turns_the_check_on(ranks, function):
    results = ranks.run(WORLD, _mismatch_raises_everywhere, function, "shape", "env")
    assert all("First difference at gradient" in r["message"] for r in results)
    assert all(r["unchanged"] for r in results)


def _collectives_with_and_without_check(function: str) -> dict[str, dict[str, int]]:
    """Per setting of the check, the collectives of a call, counted per operator and size of
    their process group."""
    params = _params(function)
    _call(function, params, False)  # the first call for a layout verifies it: count later ones
    counts = {}
    previous = os.environ.get(ENV_VAR)
    try:
        for label, check, env in (
            ("off", False, "0"),
            ("on", True, "0"),
            ("env", None, "1"),
            ("env overridden", False, "1"),
        ):
            os.environ[ENV_VAR] = env
            with WireRecorder() as wire:
                _call(function, params, check)
            keys = [f"{c.op} on {c.group}" for c in wire.collectives]
            counts[label] = {key: keys.count(key) for key in keys}
    finally:
        if previous is None:
            del os.environ[ENV_VAR]
        else:
            os.environ[ENV_VAR] = previous
    return counts


# Added by the check, each an all_reduce over the world (4 ranks) unless said: one of a few int64
# for averaging (MAX of the layout digest and of its negation); for the norms that one and the
# layout's proof, which runs on every checked call: the self-check's, then (FSDP2 + TP on
# (dp=2, tp=2)) the copies' full fingerprints within tp (2 ranks) and one all_reduce of their
# three flags; and one int64 first that hands a gradient one rank refuses (on the meta device)
# to every rank.
ALL_REDUCE = "c10d::allreduce_"
NORM_CHECK = {f"{ALL_REDUCE} on {WORLD}": 4, f"{ALL_REDUCE} on 2": 1}
CHECK_COLLECTIVES = {
    "allreduce_grads_avg": {f"{ALL_REDUCE} on {WORLD}": 1},
    "total_grad_norm": NORM_CHECK,
    "clip_grad_norm_": NORM_CHECK,
}


@pytest.mark.parametrize("function", FUNCTIONS)
def test_check_costs_small_collectives(ranks, function):
    counts = ranks.run(WORLD, _collectives_with_and_without_check, function)[0]
    off, on = counts["off"], counts["on"]
    added = {op: on.get(op, 0) - off.get(op, 0) for op in set(on) | set(off)}
    assert {op: n for op, n in added.items() if n} == CHECK_COLLECTIVES[function], counts
    assert counts["env"] == on
    assert counts["env overridden"] == off


def _verify_with_stages(odd_rank: int, differ: str) -> tuple[str | None, int]:
    """verify_same_layout with two pipeline stages of two ranks (stage = rank // 2).

    The stages pass different layouts by design; ``differ`` makes ``odd_rank`` differ from the
    other rank of its stage ("layout") or from every rank in its settings ("settings").
    """
    stage = dist.get_rank() // 2
    layout = [f"stage {stage} shape=(2,)"] * (stage + 1)
    settings = "norm_type=2.0"
    if dist.get_rank() == odd_rank:
        if differ == "layout":
            layout = [*layout[:-1], f"stage {stage} shape=(3,)"]
        elif differ == "settings":
            settings = "norm_type=1.0"
    message = None
    with CommDebugMode() as comm:
        try:
            verify_same_layout(layout, None, torch.device("cpu"), "test", settings, (stage, 2))
        except RuntimeError as error:
            message = str(error)
    return message, comm.get_total_counts()


def test_stages_are_compared_within_themselves(ranks):
    """Stages hold different gradients: no error, in one collective."""
    for message, collectives in ranks.run(WORLD, _verify_with_stages, -1, "none"):
        assert message is None
        assert collectives == 1


@pytest.mark.parametrize("odd_rank", [1, 2, 3])
def test_a_rank_differing_from_its_stage_raises_everywhere(ranks, odd_rank):
    results = ranks.run(WORLD, _verify_with_stages, odd_rank, "layout")
    messages = {message for message, _ in results}
    assert len(messages) == 1 and None not in messages, messages
    (message,) = messages
    stage = odd_rank // 2
    assert f"ranks of pipeline stage {stage} passed different gradient layouts" in message
    # the lowest rank of the stage is the reference, compared with the first rank that differs
    reference, other = 2 * stage, 2 * stage + 1
    shapes = {rank: "(3,)" if rank == odd_rank else "(2,)" for rank in (reference, other)}
    assert (
        f"rank {reference} has stage {stage} shape={shapes[reference]}, "
        f"rank {other} has stage {stage} shape={shapes[other]}"
    ) in message


def test_check_names_differing_arguments_across_stages(ranks):
    for message, _ in ranks.run(WORLD, _verify_with_stages, 2, "settings"):
        assert message is not None
        assert "ranks passed different arguments" in message
        assert "rank 0 has norm_type=2.0, rank 2 has norm_type=1.0" in message


# --- a gradient one rank refuses ---------------------------------------------------------------

REFUSING_RANK = 2


def _one_rank_refuses() -> list[tuple[str, str, str, bool]]:
    """Rank 2 alone passes a gradient on the meta device (to each norm, the clip and the report),
    or of an integer dtype (to total_grad_norm). Without the check it would raise alone while the others
    wait in the norm's all_reduce; with it every rank raises its error."""
    generator = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.zeros(4, 3)), nn.Parameter(torch.zeros(5))]
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)
    meta = nn.Parameter(torch.zeros(5, device="meta"))
    meta.grad = torch.ones(5, device="meta")
    odd = dist.get_rank() == REFUSING_RANK
    mine = [params[0], meta] if odd else params
    grads = [p.grad for p in mine]
    integer = [grads[0], torch.ones(5, dtype=torch.int64)] if odd else grads
    before = [local_bytes(p.grad) for p in params]
    calls: dict[str, Callable[[], object]] = {
        "total_grad_norm": lambda: total_grad_norm(grads, check=True),
        "get_total_norm": lambda: get_total_norm(grads, check=True),
        "clip_grad_norm_": lambda: clip_grad_norm_(mine, 0.01, check=True),
        "total_grad_norm integer": lambda: total_grad_norm(integer, check=True),
        "grad_norm_report": lambda: grad_norm_report(
            [(f"p{i}", p) for i, p in enumerate(mine)], check=True
        ),
    }
    results = []
    for name, call in calls.items():
        with pytest.raises((ValueError, TypeError)) as raised:
            call()
        unchanged = all(
            torch.equal(b, local_bytes(p.grad)) for b, p in zip(before, params, strict=True)
        )
        results.append((name, type(raised.value).__name__, str(raised.value), unchanged))
    alive = torch.ones(())
    dist.all_reduce(alive)
    assert alive.item() == WORLD
    return results


def test_a_gradient_one_rank_refuses_raises_on_every_rank(ranks):
    results = ranks.run(WORLD, _one_rank_refuses)
    assert all(r == results[0] for r in results), "the ranks raised different errors"
    for name, kind, message, unchanged in results[0]:
        function = name.split()[0]
        argument = "tensors" if function == "get_total_norm" else "grads"  # torch's names
        assert message.startswith(f"{function}: on rank {REFUSING_RANK}, {argument}[1] "), message
        if name.endswith("integer"):
            assert kind == "TypeError" and "has dtype torch.int64" in message, message
        else:
            assert kind == "ValueError" and "is on the meta device" in message, message
        assert message.endswith("No gradient was modified."), message
        assert unchanged, name
