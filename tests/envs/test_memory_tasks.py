"""Memory tasks (rl_tformers.envs.memory_tasks): argument checks, and the commands that build their data files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from rl_tformers.envs.memory_tasks import RecallEnv
from typer.testing import CliRunner

from rl_tformers.cli import app


# ------------------------------------------------- memory / POMDP task arguments
@pytest.mark.parametrize("kwargs, message", [
    ({"delay": 2.0}, "Recall: delay must be an integer, got 2.0 (float)"),
    ({"delay": True}, "Recall: delay must be an integer, got True (bool)"),
    ({"length": "10"}, "Recall: length must be an integer, got '10' (str)"),
])
def test_recall_refuses_arguments_that_are_not_integers(kwargs, message) -> None:
    """delay=2.0 (a YAML float) and delay=True are refused (the first would crash at the first
    scored step with numpy's "only integers ... are valid indices", the second silently mean 1)."""
    with pytest.raises(ValueError) as info:
        RecallEnv(**kwargs)
    assert str(info.value) == message
    env = RecallEnv(delay=np.int64(2), n_symbols=3, length=5)  # numpy integers are integers
    env.reset(seed=0)
    assert env.step(0)[1] == 0.0 and env.delay == 2


runner = CliRunner()


# ------------------------------------------------------------------- a missing scripted-task file
def test_missing_memory_task_file_names_the_command_that_builds_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # no data/ here
    r = runner.invoke(app, ["train", "-c", "gtrxl/recall_bc", "train.steps=2"])
    assert r.exit_code != 0
    assert ("build it with (dataset.build): rl-tformers collect --memory-task recall --delay 8 --episodes 2000 "
            "--hdf5 data/memory/recall-d8.hdf5") in r.output
    assert not (tmp_path / "runs").exists()  # no run directory (nor its runs/ parent) left behind
    # another file on the command line does not get recall-d8's recipe
    r = runner.invoke(app, ["train", "-c", "gtrxl/recall_bc", "dataset.path=other.hdf5", "train.steps=2"])
    assert r.exit_code != 0 and "other.hdf5" in r.output and "--memory-task" not in r.output


def test_every_config_with_a_data_memory_file_says_how_to_build_it() -> None:
    import re

    from rl_tformers.runtime.run_config import available_configs, compose

    checked = 0
    for name in available_configs():
        cfg = compose(name, [])
        path = str(cfg.get("dataset", {}).get("path") or "")
        if path.startswith("data/memory/"):
            build = str(cfg.dataset.get("build") or "")
            assert re.fullmatch(rf"rl-tformers collect --memory-task \w+ .*--hdf5 {re.escape(path)}", build), (name, build)
            checked += 1
    assert checked >= 9
