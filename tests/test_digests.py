"""The replica check's digests, in one process: exact, certain where the guide says so, the same
however tensors are batched, for every dtype torch has, and without a host sync once planned.

Oracles: the lanes computed from their definition with Python's unbounded integers, from the raw
bytes of each tensor (built from random bytes, so the oracle never goes through the code that
reads words); every single bit flipped in every element of a float32 and a bfloat16 tensor, each
a different D0; every pair of unequal elements swapped, each a different D0; digests of mixed
batches (dtypes, lengths that do and do not fill rows of 64 words, small tensors joined by
their trailing shape, large tensors read in place) equal to each tensor's alone, and for those
that take another path than the padded copy, to the lanes computed word by word in int64. A steady-state call is traced op by op: it builds no tensor from
host data, reads nothing back, and runs as many kernels for 600 tensors as for 20.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from credit.parallel._replicas import digests as _digests

MOD = 1 << 64
ROW = 64
QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
# Every dtype this torch has that a tensor with data can hold (quantized ones are refused).
DTYPES = sorted(
    {value for value in vars(torch).values() if isinstance(value, torch.dtype)} - QUANTIZED,
    key=str,
)


def _signed(value: int) -> int:
    value %= MOD
    return value - MOD if value >= 1 << 63 else value


def _reference(raw: Tensor, itemsize: int) -> list[int]:
    """The four lanes from their definition (see _digests), in unbounded integers, of the tensor
    whose row-major bytes are ``raw`` (uint8) and whose elements are ``itemsize`` bytes."""
    data = bytes(raw.reshape(-1).tolist())
    width = min(itemsize, 4)
    words = [
        int.from_bytes(data[i : i + width], "little", signed=True)
        for i in range(0, len(data), width)
    ]
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
            lanes[k] += (multipliers[k - 1][r] % MOD) * weights[1 + k][c] * x
    return [_signed(lane) for lane in lanes]


def _from_bytes(raw: Tensor, dtype: torch.dtype) -> Tensor:
    """The tensor of ``dtype`` whose bytes are ``raw`` (uint8, last dim the element's bytes)."""
    shape = raw.shape[:-1]
    return raw.reshape(-1).view(dtype).view(shape)


def _random_bytes(*shape: int, seed: int) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)


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
        raw = tensor.reshape(-1).view(torch.uint8)
        assert lanes == _reference(raw, tensor.element_size()), f"{tensor.dtype}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype(dtype):
    """Contiguous and transposed, 0-dim and empty, equal copies and one flipped bit: the lanes are
    their definition, equal bits give equal digests, and every flip of one element's bits changes
    D0 (complex32, a 4-byte element, is one 32-bit word)."""
    size = dtype.itemsize
    raw = _random_bytes(9, 11, size, seed=size)
    tensor = _from_bytes(raw, dtype)  # 99 elements: rows of 64 words not filled
    transposed = tensor.t()
    scalar = _from_bytes(raw[0, 0], dtype)
    empty = _from_bytes(raw[:0, 0], dtype)
    copy = _from_bytes(raw.clone(), dtype)
    flips = []
    for bit in range(8 * size):
        flipped = raw.clone()
        flipped[4, 7, bit // 8] ^= 1 << (bit % 8)
        flips.append(_from_bytes(flipped, dtype))
    batch = [tensor, transposed, scalar, empty, copy, *flips]
    lanes = _digests.digests(batch)
    assert lanes.tolist()[:4] == [
        _reference(raw, size),
        _reference(raw.transpose(0, 1), size),
        _reference(raw[0, 0], size),
        [0, 0, 0, 0],
    ]
    assert torch.equal(lanes[4], lanes[0])
    assert bool((lanes[5:, 0] != lanes[0, 0]).all())
    assert scalar.dim() == 0 and not transposed.is_contiguous()


def test_a_mixed_list_of_every_dtype_gives_each_its_own_digest():
    tensors = []
    for index, dtype in enumerate(DTYPES):
        raw = _random_bytes(3 + index, 5, dtype.itemsize, seed=100 + index)
        tensor = _from_bytes(raw, dtype)
        tensors += [tensor, tensor.t(), tensor[0, 0]]
    together = _digests.digests(tensors)
    for tensor, lanes in zip(tensors, together, strict=True):
        assert torch.equal(lanes, _digests.digests([tensor])[0]), tensor.dtype


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_quantized_tensors_are_refused():
    quantized = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    with pytest.raises(TypeError, match=r"tensor 1 is quantized \(torch.qint8\)"):
        _digests.plan([torch.zeros(3), quantized])


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


def _wrapping_reference(tensor: Tensor) -> Tensor:
    """The lanes from their definition, word by word in int64 (which wraps mod 2^64): no rows,
    no padding, no float64; for tensors too large for Python's integers to be quick."""
    words = _digests._words(tensor).to(torch.int64)
    j = torch.arange(words.numel(), dtype=torch.int64)
    weights = _digests._weights(torch.device("cpu")).long()
    lanes = [((2 * j + 1) * words).sum()]
    for k in (1, 2, 3):
        u = _digests._odd_multipliers(j // ROW, k)
        lanes.append((u * weights[1 + k, j % ROW] * words).sum())
    return torch.stack(lanes)


def test_a_batch_gives_each_tensor_its_own_digest():
    generator = torch.Generator().manual_seed(3)
    lengths = [0, 1, 7, 63, 64, 65, 1000, 4096, 70_000, 64 * 4096, 64 * 4096 + 3]
    dtypes = [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.bool]
    tensors = []
    for index, length in enumerate(lengths * 2):
        values = torch.randn(length, generator=generator) * 100
        dtype = dtypes[index % len(dtypes)]
        tensors.append(values > 0 if dtype is torch.bool else values.to(dtype))
    # Small ones that fill whole rows, joined by their trailing shape: contiguous or not.
    wide = torch.randn(64, 8, generator=generator)
    joined = [wide.t(), torch.randn(3, 64, generator=generator), wide.double()[:, :4]]
    # Large ones read in place: a whole number of rows, a partial last row, transposed.
    large = torch.randn(128, 2049, generator=generator)
    checked = [*joined, large, large.t(), large.to(torch.float16).t()]
    tensors += checked
    together = _digests.digests(tensors)
    for tensor, lanes in zip(tensors, together, strict=True):
        assert torch.equal(lanes, _digests.digests([tensor])[0]), (tensor.dtype, tensor.numel())
    checked += tensors[len(lengths) * 2 - 2 : len(lengths) * 2]
    for tensor in checked:
        lanes = together[next(i for i, t in enumerate(tensors) if t is tensor)]
        assert torch.equal(lanes, _wrapping_reference(tensor)), (tensor.dtype, tensor.shape)


def test_a_plan_digests_new_values_of_its_layout_and_refuses_another():
    generator = torch.Generator().manual_seed(4)

    def layout() -> list[Tensor]:
        return [
            torch.nn.Parameter(torch.randn(5, 7, generator=generator)),
            torch.randn(64 * 4096 + 5, generator=generator).half(),
            torch.randn(3, generator=generator, dtype=torch.complex64),
            torch.randn(20, generator=generator).to(torch.float8_e4m3fn),
        ]

    plan = _digests.plan(layout())
    lanes = plan(layout())
    assert not lanes.is_inference() and not lanes.requires_grad
    lanes += 1  # the caller's to modify
    assert plan.nbytes == 35 * 4 + (64 * 4096 + 5) * 2 + 3 * 8 + 20
    for _ in range(2):
        tensors = layout()
        assert torch.equal(plan(tensors), _digests.digests(tensors))
    tensors = layout()
    with pytest.raises(ValueError, match=r"tensor 1 is torch\.float32 of shape \(262149,\)"):
        plan([tensors[0], tensors[1].float(), *tensors[2:]])
    with pytest.raises(ValueError, match=r"tensor 0 is torch\.float32 of shape \(6, 6\)"):
        plan([torch.zeros(6, 6), *tensors[1:]])
    with pytest.raises(ValueError, match=r"\(7, 5\); the plan was built for .* shape \(5, 7\)"):
        plan([tensors[0].t(), *tensors[1:]])
    with pytest.raises(ValueError, match="the plan digests 4 tensors, got 3"):
        plan(tensors[:3])
    assert _digests.plan([])([]).shape == (0, _digests.LANES)


# ---------------------------------------------------------------------------------------------
# the steady state, traced op by op


_VIEWS = {
    "view",
    "_unsafe_view",
    "reshape",
    "_reshape_alias",
    "slice",
    "select",
    "t",
    "transpose",
    "expand",
    "as_strided",
    "alias",
    "detach",
    "view_as_real",
}


class _Trace(TorchDispatchMode):
    """Every aten op a call runs, and those that would be a host sync or a blocking copy on a GPU:
    a tensor built from host data (``aten.lift_fresh``: ``torch.tensor(list)``, ``new_tensor``,
    indexing with a list), a value read back (``_local_scalar_dense``: item, bool, float,
    tolist), a data-dependent shape (nonzero, masked_select, a boolean index), a copy or an index
    between devices."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        self.ops.append(name)
        tensors = [a for a in itertools.chain(args, kwargs.values()) if isinstance(a, Tensor)]
        indices = [
            i for a in args if isinstance(a, list | tuple) for i in a if isinstance(i, Tensor)
        ]
        if name in {
            "lift_fresh",
            "lift_fresh_copy",
            "_local_scalar_dense",
            "nonzero",
            "masked_select",
        }:
            self.syncs.append(name)
        if name in {"index", "index_put", "index_put_"} and any(
            i.dtype in (torch.bool, torch.uint8) for i in indices
        ):
            self.syncs.append(f"{name} with a boolean index")
        if len({t.device for t in tensors + indices}) > 1:
            self.syncs.append(f"{name} across devices")
        if name == "_to_copy" and "device" in kwargs and kwargs["device"] != args[0].device:
            self.syncs.append(f"{name} to another device")
        if name == "repeat_interleave" and kwargs.get("output_size") is None:
            self.syncs.append(f"{name} without output_size")
        return func(*args, **kwargs)


def _traced(call: Callable[[], object]) -> _Trace:
    with _Trace() as trace:
        call()
    return trace


def _kernels(trace: _Trace) -> list[str]:
    return sorted(op for op in trace.ops if op not in _VIEWS)


def _mixed_layout(small: int) -> list[Tensor]:
    """``small`` float32 tensors of 1, 64 and 100 elements, and one of each other kind: bf16 and
    complex64 (copied as they are), float8 and uint16 (viewed as words), large ones read in
    place (whole rows, a partial last row, transposed), empty and 0-dim."""
    generator = torch.Generator().manual_seed(5)
    tensors = [torch.randn((1, 64, 100)[i % 3], generator=generator) for i in range(small)]
    large = torch.randn(4099, 64, generator=generator)
    return [
        *tensors,
        torch.randn(30, generator=generator).bfloat16(),
        torch.randn(3, 3, generator=generator, dtype=torch.complex64),
        torch.randn(40, generator=generator).to(torch.float8_e5m2),
        torch.randint(0, 1 << 16, (50,), generator=generator).to(torch.uint16),
        large,
        large[:50, :63],
        large.t(),
        torch.randn(64 * 4096 + 5, generator=generator),
        torch.zeros(0, 3),
        torch.tensor(2.5),
    ]


def test_a_planned_call_has_no_host_sync_and_its_kernels_do_not_grow_with_the_tensors():
    """On a GPU each flagged op would be a host sync or a blocking copy; the steady state has
    none, and no constant (index, size, weight or multiplier tensor) is built or grown in it."""
    few, many = _mixed_layout(20), _mixed_layout(600)
    plan_few, plan_many = _digests.plan(few), _digests.plan(many)
    plan_few(few)
    steady_few = _traced(lambda: plan_few(few))
    steady_many = _traced(lambda: plan_many(many))
    assert steady_few.syncs == [] and steady_many.syncs == []
    assert _kernels(steady_few) == _kernels(steady_many)
    only_small_few, only_small_many = few[:20], many[:600]
    plan_small_few, plan_small_many = _digests.plan(only_small_few), _digests.plan(only_small_many)
    assert _kernels(_traced(lambda: plan_small_few(only_small_few))) == _kernels(
        _traced(lambda: plan_small_many(only_small_many))
    )
    # Only the rows read in place get their coefficients on each call (a block at a time).
    steady_small = _traced(lambda: plan_small_many(only_small_many))
    assert not {"arange", "randint", "bitwise_xor", "cumsum"} & set(steady_small.ops)
    assert not {"randint", "cumsum"} & set(steady_many.ops)
    # What the trace flags, each caught: the old per-call index and size tensors, reads.
    x = torch.arange(10.0)
    planted = _traced(
        lambda: (
            torch.tensor([1, 2]),
            x[[1, 2]],
            x[x > 3],
            float(x.sum()),
            torch.repeat_interleave(x.long()),
            x.nonzero(),
        )
    )
    assert planted.syncs == [
        "lift_fresh",
        "lift_fresh",
        "index with a boolean index",
        "_local_scalar_dense",
        "repeat_interleave without output_size",
        "nonzero",
    ]
    building = _traced(lambda: _digests.plan(few))
    assert {"lift_fresh", "arange", "bitwise_xor", "cumsum"} <= set(building.ops)


def _kept_bytes(plan: _digests.DigestPlan) -> int:
    """The bytes of the tensors a plan keeps (its parts' row owners, coefficients, weights)."""
    kept = [
        t
        for part in plan._parts
        for t in (part.weights, *(x for g in part.groups for x in (g.owner, g.coefficients)))
    ]
    return sum(t.numel() * t.element_size() for t in kept)


def test_a_plan_keeps_nothing_per_row_of_the_tensors_it_reads_in_place():
    """A plan's constants grow with the small tensors' rows only: the large ones' coefficients
    are made a block at a time, so a model of many GiB keeps a few KiB per plan for them."""
    generator = torch.Generator().manual_seed(6)
    large = [torch.randn(64 * 4096 * 3 + 7, generator=generator) for _ in range(2)]
    small = [torch.randn(100, generator=generator) for _ in range(8)]
    kept_large = _kept_bytes(_digests.plan(large))
    kept_small = _kept_bytes(_digests.plan(small))
    # The weights and the two partial last rows (copied): nothing per row read in place.
    assert kept_large <= 2 * 48 + 5 * 64 * 8 + 16, kept_large
    assert kept_small == 8 * 2 * 48 + 5 * 64 * 8  # two rows each (100 words), and the weights


def test_odd_weights_are_odd_and_fixed():
    assert _digests.odd_weight("copies", 0, 3, 1) == _digests.odd_weight("copies", 0, 3, 1)
    assert all(_digests.odd_weight(i) % 2 == 1 for i in range(100))
    assert len({_digests.odd_weight(i) for i in range(100)}) == 100
