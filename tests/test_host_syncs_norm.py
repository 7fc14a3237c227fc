"""The norm's host syncs, per call, on real gloo ranks: a layout's plan is built once.

On a GPU every read of a device value on the host (``item``, ``bool``, ``float``, ``tolist``) and
every tensor made from Python data for the device (``torch.tensor(list, device=...)``, a Python
list as an index) is a host sync. A TorchDispatchMode records them here (``tolist`` of a CPU tensor
does not dispatch: it is wrapped while recording), each with the library function that made it,
around a layout's first, second and third calls. The first call builds the layout's plan (its
constants copied to the device once, its verification read once); later calls must show nothing
but the documented reads (the guide's "Host syncs").

Rank maps (``DeviceMesh.mesh``) live on the CPU in every DeviceMesh: reading them is no device
sync, and they are read (once per layout, for the ownership of each gradient) before recording.
"""

from __future__ import annotations

import collections
import functools
import math
import os
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from credit.parallel import collectives
from credit.parallel._common import holdings as _holdings
from credit.parallel.amp import GradScaler
from credit.parallel.collectives import clip_grad_norm_, total_grad_norm
from credit.parallel.norm_report import grad_norm_report
from testbed.layouts import build, grads

LIBRARY = os.path.dirname(collectives.__file__)
READ = "read"
FROM_HOST = "from host"
DATA_DEPENDENT = "data-dependent"
_KINDS = {
    "aten._local_scalar_dense.default": READ,
    "aten.lift_fresh.default": FROM_HOST,
    "aten.nonzero.default": DATA_DEPENDENT,
    "aten.masked_select.default": DATA_DEPENDENT,
}
Events = dict[tuple[str, str], int]


def _library_function() -> str | None:
    """``file:function`` of the innermost library frame, or None outside the library."""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename.startswith(LIBRARY):
            return f"{os.path.relpath(frame.filename, LIBRARY)}:{frame.name}"
    return None


class HostSyncs(TorchDispatchMode):
    """Counts host reads, tensors made from Python data and data-dependent shapes that the library
    makes while it is entered: ``events[(kind, "file:function")]``."""

    def __init__(self) -> None:
        super().__init__()
        self.events: collections.Counter[tuple[str, str]] = collections.Counter()
        self._tolist = Tensor.tolist

    def _record(self, kind: str) -> None:
        where = _library_function()
        if where is not None:
            self.events[(kind, where)] += 1

    def __enter__(self) -> HostSyncs:
        tolist = self._tolist

        def recorded_tolist(tensor: Tensor) -> Any:
            self._record(READ)
            return tolist(tensor)

        Tensor.tolist = recorded_tolist  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        Tensor.tolist = self._tolist  # type: ignore[method-assign]
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kind = _KINDS.get(str(func))
        if str(func) == "aten.index.Tensor" and any(
            index is not None and index.dtype == torch.bool for index in args[1]
        ):
            kind = DATA_DEPENDENT
        if kind is not None:
            self._record(kind)
        return func(*args, **(kwargs or {}))


def per_call(call: Any, calls: int = 3) -> list[Events]:
    """The events of each of ``calls`` successive calls of ``call``."""
    found = []
    for _ in range(calls):
        with HostSyncs() as syncs:
            call()
        found.append(dict(syncs.events))
    return found


def test_the_recorder_sees_a_read_and_a_copy_in_the_library():
    """Guards the recorder: a library read (error_if_nonfinite) and data from the host."""
    with HostSyncs() as syncs:
        total_grad_norm([torch.ones(3)], error_if_nonfinite=True)
        float(torch.ones(2).sum())  # outside the library: not counted
    assert syncs.events == {(READ, "_norm/verdict.py:_finite_and_differ"): 1}
    with HostSyncs() as syncs:
        torch.ones(2).tolist()
        torch.tensor([1.0, 2.0])
    assert syncs.events == {}
    assert Tensor.tolist is HostSyncs()._tolist  # restored


# Each rank's events, named by the calls of the trainer.
PLAN = (FROM_HOST, "_norm/plan.py:_on_device")  # the plan's constants, one copy
COPIES = (FROM_HOST, "_norm/copies.py:plan")  # the comparison of copies' constants, one copy
# The same, where the copies meet in process groups of their own: the constants, and the read of
# the groups' proof.
GROUPS = (FROM_HOST, "_norm/group_comparison.py:plan")
GROUPS_VERDICT = (READ, "_norm/proof.py:_prove_in_groups")
VERDICT = (READ, "_norm/proof.py:prove")  # the verification's verdict
INDEX = (FROM_HOST, "_norm/stacking.py:indices")  # an index tensor asked for the first time
REPORT = (READ, "norm_report.py:_read")
STAGES = (READ, "_norm/collective.py:_stages")  # the pipeline's one read
STAGE_RANKS = {(READ, "_norm/pipeline.py:lowest_rank_of_stage"): 1}
# The copies' verdict, read at once where the collective's tensors are on the CPU (reading costs
# no sync there); on a GPU it stays on the device (test_host_syncs.py traces the CUDA path).
CPU_VERDICT = (READ, "_norm/verdict.py:raise_if_copies_differ")


def _one_stage() -> dict[str, list[Events]]:
    model = build("fsdp_tp", dim=20).model  # a width of its own: a new layout
    model_grads = grads(model)
    for grad in model_grads:
        _holdings.holding(grad)  # the rank maps, read on the CPU (see the module docstring)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-3, fused=True)
    scaler = GradScaler("cpu", init_scale=1.0)
    one = torch.ones(())

    def amp_step() -> None:
        scaler.scale(one)
        scaler.unscale_(optimizer)
        clip_grad_norm_(params, 0.5)  # answers the scaler's flag
        scaler.step(optimizer)
        scaler.update()

    return {
        "norm": per_call(lambda: total_grad_norm(model_grads)),
        "norm inf": per_call(lambda: total_grad_norm(model_grads, math.inf)),
        "clip, tensor max_norm": per_call(lambda: clip_grad_norm_(params, one)),
        "amp step": per_call(amp_step),
        "report": per_call(lambda: grad_norm_report(model.named_parameters())),
    }


def test_one_stage_copies_its_constants_once_and_reads_nothing_after(ranks):
    for events in ranks.run(4, _one_stage):
        verdict = {CPU_VERDICT: 1}
        # FSDP2 + TP: the copies along tp are compared within their tp groups.
        first = {PLAN: 1, GROUPS: 1, VERDICT: 1, GROUPS_VERDICT: 1, **verdict}
        assert events["norm"] == [first, verdict, verdict]
        assert events["norm inf"] == [{}, {}, {}]  # the largest copy needs no comparison
        assert events["clip, tensor max_norm"] == [verdict] * 3
        # The scaler's flag reads the clip's entries through positions kept with the layout.
        assert events["amp step"] == [{INDEX: 1, **verdict}, verdict, verdict]
        assert events["report"] == [
            {INDEX: 1, REPORT: 1, **verdict},
            {REPORT: 1, **verdict},
            {REPORT: 1, **verdict},
        ]


@functools.cache
def _fresh_pp_groups() -> tuple[dist.ProcessGroup, ...]:
    """Pipeline groups {0, 2} and {1, 3} of this test alone: their first use is in it."""
    groups = (dist.new_group([0, 2]), dist.new_group([1, 3]))
    assert all(group is not None for group in groups)
    return groups  # type: ignore[return-value]


def _two_stages(width: int) -> list[Events]:
    stage, dp_rank = divmod(dist.get_rank(), 2)
    torch.manual_seed(stage)  # plain replicas within a stage, other shapes per stage
    model = nn.Sequential(nn.Linear(width, width + stage), nn.Linear(width + stage, 1))
    model(torch.ones(2, width)).sum().backward()
    stage_grads = grads(model)
    return per_call(lambda: total_grad_norm(stage_grads, pp_group=_fresh_pp_groups()[dp_rank]))


def test_pipeline_stages_read_once_per_call(ranks):
    for first, *later in ranks.run(4, _two_stages, 6):
        # The first call also learns the ranks of each stage, once per pipeline group (one
        # read), and the segment of each norm (an index tensor).
        assert first == {PLAN: 1, COPIES: 1, VERDICT: 1, INDEX: 1, STAGES: 1, **STAGE_RANKS}
        assert later == [{STAGES: 1}, {STAGES: 1}]
