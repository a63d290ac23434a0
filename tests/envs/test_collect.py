"""Collecting datasets: round trip from a shared policy, determinism, POMDP masks, noise, training replay."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from rl_tformers.envs.collect import Behaviour, collect, train_and_record
from rl_tformers.envs.loaders import load_d4rl_hdf5, load_minari
from rl_tformers.envs.policies import NoisyPolicy, RandomPolicy, detect_algorithm, load_sb3_policy
from rl_tformers.envs.pomdp import ObservationMaskWrapper, make_env, pomdp_record, position_indices


class Recorder:
    """Wraps a policy and keeps every observation it saw and action it returned."""

    def __init__(self, policy):
        self.policy, self.obs, self.actions = policy, [], []

    def reset(self):
        self.policy.reset()

    def __call__(self, obs):
        a = self.policy(obs)
        self.obs.append(np.array(obs))
        self.actions.append(np.array(a))
        return a


def test_two_episodes_of_a_shared_policy_round_trip_exactly(shared_dir, tmp_path):
    env = gym.make("Hopper-v5")
    rec = Recorder(load_sb3_policy(shared_dir / "policies/sac/Hopper-v3/model.zip", env))
    res = collect("Hopper-v5", [Behaviour(rec, episodes=2)], dataset_id="t/hopper/sac-v0", root=tmp_path, seed=3,
                  hdf5=tmp_path / "sac.hdf5", progress=False)
    assert res.num_episodes == 2 and res.episode_returns.min() > 900  # the SAC agent scores ~1100
    for ds in (load_minari("t/hopper/sac-v0", root=tmp_path), load_d4rl_hdf5(tmp_path / "sac.hdf5")):
        assert ds.lengths.tolist() == res.episode_lengths.tolist()
        np.testing.assert_array_equal(ds.observations, np.stack(rec.obs))
        np.testing.assert_array_equal(ds.actions, np.stack(rec.actions))
        assert ds.episode_returns.tolist() == res.episode_returns.tolist()
        assert ds.metadata.env_id == "Hopper-v5"
        assert (ds.metadata.ref_min_score, ds.metadata.ref_max_score) == (-20.272305, 3234.3)
        ends = ds.starts + ds.lengths - 1
        assert (ds.terminations[ends] | ds.truncations[ends]).all()


def test_detect_algorithm_of_shared_policies(shared_dir):
    got = {a: detect_algorithm(shared_dir / f"policies/{a}/Hopper-v3/model.zip") for a in ("sac", "ars", "ppo", "a2c")}
    assert got == {"sac": "sac", "ars": "ars", "ppo": "ppo", "a2c": "a2c"}


def random_run(root, dataset_id, seed, pomdp=None, episodes=3):
    env = gym.make("Hopper-v5")
    return collect("Hopper-v5", [Behaviour(RandomPolicy(env.action_space, seed=seed), episodes=episodes)],
                   dataset_id=dataset_id, root=root, seed=seed, pomdp=pomdp, progress=False)


def test_collection_is_deterministic_for_a_seed(tmp_path):
    random_run(tmp_path, "t/a/r-v0", seed=5)
    random_run(tmp_path, "t/b/r-v0", seed=5)
    random_run(tmp_path, "t/c/r-v0", seed=6)
    a, b, c = (load_minari(f"t/{x}/r-v0", root=tmp_path) for x in "abc")
    np.testing.assert_array_equal(a.observations, b.observations)
    np.testing.assert_array_equal(a.actions, b.actions)
    np.testing.assert_array_equal(a.rewards, b.rewards)
    assert a.observations.shape != c.observations.shape or not np.array_equal(a.observations, c.observations)


def test_existing_dataset_needs_overwrite(tmp_path):
    random_run(tmp_path, "t/x/r-v0", seed=0, episodes=1)
    with pytest.raises(FileExistsError, match="overwrite"):
        random_run(tmp_path, "t/x/r-v0", seed=0, episodes=1)


def test_position_only_dataset_has_the_same_episodes_without_velocities(tmp_path):
    assert position_indices("Hopper-v5") == [0, 1, 2, 3, 4]
    assert position_indices("Walker2d-v5") == list(range(8))
    assert position_indices("HalfCheetah-v5") == list(range(8))
    env = gym.make("Hopper-v5")
    record = pomdp_record(env, "positions")
    full = random_run(tmp_path, "t/full/r-v0", seed=2)
    part = random_run(tmp_path, "t/pos/r-v0", seed=2, pomdp=record)
    assert full.episode_returns.tolist() == part.episode_returns.tolist()
    f, p = load_minari("t/full/r-v0", root=tmp_path), load_minari("t/pos/r-v0", root=tmp_path)
    assert p.observation_shape == (5,) and p.metadata.pomdp == {"kind": "positions", "indices": [0, 1, 2, 3, 4],
                                                                "source_shape": [11]}
    np.testing.assert_array_equal(p.observations, f.observations[:, :5])
    np.testing.assert_array_equal(p.final_observations, f.final_observations[:, :5])
    ev = make_env("Hopper-v5", p.metadata.pomdp)
    assert ev.observation_space.shape == (5,)
    import minari

    recovered = minari.MinariDataset(tmp_path / "t/pos/r-v0/data").recover_environment(eval_env=True)
    assert isinstance(recovered, ObservationMaskWrapper) and recovered.observation_space.shape == (5,)


def test_generic_observation_mask():
    env = ObservationMaskWrapper(gym.make("Hopper-v5"), [0, 10])
    obs, _ = env.reset(seed=0)
    full, _ = gym.make("Hopper-v5").reset(seed=0)
    np.testing.assert_array_equal(obs, full[[0, 10]])
    with pytest.raises(ValueError, match="outside"):
        ObservationMaskWrapper(gym.make("Hopper-v5"), [11])
    with pytest.raises(ValueError, match="not a MuJoCo environment"):
        position_indices("CartPole-v1")


def test_noise_is_clipped_and_epsilon_one_is_random():
    space = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)

    class Const:
        def reset(self):
            pass

        def __call__(self, obs):
            return np.full(3, 0.9, np.float32)

    noisy = NoisyPolicy(Const(), space, noise_std=1.0, seed=0)
    acts = np.stack([noisy(None) for _ in range(500)])
    assert acts.max() == 1.0 and acts.min() >= -1.0 and (acts == 1.0).mean() > 0.3
    eps = NoisyPolicy(Const(), space, epsilon=1.0, seed=0)
    acts = np.stack([eps(None) for _ in range(200)])
    assert not np.isclose(acts, 0.9).any() and acts.min() < -0.5
    with pytest.raises(ValueError, match="--noise needs a Box"):
        NoisyPolicy(Const(), gym.spaces.Discrete(2), noise_std=0.1)


def test_training_replay_dataset_is_the_sac_replay_buffer(tmp_path):
    policy, replay = train_and_record("sac", "Hopper-v5", 110, seed=0, replay_dataset_id="t/hopper/replay-v0",
                                      root=tmp_path, progress=False)
    rb = policy.model.replay_buffer
    ds = load_minari("t/hopper/replay-v0", root=tmp_path)
    assert ds.num_steps == rb.pos == 110
    np.testing.assert_array_equal(ds.actions, rb.actions[:110, 0])
    np.testing.assert_allclose(ds.observations, rb.observations[:110, 0], rtol=0, atol=0)
    np.testing.assert_array_equal(ds.rewards.astype(np.float32), rb.rewards[:110, 0])
    ends = ds.starts + ds.lengths - 1
    np.testing.assert_array_equal(ds.terminations[ends], rb.dones[:110, 0][ends].astype(bool) & ~rb.timeouts[:110, 0][ends].astype(bool))
    assert replay.num_steps == 110
