"""Gradient norms over any mix of meshes and pipeline stages, in one collective: the hot path.

The one norm behind ``total_grad_norm``, ``get_total_norm``, ``clip_grad_norm_`` and
``grad_norm_report``. The public function builds the request (``request``: the arguments, checked
once, before any collective) and hands it to :func:`reduce`, which runs the steps in order, each
in a module of its own (the contributor's page, ``docs/design.rst``, draws them):

1. plan (``plan``): what the layout holds, built on its first call and kept;
2. proof (``proof``): the layout proven on its first call, within a stage before the norm;
3. local norms (``local_norms``): torch's kernels in torch's order, after completing Partial
   gradients;
4. the collective (``collective``): one all_reduce, of a kind per layout; under pipeline stages
   the proof then acts on what the stages decided (``proof.act_on_decisions``);
5. verdict (``verdict``): copies that differ, raised the same on every rank where reading is
   free; the listeners (``hooks``: the GradScaler's flags) then read the result, which they
   never change; then ``error_if_nonfinite``'s read.

A clip then scales the gradients (``clip``), called by the public function after ``reduce``.
Every rank issues the same collectives, decided by the world, ``pp_group`` and the layout that all
ranks of a stage share, never by what one rank happens to hold.
"""

from __future__ import annotations

from credit.parallel._norm import collective as _collective
from credit.parallel._norm import hooks as _hooks
from credit.parallel._norm import local_norms as _local_norms
from credit.parallel._norm import plan as _plan
from credit.parallel._norm import proof as _proof
from credit.parallel._norm import verdict as _verdict
from credit.parallel._norm.plan import Kind
from credit.parallel._norm.request import NormRequest
from credit.parallel._norm.results import Reduced


def reduce(
    request: NormRequest, segment_of: list[int] | None = None, segment_count: int = 1
) -> Reduced:
    """The norm of the request's gradients (see the module docstring).

    Args:
        request: the call's checked arguments.
        segment_of: under pipeline stages, the segment of each gradient (default: all in one).
        segment_count: the number of segments, the same on every rank.

    Raises:
        ValueError: the gradients' layout cannot be reduced, or copies differ where the verdict
            is read (raised on every rank).
        RuntimeError: the proof or the check mode failed, or ``error_if_nonfinite`` and the norm
            is not finite (raised on every rank).
    """
    plan = None
    if not request.alone:
        plan = _plan.planned(request)
        _proof.prove_if_due(plan, request)
    norms = _local_norms.norms_of(request, plan, segment_of)
    # Under pipeline stages the listeners' questions ride on the stages' all_reduce.
    stages = plan is not None and plan.kind is Kind.STAGES
    unanswered = _hooks.unanswered(request.local) if stages else 0
    reduced = _collective.reduce(norms, request, plan, segment_count, unanswered)
    if plan is not None and reduced.stages is not None:
        _proof.act_on_decisions(plan, request, reduced.stages.decisions)
    reduced = _verdict.raise_where_free(reduced, request)
    _hooks.notify(reduced.normed)
    if request.error_if_nonfinite:
        _verdict.raise_if_nonfinite(reduced, request)
    return reduced
