"""The spike policy at its edges, at 4 real gloo ranks: a loss some ranks lack, an argument one
rank gets wrong, and the calls a trainer makes in the wrong order.

Each case either works, with the same bits on every rank, or raises the same error on every
rank with no gradient modified, after which the trainer goes on (``update()``, then ordinary
steps) without a collective mismatch. The oracle of a loss is every rank's own loss, gathered
in the test: the average of those given, in float64, rounded to float32 (the policy sums in
float64 too, in the collective's order: within 1 float32 ULP).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from support.amp_layouts import Layout, batch, build, local_bits
from torch import Tensor

from credit.parallel.amp import GradScaler
from credit.parallel.spikes import SpikePolicy

WARMUP = 3
SPIKE_STEP = 5
STEPS = 7
LossOf = Callable[[int, Tensor], object]


class _Trainer:
    """A DDP model (or the layout given) stepped through a scaler holding a policy."""

    def __init__(
        self, name: str = "ddp", scaling: bool = False, spike_step: int | None = SPIKE_STEP
    ) -> None:
        self.layout: Layout = build(name)
        self.optimizer = torch.optim.SGD(self.layout.model.parameters(), lr=0.01)
        self.policy = SpikePolicy(warmup=WARMUP)
        self.scaler = GradScaler("cpu", scaling=scaling, spikes=self.policy)
        self.step = 0
        self.spike_step = spike_step

    def backward(self) -> Tensor:
        weight = 1e3 if self.step == self.spike_step else 1.0
        loss = self.layout.model(batch(self.layout, self.step)).pow(2).mean() * weight
        self.scaler.scale(loss).backward()
        return loss.detach()

    def train(self, loss_of: LossOf, steps: int) -> list[dict]:
        """``steps`` ordinary steps, the policy given ``loss_of(step, loss)``; each step's
        figures and whether it was skipped."""
        records = []
        for _ in range(steps):
            loss = self.backward()
            self.scaler.unscale_(self.optimizer)
            self.policy.clip_grad_norm_(
                self.layout.model.parameters(),
                loss=loss_of(self.step, loss),
                **self.layout.clip_kwargs,
            )
            records.append({"local loss": loss, **self.policy.metrics()})
            self.finish()
            records[-1]["skipped"] = self.scaler.last_step_skipped
        return records

    def finish(self) -> None:
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad()
        self.step += 1

    def refused(self, call: Callable[[], object]) -> dict:
        """Call the policy's clip the wrong way after a backward: the error it raised, whether
        the gradients kept their bits, and whether the trainer goes on afterwards."""
        self.backward()
        self.scaler.unscale_(self.optimizer)
        before = _grad_bits(self)
        try:
            call()
        except Exception as error:  # the test compares it across ranks
            raised = f"{type(error).__name__}: {error}"
        else:
            raised = "nothing"
        kept = all(torch.equal(before[n], g) for n, g in _grad_bits(self).items())
        self.finish()
        after = self.train(lambda step, loss: loss, 1)
        return {"raised": raised, "grads kept": kept, "went on": not after[0]["skipped"]}


def _grad_bits(trainer: _Trainer) -> dict[str, Tensor]:
    model = trainer.layout.model
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _given_average(loss: object) -> float | None:
    """The oracle: the float32 average of the losses the ranks gave (None where none did)."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, None if loss is None else float(loss))  # type: ignore[arg-type]
    given = [value for value in everyone if value is not None]
    return (
        float(torch.tensor(math.fsum(given) / len(given), dtype=torch.float32)) if given else None
    )


def _figures(records: list[dict]) -> list[list[int]]:
    """Each step's figures as bits (the same on every rank), the skip as 0 or 1."""
    rows = []
    for record in records:
        figures = [v for k, v in record.items() if k not in ("local loss", "skipped")]
        bits = torch.stack(figures).float().view(torch.int32).tolist()
        rows.append([*bits, int(record["skipped"])])
    return rows


def _losses_against_oracle(trainer: _Trainer, loss_of: LossOf) -> dict:
    """Train with ``loss_of``, and each step's policy loss against the oracle's average."""
    records, ulps = [], []
    for _ in range(STEPS):
        step = trainer.step
        record = trainer.train(loss_of, 1)[0]
        expected = _given_average(loss_of(step, record["local loss"]))
        assert expected is not None
        spacing = math.ulp(torch.tensor(expected, dtype=torch.float32).item())
        ulps.append(abs(float(record["loss"]) - expected) / spacing)
        records.append(record)
    return {
        "figures": _figures(records),
        "ulps": max(ulps),
        "skipped": trainer.scaler.skipped_steps,
    }


# --- a loss some ranks lack ---------------------------------------------------------------------


def _loss_on_rank_0() -> dict:
    rank = dist.get_rank()
    return _losses_against_oracle(_Trainer(), lambda step, loss: loss if rank == 0 else None)


def _loss_left_out_later() -> dict:
    rank = dist.get_rank()
    return _losses_against_oracle(
        _Trainer(), lambda step, loss: None if (step >= 4 and rank == 3) else loss
    )


def _pipeline_last_stage() -> dict:
    trainer = _Trainer("pp_equal")
    last = trainer.layout.stage == 1
    return _losses_against_oracle(trainer, lambda step, loss: loss if last else None)


def _assert_works(records: list[dict]) -> None:
    for rank, record in enumerate(records):
        assert record["figures"] == records[0]["figures"], f"rank {rank}: other bits"
        assert record["ulps"] <= 1.0, f"rank {rank}: {record['ulps']} ULPs from the oracle"
        assert record["skipped"] == 1, f"rank {rank}: the spike at step {SPIKE_STEP} not skipped"
        assert record["figures"][SPIKE_STEP][-1] == 1


def test_a_loss_on_rank_0_alone_from_the_first_step_is_the_worlds(ranks):
    _assert_works(ranks.run(4, _loss_on_rank_0))


def test_a_loss_left_out_on_one_rank_later_is_the_others_average(ranks):
    _assert_works(ranks.run(4, _loss_left_out_later))


def test_the_pipelines_loss_on_the_last_stage_alone_is_the_worlds(ranks):
    _assert_works(ranks.run(4, _pipeline_last_stage))


# --- raised alike on every rank ------------------------------------------------------------------


def _refusals() -> dict:
    """Each wrong call in turn, on one trainer: the trainer goes on after each."""
    rank = dist.get_rank()
    trainer = _Trainer(spike_step=None)
    trainer.train(lambda step, loss: loss, WARMUP + 1)
    params = list(trainer.layout.model.parameters())
    policy = trainer.policy
    cases = {
        "no rank gives a loss": lambda: policy.clip_grad_norm_(params),
        "a non-scalar loss on rank 2": lambda: policy.clip_grad_norm_(
            params, loss=torch.ones(2) if rank == 2 else torch.ones(())
        ),
        "a string loss on rank 1": lambda: policy.clip_grad_norm_(
            params, loss="1.0" if rank == 1 else 1.0
        ),
        "groups an int": lambda: policy.clip_grad_norm_(params, loss=1.0, groups=3),
        "groups of strings": lambda: policy.clip_grad_norm_(params, loss=1.0, groups={"a": "x"}),
    }
    return {name: trainer.refused(call) for name, call in cases.items()}


def test_what_one_rank_gets_wrong_raises_alike_on_every_rank_and_the_trainer_goes_on(ranks):
    records = ranks.run(4, _refusals)
    expected = {
        "no rank gives a loss": "ValueError: SpikePolicy.clip_grad_norm_: no rank gave a loss",
        "a non-scalar loss on rank 2": "ValueError: SpikePolicy.clip_grad_norm_: rank 2: loss "
        "must hold one element, got shape (2,). No gradient was modified.",
        "a string loss on rank 1": "TypeError: SpikePolicy.clip_grad_norm_: rank 1: loss must "
        "be a tensor of one element or a number, got '1.0'. No gradient was modified.",
        "groups an int": "TypeError: groups must be the step's grad_norm_report",
        "groups of strings": "TypeError: groups must be the step's grad_norm_report",
    }
    for rank, record in enumerate(records):
        assert record == records[0], f"rank {rank} differs: {record}"
    for name, outcome in records[0].items():
        assert outcome["raised"].startswith(expected[name]), (name, outcome["raised"])
        assert outcome["grads kept"] and outcome["went on"], (name, outcome)


# --- calls in the wrong order, and what the scaler answers ----------------------------------


def _wrong_order() -> dict:
    fp16 = _Trainer(scaling=True)
    loss = fp16.backward()
    before = _grad_bits(fp16)
    try:
        fp16.policy.clip_grad_norm_(fp16.layout.model.parameters(), loss=loss)
        raised = "nothing"
    except RuntimeError as error:
        raised = str(error)
    kept = all(torch.equal(before[n], g) for n, g in _grad_bits(fp16).items())
    fp16.scaler.unscale_(fp16.optimizer)
    fp16.policy.clip_grad_norm_(fp16.layout.model.parameters(), loss=loss)
    fp16.finish()
    twice = _Trainer()
    twice.train(lambda step, loss: None, SPIKE_STEP)
    twice.backward()
    twice.scaler.unscale_(twice.optimizer)
    params = list(twice.layout.model.parameters())
    twice.policy.clip_grad_norm_(params, max_norm=0.5)
    weights = local_bits(twice.layout.model)
    try:
        twice.policy.clip_grad_norm_(params, max_norm=0.5)
        second = "nothing"
    except RuntimeError as error:
        second = str(error)
    twice.finish()
    spike_kept = all(torch.equal(weights[n], w) for n, w in local_bits(twice.layout.model).items())
    return {
        "before unscale_": (raised, kept, fp16.policy.metrics()["norm"].item(), fp16.step),
        "twice": (second, twice.scaler.last_step_skipped, spike_kept, twice.policy.skipped_spikes),
    }


def test_calls_out_of_order_raise_and_the_first_decision_stands(ranks):
    for rank, record in enumerate(ranks.run(4, _wrong_order)):
        raised, kept, norm, steps = record["before unscale_"]
        assert raised.startswith("SpikePolicy.clip_grad_norm_ came before scaler.unscale_"), rank
        assert kept and steps == 1, rank
        assert norm < 100.0, f"rank {rank}: the history holds a scaled norm {norm}"
        second, skipped, spike_kept, spikes = record["twice"]
        assert second.startswith("SpikePolicy.clip_grad_norm_ was called twice in one step"), rank
        assert skipped and spike_kept and spikes == 1, f"rank {rank}: {record['twice']}"


def _non_finite_loss_and_two_optimizers() -> dict:
    trainer = _Trainer(scaling=True)
    trainer.train(lambda step, loss: loss, 2)
    scale = trainer.scaler.get_scale()
    weights = local_bits(trainer.layout.model)
    nan = trainer.train(lambda step, loss: torch.tensor(math.nan), 1)[0]
    nan_kept = all(torch.equal(weights[n], w) for n, w in local_bits(trainer.layout.model).items())
    layout = build("ddp")
    params = list(layout.model.parameters())
    first, second = torch.optim.SGD(params[:2], lr=0.01), torch.optim.SGD(params[2:], lr=0.01)
    policies = (SpikePolicy(warmup=WARMUP), SpikePolicy(warmup=WARMUP))
    scaler = GradScaler(
        "cpu", scaling=False, spikes=dict(zip((first, second), policies, strict=True))
    )
    answers = []
    for step in range(SPIKE_STEP + 1):
        scaler.scale(layout.model(batch(layout, step)).pow(2).mean()).backward()
        if step == SPIKE_STEP:
            for param in params[:2]:
                param.grad.mul_(1e3)  # type: ignore[union-attr]
        for optimizer, policy, group in zip(
            (first, second), policies, (params[:2], params[2:]), strict=True
        ):
            scaler.unscale_(optimizer)
            policy.clip_grad_norm_(group)
        scaler.step(first)
        scaler.step(second)
        scaler.update()
        answers.append((scaler.step_skipped(first), scaler.step_skipped(second)))
        first.zero_grad()
        second.zero_grad()
    return {
        "nan loss": (
            bool(nan["skipped"]),
            nan_kept,
            trainer.scaler.get_scale() == scale,
            trainer.policy.skipped_non_finite,
            trainer.policy.skipped_spikes,
            trainer.scaler.skipped_steps,
        ),
        "two optimizers": (answers, scaler.last_step_skipped),
    }


def test_a_nan_loss_skips_as_non_finite_and_each_optimizer_answers_for_itself(ranks):
    for rank, record in enumerate(ranks.run(4, _non_finite_loss_and_two_optimizers)):
        # Skipped, weights kept, the scale kept (no gradient overflowed), counted alike.
        assert record["nan loss"] == (True, True, True, 1, 0, 1), f"rank {rank}: {record}"
        answers, any_skipped = record["two optimizers"]
        assert answers == [(False, False)] * SPIKE_STEP + [(True, False)], f"rank {rank}"
        assert any_skipped, rank
