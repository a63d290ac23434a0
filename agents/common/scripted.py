"""A scripted CartPole-v1 controller and the small offline dataset the quick-start demo trains on.

The demo must run on a fresh machine without pretrained policies, so its dataset is built on
the spot by this module (about two seconds on one core):

- :func:`cartpole_expert`: a linear state-feedback controller (push right when
  ``0.1 x + 0.5 x' + 10 theta + 2 theta' > 0``). It balances every episode to the 500-step
  time limit.
- :func:`collect_delayed_expert`: each episode balances with the expert until a switch step
  ``T ~ U{0..499}``, then always pushes left, and the pole falls about ten steps later; with
  probability ``epsilon`` any action is replaced by a random one. The return is the episode
  length, ``T`` plus about ten (correlation 0.9999), so the dataset covers returns from about
  10 to 500 evenly: a return-conditioned agent should balance for as many steps as it is asked
  to, the cleanest possible picture of return conditioning (achieved return on the y = x line).
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
from rl_tformers.envs.dataset import DatasetMetadata, EpisodeDataset

CARTPOLE_ID = "CartPole-v1"
MAX_STEPS = 500


def cartpole_expert(obs: np.ndarray) -> np.ndarray:
    """Balancing action for CartPole-v1.

    Args:
        obs: (N, 4) observations ``[x, x', theta, theta']`` (theta = 0 upright, radians).
    Returns:
        (N,) int64 actions: 1 = push right, 0 = push left.
    """
    u = 0.1 * obs[:, 0] + 0.5 * obs[:, 1] + 10.0 * obs[:, 2] + 2.0 * obs[:, 3]
    return (u > 0).astype(np.int64)


def collect_delayed_expert(n_episodes: int = 300, seed: int = 0, epsilon: float = 0.05, n_envs: int = 50) -> EpisodeDataset:
    """Collect ``n_episodes`` CartPole-v1 episodes: expert until a random switch step, then push left.

    Args:
        n_episodes: number of episodes.
        seed: seeds the switch steps, the random actions and the resets (episode j: seed + j).
        epsilon: probability of replacing an action by a uniformly random one.
        n_envs: parallel environments used for collection.

    Returns:
        A validated :class:`EpisodeDataset` (Minari layout: final observations kept), metadata
        ``env_id="CartPole-v1"``, collection settings in ``extra``.
    """
    rng = np.random.default_rng(seed)
    envs = gym.vector.SyncVectorEnv(
        [lambda: gym.make(CARTPOLE_ID) for _ in range(n_envs)], autoreset_mode=gym.vector.AutoresetMode.DISABLED
    )
    episodes: list[dict] = []
    try:
        for b in range(-(-n_episodes // n_envs)):
            obs, _ = envs.reset(seed=[seed + b * n_envs + i for i in range(n_envs)])
            switch = rng.integers(0, MAX_STEPS, n_envs)
            length = np.zeros(n_envs, np.int64)
            done = np.zeros(n_envs, bool)
            o, a, r, term, trunc = [obs], [], [], [], []
            for t in range(MAX_STEPS):
                act = np.where(t >= switch, 0, cartpole_expert(obs))
                act = np.where(rng.uniform(size=n_envs) < epsilon, rng.integers(0, 2, n_envs), act)
                obs, rew, te, tr, _ = envs.step(act)
                o.append(obs)
                a.append(act)
                r.append(rew)
                term.append(te)
                trunc.append(tr)
                length += ~done
                done |= te | tr
                if done.all():
                    break
                if (te | tr).any():  # finished rows keep stepping (ignored) from a fresh state
                    envs.reset(options={"reset_mask": te | tr})
            obs_b, act_b, rew_b = np.stack(o, 1), np.stack(a, 1), np.stack(r, 1)  # (N, L+1, 4), (N, L), (N, L)
            term_b, trunc_b = np.stack(term, 1), np.stack(trunc, 1)  # (N, L)
            for i in range(n_envs):  # per collected episode, not per step
                n = int(length[i])
                episodes.append({"observations": obs_b[i, : n + 1], "actions": act_b[i, :n], "rewards": rew_b[i, :n],
                                 "terminations": term_b[i, :n], "truncations": trunc_b[i, :n]})
    finally:
        envs.close()
    env = gym.make(CARTPOLE_ID)
    meta = DatasetMetadata(
        env_id=CARTPOLE_ID, source="memory", dataset_id="rlt/cartpole-v1/delayed-expert-v0",
        extra={"collector": "rl_tformers.agents.common.scripted.collect_delayed_expert",
               "seed": seed, "epsilon": epsilon, "episodes": n_episodes},
    )
    ds = EpisodeDataset.from_episodes(episodes[:n_episodes], observation_space=env.observation_space,
                                      action_space=env.action_space, metadata=meta)
    env.close()
    return ds
