"""What every rank runs: the parallel training loop, and on rank 0 the single-process replica."""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import math
import os
import sys
import time
import traceback
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from credit.parallel._common.groups import collective_device
from credit.parallel._common.launch import init_process_group
from credit.parallel.collectives import all_reduce_avg, clip_grad_norm_
from credit.parallel.demo import _amp, _report, _spikes
from credit.parallel.demo._cli import Options
from credit.parallel.demo._history import History
from credit.parallel.demo._model import (
    TinyWeatherModel,
    band,
    band_loss,
    global_batch,
    latitude_weights,
    parallelize,
)
from credit.parallel.grad_sync import (
    sync_domain_gradients,
    sync_domain_gradients_in_backward,
    sync_replicated_gradients,
)
from credit.parallel.parallel_mesh import ParallelMesh, build_device_mesh
from credit.parallel.replicas import ReplicaMismatchError, verify_replicas

logger = logging.getLogger(__name__)

PROCESS_GROUP_TIMEOUT = timedelta(seconds=120)


EXIT_PASS, EXIT_DEPARTS, EXIT_ERROR, EXIT_PEER_FAILED = 0, 1, 3, 4
# How gloo reports that a peer process went away (it crashed, or stopped on its own error).
_PEER_GONE = ("closed by peer", "reset by peer", "remote worker crashing")


def run_worker(options: Options) -> int:
    """Entry point of one rank: train, compare with the replica, return this rank's exit status.

    A rank that raises prints its traceback; its peers then fail in their next collective and
    stop quietly. Under the demo's own launcher a failing rank ends its process at once, which
    closes its connections (a rank that returned would be kept alive by the launcher until
    every rank returns) and leaves the reporting to the launcher.

    Args:
        options: the checked command-line options.

    Returns:
        ``EXIT_PASS`` (0) when the run matches the replica, ``EXIT_DEPARTS`` (1) when it does not
        (the same on every rank), ``EXIT_ERROR`` (3) when this rank raised, ``EXIT_PEER_FAILED``
        (4) when it stopped because another rank went away.
    """
    quiet_torch()
    started = time.perf_counter()
    try:
        device = _device(options)
        init_process_group(options.backend, PROCESS_GROUP_TIMEOUT)
        mesh = build_device_mesh(options.dp, options.tp, options.domain, device_type=device.type)
        passed = _train_and_compare(options, mesh, device, started)
    except Exception as exc:
        code = EXIT_PEER_FAILED if _peer_gone(exc) else EXIT_ERROR
        if code == EXIT_ERROR:
            logger.error("rank %s failed:\n%s", os.environ.get("RANK", "?"), traceback.format_exc())
        if not options.in_place:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        return code
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    return EXIT_PASS if passed else EXIT_DEPARTS


def _peer_gone(exc: Exception) -> bool:
    """Whether ``exc`` says another rank went away (or the launcher is stopping this one)."""
    if type(exc).__name__ == "SignalException":  # the launcher's SIGTERM, once a rank failed
        return True
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in _PEER_GONE)


def quiet_torch() -> None:
    """Keep torch's internal warnings and logs (below ERROR) off the console."""
    warnings.filterwarnings("ignore", module=r"torch(\.|$)")
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.getLogger("torch").setLevel(logging.ERROR)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(message)s")


def _device(options: Options) -> torch.device:
    if options.device == "cuda":
        # One GPU per rank under nccl; gloo ranks share the GPUs there are.
        index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        torch.cuda.set_device(index)
        # The run is compared with its replica in float32: no TF32 rounding in matmuls or convs.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        return torch.device("cuda", index)
    torch.set_num_threads(1)
    return torch.device("cpu")


def _train_and_compare(
    options: Options, mesh: ParallelMesh, device: torch.device, started: float
) -> bool:
    """Train on every rank (and the replica on rank 0); the verdict, the same on every rank."""
    torch.manual_seed(options.seed)
    model = TinyWeatherModel(options.model).to(device)
    # The replica starts from the very weights the parallel model is sharded from.
    replica = _Replica(copy.deepcopy(model), options, device) if dist.get_rank() == 0 else None
    parallelize(model, mesh.tp, mesh.dp)
    run = _ParallelRun(model, mesh, options, device, _amp.for_parallel_run(options, model, device))
    if replica is not None:
        _report.ready(options, sum(p.numel() for p in replica.model.parameters()), started)
    for step in range(1, options.steps + 1):
        torch_clip = run.step(step)
        if replica is not None:
            replica.step(step, run.planted)
            if step == 1:
                _report.torch_clip(torch_clip)
                _report.header(options)
            _report.row(step, run.history, replica.history)
    if replica is not None and options.verify_replicas is not None:
        _report.replica_checks(run.history)
    if options.spike_step is not None:
        everyone = _on_every_rank(run.history.spikes[options.spike_step - 1], device)
        if replica is not None:
            _report.spike(options, everyone, run.spike_figures, replica.spike_seen)
    if options.nonfinite_step is not None:
        skips, diverged = _torch_scaler_skips(options, mesh, device)
        if replica is not None:
            _report.torch_scaler(options.nonfinite_step, skips, diverged)
    weights = _weights_difference(run.model, replica)
    same_bits = _same_bits_everywhere(run.history)
    passed = replica is not None and _report.verdict(
        options, run.history, replica.history, weights, same_bits, started
    )
    flag = torch.tensor([1.0 if passed else 0.0], device=device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def _torch_scaler_skips(
    options: Options, mesh: ParallelMesh, device: torch.device
) -> tuple[list[bool], str | None]:
    """Train a second copy of the parallel model with torch's own GradScaler up to the planted
    step; whether each rank skipped that step (gathered on every rank), and with
    ``--verify-replicas`` what the replica check found after it."""
    torch.manual_seed(options.seed)
    model = TinyWeatherModel(options.model).to(device)
    parallelize(model, mesh.tp, mesh.dp)
    run = _ParallelRun(model, mesh, options, device, _amp.for_contrast(options, device))
    run.probe_torch_clip = False
    assert options.nonfinite_step is not None
    for step in range(1, options.nonfinite_step + 1):
        run.step(step)
    if options.verify_replicas is not None and options.nonfinite_step % options.verify_replicas:
        run.check_replicas(options.nonfinite_step)  # not checked by step(): check it now
    return _on_every_rank(run.history.skipped[-1], device), run.history.diverged


def _on_every_rank(flag: bool, device: torch.device) -> list[bool]:
    """Every rank's ``flag``, by rank (gathered on every rank)."""
    mine = torch.tensor([float(flag)], device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [bool(value.item()) for value in everyone]


class _ParallelRun:
    """The trainer loop on this rank's share of the data, model and latitude bands."""

    def __init__(
        self,
        model: nn.Module,
        mesh: ParallelMesh,
        options: Options,
        device: torch.device,
        scaler: _amp.StepScaler,
    ) -> None:
        self.model, self.mesh, self.options, self.device = model, mesh, options, device
        self.scaler = scaler
        self.probe_torch_clip = True  # try torch's own clip at step 1, for the report
        # The inf of --nonfinite-step goes on the last rank, in a parameter every rank can name.
        self.planted = _amp.planted_parameter(model)
        if not isinstance(model, FSDPModule):
            raise TypeError("the model must be wrapped by fully_shard")
        self.fsdp: FSDPModule = model
        self.in_backward = options.domain_sync == "in-backward"
        if self.in_backward:
            # FSDP2's reduce-scatter of each unit then averages over the domain group too.
            sync_domain_gradients_in_backward(model, mesh.domain)
        self.optimizer = _optimizer(model, options)
        coordinate = mesh.world.get_coordinate()
        assert coordinate is not None
        self.dp_rank, _, domain_rank = coordinate
        self.rows = band(options.model.lat, options.domain, domain_rank)
        self.weights = latitude_weights(options.model).to(device)
        self.history = History()
        self.spike_figures: dict[str, float] = {}  # the policy's metrics at --spike-step

    def step(self, step: int) -> str | None:
        """One optimizer step, recorded in ``history``; at step 1, torch's clip's error if any."""
        o = self.options
        total = torch.zeros((), device=self.device)
        for micro in range(o.accum):
            # FSDP2 reduce-scatters only at the accumulation boundary.
            self.fsdp.set_requires_gradient_sync(micro == o.accum - 1)
            x, y = global_batch(o.model, o.dp * o.micro_batch, o.seed, step, micro)
            x, y = (t.chunk(o.dp)[self.dp_rank].to(self.device) for t in (x, y))
            if step == o.spike_step:
                x = _spikes.spiked_shard(x, o.dp, self.dp_rank)
            loss = band_loss(self.model(x), y, self.weights, self.rows, o.domain)
            self.scaler.scale(loss / o.accum).backward()
            total += loss.detach()
        if not self.in_backward:
            sync_domain_gradients(self.model, self.mesh.domain)
        sync_replicated_gradients(self.model, self.mesh.tp)
        if step == o.nonfinite_step and dist.get_rank() == dist.get_world_size() - 1:
            _amp.plant_inf(self.model, self.planted)
        torch_clip = _try_torch_clip(self.model) if step == 1 and self.probe_torch_clip else None
        self.scaler.unscale_(self.optimizer)
        norm = self._clip(step)
        skipped = self.scaler.step(self.optimizer, norm)
        self.optimizer.zero_grad()
        mean_loss = total / o.accum
        all_reduce_avg(mean_loss)  # the mean over bands and over dp shards: the global loss
        self.history.record(float(mean_loss), float(norm))
        if self.scaler.active:
            self.history.record_scaler(self.scaler.get_scale(), skipped, self._was_spike())
        if o.verify_replicas is not None and step % o.verify_replicas == 0:
            self.check_replicas(step)
        return torch_clip

    def _clip(self, step: int) -> Tensor:
        """Clip and return the norm: by the spike policy where there is one (whose decision the
        scaler then takes), else by clip_grad_norm_."""
        policy = self.scaler.policy
        if policy is None:
            return clip_grad_norm_(self.model.parameters(), self.options.max_norm)
        norm = policy.clip_grad_norm_(self.model.parameters(), max_norm=self.options.max_norm)
        if step == self.options.spike_step:
            self.spike_figures = {name: float(value) for name, value in policy.metrics().items()}
        return norm

    def _was_spike(self) -> bool:
        """Whether the policy decided the last step a spike (reads the device)."""
        policy = self.scaler.policy
        return policy is not None and bool(policy.metrics()["spike"])

    def check_replicas(self, step: int) -> None:
        """Prove every copy of the parameters and the optimizer state bit-identical (every rank
        together), recording the cost, or the first difference found."""
        started = time.perf_counter()
        try:
            report = verify_replicas(self.model, self.optimizer)
        except ReplicaMismatchError as error:
            if self.history.diverged is None:
                self.history.diverged = _report.mismatches(step, error.mismatches)
            return
        elapsed = (time.perf_counter() - started) * 1e3
        self.history.record_check(step, elapsed, report.compared, report.tensors)


class _Replica:
    """The same model and data in one process, with torch's own clip_grad_norm_ (and its own
    GradScaler, and the spike policy's rule on its own norms)."""

    def __init__(self, model: nn.Module, options: Options, device: torch.device) -> None:
        self.model, self.options, self.device = model, options, device
        self.scaler = _amp.for_replica(options, device)
        self.optimizer = _optimizer(model, options)
        self.weights = latitude_weights(options.model).to(device)
        self.history = History()
        self.mirror: _spikes.SpikeMirror | None = None
        if options.spike_step is not None:
            self.mirror = _spikes.SpikeMirror(_spikes.demo_policy().settings)
        self.spike_seen: _spikes.SpikeSeen | None = None  # the spike step, as seen here
        self.last_move: tuple[int, float] | None = None  # the last step taken, how far it moved

    def step(self, step: int, planted: str) -> None:
        """One optimizer step on the whole global batch, recorded in ``history``; at the planted
        step, an inf in parameter ``planted``'s gradient, as the parallel run gets one; at the
        spike step, the last data shard's inputs scaled, as the parallel run's."""
        o = self.options
        total = torch.zeros((), device=self.device)
        every_row = band(o.model.lat, 1, 0)
        for micro in range(o.accum):
            x, y = global_batch(o.model, o.dp * o.micro_batch, o.seed, step, micro)
            if step == o.spike_step:
                x = _spikes.spiked_batch(x, o.dp)
            x, y = x.to(self.device), y.to(self.device)
            loss = band_loss(self.model(x), y, self.weights, every_row, 1)
            self.scaler.scale(loss / o.accum).backward()
            total += loss.detach()
        if step == o.nonfinite_step:
            _amp.plant_inf(self.model, planted)
        self.scaler.unscale_(self.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), o.max_norm)
        skipped, spike = self._take_or_skip(step, norm)
        self.optimizer.zero_grad()
        self.history.record(float(total / o.accum), float(norm))
        if self.scaler.active:
            self.history.record_scaler(self.scaler.get_scale(), skipped, spike)

    def _take_or_skip(self, step: int, norm: Tensor) -> tuple[bool, bool]:
        """Step the optimizer unless the scaler or the spike rule skips it; whether it was
        skipped, and whether as a spike. At the spike step, first measure on copies how far the
        step would move the weights without the rule."""
        if self.mirror is None:
            return self.scaler.step(self.optimizer, norm), False
        decision = self.mirror.decide(norm)
        spike = bool(decision.spike)
        if step == self.options.spike_step:
            build = functools.partial(_optimizer, options=self.options)
            move = _spikes.move_without_policy(self.model, self.optimizer, build)
            z = float(decision.z[0])
            seen_z = None if math.isnan(z) else z
            self.spike_seen = _spikes.SpikeSeen(float(norm), seen_z, spike, move, self.last_move)
        before = _spikes.weights(self.model)
        skipped = self.scaler.step(self.optimizer, norm, spike)
        self.mirror.end_step(decision, non_finite=skipped and not spike)
        if not skipped:
            self.last_move = (step, _spikes.relative_move(before, self.model))
        return skipped, spike


def _optimizer(model: nn.Module, options: Options) -> torch.optim.Optimizer:
    if options.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=options.lr, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=options.lr, weight_decay=0.01)


def _try_torch_clip(model: nn.Module) -> str | None:
    """torch's clip_grad_norm_ on the parallel layout: None if it works, else its error.

    ``max_norm=inf`` keeps the gradients as they are should it succeed. It fails, where it does,
    in a local dispatch check before any collective, on every rank alike.
    """
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=math.inf)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _weights_difference(model: nn.Module, replica: _Replica | None) -> float:
    """Largest relative difference, tensor by tensor (norm-wise), of the trained weights."""
    worst = 0.0
    reference = dict(replica.model.named_parameters()) if replica is not None else {}
    for name, param in model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param  # collective
        if replica is not None:
            ref = reference[name].detach()
            diff = torch.linalg.vector_norm(full.detach() - ref) / torch.linalg.vector_norm(ref)
            # max() would pass over a NaN (a non-finite step taken): count it as infinitely far.
            worst = max(worst, float(diff) if torch.isfinite(diff) else math.inf)
    return worst


def _same_bits_everywhere(history: History) -> bool:
    """Whether every rank recorded the same bits of every step's loss and grad norm (and scale,
    skipped step and spike)."""
    values = torch.tensor(
        history.loss
        + history.norm
        + history.scale
        + list(map(float, history.skipped + history.spikes)),
        dtype=torch.float64,
        device=collective_device(),
    )
    gathered = [torch.empty_like(values) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, values)
    bits = [g.view(torch.int64) for g in gathered]
    return all(torch.equal(b, bits[0]) for b in bits)
