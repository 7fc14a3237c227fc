"""CREDIT's own gen2 trainer (``miles-credit`` 2026.2.0) with the spike policy, on 4 gloo ranks.

CREDIT's entry point (``credit.applications.train_gen2``, run by ``torchrun`` through
``credit_run.py``, which only records) trains its ``nextgen_wxformer`` with FSDP2 x native TP
(dp=2 x tp=2) on tiny synthetic NetCDF files read by CREDIT's own ``LocalDataset``, with the
config keys and the patch of the CREDIT page (``docs/credit/miles-credit-2026.2.0.patch``).

Where the patched code lives: the installed CREDIT is never edited. The test copies the installed
``credit`` package into a temporary folder, lays this repository's ``src/credit/parallel`` over
its ``credit/parallel/`` (what installing this package after ``miles-credit`` does, so the files
tested are the working tree's, not the venv's copy), applies the patch there with ``git apply``,
and puts the folder first on the ranks' ``PYTHONPATH``.

One sample, the forcing ``tsi`` at 2020-01-05 00:00 times 100, is the input of dp rank 0's 4th
step of epoch 1 (CREDIT's seeded sampler), past the policy's warm-up of 6 steps. The run goes
through 2 epochs of 8 steps; a second run resumes from the first run's checkpoint of epoch 0 (as
a run stopped after epoch 0 and resumed) and trains epoch 1.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from harness import WORLD, framework

ROOT = Path(__file__).resolve().parents[1]
RELEASE = "2026.2.0"
PATCH = ROOT / "docs" / "credit" / f"miles-credit-{RELEASE}.patch"
STEPS = 8  # per epoch and dp rank
SPIKE_TIME, SPIKE_FACTOR = "2020-01-05T00", 100.0
SPIKE_STEP = STEPS + 4  # the 12th update: dp rank 0's 4th step of epoch 1
SPIKE_RANKS = {0, 1}  # dp rank 0: global ranks 0 and 1 (tp peers)


def _credit_package(folder: Path) -> Path:
    """A copy of the installed CREDIT with this repository's package laid over it, patched."""
    framework("credit.trainers.trainer_gen2")
    assert importlib.metadata.version("miles-credit") == RELEASE
    installed = Path(importlib.metadata.distribution("miles-credit").locate_file("credit"))
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(installed, folder / "credit", ignore=ignore)
    ours = ROOT / "src" / "credit" / "parallel"
    shutil.copytree(ours, folder / "credit" / "parallel", ignore=ignore, dirs_exist_ok=True)
    subprocess.run(["git", "apply", str(PATCH)], cwd=folder, check=True, capture_output=True)
    return folder


def _data(folder: Path) -> Path:
    """Tiny ERA5-like NetCDF files: 2 levels of T and U, SP, the forcing tsi, the static LSM."""
    np = pytest.importorskip("numpy")
    pd = pytest.importorskip("pandas")
    xr = pytest.importorskip("xarray")
    rng = np.random.default_rng(0)
    times = pd.date_range("2020-01-01", periods=26, freq="6h")
    grid = {"latitude": np.linspace(-80, 80, 16), "longitude": np.linspace(0, 360, 32, False)}
    cube = ("time", "level", "latitude", "longitude")
    plane = ("time", "latitude", "longitude")

    def field(dims: tuple[str, ...]) -> tuple[tuple[str, ...], Any]:
        sizes = {"time": len(times), "level": 2, "latitude": 16, "longitude": 32}
        return dims, rng.standard_normal([sizes[d] for d in dims]).astype("float32")

    coords = {"time": times, **grid}
    folder.mkdir()
    prognostic = {"T": field(cube), "U": field(cube), "SP": field(plane)}
    xr.Dataset(prognostic, {**coords, "level": [500, 850]}).to_netcdf(folder / "prog_2020.nc")
    forcing = xr.Dataset({"tsi": field(plane)}, coords)
    forcing["tsi"].loc[{"time": SPIKE_TIME}] *= SPIKE_FACTOR
    forcing.to_netcdf(folder / "forcing_2020.nc")
    static = {"LSM": field(("latitude", "longitude"))}
    xr.Dataset(static, grid).to_netcdf(folder / "static.nc")
    return folder


def _source(data: Path) -> dict[str, Any]:
    files = {
        "prognostic": {"vars_3D": ["T", "U"], "vars_2D": ["SP"], "path": f"{data}/prog_%Y.nc"},
        "dynamic_forcing": {"vars_2D": ["tsi"], "path": f"{data}/forcing_%Y.nc"},
        "static": {"vars_2D": ["LSM"], "path": f"{data}/static.nc"},
    }
    variables = {**files, "diagnostic": None}
    return {
        "dataset_type": "local",
        "level_coord": "level",
        "levels": [500, 850],
        "variables": variables,
    }


MODEL = {  # CREDIT's nextgen_wxformer (native TP), as small as its constraints allow
    "type": "nextgen_wxformer",
    **{"frames": 1, "image_height": 16, "image_width": 32, "levels": 2, "channels": 2},
    **{"surface_channels": 1, "input_only_channels": 2, "output_only_channels": 0},
    **{"dim": [8, 16, 32, 64], "dim_head": 4, "depth": [1, 1, 1, 1]},
    **{"global_window_size": [2, 2, 1, 1], "local_window_size": 1},
    **{"cross_embed_kernel_sizes": [[2, 4]] * 4, "cross_embed_strides": [2, 2, 2, 2]},
    **{"num_spectral_nodes": 4, "col_attn_heads": 2, "use_spectral_norm": False},
}
POSTBLOCKS = {  # the prediction and the target as CREDIT's metrics read them
    "reconstruct": {"type": "reconstruct"},
    "reconstruct_target": {
        "type": "reconstruct",
        "args": {"in_key": "y", "out_key": "y_target_processed"},
    },
}


def _trainer(resume: bool) -> dict[str, Any]:
    loads = ("load_weights", "load_optimizer", "load_scaler", "load_scheduler", "reload_epoch")
    return {
        "type": "era5-gen2",
        "parallelism": {"data": "fsdp2", "tensor": 2, "domain": 1},
        **dict.fromkeys(loads, resume),
        **{"start_epoch": 0, "epochs": 2, "batches_per_epoch": STEPS},
        **{"learning_rate": 0.001, "weight_decay": 0, "amp": False, "grad_accum_every": 1},
        **{"train_batch_size": 1, "valid_batch_size": 1, "thread_workers": 0},
        **{"skip_validation": True, "use_scheduler": False},
        **{"save_backup_weights": False, "save_best_weights": False, "save_every_epoch": True},
        # The CREDIT page's keys: grad_max_norm stays a fixed ceiling (0.0: none).
        "grad_max_norm": 0.0,
        "spike_policy": {"warmup": 6},
    }


def _config(data: Path, save_loc: Path, resume: bool) -> dict[str, Any]:
    period = {"start_datetime": "2020-01-01", "end_datetime": "2020-01-07"}
    return {
        "save_loc": str(save_loc),
        "seed": 1000,
        "data": {"source": {"ERA5": _source(data)}, "timestep": "6h", "forecast_len": 1, **period},
        "preblocks": {"per_step": {"concat": {"type": "concat"}}},
        "postblocks": {"per_step": POSTBLOCKS},
        "model": MODEL,
        "loss": {"training_loss": "mse", "validation_loss": "mse", "use_latitude_weights": False},
        "trainer": _trainer(resume),
    }


def _train(package: Path, config: dict[str, Any], verify_at: str) -> list[dict[str, Any]]:
    """CREDIT's entry point on 4 ranks; what each rank recorded, by rank."""
    yaml = pytest.importorskip("yaml")
    save_loc = Path(config["save_loc"])
    save_loc.mkdir(exist_ok=True)
    (save_loc / "config.yml").write_text(yaml.safe_dump(config))
    command = [
        *(str(Path(sys.executable).parent / "torchrun"), "--standalone"),
        *("--nproc-per-node", str(WORLD), str(Path(__file__).parent / "credit_run.py")),
        *(str(save_loc / "record"), "-c", str(save_loc / "config.yml"), "--backend", "gloo"),
    ]
    env = {**os.environ, "PYTHONPATH": str(package), "CREDIT_RUN_VERIFY_AT": verify_at}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    return [json.loads((save_loc / f"record.{r}.json").read_text()) for r in range(WORLD)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The straight run (2 epochs) and the run resumed from its checkpoint of epoch 0."""
    folder = tmp_path_factory.mktemp("credit")
    package = _credit_package(folder / "package")
    data = _data(folder / "data")
    straight = _train(package, _config(data, folder / "straight", False), f"{STEPS},{2 * STEPS}")
    (epoch0,) = (folder / "straight").glob("checkpoint.pt00000*")
    (folder / "resumed").mkdir()
    shutil.copy(epoch0, folder / "resumed" / "checkpoint.pt")
    resumed = _train(package, _config(data, folder / "resumed", True), str(STEPS))
    return {"straight": straight, "resumed": resumed, "folder": folder}


def test_the_planted_spike_is_skipped_on_every_rank_and_the_weights_stay(runs):
    """The spike's loss is on dp rank 0 at the 12th step; every rank's scaler skips that step and
    no other, and the policy counts one spike; the weights on every rank are unchanged by it and
    changed by every other step."""
    straight = runs["straight"]
    for rank, record in enumerate(straight):
        losses = record["losses"]
        spiked = [step + 1 for step, loss in enumerate(losses) if loss > 5 * min(losses)]
        assert spiked == ([SPIKE_STEP] if rank in SPIKE_RANKS else []), (rank, losses)
        steps = record["steps"]
        assert len(steps) == 2 * STEPS
        skipped = [n + 1 for n, step in enumerate(steps) if step["skipped"]]
        assert skipped == [SPIKE_STEP], (rank, skipped)
        assert [step["spikes"] for step in steps][SPIKE_STEP - 1 :] == [1] * (STEPS - 3)
        assert {step["non_finite"] for step in steps} == {0}
        digests = [record["digest_start"], *(step["digest"] for step in steps)]
        unchanged = [n for n in range(1, len(digests)) if digests[n] == digests[n - 1]]
        assert unchanged == [SPIKE_STEP], (rank, unchanged)
    for n in range(2 * STEPS):  # the same decision and the same norm bits on every rank
        assert len({json.dumps(record["steps"][n]["norm"]) for record in straight}) == 1


def test_replicas_are_verified_after_the_spike_and_at_each_epoch_end(runs):
    """verify_replicas (every copy of every weight and AdamW state, bit-exact) ran on every rank
    after the skipped step and at the end of each epoch, in both runs, and found no mismatch (a
    mismatch raises and the run fails)."""
    for name, expected in (("straight", [STEPS, SPIKE_STEP, 2 * STEPS]), ("resumed", [4, STEPS])):
        for record in runs[name]:
            verified = [n + 1 for n, step in enumerate(record["steps"]) if step.get("verified")]
            assert verified == expected, (name, verified)


def test_a_run_resumed_from_credits_checkpoint_decides_as_the_straight_run(runs):
    """Resumed from the checkpoint of epoch 0 (the policy's state saved beside the scaler's), epoch
    1 skips the same step, with the same norms, weights and counts, and ends with the same policy
    state bits on every rank."""
    for straight, resumed in zip(runs["straight"], runs["resumed"], strict=True):
        assert resumed["steps"] == straight["steps"][STEPS:]
        assert resumed["digest_start"] == straight["steps"][STEPS - 1]["digest"]
        assert resumed["policy_state"] == straight["policy_state"]
    assert len({json.dumps(record["policy_state"]) for record in runs["straight"]}) == 1


def test_credits_epoch_log_leaves_the_skipped_step_out_and_counts_it(runs):
    """training_log.csv: epoch 1's train_loss is the mean of the world's loss over its 7 steps
    taken (the spike's step left out), and the counts of skipped spikes and non-finite steps are
    logged per epoch."""
    pd = pytest.importorskip("pandas")
    log = pd.read_csv(runs["folder"] / "straight" / "training_log.csv")
    assert list(log["train_skipped_spikes"]) == [0.0, 1.0]
    assert list(log["train_skipped_non_finite"]) == [0.0, 0.0]
    world = [
        sum(losses) / WORLD for losses in zip(*(r["losses"] for r in runs["straight"]), strict=True)
    ]
    taken = [loss for n, loss in enumerate(world[STEPS:], STEPS + 1) if n != SPIKE_STEP]
    assert log["train_loss"][1] == pytest.approx(sum(taken) / len(taken), rel=1e-6)
    assert log["train_loss"][1] != pytest.approx(sum(world[STEPS:]) / STEPS, rel=1e-2)
