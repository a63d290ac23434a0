"""Tiny continuous-action offline data shared by the Online DT tests (imported as ``tests.pendulum``)."""
from __future__ import annotations

import gymnasium as gym
import numpy as np
from rl_tformers.envs.dataset import DatasetMetadata, EpisodeDataset


def random_pendulum_dataset(lengths: list[int], seed: int = 0) -> EpisodeDataset:
    """Random-action Pendulum-v1 episodes of the given lengths (steps), each truncated at its
    end; episode i resets with seed i, actions uniform in [-2, 2] from ``default_rng(seed)``."""
    rng = np.random.default_rng(seed)
    env = gym.make("Pendulum-v1")
    eps = []
    for i, n in enumerate(lengths):
        obs = [env.reset(seed=i)[0]]
        act = rng.uniform(-2, 2, (n, 1)).astype(np.float32)
        rew = []
        for a in act:
            o, r, *_ = env.step(a)
            obs.append(o)
            rew.append(r)
        eps.append({"observations": np.stack(obs), "actions": act, "rewards": np.array(rew),
                    "terminations": np.zeros(n, bool), "truncations": np.eye(1, n, n - 1, dtype=bool)[0]})
    return EpisodeDataset.from_episodes(eps, observation_space=env.observation_space, action_space=env.action_space,
                                        metadata=DatasetMetadata(env_id="Pendulum-v1"))
