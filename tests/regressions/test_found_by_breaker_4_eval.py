"""Defects found by the fourth breaker pass in evaluation, plotting and the data/eval benchmarks:
huge DT targets gave NaN returns (exit 0, invalid JSON), unchecked bench options, and plot/eval
--out paths that printed the wrong file or failed after all the evaluating was done.

Every test is tiny (a few rows of crafted data, two updates of a toy DT) and runs in seconds;
the expensive parts of the commands are replaced by tripwires where the point is that they
never start.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from test_found_by_tester import _train, _write_h5
from typer.testing import CliRunner

from rl_tformers.cli import app

runner = CliRunner()


def _strict_loads(text: str):
    """``json.loads`` that rejects the non-standard NaN / Infinity tokens."""
    def bad(token: str):
        raise ValueError(f"non-standard JSON token {token}")

    return json.loads(text, parse_constant=bad)


def _tripwire(*args, **kwargs):
    raise AssertionError("the expensive part ran before the bad option was refused")


@pytest.fixture(scope="module")
def dt_run(tmp_path_factory) -> Path:
    """A DT trained for 2 updates on a tiny CartPole file (discrete actions)."""
    tmp = tmp_path_factory.mktemp("b4dt")
    h5 = _write_h5(tmp / "cartpole.hdf5")
    r = _train(f"dataset.path={h5}", "--run-dir", str(tmp / "dt"))
    assert r.exit_code == 0, r.output
    return tmp / "dt"


@pytest.fixture(scope="module")
def dt_cont_run(tmp_path_factory) -> Path:
    """A DT trained for 2 updates on a tiny Pendulum-shaped file (continuous actions)."""
    tmp = tmp_path_factory.mktemp("b4dtc")
    h5 = _write_h5(tmp / "pendulum.hdf5", obs_dim=3, env_id="Pendulum-v1", discrete=False)
    r = _train(f"dataset.path={h5}", "agent.max_ep_len=200", "--run-dir", str(tmp / "dt"))
    assert r.exit_code == 0, r.output
    return tmp / "dt"


# ------------------------------------------------------------- 1. huge DT targets, NaN, strict JSON
@pytest.mark.parametrize("target", ["1e25", "1e30", "4e38", "-1e30"])
def test_eval_refuses_a_target_beyond_the_rtg_embedding_up_front(dt_run: Path, monkeypatch, target: str) -> None:
    from rl_tformers.agents.common import evaluation

    monkeypatch.setattr(evaluation, "evaluate", _tripwire)
    r = runner.invoke(app, ["eval", str(dt_run), "--targets", f"100,{target}", "--episodes", "1", "--envs", "1",
                            "--json"])
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith(f"error: --targets: {float(target):g} is beyond what this model takes: |target| "
                               f"must be at most "), r.stderr
    assert "reward scale" in r.stderr and "NaN" in r.stderr and r.stdout == ""


def test_plot_refuses_a_target_beyond_the_rtg_embedding_up_front(dt_run: Path, tmp_path: Path,
                                                                 monkeypatch) -> None:
    from rl_tformers.agents.common import evaluation

    monkeypatch.setattr(evaluation, "evaluate", _tripwire)
    r = runner.invoke(app, ["plot", str(dt_run), "--out", str(tmp_path / "p.png"), "--targets", "10,1e30",
                            "--episodes", "1", "--envs", "1", "--no-tensorboard"])
    assert r.exit_code == 2 and r.stderr.startswith("error: --targets: 1e+30 is beyond what this model takes")
    assert not (tmp_path / "p.png").exists()


def test_target_limit_is_where_the_float32_embedding_still_holds(dt_cont_run: Path) -> None:
    """Below the limit every action is finite; far above it (where the old code sent NaN) the
    policy refuses the target."""
    import torch
    from rl_tformers.runtime.loading import load_run

    run = load_run(dt_cont_run, torch.device("cpu"))
    pol = run.agent.policy()
    limit = pol.target_limit()
    assert 1e10 < limit < 1e30
    obs = np.zeros((2, 3), np.float32)
    state = pol.initial_state(2, limit)  # the largest accepted target still gives finite actions
    a, _ = pol.act(obs, state, np.ones(2, bool))
    assert np.isfinite(a).all()
    with pytest.raises(ValueError, match=r"target return: 1e\+30 is beyond what this model takes"):
        pol.initial_state(2, 1e30)
    pol.check_targets([10.0, -limit])
    with pytest.raises(ValueError, match=r"^--targets: .* must be at most"):
        pol.check_targets([10.0, 2 * limit], option="--targets")


class _NaNPolicy:
    """Finite actions for ``good_steps`` steps, then NaN."""

    def __init__(self, good_steps: int) -> None:
        self.good_steps = good_steps

    def initial_state(self, n, target=None):
        return {"t": 0}

    def act(self, obs, state, episode_start, last_reward=None):
        state["t"] += 1
        value = 0.0 if state["t"] <= self.good_steps else float("nan")
        return np.full((len(obs), 1), value, np.float32), state


def test_evaluate_stops_at_a_non_finite_action_without_sending_it(monkeypatch) -> None:
    from rl_tformers.runtime.evaluation import NonFiniteError, evaluate

    sent: list[np.ndarray] = []

    class Spy(gym.Wrapper):
        def step(self, action):
            sent.append(np.asarray(action))
            return self.env.step(action)

    with pytest.raises(NonFiniteError) as info:
        evaluate(_NaNPolicy(3), lambda: Spy(gym.make("Pendulum-v1")), [250.0], episodes=1, n_envs=1, seed=7)
    assert str(info.value) == ("evaluate: the policy returned a non-finite action for target return 250 at step 3 "
                               "of episode 0 (env 0, reset seed 7): [nan]; it was not sent to the environment")
    assert len(sent) == 3 and all(np.isfinite(a).all() for a in sent)


def test_dt_with_nan_predictions_raises_instead_of_acting(dt_cont_run: Path, dt_run: Path, monkeypatch) -> None:
    """The backstop behind the up-front check: if the model's output is NaN anyway (here: the
    limit switched off), no action comes out of it, continuous or discrete (argmax of NaN)."""
    import torch
    from rl_tformers.runtime.evaluation import NonFiniteError, evaluate
    from rl_tformers.runtime.loading import load_run
    from rl_tformers.agents.decision_transformer.policy import DTPolicy

    monkeypatch.setattr(DTPolicy, "target_limit", lambda self: math.inf)
    for path in (dt_cont_run, dt_run):
        run = load_run(path, torch.device("cpu"))
        with pytest.raises(NonFiniteError, match=r"not finite \(NaN/inf\) for target return 1e\+30 at episode "
                                                 r"step 0 \(env 0;"):
            evaluate(run.agent.policy(), run.agent.make_env(), [1e30], episodes=1, n_envs=1)


def test_eval_and_plot_turn_a_non_finite_evaluation_into_an_error(dt_run: Path, tmp_path: Path,
                                                                  monkeypatch) -> None:
    from rl_tformers.agents.decision_transformer.policy import DTPolicy

    monkeypatch.setattr(DTPolicy, "target_limit", lambda self: math.inf)
    r = runner.invoke(app, ["eval", str(dt_run), "--targets", "1e30", "--episodes", "1", "--envs", "1", "--json"])
    assert r.exit_code == 2 and r.stdout == "", r.output
    assert r.stderr.startswith("error: Decision Transformer: the model's prediction is not finite (NaN/inf) for "
                               "target return 1e+30")
    r = runner.invoke(app, ["plot", str(dt_run), "--out", str(tmp_path / "p.png"), "--targets", "10,1e30",
                            "--episodes", "1", "--envs", "1", "--no-tensorboard"])
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.exit_code == 2 and "error: Decision Transformer: the model's prediction is not finite" in r.stderr


def test_eval_json_is_strict(dt_run: Path, tmp_path: Path) -> None:
    from rl_tformers.runtime.evaluation import strict_json

    out = tmp_path / "e.json"
    r = runner.invoke(app, ["eval", str(dt_run), "--targets", "10", "--episodes", "2", "--envs", "1", "--json",
                            "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert _strict_loads(r.stdout)["results"][0]["target_return"] == 10.0
    assert _strict_loads(out.read_text())["results"][0]["returns"]
    assert strict_json({"a": [float("nan"), 1.0, float("inf")], "b": np.float32("-inf")}) == \
        '{"a": [null, 1.0, null], "b": null}'


def test_eval_refuses_a_non_finite_early_exit_threshold(tmp_path: Path) -> None:
    r = runner.invoke(app, ["eval", str(tmp_path / "no_run"), "--early-exit", "inf"])
    assert r.exit_code == 2
    assert r.stderr.startswith("error: --early-exit inf: the threshold must be a finite number")


def test_plot_from_json_with_nan_returns_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "eval.json"
    path.write_text('{"results": [{"target_return": 10, "returns": [NaN, 2.0]}]}')
    r = runner.invoke(app, ["plot", str(tmp_path / "no_run"), "--out", str(tmp_path / "p.png"),
                            "--from-json", str(path)])
    assert r.exit_code == 2 and f"error: --from-json {path}: results[0] is not a per-target result" in r.stderr
    assert "must be finite numbers" in r.stderr


# ------------------------------------------------------------- 2. bench data / bench eval options
@pytest.mark.parametrize("args, option", [
    (["--train-steps", "0"], "--train-steps"), (["--train-steps", "-1"], "--train-steps"),
    (["--batches", "0"], "--batches"), (["--batches", "-1"], "--batches"),
    (["--batch-size", "0"], "--batch-size"), (["--steps", "0"], "--steps"), (["--steps", "-5"], "--steps"),
    (["--repeats", "0"], "--repeats"), (["--repeats", "-2"], "--repeats"),
    (["--threads", "0"], "--threads"), (["--threads", "-1"], "--threads"),
])
def test_bench_data_counts_are_checked_before_any_work(monkeypatch, args: list[str], option: str) -> None:
    from rl_tformers.bench import data as bd

    monkeypatch.setattr(bd, "run", _tripwire)
    r = runner.invoke(app, ["bench", "data", *args])
    assert r.exit_code == 2 and option in r.output, r.output


def test_bench_data_settings_are_checked_in_python_too(monkeypatch) -> None:
    from rl_tformers.bench import data as bd

    monkeypatch.setattr(bd, "build_trainer", _tripwire)
    with pytest.raises(ValueError, match=r"^--train-steps must be >= 1, got 0$"):
        bd.run(bd.Settings(train_steps=0))
    with pytest.raises(ValueError, match=r"^--batches must be >= 1, got -1$"):
        bd.run(bd.Settings(batches=-1))


def test_bench_data_keep_and_out_paths_are_checked_first(tmp_path: Path, monkeypatch) -> None:
    from rl_tformers.bench import data as bd

    monkeypatch.setattr(bd, "run", _tripwire)
    (tmp_path / "afile").write_text("hi")
    r = runner.invoke(app, ["bench", "data", "--keep", str(tmp_path / "afile")])
    assert r.exit_code == 2 and r.stderr.startswith(f"error: --keep {tmp_path / 'afile'} is a file")
    r = runner.invoke(app, ["bench", "data", "--out", str(tmp_path)])
    assert r.exit_code == 2 and r.stderr.startswith(f"error: --out {tmp_path} is a directory")


@pytest.mark.parametrize("args, message", [
    (["--mem-envs", "0"], "--mem-envs"), (["--mem-envs", "-1"], "--mem-envs"),
    (["--mem-steps", "0"], "--mem-steps"), (["--mem-steps", "-3"], "--mem-steps"),
    (["--threads", "0"], "--threads"), (["--threads", "-1"], "--threads"),
    (["--max-episode-steps", "-1"], "--max-episode-steps"), (["--max-episode-steps", "0"], "--max-episode-steps"),
    (["--mem-lens", "0"], "error: --mem-lens: every memory length must be >= 1, got 0"),
    (["--mem-lens", "4,abc"], "error: --mem-lens: 'abc' is not an integer"),
    (["--mem-lens", ","], "error: --mem-lens: give at least one memory length"),
    (["--memory-kinds", "xl,bogus"], "error: --memory-kinds: unknown kind 'bogus'; use a comma-separated subset "
                                     "of xl,gtrxl"),
])
def test_bench_eval_options_are_checked_before_any_work(monkeypatch, args: list[str], message: str) -> None:
    from rl_tformers.bench import eval as be

    monkeypatch.setattr(be, "run", _tripwire)
    r = runner.invoke(app, ["bench", "eval", "--skip-rollouts", *args])
    assert r.exit_code == 2 and message in r.output, r.output


def test_bench_eval_settings_are_checked_in_python_too(monkeypatch) -> None:
    from rl_tformers.bench import eval as be

    monkeypatch.setattr(be, "load_agent", _tripwire)
    monkeypatch.setattr(be, "memory_step_cost", _tripwire)
    with pytest.raises(ValueError, match=r"^--max-episode-steps must be >= 1, got 0 \(leave the option out"):
        be.run(be.Settings(max_episode_steps=0))
    with pytest.raises(ValueError, match=r"^--mem-steps must be >= 1, got 0$"):
        be.run(be.Settings(mem_steps=0))


# ------------------------------------------------------------- 3. plot / eval --out paths
def test_plot_out_without_extension_writes_and_prints_the_png(dt_run: Path, tmp_path: Path) -> None:
    r = runner.invoke(app, ["plot", str(dt_run), "--out", str(tmp_path / "noext"), "--targets", "10,20",
                            "--episodes", "1", "--envs", "1", "--no-tensorboard"])
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[-1] == f"wrote {tmp_path / 'noext.png'}"
    assert (tmp_path / "noext.png").is_file() and not (tmp_path / "noext").exists()


def test_save_figure_returns_the_file_it_wrote(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt
    from rl_tformers.runtime.plots import figure_path, save_figure

    assert save_figure(plt.figure(), tmp_path / "a") == tmp_path / "a.png" and (tmp_path / "a.png").is_file()
    assert save_figure(plt.figure(), tmp_path / "b.svg") == tmp_path / "b.svg"
    assert figure_path(tmp_path / "c.PDF") == tmp_path / "c.PDF"
    with pytest.raises(ValueError, match="is a directory"):
        save_figure(plt.figure(), tmp_path)


@pytest.mark.parametrize("make_out, expected", [
    (lambda t: t, "is a directory; give a file name"),
    (lambda t: t / "x.jpgx", "matplotlib cannot write '.jpgx' files; use one of the extensions "),
    (lambda t: t / "afile" / "p.png", "afile is a file, not a directory"),
])
def test_plot_out_is_checked_before_loading_or_evaluating(tmp_path: Path, monkeypatch, make_out, expected) -> None:
    from rl_tformers.agents.common import evaluation

    monkeypatch.setattr(evaluation, "evaluate", _tripwire)
    (tmp_path / "afile").write_text("hi")
    out = make_out(tmp_path)
    r = runner.invoke(app, ["plot", str(tmp_path / "no_run"), "--out", str(out), "--targets", "10"])
    assert r.exit_code == 2 and r.stderr.startswith(f"error: --out {out}"), r.output
    assert expected in r.stderr
    if "jpgx" in str(out):
        assert ".png" in r.stderr and ".pdf" in r.stderr and ".svg" in r.stderr
    assert not (tmp_path.parent / f"{tmp_path.name}.png").exists()


def test_eval_out_is_checked_before_evaluating(dt_run: Path, tmp_path: Path, monkeypatch) -> None:
    from rl_tformers.agents.common import evaluation

    monkeypatch.setattr(evaluation, "evaluate", _tripwire)
    r = runner.invoke(app, ["eval", str(dt_run), "--targets", "10", "--episodes", "1", "--envs", "1",
                            "--out", str(tmp_path)])
    assert r.exit_code == 2 and r.stderr.startswith(f"error: --out {tmp_path} is a directory"), r.output
    (tmp_path / "afile").write_text("hi")
    r = runner.invoke(app, ["eval", str(dt_run), "--targets", "10", "--out", str(tmp_path / "afile" / "e.json")])
    assert r.exit_code == 2 and "afile is a file, not a directory" in r.stderr
