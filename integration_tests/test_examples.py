"""The complete scripts of docs/examples/, run by the commands the Integrations page and the
README show.

Every console line of ``docs/integrations.rst`` and every inline command of ``README.md`` that
runs a script of ``docs/examples/`` on the CPU (those with ``--device cuda`` need 4 GPUs, those
with ``--nnodes`` several machines; torchtitan's trainer's two lines, the second reading what the
first writes, in ``test_torchtitan_trainer.py``) is run here as written, once, from the
repository root, with this environment's ``python``, ``torchrun`` and ``accelerate`` first on
the PATH. Each script prints one line per step; the framework scripts, the plain loop and the spike example (which
raises unless its planted spike was skipped) end with a ``done:`` line once
every rank has proven every copy of every weight and optimizer state bit-identical
(``verify_replicas``). Their gradient norms are the same on every rank by construction of the
clip, which the other integration tests check against the materialised gradients.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from harness import framework

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "integrations.rst"
README = ROOT / "README.md"
# A console line of the page: "$ <command> ... docs/examples/<script>.py [arguments]".
COMMAND = re.compile(r"^\s*\$ (?P<command>\S.*docs/examples/(?P<script>\w+)\.py.*?)\s*$")
# An inline command of the README, which may wrap: `torchrun ... docs/examples/<script>.py ...`.
INLINE = re.compile(
    r"`(?P<command>(?:torchrun|python|accelerate launch)\s[^`]*?docs/examples/(?P<script>\w+)\.py[^`]*)`"
)
# Scripts that end with "done: ... replicas verified" (the framework scripts and the plain loop).
DONE = re.compile(r"^done: \d+ steps on 4 \w+.*replicas verified$", re.MULTILINE)
FRAMEWORKS = {
    "lightning_fsdp_tp": "lightning",
    "accelerate_fsdp_tp": "accelerate",
    "torchtitan_meshes": "torchtitan",
    "torchtune_tp": "torchtune",
}
STEP = re.compile(r"^step (\d+)  loss (\S+)  grad_norm (\S+)", re.MULTILINE)


# Scripts whose lines a test of their own runs as written, in order (the first writes what the
# second reads): torchtitan's trainer, in test_torchtitan_trainer.py.
OWN_TEST = {"torchtitan_trainer"}


def _runs_here(command: str) -> bool:
    return "--device cuda" not in command and "--nnodes" not in command


def _commands() -> list[tuple[str, str]]:
    """(script, command) for every CPU command of the page, then of the README, each once."""
    found = [
        (m["script"], m["command"]) for m in map(COMMAND.match, PAGE.read_text().splitlines()) if m
    ]
    found += [
        (m["script"], " ".join(m["command"].split())) for m in INLINE.finditer(README.read_text())
    ]
    return list(dict.fromkeys(c for c in found if _runs_here(c[1]) and c[0] not in OWN_TEST))


COMMANDS = _commands()


def test_the_page_runs_a_script_per_framework_the_plain_loop_and_the_spikes():
    scripts = {script for script, _ in COMMANDS}
    assert scripts >= {"torchrun_loop", "spikes", *FRAMEWORKS}, scripts
    for script in scripts:
        assert (ROOT / "docs" / "examples" / f"{script}.py").is_file(), script


@pytest.mark.parametrize(("script", "command"), COMMANDS, ids=[c for _, c in COMMANDS])
def test_page_command_runs_as_written(script, command):
    if script in FRAMEWORKS:
        framework(FRAMEWORKS[script])
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("OMP_NUM_THREADS", None)  # as a user's shell has it
    done = subprocess.run(
        shlex.split(command), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = STEP.findall(done.stdout)
    assert [int(step) for step, _, _ in steps] == list(range(len(steps))), done.stdout
    assert len(steps) >= 3 and all(math.isfinite(float(norm)) for _, _, norm in steps)
    if script != "fsdp_tp_domain":  # the README's 8-rank example checks its norms, not replicas
        assert DONE.search(done.stdout), done.stdout


# The page's "tune cp" lines: recipes and configs copied to files of one's own to edit.
TUNE_CP = [
    m["command"]
    for m in map(
        re.compile(r"^\s*\$ (?P<command>tune cp .*?)\s*$").match, PAGE.read_text().splitlines()
    )
    if m
]


def test_tune_cp_lines_give_the_recipe_the_page_edits(tmp_path):
    """Each ``tune cp`` line of the page, run as written (in a folder of its own: it writes
    there), copies its file; the recipe holds the clip call the page says to replace."""
    framework("torchtune")
    assert len(TUNE_CP) == 2, TUNE_CP
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    for command in TUNE_CP:
        done = subprocess.run(
            shlex.split(command), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert (tmp_path / shlex.split(command)[-1]).is_file(), command
    recipe = (tmp_path / "my_recipe.py").read_text()
    assert recipe.count("torch.nn.utils.clip_grad_norm_(") == 1, "the page's edit no longer fits"
    assert "isinstance(grad_norm, DTensor)" in recipe
