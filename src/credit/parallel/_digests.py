"""Bit-exact digests of tensors: four 64-bit numbers of their raw bits, computed where they live.

A tensor is read as a sequence of signed integer words ``x_0 .. x_{n-1}``: its raw bits 8, 16 or 32
at a time (one word per element up to 4-byte elements, two or four per larger element). Its
digest is four lanes, all mod 2^64::

    D0 = sum_j (2j + 1) x_j
    Dk = sum_j u_k(j // 64) a_k(j % 64) x_j        k = 1, 2, 3

with weights ``a_k`` drawn in [1, 2^16) and odd 64-bit row multipliers ``u_k``, pseudo-random and
the same in every process. Copies with the same bits have the same digest; copies that differ:

- by one flipped bit: some ``x_j`` changes by +-2^b (b < 32), so D0 by (2j + 1) 2^b, an odd number
  times a power of two below 2^64: never 0 mod 2^64. Detected with certainty.
- by two elements of at most 4 bytes swapped (``x_j <-> x_k``, unequal): D0 changes by
  2 (j - k) (x_k - x_j), whose factors of two number at most 1 + 30 + 31 < 64 for tensors under
  2^31 words. Detected with certainty.
- in any other way not chosen knowing the weights: each of D1, D2, D3 misses the difference with a
  probability of about 2^-16 (a weight would have to cancel it), independently, so about 2^-48 for
  the three. D0 alone misses some structured patterns (sign bits flipped in four neighbouring
  words, with alternating directions; two 8-byte elements swapped whose halves differ by opposite
  amounts), which the other lanes then catch with that probability.

The lanes come from float64 matrix products per (device, word width): the words, 64 to a row
(each tensor padded with zeros to whole rows), times a 64 x 5 matrix of small integer weights
(a row sum, the D0 weights ``2c + 1``, the three ``a_k``). Every product and partial sum is an
integer below 2^53 (64 words of at most 2^31 times weights below 2^16), so float64 computes them
exactly, in whatever order BLAS or cuBLAS adds them. The per-row results are combined in int64,
whose arithmetic wraps mod 2^64 on every device. A large tensor is read twice, where it lies:
converted to float64 a block of 2 MiB at a time, and multiplied; the small ones are first copied
together.
"""

from __future__ import annotations

import functools
import hashlib
import itertools

import torch
from torch import Tensor
from torch._utils import _flatten_dense_tensors

LANES = 4
_ROW = 64  # words per row
_RANDOM_LANES = LANES - 1
_WEIGHT_BOUND = 2**16
_ROWS_PER_BLOCK = 1 << 12  # rows converted to float64 at a time (2 MiB)
_WORD_TYPES = {1: torch.int8, 2: torch.int16}  # wider elements are read as 32-bit words


def digests(tensors: list[Tensor]) -> Tensor:
    """The digest of each tensor: int64, shape ``(len(tensors), LANES)``, on the first tensor's
    device (on the CPU when there is none)."""
    device = tensors[0].device if tensors else torch.device("cpu")
    result = torch.zeros(len(tensors), LANES, dtype=torch.int64, device=device)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for index, tensor in enumerate(tensors):
        groups.setdefault((tensor.device, tensor.dtype), []).append(index)
    for (where, _), indices in groups.items():
        lanes = _lanes([tensors[i] for i in indices], where)
        result[indices] = lanes.to(device)
    return result


def _words(tensor: Tensor) -> Tensor:
    """The raw bits of ``tensor`` as a flat tensor of signed 8-, 16- or 32-bit words."""
    flat = tensor.reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    return flat.view(_WORD_TYPES.get(flat.element_size(), torch.int32))


def _lanes(tensors: list[Tensor], device: torch.device) -> Tensor:
    """The lanes of each tensor (all on ``device``, of one dtype)."""
    words_per_element = max(1, tensors[0].dtype.itemsize // 4)  # see _words
    lengths = [tensor.numel() * words_per_element for tensor in tensors]
    rows_of = [-(-length // _ROW) for length in lengths]
    # Three kinds, each read in as few operations as it allows: a large tensor of whole rows
    # where it lies; the other tensors of whole rows in one flat copy; the rest in one flat copy
    # spread over rows padded with zeros.
    kinds = [
        0 if length % _ROW else (1 if length < _ROWS_PER_BLOCK * _ROW else 2) for length in lengths
    ]
    parts: dict[int, Tensor] = {}
    for kind in sorted(set(kinds)):
        members = [tensors[i] for i, k in enumerate(kinds) if k == kind]
        if kind == 2:
            parts[2] = torch.cat([_row_sums(_words(t).view(-1, _ROW)) for t in members])
            continue
        flat = _words(_flatten_dense_tensors(members) if len(members) > 1 else members[0])
        if kind == 0:
            member_lengths = [n for n, k in zip(lengths, kinds, strict=True) if k == 0]
            flat = _padded(flat, member_lengths, device)
        parts[kind] = _row_sums(flat.view(-1, _ROW))
    if len(parts) == 1:
        (sums,) = parts.values()
    else:  # the parts' rows back in the tensors' order (a permutation: no host sync)
        row_kinds = _repeat(torch.tensor(kinds, device=device), rows_of, device)
        order = torch.argsort(row_kinds, stable=True)
        sums = torch.empty(sum(rows_of), 2 + _RANDOM_LANES, dtype=torch.float64, device=device)
        sums[order] = torch.cat([parts[kind] for kind in sorted(parts)])
    return _combine(sums.to(torch.int64), rows_of, device)


def _repeat(values: Tensor, counts: list[int], device: torch.device) -> Tensor:
    """Each of ``values`` ``counts`` times, with the size known on the host (no sync)."""
    return torch.repeat_interleave(
        values, torch.tensor(counts, device=device), output_size=sum(counts)
    )


def _padded(flat: Tensor, lengths: list[int], device: torch.device) -> Tensor:
    """``flat`` (word sequences of ``lengths``, one after the other) with each sequence padded
    with zeros to whole rows: one index operation."""
    padding = [-length % _ROW for length in lengths]
    shifts = torch.tensor([0, *itertools.accumulate(padding)][:-1], device=device)
    positions = torch.arange(flat.numel(), device=device) + _repeat(shifts, lengths, device)
    rows = flat.new_zeros(sum(lengths) + sum(padding))
    rows[positions] = flat
    return rows


def _row_sums(rows: Tensor) -> Tensor:
    """``rows`` (integer words) times the weights: converted to float64 a block of rows at a
    time."""
    weights = _weights(rows.device)
    out = torch.empty(rows.shape[0], 2 + _RANDOM_LANES, dtype=torch.float64, device=rows.device)
    for start in range(0, rows.shape[0], _ROWS_PER_BLOCK):
        block = rows[start : start + _ROWS_PER_BLOCK].to(torch.float64)
        torch.mm(block, weights, out=out[start : start + _ROWS_PER_BLOCK])
    return out


def _combine(sums: Tensor, rows_of: list[int], device: torch.device) -> Tensor:
    """Each tensor's lanes from its rows' sums (int64, wrapping): the row ``r`` of a tensor adds
    ``2 * 64 * r * (row sum) + (its D0 sum)`` to D0 and ``u_k(r) * (its Dk sum)`` to Dk."""
    owner = _repeat(torch.arange(len(rows_of), device=device), rows_of, device)
    starts = torch.tensor([0, *itertools.accumulate(rows_of)][:-1], device=device)
    row = torch.arange(sums.shape[0], dtype=torch.int64, device=device) - starts[owner]
    per_row = torch.empty(sums.shape[0], LANES, dtype=torch.int64, device=device)
    per_row[:, 0] = 2 * _ROW * row * sums[:, 0] + sums[:, 1]
    longest = max(rows_of, default=0)
    for lane in range(1, LANES):
        per_row[:, lane] = _multipliers(longest, lane, device)[row] * sums[:, 1 + lane]
    lanes = torch.zeros(len(rows_of), LANES, dtype=torch.int64, device=device)
    return lanes.index_add_(0, owner, per_row)


@functools.cache
def _weights(device: torch.device) -> Tensor:
    """The 64 x 5 weights: ones, ``2c + 1``, and three columns drawn in [1, 2^16)."""
    generator = torch.Generator().manual_seed(0xD16E57)
    drawn = torch.randint(1, _WEIGHT_BOUND, (_ROW, _RANDOM_LANES), generator=generator)
    column = torch.arange(_ROW)
    weights = torch.cat([torch.ones(_ROW, 1), (2 * column + 1)[:, None], drawn], dim=1)
    return weights.to(torch.float64).to(device)


def odd_weight(*key: object) -> int:
    """An odd 64-bit number that depends on ``key`` only, the same in every process."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") | 1


def _signed(value: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


# splitmix64's constants (Steele, Lea and Flood), as int64.
_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX_1 = _signed(0xBF58476D1CE4E5B9)
_MIX_2 = _signed(0x94D049BB133111EB)


def _shift_right(values: Tensor, bits: int) -> Tensor:
    """The logical right shift of int64 values (torch's ``>>`` keeps the sign)."""
    return (values >> bits) & ((1 << (64 - bits)) - 1)


_multiplier_tables: dict[tuple[int, torch.device], Tensor] = {}


def _multipliers(rows: int, lane: int, device: torch.device) -> Tensor:
    """``u_lane(r)`` for ``r < rows`` at least, from a table kept per device (grown as needed)."""
    table = _multiplier_tables.get((lane, device))
    if table is None or table.numel() < rows:
        size = max(rows, 2 * table.numel() if table is not None else 1 << 12)
        table = _odd_multipliers(torch.arange(size, dtype=torch.int64, device=device), lane)
        _multiplier_tables[(lane, device)] = table
    return table


def _odd_multipliers(rows: Tensor, lane: int) -> Tensor:
    """``u_lane(r)`` for each row index ``r``: odd pseudo-random int64s (splitmix64)."""
    z = (rows + lane * (1 << 40)) * _GOLDEN
    z = (z ^ _shift_right(z, 30)) * _MIX_1
    z = (z ^ _shift_right(z, 27)) * _MIX_2
    return (z ^ _shift_right(z, 31)) | 1
