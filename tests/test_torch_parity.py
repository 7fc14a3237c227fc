"""Drop-in parity with torch: clip_grad_norm_ and total_grad_norm against torch.nn.utils.

Plain tensors (one process, and on 2 gloo ranks, as replicas proven equal or with ``per_rank=True``
for ranks that hold models of their own): the norm, its dtype and device, and every clipped
gradient have the same bits as torch's, for every argument torch takes. Homogeneous DTensor sets (FSDP2 on a 1D mesh): the same bits as torch's
``clip_grad_norm_(...).full_tensor()`` on an identical copy of the model, and the same clipped
local shards. HSDP on a 2D (replicate, shard) mesh: the same value as torch's within a stated
tolerance.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from credit.parallel.collectives import clip_grad_norm_, total_grad_norm
from testbed.layouts import build, full_grads, grads, mesh, same_bits_everywhere, ulp_distance

NORM_TYPES: tuple[float | str, ...] = (1.0, 2.0, 3.0, math.inf, "inf")
# Every gradient below has a norm well above 1 for each p, so max_norm=1 clips and 1e3 does not.
MAX_NORMS = (1.0, 1e3)
# (shape, dtype, how the gradient is laid out); "none" leaves the gradient None.
PARAM_SPECS = (
    ((5, 7), torch.float32, "contiguous"),
    ((3,), torch.float64, "contiguous"),
    ((4, 4), torch.bfloat16, "contiguous"),
    ((6,), torch.float32, "none"),
    ((3, 2), torch.float32, "transposed"),
    ((2, 9), torch.float64, "contiguous"),
)
INTEGER_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# ---------------------------------------------------------------------------------------------
# helpers


def _bits(tensor: Tensor) -> Tensor:
    """The raw bits of ``tensor`` (NaN compares equal to the same NaN)."""
    return tensor.detach().contiguous().view(INTEGER_VIEW[tensor.element_size()])


def _assert_same_bits(ours: Tensor | None, reference: Tensor | None, what: str) -> None:
    if reference is None:
        assert ours is None, f"{what}: expected no tensor, got {ours}"
        return
    assert ours is not None, f"{what}: expected a tensor, got None"
    assert type(ours) is type(reference), f"{what}: {type(ours)} != {type(reference)}"
    assert ours.dtype == reference.dtype, f"{what}: dtype {ours.dtype} != {reference.dtype}"
    assert ours.device == reference.device, f"{what}: device {ours.device} != {reference.device}"
    assert ours.shape == reference.shape, f"{what}: shape {ours.shape} != {reference.shape}"
    if ours.device.type != "meta":
        differ = int((_bits(ours) != _bits(reference)).sum())
        assert differ == 0, f"{what}: {differ} of {ours.numel()} elements differ in their bits"


def _params(seed: int, specs: Iterable[tuple] = PARAM_SPECS, scale: float = 3.0) -> list[Tensor]:
    """Leaf parameters with gradients fixed by ``seed`` (two calls give identical copies)."""
    generator = torch.Generator().manual_seed(seed)
    params = []
    for shape, dtype, layout in specs:
        param = torch.zeros(shape, dtype=dtype, requires_grad=True)
        if layout == "transposed":
            values = torch.randn(tuple(reversed(shape)), generator=generator) * scale
            param.grad = values.to(dtype).t()
        elif layout != "none":
            param.grad = (torch.randn(shape, generator=generator) * scale).to(dtype)
        params.append(param)
    return params


def _container(params: list[Tensor], kind: str) -> Tensor | list[Tensor] | Iterable[Tensor]:
    if kind == "tensor":
        return params[0]
    if kind == "list":
        return list(params)
    return (p for p in params)  # a generator, consumed once


def _assert_grads_same_bits(ours: list[Tensor], reference: list[Tensor], what: str) -> None:
    for index, (a, b) in enumerate(zip(ours, reference, strict=True)):
        _assert_same_bits(a.grad, b.grad, f"{what}: grad {index}")


def _rank_seed(seed: int) -> int:
    """Different gradients on each rank: models of their own, normed with ``per_rank=True``."""
    return seed + (dist.get_rank() if dist.is_initialized() else 0)


# ---------------------------------------------------------------------------------------------
# plain tensors: one body, run in this process and on 2 gloo ranks


def _clip_matches_torch(seed: int, per_rank: bool = False) -> None:
    for norm_type in NORM_TYPES:
        for max_norm_value in MAX_NORMS:
            for max_norm in (max_norm_value, torch.tensor(max_norm_value)):
                for kind in ("tensor", "list", "generator"):
                    what = f"p={norm_type!r} max_norm={max_norm!r} parameters as {kind}"
                    ours_params, torch_params = _params(seed), _params(seed)
                    ours = clip_grad_norm_(
                        _container(ours_params, kind), max_norm, norm_type, per_rank=per_rank
                    )
                    reference = torch.nn.utils.clip_grad_norm_(
                        _container(torch_params, kind), max_norm, norm_type
                    )
                    _assert_same_bits(ours, reference, what)
                    _assert_grads_same_bits(ours_params, torch_params, what)


def _total_norm_matches_torch(seed: int, per_rank: bool = False) -> None:
    for norm_type in NORM_TYPES:
        for foreach in (None, False, True):  # True works on CPU, as in torch
            what = f"p={norm_type!r} foreach={foreach}"
            tensors = [p.grad for p in _params(seed) if p.grad is not None]
            ours = total_grad_norm(tensors, norm_type, foreach=foreach, per_rank=per_rank)
            reference = torch.nn.utils.get_total_norm(tensors, norm_type, foreach=foreach)
            _assert_same_bits(ours, reference, what)
            ours_params, torch_params = _params(seed), _params(seed)
            ours = clip_grad_norm_(ours_params, 1.0, norm_type, foreach=foreach, per_rank=per_rank)
            reference = torch.nn.utils.clip_grad_norm_(
                torch_params, 1.0, norm_type, foreach=foreach
            )
            _assert_same_bits(ours, reference, f"clip {what}")
            _assert_grads_same_bits(ours_params, torch_params, f"clip {what}")


def _single_dtype_sets_match_torch(seed: int, per_rank: bool = False) -> None:
    """The norm's dtype follows the gradients': bf16 alone gives a bf16 norm, as in torch."""
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        specs = [
            ((5, 7), dtype, "contiguous"),
            ((4,), dtype, "none"),
            ((3, 3), dtype, "transposed"),
        ]
        for norm_type in (1.0, 2.0, math.inf):
            # Several max_norm values: a 0-dim tensor must give torch's bits too, and a wrong
            # rounding of the coefficient shows on some values only.
            for max_norm in (
                0.3,
                0.7,
                1.1,
                torch.tensor(0.3),
                torch.tensor(0.7),
                torch.tensor(1.1),
            ):
                what = f"{dtype} p={norm_type} max_norm={max_norm!r}"
                ours_params, torch_params = _params(seed, specs), _params(seed, specs)
                ours = clip_grad_norm_(ours_params, max_norm, norm_type, per_rank=per_rank)
                reference = torch.nn.utils.clip_grad_norm_(torch_params, max_norm, norm_type)
                assert reference.dtype == dtype
                _assert_same_bits(ours, reference, what)
                _assert_grads_same_bits(ours_params, torch_params, what)


def _no_gradients_give_zero() -> None:
    frozen = [torch.zeros(3, requires_grad=True), torch.zeros(2, 2, requires_grad=True)]
    for norm_type in NORM_TYPES:
        with pytest.warns(UserWarning, match="none has a .grad"):  # torch's result, and why
            ours = clip_grad_norm_(frozen, 1.0, norm_type)
        reference = torch.nn.utils.clip_grad_norm_(frozen, 1.0, norm_type)
        _assert_same_bits(ours, reference, f"no grads p={norm_type!r}")
        _assert_same_bits(ours, torch.tensor(0.0), f"no grads p={norm_type!r}")
        _assert_same_bits(
            total_grad_norm([], norm_type),
            torch.nn.utils.get_total_norm([], norm_type),
            f"empty list p={norm_type!r}",
        )
        _assert_same_bits(
            total_grad_norm([None, None], norm_type), torch.tensor(0.0), "only None grads"
        )


def _empty_generator_warns_as_torch() -> None:
    with pytest.warns(UserWarning, match="empty generator") as ours_warning:
        ours = clip_grad_norm_((p for p in []), 1.0)
    with pytest.warns(UserWarning, match="empty generator") as torch_warning:
        reference = torch.nn.utils.clip_grad_norm_((p for p in []), 1.0)
    assert str(ours_warning[0].message) == str(torch_warning[0].message)
    _assert_same_bits(ours, reference, "empty generator")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an empty list is not a generator: no warning
        clip_grad_norm_([], 1.0)


def _nonfinite_as_torch(seed: int, per_rank: bool = False) -> None:
    for poison in (math.inf, -math.inf, math.nan):
        for norm_type in NORM_TYPES:
            what = f"grad with {poison} p={norm_type!r}"
            ours_params, torch_params = _params(seed), _params(seed)
            for params in (ours_params, torch_params):
                assert params[2].grad is not None
                params[2].grad[1, 1] = poison
            originals = [None if p.grad is None else p.grad.clone() for p in ours_params]

            # error_if_nonfinite=True: both raise the same error and leave every gradient as it was
            with pytest.raises(RuntimeError, match="non-finite") as ours_error:
                clip_grad_norm_(
                    ours_params, 1.0, norm_type, error_if_nonfinite=True, per_rank=per_rank
                )
            with pytest.raises(RuntimeError, match="non-finite") as torch_error:
                torch.nn.utils.clip_grad_norm_(
                    torch_params, 1.0, norm_type, error_if_nonfinite=True
                )
            assert str(ours_error.value) == str(torch_error.value), what
            for index, (param, original) in enumerate(zip(ours_params, originals, strict=True)):
                _assert_same_bits(param.grad, original, f"{what}: grad {index} untouched")

            # error_if_nonfinite=False: both return the non-finite norm and scale by it
            ours = clip_grad_norm_(ours_params, 1.0, norm_type, per_rank=per_rank)
            reference = torch.nn.utils.clip_grad_norm_(torch_params, 1.0, norm_type)
            assert not torch.isfinite(reference), what
            _assert_same_bits(ours, reference, what)
            _assert_grads_same_bits(ours_params, torch_params, what)


def _foreach_on_a_device_without_foreach_kernels() -> None:
    """CPU has foreach kernels in this torch, so foreach=True works there (see above); only a
    device without them ("meta" here) makes torch raise. Ours rejects a meta gradient up front
    (a collective on it would be a silent no-op): both raise, and nothing is touched."""
    params = [torch.zeros(3, 2, device="meta", requires_grad=True)]
    params[0].grad = torch.empty(3, 2, device="meta")
    with pytest.raises(RuntimeError, match="foreach=True was passed"):
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
    for foreach in (True, False, None):
        with pytest.raises(ValueError, match="meta device"):
            clip_grad_norm_(params, 1.0, foreach=foreach)
        with pytest.raises(ValueError, match="meta device"):
            total_grad_norm([params[0].grad], foreach=foreach)


def _plain_parity(seed: int, per_rank: bool) -> None:
    """Replicas (the same gradients on every rank), or models of their own with ``per_rank``."""
    if per_rank:
        seed = _rank_seed(seed)
    _clip_matches_torch(seed, per_rank)
    _total_norm_matches_torch(seed, per_rank)
    _single_dtype_sets_match_torch(seed, per_rank)
    _nonfinite_as_torch(seed, per_rank)
    _no_gradients_give_zero()
    _empty_generator_warns_as_torch()
    _foreach_on_a_device_without_foreach_kernels()


PLAIN_CASES: dict[str, Callable[[int], None]] = {
    "clip": _clip_matches_torch,
    "total_norm_and_foreach": _total_norm_matches_torch,
    "single_dtype": _single_dtype_sets_match_torch,
    "no_grads": lambda seed: _no_gradients_give_zero(),
    "empty_generator": lambda seed: _empty_generator_warns_as_torch(),
    "nonfinite": _nonfinite_as_torch,
    "foreach_unsupported_device": lambda seed: _foreach_on_a_device_without_foreach_kernels(),
}


@pytest.mark.parametrize("case", PLAIN_CASES)
def test_plain_tensors_match_torch_in_one_process(case):
    assert not dist.is_initialized(), "this test runs without a process group"
    PLAIN_CASES[case](7)


@pytest.mark.parametrize("per_rank", [False, True], ids=["replicas", "per_rank"])
def test_plain_tensors_match_torch_on_two_gloo_ranks(ranks, per_rank):
    """With a process group, plain gradients are still reduced locally, exactly as torch does:
    replicas once proven equal, a model per rank with ``per_rank=True``."""
    ranks.run(2, _plain_parity, 7, per_rank)


def test_empty_gradient_with_inf_norm_is_left_out_where_torch_raises():
    """A documented difference: torch's kernels raise on an empty tensor for the inf norm."""
    params = _params(3)
    empty = torch.zeros(0, 4, requires_grad=True)
    empty.grad = torch.zeros(0, 4)
    for foreach in (None, False):
        with pytest.raises(RuntimeError, match="empty tensor"):
            torch.nn.utils.clip_grad_norm_([*params, empty], 1.0, math.inf, foreach=foreach)
        ours = total_grad_norm([p.grad for p in [*params, empty]], math.inf, foreach=foreach)
        reference = torch.nn.utils.get_total_norm(
            [p.grad for p in params if p.grad is not None], math.inf
        )
        _assert_same_bits(ours, reference, f"foreach={foreach}")


# ---------------------------------------------------------------------------------------------
# homogeneous DTensor sets: FSDP2 on a 1D mesh, HSDP on a 2D mesh (4 ranks)

# HSDP: torch all-reduces the vector of per-parameter p-th powers over the shard dim and takes
# the final vector_norm after; a reduction of each rank's total p-th power instead associates the
# same sums differently and rounds differently, by a few float32 ULP (up to 2 measured: one
# rounding each in the powers, the sums and the root). Reduced per parameter, as torch does, the
# replicas' zeros add exactly and the bits match. A replica counted twice or a shard missed moves
# the norm by far more than 4 ULP.
HSDP_ULP = 4


class EvenNet(nn.Module):
    """Every weight and bias has a row count divisible by 4: no rank holds an empty shard."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        return self.frozen(self.b(torch.tanh(self.a(x))))


def _build_even(layout: str, seed: int) -> nn.Module:
    world = dist.get_world_size()
    if layout == "fsdp":
        device_mesh = mesh((world,), ("dp",))
    else:
        device_mesh = mesh((2, world // 2), ("replicate", "shard"))
    torch.manual_seed(seed)
    model = EvenNet()
    fully_shard(model.a, mesh=device_mesh)
    fully_shard(model.b, mesh=device_mesh)
    fully_shard(model, mesh=device_mesh)
    generator = torch.Generator().manual_seed(seed + 1 + dist.get_rank())
    model(torch.randn(3, 8, generator=generator)).pow(2).mean().backward()
    return model


def _build(model_name: str, layout: str, seed: int) -> nn.Module:
    if model_name == "even":
        return _build_even(layout, seed)
    return build(layout, seed).model


def _local_grads(model: nn.Module) -> list[Tensor]:
    return [g._local_tensor for g in grads(model)]


def _restore(model: nn.Module, saved: list[Tensor]) -> None:
    for local, value in zip(_local_grads(model), saved, strict=True):
        local.copy_(value)


def _dtensor_clip_vs_torch(model_name: str, layout: str, norm_types: tuple[float, ...]) -> list:
    """Clip one copy with ours and an identical copy with torch; compare norms and shards."""
    ours_model, torch_model = _build(model_name, layout, 0), _build(model_name, layout, 0)
    assert all(isinstance(g, DTensor) for g in grads(ours_model))
    saved = [t.clone() for t in _local_grads(ours_model)]
    results = []
    for norm_type in norm_types:
        _restore(ours_model, saved)
        _restore(torch_model, saved)
        unclipped = torch.nn.utils.get_total_norm(grads(torch_model), norm_type).full_tensor()
        max_norm = float(unclipped) / 4  # every p clips
        ours_unclipped = total_grad_norm(grads(ours_model), norm_type)
        ours = clip_grad_norm_(ours_model.parameters(), max_norm, norm_type)
        reference = torch.nn.utils.clip_grad_norm_(torch_model.parameters(), max_norm, norm_type)
        assert isinstance(reference, DTensor)
        reference = reference.full_tensor()
        assert type(ours) is Tensor, f"p={norm_type}: got {type(ours)}, not a plain tensor"
        assert (ours.dtype, ours.device, ours.shape) == (
            reference.dtype,
            reference.device,
            reference.shape,
        )
        shards_same = all(
            torch.equal(_bits(a), _bits(b))
            for a, b in zip(_local_grads(ours_model), _local_grads(torch_model), strict=True)
        )
        results.append(
            (
                norm_type,
                ulp_distance(ours, reference),
                shards_same,
                same_bits_everywhere(ours),
                bool(torch.equal(_bits(ours), _bits(ours_unclipped))),
            )
        )
    return results


def _assert_dtensor_results(per_rank: list, max_ulp: int, what: str) -> list[int]:
    ulps = []
    for rank, results in enumerate(per_rank):
        for norm_type, ulp, shards_same, same_everywhere, returns_unclipped in results:
            label = f"{what} p={norm_type} rank {rank}"
            assert same_everywhere, f"{label}: ranks disagree"
            assert returns_unclipped, f"{label}: did not return the norm before clipping"
            assert ulp <= max_ulp, f"{label}: {ulp} ULP from torch"
            if ulp == 0:  # the same norm gives the same coefficient: the same clipped shards
                assert shards_same, f"{label}: clipped shards differ from torch's"
            ulps.append(ulp)
    return ulps


@pytest.mark.parametrize(
    ("model_name", "norm_types"),
    [("even", (1.0, 2.0, 3.0, math.inf)), ("tiny", (1.0, 2.0, 3.0))],
    ids=["no_empty_shards", "layouts_fsdp"],
)
def test_fsdp_1d_clip_is_bit_identical_to_torch(ranks, model_name, norm_types):
    per_rank = ranks.run(4, _dtensor_clip_vs_torch, model_name, "fsdp", norm_types)
    _assert_dtensor_results(per_rank, 0, f"{model_name} fsdp")


@pytest.mark.parametrize(
    ("model_name", "norm_types"),
    [("even", (1.0, 2.0, 3.0, math.inf)), ("tiny", (1.0, 2.0, 3.0))],
    ids=["no_empty_shards", "layouts_hsdp"],
)
def test_hsdp_2d_clip_matches_torch(ranks, model_name, norm_types):
    per_rank = ranks.run(4, _dtensor_clip_vs_torch, model_name, "hsdp", norm_types)
    _assert_dtensor_results(per_rank, HSDP_ULP, f"{model_name} hsdp")


def _inf_norm_with_an_empty_shard(call_torch: bool) -> tuple[bool, float, float, bool]:
    """torch raises on the ranks holding an empty shard of the 1-row head; ours does not."""
    model = build("fsdp").model
    raised = False
    if call_torch:
        try:
            torch.nn.utils.get_total_norm(grads(model), math.inf)
        except RuntimeError as error:
            assert "empty tensor" in str(error)
            raised = True
    ours = total_grad_norm(grads(model), math.inf)
    reference = torch.nn.utils.get_total_norm(full_grads(model), math.inf)
    return raised, float(ours), float(reference), same_bits_everywhere(ours)


def test_fsdp_inf_norm_with_an_empty_shard_matches_the_materialised_norm(ranks):
    for _, ours, reference, same_everywhere in ranks.run(4, _inf_norm_with_an_empty_shard, False):
        assert ours == reference  # the max is exact: no rounding to allow for
        assert same_everywhere


@pytest.mark.skipif(
    torch.__version__.startswith("2.10."),
    reason="torch 2.10's get_total_norm issues a collective on the ranks where it does not raise, "
    "so calling it where some ranks raise desyncs the group",
)
def test_torch_raises_on_an_empty_shard_where_ours_does_not(ranks):
    # Elsewhere get_total_norm issues no collective here, so the ranks that do not raise cannot hang.
    results = ranks.run(4, _inf_norm_with_an_empty_shard, True)
    assert [raised for raised, *_ in results] == [False, True, True, True]
    for _, ours, reference, same_everywhere in results:
        assert ours == reference
        assert same_everywhere


def _mixed_dtypes_vs_torch() -> list[tuple[float, bool]]:
    """FSDP2 over the whole world with fp32 and bf16 parameters side by side."""
    world = mesh((dist.get_world_size(),), ("dp",))
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(16, 16), "b": nn.Linear(16, 16).to(torch.bfloat16)})
    for module in model.values():
        fully_shard(module, mesh=world)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(dist.get_rank()))
    (model["a"](x).sum() + model["b"](x.bfloat16()).float().sum()).backward()
    results = []
    for norm_type in (1.0, 2.0, 3.0, math.inf):
        ours = total_grad_norm(grads(model), norm_type)
        reference = torch.nn.utils.get_total_norm(grads(model), norm_type).full_tensor()
        results.append((norm_type, ours.dtype == reference.dtype and torch.equal(ours, reference)))
    return results


def test_mixed_dtypes_on_one_mesh_are_bit_identical_to_torch(ranks):
    for results in ranks.run(4, _mixed_dtypes_vs_torch):
        for norm_type, same in results:
            assert same, f"p={norm_type}: not torch's bits"
