"""``python -m credit.parallel demo``: real launches of real ranks, parity with one process.

Each test starts the command line in its own processes (the demo launches its ranks through
torch's elastic launcher), then checks the exit status, the verdict line and the per-step table.
The oracle is the single-process replica the demo trains on rank 0 with torch's own
``clip_grad_norm_``: the table prints both runs' loss and grad norm, and the relative differences
are recomputed here from the printed values.
"""

from __future__ import annotations

import math
import os
import re
import socket
import statistics
import subprocess
import sys
from dataclasses import dataclass

import pytest

from credit.parallel.demo import DEFAULT_RTOL, main
from credit.parallel.demo._cli import DEFAULT_DOMAIN_SYNC

# The demo's tolerance, 1e-4 relative: about 840 float32 ULPs at any magnitude (one ULP is at
# most 2**-23 ~ 1.19e-7 relative). The sharded run rounds differently from the replica (TP splits
# the projections' sums, FSDP2 and domain averaging add in another order); measured on these
# layouts, the loss and grad norm differ by at most a few ULPs over a few steps.
RTOL = 1e-4
# The table prints 8 significant digits: a relative difference recomputed from printed values
# is off by at most 1e-7 from the one computed on the full values.
PRINT_SLACK = 1e-7
LAUNCH_TIMEOUT_S = 240
DOMAIN_AVERAGE_WHEN = {"in-backward": "inside backward", "explicit": "after backward"}[
    DEFAULT_DOMAIN_SYNC
]
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
# With --amp the table has two more columns: the scale after the step, and whether it was skipped.
ROW = re.compile(r"^\s*(\d+)" + r"\s+(\S+)" * 6 + r"(?:\s+(\S+)\s+(yes|no))?\s*$")
VERDICT_FIGURES = re.compile(
    r"max relative difference (\S+) \(loss\), (\S+) \(grad norm\), (\S+) \(weights\)"
)
SPIKE_SKIPPED = re.compile(
    r"^SpikePolicy: every rank skipped step (\d+) as a spike: grad norm (\S+), z-score (\S+) "
    r"\(skipped above (\S+)\); the replica skipped it \(z-score (\S+) on its own norms\)$",
    re.MULTILINE,
)
WITHOUT_POLICY = re.compile(
    r"^without the policy: step (\d+) is taken, its grad norm (\S+) clipped to (\S+), and the "
    r"weights move by (\S+) \(\|\|w_after - w_before\|\| / \|\|w_before\|\|, all parameters, "
    r"on copies of the replica\), (\S+)x step (\d+)'s (\S+); with it they do not move$",
    re.MULTILINE,
)
# The demo's policy: SpikePolicy(warmup=5), its other settings SpikePolicy's defaults.
SPIKE_WARMUP, SKIP_SIGMA, ALPHA, EPS = 5, 6.0, 0.97, 1e-6


@dataclass(frozen=True)
class Row:
    step: int
    loss: float
    ref_loss: float
    loss_rel: float
    norm: float
    ref_norm: float
    norm_rel: float
    scale: float | None = None  # with --amp only
    skipped: bool | None = None  # with --amp only


def _env() -> dict[str, str]:
    """This environment without torchrun's variables (the demo would run in place)."""
    return {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES}


def _demo_command(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "credit.parallel", "demo", *args]


def _run(command: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, env=_env()
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _table(stdout: str) -> list[Row]:
    lines = stdout.splitlines()
    headers = [i for i, line in enumerate(lines) if line.split()[:2] == ["step", "loss"]]
    assert len(headers) == 1, stdout
    rows = []
    for line in lines[headers[0] + 1 :]:
        match = ROW.match(line)
        if match is None:
            break
        step, *values, scale, skipped = match.groups()
        scaler = (float(scale), skipped == "yes") if scale is not None else (None, None)
        rows.append(Row(int(step), *map(float, values), *scaler))
    return rows


def _verdicts(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith(("PASS:", "FAIL:"))]


def _relative(value: float, reference: float) -> float:
    return abs(value - reference) / abs(reference)


def _check_parity(stdout: str, steps: int, spikes: frozenset[int] = frozenset()) -> None:
    """Every step present, every printed difference right and within the tolerance; a step
    skipped for a NaN or inf has norms not finite on either side, left out of the verdict's
    maxima; a step skipped as a spike (one of ``spikes``) has finite norms, compared."""
    rows = _table(stdout)
    assert [row.step for row in rows] == list(range(1, steps + 1)), stdout
    for row in rows:
        compared = [(row.loss, row.ref_loss, row.loss_rel)]
        if row.skipped and row.step not in spikes:
            assert not (math.isfinite(row.norm) or math.isfinite(row.ref_norm)), (row, stdout)
        else:
            compared.append((row.norm, row.ref_norm, row.norm_rel))
        for value, ref, printed in compared:
            assert abs(_relative(value, ref) - printed) <= PRINT_SLACK, (row, stdout)
            assert printed <= RTOL, (row, stdout)
    (verdict,) = _verdicts(stdout)
    assert verdict.startswith("PASS:"), stdout
    figures = VERDICT_FIGURES.search(verdict)
    assert figures is not None, verdict
    # The verdict's maxima are the table's, as printed (one digit after the point).
    assert float(figures[1]) == float(f"{max(r.loss_rel for r in rows):.1e}")
    norm_rel = max(r.norm_rel for r in rows if not r.skipped or r.step in spikes)
    assert float(figures[2]) == float(f"{norm_rel:.1e}")
    assert float(figures[3]) <= RTOL


def _check_clean_output(result: subprocess.CompletedProcess[str], world: int) -> None:
    """Rank 0 alone prints, and nothing of torch's own (warnings, logs) reaches the console."""
    assert result.stderr == ""
    assert sum(f"{world} ranks up in" in line for line in result.stdout.splitlines()) == 1


def test_default_tolerance_is_the_one_checked_here() -> None:
    assert DEFAULT_RTOL == RTOL


@pytest.mark.slow
def test_dp2_tp2_matches_the_replica() -> None:
    result = _run(_demo_command(["--steps", "3"]))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "launching 4 ranks (dp=2 x tp=2 x domain=1, gloo, fork) ..."
    # torch's own clip fails on this layout (TP'd params on (dp, tp), the rest on dp).
    (torch_line,) = [line for line in lines if line.startswith("torch.nn.utils.clip_grad_norm_")]
    assert "must have the same mesh" in torch_line
    _check_parity(result.stdout, steps=3)
    _check_clean_output(result, world=4)


@pytest.mark.slow
def test_dp2_tp2_domain2_on_eight_ranks_matches_the_replica() -> None:
    result = _run(_demo_command(["--domain", "2", "--steps", "2", "--accum", "2"]))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "launching 8 ranks (dp=2 x tp=2 x domain=2" in result.stdout
    assert "each domain rank's loss on its own band of 8 latitude rows" in result.stdout
    assert f"domain average {DOMAIN_AVERAGE_WHEN}" in result.stdout
    _check_parity(result.stdout, steps=2)
    _check_clean_output(result, world=8)


@pytest.mark.slow
def test_under_torchrun_the_demo_runs_in_place() -> None:
    """torchrun starts the ranks (the multi-node path); the demo runs as each of them."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_port()),
        "-m",
        "credit.parallel",
        "demo",
        "--tp",
        "1",
        "--steps",
        "2",
    ]
    result = _run(command)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "launching" not in result.stdout  # torchrun launched; the demo did not
    assert "2 ranks up" in result.stdout and "dp=2 x tp=1 x domain=1" in result.stdout
    _check_parity(result.stdout, steps=2)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "function"),
    [("explicit", "sync_domain_gradients"), ("in-backward", "sync_domain_gradients_in_backward")],
)
def test_the_check_catches_a_missing_domain_sync(mode: str, function: str) -> None:
    """Without the domain sync each rank holds its own band's gradient where the rank maps see
    copies: the clip refuses, naming the missing sync, before any step is taken."""
    code = (
        "import sys, credit.parallel.demo._train as train\n"
        f"train.{function} = lambda model, group: None\n"
        "from credit.parallel.demo import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    args = ["--dp", "1", "--tp", "1", "--domain", "2", "--steps", "2", "--accum", "1"]
    args += ["--domain-sync", mode]
    result = _run([sys.executable, "-c", code, *args])
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "ValueError: clip_grad_norm_:" in output, output
    assert "holds different values on ranks that the rank maps take for copies" in output
    assert "if they are replicas not averaged yet (a missing sync_domain_gradients" in output
    assert not _verdicts(result.stdout), "the run went on"


@pytest.mark.slow
def test_fp16_scaling_skips_the_planted_step_on_every_rank_where_torch_diverges() -> None:
    """An inf in rank 3's TP shard at step 3: every rank and the replica skip it and back off
    (1024, 2048 after two clean steps, 1024); torch's own scaler on the same layout does not.
    The replica check proves this package's run bit-identical across copies at steps 2 and 4, and
    finds where torch's scaler left the copies apart."""
    result = _run(_demo_command(["--amp", "fp16", "--steps", "5", "--verify-replicas", "2"]))
    assert result.returncode == 0, result.stdout + result.stderr
    _check_parity(result.stdout, steps=5)
    rows = _table(result.stdout)
    assert [row.scale for row in rows] == [1024, 2048, 1024, 1024, 2048]
    assert [row.skipped for row in rows] == [False, False, True, False, False]
    assert rows[2].norm == rows[2].ref_norm == math.inf  # the parallel run and the replica
    assert (
        "torch.amp.GradScaler on this layout: ranks 1, 3 skipped step 3, ranks 0, 2 stepped: "
        "the replicas diverged"
    ) in result.stdout
    (verdict,) = _verdicts(result.stdout)
    assert "every rank skipped step 3, as the replica" in verdict
    # The skipped step's report names the culprit (a warning, on rank 0's stderr).
    assert "non-finite gradients in rank 3: blocks.0.attn.q.weight" in result.stderr
    checks = re.search(r"verify_replicas at steps 2, 4: (\d+) of the (\d+) tensors", result.stdout)
    assert checks is not None, result.stdout
    assert 0 < int(checks[1]) < int(checks[2])
    assert "have copies on other ranks, all bit-identical;" in result.stdout
    assert "ms per call, one all_reduce" in result.stdout
    # torch's scaler: ranks 1 and 3 skipped, 0 and 2 stepped; their tp peers' copies differ,
    # two by two: no strict majority tells which copy is right.
    found = re.search(
        r"verify_replicas after torch's scaler's step: at step 3, (\d+) tensors", result.stdout
    )
    assert found is not None and int(found[1]) > 0, result.stdout
    assert "(ranks 0, 1 disagree, ranks 2, 3 disagree)" in result.stdout


@pytest.mark.slow
def test_bf16_skips_the_planted_step_without_scaling() -> None:
    """Skipping only: the scale stays 1 and the planted step is skipped everywhere; torch's
    scaler on the same layout splits the ranks at a scale of 1 too."""
    result = _run(_demo_command(["--amp", "bf16", "--steps", "4", "--nonfinite-step", "2"]))
    assert result.returncode == 0, result.stdout + result.stderr
    _check_parity(result.stdout, steps=4)
    rows = _table(result.stdout)
    assert [row.scale for row in rows] == [1.0] * 4
    assert [row.skipped for row in rows] == [False, True, False, False]
    assert "every rank skipped step 2, as the replica" in result.stdout
    assert "torch.amp.GradScaler on this layout: ranks 1, 3 skipped step 2, ranks 0, 2" in (
        result.stdout
    )


def _close(value: float, printed: str, digits: int) -> bool:
    """Whether ``printed`` is ``value`` to ``digits`` significant digits (and a last-digit slack
    for the rounding of float32 figures)."""
    return abs(float(printed) - value) <= 1.5 * 10 ** (
        math.floor(math.log10(abs(value))) - digits + 1
    )


def _zscore_and_limit(taken: list[float], value: float) -> tuple[float, float]:
    """The z-score of ``value`` after the norms of the ``taken`` steps, and the norm above which
    a step is skipped, by ZClip's moving average as SpikePolicy documents it: the mean and
    population variance of the warm-up's norms, then ``m = a m + (1 - a) x``,
    ``v = a v + (1 - a) (x - m)**2`` for every later one."""
    mean, var = statistics.fmean(taken[:SPIKE_WARMUP]), statistics.pvariance(taken[:SPIKE_WARMUP])
    for x in taken[SPIKE_WARMUP:]:
        mean = ALPHA * mean + (1 - ALPHA) * x
        var = ALPHA * var + (1 - ALPHA) * (x - mean) ** 2
    std = math.sqrt(var) + EPS
    return (value - mean) / std, mean + SKIP_SIGMA * std


def _check_spike_line(stdout: str, taken: list[Row], spike: Row) -> None:
    """The policy's figures at the ``spike`` step, and the replica's z-score, against those
    recomputed here from the table's norms of the steps ``taken`` before it."""
    found = SPIKE_SKIPPED.search(stdout)
    assert found is not None, stdout
    assert int(found[1]) == spike.step
    z, limit = _zscore_and_limit([row.norm for row in taken], spike.norm)
    assert _close(spike.norm, found[2], 4), found[0]
    assert _close(z, found[3], 3), found[0]
    assert _close(limit, found[4], 4), found[0]
    ref_z, _ = _zscore_and_limit([row.ref_norm for row in taken], spike.ref_norm)
    assert _close(ref_z, found[5], 3), found[0]


@pytest.mark.slow
def test_a_planted_spike_is_skipped_on_every_rank_and_by_the_replica() -> None:
    """At step 6 the inputs of rank 3's data shard (ranks 2 and 3) are scaled by 1e3: the spike
    policy, held by GradScaler(scaling=False), skips the step on every rank, the replica's own
    rule skips it too, and the run still matches the replica step by step. A copy of the replica
    taking the step shows how far it would move the weights."""
    result = _run(_demo_command(["--steps", "7", "--spike-step", "6"]))
    assert result.returncode == 0, result.stdout + result.stderr
    _check_parity(result.stdout, steps=7, spikes=frozenset({6}))
    rows = _table(result.stdout)
    assert [row.skipped for row in rows] == [False] * 5 + [True, False]
    assert [row.scale for row in rows] == [1.0] * 7  # no scaling, skipping only
    assert rows[5].norm > 100 * max(row.norm for row in rows[:5])
    _check_spike_line(result.stdout, rows[:5], rows[5])
    moved = WITHOUT_POLICY.search(result.stdout)
    assert moved is not None, result.stdout
    step, norm, clip, move, ratio, before, before_move = moved.groups()
    assert (int(step), int(before), float(clip)) == (6, 5, 0.25)
    assert _close(rows[5].ref_norm, norm, 4)
    # Clipped, the spike's step is of a usual step's size, a real step, not none.
    assert 0.1 < float(ratio) < 10
    assert abs(float(ratio) - float(move) / float(before_move)) <= 0.01
    (verdict,) = _verdicts(result.stdout)
    assert "every rank skipped step 6, as the replica (a spike to the policy" in verdict
    # Rank 0 alone reports, through the policy's logger: its one warning on stderr.
    (warning,) = result.stderr.splitlines()
    assert warning.startswith("SpikePolicy skipped the 6th step it saw as a spike: gradient norm ")


@pytest.mark.slow
def test_fp16_scaling_skips_a_spike_without_backing_off() -> None:
    """With fp16 the policy rides in the scaling GradScaler: the inf of step 2 backs the scale
    off, the spike of step 8 does not (its growth interval counts it: 2048 to 4096, as torch's
    scaler in the replica, which takes no step there). The skipped inf step is no warm-up value:
    the first five taken steps are 1 and 3-6."""
    args = ["--amp", "fp16", "--nonfinite-step", "2", "--spike-step", "8", "--steps", "8"]
    result = _run(_demo_command([*args, "--tp", "1", "--accum", "1"]))
    assert result.returncode == 0, result.stdout + result.stderr
    _check_parity(result.stdout, steps=8, spikes=frozenset({8}))
    rows = _table(result.stdout)
    assert [row.scale for row in rows] == [1024, 512, 512, 1024, 1024, 2048, 2048, 4096]
    assert [row.skipped for row in rows] == [False, True] + [False] * 5 + [True]
    _check_spike_line(result.stdout, [rows[0], *rows[2:7]], rows[7])
    (verdict,) = _verdicts(result.stdout)
    assert (
        "every rank skipped steps 2, 8, as the replica (step 2: grad norms not finite on either "
        "side, left out of the maxima; step 8: a spike to the policy"
    ) in verdict


def test_bad_option_exits_2_before_launching() -> None:
    result = _run(_demo_command(["--steps", "0"]))
    assert result.returncode == 2
    assert "argument --steps: must be a positive integer, got 0" in result.stderr
    assert "launching" not in result.stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "-1"], "argument --steps: must be a positive integer, got -1"),
        (["--accum", "0"], "argument --accum: must be a positive integer, got 0"),
        (["--backend", "mpi"], "argument --backend: invalid choice: 'mpi'"),
        (["--dp", "0"], "argument --dp: must be a positive integer, got 0"),
        (["--tp", "3"], "--tp 3 must divide the model's 4 attention heads"),
        (["--domain", "17"], "--domain 17: more latitude bands than the grid's 16 rows"),
        (["--start-method", "thread"], "argument --start-method: invalid choice: 'thread'"),
        (["--domain-sync", "later"], "argument --domain-sync: invalid choice: 'later'"),
        (["--amp", "fp8"], "argument --amp: invalid choice: 'fp8'"),
        (
            ["--verify-replicas", "0"],
            "argument --verify-replicas: must be a positive integer, got 0",
        ),
        (["--amp", "fp16", "--nonfinite-step", "0"], "must be a positive integer, got 0"),
        (["--amp", "fp16", "--nonfinite-step", "11"], "--nonfinite-step 11 is past the last step"),
        (["--nonfinite-step", "2"], "--nonfinite-step needs --amp fp16 or --amp bf16"),
        (["--spike-step", "0"], "argument --spike-step: must be a positive integer, got 0"),
        (["--spike-step", "11"], "--spike-step 11 is past the last step (10)"),
        (
            ["--spike-step", "5"],
            "--spike-step 5 is within the spike policy's warm-up: its first 5 taken steps "
            "decide nothing; use a step from 6 to 10",
        ),
        (
            ["--amp", "bf16", "--spike-step", "6"],
            "its first 5 taken steps (the skipped step 3 not one of them) decide nothing; use a "
            "step from 7 to 10",
        ),
        (["--steps", "4", "--spike-step", "3"], "use a step from 6 on, with --steps 6 or more"),
        (
            ["--amp", "fp16", "--nonfinite-step", "7", "--spike-step", "7"],
            "--spike-step 7 is also the step of the planted inf (--nonfinite-step)",
        ),
        (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
        (["--backend", "nccl", "--device", "cpu"], "--backend nccl needs --device cuda"),
        (
            ["--device", "cuda", "--start-method", "fork"],
            "--device cuda needs --start-method spawn or forkserver",
        ),
    ],
)
def test_bad_options_fail_fast_with_a_clear_message(
    argv: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)

    def no_launch(options: object) -> int:
        raise AssertionError(f"launched despite a bad option: {options}")

    monkeypatch.setattr("credit.parallel.demo._launch.launch", no_launch)
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert captured.out == ""
