"""Window (DT) and segment (GTrXL) samplers: masks, padding, content, probabilities."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from rl_tformers.envs.dataset import DatasetError, EpisodeDataset
from rl_tformers.envs.samplers import SegmentSampler, WindowSampler
from rl_tformers.envs.trajectory import observation_stats

BOX2 = gym.spaces.Box(-1e4, 1e4, shape=(2,), dtype=np.float32)


def make(terminals, rewards=None, discrete=False):
    n = len(terminals)
    obs = np.stack([np.arange(n), -np.arange(n)], axis=1).astype(np.float32)  # obs[i] = (i, -i)
    if discrete:
        act, space = np.arange(n) % 3, gym.spaces.Discrete(3)
    else:
        act, space = np.stack([np.arange(n), np.arange(n)], axis=1).astype(np.float32), BOX2
    rew = np.arange(1, n + 1, dtype=float) if rewards is None else np.asarray(rewards, float)
    return EpisodeDataset.from_flags(obs, act, rew, terminals, action_space=space)


def test_windows_of_short_episodes_are_whole_episodes_with_k20():
    ds = make([0, 1, 1, 0, 0, 1])  # lengths 2, 1, 3
    sampler = WindowSampler(ds, context_len=20)
    b = sampler.sample(64, np.random.default_rng(0))
    assert b["observations"].shape == (64, 20, 2) and b["mask"].shape == (64, 20)
    sums = b["mask"].sum(axis=1)
    assert set(np.unique(b["episode"]).tolist()) == {0, 1, 2}
    assert (sums == ds.lengths[b["episode"]]).all()
    assert {int(s) for s in sums} == {2, 1, 3}
    row = int(np.flatnonzero(b["episode"] == 2)[0])  # episode 2 = steps 3, 4, 5
    # start-aligned: real steps from slot 0, padding on the right (the evaluation context's layout)
    assert b["mask"][row].tolist() == [True] * 3 + [False] * 17
    assert b["observations"][row, :3, 0].tolist() == [3.0, 4.0, 5.0]
    assert b["timesteps"][row, :3].tolist() == [0, 1, 2]
    assert b["returns_to_go"][row, :3].tolist() == [15.0, 11.0, 6.0]  # rewards 4, 5, 6
    assert b["rewards"][row, :3].tolist() == [4.0, 5.0, 6.0]
    assert (b["observations"][row, 3:] == 0).all() and (b["timesteps"][row, 3:] == 0).all()


def test_start_aligned_windows_are_contiguous_and_inside_their_episode():
    term = np.zeros(300)
    term[[49, 199, 299]] = 1  # lengths 50, 150, 100
    ds = make(term)
    b = WindowSampler(ds, context_len=20).sample(256, np.random.default_rng(1))
    assert b["mask"].all()  # every episode is longer than K
    first = b["observations"][:, 0, 0].astype(int)
    np.testing.assert_array_equal(b["observations"][:, :, 0], first[:, None] + np.arange(20))
    start = ds.starts[b["episode"]]
    assert ((first >= start) & (first + 20 <= start + ds.lengths[b["episode"]])).all()
    np.testing.assert_array_equal(b["timesteps"], (first - start)[:, None] + np.arange(20))
    np.testing.assert_array_equal(b["actions"][:, :, 1], b["observations"][:, :, 0])


def test_episodes_are_drawn_proportionally_to_length():
    term = np.zeros(1000)
    term[[99, 999]] = 1  # lengths 100 and 900
    ds = make(term)
    b = WindowSampler(ds, context_len=5).sample(20000, np.random.default_rng(2))
    share = float((b["episode"] == 1).mean())
    assert abs(share - 0.9) < 0.01


def test_end_aligned_windows_end_uniformly_over_steps():
    ds = make([0, 0, 0, 0, 1, 0, 1])  # lengths 5, 2
    b = WindowSampler(ds, context_len=3, align="end").sample(4000, np.random.default_rng(3))
    last = b["observations"][:, -1, 0].astype(int)  # every window ends with a real step
    assert b["mask"][:, -1].all()
    counts = np.bincount(last, minlength=7) / last.size
    np.testing.assert_allclose(counts, np.full(7, 1 / 7), atol=0.02)
    early = last == 0  # window ending at the episode's first step holds one step
    assert (b["mask"][early].sum(axis=1) == 1).all()
    mid = last == 3
    assert (b["observations"][mid][:, :, 0] == [1, 2, 3]).all()


def test_reward_scale_and_obs_stats_are_applied():
    ds = make([0, 1, 1, 0, 0, 1])
    stats = observation_stats(ds)
    b = WindowSampler(ds, 4, reward_scale=10.0, obs_stats=stats).sample(8, np.random.default_rng(0))
    row = int(np.flatnonzero(b["episode"] == 0)[0])
    assert b["returns_to_go"][row, :2].tolist() == pytest.approx([0.3, 0.2])
    np.testing.assert_allclose(b["observations"][row, :2], stats.normalize(np.array([[0, 0], [1, -1]])), rtol=1e-6)
    assert (b["observations"][row, 2:] == 0).all()  # padding stays zero after normalisation


def test_discrete_actions_are_int64():
    ds = make([0, 1, 1, 0, 0, 1], discrete=True)
    b = WindowSampler(ds, 4).sample(8, np.random.default_rng(0))
    assert b["actions"].dtype == np.int64 and b["actions"].shape == (8, 4)


def test_window_sampler_refuses_episodes_longer_than_max_ep_len():
    with pytest.raises(DatasetError, match="max_ep_len=2"):
        WindowSampler(make([0, 1, 1, 0, 0, 1]), 4, max_ep_len=2)


def test_same_generator_seed_gives_same_batch():
    ds = make(np.r_[np.zeros(49), 1, np.zeros(29), 1])
    s = WindowSampler(ds, 8)
    a, b = s.sample(16, np.random.default_rng([5, 3])), s.sample(16, np.random.default_rng([5, 3]))
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_segments_cross_episode_boundaries_with_start_flags_and_end_padding():
    ds = make([0, 1, 1, 0, 0, 1])  # lengths 2, 1, 3 ; steps 0..5
    sampler = SegmentSampler(ds, seq_len=3, burn_in=1)
    b = sampler.sample(200, np.random.default_rng(0))
    assert b["observations"].shape == (200, 4, 2)
    first = b["observations"][:, 0, 0].astype(int)
    for row in range(200):
        v = first[row] + np.arange(4)
        real = v < 6
        assert b["mask"][row].tolist() == real.tolist()
        assert b["observations"][row, real, 0].tolist() == v[real].tolist()
        assert b["episode_start"][row].tolist() == [bool(r and x in (0, 2, 3)) for r, x in zip(real, v)]
        assert b["terminations"][row].tolist() == [bool(r and x in (1, 2, 5)) for r, x in zip(real, v)]
    assert b["loss_mask"][:, 0].sum() == 0
    assert (b["loss_mask"][:, 1:] == b["mask"][:, 1:]).all()
    assert set(first.tolist()) == set(range(6))
    row = int(np.flatnonzero(first == 1)[0])  # steps 1, 2, 3, 4: episodes 0, 1, 2, 2
    assert b["episode"][row].tolist() == [0, 1, 2, 2]
    assert b["timesteps"][row].tolist() == [1, 0, 0, 1]
    assert b["returns_to_go"][row].tolist() == [2.0, 3.0, 15.0, 11.0]
    row = int(np.flatnonzero(first == 4)[0])  # steps 4, 5, pad, pad
    assert b["episode"][row].tolist() == [2, 2, -1, -1] and b["rewards"][row].tolist() == [5.0, 6.0, 0.0, 0.0]


def test_segments_follow_episode_table_order_of_a_selection():
    ds = make([0, 1, 1, 0, 0, 1]).select([2, 0])  # steps 3,4,5 then 0,1
    b = SegmentSampler(ds, seq_len=5).sample(50, np.random.default_rng(0))
    full = b["observations"][b["mask"].all(axis=1)][:, :, 0]
    assert full.shape[0] > 0 and (full == [3, 4, 5, 0, 1]).all()
