"""Partially observed variants of gymnasium tasks: hide observation entries (e.g. velocities).

The memory benchmarks for GTrXL are MuJoCo locomotion tasks that only show joint positions:
the agent must infer velocities from its history. Pieces:

* :func:`position_indices`: which observation entries are positions (``qpos``) in a MuJoCo
  locomotion observation, found by matching a reset observation against ``data.qpos`` (not a
  hand-kept table): Hopper-v5 ``[0..4]`` of 11, Walker2d-v5 and HalfCheetah-v5 ``[0..7]`` of 17.
* :class:`ObservationMaskWrapper`: a gymnasium ``ObservationWrapper`` keeping given indices of a
  Box observation (records its constructor arguments, so ``env.spec`` rebuilds it).
* :func:`make_env`: build an environment, masked like a dataset's metadata ``pomdp`` record
  says, for evaluating agents trained on partially observed data.
"""

from __future__ import annotations

from collections.abc import Sequence

import gymnasium as gym
import numpy as np
from rl_tformers.envs.environments import make_task

POMDP_KINDS = ("positions", "mask")


def _as_index_list(indices: Sequence[int] | np.ndarray, dim: int) -> list[int]:
    arr = np.asarray(indices)
    if arr.dtype == bool:
        # a boolean mask is not a list of indices: [False, True] would keep entries 0 and 1
        raise ValueError(f"observation indices must be integers, got a boolean mask {arr.tolist()}; "
                         f"pass the kept indices (e.g. numpy.flatnonzero(mask))")
    if arr.size and not (np.issubdtype(arr.dtype, np.integer) or (
            np.issubdtype(arr.dtype, np.floating) and np.array_equal(arr, np.round(arr)))):
        # 1.5 would silently become index 1
        raise ValueError(f"observation indices must be integers, got {arr.reshape(-1).tolist()}")
    idx = [int(i) for i in arr.reshape(-1)]
    if not idx:
        raise ValueError("observation mask keeps no index")
    bad = [i for i in idx if not 0 <= i < dim]
    if bad:
        raise ValueError(f"observation indices {bad} outside [0, {dim})")
    if len(set(idx)) != len(idx):
        raise ValueError(f"observation indices repeat: {idx}")
    return idx


class ObservationMaskWrapper(gym.ObservationWrapper, gym.utils.RecordConstructorArgs):
    """Keep ``indices`` of a 1-D Box observation: obs (D,) -> obs[indices] (len(indices),).

    Raises:
        ValueError: non-Box or non-1-D observation space, empty/out-of-range/repeated indices.
    """

    def __init__(self, env: gym.Env, indices: Sequence[int]):
        space = env.observation_space
        if not isinstance(space, gym.spaces.Box) or len(space.shape) != 1:
            raise ValueError(f"ObservationMaskWrapper needs a 1-D Box observation space, got {space!r}")
        idx = _as_index_list(indices, space.shape[0])
        gym.utils.RecordConstructorArgs.__init__(self, indices=idx)
        gym.ObservationWrapper.__init__(self, env)
        self.indices = np.asarray(idx, dtype=np.int64)
        self.observation_space = gym.spaces.Box(space.low[self.indices], space.high[self.indices],
                                                dtype=space.dtype)

    def observation(self, observation: np.ndarray) -> np.ndarray:
        """obs (D,) -> obs[indices] (len(indices),)."""
        return np.asarray(observation)[self.indices]


def position_indices(env: gym.Env | str) -> list[int]:
    """Observation indices holding joint positions (``qpos``) in a MuJoCo locomotion task.

    Gymnasium's locomotion observations start with ``qpos[k:]`` (``k`` root coordinates
    excluded) followed by velocities. ``k`` is found by matching a reset observation with
    ``data.qpos``, so any such task works without a table.

    Raises:
        ValueError: the environment is not a MuJoCo task whose observation starts with qpos.
    """
    own = isinstance(env, str)
    e = gym.make(env) if own else env
    try:
        base = e.unwrapped
        data = getattr(base, "data", None)
        if data is None or not hasattr(data, "qpos"):
            raise ValueError(f"{getattr(e.spec, 'id', e)} is not a MuJoCo environment; use an explicit "
                             "observation mask (--obs-indices) instead of 'positions'")
        obs, _ = base.reset(seed=0)
        obs = np.asarray(obs).reshape(-1)
        qpos = np.asarray(data.qpos).reshape(-1)
        for k in range(qpos.size):
            n = qpos.size - k
            if n <= obs.size and np.array_equal(obs[:n], qpos[k:]):
                return list(range(n))
        raise ValueError(f"the observation of {getattr(e.spec, 'id', e)} does not start with qpos; use an "
                         "explicit observation mask (--obs-indices)")
    finally:
        if own:
            e.close()


def pomdp_record(env: gym.Env, kind: str, indices: Sequence[int] | None = None) -> dict:
    """The ``pomdp`` metadata record of a dataset: ``{"kind", "indices", "source_shape"}``.

    ``kind="positions"`` computes the indices (:func:`position_indices`); ``kind="mask"`` uses
    ``indices``.
    """
    if kind not in POMDP_KINDS:
        raise ValueError(f"unknown POMDP kind {kind!r}; choose one of {POMDP_KINDS}")
    shape = tuple(env.observation_space.shape)
    if kind == "positions":
        idx = position_indices(env)
    else:
        if indices is None:
            raise ValueError("kind='mask' needs indices")
        idx = _as_index_list(indices, shape[0])
    return {"kind": kind, "indices": idx, "source_shape": list(shape)}


def apply_pomdp(env: gym.Env, pomdp: dict | None) -> gym.Env:
    """Wrap ``env`` with the observation mask of a ``pomdp`` record (no-op for ``None``)."""
    if not pomdp:
        return env
    return ObservationMaskWrapper(env, pomdp["indices"])


def make_env(env_id: str, pomdp: dict | None = None, **kwargs) -> gym.Env:
    """``gym.make(env_id, **kwargs)`` as the agents see it (POPGym's ids resolved, non-Box
    observations one-hot: :func:`~rl_tformers.envs.environments.make_task`), masked as the
    ``pomdp`` record says (see :func:`pomdp_record`).

    Raises:
        MissingExtraError: a POPGym id without the ``popgym`` extra (a ValueError).
    """
    return apply_pomdp(make_task(env_id, **kwargs), pomdp)
