"""Defects found by the sixth breaker pass in the sweep, eval and plot commands: a summary that
averaged unfinished runs, grid values and overrides that silently trained the same or another
config, two sweeps in one folder, reset seeds beyond torch's range, an environment that cannot be
built, malformed ``--from-json`` rewards, and ``plot --checkpoint`` with a RUN_DIR that is no
directory.

Everything is tiny: crafted metrics.jsonl files instead of training, configs composed but never
trained, one 2-update DT run (module fixture), a 1-step environment.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from rl_tformers.agents.common import evaluation as ev
from rl_tformers.runtime.evaluation import TargetResult, evaluate, make_env_factory
from test_found_by_tester import _train, _write_h5
from typer.testing import CliRunner

from rl_tformers.cli import app
from rl_tformers.runtime import sweep as sw

runner = CliRunner()
TOY = ["agent.kind=toy", "train.steps=2", "train.batch_size=4", "eval.every=0"]


def _tripwire(*args, **kwargs):
    raise AssertionError("the expensive part ran before the bad input was refused")


@pytest.fixture(scope="module")
def dt_run(tmp_path_factory) -> Path:
    """A DT trained for 2 updates on a tiny CartPole file."""
    tmp = tmp_path_factory.mktemp("b6dt")
    r = _train(f"dataset.path={_write_h5(tmp / 'cartpole.hdf5')}", "--run-dir", str(tmp / "dt"))
    assert r.exit_code == 0, r.output
    return tmp / "dt"


# ------------------------------------------------ 1. the summary averaged runs that did not finish
def test_sweep_summary_counts_only_completed_runs(tmp_path: Path) -> None:
    runs = sw.expand({"train.lr": ["1e-3"]}, [0, 1, 2, 3], tmp_path)
    values = [1.0, 2.0, 50.0, 70.0]  # seeds 2 and 3: intermediate evaluations of unfinished runs
    for run, v in zip(runs, values):
        run.run_dir.mkdir(parents=True)
        (run.run_dir / "metrics.jsonl").write_text(json.dumps({"step": 4, "eval/return": v}) + "\n")
    statuses = ["ok", "skipped", "stopped", "failed"]
    outcomes = {r.name: sw.RunOutcome(s, 0) for r, s in zip(runs, statuses)}
    res = sw.write_results(tmp_path, runs, outcomes, warn=_tripwire)
    (s,) = res.summary
    assert (s["n"], s["of"], s["mean"], s["std"]) == (2, 4, 1.5, pytest.approx(0.7071067811865476))
    assert "| train.lr=1e-3 | 1.5 | 0.7071 | 2/4 |" in (tmp_path / "results.md").read_text()
    assert json.loads((tmp_path / "results.json").read_text())["summary"][0]["n"] == 2
    assert [r["eval/return"] for r in res.rows] == values  # every row keeps its own last values

    warned: list[str] = []
    outcomes = {r.name: sw.RunOutcome("stopped", 130) for r in runs}
    res = sw.write_results(tmp_path, runs, outcomes, warn=warned.append)
    assert res.summary[0]["mean"] is None and res.summary[0]["n"] == 0
    assert warned == ["warning: eval/return: only runs that did not complete logged it; the summary and plot "
                      "count completed runs only"]
    assert not (tmp_path / "results.png").exists()


# ------------------------------------------- 2. two spellings of one value trained the same config
@pytest.mark.parametrize("grid", [{"train.lr": ["1e-3", "0.001"]}, {"backbone.n_layers": ["1", "+1"]}])
def test_sweep_refuses_grid_values_with_the_same_config(tmp_path: Path, grid: dict) -> None:
    a, b = (f"{k}={v}" for k in grid for v in grid[k])
    with pytest.raises(sw.SweepError, match=re.escape(f"the points ({a}) and ({b}) give the same config")):
        sw.sweep(None, grid, [0, 1], tmp_path / "s", TOY, echo=_tripwire)
    assert not (tmp_path / "s").exists()


# --------------------------------------------- 3. overrides the sweep replaced without a word
@pytest.mark.parametrize(("grid", "override", "says"), [
    ({}, "seed=5", "override 'seed=5': the sweep sets each run's seed from --seeds"),
    ({}, "run_dir=elsewhere", "override 'run_dir=elsewhere': the sweep puts each run in OUT/<point>/seed<k>"),
    ({"train.lr": ["1e-3", "2e-3"]}, "train.lr=0.1", "override 'train.lr=0.1' and --grid train.lr=... set the same"),
    ({"train.lr": ["1e-3", "2e-3"]}, "train.lr=1e-3", "override 'train.lr=1e-3' and --grid train.lr=... set the same"),
    ({"backbone.position.kind": ["rotary", "learned"]}, "backbone.position={kind: alibi}",
     "override 'backbone.position={kind: alibi}' and --grid backbone.position.kind=... set the same"),
])
def test_sweep_refuses_an_override_each_run_would_replace(tmp_path: Path, grid: dict, override: str,
                                                          says: str) -> None:
    r = runner.invoke(app, ["sweep", "--out", str(tmp_path / "s"), *[f"--grid={k}={','.join(v)}" for k, v in
                                                                    grid.items()], "--seeds", "0,1", *TOY, override])
    assert r.exit_code == 2 and f"error: {says}" in r.output, r.output
    assert not (tmp_path / "s").exists()


# ----------------------------------------------------- 4. two sweeps trained in one folder at once
def test_a_second_sweep_in_the_same_folder_is_refused(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "s"
    monkeypatch.setattr(sw, "run_local", _tripwire)
    with sw._SweepLock(out):  # the first sweep, running
        with pytest.raises(sw.SweepError, match=rf"--out {out}: another sweep \(pid \d+\) is running in this folder"):
            sw.sweep(None, {}, [0], out, TOY, echo=_tripwire)
        assert sorted(p.name for p in out.iterdir()) == [".sweep.lock"]  # nothing started
    assert not out.exists()  # the first one created the folder and wrote nothing: removed
    # once the first sweep is gone, the second proceeds (here: up to the runs, which are stubbed out)
    monkeypatch.setattr(sw, "run_local", lambda todo, *a, **k: {run.name: sw.RunOutcome("ok", 0) for run, _ in todo})
    res = sw.sweep(None, {}, [0], out, TOY, echo=lambda m: None)
    assert [r["status"] for r in res.rows] == ["ok"] and (out / "results.csv").is_file()


# ------------------------------------------------------------- 5. reset seeds beyond torch's range
class _OneStepEnv(gym.Env):
    observation_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
    action_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action):
        return np.zeros(1, np.float32), float(self.np_random.uniform()), True, False, {}


class _ZeroPolicy:
    def initial_state(self, n, target=None):
        return n

    def act(self, obs, state, episode_start, last_reward=None):
        return np.zeros((state, 1), np.float32), state


def test_eval_seed_range_is_checked_and_large_seeds_work(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"evaluate: seed 18446744073709551616 is not an integer in \[0, 2\*\*64 - 1\]"):
        evaluate(_ZeroPolicy(), _OneStepEnv, episodes=2, n_envs=2, seed=2**64)
    big = 2**63  # reset seeds used to be numpy int64 sums: OverflowError past 2**63 - 1
    rep = evaluate(_ZeroPolicy(), _OneStepEnv, episodes=3, n_envs=2, seed=big)
    assert rep.results[0].seeds == [big, big + 1, big + 2]
    again = evaluate(_ZeroPolicy(), _OneStepEnv, episodes=1, n_envs=1, seed=big + 1)
    assert again.results[0].returns == rep.results[0].returns[1:2]  # episode j is seeded seed + j
    for cmd in ("eval", "plot"):
        r = runner.invoke(app, [cmd, str(tmp_path), "--seed", str(2**64), "--out", str(tmp_path / "x.png")])
        assert r.exit_code == 2 and "--seed" in r.output and "18446744073709551615" in r.output, r.output


# ------------------------------------------------- 6. an evaluation environment that cannot be built
def test_an_environment_that_cannot_be_built_is_a_clean_error(dt_run: Path, tmp_path: Path) -> None:
    from rl_tformers.runtime.checkpoint import content_digest

    with pytest.raises(ev.EnvironmentBuildError, match=r"cannot build the evaluation environment 'Nope-v0' here "
                                                    r"\(NameNotFound: Environment `Nope` doesn't exist"):
        evaluate(_ZeroPolicy(), make_env_factory("Nope-v0"), episodes=2, n_envs=2, env_id="Nope-v0")
    # a run trained with an environment this machine lacks (here: its checkpoint names another one)
    path = next((dt_run / "checkpoints").glob("*.pt"))
    state = torch.load(path, weights_only=False)
    state["extra"]["env_id"] = "Nope-v0"
    state["sha256"] = content_digest(state)
    ckpt = tmp_path / "other.pt"
    torch.save(state, ckpt)
    for cmd in (["eval", str(dt_run), "--episodes", "1"],
                ["plot", str(dt_run), "--episodes", "1", "--out", str(tmp_path / "p.png"), "--no-tensorboard"]):
        r = runner.invoke(app, [*cmd, "--checkpoint", str(ckpt)])
        assert r.exit_code == 2 and (r.exception is None or isinstance(r.exception, SystemExit)), r.output
        assert "error: evaluate: cannot build the evaluation environment 'Nope-v0' here" in r.output, r.output


# ------------------------------------------------------------- 7. --from-json with odd per-episode data
@pytest.mark.parametrize(("result", "says"), [
    ({"target_return": 10, "returns": []}, "returns is empty"),
    ({"target_return": 10, "returns": [1, 2], "rewards": "ab"}, "rewards must be 2 lists (one per return), got str"),
    ({"target_return": 10, "returns": [1, 2], "rewards": [[1, None], [2]]},
     "rewards of episode 0 must be a list of finite numbers"),
    ({"target_return": 10, "returns": [5, 6], "rewards": [[1, 2, 3]]}, "rewards must be 2 lists (one per return), got 1"),
    ({"target_return": 10, "returns": [5, 6], "rewards": [[2, 3], [1, 2]]},
     "rewards of episode 1 sum to 3.0, but its return is 6"),
    ({"target_return": 10, "returns": [5], "lengths": [3], "rewards": [[2, 3]]},
     "rewards of episode 0: 2 rewards, but its length is 3"),
    ({"target_return": 10, "returns": [5, 6], "lengths": [3]}, "lengths must be 2 non-negative integers"),
])
def test_plot_from_json_checks_each_result(tmp_path: Path, monkeypatch, result: dict, says: str) -> None:
    from rl_tformers.agents.common import loading

    monkeypatch.setattr(loading, "load_run", _tripwire)
    path = tmp_path / "eval.json"
    path.write_text(json.dumps({"results": [result]}))
    r = runner.invoke(app, ["plot", str(tmp_path), "--from-json", str(path), "--out", str(tmp_path / "p.png")])
    assert r.exit_code == 2 and (r.exception is None or isinstance(r.exception, SystemExit)), r.output
    assert f"error: --from-json {path}: results[0] is not a per-target result" in r.output and says in r.output, r.output
    assert not (tmp_path / "p.png").exists()


def test_from_dict_reads_back_what_eval_writes() -> None:
    rewards = [[0.1, 0.2, 0.7000000000000001], [1.5]]
    res = TargetResult(10.0, [sum(rewards[0]), 1.5], [3, 1], [0, 1], rewards=rewards)
    back = TargetResult.from_dict(json.loads(json.dumps(res.to_dict(with_rewards=True))))
    assert (back.returns, back.lengths, back.seeds, back.rewards) == (res.returns, [3, 1], [0, 1], rewards)


# ------------------------------------- 8. plot --checkpoint with a RUN_DIR that is not a directory
@pytest.mark.parametrize("make", ["missing", "file"])
def test_plot_checkpoint_with_a_run_dir_that_is_not_a_directory(tmp_path: Path, monkeypatch, make: str) -> None:
    from rl_tformers.agents.common import loading

    monkeypatch.setattr(loading, "load_run", _tripwire)
    run_dir = tmp_path / "run"
    if make == "file":
        run_dir.write_text("x")
    r = runner.invoke(app, ["plot", str(run_dir), "--checkpoint", str(tmp_path / "c.pt"), "--out",
                            str(tmp_path / "p.png")])
    what = "does not exist" if make == "missing" else "is not a directory"
    assert r.exit_code == 2 and f"error: {run_dir} {what}: the figure is logged to RUN_DIR's TensorBoard" in r.output
    assert "--no-tensorboard" in r.output
    assert run_dir.exists() == (make == "file") and not (tmp_path / "p.png").exists()


# ------------------------------------------- 9. plot --from-json ignored the evaluation options given
@pytest.mark.parametrize(("extra", "names"), [(["--targets", "5", "--episodes", "3"], "--targets, --episodes"),
                                              (["--seed", "0"], "--seed"), (["--n-targets", "4", "--envs", "2"],
                                                                            "--n-targets, --envs")])
def test_plot_from_json_refuses_evaluation_options(tmp_path: Path, monkeypatch, extra: list, names: str) -> None:
    from rl_tformers.agents.common import loading

    monkeypatch.setattr(loading, "load_run", _tripwire)
    path = tmp_path / "eval.json"
    path.write_text(json.dumps({"results": [{"target_return": 10, "returns": [5, 6]}]}))
    r = runner.invoke(app, ["plot", str(tmp_path), "--from-json", str(path), "--out", str(tmp_path / "p.png"), *extra])
    assert r.exit_code == 2, r.output
    assert f"error: --from-json {path} plots a saved evaluation: {names} would be ignored" in r.output
