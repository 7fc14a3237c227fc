"""Every install line of the README and the docs, run as written.

The package is not on a package index yet: the pages install it from the checkout
(``pip install -e .``, and ``-e ".[<framework>]"`` with a framework's extra), after torch and
numpy. Each ``pip install`` line found there (in the README's code blocks and inline code, and in
the docs' inline code and console lines) runs here once, in the order the pages give them (the
README's first, torch first), from the repository root, in a fresh virtual environment whose
``pip`` is first on the PATH. The one line not run is the CUDA build of torch (several GB, and no
GPU here); the pages' other lines must not pull it in either: the CPU build the first line
installs is still there at the end.

On a machine where torch's own index cannot be reached, its CPU line takes torch from the
machine's pip configuration (a local wheel), as pip would for a user there; ``PIP_RETRIES=0``
keeps pip from retrying the unreachable index for minutes.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.rst"))
# A line of a code block ("pip install ...", or "$ pip install ..." in a console block).
BLOCK_LINE = re.compile(r"^\s*(?:\$ )?(?P<command>pip install .*?)\s*$", re.M)
MARKDOWN_INLINE = re.compile(r"(?<!`)`(?P<command>pip install [^`]+)`(?!`)")
RST_INLINE = re.compile(r"``(?P<command>pip install [^`]+)``")
PROBE = """
import importlib.metadata as metadata, json, warnings
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    import torch
import credit.parallel.collectives as collectives
names = ["lightning", "accelerate", "torchtitan", "torchtune", "torchao"]
print(json.dumps({
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
    "torch_warnings": [str(w.message) for w in seen],
    "collectives": collectives.__file__,
    "versions": {name: metadata.version(name) for name in names},
}))
"""


def _argv(command: str) -> list[str]:
    return shlex.split(" ".join(command.split()), comments=True)


def install_lines() -> list[list[str]]:
    """Every ``pip install`` line of the README, then of the docs, each once, as argv."""
    found = []
    readme = README.read_text()
    blocks = "\n".join(re.findall(r"^```\w*\n(.*?)^```", readme, re.M | re.S))
    found += [m["command"] for m in BLOCK_LINE.finditer(blocks)]
    found += [m["command"] for m in MARKDOWN_INLINE.finditer(readme)]
    for page in DOCS:
        text = page.read_text()
        found += [m["command"] for m in re.finditer(r"^\s*\$ (pip install .*?)\s*$", text, re.M)]
        found += [m["command"] for m in RST_INLINE.finditer(text)]
    unique = dict.fromkeys(shlex.join(_argv(command)) for command in found)
    return [shlex.split(command) for command in unique]


def _cuda_torch(argv: list[str]) -> bool:
    """The CUDA build of torch: torch from an index other than torch's CPU one."""
    return any(re.match(r"torch\b", arg) for arg in argv) and not any(
        "/whl/cpu" in arg for arg in argv
    )


def _pins() -> dict[str, str]:
    """The releases the framework extras of pyproject.toml pin (``name = ["package==X", ...]``)."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    pins = {}
    for name in ("lightning", "accelerate", "torchtitan", "torchtune"):
        (extra,) = re.findall(rf"^{name} = \[(.*)\]$", pyproject, re.M)
        pins.update(re.findall(r'"([\w-]+)==([\w.]+)"', extra))
    return pins


def test_the_pages_install_lines_are_found_and_all_but_cuda_runs_here():
    lines = install_lines()
    commands = [shlex.join(argv) for argv in lines]
    assert [c for c in commands if _cuda_torch(shlex.split(c))] == ["pip install torch==2.13.0"]
    assert commands[0].startswith("pip install torch==2.13.0 --index-url"), commands
    for extra in ("lightning", "accelerate", "torchtitan", "torchtune", "integrations"):
        assert f"pip install -e '.[{extra}]'" in commands, (extra, commands)
    assert not [c for c in commands if "credit-parallel" in c], commands  # not on an index


def test_every_install_line_runs_as_written_in_a_fresh_environment(tmp_path):
    """Each line succeeds; torch is the CPU build the first line installed, imports without a
    warning (numpy is there), the package is the checkout's, and every framework is at the
    release its extra pins."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True, timeout=300)
    env = dict(os.environ)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PIP_RETRIES"] = "0"
    env.pop("PYTHONPATH", None)
    for argv in install_lines():
        if _cuda_torch(argv):
            continue
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
        assert done.returncode == 0, (shlex.join(argv), done.stdout[-3000:] + done.stderr[-3000:])
    probe = subprocess.run(
        [venv / "bin" / "python", "-c", PROBE],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    seen = json.loads(probe.stdout.splitlines()[-1])
    assert seen["torch"].startswith("2.13.0") and seen["cuda"] is None, seen
    assert seen["torch_warnings"] == [] and "NumPy" not in probe.stderr, probe.stderr
    assert Path(seen["collectives"]).is_relative_to(ROOT / "src"), seen["collectives"]
    assert seen["versions"] == _pins(), seen["versions"]
