"""Environments as the agents see them: ids resolved (POPGym's included) and spaces encoded.

Every agent acts on a flat float observation vector (or a ``(C, H, W)`` uint8 image of a pixel
task) and on a Box or a single Discrete action. :func:`make_task` builds any registered gymnasium
id that way, without per-task code:

* Atari (``ALE/Breakout-v5``, ``BreakoutNoFrameskip-v4``) and MinAtar (``MinAtar/Breakout-v1``)
  ids with the ``atari`` extra (``pip install 'rl-tformers[atari]'``), preprocessed as the field
  does (:mod:`rl_tformers.envs.pixels`); refused with :class:`MissingExtraError` without it.

* :func:`register_env_id`: POPGym's tasks (Morad et al., ICLR 2023, package ``popgym``, the
  ``popgym`` extra: ``pip install 'rl-tformers[popgym]'``) register their ids
  (``popgym-RepeatPreviousEasy-v0``, ...) when ``popgym`` is imported; an id starting with
  ``popgym-`` imports it first, and is refused with :class:`MissingExtraError` without it.
* :class:`OneHotObservation`: a Discrete, MultiDiscrete, MultiBinary, Tuple or Dict observation
  as one float32 vector, by ``gymnasium.spaces.flatten``: one-hot per Discrete component
  (``Discrete(4)`` value 2 -> ``[0, 0, 1, 0]``), the concatenated one-hots of a MultiDiscrete
  (``MultiDiscrete([2, 2])`` value ``[1, 0]`` -> ``[0, 1, 1, 0]``), Box values as they are, the
  components of a Tuple or Dict concatenated in order. The same flattening as the data layer's
  ``flatten_observations``, so offline data and the environment agree.
* :class:`FlatDiscreteAction`: a MultiDiscrete action space as one ``Discrete(prod(nvec))``
  (index k -> ``numpy.unravel_index(k, nvec) + start``, C order).
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from rl_tformers.envs.extras import ATARI_INSTALL, POPGYM_INSTALL, MissingExtraError
from rl_tformers.envs.pixels import is_pixel_id, make_pixel_env, register_pixel_id

__all__ = ["ATARI_INSTALL", "POPGYM_INSTALL", "MissingExtraError", "encode_spaces", "make_task", "register_env_id"]

POPGYM_PREFIX = "popgym-"


def register_env_id(env_id: str) -> None:
    """Make sure gymnasium knows ``env_id``: an id starting with ``popgym-`` imports ``popgym``
    (which registers its 42 tasks), an Atari or MinAtar id ``ale_py`` or ``minatar``
    (:func:`~rl_tformers.envs.pixels.register_pixel_id`); any other id is left to gymnasium.

    Raises:
        MissingExtraError: a ``popgym-``, Atari or MinAtar id whose package cannot be imported (the
            message names the extra to install).
    """
    if is_pixel_id(env_id):
        register_pixel_id(env_id)
        return
    if not str(env_id).startswith(POPGYM_PREFIX):
        return
    try:
        import popgym  # noqa: F401  (optional dependency, the popgym extra: registers POPGym's ids on import)
    except ImportError as exc:
        raise MissingExtraError(f"{env_id} is a POPGym task and popgym is not installed: {POPGYM_INSTALL} "
                                f"({type(exc).__name__}: {exc})") from None


class OneHotObservation(gym.ObservationWrapper, gym.utils.RecordConstructorArgs):
    """A non-Box observation as one float32 vector (``gymnasium.spaces.flatten``; see the module).

    The observation space becomes ``Box(low, high, (F,), float32)`` with F = ``flatdim`` of the
    source space (``Tuple(Discrete(2), Discrete(4))``: F = 6, ``MultiDiscrete([2, 2])``: F = 4).

    Raises:
        ValueError: a space gymnasium cannot flatten (Text, Graph, Sequence, ...).
    """

    def __init__(self, env: gym.Env) -> None:
        gym.utils.RecordConstructorArgs.__init__(self)
        gym.ObservationWrapper.__init__(self, env)
        self.source_space = env.observation_space
        try:
            flat = gym.spaces.flatten_space(self.source_space)
        except NotImplementedError:
            flat = None
        if not isinstance(flat, gym.spaces.Box):  # Sequence and Graph flatten to themselves, Text not at all
            raise ValueError(f"the observation space {self.source_space} cannot be encoded as one vector")
        self.observation_space = gym.spaces.Box(np.asarray(flat.low, np.float32), np.asarray(flat.high, np.float32),
                                                dtype=np.float32)

    def observation(self, observation: Any) -> np.ndarray:
        """One observation of the source space -> (F,) float32."""
        return np.asarray(gym.spaces.flatten(self.source_space, observation), np.float32)


class FlatDiscreteAction(gym.ActionWrapper, gym.utils.RecordConstructorArgs):
    """A ``MultiDiscrete(nvec, start)`` action space as ``Discrete(prod(nvec))``.

    Action k is ``numpy.unravel_index(k, nvec) + start`` (C order: the last component varies
    fastest), e.g. ``MultiDiscrete([8, 8])``: 10 -> ``[1, 2]``. Only for 1-D ``nvec``.

    Raises:
        ValueError: a MultiDiscrete space with a multi-dimensional ``nvec``.
    """

    def __init__(self, env: gym.Env) -> None:
        gym.utils.RecordConstructorArgs.__init__(self)
        gym.ActionWrapper.__init__(self, env)
        space = env.action_space
        if np.ndim(space.nvec) != 1:
            raise ValueError(f"the action space {space} has a {np.ndim(space.nvec)}-dimensional nvec; only a 1-D "
                             f"MultiDiscrete is encoded as one Discrete")
        self.nvec = np.asarray(space.nvec, np.int64)
        self.start = np.asarray(space.start, np.int64)
        self.action_space = gym.spaces.Discrete(int(np.prod(self.nvec)))

    def action(self, action: Any) -> np.ndarray:
        """Class index k (a scalar) -> the (len(nvec),) action of the MultiDiscrete space."""
        return np.asarray(np.unravel_index(int(action), tuple(self.nvec)), np.int64) + self.start


def encode_spaces(env: gym.Env) -> gym.Env:
    """``env`` with a non-Box observation one-hot encoded (:class:`OneHotObservation`) and a
    MultiDiscrete action space as one Discrete (:class:`FlatDiscreteAction`); Box observations
    and Discrete or Box actions are left as they are (the same ``env`` when nothing changes)."""
    if not isinstance(env.observation_space, gym.spaces.Box):
        env = OneHotObservation(env)
    if isinstance(env.action_space, gym.spaces.MultiDiscrete):
        env = FlatDiscreteAction(env)
    return env


def make_task(env_id: str, **kwargs: Any) -> gym.Env:
    """``gym.make(env_id, **kwargs)`` with its id resolved (:func:`register_env_id`) and its spaces
    encoded (:func:`encode_spaces`). An Atari or MinAtar id is built with its standard
    preprocessing (:func:`~rl_tformers.envs.pixels.make_pixel_env`: ``ALE/Breakout-v5`` gives
    ``Box(0, 255, (4, 84, 84), uint8)`` observations), kept as uint8 images.

    Raises:
        MissingExtraError: a POPGym id without ``popgym`` installed, an Atari or MinAtar id without
            the ``atari`` extra.
        gymnasium.error.Error: an id gymnasium does not know (from ``gym.make``).
    """
    if is_pixel_id(env_id):
        return make_pixel_env(env_id, **kwargs)
    register_env_id(env_id)
    return encode_spaces(gym.make(env_id, **kwargs))
