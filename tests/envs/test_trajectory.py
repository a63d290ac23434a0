"""Return-to-go (training and evaluation forms), observation stats, reward scale, top-fraction filter."""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import pytest
from rl_tformers.envs.dataset import EpisodeDataset
from rl_tformers.envs.trajectory import (
    ObsStats,
    dataset_returns_to_go,
    next_return_to_go,
    observation_stats,
    returns_to_go,
    reward_scale,
    top_fraction,
)

BOX1 = gym.spaces.Box(-1.0, 1.0, shape=(1,), dtype=np.float32)


def make(rewards_per_episode, obs=None):
    rewards = np.concatenate([np.asarray(r, float) for r in rewards_per_episode])
    n = rewards.size
    term = np.zeros(n)
    term[np.cumsum([len(r) for r in rewards_per_episode]) - 1] = 1
    if obs is None:
        obs = np.arange(n, dtype=np.float32)[:, None]
    return EpisodeDataset.from_flags(obs, np.zeros((n, 1), np.float32), rewards, term, action_space=BOX1)


def test_undiscounted_rtg_of_1_to_5():
    assert returns_to_go([1, 2, 3, 4, 5]).tolist() == [15.0, 14.0, 12.0, 9.0, 5.0]


def test_evaluation_time_rtg_updates_reproduce_training_rtg():
    rewards = [1, 2, 3, 4, 5]
    rtg, seen = 15.0, []
    for r in rewards:
        seen.append(rtg)
        rtg = next_return_to_go(rtg, r)
    assert seen == returns_to_go(rewards).tolist() == [15.0, 14.0, 12.0, 9.0, 5.0]
    assert rtg == 0.0


def test_discounted_rtg_and_its_update():
    assert returns_to_go([1, 1, 1], gamma=0.5).tolist() == [1.75, 1.5, 1.0]
    rtg, seen = 1.75, []
    for r in [1, 1, 1]:
        seen.append(rtg)
        rtg = next_return_to_go(rtg, r, gamma=0.5)
    assert seen == [1.75, 1.5, 1.0]


def test_rtg_update_is_elementwise_over_environments():
    out = next_return_to_go(np.array([10.0, 3.0]), np.array([1.0, 3.0]))
    assert out.tolist() == [9.0, 0.0]


def test_rtg_rejects_bad_gamma():
    with pytest.raises(ValueError, match="gamma"):
        returns_to_go([1.0], gamma=0.0)


def test_dataset_rtg_is_per_episode():
    ds = make([[1, 2], [3], [1, 1, 1]])
    assert dataset_returns_to_go(ds).tolist() == [3, 2, 3, 3, 2, 1]
    assert dataset_returns_to_go(ds, gamma=0.5).tolist() == [2, 2, 3, 1.75, 1.5, 1.0]


def test_top_fraction_is_inclusive():
    ds = make([[4, 6], [20]])  # returns 10 and 20
    assert ds.episode_returns.tolist() == [10.0, 20.0]
    assert top_fraction(ds, 1.0).episode_returns.tolist() == [10.0, 20.0]
    kept = top_fraction(ds, 0.5)
    assert kept.num_episodes == 1 and kept.episode_returns.tolist() == [20.0]
    assert kept.episode(0).rewards.tolist() == [20.0]


def test_top_fraction_keeps_ties_and_order():
    ds = make([[5], [9], [5], [1]])
    assert top_fraction(ds, 0.5).episode_returns.tolist() == [5.0, 9.0, 5.0]
    assert top_fraction(ds, 0.25).episode_returns.tolist() == [9.0]
    with pytest.raises(ValueError):
        top_fraction(ds, 0.0)


def test_observation_stats_match_numpy_and_floor_std():
    obs = np.stack([np.arange(6.0), np.full(6, 2.0)], axis=1).astype(np.float32)
    ds = make([[1, 1], [1, 1, 1, 1]], obs=obs)
    st = observation_stats(ds)
    np.testing.assert_allclose(st.mean, [2.5, 2.0])
    np.testing.assert_allclose(st.std, [np.std(np.arange(6.0)), 1e-6], rtol=1e-6)
    # a non-contiguous selection streams over the covered rows only
    sub = ds.select([1])
    np.testing.assert_allclose(observation_stats(sub).mean, [3.5, 2.0])
    np.testing.assert_allclose(st.normalize(obs)[:, 0], (np.arange(6.0) - 2.5) / np.std(np.arange(6.0)), rtol=1e-6)
    assert ObsStats.from_dict(st.to_dict()).mean.tolist() == st.mean.tolist()


def test_reward_scale_is_power_of_ten_below_largest_return_at_most_the_papers_1000():
    assert reward_scale(make([[3000.0, 289.0], [10.0]])) == 1000.0
    assert reward_scale(make([[999.0]])) == 100.0
    assert reward_scale(make([[1000.0]])) == 1000.0
    assert reward_scale(make([[6000.0, 4999.0]])) == 1000.0  # HalfCheetah expert returns reach ~11,000
    assert reward_scale(make([[-12000.0], [50.0]])) == 1000.0
    assert reward_scale(make([[1.0e9]])) == 1000.0
    assert reward_scale(make([[-0.5]])) == 0.1
    assert reward_scale(make([[0.0]])) == 1.0


# ------------------------------------------- exact returns-to-go for non-integer rewards
def test_evaluation_rtg_update_reproduces_training_rtg_for_float_rewards() -> None:
    """``next_return_to_go`` reproduces ``returns_to_go`` exactly for integer rewards and within a
    few ulps of the return otherwise: with rewards [0.1, 0.1, 0.1] the evaluation-time RTG at step
    1 is 0.20000000000000004 where training saw 0.2 (training sums from the end, the update
    subtracts from the start; no float64 order of operations makes both exact)."""
    from rl_tformers.envs.trajectory import next_return_to_go, returns_to_go

    rng = np.random.default_rng(0)
    for rewards in ([0.1, 0.1, 0.1], [0.1, 0.7, 0.2], rng.normal(3.0, 1.0, 1000).tolist()):
        rtg = returns_to_go(rewards)
        x, seen = float(rtg[0]), []
        for r in rewards:
            seen.append(x)
            x = next_return_to_go(x, r)
        tol = 8 * np.finfo(np.float64).eps * math.fsum(abs(r) for r in rewards) * len(rewards) ** 0.5
        assert np.abs(np.array(seen) - rtg).max() <= tol
        assert rtg[-1] == rewards[-1]  # the last step's RTG is its reward exactly
    ints = rng.integers(-5, 6, 500).astype(np.float64)
    rtg = returns_to_go(ints)
    x, seen = float(rtg[0]), []
    for r in ints:
        seen.append(x)
        x = next_return_to_go(x, r)
    assert seen == rtg.tolist()  # integer rewards: bit for bit


def test_return_to_go_at_step_0_is_the_episode_return() -> None:
    """``episode_returns`` (math.fsum, used for top_fraction, targets and reward_scale) is 1.0 for
    rewards [0.1, 0.7, 0.2], the training RTG of step 0 0.9999999999999999: both within float64
    rounding of the true sum (documented), and equal for integer rewards."""
    import gymnasium as gym
    from rl_tformers.envs.dataset import EpisodeDataset
    from rl_tformers.envs.trajectory import dataset_returns_to_go

    for rewards in (np.array([0.1, 0.7, 0.2]), np.array([3.0, -1.0, 7.0])):
        ds = EpisodeDataset.from_flags(np.zeros((3, 1), np.float32), np.zeros((3, 1), np.float32), rewards,
                                       np.array([0, 0, 1]), action_space=gym.spaces.Box(-1.0, 1.0, (1,), np.float32))
        assert ds.episode_returns[0] == math.fsum(rewards)
        assert abs(dataset_returns_to_go(ds)[0] - ds.episode_returns[0]) <= 4 * np.finfo(np.float64).eps
    assert dataset_returns_to_go(ds)[0] == ds.episode_returns[0] == 9.0
