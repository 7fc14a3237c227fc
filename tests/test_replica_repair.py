"""verify_replicas on tensors of every memory format, its repair all or nothing, and its arguments
checked to agree, at 4 real gloo ranks.

- Memory formats: a channels_last CNN and its AdamW state pass clean; a parameter, buffer or state
  of every kind a model or an optimizer holds (channels_last, channels_last_3d, transposed, an
  expanded buffer, views into a flat buffer at storage offsets that no 8- or 16-byte element
  would have, strided slices, 5 bools, a channels_last tensor large enough to be read in place)
  is checked, and repaired bit for bit from a strict majority, keeping its strides; in one
  process, the digests of each are those of its contiguous copy, planned for either.
- All or nothing: rank 3 restored from the wrong checkpoint (one bit off in every parameter,
  buffer and AdamW state of a channels_last conv, a transposed parameter and a 5-bool buffer)
  is repaired on every rank; a repair that cannot be written on one rank (its copy broadcasts a
  dim along which the source's values vary, or its rows overlap in memory) raises the same error
  on every rank and leaves every byte of every storage on every rank, and the optimizer's state,
  as they were.
- Memory shared with another tensor: an EMA buffer re-created by reference on rank 3
  (``m.ema = m.w.detach()``), AdamW's ``exp_avg_sq`` made ``exp_avg`` on rank 3, a row viewed at
  another offset on rank 3, and ``row`` a view of ``table`` on every rank with ``repair_from``
  naming a source whose row is corrupted: the check names the memory shared on some ranks only,
  the repair is refused on every rank with the same error, every byte left as it was; with
  memory of its own (``clone()``), or from a source whose bits agree where the tensors share
  memory, the repair goes on and every rank holds the bits before the plant, as it does for one
  state tensor under two names on every rank. In one process,
  the pairs of tensors found sharing memory against the bytes each occupies, enumerated.
- Arguments: ``repair_from``, ``repair`` or ``buffers`` that differ across ranks (one rank's
  ``repair_from`` outside the world too) raise the same ValueError on every rank, naming the
  argument and each rank's value, with nothing modified.

Oracles: each rank's raw bits of every tensor in row-major order and of every byte of its
storage, gathered from every rank and compared with ``torch.equal``; the bits before the plant;
every rank's message compared with rank 0's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from credit.parallel._common import aliasing as _aliasing
from credit.parallel._common.compat import local_tensor
from credit.parallel._replicas import digests as _digests
from credit.parallel.replicas import ReplicaMismatchError, verify_replicas

WORLD = 4
PLANTED = 3
_INTEGERS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _integers(tensor: Tensor) -> Tensor:
    """The elements of this rank's ``tensor`` as integers of their size (a view)."""
    local = local_tensor(tensor).detach()
    if local.element_size() == 16:
        return torch.view_as_real(local).view(torch.int64)
    return local.view(_INTEGERS[local.element_size()])


def _tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Tensor]:
    named = dict(model.named_parameters()) | dict(model.named_buffers())
    if optimizer is not None:
        names = {id(param): name for name, param in model.named_parameters()}
        for param, state in optimizer.state.items():
            named |= {f"{key} of {names[id(param)]}": value for key, value in state.items()}
    return named


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Every tensor's raw bits in row-major order, strides and storage offset, and every byte of
    its storage."""
    snapshot = {}
    for name, tensor in _tensors(model, optimizer).items():
        local = local_tensor(tensor).detach()
        storage = torch.empty(0, dtype=torch.uint8).set_(local.untyped_storage())
        bits = _integers(local).contiguous().view(-1).view(torch.uint8).clone()
        snapshot[name] = (bits, local.stride(), local.storage_offset(), storage.clone())
    return snapshot


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    def equal(x: Any, y: Any) -> bool:
        return torch.equal(x, y) if isinstance(x, Tensor) else x == y

    return a.keys() == b.keys() and all(
        all(equal(x, y) for x, y in zip(a[name], b[name], strict=True)) for name in a
    )


def _everyone(value: Any) -> list[Any]:
    gathered: list[Any] = [None] * WORLD
    dist.all_gather_object(gathered, value)
    return gathered


@torch.no_grad()
def _flip(tensors: list[Tensor]) -> None:
    """On the planted rank, flip the lowest bit of the first element of each tensor."""
    if dist.get_rank() == PLANTED:
        for tensor in tensors:
            ints = _integers(tensor)
            ints[(0,) * ints.dim()] ^= 1


def _attempt(call: Any) -> dict[str, Any]:
    try:
        report = call()
    except (ReplicaMismatchError, ValueError) as error:
        return {"raised": f"{type(error).__name__}: {error}"}
    return {"raised": None, "repaired": [(m.name, m.reference, m.ranks) for m in report.repaired]}


def _adamw(model: nn.Module, steps: int, loss: Any) -> torch.optim.AdamW:
    """AdamW after ``steps`` steps on gradients the same on every rank."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        loss().backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer


def _outcome(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Plant a flipped bit in every tensor on the planted rank; the check, the repair, and the
    bits of every rank after it against rank 0's and against the bits before the plant."""
    before = _snapshot(model, optimizer)
    _flip(list(_tensors(model, optimizer).values()))
    planted = _snapshot(model, optimizer)
    record: dict[str, Any] = {"check": _attempt(lambda: verify_replicas(model, optimizer))}
    record["check left alone"] = _same(planted, _snapshot(model, optimizer))
    return record | _repaired(model, optimizer, before, repair=True)


def _repaired(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, before: Any, **arguments: Any
) -> dict[str, Any]:
    """A repair with ``arguments``; every rank's bits after it against rank 0's and against
    ``before``; and a last check."""
    record = {"repair": _attempt(lambda: verify_replicas(model, optimizer, **arguments))}
    after = _snapshot(model, optimizer)
    record["restored"] = _same(before, after)
    record["as rank 0"] = _same(after, _everyone(after)[0])
    record["after"] = _attempt(lambda: verify_replicas(model, optimizer))
    return record


# --- memory formats --------------------------------------------------------------------------


class _Cnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.conv = nn.Conv2d(16, 16, 3)  # 2304 elements: whole rows of 64 words
        self.norm = nn.BatchNorm2d(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: Tensor) -> Tensor:
        x = self.norm(self.conv(self.stem(x).relu())).relu()
        return self.head(x.mean((2, 3)))


def _channels_last_cnn() -> dict[str, Any]:
    model = _Cnn().to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    x = x.to(memory_format=torch.channels_last)
    optimizer = _adamw(model, 2, lambda: model(x).pow(2).sum())
    exp_avg = optimizer.state[model.conv.weight]["exp_avg"]
    layouts = [
        model.conv.weight.is_contiguous(memory_format=torch.channels_last),
        exp_avg.is_contiguous(memory_format=torch.channels_last) and not exp_avg.is_contiguous(),
    ]
    report = verify_replicas(model, optimizer)
    return {
        "layouts": layouts,
        "clean": (report.tensors, report.compared, report.repaired),
        **_outcome(model, optimizer),
    }


def test_a_channels_last_cnn_and_its_adamw_state_are_checked_and_repaired(ranks):
    results = ranks.run(WORLD, _channels_last_cnn)
    for rank, record in enumerate(results):
        assert record["layouts"] == [True, True], f"rank {rank}"
        # 8 parameters, 3 BatchNorm buffers, 3 AdamW states of each parameter.
        assert record["clean"] == (35, 35, ()), f"rank {rank}"
        assert record["check"]["raised"].startswith("ReplicaMismatchError: verify_replicas: 35 of")
        assert record["check"]["raised"] == results[0]["check"]["raised"]
        assert record["check left alone"], f"rank {rank}"
        assert len(record["repair"]["repaired"]) == 35
        assert all(m[1:] == (0, (PLANTED,)) for m in record["repair"]["repaired"])
        assert record["restored"] and record["as rank 0"], f"rank {rank}"
        assert record["after"] == {"raised": None, "repaired": []}


class _EveryKind(nn.Module):
    """A tensor of every memory format and non-contiguous kind, the same bits on every rank."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        channels_last = torch.channels_last
        self.conv2d = nn.Parameter(torch.randn(16, 16, 3, 3).to(memory_format=channels_last))
        self.conv3d = nn.Parameter(
            torch.randn(8, 8, 2, 2, 2).to(memory_format=torch.channels_last_3d)
        )
        self.transposed = nn.Parameter(torch.randn(12, 16).t())  # whole rows: joined
        self.transposed_odd = nn.Parameter(torch.randn(5, 7, dtype=torch.float64).t())
        # Read in place, its last partial row copied with the small tensors.
        self.large = nn.Parameter(torch.randn(67, 65, 7, 9).to(memory_format=channels_last))
        flat = torch.randn(600)
        self.view_at_4_bytes = nn.Parameter(flat[1:129].view(2, 64))
        self.register_buffer("strided_view", flat[130:430:3])
        self.register_buffer("flat", flat)
        flat64 = torch.randn(200, dtype=torch.float64)
        self.register_buffer("view_at_8_bytes", flat64[1:66])
        self.register_buffer("complex_view", torch.view_as_complex(flat64[66:106].view(20, 2)))
        self.register_buffer("expanded", torch.randn(1, 64).expand(4, 64))
        self.register_buffer("expanded_odd", torch.randn(3, 1, 5).expand(3, 4, 5))
        self.register_buffer("bools", torch.rand(5) > 0.5)
        self.register_buffer("bools_transposed", (torch.rand(3, 4) > 0.5).t())
        self.register_buffer("bf16_slice", torch.randn(200).bfloat16()[::2])
        counts = torch.randint(-1000, 1000, (2, 3, 4, 5))
        self.register_buffer("int_channels_last", counts.to(memory_format=channels_last))

    def loss(self) -> Tensor:
        return torch.stack([p.double().pow(2).sum() for p in self.parameters()]).sum()


def _every_kind() -> dict[str, Any]:
    model = _EveryKind()
    optimizer = _adamw(model, 1, model.loss)
    strides = {name: local_tensor(t).stride() for name, t in _tensors(model, optimizer).items()}
    record = _outcome(model, optimizer)
    after = {name: local_tensor(t).stride() for name, t in _tensors(model, optimizer).items()}
    record["strides kept"] = strides == after
    record["kinds"] = [
        not model.transposed.is_contiguous(),
        model.expanded.stride() == (0, 1),
        model.view_at_4_bytes.storage_offset() == 1,
        model.view_at_8_bytes.storage_offset() == 1,
        model.strided_view.stride() == (3,),
        not optimizer.state[model.conv3d]["exp_avg"].is_contiguous(),
        not optimizer.state[model.transposed]["exp_avg_sq"].is_contiguous(),
    ]
    return record


def test_every_memory_format_and_non_contiguous_kind_is_checked_and_repaired(ranks):
    results = ranks.run(WORLD, _every_kind)
    for rank, record in enumerate(results):
        assert all(record["kinds"]), f"rank {rank}: {record['kinds']}"
        assert record["check"]["raised"] == results[0]["check"]["raised"]
        assert record["check"]["raised"].startswith("ReplicaMismatchError: verify_replicas: 34 of")
        assert record["check left alone"], f"rank {rank}"
        assert len(record["repair"]["repaired"]) == 34, record["repair"]
        assert record["restored"] and record["as rank 0"], f"rank {rank}"
        assert record["strides kept"], f"rank {rank}"
        assert record["after"] == {"raised": None, "repaired": []}


def _every_format() -> list[Tensor]:
    """Tensors of every memory format and non-contiguous kind, each beside its contiguous copy
    where the joined, padded and in-place paths read them."""
    torch.manual_seed(0)
    flat = torch.randn(700, dtype=torch.float64)
    return [
        torch.randn(16, 16, 3, 3).to(memory_format=torch.channels_last),  # joined
        torch.randn(8, 8, 2, 2, 2).to(memory_format=torch.channels_last_3d),
        torch.randn(3, 5, 2, 2).to(memory_format=torch.channels_last),  # padded
        torch.randn(67, 65, 7, 9).to(memory_format=torch.channels_last),  # in place
        torch.randn(12, 16).t(),
        torch.randn(1, 64).expand(4, 64),
        torch.randn(2, 1, 3).expand(2, 5, 3),
        flat[1:66],  # contiguous, at an offset of 8 bytes
        flat[100:400:3],
        torch.view_as_complex(flat[402:442].view(20, 2))[::2],
        (torch.rand(3, 4) > 0.5).t(),
        torch.randn(200).bfloat16()[::2],
    ]


def test_digests_are_of_the_values_in_row_major_order_whatever_the_memory_format():
    tensors = _every_format()
    contiguous = [t.contiguous() for t in tensors]
    assert [t.is_contiguous() for t in tensors].count(True) == 1
    expected = _digests.digests(contiguous)
    assert torch.equal(_digests.digests(tensors), expected)
    # A plan made for one memory format digests another of the same shapes.
    assert torch.equal(_digests.plan(contiguous)(tensors), expected)
    assert torch.equal(_digests.plan(tensors)(contiguous), expected)


# --- all or nothing --------------------------------------------------------------------------


class _Restored(nn.Module):
    """A channels_last conv, a transposed parameter and a buffer of 5 bools."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(4, 4, 3).to(memory_format=torch.channels_last)
        self.proj = nn.Parameter(torch.randn(6, 4).t())
        self.register_buffer("mask", torch.tensor([True, False, True, True, False]))

    def loss(self) -> Tensor:
        x = torch.randn(2, 4, 5, 5, generator=torch.Generator().manual_seed(1))
        y = self.conv(x.to(memory_format=torch.channels_last)).mean((2, 3))
        return (y @ self.proj).pow(2).sum()


def _wrong_checkpoint() -> dict[str, Any]:
    model = _Restored()
    return _outcome(model, _adamw(model, 2, model.loss))


def test_a_rank_restored_from_the_wrong_checkpoint_is_repaired_on_every_rank(ranks):
    results = ranks.run(WORLD, _wrong_checkpoint)
    repaired = results[0]["repair"]
    # conv.weight, conv.bias, proj, mask, and three AdamW states of each parameter.
    assert repaired["raised"] is None and len(repaired["repaired"]) == 13
    for rank, record in enumerate(results):
        assert record["repair"] == repaired, f"rank {rank}"
        assert record["restored"] and record["as rank 0"], f"rank {rank}"
        assert record["after"] == {"raised": None, "repaired": []}


def _unwritable() -> dict[str, Any]:
    """Rank 3's buffer broadcasts a dim along which the others' copies vary, beside a parameter
    and a bool buffer with a flipped bit and AdamW state that rank 3 lacks: every other group
    could be repaired, that one cannot."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    rows = torch.randn(3, 8)
    model.register_buffer("rows", rows[:1].expand(3, 8) if dist.get_rank() == PLANTED else rows)
    model.register_buffer("mask", torch.tensor([True, False, True, True, False]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    if dist.get_rank() != PLANTED:
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
    _flip([model.weight, model.mask])
    before = _snapshot(model, optimizer)
    record = _attempt(lambda: verify_replicas(model, optimizer, repair=True))
    record["unchanged"] = _same(before, _snapshot(model, optimizer))
    record["state"] = sorted(map(str, optimizer.state.get(model.weight, {})))
    return record


def _overlapping() -> dict[str, Any]:
    """Rank 3's buffer lets its elements share memory (rows overlapping, as ``as_strided`` can
    make them), beside a parameter with a flipped bit."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    window = torch.randn(10).as_strided((3, 4), (2, 1))
    model.register_buffer("window", window if dist.get_rank() == PLANTED else window.clone())
    _flip([model.weight, model.window])
    before = _snapshot(model, None)
    record = _attempt(lambda: verify_replicas(model, repair=True))
    record["unchanged"] = _same(before, _snapshot(model, None))
    return record


def test_a_repair_that_cannot_be_written_on_one_rank_raises_on_every_rank_modifying_nothing(
    ranks,
):
    for record in ranks.run(WORLD, _overlapping):
        assert record["raised"].startswith(
            "ReplicaMismatchError: verify_replicas: cannot repair the copies that differ: rank "
            "3's copy of window may hold elements that share memory (rank 3's strides: (2, 1))"
        ), record["raised"]
        assert record["unchanged"]
    results = ranks.run(WORLD, _unwritable)
    message = results[0]["raised"]
    assert message is not None and message.startswith(
        "ReplicaMismatchError: verify_replicas: cannot repair the copies that differ: rank 0's "
        "copy of rows (the source) varies along dim 0, which rank 3's copy broadcasts"
    ), message
    assert "Nothing was modified" in message
    for rank, record in enumerate(results):
        assert record["raised"] == message, f"rank {rank}"
        assert record["unchanged"], f"rank {rank}: a failed repair modified something"
        expected = [] if rank == PLANTED else ["exp_avg", "exp_avg_sq", "step"]
        assert record["state"] == expected, f"rank {rank}"


# --- memory shared with another tensor ------------------------------------------------------


def _shared(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    plant: Callable[[], None],
    refused_with: dict[str, Any],
    remedy: Callable[[], None],
    repaired_with: dict[str, Any],
) -> dict[str, Any]:
    """Plant; the check and a repair with the keywords ``refused_with``, both to leave every bit
    of every tensor and storage alone; then the remedy, a repair with ``repaired_with`` and a
    last check, and every rank's bits after it against rank 0's and against the bits before the
    plant."""
    before = _snapshot(model, optimizer)
    plant()
    planted = _snapshot(model, optimizer)
    record: dict[str, Any] = {"check": _attempt(lambda: verify_replicas(model, optimizer))}
    record["refused"] = _attempt(lambda: verify_replicas(model, optimizer, **refused_with))
    record["left alone"] = _same(planted, _snapshot(model, optimizer))
    remedy()
    return record | _repaired(model, optimizer, before, **repaired_with)


def _on_planted_rank(action: Callable[[], None]) -> Callable[[], None]:
    return lambda: action() if dist.get_rank() == PLANTED else None


class _WithEma(nn.Module):
    """A weight and its exponential moving average, a buffer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, 8))
        self.register_buffer("ema", self.w.detach().clone())


def _ema_by_reference() -> dict[str, Any]:
    """Rank 3 resumes with its EMA re-created by reference (``m.ema = m.w.detach()``), the
    others with a copy of their own; the remedy gives rank 3's EMA memory of its own."""
    model = _WithEma()
    optimizer = _adamw(model, 2, lambda: model.w.pow(2).sum())
    model.ema.lerp_(model.w.detach(), 0.1)

    def resume() -> None:
        model.ema = model.w.detach()

    def own_memory() -> None:
        model.ema = model.ema.clone()

    return _shared(
        model,
        optimizer,
        _on_planted_rank(resume),
        {"repair": True},
        _on_planted_rank(own_memory),
        {"repair": True},
    )


def _state_by_reference() -> dict[str, Any]:
    """Rank 3's AdamW state with ``state["exp_avg_sq"] = state["exp_avg"]`` after a step; the
    remedy gives its ``exp_avg_sq`` memory of its own."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    optimizer = _adamw(model, 1, lambda: model(torch.ones(2, 4)).pow(2).sum())
    state = optimizer.state[model.weight]

    def alias() -> None:
        state["exp_avg_sq"] = state["exp_avg"]

    def own_memory() -> None:
        state["exp_avg_sq"] = state["exp_avg_sq"].clone()

    return _shared(
        model,
        optimizer,
        _on_planted_rank(alias),
        {"repair": True},
        _on_planted_rank(own_memory),
        {"repair": True},
    )


def _state_aliased_everywhere() -> dict[str, Any]:
    """``state["exp_avg_sq"] = state["exp_avg"]`` on every rank, rank 3's flipped: one tensor
    under two names, repaired through either."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    optimizer = _adamw(model, 1, lambda: model(torch.ones(2, 4)).pow(2).sum())
    state = optimizer.state[model.weight]
    state["exp_avg_sq"] = state["exp_avg"]
    before = _snapshot(model, optimizer)
    _flip([state["exp_avg"]])
    check = _attempt(lambda: verify_replicas(model, optimizer))
    return {"check": check} | _repaired(model, optimizer, before, repair=True)


class _Table(nn.Module):
    """A table and its first row, both parameters: the row a view into the table."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Parameter(torch.randn(4, 8))
        self.row = nn.Parameter(self.table.detach()[0])


def _row_of_table() -> dict[str, Any]:
    """``row`` corrupted on rank 2 (so row 0 of its ``table`` too), ``table`` (row 2) on rank 3;
    a repair from ``repair_from=[2]``, then from ``repair_from=[0]``."""
    model = _Table()

    @torch.no_grad()
    def plant() -> None:
        if dist.get_rank() == 2:
            _integers(model.row)[1] ^= 1
        if dist.get_rank() == 3:
            _integers(model.table)[2, 3] ^= 1

    record = _shared(
        model,
        None,
        plant,
        {"repair": True, "repair_from": [2]},
        lambda: None,
        {"repair": True, "repair_from": [0]},
    )
    record["views"] = (
        model.row.untyped_storage().data_ptr() == model.table.untyped_storage().data_ptr()
    )
    return record


def _row_elsewhere() -> dict[str, Any]:
    """Rank 3's ``row`` re-made as a view of the table's row 1, the others' of row 0."""
    model = _Table()
    if dist.get_rank() == PLANTED:
        model.row = nn.Parameter(model.table.detach()[1])
    planted = _snapshot(model, None)
    record = {"check": _attempt(lambda: verify_replicas(model))}
    record["refused"] = _attempt(lambda: verify_replicas(model, repair=True))
    record["left alone"] = _same(planted, _snapshot(model, None))
    return record


def _expect_refused(results: list[dict[str, Any]], start: str) -> None:
    message = results[0]["refused"]["raised"]
    assert message is not None and message.startswith(start), message
    assert "Nothing was modified" in message
    for rank, record in enumerate(results):
        assert record["refused"]["raised"] == message, f"rank {rank}"
        assert record["check"]["raised"] == results[0]["check"]["raised"], f"rank {rank}"
        assert record["left alone"], f"rank {rank}: a refused repair modified something"


def _expect_repaired(results: list[dict[str, Any]], repaired: list[tuple[Any, ...]]) -> None:
    for rank, record in enumerate(results):
        assert record["repair"] == {"raised": None, "repaired": repaired}, f"rank {rank}"
        assert record["restored"] and record["as rank 0"], f"rank {rank}"
        assert record["after"] == {"raised": None, "repaired": []}, f"rank {rank}"


def test_a_copy_re_created_by_reference_on_one_rank_is_named_and_never_written_through(ranks):
    results = ranks.run(WORLD, _ema_by_reference)
    check = results[0]["check"]["raised"]
    assert "ema (rank 3 differs from rank 0; a strict majority holds rank 0's copy)" in check
    assert "ema shares memory with w on rank 3, not on ranks 0, 1, 2" in check
    _expect_refused(
        results,
        "ReplicaMismatchError: verify_replicas: cannot repair the copies that differ: rank 3's "
        "copy of ema shares memory with w, and rank 0's copy (the source) does not: writing ema "
        "would change w on rank 3",
    )
    _expect_repaired(results, [("ema", 0, (PLANTED,))])


def test_optimizer_state_aliased_on_one_rank_is_named_and_never_written_through(ranks):
    results = ranks.run(WORLD, _state_by_reference)
    check = results[0]["check"]["raised"]
    name = "exp_avg_sq of weight"
    assert f"{name} (rank 3 differs from rank 0; a strict majority holds rank 0's copy)" in check
    assert f"{name} shares memory with exp_avg of weight on rank 3, not on ranks 0, 1, 2" in check
    _expect_refused(
        results,
        "ReplicaMismatchError: verify_replicas: cannot repair the copies that differ: rank 3's "
        f"copy of {name} shares memory with exp_avg of weight, and rank 0's copy (the source) "
        f"does not: writing {name} would change exp_avg of weight on rank 3",
    )
    _expect_repaired(results, [(name, 0, (PLANTED,))])
    # The same tensor under both names on every rank: repaired as before.
    results = ranks.run(WORLD, _state_aliased_everywhere)
    assert "shares memory" not in results[0]["check"]["raised"]
    _expect_repaired(results, [("exp_avg of weight", 0, (PLANTED,)), (name, 0, (PLANTED,))])


def test_views_shared_alike_on_every_rank_never_spread_a_corrupted_source(ranks):
    results = ranks.run(WORLD, _row_of_table)
    assert "shares memory" not in results[0]["check"]["raised"]
    assert (
        "table (3 different copies: ranks 0, 1 / rank 2 / rank 3; no strict majority)"
        in results[0]["check"]["raised"]
    )
    _expect_refused(
        results,
        "ReplicaMismatchError: verify_replicas: cannot repair the copies that differ: the copies "
        "of ranks 0, 1, 3 of table share memory with row, as rank 2's copy (the source) does, "
        "but rank 2's row differs from theirs: writing table would change row on ranks 0, 1, 3; "
        "rank 2's copy of row shares memory with table, as rank 0's copy (the source) does, but "
        "rank 0's table differs from rank 2's: writing row would change table on rank 2",
    )
    # From rank 0's copies, the writes agree wherever the tensors share memory.
    assert all(record["views"] for record in results)
    _expect_repaired(results, [("table", 0, (2, 3)), ("row", 0, (2,))])
    # A view of another row on one rank: shared alike nowhere.
    results = ranks.run(WORLD, _row_elsewhere)
    assert (
        "row shares memory with table at different offsets on ranks 0, 1, 2 / rank 3"
        in results[0]["check"]["raised"]
    )
    _expect_refused(
        results,
        "ReplicaMismatchError: verify_replicas: cannot repair the copies that differ: rank 3's "
        "copy of row shares memory with table, otherwise than rank 0's copy (the source) does: "
        "writing row would change table on rank 3",
    )


def _sharing_cases() -> list[Tensor]:
    """Tensors that share memory in every way a model or an optimizer can make them."""
    torch.manual_seed(0)
    flat = torch.randn(64)
    wide = torch.randn(8, 6)
    other = torch.randn(64)
    return [
        flat,
        flat[:16],  # views cut one after the other
        flat[16:32].view(4, 4),
        flat[32:48:3],  # strided, inside the buffer
        flat[0::2][24:],  # interleaved with the next: no element in common
        flat[1::2][24:],
        flat[10:20],  # overlapping the first two views
        flat[40:44].view(torch.int32),  # another dtype of the same bytes
        wide,
        wide.t(),  # the same elements, transposed
        wide[:, 0],  # a column
        wide[:, 1],
        torch.randn(1, 6).expand(4, 6),  # broadcasting its own storage
        other,
        other,  # the same tensor twice
        other.view(torch.complex64),  # 8-byte elements over 4-byte ones
        flat[:0],  # empty: no memory
    ]


def _bytes_of(tensor: Tensor) -> set[tuple[int, int]]:
    """The bytes a tensor's elements occupy: (its storage's address, byte), by enumeration."""
    size = tensor.element_size()
    count = tensor.untyped_storage().nbytes() // size
    at = torch.arange(count).as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())
    starts = at.reshape(-1) * size
    address = tensor.untyped_storage().data_ptr()
    return {(address, int(start) + k) for start in starts for k in range(size)}


def test_tensors_that_share_memory_are_found_from_their_metadata():
    tensors = _sharing_cases()
    occupied = [_bytes_of(t) for t in tensors]
    expected = [
        (i, j)
        for i in range(len(tensors))
        for j in range(i + 1, len(tensors))
        if occupied[i] & occupied[j]
    ]
    assert _aliasing.sharing(tensors) == expected
    # The oracle's verdicts on the cases that tell: shared, and apart.
    assert {(0, 1), (0, 7), (1, 6), (2, 6), (8, 9), (9, 10), (13, 14), (13, 15)} <= set(expected)
    assert not {(1, 2), (4, 5), (10, 11), (1, 3)} & set(expected)
    assert not any(12 in pair or 16 in pair for pair in expected)


# --- arguments that must agree --------------------------------------------------------------


def _disagreeing(**per_rank: Any) -> dict[str, Any]:
    """Two copies against two of a weight, ``verify_replicas`` called with this rank's value of
    each argument in ``per_rank`` (a list indexed by rank)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    model.register_buffer("scale", torch.ones(3))
    if dist.get_rank() >= 2:
        _integers(model.weight)[0, 0] ^= 1
    before = _snapshot(model, None)
    mine = {name: values[dist.get_rank()] for name, values in per_rank.items()}
    record = _attempt(lambda: verify_replicas(model, **mine))
    record["unchanged"] = _same(before, _snapshot(model, None))
    return record


def _arguments() -> dict[str, dict[str, Any]]:
    return {
        "repair_from": _disagreeing(repair=[True] * 4, repair_from=[[0], [0], [0], [3]]),
        "repair": _disagreeing(repair=[True, False, False, False]),
        "buffers": _disagreeing(buffers=[True, True, False, True]),
        "out of the world": _disagreeing(repair=[True] * 4, repair_from=[[0], [0], [0], [4]]),
    }


def test_arguments_that_differ_across_ranks_raise_the_same_error_everywhere(ranks):
    results = ranks.run(WORLD, _arguments)
    expected = {
        "repair_from": "repair_from: [0] on ranks 0, 1, 2, [3] on rank 3",
        "repair": "repair: True on rank 0, False on ranks 1, 2, 3",
        "buffers": "buffers: True on ranks 0, 1, 3, False on rank 2",
        "out of the world": "repair_from: [0] on ranks 0, 1, 2, [4] on rank 3",
    }
    for case, part in expected.items():
        message = results[0][case]["raised"]
        assert message == (
            "ValueError: verify_replicas: the ranks passed different arguments, which must be "
            f"the same on every rank: {part}. Nothing was modified."
        ), message
        for rank, records in enumerate(results):
            assert records[case]["raised"] == message, f"{case}, rank {rank}"
            assert records[case]["unchanged"], f"{case}, rank {rank}"
