"""Pixel environments: Atari (ALE) with the field's standard preprocessing, and MinAtar.

Both give ``Box(0, 255, (C, H, W), uint8)`` observations, channels first, the layout every
pixel dataset and encoder of the package uses.

* **Atari** (``ALE/<Game>-v5`` or ``<Game>NoFrameskip-v4``; the ``atari`` extra: ``ale-py``,
  which ships the ROMs, and ``opencv-python-headless`` for the resize): the preprocessing of
  Mnih et al. 2015 as the Decision Transformer's Atari code uses it (Chen et al. 2021, ``atari/``,
  through Dopamine's ``AtariPreprocessing``): gymnasium's ``AtariPreprocessing`` (no-op starts
  up to 30, frame skip 4 with a max over the last two frames, grey scale, 84x84, no terminal on
  life loss) and ``FrameStackObservation(4)``, so the observation space is
  ``Box(0, 255, (4, 84, 84), uint8)``, oldest frame first. No sticky actions
  (``repeat_action_probability=0``, as the DT's evaluation); the base environment runs with
  ``frameskip=1`` (the skip is the wrapper's). The first observation of an episode is
  ``[0, 0, 0, f0]``: frames before the episode start are zeros (``padding_type="zero"``), as in
  Dopamine's replay buffer (the DQN-replay data the DT trained on) and in the DT's own
  evaluation environment, and as :func:`~rl_tformers.envs.frames.stack_frames` pads samples.
* **MinAtar** (Young and Tian 2019, ``MinAtar/<Game>-v1``, package ``minatar``, also in the
  ``atari`` extra): the 10x10 object maps, ``(10, 10, n)`` bool in MinAtar, given as
  ``(n, 10, 10)`` uint8 with values 0 and 255 (so an encoder's ``x / 255`` sees 0 and 1); no
  frame stack (MinAtar's state carries its own trails); sticky actions off
  (``sticky_action_prob=0``, MinAtar's default is 0.1) and a time limit of
  :data:`MINATAR_MAX_STEPS` steps unless given.

Reference scores (random and human per game) for normalised Atari scores are in
:mod:`rl_tformers.envs.scores` (``ATARI_REF_SCORES``).
"""

from __future__ import annotations

import re
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation
from rl_tformers.envs.extras import ATARI_INSTALL, MissingExtraError

#: frames per Atari observation (Mnih et al. 2015; the DT's Atari code)
ATARI_FRAME_STACK = 4
#: Atari frame side after the resize
ATARI_SCREEN = 84
#: at most this many no-op actions at reset (Mnih et al. 2015)
ATARI_NOOP_MAX = 30
#: environment frames per agent step
ATARI_FRAME_SKIP = 4
#: MinAtar's time limit in agent steps when none is given (MinAtar itself has none)
MINATAR_MAX_STEPS = 10_000

_ATARI_V4 = re.compile(r"^[A-Z][A-Za-z0-9]*NoFrameskip-v4$")


def is_atari_id(env_id: str) -> bool:
    """``ALE/<Game>-v5`` (any ``ALE/`` id) or ``<Game>NoFrameskip-v4``."""
    return str(env_id).startswith("ALE/") or bool(_ATARI_V4.match(str(env_id)))


def is_minatar_id(env_id: str) -> bool:
    """``MinAtar/<Game>-v0`` or ``-v1``."""
    return str(env_id).startswith("MinAtar/")


def is_pixel_id(env_id: str) -> bool:
    """An Atari or MinAtar id (:func:`is_atari_id`, :func:`is_minatar_id`)."""
    return is_atari_id(env_id) or is_minatar_id(env_id)


def _missing(env_id: str, exc: ImportError) -> MissingExtraError:
    return MissingExtraError(f"{env_id} needs the atari extra, which is not installed: {ATARI_INSTALL} "
                             f"({type(exc).__name__}: {exc})")


def register_pixel_id(env_id: str) -> None:
    """Register the ids of ``env_id``'s family with gymnasium: ``ale_py``'s (Atari) or MinAtar's.

    Raises:
        MissingExtraError: the package is not installed (the message names the extra).
    """
    if is_atari_id(env_id):
        try:
            import ale_py  # optional dependency (the atari extra): registers the ALE ids
            import cv2  # noqa: F401  (optional dependency: AtariPreprocessing's resize)
        except ImportError as exc:
            raise _missing(env_id, exc) from None
        if "ALE/Pong-v5" not in gym.registry:
            gym.register_envs(ale_py)
    elif is_minatar_id(env_id):
        try:
            from minatar import gym as minatar_gym  # optional dependency (the atari extra)
        except ImportError as exc:
            raise _missing(env_id, exc) from None
        if "MinAtar/Breakout-v1" not in gym.registry:
            minatar_gym.register_envs()


def make_atari(env_id: str, *, frame_stack: int = ATARI_FRAME_STACK, noop_max: int = ATARI_NOOP_MAX,
               repeat_action_probability: float = 0.0, **kwargs: Any) -> gym.Env:
    """An Atari game with the standard preprocessing (see the module): observations
    ``Box(0, 255, (frame_stack, 84, 84), uint8)``, oldest frame first, zeros before the episode's
    first frame.

    Args:
        env_id: ``ALE/<Game>-v5`` or ``<Game>NoFrameskip-v4``.
        frame_stack: frames per observation (4).
        noop_max: most no-op actions at reset (30).
        repeat_action_probability: sticky actions (0: none, the DT's evaluation).
        kwargs: passed to ``gym.make`` (``max_episode_steps``, ``full_action_space``, ...).

    Raises:
        MissingExtraError: ``ale-py`` or ``opencv-python-headless`` not installed.
    """
    register_pixel_id(env_id)
    env = gym.make(env_id, frameskip=1, repeat_action_probability=float(repeat_action_probability), **kwargs)
    env = AtariPreprocessing(env, noop_max=int(noop_max), frame_skip=ATARI_FRAME_SKIP, screen_size=ATARI_SCREEN,
                             grayscale_obs=True, terminal_on_life_loss=False, scale_obs=False)
    return FrameStackObservation(env, int(frame_stack), padding_type="zero")


class ChannelsFirstUint8(gym.ObservationWrapper, gym.utils.RecordConstructorArgs):
    """MinAtar's ``(H, W, C)`` bool object maps as ``(C, H, W)`` uint8 with values 0 and 255."""

    def __init__(self, env: gym.Env) -> None:
        gym.utils.RecordConstructorArgs.__init__(self)
        gym.ObservationWrapper.__init__(self, env)
        h, w, c = env.observation_space.shape
        self.observation_space = gym.spaces.Box(0, 255, (c, h, w), np.uint8)

    def observation(self, observation: np.ndarray) -> np.ndarray:
        """(H, W, C) bool -> (C, H, W) uint8 in {0, 255}."""
        return np.ascontiguousarray(np.moveaxis(np.asarray(observation, np.uint8), -1, 0)) * np.uint8(255)


def make_minatar(env_id: str, *, sticky_action_prob: float = 0.0, max_episode_steps: int | None = MINATAR_MAX_STEPS,
                 **kwargs: Any) -> gym.Env:
    """A MinAtar game, ``Box(0, 255, (C, 10, 10), uint8)`` observations (see the module).

    Raises:
        MissingExtraError: ``minatar`` not installed.
    """
    register_pixel_id(env_id)
    env = gym.make(env_id, sticky_action_prob=float(sticky_action_prob), max_episode_steps=max_episode_steps,
                   **kwargs)
    return ChannelsFirstUint8(env)


def make_pixel_env(env_id: str, **kwargs: Any) -> gym.Env:
    """:func:`make_atari` or :func:`make_minatar` by the id's family.

    Raises:
        ValueError: ``env_id`` is neither (:func:`is_pixel_id`).
    """
    if is_atari_id(env_id):
        return make_atari(env_id, **kwargs)
    if is_minatar_id(env_id):
        return make_minatar(env_id, **kwargs)
    raise ValueError(f"{env_id!r} is not an Atari (ALE/..., ...NoFrameskip-v4) or MinAtar (MinAtar/...) id")


def frame_stack_of(env: gym.Env) -> int:
    """Frames per observation of ``env``: the ``stack_size`` of its ``FrameStackObservation``
    (the outermost one), 1 when it has none."""
    e = env
    while isinstance(e, gym.Wrapper):
        if isinstance(e, FrameStackObservation):
            return int(e.stack_size)
        e = e.env
    return 1
