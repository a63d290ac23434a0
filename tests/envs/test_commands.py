"""CLI: ``rl-tformers collect`` and ``rl-tformers dataset info``."""

from __future__ import annotations

import json

import h5py
import numpy as np
from typer.testing import CliRunner

from rl_tformers.cli import app

runner = CliRunner()

INFO_KEYS = {"episodes", "steps", "return_mean", "return_std", "return_min", "return_max", "length_min", "length_max",
             "terminations", "truncations", "observation_shape", "action_space"}


def test_collect_then_dataset_info_json(tmp_path):
    r = runner.invoke(app, ["collect", "--env", "Hopper-v5", "--episodes", "3", "--root", str(tmp_path), "--json",
                            "--no-progress", "--seed", "1", "--hdf5", str(tmp_path / "r.hdf5")])
    assert r.exit_code == 0, r.output
    made = json.loads(r.stdout.strip().splitlines()[-1])
    assert made["dataset_id"] == "rlt/hopper-v5/random-v0" and made["episodes"] == 3
    for spec in ("rlt/hopper-v5/random-v0", str(tmp_path / "r.hdf5")):
        r = runner.invoke(app, ["dataset", "info", spec, "--json", "--root", str(tmp_path)])
        assert r.exit_code == 0, r.output
        info = json.loads(r.stdout)
        assert INFO_KEYS <= info.keys()
        assert info["episodes"] == 3 and info["steps"] == made["steps"]
        assert info["return_mean"] == made["return_mean"]
        assert info["observation_shape"] == [11] and info["action_space"] == "Box(-1.0, 1.0, (3,), float32)"
        assert info["terminations"] + info["truncations"] == 3
        assert info["ref_min_score"] == -20.272305
    r = runner.invoke(app, ["dataset", "info", "rlt/hopper-v5/random-v0", "--root", str(tmp_path)])
    assert r.exit_code == 0 and "return_mean" in r.stdout
    r = runner.invoke(app, ["dataset", "export", "rlt/hopper-v5/random-v0", str(tmp_path / "e.hdf5"), "--root",
                            str(tmp_path)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["dataset", "info", str(tmp_path / "e.hdf5"), "--json"])
    assert json.loads(r.stdout)["return_mean"] == made["return_mean"]


def test_collect_with_observation_indices(tmp_path):
    r = runner.invoke(app, ["collect", "--env", "Hopper-v5", "--episodes", "1", "--root", str(tmp_path), "--json",
                            "--no-progress", "--obs-indices", "0,3,10"])
    assert r.exit_code == 0, r.output
    made = json.loads(r.stdout.strip().splitlines()[-1])
    assert made["dataset_id"] == "rlt/hopper-v5/random-masked-v0"
    r = runner.invoke(app, ["dataset", "info", made["dataset_id"], "--json", "--root", str(tmp_path)])
    info = json.loads(r.stdout)
    assert info["observation_shape"] == [3] and info["pomdp"]["indices"] == [0, 3, 10]


def test_bad_dataset_exits_nonzero_with_the_validation_error_on_stderr(tmp_path):
    path = tmp_path / "bad.hdf5"
    with h5py.File(path, "w") as f:
        f["observations"] = np.zeros((4, 2), np.float32)
        f["actions"] = np.zeros((4, 1), np.float32)
        f["rewards"] = np.array([0.0, np.nan, 0.0, 0.0], np.float32)
        f["terminals"] = np.array([0, 0, 0, 1])
        f["timeouts"] = np.zeros(4)
    r = runner.invoke(app, ["dataset", "info", str(path), "--json"])
    assert r.exit_code == 1
    assert r.stdout == ""
    assert "rewards: episode 0, step 1" in r.stderr
    r = runner.invoke(app, ["dataset", "info", "nobody/nothing-v0", "--root", str(tmp_path)])
    assert r.exit_code == 1 and "not found" in r.stderr


def test_list_recipes_and_unknown_recipe():
    r = runner.invoke(app, ["collect", "--list-recipes"])
    assert r.exit_code == 0
    names = [line.split()[0] for line in r.stdout.splitlines()]
    assert len(names) == 30 and "hopper-medium-replay-positions" in names
    r = runner.invoke(app, ["collect", "--recipe", "pong-*"])
    assert r.exit_code == 1 and "no recipe matches 'pong-*'" in r.stderr
