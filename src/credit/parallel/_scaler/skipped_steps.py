"""The steps a GradScaler skipped: counted on every rank alike, and reported by name on rank 0.

A :class:`~credit.parallel.amp.GradScaler` holds one :class:`SkippedSteps`. At ``update`` it
counts the step just decided, on the scale's device, without a host read; ``skipped_steps`` and
``last_step_skipped`` read the count back. On a step that a non-fused optimizer skips, it logs a
warning on the world's rank 0 naming the parameters whose gradients held a NaN or inf, and the
ranks that held them, for the 1st, 2nd, 4th, 8th, ... skipped step only: the names cost one
all_gather, on those steps alone. Both counts travel in the scaler's ``state_dict``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from credit.parallel._common.groups import collective_device, is_distributed, world_of_one
from credit.parallel._common.text import ordinal
from credit.parallel._scaler import found_inf as _found_inf

# The records carry the name of the public module, which users configure.
logger = logging.getLogger("credit.parallel.amp")

# The longest list of names one rank sends to the skipped-step report, in bytes.
_REPORT_BYTES = 512

_SPOILED = (
    "no gradient held a NaN or inf when unscale_ checked it, but a clip's coefficient was not "
    "finite (a NaN or negative max_norm, or a NaN norm) and made the gradients it scaled NaN"
)


class SkippedSteps:
    """One scaler's count of skipped steps, and its report of them.

    Args:
        model: the module whose parameters the optimizers update, only to name them in the
            report; None to take the optimizers' ``param_names``, or places and shapes.
    """

    def __init__(self, model: nn.Module | None) -> None:
        self._names = {id(p): name for name, p in model.named_parameters()} if model else {}
        self._before = 0  # steps skipped before the state was loaded
        self._since: Tensor | None = None  # steps skipped since, on the scale's device
        self._last: Tensor | None = None
        self._last_by_optimizer: dict[int, Tensor] = {}
        self._reports = 0  # skipped steps seen by a non-fused optimizer's step

    def count(self, answers: dict[int, Tensor]) -> None:
        """Count the step the world's ``answers`` (one per optimizer, by its ``id``) decided:
        skipped when any of them is 1.0. On the device, without a host read."""
        values = list(answers.values())
        skipped = torch.stack([answer.to(values[0].device) for answer in values]).amax() > 0
        self._last = skipped
        self._last_by_optimizer = answers
        self._since = skipped.long() if self._since is None else self._since + skipped

    @property
    def total(self) -> int:
        """How many steps were skipped, those before a loaded state included (reads the device)."""
        since = 0 if self._since is None else int(self._since.item())
        return self._before + since

    @property
    def last_skipped(self) -> bool:
        """Whether the last step counted was skipped (reads the device)."""
        return self._last is not None and bool(self._last.item())

    def skipped(self, key: int) -> bool:
        """Whether optimizer ``key`` skipped the last step counted (reads the device).

        Raises:
            ValueError: the optimizer had no answer in that step.
        """
        answer = self._last_by_optimizer.get(key)
        if answer is None:
            raise ValueError(
                "this optimizer was not unscaled or stepped through the GradScaler in the step "
                "before its last update()"
            )
        return bool(answer.item())

    def state_dict(self) -> dict[str, int]:
        """``skipped_steps`` and ``reported_skips`` (the skipped steps the report has seen)."""
        return {"skipped_steps": self.total, "reported_skips": self._reports}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Count on from a state of :meth:`state_dict` (zero where an entry is missing)."""
        self._before = int(state_dict.get("skipped_steps", 0))
        self._since = None
        self._reports = int(state_dict.get("reported_skips", 0))

    def report(self, optimizer: torch.optim.Optimizer, flag: _found_inf.Flag) -> None:
        """Log which parameters of ``optimizer`` held non-finite gradients, and where, on
        rate-limited steps. Every rank calls it: the names are gathered from all of them."""
        self._reports += 1
        if self._reports & (self._reports - 1):  # the 1st, 2nd, 4th, 8th, ... only
            return
        mine = ", ".join(self._nonfinite_names(optimizer, flag))
        everyone = _gather_text(mine)
        if is_distributed() and dist.get_rank() != 0:
            return
        held = "; ".join(f"rank {rank}: {text}" for rank, text in enumerate(everyone) if text)
        spoiled = flag.spoiled is not None and bool(flag.spoiled.item())
        logger.warning(
            "GradScaler skipped a step (the %s skipped so far): %s",
            ordinal(self._reports),
            f"non-finite gradients in {held}"
            if held
            else (_SPOILED if spoiled else "no gradient this scaler checks held a NaN or inf"),
        )

    def _nonfinite_names(
        self, optimizer: torch.optim.Optimizer, flag: _found_inf.Flag
    ) -> list[str]:
        """The parameters whose gradients held a NaN or inf on this rank when unscale_ checked."""
        named = []
        for group_index, group in enumerate(optimizer.param_groups):
            # torch's optimizers keep the names when built from model.named_parameters().
            group_names = group.get("param_names") or ()
            for index, param in enumerate(group["params"]):
                if param.grad is not None:
                    name = self._names.get(id(param))
                    if name is None and index < len(group_names):
                        name = group_names[index]
                    if name is None:
                        name = f"param_groups[{group_index}][{index}] shape={tuple(param.shape)}"
                    named.append(name)
        flags = _found_inf.nonfinite(flag)
        return [name for name, up in zip(named, flags, strict=True) if up]


def _gather_text(text: str) -> list[str]:
    """Every rank's ``text`` (truncated to _REPORT_BYTES), in one all_gather."""
    if world_of_one():
        return [text]
    encoded = list(text.encode()[:_REPORT_BYTES])
    mine = torch.zeros(_REPORT_BYTES, dtype=torch.uint8)
    mine[: len(encoded)] = torch.tensor(encoded, dtype=torch.uint8)
    mine = mine.to(collective_device())
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [bytes(t.cpu().tolist()).rstrip(b"\0").decode(errors="replace") for t in everyone]
