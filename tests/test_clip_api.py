"""Every ``max_norm`` form torch's clip takes, with torch's bits.

Oracles, bit for bit (no tolerance: the same operations in the same order):

- plain tensors in one process: torch's ``clip_grad_norm_`` on identical copies, for every
  ``max_norm`` form torch takes and each ``foreach``; where torch raises, ours raises the same
  kind of error;
- a CPU ``max_norm`` with CUDA gradients is never copied to the device nor read: a trace of the
  coefficient on fake CUDA tensors; with a GPU, the bits and
  ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from layouts import local_bytes
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from credit.parallel._compat import local_tensor
from credit.parallel._inputs import clip_bound
from credit.parallel.collectives import _clip_coefficient, clip_grad_norm_

FOREACH = (None, True, False)


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
    """clip_grad_norm_ against torch's own."""
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


def _raised(function: Callable[..., Any], *args: Any) -> type[BaseException] | None:
    try:
        function(*args)
    except Exception as error:
        return type(error)
    return None


def test_what_torch_refuses_is_refused_alike_and_nothing_changes():
    """Where torch raises on a max_norm, ours raises the same kind of error, and no
    gradient changes. Refused here alone (torch takes them): a bool, a string and a complex or
    bool tensor (TypeError: not real numbers), a NaN or negative number (ValueError: torch
    would NaN or flip the gradients silently)."""
    torch_clip = torch.nn.utils.clip_grad_norm_
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
        after = [local_bytes(g) for g in _shards(params)]
        assert all(torch.equal(b, a) for b, a in zip(before, after, strict=True)), label
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
    Python float of torch's clip is."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        planted = _Trace()
        with planted:  # the trace sees a copy when there is one
            torch.tensor(0.3, dtype=torch.float64).to(torch.float32)
        assert planted.problems(), "the trace missed a planted copy"
        for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            total = torch.rand((), device="cuda", dtype=dtype)
            for label, max_norm in _forms(0.3):
                with _Trace() as trace:
                    coefficient = _clip_coefficient(clip_bound(max_norm), total)
                assert trace.problems() == [], f"{dtype} {label}: {trace.problems()}"
                assert (coefficient.device.type, coefficient.dtype, coefficient.shape) == (
                    "cuda",
                    dtype,
                    torch.Size([]),
                ), f"{dtype} {label}"


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
                assert _same(_clip_coefficient(clip_bound(max_norm), norm), reference)

        for device in ("cpu", "cuda"):
            for label, max_norm in _forms(2.5, device):
                for foreach in FOREACH:
                    what = f"{dtype} max_norm {label} on {device} foreach={foreach}"
                    grad = torch.randn(5, 7, generator=generator).to(dtype).cuda() * 3
                    ours, theirs = _cuda_param(grad), _cuda_param(grad)
                    reference = torch.nn.utils.clip_grad_norm_(theirs, max_norm, foreach=foreach)
                    torch.cuda.set_sync_debug_mode("error")
                    try:
                        norm = clip_grad_norm_(ours, max_norm, foreach=foreach)
                    finally:
                        torch.cuda.set_sync_debug_mode(0)
                    assert _same(norm, reference) and _same_shards(ours, theirs), what
