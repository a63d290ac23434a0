"""CLI: ``rl-tformers collect`` and ``rl-tformers dataset info``."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import gymnasium as gym
import h5py
import numpy as np
import pytest
import torch
from rl_tformers.envs import collect as C
from rl_tformers.envs.collect import Behaviour, collect
from rl_tformers.envs.dataset import DatasetError
from rl_tformers.envs.loaders import load_dataset
from rl_tformers.envs.policies import RandomPolicy, load_sb3_policy, train_sb3
from typer.testing import CliRunner

from rl_tformers.bench import attention as A
from rl_tformers.bench import eval as E
from rl_tformers.bench import reversible as R
from rl_tformers.cli import app
from tests.datafiles import write_cartpole_h5, write_d4rl_h5
from tests.runs import assert_clean_exit, tripwire

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
    assert r.exit_code == 2
    assert r.stdout == ""
    assert "rewards: episode 0, step 1" in r.stderr
    r = runner.invoke(app, ["dataset", "info", "nobody/nothing-v0", "--root", str(tmp_path)])
    assert r.exit_code == 2 and "not found" in r.stderr


def test_list_recipes_and_unknown_recipe():
    r = runner.invoke(app, ["collect", "--list-recipes"])
    assert r.exit_code == 0
    names = [line.split()[0] for line in r.stdout.splitlines()]
    assert len(names) == 31 and "hopper-medium-replay-positions" in names and "minatar-breakout-dqn-replay" in names
    r = runner.invoke(app, ["collect", "--recipe", "pong-*"])
    assert r.exit_code == 2 and "no recipe matches 'pong-*'" in r.stderr


def _cartpole(root: Path, dataset_id: str, episodes: int, policy=None, overwrite: bool = False):
    env = gym.make("CartPole-v1")
    pol = policy or RandomPolicy(env.action_space, seed=0)
    return collect("CartPole-v1", [Behaviour(pol, episodes=episodes)], dataset_id=dataset_id, root=root,
                   overwrite=overwrite, progress=False)


# ----------------------------------------------------- an interrupted --overwrite kept nothing
class _Interrupting:
    """A policy whose third action raises ``error`` (Ctrl-C, or a failure)."""

    def __init__(self, space, error: type[BaseException]):
        self.random, self.calls, self.error = RandomPolicy(space, seed=1), 0, error

    def reset(self) -> None:
        pass

    def __call__(self, obs):
        self.calls += 1
        if self.calls == 3:
            raise self.error("stop")
        return self.random(obs)


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_an_interrupted_overwrite_keeps_the_dataset_it_was_replacing(tmp_path: Path, error) -> None:
    old = _cartpole(tmp_path, "tst/keep-v0", episodes=2)
    before = load_dataset("tst/keep-v0", root=tmp_path)
    with pytest.raises(error):
        _cartpole(tmp_path, "tst/keep-v0", episodes=50, overwrite=True,
                  policy=_Interrupting(gym.make("CartPole-v1").action_space, error))
    after = load_dataset("tst/keep-v0", root=tmp_path)
    assert after.num_steps == before.num_steps == old.num_steps
    assert np.array_equal(after.observations, before.observations)
    assert sorted(p.name for p in (tmp_path / "tst").iterdir()) == ["keep-v0", "namespace_metadata.json"]


def test_a_completed_overwrite_replaces_and_leaves_no_backup(tmp_path: Path) -> None:
    _cartpole(tmp_path, "tst/keep-v0", episodes=1)
    new = _cartpole(tmp_path, "tst/keep-v0", episodes=2, overwrite=True)
    assert load_dataset("tst/keep-v0", root=tmp_path).num_episodes == new.num_episodes == 2
    assert sorted(p.name for p in (tmp_path / "tst").iterdir()) == ["keep-v0", "namespace_metadata.json"]


# ----------------------------------------------------- collect values checked by name
@pytest.mark.parametrize(("args", "says"), [
    (["--env", "Pendulum-v1", "--noise", "-1"], "--noise must be a finite number >= 0"),
    (["--env", "Pendulum-v1", "--noise", "nan"], "--noise must be a finite number >= 0"),
    (["--env", "Pendulum-v1", "--noise", "inf"], "--noise must be a finite number >= 0"),
    (["--env", "Pendulum-v1", "--epsilon", "nan"], "--epsilon must be a probability in [0, 1], got nan"),
    (["--env", "Pendulum-v1", "--epsilon", "-0.5"], "--epsilon must be a probability in [0, 1], got -0.5"),
    (["--env", "Pendulum-v1", "--train", "ppo", "--train-steps", "0"], "--train-steps must be >= 1, got 0"),
    (["--env", "CartPole-v1", "--seed", "-1"], "--seed must be >= 0 (it seeds the episode resets), got -1"),
    (["--env", "CartPole-v1", "--dataset-id", "bad"], "--dataset-id 'bad' is not a Minari dataset id"),
    (["--env", "CartPole-v1", "--dataset-id", "ns/bad"], "--dataset-id 'ns/bad' is not a Minari dataset id"),
    (["--env", "CartPole-v1", "--dataset-id", ""], "--dataset-id '' is not a Minari dataset id"),
    (["--env", "CartPole-v1", "--train", "ppo", "--replay-dataset-id", "ns/bad"],
     "--replay-dataset-id 'ns/bad' is not a Minari dataset id"),
    (["--env", "CartPole-v1", "--recipe-steps", "5"], "--recipe-steps needs --recipe"),
    (["--recipe", "hopper-random", "--recipe-steps", "0"], "--recipe-steps must be >= 6, got 0"),
    (["--recipe", "hopper-random", "--seed", "-2"], "--seed must be >= 0"),
    (["--recipe", "hopper-random", "--env", "Hopper-v5", "--steps", "5", "--noise", "0.1"],
     "--env, --steps, --noise: not used with --recipe"),
    (["--recipe", "hopper-random", "--dataset-id", "rlt/x-v0"], "--dataset-id: not used with --recipe"),
    (["--recipe", "hopper-random", "--recipe-version", "2"], "--recipe-version 2: the recipe versions are 0, 1"),
    (["--env", "CartPole-v1", "--recipe-version", "0"], "--recipe-version needs --recipe"),
    (["--recipe", "hopper-medium", "--stochastic"], "--stochastic: not used with --recipe"),
    (["--env", "CartPole-v1", "--stochastic"], "--stochastic samples the actions of a --policy save file"),
    (["--env", "CartPole-v1", "--until-return", "100"], "--until-return needs --train"),
    (["--env", "CartPole-v1", "--train", "ppo", "--until-return", "nan"],
     "--until-return must be a finite return, got nan"),
    (["--memory-task", "recall", "--hdf5", "x.hdf5", "--recipe-version", "0"], "--recipe-version: not used with --memory-task"),
])
def test_collect_refuses_bad_values_by_name_before_collecting(tmp_path: Path, monkeypatch, args, says) -> None:
    monkeypatch.setattr(C, "_collect", tripwire)
    monkeypatch.setattr(C, "train_sb3", tripwire, raising=False)
    monkeypatch.setattr("rl_tformers.envs.policies.train_sb3", tripwire)
    r = runner.invoke(app, ["collect", "--root", str(tmp_path / "data"), "--episodes", "1", "--no-progress", *args]
                      if "--recipe" not in args else
                      ["collect", "--root", str(tmp_path / "data"), "--no-progress", *args])
    out = " ".join(r.output.replace("│", " ").split())
    assert r.exit_code != 0 and not isinstance(r.exception, AssertionError), r.output
    assert says in out, out
    assert "Traceback" not in r.output
    assert not (tmp_path / "data").exists() or not any((tmp_path / "data").rglob("metadata.json"))


# ----------------------------------------------------- a policy for another environment
def _fake_sb3_zip(path: Path, obs_shape: list[int], act_shape: list[int]) -> Path:
    data = {"policy_class": {"__module__": "stable_baselines3.sac.policies"},
            "observation_space": {"shape": obs_shape}, "action_space": {"shape": act_shape}}
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("data", json.dumps(data))
    return path


def test_a_policy_trained_on_other_shapes_is_refused_naming_both(tmp_path: Path) -> None:
    env = gym.make("Pendulum-v1")  # observation (3,), action (1,)
    with pytest.raises(ValueError, match=r"trained with observation space of shape \(11,\), but Pendulum-v1 has Box"):
        load_sb3_policy(_fake_sb3_zip(tmp_path / "a.zip", [11], [1]), env)
    with pytest.raises(ValueError, match=r"trained with action space of shape \(3,\), but Pendulum-v1 has Box"):
        load_sb3_policy(_fake_sb3_zip(tmp_path / "b.zip", [3], [3]), env)
    r = runner.invoke(app, ["collect", "--root", str(tmp_path / "d"), "--env", "Pendulum-v1", "--episodes", "1",
                            "--policy", str(tmp_path / "a.zip"), "--no-progress"])
    assert r.exit_code == 2 and "error: --policy" in r.output and "shape (11,)" in r.output, r.output
    assert "Traceback" not in r.output


def test_training_an_algorithm_on_an_action_space_it_cannot_use_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"--train sac: cannot train on CartPole-v1: .*Discrete\(2\)"):
        train_sb3("sac", gym.make("CartPole-v1"), 1)


# ----------------------------------------------------- malformed pomdp records
def _h5_with_pomdp(path: Path, pomdp) -> Path:
    n = 6
    with h5py.File(path, "w") as f:
        f["observations"] = np.zeros((n, 2), np.float32)
        f["actions"] = np.zeros((n, 1), np.float32)
        f["rewards"] = np.ones(n, np.float32)
        f["terminals"] = np.array([0, 0, 1, 0, 0, 1], bool)
        f["timeouts"] = np.zeros(n, bool)
        f.attrs["rl_tformers_metadata"] = json.dumps({"pomdp": pomdp})
    return path


@pytest.mark.parametrize(("pomdp", "says"), [
    ("yes", "pomdp: 'yes' is a str, not an object"),
    ({"kind": "hide", "indices": [0, 1], "source_shape": [4]}, "pomdp: kind 'hide' is not one of positions, mask"),
    ({"kind": "mask", "indices": [0, 9], "source_shape": [4]}, "pomdp: indices [9] are outside [0, 4)"),
    ({"kind": "mask", "indices": [1, 1], "source_shape": [4]}, "pomdp: indices [1, 1] repeat"),
    ({"kind": "mask", "indices": [0, 1, 2], "source_shape": [4]},
     "pomdp: 3 indices, but the observations have shape (2,)"),
    ({"kind": "mask", "indices": [0, True], "source_shape": [4]}, "pomdp: indices [0, True] is not a non-empty list"),
    ({"kind": "mask", "indices": [0, 1]}, "pomdp: source_shape None is not a non-empty list of integers"),
])
def test_a_malformed_pomdp_record_is_refused_at_load(tmp_path: Path, pomdp, says) -> None:
    path = _h5_with_pomdp(tmp_path / "d.hdf5", pomdp)
    with pytest.raises(DatasetError, match=r"^" + __import__("re").escape(says)) as err:
        load_dataset(path)
    assert err.value.field == "pomdp" and "attribute rl_tformers_metadata" in str(err.value)
    r = runner.invoke(app, ["dataset", "info", str(path)])
    assert r.exit_code == 2 and f"error: {says}" in r.output, r.output


def test_a_well_formed_pomdp_record_loads(tmp_path: Path) -> None:
    rec = {"kind": "mask", "indices": [0, 3], "source_shape": [4]}
    assert load_dataset(_h5_with_pomdp(tmp_path / "d.hdf5", rec)).metadata.pomdp == rec


def test_a_malformed_pomdp_record_in_minari_metadata_is_refused(tmp_path: Path) -> None:
    _cartpole(tmp_path, "tst/pomdp-v0", episodes=1)
    meta = tmp_path / "tst" / "pomdp-v0" / "data" / "metadata.json"
    m = json.loads(meta.read_text())
    m["rl_tformers"]["pomdp"] = {"kind": "mask", "indices": [9, 10], "source_shape": [4]}
    meta.write_text(json.dumps(m))
    r = runner.invoke(app, ["dataset", "info", "tst/pomdp-v0", "--root", str(tmp_path)])
    assert r.exit_code == 2, r.output
    assert "error: pomdp: indices [9, 10] are outside [0, 4) (source_shape [4]) in the Minari metadata of " \
           "tst/pomdp-v0" in r.output


# ----------------------------------------------------- export below a file
def test_dataset_export_below_a_file_is_refused_before_loading(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("rl_tformers.envs.loaders.load_dataset", tripwire)
    blocker = tmp_path / "f.hdf5"
    blocker.write_text("x")
    r = runner.invoke(app, ["dataset", "export", str(blocker), str(blocker / "out.hdf5")])
    assert r.exit_code == 2 and f"error: OUT {blocker / 'out.hdf5'}: {blocker} is a file, not a directory" in r.output


# ----------------------------------------------------- bench attention options
TINY = ["--kinds", "sdpa", "--lengths", "8", "--d-model", "8", "--n-heads", "2", "--repeats", "1"]


@pytest.mark.parametrize(("args", "says"), [
    (["--kinds", ""], "--kinds is empty; give comma-separated attention kinds, or 'all'"),
    (["--kinds", "sdpa,sdpa"], "--kinds: 'sdpa' is given twice"),
    (["--lengths", "8,8"], "--lengths: 8 is given twice"),
    (["--lengths", "1.5"], "--lengths '1.5': expected comma-separated integers"),
    (["--batch", "0"], "--batch must be >= 1, got 0"),
    (["--d-model", "0"], "--d-model must be >= 1, got 0"),
    (["--n-heads", "0"], "--n-heads must be >= 1, got 0"),
    (["--d-model", "10", "--n-heads", "4"], "--d-model 10 is not divisible by --n-heads 4"),
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--memory-budget-gb", "nan"], "--memory-budget-gb must be a positive number, got nan"),
    (["--memory-budget-gb", "-1"], "--memory-budget-gb must be a positive number, got -1.0"),
    (["--time-budget-s", "0"], "--time-budget-s must be a positive number, got 0.0"),
    (["--device", "tpu"], "--device 'tpu': use cpu or cuda"),
    (["--rl-steps", "5"], "--rl-steps is used by the RL-scale cases only; add --rl-scale"),
    (["--rl-option", "steps=5"], "--rl-option is used by the RL-scale cases only; add --rl-scale"),
    (["--rl-scale", "--rl-option", "foo"], "--rl-option: expected key=value, got 'foo'"),
    (["--rl-scale", "--rl-option", "foo=1"], "unknown dt_long_context options ['foo']"),
    (["--rl-scale", "--rl-steps", "0"], "--rl-steps must be >= 1, got 0"),
])
def test_bench_attention_refuses_bad_options_before_measuring(monkeypatch, args, says) -> None:
    monkeypatch.setattr(A, "run", tripwire)
    monkeypatch.setattr(A, "run_rl_scale", tripwire)
    r = runner.invoke(app, ["bench", "attention", *TINY, *args])
    assert r.exit_code == 2 and f"error: {says}" in r.output, r.output


def test_bench_attention_refuses_an_unavailable_cuda_device(monkeypatch) -> None:
    monkeypatch.setattr(A, "run", tripwire)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = runner.invoke(app, ["bench", "attention", *TINY, "--device", "cuda"])
    assert r.exit_code == 2 and "error: --device cuda: CUDA is not available here" in r.output, r.output


def test_bench_attention_out_and_plot_paths(tmp_path: Path, monkeypatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setattr(A, "run", tripwire)
    for option, path, says in (("--out", tmp_path, f"--out {tmp_path} is a directory"),
                               ("--out", blocker / "a.json", f"--out {blocker / 'a.json'}: {blocker} is a file, not a directory"),
                               ("--plot", tmp_path, f"--plot {tmp_path} is a directory"),
                               ("--plot", blocker / "p.png", f"--plot {blocker / 'p.png'}: {blocker} is a file")):
        r = runner.invoke(app, ["bench", "attention", *TINY, option, str(path)])
        assert r.exit_code == 2 and f"error: {says}" in r.output, r.output
    monkeypatch.undo()
    out, fig = tmp_path / "new" / "a" / "b.json", tmp_path / "new2" / "p.png"
    r = runner.invoke(app, ["bench", "attention", *TINY, "--out", str(out), "--plot", str(fig)])
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["rows"][0]["kind"] == "sdpa" and fig.stat().st_size > 0


# ----------------------------------------------------- bench reversible and bench eval
@pytest.mark.parametrize(("args", "says"), [
    (["--depths", ""], "--depths: give at least one number of layers"),
    (["--depths", "0"], "--depths: every depth must be >= 1, got 0"),
    (["--depths", "1.5"], "--depths '1.5': expected comma-separated integers"),
    (["--depths", "1,1"], "--depths: 1 is given twice"),
    (["--depths", "1", "--batch", "0"], "--batch must be >= 1, got 0"),
    (["--depths", "1", "--seq-len", "0"], "--seq-len must be >= 1, got 0"),
    (["--depths", "1", "--d-model", "8", "--n-heads", "3"], "--d-model 8 is not divisible by --n-heads 3"),
    (["--depths", "1", "--device", "tpu"], "--device 'tpu': use cpu or cuda"),
])
def test_bench_reversible_refuses_bad_options_by_name(monkeypatch, args, says) -> None:
    monkeypatch.setattr(R, "run", tripwire)
    r = runner.invoke(app, ["bench", "reversible", *args])
    assert r.exit_code == 2 and f"error: {says}" in r.output, r.output


@pytest.mark.parametrize(("args", "says"), [
    (["--skip-rollouts", "--memory-kinds", ""], "nothing to measure: --skip-rollouts skips part 1 and "
                                                "--memory-kinds '' skips part 2"),
    (["--skip-rollouts", "--memory-kinds", "xl,xl"], "--memory-kinds: 'xl' is given twice"),
    (["--skip-rollouts", "--mem-lens", "4,4"], "--mem-lens: 4 is given twice"),
    (["--device", "tpu"], "--device 'tpu': use cpu or cuda"),
])
def test_bench_eval_refuses_bad_options_by_name(monkeypatch, args, says) -> None:
    monkeypatch.setattr(E, "run", tripwire)
    r = runner.invoke(app, ["bench", "eval", *args])
    assert r.exit_code == 2 and f"error: {says}" in r.output, r.output


# ------------------------------------------------- 3 and 4: output layout
def test_dataset_info_json_is_one_indented_object(tmp_path: Path) -> None:
    path = write_cartpole_h5(tmp_path / "cp.hdf5")
    r = runner.invoke(app, ["dataset", "info", str(path), "--json"])
    assert r.exit_code == 0, r.output
    text = r.stdout
    assert text.startswith('{\n  "') and json.loads(text)["episodes"] == 3


def test_list_recipes_keeps_its_columns_for_long_names() -> None:
    r = runner.invoke(app, ["collect", "--list-recipes"])
    assert r.exit_code == 0, r.output
    rows = [line for line in r.stdout.splitlines() if line.strip()]
    assert any(row.startswith("halfcheetah-medium-replay-positions ") for row in rows)
    ids = [row.index("rlt/") for row in rows]
    assert len(set(ids)) == 1  # every dataset id starts in the same column


# ------------------------------------------------------------------- export into a directory
def test_dataset_export_to_a_directory_is_a_clean_error(tmp_path: Path) -> None:
    h5 = write_d4rl_h5(tmp_path / "ok.hdf5")
    (tmp_path / "out").mkdir()
    r = runner.invoke(app, ["dataset", "export", str(h5), str(tmp_path / "out")])
    assert_clean_exit(r, 2)
    assert f"error: {tmp_path / 'out'} is a directory; OUT is the .hdf5 file to write" in r.output


# ------------------------------------------------------------------- messages
def test_dataset_info_max_ep_len_must_be_positive(tmp_path: Path) -> None:
    h5 = write_d4rl_h5(tmp_path / "ok.hdf5")
    r = runner.invoke(app, ["dataset", "info", str(h5), "--max-ep-len", "-5"])
    assert_clean_exit(r, 2)  # a usage error naming the option
    assert "--max-ep-len" in r.output and "max_ep_len=-5" not in r.output


# -- `collect --recipe-steps 5` built a medium-replay set without its random shard -----------------
def test_collect_refuses_recipe_steps_that_leave_a_shard_empty(tmp_path, monkeypatch):
    from rl_tformers.envs import collect as C
    from rl_tformers.envs import recipes as R

    def tripwire(*args, **kwargs):
        raise AssertionError("a recipe was built")

    monkeypatch.setattr(C, "build_recipe", tripwire)
    expected = ("error: --recipe-steps must be >= 6, got {} (the medium-replay recipes split it into 5 shards of "
                "10-25 %, each of at least 1 step)\n")
    for n in ("5", "1"):
        r = runner.invoke(app, ["collect", "--recipe", "hopper-medium-replay", "--recipe-steps", n,
                                "--root", str(tmp_path / "data"), "--no-progress"])
        assert (r.exit_code, r.stderr) == (2, expected.format(n)), r.output
        r = runner.invoke(app, ["collect", "--list-recipes", "--recipe-steps", n])
        assert (r.exit_code, r.stderr, r.stdout) == (2, expected.format(n), "")
    assert not (tmp_path / "data").exists()
    assert R.MIN_STEPS == 6
    with pytest.raises(ValueError, match=r"^hopper-medium-replay: steps must be >= 6 \(its 5 shards take 10-25 % "
                                          r"of them each, and none may be empty\), got 5$"):
        R.make_recipe("hopper", "medium-replay", steps=5, version=0)
    assert [s.steps for s in R.make_recipe("hopper", "medium-replay", steps=6, version=0).shards] == [1, 1, 1, 2, 2]
    assert [s.steps for s in R.make_recipe("hopper", "random", steps=6).shards] == [6]


# -- `dataset info` did not compare the data with the environment it names ----------------------
def _hdf5(path, obs_dim: int, env_id: str = "CartPole-v1"):
    with h5py.File(path, "w") as f:
        f["observations"] = np.zeros((6, obs_dim), np.float32)
        f["actions"] = np.array([0, 1, 0, 1, 0, 1], np.int64)
        f["rewards"] = np.ones(6, np.float32)
        f["terminals"] = np.array([0, 0, 1, 0, 0, 1], bool)
        f.attrs["env_id"] = env_id
    return path


def test_dataset_info_warns_when_the_data_does_not_match_its_environment(tmp_path):
    bad = _hdf5(tmp_path / "bad.hdf5", 3)
    for extra in ([], ["--json"]):
        r = runner.invoke(app, ["dataset", "info", str(bad), *extra])
        assert r.exit_code == 0, r.output
        assert r.stderr == (
            "warning: the dataset does not match its environment CartPole-v1: observations of shape (3,) per step "
            "in the data, of shape (4,) in the environment; training on it needs agent.env_id set to the "
            "environment the data came from\n")
    assert json.loads(r.stdout)["observation_shape"] == [3]  # --json: stdout is still one JSON object
    # a dataset that fits its environment, or one whose environment cannot be made here: no warning
    for path in (_hdf5(tmp_path / "good.hdf5", 4), _hdf5(tmp_path / "unknown.hdf5", 3, env_id="NoSuchEnv-v0")):
        r = runner.invoke(app, ["dataset", "info", str(path)])
        assert (r.exit_code, r.stderr) == (0, ""), r.output
