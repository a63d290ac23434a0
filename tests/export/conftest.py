"""Tiny trained runs of every exportable agent family (session-wide: the tests only read them).

Each trains for a few dozen updates on a tiny dataset, on CPU, in seconds: a DT with
``Discrete(3, start=1)`` actions, a DT and BC on Pendulum-shaped data (a Box(-2, 2) action), an
offline GTrXL on the recall memory task (Transformer-XL memory of 4 slots) and a PPO-GTrXL on
CartPole.
"""

from __future__ import annotations

from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from rl_tformers.envs.dataset import DatasetMetadata, EpisodeDataset
from rl_tformers.envs.loaders import save_d4rl_hdf5
from rl_tformers.envs.memory_tasks import scripted_dataset

from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.trainer import train
from tests.datafiles import write_d4rl_h5

SHIFTED = "rl_tformers_test/ShiftedChoice-v0"
EPISODE = 60  # steps of a ShiftedChoice episode


class ShiftedChoiceEnv(gym.Env):
    """Box(4) observations, ``Discrete(3, start=1)`` actions (asserted); reward 1 when the action
    is 1 + the index of the largest of the first three observation entries; 60 steps."""

    def __init__(self) -> None:
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)
        self.action_space = gym.spaces.Discrete(3, start=1)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def _obs(self) -> np.ndarray:
        return self.np_random.normal(size=4).astype(np.float32)

    def step(self, action):
        assert self.action_space.contains(action), action
        self.t += 1
        obs = self._obs()
        return obs, float(int(action) == 1 + int(np.argmax(obs[:3]))), False, self.t >= EPISODE, {}


if SHIFTED not in gym.registry:
    gym.register(SHIFTED, entry_point=ShiftedChoiceEnv)  # the class itself: conftest modules share one name

TINY = ["backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=2", "train.progress=false",
        "eval.every=0", "eval.at_end=false", "device=cpu"]
DT = ["agent.kind=dt", "agent.context_len=4", "train.steps=30", "train.batch_size=8", "train.warmup_steps=1",
      "backbone.dropout=0.0", *TINY]


def _shifted_h5(path: Path) -> Path:
    """Four 60-step ShiftedChoice episodes of random actions."""
    rng = np.random.default_rng(0)
    eps = [{"observations": rng.normal(size=(EPISODE + 1, 4)).astype(np.float32),
            "actions": rng.integers(1, 4, EPISODE), "rewards": rng.integers(0, 2, EPISODE).astype(float),
            "terminations": np.zeros(EPISODE, bool), "truncations": np.r_[np.zeros(EPISODE - 1, bool), True]}
           for _ in range(4)]
    ds = EpisodeDataset.from_episodes(eps, observation_space=gym.spaces.Box(-np.inf, np.inf, (4,), np.float32),
                                      action_space=gym.spaces.Discrete(3, start=1),
                                      metadata=DatasetMetadata(env_id=SHIFTED))
    return save_d4rl_hdf5(ds, path)


@pytest.fixture(scope="session")
def export_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``{name: run_dir}``: ``dt_discrete``, ``dt_pendulum``, ``bc_pendulum``, ``gtrxl_recall``, ``ppo_cartpole``."""
    root = tmp_path_factory.mktemp("export_runs")
    shifted = _shifted_h5(root / "shifted.hdf5")
    pendulum = write_d4rl_h5(root / "pendulum.hdf5", obs_dim=3, env_id="Pendulum-v1", discrete=False)
    recall = save_d4rl_hdf5(scripted_dataset("recall", 30, delay=2, seed=0), root / "recall.hdf5")
    gtrxl_tiny = ["backbone.memory.mem_len=4", "train.steps=30", "train.batch_size=4", "train.warmup_steps=1", *TINY]
    overrides = {
        "dt_discrete": [f"dataset.path={shifted}", *DT],
        "dt_pendulum": [f"dataset.path={pendulum}", "agent.max_ep_len=200", *DT],
        "bc_pendulum": ["agent.kind=bc", f"dataset.path={pendulum}", "agent.hidden=[16]", "train.steps=30",
                        "train.batch_size=8", "train.warmup_steps=1", "train.progress=false", "eval.every=0",
                        "eval.at_end=false", "device=cpu"],
        "gtrxl_recall": ["agent.kind=gtrxl", "agent.seq_len=4", "agent.burn_in=2", "agent.prev_action=true",
                         f"dataset.path={recall}", *gtrxl_tiny],
        "ppo_cartpole": ["agent.kind=gtrxl_ppo", "agent.env_id=CartPole-v1", "agent.n_envs=2", "agent.n_steps=8",
                         "agent.n_epochs=1", "agent.n_minibatches=2", "backbone.memory.mem_len=4", "train.steps=8",
                         *TINY],
    }
    out = {}
    for name, ov in overrides.items():
        train(compose(overrides=ov), root / name)
        out[name] = root / name
    return out
