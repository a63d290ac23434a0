"""The run lock (rl_tformers.runtime.runlock): one process trains a run directory at a time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rl_tformers.cli import app
from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.runlock import hold_run, lock_holder
from rl_tformers.runtime.trainer import RunDirError, resume, train
from tests.runs import train_dt

runner = CliRunner()


TOY_4_STEPS = ["agent.kind=toy", "train.steps=4", "train.batch_size=4", "backbone.n_layers=1", "train.log_every=2",
       "train.checkpoint_every=0", "train.warmup_steps=1", "eval.every=0"]


# ------------------------------------------------------------------- one trainer per run directory
def test_a_run_directory_being_trained_is_refused(tmp_path: Path) -> None:
    cfg = compose(None, [*TOY_4_STEPS, "eval.at_end=false", "device=cpu", "train.progress=false"])
    train(cfg, tmp_path / "run", stop_at=2)
    with hold_run(tmp_path / "run"):
        assert lock_holder(tmp_path / "run") == os.getpid()
        with pytest.raises(RunDirError, match=f"run is being trained by pid {os.getpid()}"):
            resume(tmp_path / "run")
        with pytest.raises(RunDirError, match=f"run is being trained by pid {os.getpid()}"):
            train(cfg, tmp_path / "run")
        r = runner.invoke(app, ["train", "--resume", str(tmp_path / "run")])
        assert r.exit_code == 2 and f"is being trained by pid {os.getpid()}" in r.output
    assert lock_holder(tmp_path / "run") is None
    assert resume(tmp_path / "run").complete


def test_the_run_lock_is_released_when_its_process_dies(tmp_path: Path) -> None:
    code = ("import sys, time; from rl_tformers.runtime.runlock import hold_run\n"
            "with hold_run(sys.argv[1]):\n    print('locked', flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        assert lock_holder(tmp_path / "run") == proc.pid
    finally:
        proc.kill()
        proc.wait()
    assert lock_holder(tmp_path / "run") is None
    with hold_run(tmp_path / "run"):
        pass


def test_a_refused_run_leaves_no_directory_behind(tmp_path: Path) -> None:
    r = train_dt(f"dataset.path={tmp_path / 'nope.hdf5'}", "--run-dir", str(tmp_path / "run"))
    assert r.exit_code == 2 and not (tmp_path / "run").exists()
