"""`rl-tformers collect --policy RUN_DIR`: a trained rl-tformers run as the behaviour policy
(:class:`~rl_tformers.envs.collect.RunPolicy`), here PPO-GTrXL on a POPGym task whose Discrete
observations are recorded one-hot, with the encoding in the dataset metadata; GTrXL BC and the DT
train on the recorded dataset and evaluate on the task."""

from __future__ import annotations

import json
from pathlib import Path

import minari
import numpy as np
import pytest
from rl_tformers.envs.collect import RunPolicy
from rl_tformers.envs.loaders import load_minari, minari_root
from typer.testing import CliRunner

from rl_tformers.cli import app
from rl_tformers.runtime.loading import load_run
from tests.datafiles import write_d4rl_h5
from tests.runs import assert_clean_exit

runner = CliRunner()

TASK = "popgym-RepeatPreviousEasy-v0"  # Discrete(4) observations, Discrete(4) actions, 51-step episodes
DATASET = "rlt/popgym-repeatpreviouseasy-v0/gtrxl-ppo-v0"  # the default id of a gtrxl_ppo run on TASK
TINY_BACKBONE = ["backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=2"]
TINY_PPO = ["agent.n_envs=4", "agent.n_steps=32", "agent.n_epochs=1", "agent.n_minibatches=1", "train.steps=3",
            "train.checkpoint_every=3", "eval.every=0", "eval.at_end=false", "train.progress=false",
            "backbone.memory.mem_len=8", *TINY_BACKBONE, "--device", "cpu"]
OFFLINE = ["train.steps=2", "train.batch_size=4", "train.warmup_steps=1", "train.checkpoint_every=2", "eval.every=0",
           "eval.episodes=2", "eval.n_envs=2", "train.progress=false", *TINY_BACKBONE, "--device", "cpu"]


class _Recorder:
    """A runtime policy that answers obs[0].argmax() and records what ``act`` was given."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def initial_state(self, n_envs: int, target_return: float | None = None) -> list:
        return [target_return]

    def act(self, obs, state, episode_start, last_reward):
        self.calls.append((obs.shape, list(state), episode_start.tolist(), last_reward.tolist()))
        return np.array([int(np.argmax(obs[0]))]), [*state, float(last_reward[0])]


def test_a_run_policy_acts_on_batches_of_one_and_receives_each_step_s_reward() -> None:
    inner = _Recorder()
    pol = RunPolicy(inner, target_return=2.5)
    assert pol(np.array([0.0, 1.0, 0.0])) == 1
    pol.observe_reward(0.5)
    assert pol(np.array([1.0, 0.0, 0.0])) == 0
    pol.reset()
    pol.observe_reward(-1.0)
    assert pol(np.array([0.0, 0.0, 1.0])) == 2
    assert inner.calls == [((1, 3), [2.5], [True], [0.0]),  # episode start: last_reward 0
                           ((1, 3), [2.5, 0.0], [False], [0.5]),
                           ((1, 3), [2.5], [True], [-1.0])]  # a fresh state after reset()


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory) -> Path:
    """PPO-GTrXL trained for 3 updates (384 environment steps) on :data:`TASK`."""
    pytest.importorskip("popgym")
    run = tmp_path_factory.mktemp("popgym") / "ppo"
    r = runner.invoke(app, ["train", "-c", "gtrxl/popgym_ppo", *TINY_PPO, "--run-dir", str(run)])
    assert r.exit_code == 0, r.output
    return run


@pytest.fixture(scope="module")
def recorded(ppo_run: Path) -> tuple[Path, dict]:
    """3 episodes of the PPO-GTrXL run recorded by `collect` under a data root; (root, --json output)."""
    root = ppo_run.parent / "data"
    r = runner.invoke(app, ["collect", "--env", TASK, "--policy", str(ppo_run), "--episodes", "3", "--seed", "4",
                            "--root", str(root), "--json", "--no-progress"])
    assert r.exit_code == 0, r.output
    return root, json.loads(r.stdout)


def test_a_ppo_gtrxl_run_records_its_popgym_episodes_one_hot_with_the_encoding_in_the_metadata(
        ppo_run: Path, recorded: tuple[Path, dict]) -> None:
    root, summary = recorded
    assert summary["dataset_id"] == DATASET and summary["episodes"] == 3 and summary["steps"] == 3 * 51
    data = load_minari(root / DATASET)
    assert data.metadata.env_id == TASK
    assert data.metadata.extra["observation_encoding"] == {"kind": "flatten", "by": "gymnasium.spaces.flatten",
                                                           "source_space": "Discrete(4)", "dim": 4}
    run = load_run(ppo_run)
    for i in range(3):
        ep = data.episode(i)
        obs = np.asarray(ep.observations)
        assert obs.shape == (51, 4) and obs.dtype == np.float32
        assert np.array_equal(obs.sum(1), np.ones(51)) and set(np.unique(obs)) == {0.0, 1.0}  # one-hot rows
        # the recorded actions are the run's deterministic policy's, replayed on the recorded observations
        replay = RunPolicy(run.agent.policy())
        actions = []
        for o, rew in zip(obs, np.asarray(ep.rewards)):
            actions.append(int(replay(o)))
            replay.observe_reward(float(rew))
        assert np.array_equal(np.asarray(ep.actions), actions)
        ret = float(np.sum(ep.rewards))  # RepeatPreviousEasy: +-1/48 at 48 of the 51 steps
        assert -1.0 <= ret <= 1.0 and ret * 24 == pytest.approx(round(ret * 24), abs=1e-9)
    with minari_root(root):
        env = minari.load_dataset(DATASET).recover_environment(eval_env=True)  # the encoded task
    assert env.observation_space.shape == (4,) and env.observation_space.dtype == np.float32


@pytest.mark.parametrize("config", ["gtrxl/recall_bc", "dt/cartpole_demo"])
def test_gtrxl_bc_and_the_dt_train_on_the_recorded_dataset_and_evaluate_on_the_task(
        recorded: tuple[Path, dict], tmp_path: Path, config: str) -> None:
    root, _ = recorded
    agent = ([f"agent.env_id={TASK}", "agent.seq_len=4", "agent.burn_in=2", "backbone.memory.mem_len=8"]
             if config.startswith("gtrxl") else ["agent.context_len=4", "agent.max_ep_len=60", "agent.targets=[1.0]"])
    run = tmp_path / "offline"
    r = runner.invoke(app, ["train", "-c", config, f"dataset.path={root / DATASET}", "dataset.build=null", *agent,
                            *OFFLINE, "--run-dir", str(run)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["eval", str(run), "--episodes", "2", "--envs", "2", "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["env_id"] == TASK and report["results"][0]["lengths"] == [51, 51]


def test_a_run_of_another_task_or_sb3_options_with_a_run_directory_are_refused_in_one_line(
        ppo_run: Path, tmp_path: Path) -> None:
    base = ["collect", "--policy", str(ppo_run), "--episodes", "1", "--root", str(tmp_path), "--no-progress"]
    cases = [(["--env", "popgym-CountRecallEasy-v0"],
              f"error: --policy {ppo_run} was trained on {TASK}, not on --env popgym-CountRecallEasy-v0"),
             (["--env", TASK, "--algo", "ppo"], "error: --algo ppo: applies to an SB3 save file; "),
             (["--env", TASK, "--obs-norm", "none"], "error: --obs-norm none: applies to an SB3 save file; ")]
    for extra, message in cases:
        r = runner.invoke(app, [*base, *extra])
        assert_clean_exit(r, 2)
        assert r.stderr.startswith(message) and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("obs_dim, n_actions, message", [
    (3, 2, "observations of shape (3,), the environment's are (4,)"),
    (4, 3, "3 discrete actions, the environment has 2 discrete actions"),
], ids=["observations", "actions"])
def test_a_run_on_data_naming_no_task_is_refused_when_its_spaces_differ_from_the_env(
        tmp_path: Path, obs_dim: int, n_actions: int, message: str) -> None:
    data = write_d4rl_h5(tmp_path / "d.hdf5", obs_dim=obs_dim, env_id=None, actions=np.arange(30) % n_actions)
    run = tmp_path / "bc"
    r = runner.invoke(app, ["train", "agent.kind=bc", "agent.hidden=[8]", f"dataset.path={data}", *OFFLINE[:6],
                            "train.progress=false", "eval.at_end=false", "--device", "cpu", "--run-dir", str(run)])
    assert r.exit_code == 0, r.output
    root = tmp_path / "data"
    r = runner.invoke(app, ["collect", "--env", "CartPole-v1", "--policy", str(run), "--episodes", "1",
                            "--root", str(root), "--no-progress"])
    assert_clean_exit(r, 2)
    assert r.stderr.strip().splitlines() == [
        f"error: --policy {run} was trained on {message}; it cannot act in --env CartPole-v1"]
    assert not root.exists() or not any(root.iterdir())  # nothing written
