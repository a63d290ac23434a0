"""Pixel environments: Atari with the standard preprocessing, MinAtar, their scores, evaluation
on them, collection into frame datasets, and the refusal without the atari extra."""

from __future__ import annotations

import sys

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation
from rl_tformers.envs.collect import Behaviour, collect
from rl_tformers.envs.environments import ATARI_INSTALL, MissingExtraError, make_task
from rl_tformers.envs.frames import stack_frames
from rl_tformers.envs.loaders import load_dataset
from rl_tformers.envs.pixels import frame_stack_of
from rl_tformers.envs.policies import RandomPolicy
from rl_tformers.envs.samplers import WindowSampler
from rl_tformers.envs.scores import normalized_score, reference_scores
from typer.testing import CliRunner

from rl_tformers.cli import app
from rl_tformers.runtime.evaluation import evaluate

BREAKOUT = "ALE/Breakout-v5"


def _wrapper(env: gym.Env, cls):
    while not isinstance(env, cls):
        env = env.env
    return env


@pytest.mark.parametrize("env_id", [BREAKOUT, "BreakoutNoFrameskip-v4"])
def test_atari_ids_get_the_dqn_preprocessing_without_sticky_actions(env_id) -> None:
    pytest.importorskip("ale_py")
    env = make_task(env_id)
    assert env.observation_space == gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
    pre = _wrapper(env, AtariPreprocessing)
    assert (pre.noop_max, pre.frame_skip, pre.screen_size, pre.grayscale_obs, pre.terminal_on_life_loss,
            pre.scale_obs) == (30, 4, (84, 84), True, False, False)
    assert frame_stack_of(env) == 4 and _wrapper(env, FrameStackObservation).padding_type == "zero"
    ale = env.unwrapped.ale
    assert ale.getFloat("repeat_action_probability") == 0.0 and ale.getInt("frame_skip") == 1
    obs, _ = env.reset(seed=0)
    assert obs.dtype == np.uint8 and obs.shape == (4, 84, 84)
    assert not obs[:3].any() and obs[3].any()  # frames before the episode start are zeros
    env.close()


def test_minatar_gives_channels_first_uint8_maps_without_sticky_actions() -> None:
    pytest.importorskip("minatar")
    env = make_task("MinAtar/Breakout-v1")
    assert env.observation_space == gym.spaces.Box(0, 255, (4, 10, 10), np.uint8)
    assert env.action_space == gym.spaces.Discrete(3) and env.spec.max_episode_steps == 10_000
    assert env.unwrapped.game.sticky_action_prob == 0.0
    obs, _ = env.reset(seed=0)
    raw = env.unwrapped.game.state()  # (10, 10, 4) bool
    assert np.array_equal(obs, np.moveaxis(raw, -1, 0).astype(np.uint8) * 255)
    assert set(np.unique(obs).tolist()) == {0, 255}


def test_atari_scores_are_normalised_by_random_and_human_references() -> None:
    assert reference_scores(BREAKOUT) == (1.7, 30.5) and reference_scores("PongNoFrameskip-v4") == (-20.7, 14.6)
    assert reference_scores("ALE/Qbert-v5") == (163.9, 13455.0) and reference_scores("ALE/Seaquest-v5") == (68.4, 42054.7)
    assert normalized_score(BREAKOUT, 30.5) == pytest.approx(100.0) and normalized_score(BREAKOUT, 1.7) == 0.0
    assert reference_scores("MinAtar/Breakout-v1") is None and normalized_score("MinAtar/Breakout-v1", 5.0) is None


class RandomActions:
    """A policy of uniform Discrete actions from a seeded generator (the protocol's Policy)."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n, self.rng = n, np.random.default_rng(seed)

    def initial_state(self, n: int, target_return=None):
        return None

    def act(self, obs, state, episode_start, last_reward):
        assert obs.dtype == np.uint8 and obs.shape[1:] == (4, 84, 84)
        return self.rng.integers(0, self.n, size=obs.shape[0]), state


def test_one_evaluation_episode_on_breakout_reports_raw_and_normalised_scores() -> None:
    pytest.importorskip("ale_py")
    report = evaluate(RandomActions(4), lambda: make_task(BREAKOUT), episodes=1, n_envs=1, seed=3,
                      normalize=lambda r: normalized_score(BREAKOUT, r), env_id=BREAKOUT)
    (res,) = report.results
    assert len(res.returns) == 1 and res.lengths[0] > 0
    assert res.normalized_score == pytest.approx(100 * (res.returns[0] - 1.7) / (30.5 - 1.7))


def test_a_collected_atari_dataset_stores_each_frame_once_and_restacks_the_observations(tmp_path) -> None:
    """One random Breakout episode collected, then replayed from its recorded seed and actions:
    every stack the sampler rebuilds equals the observation the environment gave at that step."""
    pytest.importorskip("ale_py")
    env = make_task(BREAKOUT)
    res = collect(BREAKOUT, [Behaviour(RandomPolicy(env.action_space, seed=1), episodes=1, label="random")],
                  dataset_id="rlt/breakout-test/random-v0", root=tmp_path, seed=2, progress=False)
    ds = load_dataset(res.path)
    assert ds.observations.dtype == np.uint8 and ds.observations.shape == (ds.num_steps, 1, 84, 84)
    assert ds.frame_stack == 4 and ds.observation_space == gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
    assert ds.metadata.env_id == BREAKOUT and ds.summary()["ref_max_score"] == 30.5
    first_seed = int(np.random.default_rng([2, 0]).integers(2**31 - 1))  # collect's first reset seed
    obs, _ = env.reset(seed=first_seed)
    seen = [obs]
    for a in ds.actions[: ds.num_steps - 1]:
        obs, *_ = env.step(int(a))
        seen.append(obs)
    seen = np.stack(seen)  # (L, 4, 84, 84): what the agent saw
    rows = np.arange(ds.num_steps)[None, :]  # (1, L): the whole episode, as one window
    stacks = WindowSampler(ds, ds.num_steps).sample(1, np.random.default_rng(0))["observations"]
    assert stacks.dtype == np.uint8 and np.array_equal(stacks[0], seen)  # the only window: the episode
    assert np.array_equal(stack_frames(ds.observations, rows, rows, 4)[0], seen)
    assert not seen[0, :3].any() and not seen[2, 0].any()


def test_an_atari_id_without_the_extra_is_refused_in_one_line_naming_it(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "ale_py", None)  # `import ale_py` raises ImportError
    with pytest.raises(MissingExtraError, match=rf"^{BREAKOUT} needs the atari extra, which is not installed: "
                                                rf"{ATARI_INSTALL.replace('[', '.').replace(']', '.')} \("):
        make_task(BREAKOUT)
    r = CliRunner().invoke(app, ["collect", "--env", BREAKOUT, "--steps", "10", "--root", str(tmp_path)])
    assert r.exit_code == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"error: --env: {BREAKOUT} needs the atari extra, which is not installed: {ATARI_INSTALL} ("), r.stderr


def test_collect_on_an_atari_id_writes_one_frame_per_step_under_a_dashed_id(tmp_path) -> None:
    pytest.importorskip("ale_py")
    r = CliRunner().invoke(app, ["collect", "--env", BREAKOUT, "--policy", "random", "--episodes", "1",
                                 "--root", str(tmp_path), "--no-progress"])
    assert r.exit_code == 0, r.output
    ds = load_dataset("rlt/ale-breakout-v5/random-v0", root=tmp_path)
    assert ds.observations.dtype == np.uint8 and ds.frame_shape == (1, 84, 84) and ds.frame_stack == 4
    assert ds.summary()["observation_bytes"] == ds.num_steps * 84 * 84
