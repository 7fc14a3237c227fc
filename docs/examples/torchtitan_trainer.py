"""torchtitan's own trainer, its clip swapped for this package's: a launcher, site-packages untouched.

torchtitan's trainer clips with ``dist_utils.clip_grad_norm_``, looked up on its module
``torchtitan.distributed.utils`` at every step. This launcher sets that name to
:func:`credit.parallel.integrations.torchtitan.clip_grad_norm_` (same signature), then runs
torchtitan's entry point, ``torchtitan.train.main``: its config manager, its model registry, its
``Trainer``. Every argument but ``--device`` and ``--write-assets`` is torchtitan's. On 4 GPUs::

    torchrun --standalone --nproc-per-node 4 docs/examples/torchtitan_trainer.py --device cuda \\
        --module llama3 --config llama3_debugmodel \\
        --parallelism.data-parallel-shard-degree 2 --parallelism.tensor-parallel-degree 2 \\
        --parallelism.spmd-backend partial_dtensor \\
        --hf-assets-path TOKENIZER_DIR --dataloader.dataset-path C4_TEST_DIR

torchtitan's wheel ships no tokenizer and no dataset. ``--write-assets DIR`` writes small ones
for a try (a word-level tokenizer of a few words under ``DIR/tokenizer``, and 32 texts in those
words under ``DIR/c4_test``) and exits without training; then, on 4 CPU ranks::

    python docs/examples/torchtitan_trainer.py --write-assets build/torchtitan-assets
    torchrun --standalone --nproc-per-node 4 docs/examples/torchtitan_trainer.py \\
        --module llama3 --config llama3_debugmodel \\
        --parallelism.data-parallel-shard-degree 2 --parallelism.tensor-parallel-degree 2 \\
        --parallelism.spmd-backend partial_dtensor \\
        --hf-assets-path build/torchtitan-assets/tokenizer \\
        --dataloader.dataset-path build/torchtitan-assets/c4_test \\
        --training.steps 3 --training.seq-len 64 --training.local-batch-size 2 \\
        --dump-folder build/torchtitan-outputs

``--device cpu`` (the default, as in the other scripts) runs the same trainer on gloo, with three
CPU-only steps: torchtitan's device is named ``"cpu"`` (its ``device_type`` is ``"cuda"`` without
an accelerator), with a stand-in for the GPU memory queries its metrics make; each layer's
attention is torchtitan's SDPA module (causal over the whole sequence) for FlexAttention, which
has no backward on a CPU; FSDP reduces with plain sums, as gloo has no ``PREMUL_SUM``. On any
device, torchtitan 0.3 calls ``torch.distributed.set_timeout`` after its first step, which torch
2.13 has under a private name only: the launcher gives it that name. Each step's norm is logged
from this package's clip on every rank, beside the line where torchtitan's metrics log it; that
line reads the norm on the host every step (torchtitan's metrics read it at their logging steps
only): where a GPU run must not wait for it, swap in ``clip_grad_norm_`` itself in ``swap_clip``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup, distributed_c10d
from torch.distributed.fsdp import FSDPModule
from torch.nn import Module

from credit.parallel.integrations.torchtitan import clip_grad_norm_

# The words of the tokenizer and of the texts that --write-assets writes.
WORDS = ("the", "mesh", "shard", "tensor", "norm", "clip", "rank", "step", "grad", "loss")


class CpuDevice:
    """``torch.cpu`` with the GPU memory queries torchtitan's metrics make (no memory stats)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def get_device_name(device: object = None) -> str:
        return "CPU"

    @staticmethod
    def get_device_properties(device: object = None) -> SimpleNamespace:
        return SimpleNamespace(
            total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        )

    @staticmethod
    def memory_stats(device: object = None) -> dict[str, int]:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device: object = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None


def set_timeout(timeout: timedelta, group: ProcessGroup | None = None) -> None:
    """``torch.distributed.set_timeout``, which torchtitan 0.3 calls after its first step and
    torch 2.13 has under a private name only."""
    distributed_c10d._set_pg_timeout(timeout, group)


def logged_clip(*args: Any, **kwargs: Any) -> Tensor:
    """:func:`credit.parallel.integrations.torchtitan.clip_grad_norm_`, its norm logged (every
    rank logs, as torchtitan's own lines do)."""
    from torchtitan.tools.logging import logger

    norm = clip_grad_norm_(*args, **kwargs)
    value = norm.item()
    logger.info("credit.parallel clip_grad_norm_: %.6f (%s)", value, value.hex())
    return norm


def swap_clip() -> None:
    """Make torchtitan's trainer clip with this package's function (it calls
    ``dist_utils.clip_grad_norm_``, looked up on the module at every step)."""
    from torchtitan.distributed import utils as dist_utils

    dist_utils.clip_grad_norm_ = logged_clip


def use_cpu() -> None:
    """The CPU-only steps; before any other torchtitan module is imported, as some bind
    ``device_type`` and ``device_module`` by name on import."""
    from torchtitan.tools import utils

    utils.device_type, utils.device_module = "cpu", CpuDevice()
    from torchtitan import train
    from torchtitan.distributed import fsdp
    from torchtitan.models.common.attention import ScaledDotProductAttention

    class CpuConfigManager(train.ConfigManager):  # type: ignore[misc]
        """torchtitan's config manager, each layer's attention its SDPA module."""

        def parse_args(self, args: list[str] | None = None) -> Any:
            config = super().parse_args(args)
            for layer in config.model_spec.model.layers:
                layer.attention.inner_attention = ScaledDotProductAttention.Config()
            return config

    keep_sums = fsdp.disable_fsdp_gradient_division

    def plain_sums(model: Module) -> None:
        keep_sums(model)  # divide factor 1.0: PREMUL_SUM(1.0), which gloo lacks; a SUM instead
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    train.ConfigManager = CpuConfigManager
    fsdp.disable_fsdp_gradient_division = plain_sums


def write_assets(folder: Path) -> None:
    """What the trainer reads besides its model: a word-level tokenizer (``tokenizer.json`` and
    ``tokenizer_config.json``, with a BOS and an EOS token) and a dataset of JSON lines with a
    ``"text"`` field, in its words. Enough to train for a few steps, not to learn anything."""
    from tokenizers import Tokenizer, models, pre_tokenizers  # a dependency of torchtitan

    vocab = {word: i for i, word in enumerate(("<unk>", "<bos>", "<eos>", *WORDS))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    (folder / "tokenizer").mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer" / "tokenizer.json"))
    config = {"bos_token": "<bos>", "eos_token": "<eos>"}
    (folder / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "c4_test").mkdir(exist_ok=True)
    texts = (" ".join(WORDS[(i * j) % len(WORDS)] for j in range(150)) for i in range(32))
    lines = (json.dumps({"text": text}) for text in texts)
    (folder / "c4_test" / "data.json").write_text("\n".join(lines) + "\n")
    print(
        f"wrote {folder}: pass --hf-assets-path {folder / 'tokenizer'} "
        f"--dataloader.dataset-path {folder / 'c4_test'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--write-assets", type=Path, metavar="DIR")
    args, torchtitan_args = parser.parse_known_args()
    if args.write_assets is not None:
        write_assets(args.write_assets)
        return
    sys.argv[1:] = torchtitan_args  # what torchtitan's config manager parses
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = set_timeout  # type: ignore[attr-defined]
    if args.device == "cpu":
        use_cpu()
    swap_clip()
    from torchtitan import train

    train.main()


if __name__ == "__main__":
    main()
    # The run is over. On gloo, torch's worker threads can still be releasing the last
    # collective's tensors when Python shuts down, and taking the GIL then aborts the finished
    # run ("terminate called without an active exception"): leave without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
