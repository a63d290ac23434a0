"""The d3rlpy cross-check's plumbing in our environment (rl_tformers.bench.crosscheck): the .npz
export is the dataset, step for step, and the summary's arithmetic. The end-to-end worker run
needs the peers' environment (d3rlpy, MuJoCo) and is skipped without it."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from rl_tformers.envs.dataset import EpisodeDataset
from rl_tformers.envs.loaders import load_dataset

from rl_tformers.bench import _peer_crosscheck as worker
from rl_tformers.bench import crosscheck as cc
from rl_tformers.bench.data import write_synthetic_d4rl
from rl_tformers.bench.train import default_peer_python
from tests.datafiles import write_d4rl_h5


def _check_export(ds: EpisodeDataset, path) -> None:
    info = cc.export_dataset(ds, path)
    data = np.load(path)
    assert sorted(data.files) == ["actions", "observations", "rewards", "terminals", "timeouts"]
    eps = list(ds)  # episode-table order
    np.testing.assert_array_equal(data["observations"], np.concatenate([e.observations for e in eps]).astype(np.float32))
    np.testing.assert_array_equal(data["actions"], np.concatenate([e.actions for e in eps]).astype(np.float32))
    np.testing.assert_array_equal(data["rewards"], np.concatenate([e.rewards for e in eps]).astype(np.float32))
    np.testing.assert_array_equal(data["terminals"], np.concatenate([e.terminations for e in eps]))
    ends = np.flatnonzero(data["terminals"] | data["timeouts"])
    assert list(ends) == list(np.cumsum(ds.lengths) - 1)  # one flag per episode, at its last step (d3rlpy's split)
    # read back the D4RL way, the episodes are the dataset's
    back = EpisodeDataset.from_flags(data["observations"], data["actions"], data["rewards"], data["terminals"], data["timeouts"])
    np.testing.assert_array_equal(back.lengths, ds.lengths)
    np.testing.assert_allclose(back.episode_returns, ds.episode_returns, rtol=1e-5)
    assert info == {"steps": ds.num_steps, "episodes": ds.num_episodes,
                    "top_return": pytest.approx(float(np.max(ds.episode_returns))),
                    "mean_return": pytest.approx(float(np.mean(ds.episode_returns)))}


def test_export_matches_the_dataset(tiny_hdf5, tmp_path):
    ds = load_dataset(tiny_hdf5)
    assert ds.num_episodes > 3 and ds.terminations.any()  # some early terminations, some timeouts
    _check_export(ds, tmp_path / "all.npz")
    # a selection in another order (non-contiguous episode table): exported in table order
    sel = ds.select(np.array([3, 0, 2]))
    assert not sel.is_contiguous()
    _check_export(sel, tmp_path / "sel.npz")


def test_export_a_fall_on_the_time_limit_step_is_a_terminal_only(tmp_path):
    # episode 0 falls on the step the time limit also ends (terminated and truncated both set):
    # D4RL's layout (d3rlpy asserts it) never sets both, and the MDP ended, so it is a terminal
    obs, act, rew = np.zeros((5, 2)), np.zeros((5, 3)), np.ones(5)
    box = gym.spaces.Box(-1.0, 1.0, shape=(3,), dtype=np.float32)
    ds = EpisodeDataset(obs, act, rew, [0, 1, 0, 0, 0], [0, 1, 0, 0, 1], starts=[0, 2], lengths=[2, 3], action_space=box)
    _check_export(ds, tmp_path / "both.npz")
    data = np.load(tmp_path / "both.npz")
    assert data["terminals"].tolist() == [False, True, False, False, False]
    assert data["timeouts"].tolist() == [False, False, False, False, True]


def test_summary_rows():
    runs = [
        {"algo": "dt", "seed": 1, "results": [{"target": 3559.0, "returns": [1000.0, 2000.0]}]},
        {"algo": "dt", "seed": 0, "results": [{"target": 3559.0, "returns": [500.0, 500.0]}]},
        {"algo": "bc", "seed": 0, "results": [{"target": None, "returns": [100.0]}]},
    ]
    rows = cc.summarise(runs, (0.0, 1000.0))
    dt = next(r for r in rows if r["algo"] == "dt")
    assert dt["seeds"] == [0, 1] and dt["per_seed_return"] == [500.0, 1500.0]
    assert dt["per_seed_normalised"] == [50.0, 150.0]
    assert dt["normalised_mean"] == 100.0 and dt["normalised_std"] == 50.0  # population std over seeds
    bc = next(r for r in rows if r["algo"] == "bc")
    assert bc["target"] is None and bc["normalised_mean"] == 10.0


def _peers_with_mujoco() -> str | None:
    py = default_peer_python()
    if not py:
        return None
    ok = subprocess.run([py, "-c", "import d3rlpy, mujoco"], capture_output=True).returncode == 0
    return py if ok else None


@pytest.mark.slow
@pytest.mark.skipif(_peers_with_mujoco() is None,
                    reason="needs the peers' environment with d3rlpy and MuJoCo (rl-tformers bench train --build-peers)")
def test_worker_end_to_end(tiny_hdf5, tmp_path):
    out = tmp_path / "out.json"
    rc = cc.main(["--dataset", str(tiny_hdf5), "--seeds", "0", "--steps", "5", "--episodes", "2",
                  "--extra-targets", "3300", "--work", str(tmp_path / "work"), "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["d3rlpy_version"].startswith("2.8")
    rows = {(r["algo"], r["target"]) for r in res["rows"]}
    assert rows == {("dt", res["targets"][0]), ("dt", 3300.0), ("bc", None)}
    for run in res["runs"]:
        assert run["reset_seeds"] == [0, 1] and all(len(r["returns"]) == 2 for r in run["results"])


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
    assert len(err.strip().splitlines()) == 1  # one line naming every file at fault
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
    """A per-run JSON without a data record (from another cross-check version, or of another
    dataset and steps) is refused."""
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
    (["--algos", "dt,sac"], "error: --algos 'dt,sac': 'sac' is not an algorithm (dt, bc, iql, cql)"),
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
    # a CartPole file (no D4RL references): not run in Hopper-v5
    cartpole = write_d4rl_h5(tmp_path / "cp.hdf5", discrete=True)
    assert "discrete actions" in refused(cartpole)
    # a continuous task without D4RL references: named, not an assert
    pendulum = write_d4rl_h5(tmp_path / "pendulum.hdf5", obs_dim=3, env_id="Pendulum-v1", discrete=False)
    assert refused(pendulum).startswith(
        f"error: no D4RL reference scores for --dataset {pendulum} or --env Pendulum-v1")
    # --env other than the dataset's
    assert refused(hopper_h5, "--env", "Walker2d-v5").startswith(
        f"error: --env Walker2d-v5, but --dataset {hopper_h5} comes from Hopper-v5")
    # a dataset that names no task: --env is required, and must fit its shapes
    anon = write_d4rl_h5(tmp_path / "data.hdf5", obs_dim=3, env_id=None, discrete=False)
    assert "records no environment; name the one it came from with --env" in refused(anon)
    assert "has observations of shape (3,) and actions of shape (1,)" in refused(anon, "--env", "Hopper-v5")


def test_the_worker_command_of_each_peer_algorithm_parses_to_its_recorded_settings(tmp_path: Path) -> None:
    """IQL and CQL run with d3rlpy's reproduction settings: the driver passes CQL's conservative
    weight and no DT targets to them, and the worker records what it was asked."""
    for algo in cc.ALGOS:
        argv = cc.worker_argv(algo, 1, tmp_path / "d.npz", tmp_path / "o.json", 500, 3, "Hopper-v5", [3300.0], 10.0)
        settings = worker.recorded_settings(worker.build_parser().parse_args(argv))
        assert settings["algo"] == algo and settings["steps"] == 500 and settings["seed"] == 1
        assert settings["targets"] == ("3300.0" if algo == "dt" else "")
        assert settings["conservative_weight"] == (10.0 if algo == "cql" else 5.0)


def test_a_run_with_a_learning_curve_stands_for_one_without_but_not_the_reverse(tmp_path, hopper_h5, fake_worker,
                                                                                 capsys):
    """``--eval-every`` evaluates in between without changing training: a stored run with a
    curve is reused for the same command without one; a run without a curve is not reused
    when a curve is asked for."""
    assert cc.main(_cc(tmp_path, hopper_h5, "--algos", "bc", "--eval-every", "5")) == 0
    assert fake_worker.calls == [("bc", 0)]
    stored = json.loads((tmp_path / "work" / "bc-s0.json").read_text())
    assert stored["settings"]["eval_every"] == 5
    assert cc.main(_cc(tmp_path, hopper_h5, "--algos", "bc")) == 0
    assert fake_worker.calls == [("bc", 0)] and "reusing" in capsys.readouterr().err
    assert cc.main(_cc(tmp_path, hopper_h5, "--algos", "dt")) == 0
    assert fake_worker.calls == [("bc", 0), ("dt", 0)]
    capsys.readouterr()
    assert cc.main(_cc(tmp_path, hopper_h5, "--algos", "dt", "--eval-every", "5")) == 2
    err = capsys.readouterr().err
    assert "eval_every: <unset> (stored) -> 5 (requested)" in err
    assert err.rstrip().endswith("delete those files to run them again (or drop --eval-every to reuse them as they "
                                 "are, without a learning curve)")
    # another difference besides the curve: no such advice
    assert cc.main(_cc(tmp_path, hopper_h5, "--algos", "dt", "--eval-every", "5", "--episodes", "2")) == 2
    assert capsys.readouterr().err.rstrip().endswith("delete those files to run them again")


@pytest.mark.parametrize("every", ["-1", "2"])
def test_crosscheck_refuses_an_evaluation_interval_that_does_not_divide_the_steps(tmp_path, fake_worker, capsys,
                                                                                  every):
    assert cc.main(_cc(tmp_path, "rlt/hopper-v5/medium-expert-v0", "--eval-every", every)) == 2
    assert capsys.readouterr().err.startswith(f"error: --eval-every {every} must be 0 (evaluate at the end only) "
                                              f"or divide --steps 5")
    assert fake_worker.calls == []


@pytest.mark.slow
@pytest.mark.skipif(_peers_with_mujoco() is None,
                    reason="needs the peers' environment with d3rlpy and MuJoCo (rl-tformers bench train --build-peers)")
def test_worker_learning_curve_leaves_training_unchanged(tiny_hdf5, tmp_path):
    """IQL (d3rlpy's Q-learning base) and DT with two targets (its transformer base) with
    ``--eval-every``: one evaluation per interval, the last one the run's result, and the same
    returns as the run without a curve."""
    def runs(*extra: str) -> list[dict]:
        out = tmp_path / f"out{len(extra)}.json"
        rc = cc.main(["--dataset", str(tiny_hdf5), "--algos", "iql,dt", "--extra-targets", "3300", "--seeds", "0",
                      "--steps", "4", "--episodes", "2", "--work", str(tmp_path / f"work{len(extra)}"), "--out",
                      str(out), *extra])
        assert rc == 0
        return json.loads(out.read_text())["runs"]

    for plain, curved in zip(runs(), runs("--eval-every", "2"), strict=True):
        assert "curve" not in plain and [c["step"] for c in curved["curve"]] == [2, 4]
        assert len(curved["results"]) == (2 if curved["algo"] == "dt" else 1)
        assert curved["curve"][-1]["results"] == curved["results"] == plain["results"]


def test_reuse_only_summarises_the_runs_the_work_folder_holds_and_runs_nothing(tmp_path, hopper_h5, fake_worker,
                                                                               capsys):
    assert cc.main(_cc(tmp_path, hopper_h5, "--algos", "bc")) == 0
    assert cc.main(_cc(tmp_path, hopper_h5, "--algos", "bc,dt", "--seeds", "0,1", "--reuse-only")) == 0
    assert fake_worker.calls == [("bc", 0)]
    assert "--reuse-only: not run, left out of the summary: dt seed 0, bc seed 1, dt seed 1" in capsys.readouterr().err
    out = json.loads((tmp_path / "out.json").read_text())
    assert [(r["algo"], r["seed"]) for r in out["runs"]] == [("bc", 0)]
    assert [(r["algo"], r["seeds"]) for r in out["rows"]] == [("bc", [0])]
    assert cc.main(_cc(tmp_path, hopper_h5, "--algos", "dt", "--reuse-only")) == 2
    assert f"error: --reuse-only: --work {tmp_path / 'work'} holds none of the requested runs" in capsys.readouterr().err


class _TransformerLikeAlgo:
    """Stands in for d3rlpy's DecisionTransformer: ``fit`` with a per-update callback, no
    ``fitter``; each update adds one to ``updates``."""

    def __init__(self) -> None:
        self.updates = 0
        self.fit_calls: list[dict] = []
        optim = types.SimpleNamespace(optim=types.SimpleNamespace(param_groups=[{"lr": 6e-5}]))
        self.impl = types.SimpleNamespace(modules=types.SimpleNamespace(optim=optim))

    def fit(self, dataset, n_steps, n_steps_per_epoch, callback=None, **kwargs):
        self.fit_calls.append({"n_steps": n_steps, "n_steps_per_epoch": n_steps_per_epoch})
        for step in range(1, n_steps + 1):
            self.updates += 1
            if callback:
                callback(self, 1 + (step - 1) // n_steps_per_epoch, step)


def test_worker_curve_of_dt_evaluates_every_target_between_updates_through_fit_s_callback(tmp_path, monkeypatch):
    """``--eval-every 2 --steps 6`` with two DT targets: evaluations after updates 2 and 4 (from
    d3rlpy's ``fit`` callback: its DecisionTransformer has no ``fitter``) and the final one at 6,
    each of both targets; the model is fitted once, over all 6 updates."""
    algo = _TransformerLikeAlgo()
    fake = types.ModuleType("d3rlpy")
    fake.__version__ = "2.8.1"
    fake.seed = lambda seed: None
    fake.dataset = types.SimpleNamespace(MDPDataset=lambda **kw: types.SimpleNamespace(episodes=[0, 1]))
    fake.logging = types.SimpleNamespace(NoopAdapterFactory=lambda: None)
    monkeypatch.setitem(sys.modules, "d3rlpy", fake)
    monkeypatch.setattr("torch.set_num_threads", lambda n: None)
    monkeypatch.setattr(worker, "build", lambda name, args, d3rlpy: (types.SimpleNamespace(serialize=lambda: "{}"),
                                                                     algo))

    def evaluate(args, evaluated):
        assert evaluated is algo
        return [{"target": float(t), "returns": [float(algo.updates)], "lengths": [1]}
                for t in args.targets.split(",")], 0.5

    monkeypatch.setattr(worker, "evaluate", evaluate)
    data = tmp_path / "d.npz"
    np.savez(data, **{k: np.zeros(3) for k in ("observations", "actions", "rewards", "terminals", "timeouts")})
    out = tmp_path / "o.json"
    assert worker.main(["--algo", "dt", "--data", str(data), "--out", str(out), "--steps", "6", "--eval-every", "2",
                        "--targets", "3559.0,3300.0"]) == 0
    run = json.loads(out.read_text())
    assert algo.fit_calls == [{"n_steps": 6, "n_steps_per_epoch": 6}]
    assert [(c["step"], [(r["target"], r["returns"]) for r in c["results"]]) for c in run["curve"]] == [
        (2, [(3559.0, [2.0]), (3300.0, [2.0])]), (4, [(3559.0, [4.0]), (3300.0, [4.0])]),
        (6, [(3559.0, [6.0]), (3300.0, [6.0])])]
    assert run["results"] == run["curve"][-1]["results"] and run["settings"]["eval_every"] == 2


def test_reuse_only_needs_no_peers_python(tmp_path, hopper_h5, fake_worker, capsys):
    """``--reuse-only`` starts no worker: a missing peers' python does not stop the summary."""
    assert cc.main(_cc(tmp_path, hopper_h5, "--algos", "bc")) == 0
    assert cc.main(_cc(tmp_path, hopper_h5, "--algos", "bc", "--reuse-only", "--python", "/nonexistent/python")) == 0
    assert fake_worker.calls == [("bc", 0)]
    assert [(r["algo"], r["seeds"]) for r in json.loads((tmp_path / "out.json").read_text())["rows"]] == [("bc", [0])]
    assert cc.main(_cc(tmp_path, hopper_h5, "--algos", "bc", "--python", "/nonexistent/python")) == 2
    assert capsys.readouterr().err.endswith("error: --python /nonexistent/python: not an executable file\n")
