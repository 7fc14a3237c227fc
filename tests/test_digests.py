"""The replica check's digests, in one process: exact, certain where the guide says so, and the
same however tensors are batched.

Oracles: the lanes computed from their definition with Python's unbounded integers; every single
bit flipped in every element of a float32 and a bfloat16 tensor, each a different D0; every pair
of unequal elements swapped, each a different D0; digests of mixed batches (dtypes, lengths that
do and do not fill rows of 64 words, large tensors read in place) equal to each tensor's alone.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import Tensor

from credit.parallel import _digests

MOD = 1 << 64
ROW = 64


def _signed(value: int) -> int:
    value %= MOD
    return value - MOD if value >= 1 << 63 else value


def _reference(tensor: Tensor) -> list[int]:
    """The four lanes from their definition (see _digests), in unbounded integers."""
    words = _digests._words(tensor).tolist()
    weights = _digests._weights(torch.device("cpu")).long().tolist()
    rows = -(-len(words) // ROW)
    multipliers = [
        _digests._odd_multipliers(torch.arange(max(rows, 1)), lane).tolist() for lane in (1, 2, 3)
    ]
    lanes = [0, 0, 0, 0]
    for j, x in enumerate(words):
        r, c = divmod(j, ROW)
        lanes[0] += (2 * j + 1) * x
        for k in (1, 2, 3):
            lanes[k] += (multipliers[k - 1][r] % MOD) * weights[c][1 + k] * x
    return [_signed(lane) for lane in lanes]


def _samples() -> list[Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randn(3, 5, generator=generator),
        torch.randn(200, generator=generator).to(torch.bfloat16),
        torch.randn(130, generator=generator).double(),
        torch.tensor(7.0),
        torch.zeros(0),
        torch.arange(-60, 70, dtype=torch.int64),
        torch.rand(70, generator=generator) > 0.5,
        torch.randn(5, generator=generator, dtype=torch.complex64),
        torch.randint(-128, 128, (90,), generator=generator, dtype=torch.int8),
    ]


def test_the_lanes_are_their_definition():
    samples = _samples()
    for tensor, lanes in zip(samples, _digests.digests(samples).tolist(), strict=True):
        assert lanes == _reference(tensor), f"{tensor.dtype} {tuple(tensor.shape)}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_single_bit_flip_changes_d0(dtype):
    """D0 alone: a flip changes some word by +-2^b, so D0 by an odd multiple of 2^b < 2^64."""
    tensor = torch.randn(150, generator=torch.Generator().manual_seed(1)).to(dtype)
    words = _digests._words(tensor)
    bits = 8 * words.element_size()
    flipped = []
    for index in range(words.numel()):
        for bit in range(bits):
            copy = words.clone()
            copy[index] ^= torch.tensor(1 << bit, dtype=torch.int64).to(words.dtype)
            flipped.append(copy.view(dtype))
    d0 = _digests.digests([tensor, *flipped])[:, 0]
    assert len(flipped) == words.numel() * bits
    assert bool((d0[1:] != d0[0]).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_every_swap_of_two_unequal_elements_changes_d0(dtype):
    """D0 alone: a swap changes it by 2 (j - k)(x_k - x_j), whose powers of two stay below 2^64.
    Positions span several rows of 64 words."""
    tensor = torch.randn(200, generator=torch.Generator().manual_seed(2)).to(dtype)
    swapped = []
    for j, k in itertools.combinations(range(0, 200, 3), 2):
        if tensor[j] != tensor[k]:
            copy = tensor.clone()
            copy[[j, k]] = tensor[[k, j]]
            swapped.append(copy)
    d0 = _digests.digests([tensor, *swapped])[:, 0]
    assert len(swapped) > 2000
    assert bool((d0[1:] != d0[0]).all())


def test_a_batch_gives_each_tensor_its_own_digest():
    generator = torch.Generator().manual_seed(3)
    lengths = [0, 1, 7, 63, 64, 65, 1000, 4096, 70_000, 64 * 4096, 64 * 4096 + 3]
    dtypes = [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.bool]
    tensors = []
    for index, length in enumerate(lengths * 2):
        values = torch.randn(length, generator=generator) * 100
        dtype = dtypes[index % len(dtypes)]
        tensors.append(values > 0 if dtype is torch.bool else values.to(dtype))
    together = _digests.digests(tensors)
    for tensor, lanes in zip(tensors, together, strict=True):
        assert torch.equal(lanes, _digests.digests([tensor])[0]), (tensor.dtype, tensor.numel())


def test_odd_weights_are_odd_and_fixed():
    assert _digests.odd_weight("copies", 0, 3, 1) == _digests.odd_weight("copies", 0, 3, 1)
    assert all(_digests.odd_weight(i) % 2 == 1 for i in range(100))
    assert len({_digests.odd_weight(i) for i in range(100)}) == 100
