"""A scripted Pendulum-v1 controller and the small offline dataset the quick-start demo trains on.

The demo must run on a fresh machine without pretrained policies, so its dataset is built on
the spot by this module (about a second on one core):

- :func:`pendulum_expert`: energy-pumping swing-up (raise the pendulum's energy until it reaches
  the upright level, Astrom & Furuta 2000) and a PD controller near the top. Deterministic
  return about -140 on Pendulum-v1 (a strong policy; random actions score about -1200).
- :func:`collect_delayed_expert`: each episode first waits ``D ~ U{0..200}`` steps (zero torque
  plus small Gaussian noise: the pendulum swings passively), then hands over to the expert with
  Gaussian action noise. The delay sets the return (correlation about -0.8), so the dataset
  covers returns from about -1700 to -120: the spread the Decision Transformer needs to learn
  return conditioning (high target: swing up at once; low target: wait). Waiting with a
  near-deterministic action (rather than uniform random torques, whose mean a regression
  policy would reproduce as "no torque" with different returns) keeps every behaviour in the
  data reproducible by a deterministic policy.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
from rl_tformers.envs.dataset import DatasetMetadata, EpisodeDataset

PENDULUM_ID = "Pendulum-v1"


def pendulum_expert(obs: np.ndarray) -> np.ndarray:
    """Swing-up + balance torque for Pendulum-v1.

    Args:
        obs: (N, 3) observations ``[cos(theta), sin(theta), theta_dot]``, theta = 0 upright.
    Returns:
        (N, 1) float32 torque in [-2, 2].

    Dynamics of Pendulum-v1 (g=10, m=l=1): theta'' = 15 sin(theta) + 3 u, so the energy
    E = theta_dot^2 / 2 + 15 (cos(theta) - 1) (zero upright at rest) changes as dE/dt = 3 u theta_dot:
    pushing along theta_dot with a gain on -E pumps energy up to the upright level.
    """
    c, s, w = obs[:, 0], obs[:, 1], obs[:, 2]
    theta = np.arctan2(s, c)
    energy = 0.5 * w**2 + 15.0 * (c - 1.0)
    swing = np.where(np.abs(w) < 1e-3, 2.0, 0.6 * np.sign(w) * (-energy))
    balance = -(12.0 * theta + 2.5 * w)
    u = np.where(c > 0.85, balance, swing)
    return np.clip(u, -2.0, 2.0).astype(np.float32)[:, None]


def collect_delayed_expert(
    n_episodes: int = 300, seed: int = 0, noise: float = 0.1, wait_noise: float = 0.1, n_envs: int = 50
) -> EpisodeDataset:
    """Collect ``n_episodes`` Pendulum-v1 episodes of 200 steps (wait for D steps, then expert).

    Args:
        n_episodes: number of episodes (the last batch of ``n_envs`` is cut to fit).
        seed: seeds the delays, the noise and the environment resets (episode j: seed + j).
        noise: std of the Gaussian noise added to the expert's torque (units of torque, max 2).
        wait_noise: std of the torque while waiting (mean 0).
        n_envs: parallel environments used for collection.

    Returns:
        A validated :class:`EpisodeDataset` (Minari layout: final observations kept), metadata
        ``env_id="Pendulum-v1"``, ``source="memory"``, collection settings in ``extra``.
    """
    rng = np.random.default_rng(seed)
    n_batches = -(-n_episodes // n_envs)
    envs = gym.vector.SyncVectorEnv([lambda: gym.make(PENDULUM_ID) for _ in range(n_envs)])
    episodes: list[dict] = []
    try:
        for b in range(n_batches):
            obs, _ = envs.reset(seed=[seed + b * n_envs + i for i in range(n_envs)])
            delay = rng.integers(0, 201, n_envs)
            o, a, r, term, trunc = [obs], [], [], [], []
            for t in range(200):
                act = np.where(
                    (t < delay)[:, None],
                    wait_noise * rng.standard_normal((n_envs, 1)),
                    pendulum_expert(obs) + noise * rng.standard_normal((n_envs, 1)),
                )
                act = np.clip(act, -2.0, 2.0).astype(np.float32)
                obs, rew, te, tr, _ = envs.step(act)
                o.append(obs)
                a.append(act)
                r.append(rew)
                term.append(te)
                trunc.append(tr)
                if (te | tr).all():
                    break
            obs_b, act_b, rew_b = np.stack(o, 1), np.stack(a, 1), np.stack(r, 1)  # (N, L+1, 3), (N, L, 1), (N, L)
            term_b, trunc_b = np.stack(term, 1), np.stack(trunc, 1)  # (N, L)
            for i in range(n_envs):
                episodes.append({"observations": obs_b[i], "actions": act_b[i], "rewards": rew_b[i],
                                 "terminations": term_b[i], "truncations": trunc_b[i]})
    finally:
        envs.close()
    env = gym.make(PENDULUM_ID)
    meta = DatasetMetadata(
        env_id=PENDULUM_ID, source="memory", dataset_id="rlt/pendulum-v1/delayed-expert-v0",
        extra={"collector": "rl_tformers.agents.common.scripted.collect_delayed_expert",
               "seed": seed, "noise": noise, "wait_noise": wait_noise, "episodes": n_episodes},
    )
    ds = EpisodeDataset.from_episodes(
        episodes[:n_episodes],
        observation_space=env.observation_space, action_space=env.action_space, metadata=meta,
    )
    env.close()
    return ds
