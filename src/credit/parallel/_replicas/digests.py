"""Bit-exact digests of tensors: four 64-bit numbers of their raw bits, computed where they live.

A tensor is read as a sequence of signed integer words ``x_0 .. x_{n-1}``: its raw bits 8, 16 or 32
at a time (one word per element up to 4-byte elements, two or four per larger element; complex32,
a 4-byte element, is one word), its elements in row-major order whatever its strides. The digest is
of the values, not of the memory: copies with the same bits in another memory format
(channels_last, transposed, expanded, a view into a larger buffer) have the same digest, as a
repair writes its source's elements in that order into any strides. Its digest is four lanes, all
mod 2^64::

    D0 = sum_j (2j + 1) x_j
    Dk = sum_j u_k(j // 64) a_k(j % 64) x_j        k = 1, 2, 3

with weights ``a_k`` drawn in [1, 2^16) and odd 64-bit row multipliers ``u_k``, pseudo-random and
the same in every process. Copies with the same bits have the same digest; copies that differ:

- by one flipped bit: some ``x_j`` changes by +-2^b (b < 32), so D0 by (2j + 1) 2^b, an odd number
  times a power of two below 2^64: never 0 mod 2^64. Detected with certainty.
- by two elements of at most 4 bytes swapped (``x_j <-> x_k``, unequal): D0 changes by
  2 (j - k) (x_k - x_j), whose factors of two number at most 1 + 31 + 31 < 64 for tensors under
  2^32 words. Detected with certainty.
- in any other way not chosen knowing the weights: each of D1, D2, D3 misses the difference with a
  probability of about 2^-16 (a weight would have to cancel it), independently, so about 2^-48 for
  the three. D0 alone misses some structured patterns (sign bits flipped in four neighbouring
  words, with alternating directions; two 8-byte elements swapped whose halves differ by opposite
  amounts), which the other lanes then catch with that probability.

How they are computed. The words are laid 64 to a row (each tensor padded with zeros to whole
rows) and multiplied, as float64, by a 64 x 5 matrix of small integer weights (a row sum, the D0
weights ``2c + 1``, the three ``a_k``). Every product and partial sum is an integer of magnitude
below 64 * 2^31 * 2^16 = 2^53, so float64 computes them exactly, in whatever order BLAS or cuBLAS
adds them. Row ``r`` of a tensor then adds, in int64 (whose arithmetic wraps mod 2^64 on every
device), ``2 * 64 * r * (row sum) + (its D0 sum)`` to D0 and ``u_k(r) * (its Dk sum)`` to Dk.

A :class:`DigestPlan`, built once per layout (the tensors' dtypes, shapes and devices), holds
everything that does not depend on the values, on the tensors' devices: which tensors are copied
together and where the zero padding goes, each copied row's tensor and coefficients ``(2 * 64 *
r, 1, u_1(r), u_2(r), u_3(r))`` for its row index ``r``, and the weights. Applying it reads no
value back to the host and builds no tensor from host data, and the kernels it runs grow with the
bytes, the dtypes and the tensors' trailing shapes, not with the number of tensors: the small
tensors of one dtype are copied together a block of rows at a time (2 MiB of float64 on a CPU,
32 MiB elsewhere), those of one trailing shape that fill whole rows joined along their first
dimension (one ``cat``), the others flattened with their padding (one more); a tensor of at least
4096 rows is read where it lies (its last partial row copied with the small ones); a
non-contiguous tensor is first copied in row-major order (a large one whole, once per call; the
rows joined by ``cat`` once more where their tensors share a memory format such as
channels_last, which ``cat`` keeps), contiguous ones never; each block is
converted to float64 while it is still in cache and multiplied; and the rows' results are
weighted and added up per tensor (one ``index_add_`` per group). The rows read in place get their
coefficients a block at a time, on each call (a few elementwise kernels per block), so that
neither what a plan keeps nor what a call allocates grows with the large tensors: a plan keeps
48 bytes per copied row of 64 words (the small tensors' rows only), and a call holds about one
block of copied words and one of float64, beside the copied rows' results (five float64 and five
int64 numbers per 64 words).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch._utils import _flatten_dense_tensors

__all__ = ["LANES", "DigestPlan", "digests", "hashed", "odd_weight", "plan"]

LANES = 4
_ROW = 64  # words per row
_RANDOM_LANES = LANES - 1
_COLUMNS = 2 + _RANDOM_LANES  # per row: the row sum, the D0 sum, the three Dk sums
_WEIGHT_BOUND = 2**16
# A tensor of at least this many rows (1 MiB of 32-bit words) is read where it lies, not copied.
_IN_PLACE_ROWS = 1 << 12
# Rows converted to float64 at a time: 2 MiB on a CPU (the block stays in cache for the product),
# 32 MiB elsewhere (fewer launches; a GPU streams it at full bandwidth).
_CPU_BLOCK_ROWS = 1 << 12
_DEVICE_BLOCK_ROWS = 1 << 16
_INTEGERS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Dtypes whose tensors are copied together as they are: torch copies them bit for bit under any
# strides, on every device. The others are first viewed as their words, one view per tensor:
# complex32, float8, unsigned, sub-byte and bit types (some have no copy kernel), and bool (a copy
# writes any nonzero byte as 1, which would hide a flipped bit).
_COPIED_AS_THEY_ARE = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.complex128,
        torch.complex64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
    }
)


def digests(tensors: Sequence[Tensor]) -> Tensor:
    """The digest of each tensor: int64, shape ``(len(tensors), LANES)``, on the first tensor's
    device (on the CPU when there is none). Builds a :class:`DigestPlan` and applies it; a caller that
    digests the same layout again keeps the plan instead."""
    return plan(tensors)(tensors)


def plan(tensors: Sequence[Tensor], device: torch.device | None = None) -> DigestPlan:
    """The plan that digests tensors of the layout of ``tensors`` (their dtypes, shapes and
    devices, in order): built once, applied to each call's tensors of that layout.

    Args:
        tensors: tensors of the layout.
        device: where the digests go. Default: the first tensor's device (the CPU when there is
            none).

    Raises:
        ValueError: a tensor is not a dense strided tensor.
        TypeError: a tensor is quantized (its values are not its raw bits alone).
    """
    return DigestPlan(tensors, device)


class DigestPlan:
    """Digests of tensors of one layout, with every constant it needs on the tensors' devices.

    Calling it with tensors of that layout returns their digests, int64 of shape
    ``(len(tensors), LANES)`` on the plan's device, with no host sync: no value read back, no
    tensor built from host data. Tensors on another device have their lanes moved to it, one
    copy per such device: from the CPU without blocking (CPU tensors beside CUDA ones are AdamW's
    step counts, which torch keeps on the CPU), from a GPU with a blocking copy, which only a
    plan whose device is the CPU makes.

    Attributes:
        nbytes: the bytes of the tensors it digests.
    """

    def __init__(self, tensors: Sequence[Tensor], device: torch.device | None = None) -> None:
        for position, tensor in enumerate(tensors):
            if tensor.layout != torch.strided:
                raise ValueError(f"tensor {position} is of layout {tensor.layout}: dense only")
            if tensor.is_quantized:
                raise TypeError(
                    f"tensor {position} is quantized ({tensor.dtype}): its scale and zero point "
                    "are not among its raw bits"
                )
        self._dtypes = [tensor.dtype for tensor in tensors]
        self._shapes = [tensor.shape for tensor in tensors]
        self.nbytes = sum(tensor.numel() * tensor.element_size() for tensor in tensors)
        first = tensors[0].device if tensors else torch.device("cpu")
        self._device = device if device is not None else first
        on: dict[torch.device, list[int]] = {}
        for position, tensor in enumerate(tensors):
            if tensor.numel():
                on.setdefault(tensor.device, []).append(position)
        self._parts = [
            _DevicePart.build(positions, self._dtypes, self._shapes, device)
            for device, positions in on.items()
        ]

    def __call__(self, tensors: Sequence[Tensor]) -> Tensor:
        """The digests of ``tensors``, which must have the plan's layout.

        Raises:
            ValueError: ``tensors`` do not have the layout the plan was built for.
        """
        self._check(tensors)
        count = len(tensors)
        with torch.inference_mode():  # no autograd bookkeeping on its many views and copies
            parts = [part.sums(tensors, count) for part in self._parts]
        # Outside inference mode: a normal tensor, which the caller may update in place.
        total = torch.zeros(_COLUMNS, count, dtype=torch.int64, device=self._device)
        for sums in parts:
            total += _moved(sums, self._device)
        # D0 = sum 2 * 64 * r * (row sum) + sum (D0 row sum); Dk = sum u_k(r) (Dk row sum)
        return torch.stack([total[0] + total[1], *total[2:]], dim=1)

    def _check(self, tensors: Sequence[Tensor]) -> None:
        dtypes = [tensor.dtype for tensor in tensors]
        shapes = [tensor.shape for tensor in tensors]
        if dtypes == self._dtypes and shapes == self._shapes:
            return
        if len(tensors) != len(self._dtypes):
            raise ValueError(
                f"the plan digests {len(self._dtypes)} tensors, got {len(tensors)}: "
                "build a plan for this layout"
            )
        position = next(
            i
            for i, (dtype, shape) in enumerate(zip(dtypes, shapes, strict=True))
            if (dtype, shape) != (self._dtypes[i], self._shapes[i])
        )
        raise ValueError(
            f"tensor {position} is {dtypes[position]} of shape {tuple(shapes[position])}; the "
            f"plan was built for {self._dtypes[position]} of shape "
            f"{tuple(self._shapes[position])}: build a plan for this layout"
        )


def _moved(sums: Tensor, device: torch.device) -> Tensor:
    """``sums`` on ``device``: from the CPU without blocking (the copy is queued on the
    device's stream), from a GPU to the CPU with a blocking copy."""
    if sums.device == device:
        return sums
    moved = torch.empty(sums.shape, dtype=sums.dtype, device=device)
    return moved.copy_(sums, non_blocking=sums.device.type == "cpu")


_Member = tuple[int, int, int]  # position, first word, the word after the last
_Item = tuple[int, int] | Tensor  # a member, (position, first word), or a zero tensor: padding


@dataclass(frozen=True)
class _Chunk:
    """At most one block of rows of a group, copied together.

    ``joined``: its members are tensors of one trailing shape whose words fill whole rows, joined
    by one ``cat`` along their first dimension (no view per tensor). Otherwise each member is
    followed by its padding, and they are flattened together.
    """

    joined: bool
    items: tuple[_Item, ...]


@dataclass(frozen=True)
class _Group:
    """Tensors (or the last partial rows of large ones) copied together into rows of words, each
    padded with zeros to whole rows, a chunk of at most one block of rows at a time (so that the
    copy is still in cache when it is converted and multiplied).

    A member is copied as it is (``viewed`` False; its first word is 0), or its words from the
    first on (``viewed`` True). ``owner`` gives each row's tensor, ``coefficients`` what the
    row's five sums are multiplied by (those of its row index in that tensor).
    """

    chunks: tuple[_Chunk, ...]
    viewed: bool
    word: torch.dtype
    owner: Tensor  # (rows,) int64
    coefficients: Tensor  # (5, rows) int64

    def rows(self, tensors: Sequence[Tensor], chunk: _Chunk) -> Tensor:
        """The rows of words of one chunk."""
        if chunk.joined:
            joined = torch.cat(
                [tensors[item[0]] for item in chunk.items if isinstance(item, tuple)]
            )
            if not joined.is_contiguous():  # cat keeps a memory format its tensors share
                joined = joined.contiguous()
            return joined.view(self.word).view(-1, _ROW)
        if self.viewed:
            parts = [
                _words(tensors[item[0]])[item[1] :] if isinstance(item, tuple) else item
                for item in chunk.items
            ]
        else:
            parts = [tensors[item[0]] if isinstance(item, tuple) else item for item in chunk.items]
        return _flatten_dense_tensors(parts).view(self.word).view(-1, _ROW)


@dataclass(frozen=True)
class _DevicePart:
    """What the tensors on one device need: their groups, the tensors read where they lie
    (position, whole rows), and the weights. The coefficients of the rows read in place are made
    a block at a time on each call, so that what a plan keeps does not grow with them."""

    groups: list[_Group]
    in_place: list[tuple[int, int]]
    weights: Tensor  # (5, 64) float64
    block_rows: int

    @classmethod
    def build(
        cls,
        positions: list[int],
        dtypes: list[torch.dtype],
        shapes: list[torch.Size],
        device: torch.device,
    ) -> _DevicePart:
        """The part of the tensors at ``positions`` (on ``device``, none empty), of ``dtypes`` and
        ``shapes`` (of every tensor)."""
        members: dict[tuple[torch.dtype, bool], list[_Member]] = {}
        in_place: list[tuple[int, int]] = []
        for position in positions:
            dtype = dtypes[position]
            length = shapes[position].numel() * _words_per_element(dtype)
            if length >= _IN_PLACE_ROWS * _ROW:
                in_place.append((position, length // _ROW))
                if length % _ROW:  # the last partial row, copied with the small tensors
                    first = length - length % _ROW
                    key = (_word_dtype(dtype), True)
                    members.setdefault(key, []).append((position, first, length))
            elif dtype in _COPIED_AS_THEY_ARE:
                members.setdefault((dtype, False), []).append((position, 0, length))
            else:
                members.setdefault((_word_dtype(dtype), True), []).append((position, 0, length))
        most = max(  # rows a block ever holds: a tensor read in place, or a whole group
            [rows for _, rows in in_place]
            + [
                sum(-(-(stop - first) // _ROW) for _, first, stop in found)
                for found in members.values()
            ]
        )
        block_rows = min(most, _CPU_BLOCK_ROWS if device.type == "cpu" else _DEVICE_BLOCK_ROWS)
        groups = [
            _group(found, dtype, viewed, shapes, device, block_rows)
            for (dtype, viewed), found in members.items()
        ]
        return cls(
            groups=groups, in_place=in_place, weights=_weights(device), block_rows=block_rows
        )

    def sums(self, tensors: Sequence[Tensor], count: int) -> Tensor:
        """Per tensor, its rows' five sums times their coefficients, added up: int64 ``(5,
        count)`` (zero for the tensors on other devices)."""
        device = self.weights.device
        total = torch.zeros(_COLUMNS, count, dtype=torch.int64, device=device)
        block = torch.empty(self.block_rows, _ROW, dtype=torch.float64, device=device)
        for group in self.groups:
            sums = torch.empty(group.coefficients.shape, dtype=torch.float64, device=device)
            start = 0
            for chunk in group.chunks:
                rows = group.rows(tensors, chunk)
                self._multiply(rows, block, sums[:, start : start + rows.shape[0]])
                start += rows.shape[0]
            products = sums.to(torch.int64).mul_(group.coefficients)
            total.index_add_(1, group.owner, products)
        sums = torch.empty(_COLUMNS, self.block_rows, dtype=torch.float64, device=device)
        for position, rows_in_place in self.in_place:
            words = _words(tensors[position])[: rows_in_place * _ROW].view(-1, _ROW)
            for start in range(0, rows_in_place, self.block_rows):
                rows = words[start : start + self.block_rows]
                out = sums[:, : rows.shape[0]]
                self._multiply(rows, block, out)
                index = torch.arange(start, start + rows.shape[0], device=device)
                products = out.to(torch.int64).mul_(_coefficients_at(index))
                total[:, position].add_(products.sum(1))
        return total

    def _multiply(self, rows: Tensor, block: Tensor, out: Tensor) -> None:
        """``out`` = the weights times ``rows`` (integer words, at most a block), exactly:
        converted to float64 in ``block``, then 5 x 64 by 64 x rows (the faster product on
        MKL)."""
        converted = block[: rows.shape[0]].copy_(rows)
        torch.mm(self.weights, converted.t(), out=out)


def _group(
    found: list[_Member],
    dtype: torch.dtype,
    viewed: bool,
    shapes: list[torch.Size],
    device: torch.device,
    block_rows: int,
) -> _Group:
    """The group of ``found``, copied as ``dtype`` (its words when ``viewed``) in chunks of at
    most ``block_rows`` rows: tensors of one trailing shape that fill whole rows joined, the
    others each with its padding; with its rows' tensor and coefficients (those of each row's
    index in its tensor), on ``device``."""
    per_element = 1 if viewed else _words_per_element(dtype)
    zeros = torch.zeros((_ROW - 1) // per_element, dtype=dtype, device=device)
    joinable: dict[tuple[int, ...], list[_Member]] = {}
    padded: list[_Member] = []
    for member in found:
        position, first, stop = member
        shape = shapes[position]
        if not viewed and shape and (stop - first) % _ROW == 0:
            joinable.setdefault(tuple(shape[1:]), []).append(member)
        else:
            padded.append(member)
    chunks: list[_Chunk] = []
    ordered: list[_Member] = []  # the members in the order their rows are laid
    for joined, members in [*((True, m) for m in joinable.values()), (False, padded)]:
        for chunk in _chunked(members, block_rows):
            items: list[_Item] = []
            for position, first, stop in chunk:
                items.append((position, first))
                padding = -(stop - first) % _ROW
                if padding:
                    items.append(zeros[: padding // per_element])
            chunks.append(_Chunk(joined, tuple(items)))
            ordered += chunk
    positions = torch.tensor([position for position, _, _ in ordered])
    first_rows = torch.tensor([first // _ROW for _, first, _ in ordered])
    counts = torch.tensor([-(-(stop - first) // _ROW) for _, first, stop in ordered])
    owner = torch.repeat_interleave(positions, counts)
    starts = torch.cumsum(counts, 0) - counts  # each member's first row in the group
    row_of = torch.arange(int(counts.sum())) - torch.repeat_interleave(starts - first_rows, counts)
    coefficients = _coefficients_at(row_of.to(device))
    return _Group(tuple(chunks), viewed, _word_dtype(dtype), owner.to(device), coefficients)


def _chunked(members: list[_Member], block_rows: int) -> list[list[_Member]]:
    """``members`` in order, cut into runs of at most ``block_rows`` rows (a member whole)."""
    chunks: list[list[_Member]] = []
    rows_in_chunk = block_rows
    for member in members:
        rows = -(-(member[2] - member[1]) // _ROW)
        if rows_in_chunk + rows > block_rows:
            chunks.append([])
            rows_in_chunk = 0
        rows_in_chunk += rows
        chunks[-1].append(member)
    return chunks


def _word_dtype(dtype: torch.dtype) -> torch.dtype:
    """The signed integer type of the words of a ``dtype`` tensor (see :func:`_words`)."""
    return _INTEGERS[min(dtype.itemsize, 4)]


def _words_per_element(dtype: torch.dtype) -> int:
    """How many words :func:`_words` reads from each element of a ``dtype`` tensor."""
    return dtype.itemsize // _word_dtype(dtype).itemsize


def _words(tensor: Tensor) -> Tensor:
    """The raw bits of ``tensor`` as a flat tensor of signed 8-, 16- or 32-bit words: its elements
    in row-major order, the bytes of each as the device stores them, a word at a time.

    Viewed first as the integer type of the element's size (a view under any strides, for every
    dtype), so that the copy a non-contiguous tensor needs is an integer copy; a contiguous
    tensor is read where it lies.
    """
    size = tensor.element_size()
    same_size = tensor.view(_INTEGERS[size]) if size in _INTEGERS else tensor
    return same_size.contiguous().view(-1).view(_word_dtype(tensor.dtype))


def _weights(device: torch.device) -> Tensor:
    """The 5 x 64 weights: ones, ``2c + 1``, and three rows drawn in [1, 2^16)."""
    generator = torch.Generator().manual_seed(0xD16E57)
    drawn = torch.randint(1, _WEIGHT_BOUND, (_ROW, _RANDOM_LANES), generator=generator)
    column = torch.arange(_ROW)
    weights = torch.cat([torch.ones(1, _ROW), (2 * column + 1)[None], drawn.t()])
    return weights.to(torch.float64).to(device)


def _coefficients_at(index: Tensor) -> Tensor:
    """Per row index ``r`` of ``index`` (int64, a column each), what its five sums are multiplied
    by: ``2 * 64 * r`` (the row sum, toward D0), 1 (the D0 sum) and ``u_1(r), u_2(r), u_3(r)``."""
    lanes = [_odd_multipliers(index, lane) for lane in range(1, LANES)]
    return torch.stack([2 * _ROW * index, torch.ones_like(index), *lanes])


def odd_weight(*key: object) -> int:
    """An odd 64-bit number that depends on ``key`` only, the same in every process."""
    return hashed(key, 1)[0] | 1


def hashed(key: object, words: int) -> list[int]:
    """``words`` unsigned 64-bit numbers that depend on ``key`` only, the same in every process."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8 * words).digest()
    return [int.from_bytes(digest[8 * k : 8 * k + 8], "little") for k in range(words)]


def signed(value: int) -> int:
    """``value`` mod 2^64, as the int64 with the same bits."""
    value %= 1 << 64
    return value - (1 << 64) if value >= 1 << 63 else value


# splitmix64's increment and its finaliser's multipliers (Steele, Lea and Flood), as int64.
GOLDEN = signed(0x9E3779B97F4A7C15)
_MIX_1 = signed(0xBF58476D1CE4E5B9)
_MIX_2 = signed(0x94D049BB133111EB)


def mix(z: Tensor) -> Tensor:
    """splitmix64's finaliser on int64 values (wrapping arithmetic, logical shifts)."""
    z = (z ^ _shift_right(z, 30)) * _MIX_1
    z = (z ^ _shift_right(z, 27)) * _MIX_2
    return z ^ _shift_right(z, 31)


def _shift_right(values: Tensor, bits: int) -> Tensor:
    """The logical right shift of int64 values (torch's ``>>`` keeps the sign)."""
    return (values >> bits) & ((1 << (64 - bits)) - 1)


def _odd_multipliers(rows: Tensor, lane: int) -> Tensor:
    """``u_lane(r)`` for each row index ``r``: odd pseudo-random int64s (splitmix64)."""
    return mix((rows + lane * (1 << 40)) * GOLDEN) | 1
