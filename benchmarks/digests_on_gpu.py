"""The replica check's digests on one GPU, against SHA-1 of each tensor on the host.

The replica check's cost per rank is its digests (``credit.parallel._replicas.digests``), one all_reduce
of 48 bytes and one read of the verdict; Megatron-LM's scheme copies every tensor to the host and
hashes it there. This times both on the tensors the benchmark's replica case checks (the
layouts' model and its AdamW state: 1618 tensors, 11.5 MiB) and on a large set (3 GiB: 192
tensors of 16 MiB, as parameters, exp_avg and exp_avg_sq), on one CUDA device, no ranks needed::

    PYTHONPATH=src python benchmarks/digests_on_gpu.py [--device cuda] [--large-mib 3072]

Each time is the median of repeated calls, the device synchronised before and after each, so it
counts the work queued on the device and the host's time to queue it. Prints a small table.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

# The repository's root, for the workloads the tests share (testbed/).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workloads import MODEL

from credit.parallel._replicas import digests as _digests
from testbed.layouts import TinyNet


def _model_and_state(device: torch.device, fused: bool) -> list[Tensor]:
    """The replica case's tensors: the model's parameters and their AdamW state after a step."""
    torch.manual_seed(0)
    model = TinyNet(**MODEL).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer = torch.optim.AdamW(params, lr=1e-3, fused=fused, foreach=None if fused else True)
    optimizer.step()
    tensors = list(model.parameters())
    return tensors + [v for state in optimizer.state.values() for v in state.values()]


def _large(device: torch.device, mib: int) -> list[Tensor]:
    count = max(3, mib // 16)
    generator = torch.Generator(device=device).manual_seed(0)
    return [
        torch.randn(1 << 22, generator=generator, device=device) for _ in range(count)
    ]  # 16 MiB each


def _timed(call: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds per call, the device synchronised around each."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sha1(tensors: list[Tensor]) -> list[bytes]:
    """Megatron-LM's scheme on one rank: each tensor copied to the host and hashed."""
    return [hashlib.sha1(t.detach().to("cpu").numpy(force=True)).digest() for t in tensors]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--large-mib", type=int, default=3072)
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, {device}", end="")
    if device.type == "cuda":
        print(f" ({torch.cuda.get_device_name(device)})", end="")
    print()
    sets = {
        "model + AdamW state (fused: state on the device)": _model_and_state(device, True),
        "model + AdamW state (foreach: step counts on the CPU)": _model_and_state(device, False),
        f"large: {args.large_mib} MiB of 16 MiB tensors": _large(device, args.large_mib),
    }
    print(f"{'tensors':<56} {'count':>6} {'MiB':>8} {'ours ms':>9} {'SHA-1 ms':>10} {'ratio':>7}")
    for name, tensors in sets.items():
        plan = _digests.plan(tensors, device)
        plan(tensors)  # warm-up: kernels compiled and cached
        large = name.startswith("large")
        ours = _timed(lambda: plan(tensors), device, 5 if large else 50)  # noqa: B023
        sha1 = _timed(lambda: _sha1(tensors), device, 1 if large else 5)  # noqa: B023
        mib = sum(t.numel() * t.element_size() for t in tensors) / 2**20
        print(
            f"{name:<56} {len(tensors):>6} {mib:>8.1f} {ours * 1e3:>9.3f} {sha1 * 1e3:>10.2f} "
            f"{ours / sha1:>7.4f}"
        )


if __name__ == "__main__":
    main()
