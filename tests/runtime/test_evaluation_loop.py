"""The evaluation loop steps only the environments still running a counted episode, with the
same episodes and returns as stepping all of them; its profile spans cost nothing when off."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from rl_tformers.runtime import eval_profile
from rl_tformers.runtime import evaluation as ev


class Tilt:
    """CartPole policy: push towards the pole's fall (a deterministic function of the observation),
    noisy enough that episodes last from a few dozen to a few hundred steps."""

    def initial_state(self, n, target=None):
        return None

    def act(self, obs, state, episode_start, last_reward=None):
        obs = np.asarray(obs)
        return (obs[:, 2] + 0.2 * obs[:, 3] + 0.05 * np.sin(40 * obs[:, 0]) > 0).astype(np.int64), state


class CountSteps(gym.Wrapper):
    """Counts the steps of the wrapped environment in a shared list (one entry per environment)."""

    def __init__(self, env, counts, i):
        super().__init__(env)
        self.counts, self.i = counts, i

    def step(self, action):
        self.counts[self.i] += 1
        return self.env.step(action)


def _envs(n, counts=None, cls=gym.vector.SyncVectorEnv):
    def make(i):
        def build():
            env = ev.with_raw_reward(gym.make("CartPole-v1"))
            return env if counts is None else CountSteps(env, counts, i)
        return build

    return cls([make(i) for i in range(n)], autoreset_mode=gym.vector.AutoresetMode.DISABLED)


def test_skipping_finished_environments_gives_the_returns_of_stepping_them():
    """7 episodes on 3 environments: the rows past their quota are not stepped, and the counted
    episodes (lengths, returns, rewards) are exactly those of the loop that steps every row."""
    counts = [0, 0, 0]
    skip_envs, full_envs = _envs(3, counts), _envs(3)
    try:
        skip = ev.run_episodes(Tilt(), skip_envs, None, 7, 11, record_rewards=True)
        full = ev.run_episodes(Tilt(), full_envs, None, 7, 11, record_rewards=True, step_finished=True)
    finally:
        skip_envs.close()
        full_envs.close()
    assert skip.lengths.tolist() == full.lengths.tolist() and len(set(skip.lengths.tolist())) > 3
    assert skip.returns.tolist() == full.returns.tolist()
    assert all(np.array_equal(a, b) for a, b in zip(skip.rewards, full.rewards))
    # each environment took exactly the steps of its own counted episodes (j = i, i + 3, i + 6)
    assert counts == [int(skip.lengths[i::3].sum()) for i in range(3)]


def test_an_async_vector_env_steps_every_row_and_plays_the_same_episodes():
    sync, asynchronous = _envs(2), _envs(2, cls=gym.vector.AsyncVectorEnv)
    try:
        a = ev.run_episodes(Tilt(), sync, None, 5, 3)
        b = ev.run_episodes(Tilt(), asynchronous, None, 5, 3)
    finally:
        sync.close()
        asynchronous.close()
    assert a.lengths.tolist() == b.lengths.tolist() and a.returns.tolist() == b.returns.tolist()


def test_evaluate_with_more_environments_than_running_episodes_gives_the_same_returns():
    """evaluate() with 1, 3 and 5 environments: the same episodes whatever N (a policy whose rows
    do not interact)."""
    reports = [ev.evaluate(Tilt(), lambda: gym.make("CartPole-v1"), episodes=5, n_envs=n, seed=4) for n in (1, 3, 5)]
    assert reports[0].results[0].returns == reports[1].results[0].returns == reports[2].results[0].returns


def test_profile_spans_split_the_wall_time_and_cost_nothing_when_off():
    assert eval_profile.span("env") is eval_profile.span("forward")  # the shared do-nothing span
    envs = _envs(2)
    try:
        with eval_profile.profiling() as prof:
            ev.run_episodes(Tilt(), envs, None, 4, 0)
    finally:
        envs.close()
    split = prof.split()
    assert prof.calls["env"] > 10 and split["env_s"] > 0 and split["forward_s"] == 0.0  # Tilt opens no span
    assert sum(split[f"{k}_s"] for k in ("forward", "context", "env", "decode", "bookkeeping")) == pytest.approx(
        split["total_s"])
    assert eval_profile.span("env") is eval_profile.span("context")  # off again after the block


def test_a_span_records_a_torch_profiler_range():
    with torch.profiler.profile() as p, eval_profile.profiling():
        with eval_profile.span("forward"):
            torch.ones(3).sum()
    assert "forward" in {e.name for e in p.events()}
