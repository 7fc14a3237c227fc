"""Installed beside CREDIT (distribution ``miles-credit``), this package replaces only its
``credit.parallel.collectives``.

Two distributions that install a file at the same path overwrite each other without a warning,
so the wheel must carry no file of CREDIT's but ``credit/parallel/collectives.py``, and
``credit`` and ``credit.parallel`` must stay namespace packages here (no ``__init__.py``). The
test builds this project's wheel, downloads CREDIT's from the package registry, installs both
into fresh virtual environments in each order (``--no-deps``; torch comes from this environment
through a ``.pth`` file) and imports them there.
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

# Slow, every test (make test-fast leaves them out): two wheels built, installed in fresh venvs.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CREDIT = "miles-credit==2026.2.0"
CREDIT_FILES = {  # what miles-credit installs under credit/parallel/, and credit/__init__.py
    "credit/__init__.py",
    "credit/parallel/__init__.py",
    "credit/parallel/collectives.py",
    "credit/parallel/domain.py",
    "credit/parallel/fsdp2.py",
    "credit/parallel/mesh.py",
    "credit/parallel/tensor_parallel.py",
}

PROBE = """
import inspect, json
import credit.parallel as package
import credit.parallel.collectives as collectives
from credit.parallel.grad_sync import sync_domain_gradients
from credit.parallel.parallel_mesh import build_device_mesh
print(json.dumps({
    "credit_names": sorted(name for name in package.__all__ if hasattr(package, name)),
    "credit_all": sorted(package.__all__),
    "credit_mesh_signature": str(inspect.signature(package.build_device_mesh)),
    "collectives_is_ours": "distinct_along" in inspect.signature(collectives.total_grad_norm).parameters,
}))
"""


def _run(*command: str | Path, cwd: Path | None = None) -> str:
    result = subprocess.run(
        [str(part) for part in command], capture_output=True, text=True, cwd=cwd, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("wheels")
    pip = (sys.executable, "-m", "pip")
    _run(*pip, "wheel", "--quiet", "--no-deps", "--wheel-dir", folder, ROOT)
    _run(*pip, "download", "--quiet", "--no-deps", "--dest", folder, CREDIT)
    (ours,) = folder.glob("credit_parallel-*.whl")
    (credit,) = folder.glob("miles_credit-*.whl")
    return {"ours": ours, "credit": credit}


def _installed(order: list[Path], folder: Path) -> dict:
    """Install the wheels one after the other into a new venv; what the probe sees there."""
    # No pip of its own (bootstrapping one costs seconds): this environment's pip installs there.
    _run(sys.executable, "-m", "venv", "--without-pip", folder)
    python = folder / "bin" / "python"
    pip = (sys.executable, "-m", "pip", "--python", python)
    for wheel in order:
        _run(*pip, "install", "--quiet", "--no-deps", "--no-index", wheel)
    site = Path(
        _run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").strip()
    )
    (site / "torch_from_the_test_environment.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return json.loads(_run(python, "-c", PROBE, cwd=folder).splitlines()[-1])


def test_the_wheel_carries_no_file_of_credit_but_collectives(wheels):
    with zipfile.ZipFile(wheels["ours"]) as wheel:
        names = {name for name in wheel.namelist() if name.startswith("credit/")}
    assert names & CREDIT_FILES == {"credit/parallel/collectives.py"}
    assert not any("/bench/" in name or name.startswith("credit/parallel/tests") for name in names)


@pytest.mark.parametrize("last", ["ours", "credit"])
def test_both_install_orders_keep_credit_whole(wheels, tmp_path, last):
    first = "credit" if last == "ours" else "ours"
    seen = _installed([wheels[first], wheels[last]], tmp_path / "venv")
    # CREDIT's own package is untouched: every name it exports imports, with its own signature.
    assert seen["credit_names"] == seen["credit_all"]
    assert {"apply_fsdp2", "apply_native_tensor_parallel", "build_device_mesh"} <= set(
        seen["credit_all"]
    )
    assert seen["credit_mesh_signature"].startswith("(parallelism_conf: dict")
    # The one shared file belongs to whichever was installed last.
    assert seen["collectives_is_ours"] == (last == "ours")
