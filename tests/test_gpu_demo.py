"""On a real GPU: the demo with CUDA tensors, against its single-process replica on the GPU.

Skipped without CUDA, with the reason. Four gloo ranks share one GPU (``--device cuda``: FSDP2 +
TP, the loss scaled in fp16 with an inf planted at step 3, every copy of the weights and optimizer
state proven bit-identical every 2 steps), and one NCCL rank (``--backend nccl``, dp = tp = 1).
The demo's own verdict is the oracle: every step's loss and grad norm within 1e-4 of the replica's
(TF32 off), every rank with the same bits; its exit status is 0 only then.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device (torch.cuda.is_available() is False)"
)

LAUNCH_TIMEOUT_S = 150
RUNS = {
    "4 gloo ranks, fp16": ["--device", "cuda", "--amp", "fp16", "--verify-replicas", "2"],
    "1 NCCL rank": ["--backend", "nccl", "--dp", "1", "--tp", "1"],
}


@pytest.mark.parametrize("run", RUNS)
def test_demo_on_cuda_matches_its_replica(run):
    # Without torchrun's variables the demo launches its own ranks.
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    command = [sys.executable, "-m", "credit.parallel", "demo", "--steps", "4", *RUNS[run]]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, env=env
    )
    print(result.stdout)  # the demo's table, in the log of tests/gpu_check.sh
    assert result.returncode == 0, result.stdout + result.stderr
    verdicts = [line for line in result.stdout.splitlines() if line.startswith("PASS:")]
    assert len(verdicts) == 1, result.stdout
