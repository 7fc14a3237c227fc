"""torchtitan 0.3's own trainer on 4 CPU ranks, launched by ``docs/examples/torchtitan_trainer.py``
as the Integrations page writes it.

The page's CPU console lines for the launcher are run here as written, in their order, from the
repository root, with this environment's ``python`` and ``torchrun`` first on the PATH: the first
writes the small tokenizer and dataset the wheel does not ship (``--write-assets``), the second
runs torchtitan's entry point, config manager and llama3 ``debugmodel`` on dp_shard=2 x tp=2.
Both write under ``build/`` only (ignored by git). The launcher's docstring shows the same lines.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from collections import Counter
from pathlib import Path

from harness import WORLD, framework

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "integrations.rst"
SCRIPT = ROOT / "docs" / "examples" / "torchtitan_trainer.py"
LINE = re.compile(r"^\s*\$ (?P<command>\S.*docs/examples/torchtitan_trainer\.py.*?)\s*$")
COLOR = re.compile(r"\x1b\[[0-9;]*m")  # torchtitan's metrics are colored, on a terminal or not
OURS = re.compile(r"credit\.parallel clip_grad_norm_: \S+ \((\S+)\)$", re.M)
LOGGED = re.compile(r"step:\s+(\d+)\s+loss:\s+(\S+)\s+grad_norm:\s+(\S+)", re.M)


def _page_lines() -> tuple[list[str], list[str]]:
    """The page's console lines for the launcher: those for a CPU, and those for GPUs."""
    lines = [m["command"] for m in map(LINE.match, PAGE.read_text().splitlines()) if m]
    gpu = [c for c in lines if "--device cuda" in c]
    return [c for c in lines if c not in gpu], gpu


def test_the_page_and_the_launcher_show_the_same_lines():
    """A line for GPUs with the user's own assets, and two for a CPU: write the assets, then
    train on them; the launcher's docstring shows the same three."""
    cpu, gpu = _page_lines()
    assert len(gpu) == 1 and len(cpu) == 2, (cpu, gpu)
    assert "--write-assets build/torchtitan-assets" in cpu[0] and cpu[0].startswith("python ")
    assert "build/torchtitan-assets/tokenizer" in cpu[1] and cpu[1].startswith("torchrun ")
    docstring = ast.get_docstring(ast.parse(SCRIPT.read_text())) or ""
    docstring = " ".join(docstring.replace("\\\n", " ").split())
    for line in cpu + gpu:
        assert " ".join(line.split()) in docstring, line


def test_torchtitan_trainer_runs_on_a_cpu_as_the_page_writes_it():
    """The run ends cleanly after its 3 steps; our clip ran once a step on each of the 4 ranks,
    with the same bits on all four, and the grad_norm torchtitan's metrics log (each rank logs
    its own line) is ours."""
    framework("torchtitan")
    cpu, _ = _page_lines()
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("OMP_NUM_THREADS", None)  # as a user's shell has it
    outputs = []
    for command in cpu:
        done = subprocess.run(
            shlex.split(command), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
        )
        outputs.append(COLOR.sub("", done.stdout + done.stderr))
        assert done.returncode == 0, (command, outputs[-1][-6000:])
    assert (ROOT / "build" / "torchtitan-assets" / "tokenizer" / "tokenizer.json").is_file()
    steps = int(shlex.split(cpu[1])[shlex.split(cpu[1]).index("--training.steps") + 1])
    output = outputs[1]
    ours = OURS.findall(output)
    # Step k+1's clip cannot start on any rank before step k's all_reduce ended on every rank:
    # the first appearance of each value gives the order of the steps.
    norms = list(dict.fromkeys(ours))
    assert len(norms) == steps and Counter(ours) == dict.fromkeys(norms, WORLD), output[-6000:]
    logged = LOGGED.findall(output)
    assert sorted(int(step) for step, _, _ in logged) == sorted(
        list(range(1, steps + 1)) * WORLD
    ), output[-6000:]
    for step, _, grad_norm in logged:
        norm = float.fromhex(norms[int(step) - 1])
        assert 0 < norm < float("inf")
        assert grad_norm == f"{norm:.4f}", (step, grad_norm, norm)
