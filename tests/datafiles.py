"""Tiny data files written by tests (imported as ``tests.datafiles``)."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np


def write_cartpole_h5(path: Path, *, n: int = 30, seed: int = 0, reward: float = 1.0) -> Path:
    """CartPole-shaped D4RL file: episodes of 10 steps, every reward ``reward``."""
    rng = np.random.default_rng(seed)
    data = {
        "observations": (rng.normal(size=(n, 4)) * 0.05).astype(np.float32),
        "actions": rng.integers(0, 2, n).astype(np.int64),
        "rewards": np.full(n, reward, np.float32),
        "terminals": np.zeros(n, bool),
        "timeouts": np.zeros(n, bool),
    }
    data["terminals"][np.arange(9, n - 1, 10)] = True
    data["timeouts"][n - 1] = True
    with h5py.File(path, "w") as f:
        for k, v in data.items():
            f.create_dataset(k, data=v)
        f.attrs["env_id"] = "CartPole-v1"
    return path
