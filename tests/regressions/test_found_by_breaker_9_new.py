"""Defects found by breaker 9 (new features: resume with dataset.path, plot --from-json checks).

Every test is tiny (CPU, seconds) and needs neither ./data nor ../shared.
"""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import pytest
from typer.testing import CliRunner

from rl_tformers.cli import app
from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.trainer import resume, train

runner = CliRunner()

TINY_DT = ["backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=1", "train.batch_size=4",
           "train.warmup_steps=0", "train.progress=false", "eval.at_end=false", "device=cpu"]


def test_plot_from_json_does_not_refuse_the_run_it_evaluated_when_run_from_another_directory(
        tmp_path: Path, cartpole_h5, monkeypatch: pytest.MonkeyPatch) -> None:
    """`eval runs/x --out e.json` records extra.run_dir / extra.checkpoint as typed (relative);
    `plot --from-json` resolves them against *its* working directory. Plotting the very run the
    file evaluated (by absolute path) from a directory that has another ./dt1 is refused with
    "is an evaluation of the run dt1, but RUN_DIR is /.../dt1"."""
    work = tmp_path / "a"
    work.mkdir()
    data = cartpole_h5(tmp_path / "cp.hdf5")
    train(compose("dt/cartpole_demo", [f"dataset.path={data}", *TINY_DT, "train.steps=1"]), work / "dt1")
    monkeypatch.chdir(work)
    saved = tmp_path / "e.json"
    r = runner.invoke(app, ["eval", "dt1", "--targets", "20", "--episodes", "1", "--envs", "1", "--out", str(saved)])
    assert r.exit_code == 0, r.output
    other = tmp_path / "b"
    other.mkdir()  # another project directory with its own (different) run called dt1
    train(compose("dt/cartpole_demo", [f"dataset.path={data}", *TINY_DT, "train.steps=1", "seed=7"]), other / "dt1")
    monkeypatch.chdir(other)
    r = runner.invoke(app, ["plot", str(work / "dt1"), "--from-json", str(saved), "--out", str(tmp_path / "f.png"),
                            "--no-tensorboard"])
    assert r.exit_code == 0, r.output  # the file evaluated exactly this run


def test_resume_refuses_another_dataset_that_has_the_same_statistics(tmp_path: Path, cartpole_h5) -> None:
    """dataset.path is resumable because "the offline agents refuse data whose statistics differ
    ... so another dataset cannot slip in this way" (config.RESUMABLE_KEYS). A file with the same
    observations, rewards and episode ends but other actions (other behaviour data) has equal
    statistics and is trained on without a word."""
    data = cartpole_h5(tmp_path / "cp.hdf5")
    other = cartpole_h5(tmp_path / "other.hdf5")
    with h5py.File(other, "r+") as f:
        acts = f["actions"][:]
        f["actions"][...] = 1 - acts  # every action flipped
    run = tmp_path / "run"
    train(compose("dt/cartpole_demo", [f"dataset.path={data}", *TINY_DT, "train.steps=1"]), run)
    with pytest.raises(Exception, match="not the data this run was trained on"):
        resume(run, [f"dataset.path={other}", "train.steps=2"])
    assert not (run / "checkpoints" / "step_000000002.pt").exists()


def test_plot_from_json_with_an_out_of_range_step_is_a_clean_error_not_a_traceback(tmp_path: Path, cartpole_h5) -> None:
    """`_saved_step` takes any int in extra.step (a hand-edited file) and `plot` logs the figure to
    TensorBoard at it: 10**30 crashes in SummaryWriter.add_event with an uncaught
    ``ValueError: Value out of range`` (a negative step is logged and titled "(step -3)")."""
    run = tmp_path / "run"
    train(compose("dt/cartpole_demo", [f"dataset.path={cartpole_h5(tmp_path / 'cp.hdf5')}", *TINY_DT, "train.steps=1"]),
          run)
    saved = tmp_path / "e.json"
    r = runner.invoke(app, ["eval", str(run), "--targets", "20", "--episodes", "1", "--envs", "1", "--out", str(saved)])
    assert r.exit_code == 0, r.output
    data = json.loads(saved.read_text())
    data["extra"]["step"] = 10**30
    saved.write_text(json.dumps(data))
    r = runner.invoke(app, ["plot", str(run), "--from-json", str(saved), "--out", str(tmp_path / "f.png")])
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
