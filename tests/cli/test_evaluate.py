"""rl-tformers eval (rl_tformers.cli.evaluate): targets, output files, JSON, refusals before evaluating."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from rl_tformers.cli import app
from rl_tformers.runtime import evaluation as ev
from rl_tformers.runtime.evaluation import TargetResult, evaluate, make_env_factory
from rl_tformers.runtime.run_config import ConfigError, compose
from tests.datafiles import write_d4rl_h5
from tests.runs import train_dt, tripwire


def _eval(*args: str):
    return CliRunner().invoke(app, ["eval", *args, "--episodes", "1", "--envs", "1"])


@pytest.mark.parametrize(
    ("targets", "why"),
    [("10,10", "items 1 and 2"), ("5,10,1e1", "items 2 and 3: 10 and 1e1 are the same number")],
)
def test_eval_refuses_a_target_given_twice(tiny_dt_run: Path, no_evaluation, targets, why) -> None:
    """``eval --targets 10,10`` evaluated the same target twice on the same episodes."""
    res = _eval(str(tiny_dt_run), "--targets", targets)
    assert res.exit_code == 2, res.output
    assert res.output == (f"error: --targets {targets}: the target 10 is given twice ({why}); give each target "
                          f"once: each is evaluated on the same episodes (reset seeds)\n")
    assert no_evaluation == []


@pytest.mark.parametrize("out", ["ev.json/", "ev.json/.", "sub/.."])
def test_eval_refuses_an_out_that_names_a_directory(tiny_dt_run: Path, tmp_path: Path, no_evaluation, out) -> None:
    """``eval --out ev.json/`` wrote a file ``ev.json`` (a Path option drops the trailing '/')."""
    text = f"{tmp_path}/{out}"  # (tmp_path / out would drop the trailing '/' itself)
    res = _eval(str(tiny_dt_run), "--out", text)
    assert res.exit_code == 2, res.output
    assert res.output.startswith(f"error: --out {text} names a directory; give a file name, e.g. ")
    assert no_evaluation == [] and not (tmp_path / "ev.json").exists()
    res = _eval(str(tiny_dt_run), "--out", "")
    assert res.exit_code == 2 and res.output == "error: --out '' is empty; give a file name, e.g. eval.json\n"


def test_eval_out_is_written_where_given(tiny_dt_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "new" / "ev.json"
    res = _eval(str(tiny_dt_run), "--out", str(out), "--targets", "10")
    assert res.exit_code == 0, res.output
    assert out.is_file() and '"results"' in out.read_text()


def test_summary_of_a_policy_without_target_has_no_target_column() -> None:
    """``eval`` of a BC run prints no target column (no ``target        -: return ...``)."""
    from rl_tformers.runtime.evaluation import TargetResult
    from rl_tformers.runtime.plots import summary_lines

    bc = TargetResult(target_return=None, returns=[1.0, 3.0], lengths=[5, 6], seeds=[0, 1])
    dt = TargetResult(target_return=3600.0, returns=[2.0], lengths=[5], seeds=[0])
    assert summary_lines([bc]) == ["return      2.00 +-     1.00 over 2 episodes"]
    assert summary_lines([dt]) == ["target     3600: return      2.00 +-     0.00 over 1 episode"]


runner = CliRunner()


def _strict_loads(text: str):
    """``json.loads`` that rejects the non-standard NaN / Infinity tokens."""
    def bad(token: str):
        raise ValueError(f"non-standard JSON token {token}")

    return json.loads(text, parse_constant=bad)


# ------------------------------------------------------------- huge DT targets, NaN, strict JSON
@pytest.mark.parametrize("target", ["1e25", "1e30", "4e38", "-1e30"])
def test_eval_refuses_a_target_beyond_the_rtg_embedding_up_front(cartpole_dt_run: Path, monkeypatch, target: str) -> None:
    from rl_tformers.runtime import evaluation

    monkeypatch.setattr(evaluation, "evaluate", tripwire)
    r = runner.invoke(app, ["eval", str(cartpole_dt_run), "--targets", f"100,{target}", "--episodes", "1", "--envs", "1",
                            "--json"])
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith(f"error: --targets: {float(target):g} is beyond what this model takes: |target| "
                               f"must be at most "), r.stderr
    assert "reward scale" in r.stderr and "NaN" in r.stderr and r.stdout == ""


def test_target_limit_is_where_the_float32_embedding_still_holds(pendulum_dt_run: Path) -> None:
    """Below the limit every action is finite; far above it (where the embedding gives NaN) the
    policy refuses the target."""
    import torch

    from rl_tformers.runtime.loading import load_run

    run = load_run(pendulum_dt_run, torch.device("cpu"))
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


def test_eval_and_plot_turn_a_non_finite_evaluation_into_an_error(cartpole_dt_run: Path, tmp_path: Path,
                                                                  monkeypatch) -> None:
    from rl_tformers.agents.decision_transformer.policy import DTPolicy

    monkeypatch.setattr(DTPolicy, "target_limit", lambda self: math.inf)
    r = runner.invoke(app, ["eval", str(cartpole_dt_run), "--targets", "1e30", "--episodes", "1", "--envs", "1", "--json"])
    assert r.exit_code == 2 and r.stdout == "", r.output
    assert r.stderr.startswith("error: Decision Transformer: the model's prediction is not finite (NaN/inf) for "
                               "target return 1e+30")
    r = runner.invoke(app, ["plot", str(cartpole_dt_run), "--out", str(tmp_path / "p.png"), "--targets", "10,1e30",
                            "--episodes", "1", "--envs", "1", "--no-tensorboard"])
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.exit_code == 2 and "error: Decision Transformer: the model's prediction is not finite" in r.stderr


def test_eval_json_is_strict(cartpole_dt_run: Path, tmp_path: Path) -> None:
    from rl_tformers.runtime.evaluation import strict_json

    out = tmp_path / "e.json"
    r = runner.invoke(app, ["eval", str(cartpole_dt_run), "--targets", "10", "--episodes", "2", "--envs", "1", "--json",
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


def test_eval_out_is_checked_before_evaluating(cartpole_dt_run: Path, tmp_path: Path, monkeypatch) -> None:
    from rl_tformers.runtime import evaluation

    monkeypatch.setattr(evaluation, "evaluate", tripwire)
    r = runner.invoke(app, ["eval", str(cartpole_dt_run), "--targets", "10", "--episodes", "1", "--envs", "1",
                            "--out", str(tmp_path)])
    assert r.exit_code == 2 and r.stderr.startswith(f"error: --out {tmp_path} is a directory"), r.output
    (tmp_path / "afile").write_text("hi")
    r = runner.invoke(app, ["eval", str(cartpole_dt_run), "--targets", "10", "--out", str(tmp_path / "afile" / "e.json")])
    assert r.exit_code == 2 and "afile is a file, not a directory" in r.stderr


def test_eval_context_len_option_reaches_the_policy_and_is_checked(tmp_path: Path) -> None:
    """``rl-tformers eval --context-len N`` (a DT acting on the last N of its K steps, Online DT's
    evaluation context): recorded in the JSON; out of range: one error line naming the option and K.
    (That the policy then reads only N steps: tests/agents/test_dt_policy.py.)"""
    import json

    import h5py
    import numpy as np
    from typer.testing import CliRunner

    from rl_tformers.cli import app

    rng = np.random.default_rng(0)
    n = 200
    term = np.zeros(n, bool)
    term[np.arange(19, n, 20)] = True
    data = tmp_path / "cartpole.hdf5"
    with h5py.File(data, "w") as f:
        f["observations"] = rng.normal(size=(n, 4)).astype(np.float32)
        f["actions"] = rng.integers(0, 2, n)
        f["rewards"] = np.ones(n)
        f["terminals"] = term
        f["timeouts"] = np.zeros(n, bool)
        f.attrs["env_id"] = "CartPole-v1"
    runner = CliRunner()
    run = tmp_path / "dt"
    res = runner.invoke(app, ["train", "-c", "dt/cartpole_demo", f"dataset.path={data}", "backbone.d_model=16",
                              "backbone.n_layers=1", "agent.context_len=4", "train.steps=2", "train.batch_size=4",
                              "eval.every=0", "eval.at_end=false", "train.progress=false", "train.warmup_steps=1",
                              "--run-dir", str(run), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    common = ["eval", str(run), "--targets", "30", "--episodes", "2", "--envs", "2", "--json"]
    short = runner.invoke(app, [*common, "--context-len", "1"])
    assert short.exit_code == 0, short.output
    report = json.loads(short.output)
    assert report["extra"]["context_len"] == 1
    full = json.loads(runner.invoke(app, common).output)
    assert "context_len" not in full["extra"]
    bad = runner.invoke(app, [*common, "--context-len", "5"])
    assert bad.exit_code != 0
    assert "--context-len 5: this run's context holds K = 4 steps (agent.context_len); give 1..4" in bad.output
    # plot takes it too; with a saved evaluation it would be ignored, so it is refused
    fig = tmp_path / "fig.png"
    plot = ["plot", str(run), "--out", str(fig), "--no-tensorboard"]
    res = runner.invoke(app, [*plot, "--targets", "30", "--episodes", "1", "--envs", "1", "--context-len", "2"])
    assert res.exit_code == 0, res.output
    assert fig.stat().st_size > 0
    assert "give 1..4" in runner.invoke(app, [*plot, "--targets", "30", "--context-len", "9"]).output
    saved = tmp_path / "eval.json"
    assert runner.invoke(app, [*common[:-1], "--out", str(saved)]).exit_code == 0
    res = runner.invoke(app, [*plot, "--from-json", str(saved), "--context-len", "2"])
    assert res.exit_code != 0 and "--context-len would be ignored" in res.output


def test_a_yaml_file_given_as_checkpoint_is_named_not_a_checkpoint(tmp_path: Path) -> None:
    """``eval --checkpoint RUN/config.yaml``: a file that is not a zip archive is named as not a
    checkpoint (not "cannot be loaded (IndexError: pop from empty list)")."""
    from rl_tformers.runtime.checkpoint import CheckpointError, load_checkpoint

    f = tmp_path / "config.yaml"
    f.write_text("seed: 0\nagent:\n  kind: dt\n")
    with pytest.raises(CheckpointError, match=r"config.yaml: not an rl-tformers checkpoint \(those are the zip "
                                              r"archives torch.save writes, RUN_DIR/checkpoints/step_\*.pt\)"):
        load_checkpoint(f)


def test_eval_of_a_missing_run_directory_says_so(tmp_path: Path) -> None:
    r = runner.invoke(app, ["eval", str(tmp_path / "no_such_run")])
    assert r.exit_code == 2 and "no_such_run does not exist" in r.output


@pytest.fixture(scope="module")
def dt_run(tmp_path_factory) -> Path:
    """A DT trained for 2 updates on a tiny CartPole file."""
    tmp = tmp_path_factory.mktemp("b6dt")
    r = train_dt(f"dataset.path={write_d4rl_h5(tmp / 'cartpole.hdf5')}", "--run-dir", str(tmp / "dt"))
    assert r.exit_code == 0, r.output
    return tmp / "dt"


# ------------------------------------------------------------- reset seeds beyond torch's range
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
    big = 2**63  # reset seeds as numpy int64 sums would raise OverflowError past 2**63 - 1
    rep = evaluate(_ZeroPolicy(), _OneStepEnv, episodes=3, n_envs=2, seed=big)
    assert rep.results[0].seeds == [big, big + 1, big + 2]
    again = evaluate(_ZeroPolicy(), _OneStepEnv, episodes=1, n_envs=1, seed=big + 1)
    assert again.results[0].returns == rep.results[0].returns[1:2]  # episode j is seeded seed + j
    for cmd in ("eval", "plot"):
        r = runner.invoke(app, [cmd, str(tmp_path), "--seed", str(2**64), "--out", str(tmp_path / "x.png")])
        assert r.exit_code == 2 and "--seed" in r.output and "18446744073709551615" in r.output, r.output


# ------------------------------------------------- an evaluation environment that cannot be built
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


def test_from_dict_reads_back_what_eval_writes() -> None:
    rewards = [[0.1, 0.2, 0.7000000000000001], [1.5]]
    res = TargetResult(10.0, [sum(rewards[0]), 1.5], [3, 1], [0, 1], rewards=rewards)
    back = TargetResult.from_dict(json.loads(json.dumps(res.to_dict(with_rewards=True))))
    assert (back.returns, back.lengths, back.seeds, back.rewards) == (res.returns, [3, 1], [0, 1], rewards)


# ------------------------------------------------------------------- eval options checked up front
@pytest.mark.parametrize("key", ["eval.episodes", "eval.n_envs"])
def test_eval_counts_must_be_positive(tmp_path: Path, key: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{key} must be >= 1, got 0$"):
        compose(None, ["agent.kind=toy", f"{key}=0"])
    h5 = write_d4rl_h5(tmp_path / "ok.hdf5")
    r = train_dt(f"dataset.path={h5}", f"{key}=-1", "--run-dir", str(tmp_path / "run"))
    assert r.exit_code == 2 and f"error: {key} must be >= 1, got -1" in r.output
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------- a run's checkpoints folder or file as RUN_DIR
def _run_with_a_checkpoint(tmp_path: Path) -> Path:
    from rl_tformers.runtime.checkpoint import save_checkpoint

    run = tmp_path / "run"
    save_checkpoint(run, {"step": 3, "config": {"agent": {"kind": "toy"}}})
    return run


def test_eval_of_the_checkpoints_folder_names_the_run_directory(tmp_path: Path) -> None:
    """`rl-tformers eval runs/dt1/checkpoints` names the run directory to pass (not "no checkpoint
    in runs/dt1/checkpoints/checkpoints" about a folder full of checkpoints); the same for plot,
    train --resume and bench eval."""
    run = _run_with_a_checkpoint(tmp_path)
    ckpts = run / "checkpoints"
    want = f"error: {ckpts} is the checkpoint folder of the run {run}; pass the run directory {run}\n"
    r = runner.invoke(app, ["eval", str(ckpts)])
    assert r.exit_code == 2 and r.stderr == want
    r = runner.invoke(app, ["plot", str(ckpts), "--out", str(tmp_path / "f.png")])
    assert r.exit_code == 2 and r.stderr == want
    # an empty run directory keeps its message
    (tmp_path / "empty").mkdir()
    r = runner.invoke(app, ["eval", str(tmp_path / "empty")])
    assert r.exit_code == 2 and r.stderr.startswith(f"error: no checkpoint in {tmp_path / 'empty' / 'checkpoints'} ")


def test_eval_of_a_checkpoint_file_says_how_to_evaluate_that_checkpoint(tmp_path: Path) -> None:
    """`rl-tformers eval runs/dt1/checkpoints/step_000000300.pt` says how to evaluate that
    checkpoint (the file belongs to a run, and eval/plot take it as --checkpoint), not only "is
    not a directory (expected a run directory ...)"."""
    run = _run_with_a_checkpoint(tmp_path)
    f = next((run / "checkpoints").glob("step_*.pt"))
    r = runner.invoke(app, ["eval", str(f)])
    assert r.exit_code == 2
    assert r.stderr == (f"error: {f} is not a directory (expected a run directory written by rl-tformers train); "
                        f"it is a checkpoint of the run {run}: pass that run directory (rl-tformers eval and "
                        f"plot take a specific checkpoint as --checkpoint FILE)\n")


def test_eval_notes_a_target_far_above_the_datasets_best(tiny_dt_run: Path) -> None:
    """Every episode of the tiny run's data returns 10: --targets 1e9 gets one note line naming
    the data's best; a target within the data gets none."""
    res = _eval(str(tiny_dt_run), "--targets", "10,1e9")
    assert res.exit_code == 0, res.output
    notes = [ln for ln in res.output.splitlines() if ln.startswith("note:")]
    assert notes == ["note: target 1e+09 lies outside the training data (its best episode return is 10, its worst 10)"]
    res = _eval(str(tiny_dt_run), "--targets", "10")
    assert res.exit_code == 0 and "note:" not in res.output, res.output



def test_outside_data_note_counts_a_target_far_below_by_the_datas_range() -> None:
    from rl_tformers.cli.evaluate import outside_data_note

    assert outside_data_note([1027.0, 1074.0], 1121.0, 1074.0) is None  # down to worst - range (47): near the data
    assert outside_data_note([1026.0, -3600.0, 1100.0], 1121.0, 1074.0) == (
        "note: targets 1026, -3600 lie outside the training data (its best episode return is 1121, its worst 1074)")
    assert outside_data_note([9.0], 10.0, 10.0) == (
        "note: target 9 lies outside the training data (its best episode return is 10, its worst 10)")

def test_outside_data_note_counts_a_target_far_above_by_the_datas_range() -> None:
    from rl_tformers.cli.evaluate import outside_data_note

    assert outside_data_note([1074.0, 1168.0], 1121.0, 1074.0) is None  # up to best + range (47): near the data
    assert outside_data_note([1169.0, 3600.0, 1800.0], 1121.0, 1074.0) == (
        "note: targets 1169, 3600, 1800 lie outside the training data (its best episode return is 1121, its worst 1074)")
    assert outside_data_note([1e9], None, None) is None


def test_eval_progress_without_a_terminal_is_plain_lines_before_the_results(tiny_dt_run: Path) -> None:
    """2 targets x 4 episodes: progress lines counted in episodes (each episode is over 5% of 8)
    on stderr, the last at 8/8, all before the results; none with --json."""
    res = CliRunner().invoke(app, ["eval", str(tiny_dt_run), "--targets", "10,20", "--episodes", "4", "--envs", "2"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    progress = [ln for ln in lines if ln.startswith("eval: ")]
    counts = [int(ln.split()[1].split("/")[0]) for ln in progress]
    assert counts == sorted(set(counts)) and counts[-1] == 8 and progress[-1].startswith("eval: 8/8 episodes (100%)")
    assert max(lines.index(ln) for ln in progress) < min(k for k, ln in enumerate(lines) if ln.startswith("dt run "))
    res = CliRunner().invoke(app, ["eval", str(tiny_dt_run), "--targets", "10", "--episodes", "2", "--json"])
    assert res.exit_code == 0 and res.stderr == "", res.stderr
