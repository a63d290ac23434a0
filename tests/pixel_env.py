"""A tiny pixel task for the tests of the image encoders (imported as ``tests.pixel_env``).

``PixelSide-v0``: each step shows a bright bar on the left or the right half of a 36 x 36 grey
frame; the observation stacks the last 2 frames on the channel axis, ``Box(0, 255, (2, 36, 36),
uint8)`` (channels first, as gymnasium's ``FrameStackObservation`` over ``AtariPreprocessing``
frames after moving the stack axis first), zeros before the episode's first frame. Action 1 on a
right bar or 0 on a left bar earns reward 1; episodes last 8 steps (a time limit). 36 x 36 is the
smallest frame the Nature CNN takes.

Registered on import; ``gym.make("tests.pixel_env:PixelSide-v0")`` imports this module first.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

ENV_ID = "PixelSide-v0"
#: the id that makes gymnasium import this module first
FULL_ID = f"tests.pixel_env:{ENV_ID}"
SIZE = 36
STACK = 2
EPISODE_STEPS = 8


def frame(side: int) -> np.ndarray:
    """(36, 36) uint8 frame with a 255 bar on the left (side 0) or right (side 1) half."""
    f = np.full((SIZE, SIZE), 20, np.uint8)
    cols = slice(4, 12) if side == 0 else slice(SIZE - 12, SIZE - 4)
    f[8:28, cols] = 255
    return f


class PixelSide(gym.Env):
    """See the module docstring."""

    def __init__(self) -> None:
        self.observation_space = gym.spaces.Box(0, 255, (STACK, SIZE, SIZE), np.uint8)
        self.action_space = gym.spaces.Discrete(2)
        self.side = 0
        self.stack = np.zeros((STACK, SIZE, SIZE), np.uint8)

    def _push(self) -> np.ndarray:
        self.stack = np.concatenate([self.stack[1:], frame(self.side)[None]], axis=0)  # oldest first
        return self.stack.copy()

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.side = int(self.np_random.integers(2))
        self.stack = np.zeros((STACK, SIZE, SIZE), np.uint8)
        return self._push(), {}

    def step(self, action):
        reward = float(int(action) == self.side)
        self.side = int(self.np_random.integers(2))
        return self._push(), reward, False, False, {}


def pixel_dataset_arrays(episodes: int = 6, seed: int = 0) -> dict[str, np.ndarray]:
    """D4RL-layout arrays of ``episodes`` episodes of PixelSide (8 steps each, the last a timeout),
    acting right 3 times in 4: observations (N, 2, 36, 36) uint8, actions (N,) int64, rewards,
    terminals, timeouts."""
    env = PixelSide()
    rng = np.random.default_rng(seed)
    obs, act, rew = [], [], []
    for e in range(episodes):
        o, _ = env.reset(seed=seed * 1000 + e)
        for _ in range(EPISODE_STEPS):
            a = env.side if rng.random() < 0.75 else 1 - env.side
            obs.append(o)
            act.append(a)
            o, r, *_ = env.step(a)
            rew.append(r)
    n = len(act)
    timeouts = np.zeros(n, bool)
    timeouts[EPISODE_STEPS - 1::EPISODE_STEPS] = True
    return {"observations": np.stack(obs).astype(np.uint8), "actions": np.asarray(act, np.int64),
            "rewards": np.asarray(rew, np.float32), "terminals": np.zeros(n, bool), "timeouts": timeouts}


gym.register(ENV_ID, entry_point=PixelSide, max_episode_steps=EPISODE_STEPS)
