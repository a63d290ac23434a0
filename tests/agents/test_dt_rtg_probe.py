"""The return-to-go probe of a trained DT: exact fit and shift values on the data's own windows."""

from __future__ import annotations

import json

import gymnasium as gym
import numpy as np
import pytest
import torch
from rl_tformers.agents.decision_transformer.model import from_env_action
from rl_tformers.agents.decision_transformer.rtg_probe import rtg_probe
from rl_tformers.envs.dataset import DatasetMetadata, EpisodeDataset
from rl_tformers.envs.loaders import save_d4rl_hdf5
from rl_tformers.envs.trajectory import returns_to_go
from typer.testing import CliRunner

from rl_tformers.runtime.loading import load_run
from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.trainer import train
from tests.datafiles import write_d4rl_h5
from tests.runs import train_dt

K = 4


@pytest.fixture(scope="module")
def probe_run(tmp_path_factory):
    rng = np.random.default_rng(0)
    space = gym.spaces.Box(-2.0, 2.0, (1,), np.float32)  # Pendulum-v1's
    eps = []
    for n in (12, 12, 6, 3):  # episode 3 (3 steps) is shorter than K: never probed
        eps.append({"observations": rng.normal(size=(n + 1, 3)).astype(np.float32),
                    "actions": rng.uniform(-2, 2, (n, 1)).astype(np.float32),
                    "rewards": rng.uniform(0, 1, n), "terminations": np.eye(1, n, n - 1, dtype=bool)[0],
                    "truncations": np.zeros(n, bool)})
    ds = EpisodeDataset.from_episodes(eps, observation_space=gym.spaces.Box(-np.inf, np.inf, (3,), np.float32),
                                      action_space=space, metadata=DatasetMetadata(env_id="Pendulum-v1"))
    tmp = tmp_path_factory.mktemp("probe")
    path = save_d4rl_hdf5(ds, tmp / "data.hdf5")
    cfg = compose("dt/cartpole_demo", [f"dataset.path={path}", "backbone.d_model=16", "backbone.n_layers=1",
                                       "backbone.n_heads=1", f"agent.context_len={K}", "agent.max_ep_len=20",
                                       "train.steps=3", "train.batch_size=4", "train.warmup_steps=1",
                                       "train.progress=false", "eval.every=0", "eval.at_end=false", "device=cpu"])
    train(cfg, tmp / "run")
    return load_run(tmp / "run"), ds


def test_fit_and_shift_are_the_models_exact_values(probe_run):
    run, ds = probe_run
    agent, info = run.agent, run.agent.info
    rows = rtg_probe(agent, ds, {"a": [0, 1], "b": [2, 3]}, t0s=(0, 8), rtgs=(0.5,))
    assert [(r["group"], r["t0"], r["episodes"]) for r in rows] == [("a", 0, 2), ("a", 8, 2), ("b", 0, 1), ("b", 8, 0)]
    assert rows[3]["fit"] is None and rows[3]["shift"] == {}
    # recompute group a, t0 = 8 by hand
    obs, act, rtg = [], [], []
    for i in (0, 1):
        ep = ds.episode(i)
        obs.append((np.asarray(ep.observations[8:12]) - info.obs_mean) / info.obs_std)
        act.append(np.asarray(ep.actions[8:12]))
        rtg.append(returns_to_go(np.asarray(ep.rewards, np.float64))[8:12] / info.reward_scale)
    obs, act, rtg = (torch.tensor(np.stack(x), dtype=torch.float32) for x in (obs, act, rtg))
    act = from_env_action(act, torch.full((1,), -2.0), torch.full((1,), 2.0))
    steps, mask = (8 + torch.arange(K)).expand(2, K), torch.ones(2, K, dtype=torch.bool)
    with torch.no_grad():
        base = agent.model(obs, act, rtg, steps, mask).action
        moved = agent.model(obs, act, rtg - rtg[:, :1] + 0.5, steps, mask).action
    assert rows[1]["fit"] == pytest.approx(float(((base - act) ** 2).sum(-1).mean()), rel=1e-6)
    assert rows[1]["shift"][0.5] == pytest.approx(float(((moved - base) ** 2).sum(-1).mean()), rel=1e-6)
    assert rows[1]["shift"][0.5] > 0  # the return-to-go token reaches the action


def test_shift_to_the_windows_own_return_is_zero_and_errors_are_clear(probe_run):
    run, ds = probe_run
    own = float(returns_to_go(np.asarray(ds.episode(0).rewards, np.float64))[0] / run.agent.info.reward_scale)
    (row,) = rtg_probe(run.agent, ds, {"a": [0]}, t0s=(0,), rtgs=(own,))
    assert row["shift"][own] == pytest.approx(0.0, abs=1e-10)
    with pytest.raises(ValueError, match="group 'x' has episode indices \\[7\\] outside 0..3"):
        rtg_probe(run.agent, ds, {"x": [7]})


runner = CliRunner()


@pytest.fixture(scope="module")
def probe_runs(tmp_path_factory):
    """A continuous-action DT run (Pendulum-shaped data: 3-dim observations, 1-dim actions), a BC
    run and a toy run on it, and the data file."""
    from rl_tformers.envs.dataset import DatasetMetadata, EpisodeDataset
    from rl_tformers.envs.loaders import save_d4rl_hdf5

    rng = np.random.default_rng(0)
    eps = [{"observations": rng.normal(size=(n + 1, 3)).astype(np.float32),
            "actions": rng.uniform(-2, 2, (n, 1)).astype(np.float32), "rewards": rng.uniform(0, 1, n),
            "terminations": np.eye(1, n, n - 1, dtype=bool)[0], "truncations": np.zeros(n, bool)}
           for n in (12, 12, 6)]
    ds = EpisodeDataset.from_episodes(eps, observation_space=gym.spaces.Box(-np.inf, np.inf, (3,), np.float32),
                                      action_space=gym.spaces.Box(-2.0, 2.0, (1,), np.float32),
                                      metadata=DatasetMetadata(env_id="Pendulum-v1"))
    tmp = tmp_path_factory.mktemp("probe")
    path = save_d4rl_hdf5(ds, tmp / "data.hdf5")
    tiny = ["backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=1", "train.steps=2", "train.batch_size=4",
            "train.warmup_steps=1", "train.progress=false", "eval.every=0", "eval.at_end=false", "device=cpu"]
    train(compose("dt/cartpole_demo", [f"dataset.path={path}", f"agent.context_len={K}", "agent.max_ep_len=20",
                                       *tiny]), tmp / "dt")
    train(compose(None, ["agent.kind=bc", f"dataset.path={path}", *tiny]), tmp / "bc")
    train(compose(None, ["agent.kind=toy", *tiny]), tmp / "toy")
    return tmp, path


def _probe(*args: str):
    """``python -m rl_tformers.agents.decision_transformer.rtg_probe ARGS`` (its command, in process)."""
    import typer
    from rl_tformers.agents.decision_transformer import rtg_probe

    cli = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    cli.command()(rtg_probe.main)
    r = runner.invoke(cli, [str(a) for a in args])
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    return r


def test_probe_runs_and_prints_rows(probe_runs):
    tmp, _ = probe_runs
    r = _probe(tmp / "dt", "--group", "a=0:2", "--group", "b=2:3", "--t0", "0", "--t0", "8", "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert [(x["group"], x["t0"], x["episodes"]) for x in rows] == [("a", 0, 2), ("a", 8, 2), ("b", 0, 1), ("b", 8, 0)]


@pytest.mark.parametrize("args, expected", [
    (["--group", "a=0:2", "--group", "a=2:3"], "error: --group 'a' is given twice (a=0:2 and a=2:3)"),
    (["--group", "a=0:2", "--t0", "-2"], "error: --t0 -2: an episode step, an integer >= 0"),
    (["--group", "a=0:2", "--t0", "0", "--t0", "0"], "error: --t0 0 is given twice"),
    (["--group", "a=0:2", "--rtg", "nan"], "error: --rtg nan: the first return-to-go must be a finite number"),
    (["--group", "a=0:2", "--rtg", "inf"], "error: --rtg inf: the first return-to-go must be a finite number"),
    (["--group", "a=0:2", "--rtg", "1", "--rtg", "1.0"], "error: --rtg 1.0 is given twice"),
    (["--group", "a=2:1"], "error: --group 'a=2:1': FIRST:STOP must be a non-empty range"),
    (["--group", "a=-1:2"], "error: --group 'a=-1:2': FIRST:STOP must be a non-empty range"),
    (["--group", "a"], "error: --group 'a': expected NAME=FIRST:STOP"),
])
def test_probe_options_are_checked_before_the_run_is_loaded(tmp_path, args, expected):
    r = _probe(tmp_path / "no-run", *args)  # the options fail first, whatever RUN_DIR is
    assert r.exit_code == 2 and r.stderr.startswith(expected), r.output


def test_probe_errors_about_the_run_and_the_data(probe_runs, tmp_path):
    tmp, path = probe_runs
    r = _probe(tmp / "dt", "--group", "a=0:9")
    assert r.exit_code == 2
    assert r.stderr.startswith(f"error: --group 'a' has episode indices [3, 4, 5] outside 0..2 "
                               f"(the run's dataset.path {path} has 3 episodes)")
    r = _probe(tmp / "dt", "--group", "a=0:2", "--t0", "9")
    assert r.exit_code == 2 and "error: --t0 9: no episode of the groups holds a window of K=4 steps" in r.stderr
    r = _probe(tmp / "dt", "--group", "a=0:2", "--t0", "17")
    assert r.exit_code == 2 and "error: --t0 17: a window of K=4 steps from step 17 reaches step 20, past the " \
                                "run's agent.max_ep_len=20" in r.stderr
    # another dataset: 6-dim observations instead of 3
    wide = write_d4rl_h5(tmp_path / "wide.hdf5", obs_dim=6, env_id="Pendulum-v1", discrete=False)
    r = _probe(tmp / "dt", "--group", "a=0:2", "--dataset", wide)
    assert r.exit_code == 2
    assert r.stderr.startswith(f"error: --dataset {wide}: the dataset does not fit the run: it has observations of "
                               f"shape (6,) (6 values) and continuous actions of size 1, but the run's model takes "
                               f"3 observation values and continuous actions of size 1")
    r = _probe(tmp / "dt", "--group", "a=0:2", "--dataset", tmp_path / "nope.hdf5")
    assert r.exit_code == 2 and r.stderr.startswith(f"error: --dataset {tmp_path / 'nope.hdf5'}: no such HDF5 file")
    r = _probe(tmp_path / "no-run", "--group", "a=0:2")
    assert r.exit_code == 2 and r.stderr.startswith(f"error: {tmp_path / 'no-run'} does not exist")
    (tmp_path / "empty").mkdir()
    r = _probe(tmp_path / "empty", "--group", "a=0:2")
    assert r.exit_code == 2 and r.stderr.startswith("error: no checkpoint in")


@pytest.mark.parametrize("kind", ["bc", "toy"])
def test_probe_names_a_run_that_is_not_a_decision_transformer(probe_runs, kind):
    tmp, _ = probe_runs
    r = _probe(tmp / kind, "--group", "a=0:2")
    assert r.exit_code == 2
    assert r.stderr == f"error: {tmp / kind} is a {kind} run, not a Decision Transformer run\n"


def test_probe_refuses_a_discrete_dt_run(tmp_path):
    h5 = write_d4rl_h5(tmp_path / "cp.hdf5")
    assert train_dt(f"dataset.path={h5}", "--run-dir", str(tmp_path / "run")).exit_code == 0
    r = _probe(tmp_path / "run", "--group", "a=0:2")
    assert r.exit_code == 2
    assert r.stderr.startswith(f"error: {tmp_path / 'run'} is a Decision Transformer with discrete actions; the "
                               f"probe takes continuous actions only")


def test_rtg_probe_function_checks_what_it_is_given(probe_runs):
    from rl_tformers.agents.decision_transformer.rtg_probe import rtg_probe
    from rl_tformers.envs.loaders import load_dataset

    from rl_tformers.runtime.loading import load_run

    tmp, path = probe_runs
    run, ds = load_run(tmp / "dt"), load_dataset(path)
    with pytest.raises(ValueError, match="--t0 -1: an episode step"):
        rtg_probe(run.agent, ds, {"a": [0]}, t0s=(-1,))
    with pytest.raises(ValueError, match="--rtg nan"):
        rtg_probe(run.agent, ds, {"a": [0]}, rtgs=(float("nan"),))
    wide = write_d4rl_h5(tmp / "wide-fn.hdf5", obs_dim=6, env_id="Pendulum-v1", discrete=False)
    with pytest.raises(ValueError, match="the dataset does not fit the run"):
        rtg_probe(run.agent, load_dataset(wide), {"a": [0]})
    with pytest.raises(ValueError, match="is not a Decision Transformer agent"):
        rtg_probe(load_run(tmp / "bc").agent, ds, {"a": [0]})


# ------------------------------------------------------------------- -h like every rl-tformers command
def test_rtg_probe_has_the_short_help_option() -> None:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "rl_tformers.agents.decision_transformer.rtg_probe", "-h"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "--group" in r.stdout


def test_probe_imports_a_plugin_of_the_run_only_when_named(probe_runs, tmp_path, monkeypatch):
    """A run listing ``plugins: [m]`` (``m.py`` sits in the current directory and writes a file
    when imported): the probe refuses it naming ``--plugin``; named, ``m`` comes from sys.path."""
    import shutil
    import sys

    from rl_tformers.runtime.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint

    tmp, _ = probe_runs
    run = tmp_path / "dt"
    shutil.copytree(tmp / "dt", run)
    name = "probe_plugin_x"
    for _, path in list_checkpoints(run):
        state = load_checkpoint(path)
        state["config"] = state["config"].replace("plugins: []\n", f"plugins:\n- {name}\n")
        path.unlink()
        save_checkpoint(run, {k: v for k, v in state.items() if k not in ("format", "version", "sha256")})
    marker = tmp_path / "imported-from-the-current-directory"
    (tmp_path / f"{name}.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    monkeypatch.chdir(tmp_path)
    r = _probe(run, "--group", "a=0:2")
    assert r.exit_code == 2 and "is not imported: a run's plugins are code" in r.stderr and f"--plugin {name}" in r.stderr
    installed = tmp_path / "site"
    installed.mkdir()
    (installed / f"{name}.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(installed))
    try:
        r = _probe(run, "--group", "a=0:2", "--plugin", name)
        assert r.exit_code == 0, r.output
        assert sys.modules[name].VALUE == 1
    finally:
        sys.modules.pop(name, None)
    assert not marker.exists()
