"""torchtitan 0.3's own trainer on 4 CPU ranks, launched by ``docs/examples/torchtitan_trainer.py``.

The launcher runs as a user runs it (``torchrun``, from the repository root, with this
environment's ``torchrun`` first on the PATH): torchtitan's entry point, config manager and llama3
``debugmodel`` on dp_shard=2 x tp=2, with a tokenizer and a small text dataset written here (the
wheel ships neither). torchrun's ``--tee 3`` prefixes each line with its rank.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from harness import WORLD, framework

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3
WORDS = ("the", "mesh", "shard", "tensor", "norm", "clip", "rank", "step", "grad", "loss")
# "[default<rank>]:" from torchrun's --tee, then torchtitan's logger.
OURS = re.compile(r"^\[default(\d)\]:.*credit\.parallel clip_grad_norm_: \S+ \((\S+)\)$", re.M)
LOGGED = re.compile(r"^\[default(\d)\]:.*step:\s+(\d+)\s+loss:\s+(\S+)\s+grad_norm:\s+(\S+)", re.M)


def _assets(folder: Path) -> tuple[Path, Path]:
    """A word-level tokenizer with a BOS and an EOS token, and a dataset of texts in its words."""
    tokenizers = framework("tokenizers")
    vocab = {word: i for i, word in enumerate(("<unk>", "<bos>", "<eos>", *WORDS))}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    (folder / "tokenizer").mkdir()
    tokenizer.save(str(folder / "tokenizer" / "tokenizer.json"))
    config = {"bos_token": "<bos>", "eos_token": "<eos>"}
    (folder / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "c4_test").mkdir()
    texts = (" ".join(WORDS[(i * j) % len(WORDS)] for j in range(150)) for i in range(32))
    lines = (json.dumps({"text": text}) for text in texts)
    (folder / "c4_test" / "data.json").write_text("\n".join(lines) + "\n")
    return folder / "tokenizer", folder / "c4_test"


def _by_rank(matches: list[tuple[str, ...]]) -> dict[int, list[tuple[str, ...]]]:
    ranks: dict[int, list[tuple[str, ...]]] = {rank: [] for rank in range(WORLD)}
    for rank, *rest in matches:
        ranks[int(rank)].append(tuple(rest))
    return ranks


def test_torchtitan_trainer_clips_with_ours_and_logs_our_norm(tmp_path):
    """The run ends cleanly after its steps; our clip ran once a step on every rank, with the same
    bits on all four, and the grad_norm torchtitan's metrics log is ours, on every rank."""
    framework("torchtitan")
    tokenizer, dataset = _assets(tmp_path)
    command = [
        *("torchrun", "--standalone", "--nproc-per-node", str(WORLD), "--tee", "3"),
        "docs/examples/torchtitan_trainer.py",
        *("--module", "llama3", "--config", "llama3_debugmodel"),
        *("--parallelism.data-parallel-shard-degree", "2"),
        *("--parallelism.tensor-parallel-degree", "2"),
        *("--parallelism.spmd-backend", "partial_dtensor"),
        *("--hf-assets-path", str(tokenizer), "--dataloader.dataset-path", str(dataset)),
        *("--training.steps", str(STEPS), "--training.seq-len", "64"),
        *("--training.local-batch-size", "2", "--debug.seed", "0"),
        *("--validator.no-enable", "--metrics.disable-color-printing"),
        *("--dump-folder", str(tmp_path / "outputs")),
    ]
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("OMP_NUM_THREADS", None)  # as a user's shell has it
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    ours, logged = _by_rank(OURS.findall(output)), _by_rank(LOGGED.findall(output))
    for rank in range(WORLD):
        assert len(ours[rank]) == STEPS, (rank, output[-6000:])
        assert [int(step) for step, _, _ in logged[rank]] == list(range(1, STEPS + 1)), rank
    for step in range(STEPS):
        norms = {ours[rank][step][0] for rank in range(WORLD)}
        assert len(norms) == 1, (step, norms)  # the same bits on every rank
        norm = float.fromhex(norms.pop())
        assert 0 < norm < float("inf")
        for rank in range(WORLD):
            assert logged[rank][step][2] == f"{norm:.4f}", (rank, step, logged[rank][step])
