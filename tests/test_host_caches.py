"""What a norm keeps between calls to spare its host work never outlives the layout it was learned for.

A call finds what this rank holds of its gradients (``holdings.holdings``) in one lookup per list
of layouts, and checks the gradients it is handed on every call (``inputs.local_refusal``, sets
of layouts, dtypes and meta flags read first). Both must see a gradient of the same list object
replaced by one of another shape, dtype, device or placement, a list mutated in place, a None
entry, and a list that returns to a layout seen before. Each case runs on two real gloo ranks that
hold the same gradients (replicas), so the norm is torch's:

- holdings: oracle, the layout read off each gradient itself (its shape, dtype, device, number
  of elements, and a DTensor's placements), on every call of one list object mutated between
  calls; a layout seen before gives the same holdings as the first time;
- the norm and the clip: oracle, ``torch.nn.utils.get_total_norm`` and torch's clip of clones,
  the same bits and dtype, on every call; a gradient no norm takes (an integer, a meta or a
  sparse one) swapped in raises torch's kind of error naming its place, with no gradient
  modified, and the list swapped back gives torch's bits again.

The refusal's first offender is also checked in one process, where several gradients are refused.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from credit.parallel._common import holdings
from credit.parallel._common.inputs import check_grads, tensor_list
from credit.parallel.collectives import clip_grad_norm_, total_grad_norm
from testbed.layouts import error_of, mesh, same_bits_everywhere


def _seeded(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> Tensor:
    """The same values on every rank: replicas."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(dtype)


def _layout(grad: Tensor) -> tuple:
    """The oracle: what a holding must say of ``grad``, read off the tensor itself."""
    if isinstance(grad, DTensor):
        local = grad.to_local()
        head = f"DTensor shape={tuple(grad.shape)} dtype={grad.dtype} placements={grad.placements}"
        return head, local.dtype, local.device, local.numel(), grad.numel()
    head = f"tensor shape={tuple(grad.shape)} dtype={grad.dtype}"
    return head, grad.dtype, grad.device, grad.numel(), grad.numel()


def _held(grads: list[Tensor]) -> list[tuple]:
    found = holdings.holdings(grads)
    return [
        (h.description[: len(_layout(g)[0])], h.dtype, h.device, h.local_numel, h.global_numel)
        for h, g in zip(found, grads, strict=True)
    ]


def _holdings_follow_one_list() -> list[bool]:
    """One list object, mutated between calls: the holdings of each call against the oracle."""
    line = mesh((2,), ("dp",))
    grads = [_seeded(4, 8), _seeded(8, seed=1), _seeded(3, 3, dtype=torch.float64, seed=2)]
    first = holdings.holdings(grads)
    first_layouts = list(grads)
    seen = [_held(grads) == [_layout(g) for g in grads]]
    swaps = [
        (1, _seeded(8, dtype=torch.float64, seed=3)),  # dtype
        (0, _seeded(8, 4, seed=4)),  # shape, the same number of elements
        (2, torch.empty(3, 3, dtype=torch.float64, device="meta")),  # device
        (1, DTensor.from_local(_seeded(4), line, [Shard(0)], run_check=False)),  # a DTensor
        (1, DTensor.from_local(_seeded(4), line, [Replicate()], run_check=False)),  # placement
        (1, DTensor.from_local(_seeded(4, seed=5), line, [Shard(0)], run_check=False)),
    ]
    for index, grad in swaps:
        grads[index] = grad
        seen.append(_held(grads) == [_layout(g) for g in grads])
    grads.append(_seeded(2, seed=6))  # the list mutated in place
    seen.append(_held(grads) == [_layout(g) for g in grads])
    del grads[0]
    seen.append(_held(grads) == [_layout(g) for g in grads])
    grads[:] = [_seeded(4, 8, seed=7), _seeded(8, seed=8), _seeded(3, 3, dtype=torch.float64)]
    again = holdings.holdings(grads)  # the first layouts, other tensors: found, not rebuilt
    seen.append(_held(grads) == [_layout(g) for g in first_layouts])
    seen.append(all(a is b for a, b in zip(again, first, strict=True)))
    # A list of DTensors only, each swapped for one of another placement, dtype or shape.
    dtensors = [DTensor.from_local(_seeded(4, seed=s), line, [Shard(0)]) for s in range(2)]
    seen.append(_held(dtensors) == [_layout(g) for g in dtensors])
    for index, grad in [
        (0, DTensor.from_local(_seeded(4), line, [Replicate()], run_check=False)),
        (1, DTensor.from_local(_seeded(4, dtype=torch.float64), line, [Shard(0)])),
        (1, DTensor.from_local(_seeded(2, 2), line, [Shard(0)])),
    ]:
        dtensors[index] = grad
        seen.append(_held(dtensors) == [_layout(g) for g in dtensors])
    return seen


def test_holdings_follow_a_list_mutated_between_calls(ranks):
    for rank, seen in enumerate(ranks.run(2, _holdings_follow_one_list)):
        assert all(seen), f"rank {rank}: stale holdings at step {seen.index(False)}"


def _torch_norm_and_clip(grads: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
    """torch's norm of ``grads`` and its clip of their clones (to 0.5)."""
    clones = [g.detach().clone() for g in grads]
    total = torch.nn.utils.get_total_norm(clones)
    params = [nn.Parameter(torch.empty_like(c)) for c in clones]
    for param, clone in zip(params, clones, strict=True):
        param.grad = clone
    torch.nn.utils.clip_grads_with_norm_(params, 0.5, total)
    return total, [p.grad for p in params]


def _same(a: Tensor, b: Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _norm_and_clip_follow_one_list() -> list:
    """One list of gradients and one of parameters, each mutated between calls."""
    grads = [_seeded(4, 8), _seeded(8, seed=1), _seeded(5, seed=2)]
    results = []
    for index, grad in [
        (None, None),
        (1, _seeded(8, dtype=torch.float64, seed=3)),  # a second dtype: two groups
        (0, _seeded(8, 4, seed=4)),  # another shape
        (2, _seeded(7, dtype=torch.bfloat16, seed=5)),
        (1, _seeded(8, seed=6)),
    ]:
        if index is not None:
            grads[index] = grad
        expected, _ = _torch_norm_and_clip(grads)
        ours = total_grad_norm(grads)
        results.append(_same(ours, expected) and bool(same_bits_everywhere(ours)))
        params = [nn.Parameter(torch.empty_like(g)) for g in grads]
        for param, g in zip(params, grads, strict=True):
            param.grad = g.clone()
        expected_total, clipped = _torch_norm_and_clip([p.grad for p in params])
        total = clip_grad_norm_(params, 0.5)
        results.append(
            _same(total, expected_total)
            and all(_same(p.grad, c) for p, c in zip(params, clipped, strict=True))
        )
    results.append(_same(total_grad_norm([*grads[:1], None, *grads[1:]]), expected))
    return results


def test_norm_and_clip_follow_a_list_mutated_between_calls(ranks):
    for rank, results in enumerate(ranks.run(2, _norm_and_clip_follow_one_list)):
        assert all(results), f"rank {rank}: not torch's bits at check {results.index(False)}"


def _refused_after_a_proven_layout() -> list:
    grads = [_seeded(4, 8), _seeded(8, seed=1)]
    proven, _ = _torch_norm_and_clip(grads)
    outcomes: list = [_same(total_grad_norm(grads), proven)]
    for refused in [
        torch.ones(8, dtype=torch.int32),
        torch.empty(8, device="meta"),
        _seeded(8, seed=1).to_sparse(),
    ]:
        grads[1] = refused
        params = [torch.zeros(4, 8), torch.zeros(8, dtype=refused.dtype, device=refused.device)]
        params[0].grad, params[1].grad = grads[0].clone(), refused
        before = params[0].grad.clone()
        outcomes.append(error_of(lambda: total_grad_norm(grads)))
        outcomes.append(error_of(lambda: clip_grad_norm_(params, 0.5)))  # noqa: B023
        outcomes.append(torch.equal(params[0].grad, before))
    grads[1] = _seeded(8, seed=1)
    outcomes.append(_same(total_grad_norm(grads), proven))
    return outcomes


def test_a_refused_gradient_swapped_into_a_proven_list_raises(ranks):
    for outcomes in ranks.run(2, _refused_after_a_proven_layout):
        assert outcomes[0] is True and outcomes[-1] is True, "not torch's bits before or after"
        kinds = ["TypeError", "ValueError", "ValueError"]
        words = ["dtype torch.int32", "meta device", "layout torch.sparse_coo"]
        for step, (kind, words_) in enumerate(zip(kinds, words, strict=True)):
            norm, clip, untouched = outcomes[1 + 3 * step : 4 + 3 * step]
            assert norm == (kind, norm[1]) and "grads[1]" in norm[1] and words_ in norm[1], norm
            assert clip is not None and clip[0] == kind and words_ in clip[1], clip
            assert untouched, f"a gradient was modified before the {kind}"


@pytest.fixture
def _no_process_group():
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("grads", "kind", "message"),
    [
        (
            [torch.ones(2), torch.ones(2, dtype=torch.int64), torch.empty(2, device="meta")],
            TypeError,
            "grads[1] has dtype torch.int64",
        ),
        (
            [torch.ones(2), torch.empty(2, device="meta"), torch.ones(2, dtype=torch.int64)],
            ValueError,
            "grads[1] is on the meta device",
        ),
        (
            [torch.ones(2).to_sparse(), torch.ones(2, dtype=torch.bool)],
            ValueError,
            "grads[0] has layout torch.sparse_coo",
        ),
        (
            [torch.ones(2), torch.ones(2, dtype=torch.complex64), torch.ones(2, dtype=torch.uint8)],
            TypeError,
            "grads[2] has dtype torch.uint8",
        ),
    ],
    ids=["integer_first", "meta_first", "sparse_first", "complex_accepted"],
)
def test_the_first_refused_gradient_is_named(_no_process_group, grads, kind, message):
    with pytest.raises(kind, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_grads(grads, "grads")


def test_a_list_of_tensors_drops_none_and_names_the_first_non_tensor(_no_process_group):
    a, b = torch.ones(1), nn.Parameter(torch.ones(2))
    assert tensor_list([a, None, b, None], "grads") == [a, b]
    kept = tensor_list((a, b), "grads")
    assert len(kept) == 2 and kept[0] is a and kept[1] is b
    with pytest.raises(TypeError, match=r"grads\[2\] is a float, expected a torch.Tensor"):
        tensor_list([a, None, 1.0, "x"], "grads")
