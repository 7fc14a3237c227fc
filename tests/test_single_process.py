"""Every function in one process with no process group initialised (the pytest process itself).

A world of one: averages leave tensors exactly as they were, norms are local and have torch's
bits, and clipping has torch's bits, for a real model's gradients.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from credit.parallel.collectives import (
    all_reduce_avg,
    allreduce_grads_avg,
    clip_grad_norm_,
    total_grad_norm,
)

INTEGER_VIEW = {2: torch.int16, 4: torch.int32, 8: torch.int64}
NORM_TYPES = (1.0, 2.0, 3.0, math.inf, "inf")


@pytest.fixture(autouse=True)
def _no_process_group():
    assert not dist.is_initialized(), "these tests need a process without a process group"
    yield
    assert not dist.is_initialized()


def _bits(tensor: Tensor) -> Tensor:
    return tensor.detach().contiguous().view(INTEGER_VIEW[tensor.element_size()])


def _same_bits(a: Tensor, b: Tensor) -> bool:
    return (
        type(a) is type(b)
        and (a.dtype, a.device, a.shape) == (b.dtype, b.device, b.shape)
        and torch.equal(_bits(a), _bits(b))
    )


def _tensors() -> list[Tensor]:
    generator = torch.Generator().manual_seed(11)
    return [
        torch.randn(5, 7, generator=generator),
        torch.randn(9, generator=generator).to(torch.bfloat16),
        torch.randn(4, 3, generator=generator, dtype=torch.float64),
        torch.randn(6, 4, generator=generator).t(),
        torch.randn(8, 6, generator=generator)[::2, 1:4],
        torch.zeros(0, 5),
        torch.tensor(2.5),
    ]


def _model(seed: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A small model with gradients from one backward, and a frozen layer (grad None)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 3))
    model[2].requires_grad_(False)
    model.to(dtype)
    generator = torch.Generator().manual_seed(seed + 1)
    model(torch.randn(8, 6, generator=generator).to(dtype)).pow(2).mean().backward()
    return model


def test_averages_leave_tensors_unchanged(monkeypatch):
    tensors = _tensors()
    originals = [t.clone() for t in tensors]
    for tensor in tensors:
        all_reduce_avg(tensor)
    allreduce_grads_avg([*tensors, None], None)
    allreduce_grads_avg(tensors, None, bucket_cap_mb=128 / 2**20, check=True)
    monkeypatch.setenv("CREDIT_PARALLEL_CHECK", "1")
    allreduce_grads_avg(tensors, None)
    for tensor, original in zip(tensors, originals, strict=True):
        assert _same_bits(tensor, original)


def test_argument_errors_are_raised_in_one_process_too():
    with pytest.raises(TypeError):
        all_reduce_avg(2.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        all_reduce_avg(torch.ones(3, dtype=torch.int64))
    with pytest.raises(ValueError):
        allreduce_grads_avg([torch.ones(3)], None, bucket_cap_mb=0)
    with pytest.raises(TypeError):
        allreduce_grads_avg([torch.ones(3)], "world")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        total_grad_norm([torch.ones(3)], norm_type="two")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_norms_are_local_and_equal_torchs(dtype):
    grads = [p.grad for p in _model(0, dtype).parameters() if p.grad is not None]
    for norm_type in NORM_TYPES:
        for foreach in (None, False, True):
            ours = total_grad_norm(grads, norm_type, foreach=foreach, check=True)
            reference = torch.nn.utils.get_total_norm(grads, norm_type, foreach=foreach)
            assert _same_bits(ours, reference), f"p={norm_type!r} foreach={foreach}"


def test_dtype_accumulates_bf16_norms_in_float32():
    grads = [p.grad for p in _model(0, torch.bfloat16).parameters() if p.grad is not None]
    for norm_type in (1.0, 2.0, math.inf):
        ours = total_grad_norm(grads, norm_type, dtype=torch.float32)
        # _foreach_norm with dtype=float32 converts each element as it reads it: the same bits
        # as the norm of float32 copies.
        reference = torch.nn.utils.get_total_norm([g.float() for g in grads], norm_type)
        assert _same_bits(ours, reference), f"p={norm_type}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clip_equals_torchs(dtype):
    for norm_type in NORM_TYPES:
        for max_norm in (0.01, 0.37, torch.tensor(0.01), torch.tensor(0.37), 1e3):
            what = f"p={norm_type!r} max_norm={max_norm!r}"
            ours_model, torch_model = _model(1, dtype), _model(1, dtype)
            ours = clip_grad_norm_(ours_model.parameters(), max_norm, norm_type, check=True)
            reference = torch.nn.utils.clip_grad_norm_(
                torch_model.parameters(), max_norm, norm_type
            )
            same = _same_bits(ours, reference)
            assert same, what
            for a, b in zip(ours_model.parameters(), torch_model.parameters(), strict=True):
                if b.grad is None:
                    assert a.grad is None
                else:
                    same = _same_bits(a.grad, b.grad)
                    assert same, what
