"""torch's clip API in full: every ``max_norm`` form, and the split ``get_total_norm`` +
``clip_grads_with_norm_``, on any mix of meshes.

Oracles, bit for bit (no tolerance: the same operations in the same order):

- plain tensors in one process: torch's ``clip_grad_norm_``, ``get_total_norm`` and
  ``clip_grads_with_norm_`` on identical copies, for every ``max_norm`` form torch takes and each
  ``foreach``; where torch raises, ours raises the same kind of error;
- FSDP2 over the world (4 gloo ranks): torch's functions on an identical copy of the model (its
  norms ``.full_tensor()``), norms and every local shard;
- FSDP2 + TP (4 ranks), where torch raises: the gradients our ``clip_grad_norm_`` leaves, and the
  same bits on every rank;
- the GradScaler's sequence with the split API: the same skipped steps, scales, parameters and
  collective counts as with ``clip_grad_norm_``, and torch's update rule;
- a CPU ``max_norm`` with CUDA gradients is never copied to the device nor read: a trace of the
  coefficient and of ``clip_grads_with_norm_`` on fake CUDA tensors; with a GPU, the bits and
  ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support.amp_layouts import (
    GROWTH_INTERVAL,
    INIT_SCALE,
    MAX_NORM,
    STEPS,
    Plant,
    batch,
    expected_scales,
    local_bits,
    plant_value,
)
from support.amp_layouts import build as build_amp
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from credit.parallel._common.compat import local_tensor
from credit.parallel._common.inputs import clip_bound
from credit.parallel._norm.clip import clip_coefficient
from credit.parallel.amp import GradScaler
from credit.parallel.collectives import (
    clip_grad_norm_,
    clip_grads_with_norm_,
    get_total_norm,
)
from credit.parallel.integrations.torchtitan import clip_grad_norm_ as titan_clip
from credit.parallel.spikes import SpikePolicy
from testbed.layouts import build, grads, local_bytes, mesh, same_bits_everywhere
from testbed.world_layouts import WireRecorder

FOREACH = (None, True, False)
# The loss scale of the distributed models: their norm is then about 14, so that every form of
# max_norm below (a quarter of it, or its integer part) clips.
GRAD_SCALE = 40.0


def _forms(value: float, device: str = "cpu") -> list[tuple[str, float | Tensor]]:
    """Every form of ``max_norm`` torch's clip takes (it reads ``float(max_norm)``)."""
    whole = max(1, int(value))
    return [
        ("float", value),
        ("int", whole),
        ("0-dim float32", torch.tensor(value, device=device)),
        ("0-dim float64", torch.tensor(value, dtype=torch.float64, device=device)),
        ("0-dim float16", torch.tensor(value, dtype=torch.float16, device=device)),
        ("0-dim bfloat16", torch.tensor(value, dtype=torch.bfloat16, device=device)),
        ("0-dim int64", torch.tensor(whole, device=device)),
        ("1-D", torch.tensor([value], device=device)),
        ("2-D", torch.tensor([[value]], dtype=torch.float64, device=device)),
        ("requires grad", torch.tensor(value, device=device, requires_grad=True)),
    ]


def _same(a: Tensor, b: Tensor) -> bool:
    """Same dtype, shape, device and bits (NaN equal to itself)."""
    if (a.dtype, a.shape, a.device) != (b.dtype, b.shape, b.device):
        return False
    return torch.equal(local_bytes(a), local_bytes(b))


def _shards(model: nn.Module | list[Tensor]) -> list[Tensor]:
    params = model.parameters() if isinstance(model, nn.Module) else model
    return [local_tensor(p.grad) for p in params if p.grad is not None]


def _restore(model: nn.Module | list[Tensor], saved: list[Tensor]) -> None:
    for shard, value in zip(_shards(model), saved, strict=True):
        shard.copy_(value)


def _same_shards(a: nn.Module | list[Tensor], b: nn.Module | list[Tensor]) -> bool:
    return all(_same(x, y) for x, y in zip(_shards(a), _shards(b), strict=True))


# --- plain tensors, one process -----------------------------------------------------------------

# Sets of gradients: mixed dtypes (torch's grouping decides the bits), and each low precision
# alone, whose coefficient is rounded from float32 to the gradients' dtype.
GRAD_SETS = {
    "mixed": ((torch.float32, (5, 7)), (torch.float64, (3,)), (torch.bfloat16, (4, 4))),
    "float16": ((torch.float16, (6,)), (torch.float16, (5, 7))),
    "bfloat16": ((torch.bfloat16, (5, 7)), (torch.bfloat16, (2, 3))),
}


def _params(grad_set: str) -> list[Tensor]:
    """Leaf tensors with gradients fixed by the set (two calls give identical copies): the last
    one transposed, and a tensor without a gradient."""
    generator = torch.Generator().manual_seed(3)
    params = []
    for dtype, shape in GRAD_SETS[grad_set]:
        param = torch.zeros(shape, dtype=dtype, requires_grad=True)
        param.grad = (torch.randn(shape, generator=generator) * 3).to(dtype)
        params.append(param)
    assert params[-1].grad is not None
    params[-1].grad = params[-1].grad.t().contiguous().t()
    return [*params, torch.zeros(2, requires_grad=True)]


@pytest.mark.parametrize("grad_set", GRAD_SETS)
def test_every_max_norm_form_gives_torchs_bits(grad_set):
    """clip_grad_norm_, and get_total_norm then clip_grads_with_norm_, against torch's own."""
    for norm_type in (2.0, math.inf):
        reference_norm = torch.nn.utils.get_total_norm(_shards(_params(grad_set)), norm_type)
        for label, max_norm in _forms(float(reference_norm) / 4):
            for foreach in FOREACH:
                what = f"{grad_set} p={norm_type} max_norm {label} foreach={foreach}"
                ours, theirs = _params(grad_set), _params(grad_set)
                norm = clip_grad_norm_(ours, max_norm, norm_type, foreach=foreach)
                reference = torch.nn.utils.clip_grad_norm_(
                    theirs, max_norm, norm_type, foreach=foreach
                )
                assert _same(norm, reference), what
                assert _same_shards(ours, theirs), what

                split, torch_split = _params(grad_set), _params(grad_set)
                total = get_total_norm(_shards(split), norm_type, False, foreach)
                torch_total = torch.nn.utils.get_total_norm(
                    _shards(torch_split), norm_type, False, foreach
                )
                assert _same(total, torch_total), what
                clip_grads_with_norm_(split, max_norm, total, foreach)
                torch.nn.utils.clip_grads_with_norm_(torch_split, max_norm, torch_total, foreach)
                assert _same_shards(split, torch_split), what
                assert _same_shards(split, ours), what


def _raised(function: Callable[..., Any], *args: Any) -> type[BaseException] | None:
    try:
        function(*args)
    except Exception as error:
        return type(error)
    return None


def test_what_torch_refuses_is_refused_alike_and_nothing_changes():
    """Where torch raises on a max_norm or total_norm, ours raises the same kind of error, and no
    gradient changes. Refused here alone (torch takes them): a bool, a string and a complex or
    bool tensor (TypeError: not real numbers), a NaN or negative number (ValueError: torch
    would NaN or flip the gradients silently), and two norms (ValueError: torch's foreach kernel
    raises a RuntimeError, its loop broadcasts them into the gradients)."""
    total = torch.tensor(4.0)
    torch_clip, torch_split = torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grads_with_norm_
    torch_refuses = {
        "two elements": torch.tensor([0.1, 0.2]),
        "no element": torch.tensor([]),
        "None": None,
        "meta": torch.tensor(0.3, device="meta"),
    }
    for label, bad in torch_refuses.items():
        theirs = _raised(torch_clip, _params("mixed"), bad)
        assert theirs is not None, label
        params = _params("mixed")
        before = [local_bytes(g) for g in _shards(params)]
        assert _raised(clip_grad_norm_, params, bad) is theirs, label
        assert _raised(clip_grads_with_norm_, params, bad, total) is theirs, label
        after = [local_bytes(g) for g in _shards(params)]
        assert all(torch.equal(b, a) for b, a in zip(before, after, strict=True)), label
    assert _raised(torch_split, _params("mixed"), 1.0, 4.0) is TypeError
    assert _raised(clip_grads_with_norm_, _params("mixed"), 1.0, 4.0) is TypeError
    ours_only = {
        "bool": (True, TypeError),
        "string": ("1", TypeError),
        "complex tensor": (torch.tensor(1.0 + 0.0j), TypeError),
        "bool tensor": (torch.tensor(True), TypeError),
        "NaN": (math.nan, ValueError),
        "negative": (-1.0, ValueError),
    }
    for label, (bad, error) in ours_only.items():
        assert _raised(torch_clip, _params("mixed"), bad) is None, label
        assert _raised(clip_grad_norm_, _params("mixed"), bad) is error, label
        assert _raised(clip_grads_with_norm_, _params("mixed"), bad, total) is error, label
    assert _raised(clip_grads_with_norm_, _params("mixed"), 1.0, torch.ones(2)) is ValueError


def test_an_empty_generator_warns_where_torchs_functions_warn():
    """torch's clip_grad_norm_ warns that nothing will be clipped; its clip_grads_with_norm_ does
    not (it takes a norm already computed)."""
    with pytest.warns(UserWarning, match="empty generator"):
        clip_grad_norm_((p for p in []), 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.nn.utils.clip_grads_with_norm_((p for p in []), 1.0, torch.tensor(1.0))
        clip_grads_with_norm_((p for p in []), 1.0, torch.tensor(1.0))


SLIP = r"look like gradients \(\[p\.grad for p in model\.parameters\(\)\]\)"
NO_GRAD_YET = r"none has a \.grad on this rank: the norm is 0 and nothing is clipped"


def _slips() -> dict[str, list[str]]:
    """What each form of the slip warns, on this rank: gradients passed as parameters, trainable
    parameters before backward, and frozen parameters (no warning)."""
    model = build("fsdp_tp", 0).model
    caught = {}
    for label, call in (
        ("grads", lambda: clip_grad_norm_(grads(model), 1.0)),
        ("grads_split", lambda: clip_grads_with_norm_(grads(model), 1.0, torch.tensor(1.0))),
        (
            "before_backward",
            lambda: clip_grad_norm_(_without_grads(build("fsdp_tp", 1).model), 1.0),
        ),
        ("frozen", lambda: clip_grad_norm_(_without_grads(model).requires_grad_(False), 1.0)),
    ):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            call()
        caught[label] = [str(w.message) for w in seen if w.category is UserWarning]
    return caught


def _without_grads(model: nn.Module) -> nn.Module:
    model.zero_grad(set_to_none=True)
    return model


def test_gradients_passed_as_parameters_warn_on_every_rank(ranks):
    """torch's clip, given gradients instead of parameters, norms nothing and clips nothing,
    silently; ours does the same and says why, on every rank."""
    for caught in ranks.run(4, _slips):
        assert len(caught["grads"]) == 1 and re.search(SLIP, caught["grads"][0]), caught
        assert len(caught["grads_split"]) == 1 and re.search(SLIP, caught["grads_split"][0])
        assert len(caught["before_backward"]) == 1, caught
        assert re.search(NO_GRAD_YET, caught["before_backward"][0]), caught
        assert caught["frozen"] == [], caught


def test_parameters_without_gradients_warn_and_nothing_changes():
    """Trainable parameters without a gradient (a clip before backward): norm 0 and a warning;
    frozen ones: norm 0 and no warning; gradients passed as parameters: the slip named."""
    model = nn.Linear(3, 2)
    with pytest.warns(UserWarning, match=NO_GRAD_YET):
        assert clip_grad_norm_(model.parameters(), 1.0).item() == 0.0
    model(torch.ones(4, 3)).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    with pytest.warns(UserWarning, match=SLIP):
        assert clip_grad_norm_([p.grad for p in model.parameters()], 1e-6).item() == 0.0
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before, strict=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        clip_grad_norm_(nn.Linear(3, 2).requires_grad_(False).parameters(), 1.0)
        clip_grad_norm_(model.parameters(), 1.0)


def test_the_warnings_point_at_the_callers_line():
    """Each warning of a clip is located at the user's call (through torch's ``no_grad``
    wrapper, the spike policy and the torchtitan adapter), not inside torch or this package; so
    "once per call site" is once per line of the user's code."""
    grads = [torch.zeros(2), torch.zeros(3)]
    without = nn.Linear(3, 2)
    spikes = SpikePolicy(skip=False, adaptive_clip="zscore")
    calls = [
        lambda: clip_grad_norm_(grads, 1.0),
        lambda: clip_grad_norm_(without.parameters(), 1.0),
        lambda: clip_grad_norm_(without, 1.0),
        lambda: clip_grad_norm_((p for p in []), 1.0),
        lambda: clip_grads_with_norm_(without.parameters(), 1.0, torch.tensor(1.0)),
        lambda: spikes.clip_grad_norm_(without.parameters(), 1.0),
        lambda: titan_clip(list(without.parameters()), 1.0),
    ]
    for call in calls:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            call()
        where = [(w.filename, w.lineno) for w in seen if w.category is UserWarning]
        assert where == [(__file__, call.__code__.co_firstlineno)], where
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")  # Python's own: once per call site
        for _ in range(2):
            clip_grad_norm_(grads, 1.0)
        clip_grad_norm_(grads, 1.0)
    assert len([w for w in seen if re.search(SLIP, str(w.message))]) == 2


def test_nothing_to_clip_returns_before_reading_total_norm_as_torch_does():
    """With no gradient, torch's clip_grads_with_norm_ returns None whatever total_norm is (a
    float included); so does ours. With gradients, a float total_norm is refused by both."""
    without_grad = [torch.zeros(2, requires_grad=True)]
    for parameters in ([], without_grad):
        assert torch.nn.utils.clip_grads_with_norm_(parameters, 0.3, 1.5) is None  # type: ignore[arg-type]
        with warnings.catch_warnings():
            warnings.simplefilter(
                "ignore", UserWarning
            )  # no gradient: its warning is tested on its own
            assert clip_grads_with_norm_(parameters, 0.3, 1.5) is None  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        torch.nn.utils.clip_grads_with_norm_(_params("mixed"), 0.3, 1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="total_norm must be a tensor"):
        clip_grads_with_norm_(_params("mixed"), 0.3, 1.5)  # type: ignore[arg-type]


# --- a CPU max_norm never travels to the device --------------------------------------------------


class _Trace(TorchDispatchMode):
    """Every aten op, with the devices and dims of its tensor inputs and outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, list[tuple[str, int]], list[str]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        inputs = [(t.device.type, t.dim()) for t in tree_leaves((args, kwargs)) if _is_tensor(t)]
        outputs = [t.device.type for t in tree_leaves(out) if _is_tensor(t)]
        self.ops.append((str(func.overloadpacket), inputs, outputs))
        return out

    def problems(self) -> list[str]:
        """Host reads, copies of a CPU tensor (to the device or not), and CPU operands of device
        ops that are not 0-dim scalars."""
        found = []
        for op, inputs, outputs in self.ops:
            devices = {device for device, _ in inputs} | set(outputs)
            if op == "aten._local_scalar_dense":
                found.append(f"host read: {op} {inputs}")
            elif op in ("aten._to_copy", "aten.copy_", "aten.to") and "cpu" in devices:
                found.append(f"copy of a CPU tensor: {op} {inputs} -> {outputs}")
            elif len(devices) > 1 and any(dev == "cpu" and dim for dev, dim in inputs):
                found.append(f"CPU operand that is not a scalar: {op} {inputs}")
        return found


def _is_tensor(value: object) -> bool:
    return isinstance(value, Tensor)


def test_a_cpu_max_norm_enters_the_device_coefficient_as_a_scalar():
    """On fake CUDA tensors: for every CPU form of max_norm and every dtype of the norm, the
    coefficient is computed on the device with no host read and no copy of max_norm (not even a
    dtype conversion on the CPU): it is a 0-dim scalar operand of the device kernels, as the
    Python float of torch's clip is. clip_grads_with_norm_ likewise, whole, with each foreach."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        planted = _Trace()
        with planted:  # the trace sees a copy when there is one
            torch.tensor(0.3, dtype=torch.float64).to(torch.float32)
        assert planted.problems(), "the trace missed a planted copy"
        for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            total = torch.rand((), device="cuda", dtype=dtype)
            for label, max_norm in _forms(0.3):
                with _Trace() as trace:
                    coefficient = clip_coefficient(clip_bound(max_norm), total)
                assert trace.problems() == [], f"{dtype} {label}: {trace.problems()}"
                assert (coefficient.device.type, coefficient.dtype, coefficient.shape) == (
                    "cuda",
                    dtype,
                    torch.Size([]),
                ), f"{dtype} {label}"
                for foreach in FOREACH:
                    params = [nn.Parameter(torch.zeros(3, 2, device="cuda", dtype=dtype))]
                    params[0].grad = torch.randn(3, 2, device="cuda", dtype=dtype)
                    with _Trace() as trace:
                        clip_grads_with_norm_(params, max_norm, total, foreach)
                    assert trace.problems() == [], f"{dtype} {label} foreach={foreach}"


def _cuda_param(grad: Tensor) -> list[Tensor]:
    param = torch.zeros_like(grad, requires_grad=True)
    param.grad = grad.clone()
    return [param]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_every_max_norm_form_on_cuda_gives_torchs_bits_without_a_sync():
    """CUDA gradients, max_norm on the CPU or on the device: torch's bits, and no host sync
    (``set_sync_debug_mode("error")`` raises at a blocking copy or a read)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        planted = _raised(torch.tensor(0.3).to, "cuda")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert planted is RuntimeError, "the sync check missed a blocking copy"
    generator = torch.Generator().manual_seed(5)
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        norms = (torch.rand(64, generator=generator, dtype=torch.float64) * 8).to(dtype)
        values = torch.rand(64, generator=generator, dtype=torch.float64) * 8
        for norm, value in zip(norms.cuda(), values, strict=True):
            for _, max_norm in _forms(float(value)) + _forms(float(value), "cuda"):
                reference = torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)
                assert _same(clip_coefficient(clip_bound(max_norm), norm), reference)

        for device in ("cpu", "cuda"):
            for label, max_norm in _forms(2.5, device):
                for foreach in FOREACH:
                    what = f"{dtype} max_norm {label} on {device} foreach={foreach}"
                    grad = torch.randn(5, 7, generator=generator).to(dtype).cuda() * 3
                    ours, theirs, split = (_cuda_param(grad) for _ in range(3))
                    reference = torch.nn.utils.clip_grad_norm_(theirs, max_norm, foreach=foreach)
                    torch.cuda.set_sync_debug_mode("error")
                    try:
                        norm = clip_grad_norm_(ours, max_norm, foreach=foreach)
                        total = get_total_norm(_shards(split), 2.0, False, foreach)
                        clip_grads_with_norm_(split, max_norm, total, foreach)
                    finally:
                        torch.cuda.set_sync_debug_mode(0)
                    assert _same(norm, reference) and _same(total, reference), what
                    assert _same_shards(ours, theirs) and _same_shards(split, theirs), what


# --- FSDP2 over the world, against torch (4 ranks) ----------------------------------------------


def _fsdp_model() -> nn.Module:
    """Two layers under FSDP2 over the world (every shard distinct: torch's clip is right), with
    gradients from one backward, the same each time it is built."""
    world = mesh((dist.get_world_size(),), ("dp",))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))
    fully_shard(model, mesh=world)
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(dist.get_rank()))
    (model(x).pow(2).mean() * GRAD_SCALE).backward()
    return model


def _fsdp_against_torch() -> dict[str, Any]:
    """Every form and foreach: our clip and our split against torch's clip, on identical copies
    (torch's split leaves what its clip leaves: checked once per form); torch's own norm, a
    Replicate DTensor, handed to ours; a Partial DTensor norm refused."""
    ours, theirs = _fsdp_model(), _fsdp_model()
    saved = [s.clone() for s in _shards(ours)]
    value = float(torch.nn.utils.get_total_norm(grads(theirs)).full_tensor()) / 4
    failures = []
    for label, max_norm in _forms(value):
        for foreach in FOREACH:
            what = f"max_norm {label} foreach={foreach}"
            _restore(ours, saved)
            _restore(theirs, saved)
            norm = clip_grad_norm_(ours.parameters(), max_norm, foreach=foreach)
            reference = torch.nn.utils.clip_grad_norm_(
                theirs.parameters(), max_norm, foreach=foreach
            ).full_tensor()
            if not (_same(norm, reference) and _same_shards(ours, theirs)):
                failures.append(f"clip_grad_norm_ {what}")
            _restore(ours, saved)
            total = get_total_norm(grads(ours), 2.0, False, foreach)
            clip_grads_with_norm_(ours.parameters(), max_norm, total, foreach)
            if not (_same(total, reference) and _same_shards(ours, theirs)):
                failures.append(f"get_total_norm, clip_grads_with_norm_ {what}")
        clipped = [s.clone() for s in _shards(theirs)]
        _restore(ours, saved)
        _restore(theirs, saved)
        torch_total = torch.nn.utils.get_total_norm(grads(theirs))
        torch.nn.utils.clip_grads_with_norm_(theirs.parameters(), max_norm, torch_total)
        clip_grads_with_norm_(ours.parameters(), max_norm, torch_total)
        same_as_clip = all(_same(a, b) for a, b in zip(_shards(theirs), clipped, strict=True))
        if not (_same_shards(theirs, ours) and same_as_clip):
            failures.append(f"torch's DTensor norm, max_norm {label}")
    world = mesh((dist.get_world_size(),), ("dp",))
    pending = DTensor.from_local(torch.tensor(1.0), world, [Partial("max")])
    _restore(ours, saved)
    try:
        clip_grads_with_norm_(ours.parameters(), 1.0, pending)
        refused = ""
    except TypeError as error:
        refused = str(error)
    return {
        "failures": failures,
        "refused": refused,
        "unchanged": all(_same(a, b) for a, b in zip(_shards(ours), saved, strict=True)),
        "same_everywhere": same_bits_everywhere(norm) and same_bits_everywhere(total),
    }


def test_fsdp_over_the_world_gives_torchs_bits_for_every_form(ranks):
    for result in ranks.run(4, _fsdp_against_torch):
        assert result["failures"] == []
        assert "total_norm is a DTensor with placements (Partial(max),)" in result["refused"]
        assert "full_tensor()" in result["refused"] and "get_total_norm" in result["refused"]
        assert result["unchanged"] and result["same_everywhere"]


# --- FSDP2 + TP, where torch raises (4 ranks) ----------------------------------------------------


def _fsdp_tp_split_is_the_clip() -> dict[str, Any]:
    """get_total_norm then clip_grads_with_norm_ leaves exactly what clip_grad_norm_ leaves, for
    every form, foreach and p, with parameters as a list, a module or named pairs; the norm's
    collectives (by the size of their process group), the scaling's none."""
    clipped, split = build("fsdp_tp", 0, GRAD_SCALE).model, build("fsdp_tp", 0, GRAD_SCALE).model
    saved = [s.clone() for s in _shards(clipped)]
    value = float(get_total_norm(grads(split))) / 4
    cases = [
        (label, max_norm, foreach, 2.0) for label, max_norm in _forms(value) for foreach in FOREACH
    ]
    cases += [("float", value, None, p) for p in (1.0, 3.0, math.inf)]
    containers: list[Callable[[nn.Module], Any]] = [
        lambda m: m.parameters(),
        lambda m: m,
        lambda m: m.named_parameters(),
    ]
    failures, counts, totals = [], set(), []
    for index, (label, max_norm, foreach, p) in enumerate(cases):
        what = f"max_norm {label} foreach={foreach} p={p}"
        _restore(clipped, saved)
        _restore(split, saved)
        norm = clip_grad_norm_(clipped.parameters(), max_norm, p, foreach=foreach)
        with WireRecorder() as norm_wire:
            total = get_total_norm(grads(split), p, False, foreach)
        with WireRecorder() as clip_wire:
            clip_grads_with_norm_(containers[index % 3](split), max_norm, total, foreach)
        counts.add((tuple(norm_wire.groups), tuple(clip_wire.groups)))
        if not (_same(norm, total) and _same_shards(clipped, split)):
            failures.append(what)
        totals.append(total)
    return {
        "failures": failures,
        "counts": counts,
        "same_everywhere": all(same_bits_everywhere(t) for t in totals),
    }


def test_fsdp_tp_split_leaves_exactly_what_the_clip_leaves(ranks):
    for result in ranks.run(4, _fsdp_tp_split_is_the_clip):
        assert result["failures"] == []
        # The norm: the copies (the rowwise biases replicated on tp, the dp mesh's shards on
        # their tp peers) compared within tp (2 ranks), then the world's one all_reduce; the inf
        # norm compares nothing. The scaling: none.
        assert result["counts"] == {((2, 4), ()), ((4,), ())}
        assert result["same_everywhere"]


# --- the GradScaler's sequence with the split API (4 ranks) -------------------------------------

# An inf on rank 3's TP shard at step 2; a NaN tensor max_norm at step 4, which the scaling
# spoils every gradient with.
INF_STEP, NAN_MAX_NORM_STEP = 2, 4


def _scaler_sequences() -> dict[str, dict[str, list]]:
    """unscale_, get_total_norm, logging, clip_grads_with_norm_, step, update; beside it the same
    training with clip_grad_norm_ for the norm and the scaling."""
    records = {}
    for variant in ("clip", "split"):
        layout = build_amp("fsdp_tp")
        model = layout.model
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
        scaler = GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
        record: dict[str, list] = {"skipped": [], "scale": [], "counts": [], "norms": []}
        for step in range(STEPS):
            scaler.scale(model(batch(layout, step)).pow(2).mean()).backward()
            if step == INF_STEP:
                plant_value(model, Plant(step, 3, "tp", math.inf))
            max_norm = torch.tensor(math.nan) if step == NAN_MAX_NORM_STEP else MAX_NORM
            with CommDebugMode() as comm:
                scaler.unscale_(optimizer)
                if variant == "clip":
                    norm = clip_grad_norm_(model.parameters(), max_norm)
                else:
                    norm = get_total_norm([p.grad for p in model.parameters()])
                    record["norms"].append(float(norm))  # the trainer's logging
                    clip_grads_with_norm_(model.parameters(), max_norm, norm)
                scaler.step(optimizer)
                scaler.update()
            optimizer.zero_grad()
            record["skipped"].append(scaler.last_step_skipped)
            record["scale"].append(scaler.get_scale())
            record["counts"].append(comm.get_total_counts())
        record["params"] = [t.view(torch.uint8) for t in local_bits(model).values()]
        records[variant] = record
    return records


def test_the_scalers_sequence_with_the_split_api_skips_as_the_clip_does(ranks):
    skipped = {INF_STEP, NAN_MAX_NORM_STEP}
    for rank, records in enumerate(ranks.run(4, _scaler_sequences)):
        clip, split = records["clip"], records["split"]
        assert split["skipped"] == [step in skipped for step in range(STEPS)], rank
        assert split["scale"] == clip["scale"] == expected_scales(skipped), rank
        # The clip met the layout first (its first call verifies it): compared from step 1.
        assert split["counts"][1:] == clip["counts"][1:], rank
        assert all(torch.equal(a, b) for a, b in zip(split["params"], clip["params"], strict=True))
        assert math.isinf(split["norms"][INF_STEP]) and math.isfinite(split["norms"][0]), rank
