"""The shared evaluation loop: unbiased episode counting, raw returns, fixed seeds, batching."""

from __future__ import annotations

import itertools

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces

from rl_tformers.runtime.evaluation import evaluate, parse_targets, with_raw_reward


class FixedLengthEnv(gym.Env):
    """Episodes of exactly ``length`` steps, reward 1 per step except the first (reward 0).

    length 1 -> return 0; length 10 -> return 9 + ``bonus`` on the last step (so 10 with bonus 1).
    """

    metadata: dict = {"render_modes": []}

    def __init__(self, length: int = 1, bonus: float = 1.0):
        self.length, self.bonus = length, bonus
        self.observation_space = spaces.Box(-np.inf, np.inf, (2,), np.float32)
        self.action_space = spaces.Box(-1.0, 1.0, (1,), np.float32)
        self.t = 0
        self.seeds: list[int | None] = []

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.seeds.append(seed)
        self.t = 0
        return np.array([0.0, float(self.length)], np.float32), {}

    def step(self, action):
        self.t += 1
        done = self.t >= self.length
        reward = 0.0 if self.t == 1 else 1.0
        if done and self.length > 1:
            reward += self.bonus
        return np.array([self.t, self.length], np.float32), reward, done, False, {}


ENV_ID = "RLTformersTest/FixedLength-v0"
if ENV_ID not in gym.registry:
    gym.register(ENV_ID, entry_point=FixedLengthEnv)


class CountingPolicy:
    """Zero actions; counts ``act`` calls and checks the batch shape (one call per step for all envs)."""

    def __init__(self):
        self.calls = 0
        self.n = None
        self.rewards_seen: list[np.ndarray] = []

    def initial_state(self, n_envs, target_return=None):
        self.n = n_envs
        return None

    def act(self, obs, state, episode_start, last_reward=None):
        assert obs.shape == (self.n, 2) and episode_start.shape == (self.n,)
        self.calls += 1
        if last_reward is not None:
            self.rewards_seen.append(np.asarray(last_reward).copy())
        return np.zeros((self.n, 1), np.float32), state


def _alternating_factory(lengths=(1, 10), scale=None):
    counter = itertools.count()

    def make():
        env = gym.make(ENV_ID, length=lengths[next(counter) % len(lengths)])
        if scale is not None:
            env = gym.wrappers.TransformReward(env, lambda r: scale * r)
        return env

    return make


def test_short_and_long_env_episodes_counted_without_bias():
    pol = CountingPolicy()
    rep = evaluate(pol, _alternating_factory(), [None], episodes=4, n_envs=2, seed=0)
    (res,) = rep.results
    assert res.returns == [0.0, 10.0, 0.0, 10.0]
    assert res.return_mean == 5.0
    assert res.lengths == [1, 10, 1, 10]
    assert res.seeds == [0, 1, 2, 3]
    # the loop ran until the long env finished its 2 episodes: 20 steps, one act call each
    assert pol.calls == 20


def test_reward_scaling_wrapper_does_not_change_reported_return():
    pol = CountingPolicy()
    rep = evaluate(pol, _alternating_factory(lengths=(10,), scale=0.001), [None], episodes=3, n_envs=2, seed=5)
    assert rep.results[0].returns == [10.0, 10.0, 10.0]
    # the policy receives raw rewards too
    assert max(float(r.max()) for r in pol.rewards_seen) == 2.0


def test_with_raw_reward_sits_above_the_unwrapped_env():
    env = with_raw_reward(gym.wrappers.TransformReward(gym.make(ENV_ID, length=3), lambda r: 0.5 * r))
    env.reset(seed=0)
    env.step(np.zeros(1, np.float32))
    _, r, _, _, info = env.step(np.zeros(1, np.float32))
    assert (r, info["raw_reward"]) == (0.5, 1.0)


def test_episode_seeds_are_fixed_and_shared_across_targets():
    made = []

    def make():
        env = gym.make(ENV_ID, length=2)
        made.append(env.unwrapped)
        return env

    rep = evaluate(CountingPolicy(), make, [1.0, 2.0], episodes=5, n_envs=2, seed=100)
    assert [r.seeds for r in rep.results] == [[100, 101, 102, 103, 104]] * 2
    # env 0 runs episodes 0, 2, 4; env 1 runs 1, 3 (then keeps going, unseeded, until env 0 is done)
    assert [s for s in made[0].seeds if s is not None] == [100, 102, 104, 100, 102, 104]
    assert [s for s in made[1].seeds if s is not None] == [101, 103, 101, 103]


def test_records_reward_sequences_and_normalises():
    rep = evaluate(
        CountingPolicy(), _alternating_factory(lengths=(3,)), [7.0], episodes=2, n_envs=2, seed=0,
        record_rewards=True, normalize=lambda r: 100 * r / 4.0,
    )
    res = rep.results[0]
    assert res.rewards == [[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]]
    d = res.to_dict()
    assert d["target_return"] == 7.0 and d["returns"] == [3.0, 3.0]
    assert d["normalized_score"] == 75.0
    assert set(rep.to_dict()["results"][0]) >= {"target_return", "returns", "return_mean", "return_std", "normalized_score"}


def test_parse_targets():
    assert parse_targets("3600, 1800") == [3600.0, 1800.0]
    assert parse_targets(None) is None
    with pytest.raises(ValueError, match="'abc' is not a number"):
        parse_targets("3600,abc")


def test_default_sweep_spans_worst_to_beyond_best():
    from rl_tformers.runtime.plots import default_sweep

    assert default_sweep(3559.0, 1000.0, 6) == [1000.0, 1614.0, 2228.0, 2842.0, 3457.0, 4071.0]
    assert default_sweep(-120.0, -1820.0, 3) == [-1820.0, -800.0, 220.0]
    with pytest.raises(ValueError, match="at least 2 targets"):
        default_sweep(1.0, 0.0, 1)


class ConstantPolicy:
    def __init__(self, value):
        self.value = value

    def initial_state(self, n, target=None):
        self.n = n
        return None

    def act(self, obs, state, episode_start, last_reward=None):
        return np.full((len(episode_start), 1), self.value, np.float32), state


def test_imitation_report_measures_distance_to_each_reference():
    from rl_tformers.agents.common.diagnostics import imitation_report

    refs = {"zero": lambda o: np.zeros((len(o), 1)), "one": lambda o: np.ones((len(o), 1))}
    rep = imitation_report(ConstantPolicy(0.75), lambda: gym.make(ENV_ID, length=5), refs, None,
                           episodes=2, n_envs=2, early_steps=2)
    assert rep["return_mean"] == 5.0  # rewards 0, 1, 1, 1, 1 + bonus 1
    assert rep["early"]["steps"] == 4 and rep["late"]["steps"] == 6  # 2 envs x (2 + 3) steps
    assert rep["early"]["dist"] == {"zero": 0.5625, "one": 0.0625}
    assert rep["late"]["closest"] == {"zero": 0.0, "one": 1.0}
    with pytest.raises(ValueError, match="at least one reference"):
        imitation_report(ConstantPolicy(0.0), lambda: gym.make(ENV_ID), {}, None)


class StepPolicy:
    """Action = [t / 100] with t the step index of the episode in that env (so actions are traceable)."""

    def initial_state(self, n_envs, target_return=None):
        return np.zeros(n_envs, np.int64)

    def act(self, obs, state, episode_start, last_reward=None):
        t = np.where(episode_start, 0, state + 1)
        return (t[:, None] / 100).astype(np.float32), t


def _vector(lengths, n):
    factory = _alternating_factory(lengths=lengths)
    return gym.vector.SyncVectorEnv([lambda: with_raw_reward(factory()) for _ in range(n)],
                                    autoreset_mode=gym.vector.AutoresetMode.DISABLED)


def test_run_episodes_records_trajectories_and_cuts_at_max_steps():
    from rl_tformers.runtime.evaluation import run_episodes

    envs = _vector((3, 10), 2)  # env 0: 3-step episodes, env 1: 10-step ones
    rec = run_episodes(StepPolicy(), envs, 5.0, 3, seed=0, record_trajectories=True, max_steps=4)
    envs.close()
    # episode 0 (env 0) ends by termination after 3 steps, episode 1 (env 1) is cut at 4, episode 2 (env 0) terminates
    assert rec.lengths.tolist() == [3, 4, 3]
    assert rec.terminated.tolist() == [True, False, True]
    assert [r.tolist() for r in rec.rewards] == [[0.0, 1.0, 2.0], [0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 2.0]]
    assert rec.returns.tolist() == [3.0, 3.0, 3.0]
    # the observation before each action: (t, length) after t steps; actions t / 100
    assert rec.observations[1].tolist() == [[0, 10], [1, 10], [2, 10], [3, 10]]
    assert rec.observations[2].tolist() == [[0, 3], [1, 3], [2, 3]]
    assert [a[:, 0].tolist() for a in rec.actions] == [np.float32([0, .01, .02]).tolist(),
                                                       np.float32([0, .01, .02, .03]).tolist(),
                                                       np.float32([0, .01, .02]).tolist()]


def test_run_episodes_grows_its_buffers_past_1024_steps():
    from rl_tformers.runtime.evaluation import run_episodes

    envs = _vector((1500,), 1)
    rec = run_episodes(StepPolicy(), envs, None, 1, seed=0, record_trajectories=True)
    envs.close()
    assert rec.lengths.tolist() == [1500] and rec.terminated.tolist() == [True]
    assert rec.observations[0][:, 0].tolist() == list(range(1500))
    assert np.array_equal(rec.actions[0][:, 0], (np.arange(1500) / 100).astype(np.float32))
    assert rec.rewards[0].tolist() == [0.0] + [1.0] * 1498 + [2.0]


def test_run_episodes_names_its_caller_in_errors():
    from rl_tformers.runtime.evaluation import NonFiniteError, run_episodes

    class NaNPolicy(StepPolicy):
        def act(self, obs, state, episode_start, last_reward=None):
            a, t = super().act(obs, state, episode_start, last_reward)
            a[t == 2] = np.nan
            return a, t

    envs = _vector((10,), 1)
    with pytest.raises(NonFiniteError, match=r"^online rollout: the policy returned a non-finite action for target "
                                             r"return 7 at step 2 of episode 0 \(env 0, reset seed 4\)"):
        run_episodes(NaNPolicy(), envs, 7.0, 1, seed=4, who="online rollout")
    envs.close()


class RowCountingPolicy(CountingPolicy):
    """Records what ``count_rows`` is told before each ``act``; fails at call ``fail_at``."""

    def __init__(self, fail_at: int | None = None):
        super().__init__()
        self.told: list = []
        self.fail_at = fail_at

    def count_rows(self, rows):
        self.told.append(None if rows is None else rows.tolist())

    def act(self, obs, state, episode_start, last_reward=None):
        if self.calls == self.fail_at:
            raise RuntimeError("policy failed")
        return super().act(obs, state, episode_start, last_reward)


def test_run_episodes_tells_the_policy_its_counted_rows_and_resets_them_even_on_error():
    """Rows past their quota are not counted (DTPolicy's exit / kNN statistics); the policy is
    told every row counts again when the loop ends, also when an error stops it."""
    pol = RowCountingPolicy()
    evaluate(pol, _alternating_factory(), [None], episodes=3, n_envs=2, seed=0)
    # env 0 (length 1) runs episodes 0 and 2, env 1 (length 10) episode 1: after 2 steps env 0 is idle
    assert pol.told[:3] == [[True, True], [True, True], [False, True]]
    assert pol.told[-1] is None and pol.told.count(None) == 1
    failing = RowCountingPolicy(fail_at=3)
    with pytest.raises(RuntimeError, match="policy failed"):
        evaluate(failing, _alternating_factory(), [None], episodes=3, n_envs=2, seed=0)
    assert failing.told[-1] is None


# ------------------------------------------------- stochastic policies: seeded, reproducible evaluation
class _CoinPolicy:
    """Samples CartPole actions with torch's global generator (like GTrXL with deterministic=false)."""

    def initial_state(self, n_envs, target_return=None):
        return None

    def act(self, obs, state, episode_start, last_reward=None):
        return torch.randint(0, 2, (len(episode_start),)).numpy(), None


def test_evaluating_a_sampling_policy_is_reproducible_and_leaves_the_global_rng_alone() -> None:
    """A policy that samples its actions (GTrXL agent.deterministic=false) draws them from a
    generator seeded by the evaluation, not torch's global one: `rl-tformers eval RUN --seed 0`
    gives the same returns at every call, as the "repeat it exactly" command printed after
    training promises."""
    from rl_tformers.runtime.evaluation import evaluate, make_env_factory

    torch.manual_seed(123)
    before = torch.get_rng_state()
    runs = [evaluate(_CoinPolicy(), make_env_factory("CartPole-v1"), [None], episodes=4, n_envs=2, seed=7)
            for _ in range(2)]
    assert runs[0].results[0].returns == runs[1].results[0].returns
    assert torch.equal(torch.get_rng_state(), before)  # an evaluation inside training shifts nothing
