"""Defects found by the breaker (third pass) in the tools: the d3rlpy cross-check driver
(stale per-run JSONs, late checks), the DT return-to-go probe's command line and a hand-edited
config.yaml on resume.

Every test is tiny (a few hundred synthetic steps, a few updates of a tiny model); the
cross-check's worker is replaced by a stand-in that records what the real one records, so no
peers' environment (d3rlpy) is needed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from test_found_by_tester import _train, _write_h5
from typer.testing import CliRunner

from rl_tformers.bench import _peer_crosscheck as worker
from rl_tformers.bench import crosscheck as cc
from rl_tformers.bench.data import write_synthetic_d4rl
from rl_tformers.cli import app
from rl_tformers.runtime.run_config import ConfigError, compose
from rl_tformers.runtime.trainer import resume, train

runner = CliRunner()


# ------------------------------------------------------------------- 1, 2: the cross-check driver
class FakeWorker:
    """Stands in for ``subprocess.run`` of the worker: parses its command line with the worker's
    own parser and writes what the worker writes (``settings`` included) to ``--out``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def __call__(self, cmd, **kwargs):
        assert cmd[1] == str(cc.WORKER)
        args = worker.build_parser().parse_args(cmd[2:])
        self.calls.append((args.algo, args.seed))
        targets = [float(t) for t in args.targets.split(",") if t] if args.algo == "dt" else [None]
        Path(args.out).write_text(json.dumps({
            "algo": args.algo, "seed": args.seed, "env": args.env, "episodes": args.episodes,
            "results": [{"target": t, "returns": [1000.0 + args.seed], "lengths": [10]} for t in targets],
            "train_seconds": 0.0, "eval_seconds": 0.0, "final_lr": 0.0, "versions": {"d3rlpy": "2.8.1"},
            "settings": worker.recorded_settings(args),
        }))

        class Done:
            returncode = 0

        return Done()


@pytest.fixture
def fake_worker(monkeypatch) -> FakeWorker:
    fake = FakeWorker()
    monkeypatch.setattr(cc.subprocess, "run", fake)
    return fake


@pytest.fixture(scope="module")
def hopper_h5(tmp_path_factory) -> Path:
    """600 synthetic Hopper-shaped steps (the file name tells the loader the task: Hopper-v5)."""
    return write_synthetic_d4rl(tmp_path_factory.mktemp("cc") / "hopper-synthetic.hdf5", 600, ep_len=100)


def _cc(tmp_path: Path, dataset: Path | str, *extra: str) -> list[str]:
    return ["--dataset", str(dataset), "--python", sys.executable, "--work", str(tmp_path / "work"),
            "--out", str(tmp_path / "out.json"), "--seeds", "0", "--steps", "5", "--episodes", "1", *extra]


def test_crosscheck_reuses_a_run_only_with_the_same_settings_and_data(tmp_path, hopper_h5, fake_worker, capsys):
    assert cc.main(_cc(tmp_path, hopper_h5)) == 0
    assert fake_worker.calls == [("dt", 0), ("bc", 0)]
    first = json.loads((tmp_path / "out.json").read_text())
    assert first["runs"][0]["data"]["sha256"] == first["dataset_sha256"]
    # the same command: both runs reused
    assert cc.main(_cc(tmp_path, hopper_h5)) == 0
    assert fake_worker.calls == [("dt", 0), ("bc", 0)]
    assert "reusing" in capsys.readouterr().err
    # the same data under another name is the same data: reused
    copy = tmp_path / "hopper-copy.hdf5"
    copy.write_bytes(hopper_h5.read_bytes())
    assert cc.main(_cc(tmp_path, copy)) == 0 and len(fake_worker.calls) == 2
    capsys.readouterr()
    before = (tmp_path / "out.json").read_text()

    # other steps: refused before anything runs, naming the files and the setting
    assert cc.main(_cc(tmp_path, hopper_h5, "--steps", "6")) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --work {tmp_path / 'work'} holds runs that cannot be reused:")
    assert f"{tmp_path / 'work' / 'dt-s0.json'} was made with other settings:" in err
    assert f"{tmp_path / 'work' / 'bc-s0.json'} was made with other settings:" in err
    assert "steps: 5 (stored) -> 6 (requested)" in err
    assert "use another --work directory, or delete those files" in err
    # another DT target: only the DT run differs
    assert cc.main(_cc(tmp_path, hopper_h5, "--extra-targets", "3300")) == 2
    err = capsys.readouterr().err
    assert "dt-s0.json was made with other settings" in err and "bc-s0.json" not in err
    assert ",3300.0' (requested)" in err
    # other data with the same settings
    other = write_synthetic_d4rl(tmp_path / "hopper-other.hdf5", 600, ep_len=100, seed=1)
    assert cc.main(_cc(tmp_path, other)) == 2
    assert "dataset sha256: " in capsys.readouterr().err
    assert len(fake_worker.calls) == 2
    assert (tmp_path / "out.json").read_text() == before  # nothing rewritten


def test_crosscheck_refuses_a_run_json_without_a_data_record(tmp_path, hopper_h5, fake_worker, capsys):
    """The breaker's repro: a per-run JSON of an older cross-check (or another dataset and steps)."""
    work = tmp_path / "work"
    work.mkdir()
    for algo in ("dt", "bc"):
        (work / f"{algo}-s0.json").write_text(json.dumps({
            "algo": algo, "seed": 0, "results": [{"target": None, "returns": [3000.0]}], "train_seconds": 1,
            "eval_seconds": 1, "versions": {"d3rlpy": "2.8"},
            "settings": {"steps": 4000, "env": "Hopper-v5", "targets": "3600.0"}}))
    assert cc.main(_cc(tmp_path, hopper_h5)) == 2
    err = capsys.readouterr().err
    assert "steps: 4000 (stored) -> 5 (requested)" in err
    assert "dataset sha256: not recorded (made by an older cross-check) (stored)" in err
    assert fake_worker.calls == [] and not (tmp_path / "out.json").exists()
    assert not (work / "crosscheck_data.npz").exists()


@pytest.mark.parametrize("extra, expected", [
    (["--seeds", "a,b"], "error: --seeds 'a,b': 'a' is not a seed (an integer >= 0)"),
    (["--seeds", "0,0"], "error: --seeds '0,0': '0' is given twice"),
    (["--seeds", "-1"], "error: --seeds '-1': '-1' is not a seed"),
    (["--extra-targets", "x"], "error: --extra-targets 'x': 'x' is not a finite number"),
    (["--extra-targets", "nan"], "error: --extra-targets 'nan': 'nan' is not a finite number"),
    (["--algos", "dt,cql"], "error: --algos 'dt,cql': 'cql' is not an algorithm (dt or bc)"),
    (["--algos", "bc", "--extra-targets", "3300"], "error: --extra-targets '3300': targets are for dt"),
    (["--steps", "0"], "error: --steps must be >= 1, got 0"),
    (["--episodes", "0"], "error: --episodes must be >= 1, got 0"),
    (["--python", "/nonexistent/python"], "error: --python /nonexistent/python: not an executable file"),
])
def test_crosscheck_checks_its_options_before_loading_anything(tmp_path, fake_worker, monkeypatch, capsys,
                                                                extra, expected):
    import rl_tformers.envs.loaders as loaders

    def no_load(*a, **k):
        raise AssertionError("the dataset was loaded before the options were checked")

    monkeypatch.setattr(loaders, "load_dataset", no_load)
    assert cc.main(_cc(tmp_path, "rlt/hopper-v5/medium-expert-v0", *extra)) == 2
    assert capsys.readouterr().err.startswith(expected)
    assert fake_worker.calls == [] and not (tmp_path / "work").exists()


def test_crosscheck_checks_the_dataset_and_its_environment_up_front(tmp_path, hopper_h5, fake_worker, capsys):
    def refused(dataset, *extra) -> str:
        assert cc.main(_cc(tmp_path, dataset, *extra)) == 2
        assert fake_worker.calls == [] and not (tmp_path / "work").exists()
        return capsys.readouterr().err

    err = refused(tmp_path / "nope.hdf5")
    assert err.startswith(f"error: --dataset {tmp_path / 'nope.hdf5'}: no such HDF5 file")
    # the breaker's CartPole file (no D4RL references): not run in Hopper-v5
    cartpole = _write_h5(tmp_path / "cp.hdf5", discrete=True)
    assert "discrete actions" in refused(cartpole)
    # a continuous task without D4RL references: named, not an assert
    pendulum = _write_h5(tmp_path / "pendulum.hdf5", obs_dim=3, env_id="Pendulum-v1", discrete=False)
    assert refused(pendulum).startswith(
        f"error: no D4RL reference scores for --dataset {pendulum} or --env Pendulum-v1")
    # --env other than the dataset's
    assert refused(hopper_h5, "--env", "Walker2d-v5").startswith(
        f"error: --env Walker2d-v5, but --dataset {hopper_h5} comes from Hopper-v5")
    # a dataset that names no task: --env is required, and must fit its shapes
    anon = _write_h5(tmp_path / "data.hdf5", obs_dim=3, env_id=None, discrete=False)
    assert "records no environment; name the one it came from with --env" in refused(anon)
    assert "has observations of shape (3,) and actions of shape (1,)" in refused(anon, "--env", "Hopper-v5")


# ------------------------------------------------------------------- 3: the return-to-go probe
K = 4


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
    # another dataset: 6-dim observations instead of 3 (the breaker's 6 vs 11)
    wide = _write_h5(tmp_path / "wide.hdf5", obs_dim=6, env_id="Pendulum-v1", discrete=False)
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
    h5 = _write_h5(tmp_path / "cp.hdf5")
    assert _train(f"dataset.path={h5}", "--run-dir", str(tmp_path / "run")).exit_code == 0
    r = _probe(tmp_path / "run", "--group", "a=0:2")
    assert r.exit_code == 2
    assert r.stderr.startswith(f"error: {tmp_path / 'run'} is a Decision Transformer with discrete actions; the "
                               f"probe takes continuous actions only")


def test_rtg_probe_function_checks_what_it_is_given(probe_runs):
    from rl_tformers.runtime.loading import load_run
    from rl_tformers.agents.decision_transformer.rtg_probe import rtg_probe
    from rl_tformers.envs.loaders import load_dataset

    tmp, path = probe_runs
    run, ds = load_run(tmp / "dt"), load_dataset(path)
    with pytest.raises(ValueError, match="--t0 -1: an episode step"):
        rtg_probe(run.agent, ds, {"a": [0]}, t0s=(-1,))
    with pytest.raises(ValueError, match="--rtg nan"):
        rtg_probe(run.agent, ds, {"a": [0]}, rtgs=(float("nan"),))
    wide = _write_h5(tmp / "wide-fn.hdf5", obs_dim=6, env_id="Pendulum-v1", discrete=False)
    with pytest.raises(ValueError, match="the dataset does not fit the run"):
        rtg_probe(run.agent, load_dataset(wide), {"a": [0]})
    with pytest.raises(ValueError, match="is not a Decision Transformer agent"):
        rtg_probe(load_run(tmp / "bc").agent, ds, {"a": [0]})


# ------------------------------------------------------------------- 4: a hand-edited config.yaml
TOY = ["agent.kind=toy", "device=cpu", "train.progress=false", "train.steps=8", "train.batch_size=4",
       "backbone.n_layers=1", "backbone.d_model=16", "train.log_every=2", "train.checkpoint_every=0",
       "train.warmup_steps=1", "eval.every=0", "eval.at_end=false"]


@pytest.fixture
def stopped_run(tmp_path) -> Path:
    run = tmp_path / "run"
    train(compose(None, TOY), run, stop_at=4)
    return run


def _edit(run: Path, old: str, new: str) -> str:
    path = run / "config.yaml"
    text = path.read_text()
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new))
    return path.read_text()


def test_resume_refuses_an_edited_config_yaml(stopped_run):
    edited = _edit(stopped_run, "d_model: 16", "d_model: 32")
    with pytest.raises(ConfigError) as info:
        resume(stopped_run, ["train.steps=10"])
    msg = str(info.value)
    assert msg.startswith(f"{stopped_run / 'config.yaml'} differs from the config of checkpoint step_000000004.pt")
    assert "backbone.d_model: 16 (checkpoint) -> 32 (config.yaml); cannot change when resuming: start a new run" in msg
    assert "as KEY=VALUE overrides on the command line" in msg
    assert (stopped_run / "config.yaml").read_text() == edited  # not rewritten
    r = runner.invoke(app, ["train", "--resume", str(stopped_run), "train.steps=10"])
    assert r.exit_code == 2 and r.output.startswith(f"error: {stopped_run / 'config.yaml'} differs"), r.output
    assert sorted(p.name for p in (stopped_run / "checkpoints").glob("*.pt")) == ["step_000000004.pt"]


def test_resume_with_a_resumable_key_edited_in_config_yaml_says_to_pass_it(stopped_run):
    _edit(stopped_run, "steps: 8", "steps: 6")
    with pytest.raises(ConfigError, match=r"train\.steps: 8 \(checkpoint\) -> 6 \(config.yaml\); to resume with "
                                          r"it, pass train\.steps=6 on the command line"):
        resume(stopped_run)
    assert resume(stopped_run, ["train.steps=6"]).step == 6  # the command line decides the keys it sets
    assert "steps: 6" in (stopped_run / "config.yaml").read_text()


def test_resume_without_config_yaml_or_with_an_older_one_still_works(stopped_run, tmp_path):
    import shutil

    other = tmp_path / "other"
    shutil.copytree(stopped_run, other)
    # written before a key existed: the key is absent, and loads with its default (TOY leaves it so)
    line = next(ln for ln in (other / "config.yaml").read_text().splitlines(True) if "keep_last:" in ln)
    _edit(other, line, "")
    assert resume(other).step == 8
    (stopped_run / "config.yaml").unlink()
    assert resume(stopped_run).step == 8
    assert (stopped_run / "config.yaml").is_file()
