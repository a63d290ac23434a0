"""What the offline agents (Decision Transformer, BC, %BC) share: the run's dataset, the statistics
stored with every checkpoint, and the evaluation environment.

``dataset:`` section of a run config (read here)::

    dataset:
      path: rlt/hopper-v5/medium-expert-v0   # Minari id, Minari folder or D4RL .hdf5 (load_dataset)
      root: null                             # data root for Minari ids (default $RL_TFORMERS_DATA, else Minari's root)
      download: false                        # let Minari download a remote id
      lazy: false                            # HDF5 only: read windows from disk
      flatten_observations: false            # Minari Dict/Tuple observations: flatten them (and the
                                             # evaluation env's, with gymnasium's FlattenObservation)
    (checked against rl_tformers.runtime.run_config.DatasetConfig: a wrong key is an error)

:class:`DatasetInfo` is everything inference needs about the data (a plain dict of tensors,
numbers and strings, so it goes into the checkpoint's ``extra`` and back): observation mean/std,
action bounds, reward scale, dataset return statistics, and the evaluation environment. The keys
``env_id``, ``env_kwargs``, ``pomdp``, ``dataset_return_max`` and ``dataset_return_mean`` are the
convention :mod:`rl_tformers.cli.evaluate` reads from any agent's extra state.
"""

from __future__ import annotations

import importlib
import logging
import math
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from rl_tformers.agents.common.encoders import is_image, observation_layout
from rl_tformers.envs.dataset import EpisodeDataset
from rl_tformers.envs.environments import register_env_id
from rl_tformers.envs.loaders import HDF5_SUFFIXES, load_dataset
from rl_tformers.envs.pomdp import make_env
from rl_tformers.envs.scores import D4RL_REF_SCORES, _last_component, reference_scores, task_family
from rl_tformers.envs.trajectory import dataset_returns_to_go, iter_chunks, observation_stats
from rl_tformers.envs.trajectory import reward_scale as auto_scale

from rl_tformers.runtime.agent_registry import AgentBuildError
from rl_tformers.runtime.evaluation import max_episode_steps


def plain(x: Any) -> Any:
    """OmegaConf nodes -> plain Python containers (other values unchanged)."""

    return OmegaConf.to_container(x, resolve=True) if isinstance(x, (DictConfig, ListConfig)) else x


def load_offline_dataset(spec: Mapping[str, Any] | None) -> EpisodeDataset:
    """The run's dataset from its ``dataset:`` section (see the module docstring).

    ``dataset.env_id`` (HDF5 files only) names the task whose action space bounds the actions,
    instead of the file's ``env_id`` attribute or the task recognised from its file name.

    Raises:
        ValueError: no ``dataset.path``; ``dataset.env_id`` with a Minari dataset (which carries
            its own environment spec).
        DatasetError / FileNotFoundError: from the data layer's loaders (a missing file's error
            starts with ``dataset.path:`` and ends with ``dataset.build``, the command that makes
            it, when the config has one).
    """

    spec = dict(spec or {})
    if not spec.get("path"):
        raise ValueError(
            "dataset.path is required: a Minari id (e.g. rlt/hopper-v5/medium-v0, built by "
            "`rl-tformers collect --recipe hopper-medium`), a Minari dataset folder or a D4RL .hdf5 file"
        )
    env_id = spec.get("env_id")
    path = Path(str(spec["path"])).expanduser()
    if env_id and not (path.suffix.lower() in HDF5_SUFFIXES or path.is_file()):
        raise ValueError(
            f"dataset.env_id={env_id!r} applies to HDF5 files only; {spec['path']} is a Minari dataset, "
            f"which carries its own environment (set agent.env_id to evaluate in another one)"
        )
    try:
        return load_dataset(
            str(spec["path"]), download=bool(spec.get("download", False)), lazy=bool(spec.get("lazy", False)),
            root=spec.get("root"), flatten_observations=bool(spec.get("flatten_observations", False)),
            env_id=str(env_id) if env_id else None,
        )
    except FileNotFoundError as exc:  # named by the key that gave the path
        build = spec.get("build")
        if build and str(spec["path"]) in str(build):
            cmd = str(build)
            if cmd.startswith("python "):  # the interpreter that runs rl-tformers, which has the package
                cmd = f"{shlex.quote(sys.executable)} {cmd[len('python '):]}"
            raise FileNotFoundError(f"dataset.path: {exc}; build it with (dataset.build): {cmd}") from None
        raise FileNotFoundError(f"dataset.path: {exc}") from exc


def action_summary(ds: EpisodeDataset, act_dim: int, action_start: int = 0) -> np.ndarray:
    """Mean action of every step of ``ds`` (float64 sums, streamed over chunks for lazy or
    filtered data): for discrete actions the frequency of each of the ``act_dim`` actions
    (action ``action_start + i`` at index i), else the (act_dim,) mean of the flattened actions.
    Part of the data fingerprint that a resumed run compares (:func:`data_differences`).
    """

    total = np.zeros(act_dim, np.float64)
    covered = np.zeros(ds.rewards.shape[0], bool)
    covered[ds.flat_indices()] = True
    for off, chunk in iter_chunks(ds.actions):
        c = np.asarray(chunk)[covered[off: off + chunk.shape[0]]]
        if not len(c):  # a chunk of steps the selection leaves out (e.g. %BC's top episodes elsewhere)
            continue
        if ds.discrete_actions:
            total += np.bincount(c.reshape(-1).astype(np.int64) - action_start, minlength=act_dim)[:act_dim]
        else:
            total += c.reshape(c.shape[0], -1).astype(np.float64).sum(axis=0)
    return (total / max(int(covered.sum()), 1)).astype(np.float32)


def _action_space(ds: EpisodeDataset) -> tuple[bool, int, np.ndarray | None, np.ndarray | None, int]:
    """(discrete, act_dim, low (A,) or None, high (A,) or None, action_start) of ``ds``'s actions.

    Raises:
        ValueError: unbounded Box actions (with where the bounds of a D4RL file come from).
    """
    discrete = ds.discrete_actions
    action_start = 0
    if discrete:
        act_dim, low, high = int(ds.action_space.n), None, None
        action_start = int(ds.action_space.start)
    else:
        low = np.asarray(ds.action_space.low, np.float32).reshape(-1)
        high = np.asarray(ds.action_space.high, np.float32).reshape(-1)
        if not (np.isfinite(low).all() and np.isfinite(high).all()):
            hint = ""
            if ds.metadata.source == "d4rl-hdf5":
                hint = (
                    f"; {ds.metadata.location}: the action bounds come from the task the data came from "
                    f"(env_id {ds.metadata.env_id!r}), taken from dataset.env_id, else the file's env_id "
                    f"attribute, else guessed from the file name (e.g. hopper-medium-v2.hdf5 -> Hopper-v5)"
                    f"{_no_bounds_reason(ds)}; set dataset.env_id=<gymnasium id> (e.g. dataset.env_id=Hopper-v5) "
                    f"or write an env_id attribute into the file"
                )
            raise ValueError(f"continuous actions need a bounded Box action space, got {ds.action_space}{hint}")
        act_dim = low.size
        _check_action_resolution(ds, low, high)
    return discrete, act_dim, low, high, action_start


def _covered_extremes(ds: EpisodeDataset, arr: Any, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-feature (min, max) (float64, (width,)) of ``arr``'s rows that ``ds``'s episodes cover,
    streamed over chunks (+inf / -inf when no row is covered)."""
    lo, hi = np.full(width, np.inf), np.full(width, -np.inf)
    covered = np.zeros(ds.rewards.shape[0], bool)
    covered[ds.flat_indices()] = True
    for off, chunk in iter_chunks(arr):
        c = np.asarray(chunk)[covered[off: off + chunk.shape[0]]].reshape(-1, width).astype(np.float64)
        if c.size:
            lo, hi = np.minimum(lo, c.min(axis=0)), np.maximum(hi, c.max(axis=0))
    return lo, hi


#: Normalised to [-1, 1] by their Box, a dimension's actions must spread at least this much:
#: sqrt of float32's smallest normal number, so that squared differences of the training targets
#: (the loss, AdamW's second moments) do not underflow float32 to 0.
ACTION_SPREAD_MIN = float(np.sqrt(np.finfo(np.float32).tiny))


def _check_action_resolution(ds: EpisodeDataset, low: np.ndarray, high: np.ndarray) -> None:
    """Refuse Box bounds so wide for the dataset's actions that their normalisation to [-1, 1]
    loses them: a dimension whose actions vary, but over less than :data:`ACTION_SPREAD_MIN`
    of the half-width ``(high - low) / 2`` (``Box(-3e38, 3e38)`` for actions in [-1, 1]: targets
    about 3e-39, a loss that underflows to 0, and a policy that acts on the scale of the bounds).

    Raises:
        ValueError: naming the dataset, the dimension, its actions' range and the bounds.
    """
    a_lo, a_hi = _covered_extremes(ds, ds.actions, low.size)
    half = high.astype(np.float64) / 2 - low.astype(np.float64) / 2  # no float32 overflow
    spread = (a_hi - a_lo) / np.where(half > 0, half, 1.0)
    bad = np.flatnonzero((a_hi > a_lo) & (half > 0) & (spread < ACTION_SPREAD_MIN))
    if bad.size:
        i = int(bad[0])
        where = ds.metadata.location or "(in memory)"
        raise ValueError(
            f"dataset {where}: action dimension {i} has bounds [{low[i]:g}, {high[i]:g}] and its actions span "
            f"[{a_lo[i]:g}, {a_hi[i]:g}], {spread[i]:.3g} of the half-width: normalised to [-1, 1] by those bounds "
            f"they differ by less than {ACTION_SPREAD_MIN:.3g}, whose square underflows float32, so the model would "
            f"train on targets of about 0 and act on the scale of the bounds; give the data an action space whose "
            f"bounds fit its actions (dataset.env_id for a D4RL file, the dataset's action_space for Minari)")


def largest_observation(ds: EpisodeDataset) -> float:
    """max |observation| over the steps of ``ds`` (float64, raw units; NaN-free data assumed)."""
    width = int(np.prod(ds.observation_shape))
    lo, hi = _covered_extremes(ds, ds.observations, width)
    return float(max(np.abs(lo).max(initial=0.0), np.abs(hi).max(initial=0.0)))


def _auto_scale(ds: EpisodeDataset, where: str) -> float:
    """``agent.reward_scale='auto'``: the power of ten at or below the largest |episode return| of ``ds``,
    at most 1000 (:func:`~rl_tformers.envs.trajectory.reward_scale`).

    Raises:
        ValueError: the returns are too small for a power of ten (all |returns| below ~1e-323).
    """
    scale = auto_scale(ds)
    if not scale > 0:  # 10 ** floor(log10(m)) underflows to 0.0 for m below ~1e-323
        m = float(np.abs(ds.episode_returns).max())
        raise ValueError(
            f"rewards: agent.reward_scale='auto' cannot scale the dataset {where}: its largest |episode "
            f"return| is {m:g}, so the power of ten at or below it underflows to 0 in float64; its rewards "
            f"are too small to condition on: rescale them (multiply the dataset's rewards), or set "
            f"agent.reward_scale to a number > 0 where the agent takes it (dt, gtrxl)")
    return scale


@dataclass
class DatasetInfo:
    """Statistics of the training data that inference needs (stored in every checkpoint).

    Attributes:
        obs_dim: flat observation size; act_dim: flat action size (the product of the Box's
            shape) or number of discrete actions.
        discrete: discrete action space.
        obs_mean, obs_std: (obs_dim,) float32 normalisation (std floored at 1e-6).
        action_low, action_high: (act_dim,) float32 bounds of a Box action space, flattened in C
            order like the actions (None if discrete).
        reward_scale: divisor of rewards and returns-to-go (DT: 1000 on MuJoCo).
        return_max, return_mean, return_min: episode returns of the (filtered) dataset, raw units.
        longest_episode: steps of the longest dataset episode.
        env_id, env_kwargs, pomdp: the evaluation environment (``pomdp``: the dataset's
            observation mask record, applied to the evaluation env too).
        ref_min, ref_max: reference returns of the D4RL normalised score (the dataset's own
            Minari metadata first, then D4RL's table for the task family), or None.
        dataset: the dataset spec string, for the record.
        action_start: ``start`` of a ``Discrete`` action space (gymnasium's ``Discrete(n,
            start=s)`` holds ``s .. s + n - 1``); the models work with class indices
            ``action - action_start`` in ``[0, n)`` and the policies add it back (0 for Box).
        flatten_observations: the dataset was loaded with ``dataset.flatten_observations=true``;
            an evaluation environment whose observation space is not a Box (Dict, Tuple,
            Discrete) is then wrapped in ``gymnasium.wrappers.FlattenObservation``, which
            flattens exactly as the loader flattened the data (``gymnasium.spaces.flatten``).
        action_shape: shape of one environment action: ``()`` for ``Discrete``, the Box's
            shape for continuous actions (e.g. ``(2, 2)``, whose ``act_dim`` is 4). The models
            work with flat ``(..., act_dim)`` actions; the policies hand the environments
            ``(N, *action_shape)``. ``None`` (checkpoints from before the field, when only 1-D
            Box actions could be trained) reads as the flat ``(act_dim,)`` (``()`` if discrete).
        obs_shape: shape of one observation as the model reads it (``(C, H, W)`` for images);
            ``None`` (checkpoints from before the field) reads as the flat ``(obs_dim,)``.
        image_obs: the observations are uint8 ``(C, H, W)`` images: never standardised (mean 0,
            std 1 stored), scaled by 1/255 inside the image encoder
            (:mod:`rl_tformers.agents.common.encoders`).

    Raises:
        ValueError: an ``action_shape`` that does not fit the action kind and ``act_dim``
            (not ``()`` for discrete actions; a product other than ``act_dim`` for a Box).
    """

    obs_dim: int
    act_dim: int
    discrete: bool
    obs_mean: np.ndarray
    obs_std: np.ndarray
    action_low: np.ndarray | None
    action_high: np.ndarray | None
    reward_scale: float
    return_max: float
    return_mean: float
    return_min: float
    longest_episode: int
    env_id: str | None
    env_kwargs: dict
    pomdp: dict | None
    ref_min: float | None = None
    ref_max: float | None = None
    dataset: str | None = None
    action_start: int = 0
    flatten_observations: bool = False
    action_shape: tuple[int, ...] | None = None
    num_steps: int | None = None
    action_mean: np.ndarray | None = None
    obs_shape: tuple[int, ...] | None = None
    image_obs: bool = False

    def __post_init__(self) -> None:
        self.obs_shape = (int(self.obs_dim),) if self.obs_shape is None else tuple(int(k) for k in self.obs_shape)
        if self.action_shape is None:  # checkpoints from before the field: flat (only 1-D Boxes trained then)
            self.action_shape = () if self.discrete else (int(self.act_dim),)
        self.action_shape = tuple(int(k) for k in self.action_shape)
        if self.discrete and self.action_shape != ():
            raise ValueError(f"DatasetInfo: action_shape={self.action_shape} for discrete actions; "
                             f"one Discrete action is a scalar, action_shape ()")
        if not self.discrete and math.prod(self.action_shape) != int(self.act_dim):
            raise ValueError(f"DatasetInfo: action_shape={self.action_shape} does not hold act_dim={self.act_dim} "
                             f"action values")

    @classmethod
    def from_dataset(
        cls, ds: EpisodeDataset, *, reward_scale: float | str = "auto", normalize_obs: bool = True,
        env_id: str | None = None, env_kwargs: Mapping[str, Any] | None = None, spec: str | None = None,
        flatten_observations: bool = False,
    ) -> DatasetInfo:
        """Compute the statistics of ``ds``.

        Args:
            reward_scale: ``"auto"`` (the data layer's power of ten at or below the largest |return|,
                at most 1000) or a positive number (divisor).
            normalize_obs: False stores mean 0 and std 1 (as image observations always do).
            env_id, env_kwargs: override the dataset's environment.
            spec: the dataset spec string (``dataset.path``), for the record and messages.
            flatten_observations: ``ds`` was loaded with ``dataset.flatten_observations=true``
                (the evaluation environment's observations are flattened the same way, see
                :attr:`flatten_observations`).

        Raises:
            ValueError: unbounded Box actions, a reward scale that is not ``"auto"`` or > 0
                (:func:`parse_reward_scale`), a scale under which the scaled returns-to-go would
                not be finite in float32 (:func:`check_scaled_returns`), ``"auto"`` on returns too
                small for a power of ten (all |returns| below ~1e-323), ``env_kwargs`` that is not
                a mapping, or an evaluation environment that does not fit the data
                (:meth:`check_env`).
        """

        env_kwargs = check_env_kwargs(env_kwargs)
        scale = parse_reward_scale(reward_scale)
        discrete, act_dim, low, high, action_start = _action_space(ds)
        obs_shape, obs_dtype = observation_layout(ds)
        obs_dim, image = int(np.prod(obs_shape)), is_image(obs_shape, obs_dtype)
        if normalize_obs and not image:  # images: scaled by 1/255 in the encoder, never standardised
            st = observation_stats(ds)
            mean, std = st.mean.reshape(-1), st.std.reshape(-1)
        else:
            mean, std = np.zeros(obs_dim, np.float32), np.ones(obs_dim, np.float32)
        where = spec or ds.metadata.location or "(in memory)"
        if scale == "auto":
            scale = _auto_scale(ds, where)
        check_scaled_returns(ds, scale, where)
        ret = ds.episode_returns
        meta = ds.metadata
        refs = evaluation_references(ds, env_id) if env_id else reference_scores(ds)
        info = cls(
            obs_dim=obs_dim, act_dim=act_dim, discrete=discrete, obs_mean=mean, obs_std=std,
            action_low=low, action_high=high, reward_scale=float(scale),
            return_max=float(ret.max()), return_mean=float(ret.mean()), return_min=float(ret.min()),
            longest_episode=int(ds.lengths.max()),
            env_id=env_id or meta.env_id,
            env_kwargs=dict(env_kwargs or meta.extra.get("env_kwargs") or {}),
            pomdp=None if env_id else (dict(meta.pomdp) if meta.pomdp else None),
            ref_min=None if refs is None else float(refs[0]), ref_max=None if refs is None else float(refs[1]),
            dataset=spec, action_start=action_start, flatten_observations=bool(flatten_observations),
            action_shape=() if discrete else tuple(int(k) for k in ds.action_space.shape),
            num_steps=int(ds.num_steps), action_mean=action_summary(ds, act_dim, action_start),
            obs_shape=obs_shape, image_obs=image,
        )
        info.check_env(ds, "agent.env_id" if env_id else "the dataset's env_id")
        return info

    def check_env(self, ds: EpisodeDataset, source: str = "agent.env_id") -> None:
        """Refuse an evaluation environment that cannot serve a model trained on ``ds``.

        Checks (nothing when :attr:`env_id` is None): the id is registered with gymnasium
        (after importing the project's own tasks, :mod:`rl_tformers.envs.memory_tasks`; a
        ``"module:id"`` id imports ``module`` first); the environment can be made with
        :attr:`env_kwargs` (and :attr:`pomdp`); its observation space (flattened when
        :attr:`flatten_observations`) is a Box of the dataset's per-step observation shape;
        its action space is of the dataset's kind (Discrete with the same ``start`` and at least
        the dataset's ``n`` actions, or a Box of the same shape). An environment whose dependencies are not installed is skipped
        with a warning (the dataset can still be trained on; evaluation will need them).

        Args:
            ds: the training data.
            source: where the id came from, for the message (``agent.env_id``, or the dataset's).

        Raises:
            ValueError: naming the id (and ``source``), the dataset and both shapes or spaces.
        """
        if not self.env_id:
            return
        where = f"the dataset {self.dataset or ds.metadata.location or '(in memory)'}"
        spaces = _eval_env_spaces(self, where, source)
        if spaces is not None:
            _check_env_spaces(self, ds, *spaces, where, source)

    def check_resumed_data(self, now: DatasetInfo | None, dataset: Any = None) -> None:
        """Refuse resuming a run saved with these statistics (the checkpoint's) on data whose
        statistics ``now`` (:meth:`from_dataset` of the dataset read at resume) differ.

        A resumed offline run trains on the dataset it reads now with the checkpoint's statistics
        (observation mean/std, reward scale, default target): if the data behind ``dataset.path``
        changed since the checkpoint (a rebuilt or overwritten file), it would go on training on
        other data with stale statistics and the resume would not continue the run. ``now=None``
        (an agent loaded without its dataset, for inference) checks nothing.

        Args:
            now: the statistics of the data read now, or None.
            dataset: ``dataset.path`` of the run, for the message.

        Raises:
            AgentBuildError: (a ValueError, reported by ``rl-tformers train`` as one ``error:``
                line) naming the dataset and every statistic that changed (checkpoint -> now).
        """
        if now is None:
            return
        changed = data_differences(self, now)
        if changed:
            raise AgentBuildError(
                f"the dataset {dataset} is not the data this run was trained on: its statistics differ from "
                f"the checkpoint's ({'; '.join(changed)}; checkpoint -> now); resume with the original "
                f"data, or start a new run on this dataset")

    def to_extra(self) -> dict[str, Any]:
        """Checkpoint-safe dict (tensors, numbers, strings, None, dicts, lists)."""
        t = lambda a: None if a is None else torch.as_tensor(np.asarray(a, np.float32))  # noqa: E731
        return {
            "obs_dim": self.obs_dim, "act_dim": self.act_dim, "discrete": self.discrete,
            "obs_mean": t(self.obs_mean), "obs_std": t(self.obs_std),
            "action_low": t(self.action_low), "action_high": t(self.action_high),
            "reward_scale": self.reward_scale,
            "dataset_return_max": self.return_max, "dataset_return_mean": self.return_mean,
            "dataset_return_min": self.return_min, "longest_episode": self.longest_episode,
            "env_id": self.env_id, "env_kwargs": dict(self.env_kwargs), "pomdp": self.pomdp,
            "ref_min": self.ref_min, "ref_max": self.ref_max, "dataset": self.dataset,
            "action_start": self.action_start, "flatten_observations": self.flatten_observations,
            "action_shape": list(self.action_shape),
            "num_steps": self.num_steps, "action_mean": t(self.action_mean),
            "obs_shape": list(self.obs_shape), "image_obs": bool(self.image_obs),
        }

    @classmethod
    def from_extra(cls, d: Mapping[str, Any]) -> DatasetInfo:
        """Inverse of :meth:`to_extra`."""
        a = lambda x: None if x is None else np.asarray(torch.as_tensor(x).cpu(), np.float32)  # noqa: E731
        return cls(
            obs_dim=int(d["obs_dim"]), act_dim=int(d["act_dim"]), discrete=bool(d["discrete"]),
            obs_mean=a(d["obs_mean"]), obs_std=a(d["obs_std"]),
            action_low=a(d["action_low"]), action_high=a(d["action_high"]),
            reward_scale=float(d["reward_scale"]),
            return_max=float(d["dataset_return_max"]), return_mean=float(d["dataset_return_mean"]),
            return_min=float(d["dataset_return_min"]), longest_episode=int(d["longest_episode"]),
            env_id=d.get("env_id"), env_kwargs=dict(d.get("env_kwargs") or {}), pomdp=d.get("pomdp"),
            ref_min=d.get("ref_min"), ref_max=d.get("ref_max"), dataset=d.get("dataset"),
            action_start=int(d["action_start"]), flatten_observations=bool(d["flatten_observations"]),
            action_shape=tuple(int(k) for k in d["action_shape"]),
            num_steps=None if d["num_steps"] is None else int(d["num_steps"]), action_mean=a(d["action_mean"]),
            obs_shape=None if d.get("obs_shape") is None else tuple(int(k) for k in d["obs_shape"]),
            image_obs=bool(d.get("image_obs", False)),
        )

    def time_limit(self) -> int | None:
        """Steps of the evaluation environment's time limit (``spec.max_episode_steps``), or
        ``None`` when it has none, the dataset names no environment, or it cannot be made here
        (:meth:`check_env` reports that); for warnings given before training."""

        if not self.env_id:
            return None
        try:
            return max_episode_steps(self.make_env())
        except Exception:  # noqa: BLE001 - only used for warnings; check_env reported what matters
            return None

    def make_env(self):
        """Zero-argument factory of the evaluation environment.

        ``gym.make(env_id, **env_kwargs)``, masked like :attr:`pomdp`, and, when
        :attr:`flatten_observations` is set and its observation space is not a Box, wrapped
        in ``gymnasium.wrappers.FlattenObservation`` (the loader's flattening of the data).

        Raises:
            ValueError: the dataset names no environment (set ``agent.env_id``).
        """
        if not self.env_id:
            raise ValueError("the dataset names no environment; set agent.env_id for evaluation")

        env_id, pomdp, kwargs = self.env_id, (dict(self.pomdp) if self.pomdp else None), dict(self.env_kwargs)
        flatten = self.flatten_observations

        def make() -> gym.Env:
            env = make_env(env_id, pomdp, **kwargs)
            if flatten and not isinstance(env.observation_space, gym.spaces.Box):
                env = gym.wrappers.FlattenObservation(env)
            return env

        return make

    def normalizer(self):
        """``returns (E,) -> 100 * (R - ref_min) / (ref_max - ref_min)`` (E,), or ``None`` without references."""
        lo, hi = self.ref_min, self.ref_max

        def norm(r: np.ndarray):
            if lo is None or hi is None:
                return None
            return 100.0 * (np.asarray(r, np.float64) - lo) / (hi - lo)

        return norm


def data_differences(saved: DatasetInfo, other: DatasetInfo) -> list[str]:
    """The statistics of the training data that ``other`` changes from ``saved`` (a checkpoint's).

    Compared: observation and action layout (``obs_dim``, ``act_dim``, ``discrete``,
    ``action_start``, ``action_shape``), action bounds, observation mean/std, reward scale,
    dataset returns (max, mean, min) and the longest episode. Equal data read through the same
    config gives equal statistics (floats compared to a relative 1e-6, so a re-read never
    differs by rounding alone).

    Returns:
        ``["dataset_return_max: 10 -> 1000", ...]`` (``saved``'s value first), empty when equal.
    """
    def arr(x) -> np.ndarray | None:
        return None if x is None else np.asarray(x, np.float64).reshape(-1)

    def same(a, b) -> bool:
        a, b = arr(a), arr(b)
        if a is None or b is None:
            return a is None and b is None
        return a.shape == b.shape and bool(np.allclose(a, b, rtol=1e-6, atol=0.0, equal_nan=True))

    def show(x) -> str:
        if x is None or isinstance(x, (bool, int, tuple)):
            return str(x)
        a = arr(x)
        if a.size == 1:
            return f"{float(a[0]):g}"
        return "[" + ", ".join(f"{v:g}" for v in a[:4]) + (", ...]" if a.size > 4 else "]")

    out = []
    for name, key in (("obs_dim", "obs_dim"), ("act_dim", "act_dim"), ("discrete", "discrete"),
                      ("action_start", "action_start"), ("action_shape", "action_shape"),
                      ("longest_episode", "longest_episode")):
        a, b = getattr(saved, key), getattr(other, key)
        if a != b:
            out.append(f"{name}: {show(a)} -> {show(b)}")
    for name, key in (("action_low", "action_low"), ("action_high", "action_high"), ("obs_mean", "obs_mean"),
                      ("obs_std", "obs_std"), ("reward_scale", "reward_scale"),
                      ("dataset_return_max", "return_max"), ("dataset_return_mean", "return_mean"),
                      ("dataset_return_min", "return_min")):
        a, b = getattr(saved, key), getattr(other, key)
        if not same(a, b):
            out.append(f"{name}: {show(a)} -> {show(b)}")
    # optional in a record: compared when both sides have them (the same statistics with
    # other actions, e.g. every action flipped, or another number of steps)
    if saved.num_steps is not None and other.num_steps is not None and saved.num_steps != other.num_steps:
        out.append(f"num_steps: {saved.num_steps} -> {other.num_steps}")
    if saved.action_mean is not None and other.action_mean is not None and not same(saved.action_mean,
                                                                                    other.action_mean):
        out.append(f"action_mean: {show(saved.action_mean)} -> {show(other.action_mean)}")
    return out


def evaluation_references(ds: EpisodeDataset, env_id: str) -> tuple[float, float] | None:
    """Reference returns ``(ref_min, ref_max)`` of the normalised score of a model trained on ``ds``
    and evaluated in ``env_id`` (``agent.env_id``), or None.

    The normalised score is a property of the task the returns are measured in, so the evaluation
    environment decides:

    * ``env_id`` is the dataset's own environment, or of the same D4RL task family
      (``Hopper-v4`` for ``Hopper-v5`` data): the dataset's references
      (:func:`~rl_tformers.envs.scores.reference_scores`: its own Minari ones first);
    * ``env_id`` is of another D4RL family (``HalfCheetah-v5`` for Walker2d data, same shapes):
      that family's D4RL references, not the dataset's (logged as a warning when the dataset
      has references of its own);
    * ``env_id`` is of no D4RL family: the dataset's references if it has any, with a warning
      that they are the dataset's task's and mean something only if ``env_id`` is that task (a
      variant such as a custom ``module:HopperHeavy-v0``); else None.
    """


    own = reference_scores(ds)
    meta = ds.metadata
    if meta.env_id and str(env_id) == str(meta.env_id):
        return own
    log = logging.getLogger(__name__)
    # the dataset's task family: its env id's when it names one (as reference_scores decides)
    names = [meta.env_id] if meta.env_id else [meta.dataset_id, _last_component(meta.location)]
    data_family = next((f for f in map(task_family, names) if f is not None), None)
    eval_family = task_family(str(env_id))
    where = meta.location or meta.dataset_id or "(in memory)"
    if eval_family is not None:
        if eval_family == data_family:
            return own
        if own is not None:
            log.warning(
                "agent.env_id=%s is another task than the dataset %s (%s): normalised scores use the D4RL "
                "references of %s (%g, %g), the evaluated task's, not the dataset's (%g, %g)", env_id, where,
                meta.env_id or data_family, eval_family, *D4RL_REF_SCORES[eval_family], *own)
        return D4RL_REF_SCORES[eval_family]
    if own is not None:
        log.warning(
            "agent.env_id=%s is not the dataset %s's environment (%s) and has no D4RL references of its own: "
            "normalised scores use the dataset's references (%g, %g), which mean something only if %s is the "
            "same task", env_id, where, meta.env_id or data_family or "unknown", *own, env_id)
    return own


def _no_bounds_reason(ds: EpisodeDataset) -> str:
    """Why the task named by a D4RL file's metadata gave no action bounds (``""`` when it names none).

    The loader takes the task's action space only when ``gym.make(env_id)`` works here and its
    action space is a Box of the file's per-step action shape; otherwise it falls back to an
    unbounded Box without saying why (a file whose task is not installed still loads for
    ``dataset info``). Training needs the bounds, so its error says which of these happened:
    the id cannot be made (not registered, a dependency missing: the exception), its action
    space is not a Box, has another shape than the data, or is unbounded itself; or the file's
    own ``action_space`` attribute (an unbounded Box) was read before the task named by the
    file's ``env_id`` attribute (``dataset.env_id`` comes before the attribute).
    """
    env_id = ds.metadata.env_id
    if not env_id:
        return ""
    from rl_tformers.envs import memory_tasks  # noqa: F401 - registers the project's tasks

    try:
        env = gym.make(env_id)
    except Exception as exc:  # noqa: BLE001 - reported, whatever the environment raised
        return f"; env_id {env_id!r} gives no bounds: gym.make({env_id!r}) fails here ({type(exc).__name__}: {exc})"
    try:
        space = env.action_space
    finally:
        env.close()
    shape = tuple(ds.action_shape)
    if not isinstance(space, gym.spaces.Box):
        return f"; env_id {env_id!r} gives no bounds: its action space {space} is not a Box"
    if tuple(space.shape) != shape:
        return (f"; env_id {env_id!r} gives no bounds: its action space {space} has another shape than the "
                f"file's actions, {shape} per step")
    if not (np.isfinite(space.low).all() and np.isfinite(space.high).all()):
        return f"; env_id {env_id!r} gives no bounds: its action space {space} is unbounded itself"
    # a bounded Box of the right shape that was not used: the file's own action_space attribute
    # (unbounded) came first, as it does before the file's env_id attribute
    return (f"; the file's own action_space attribute ({ds.action_space}) was read before the action space "
            f"{space} of its env_id attribute {env_id!r}: set dataset.env_id={env_id} to take that task's bounds")


def flattens_observations(spec: Mapping[str, Any] | None) -> bool:
    """``dataset.flatten_observations`` of a run's ``dataset:`` section (False when absent)."""
    return bool(dict(spec or {}).get("flatten_observations", False))


def check_env_kwargs(value: Any) -> Mapping[str, Any] | None:
    """``agent.env_kwargs`` (gym.make keyword arguments of the evaluation env): a mapping or None.

    Raises:
        ValueError: naming ``agent.env_kwargs`` and the value, for anything else.
    """
    if value is not None and not isinstance(value, Mapping):
        raise ValueError(f"agent.env_kwargs must be a mapping of gym.make keyword arguments "
                         f"(e.g. {{max_episode_steps: 500}}) or null, got {value!r}")
    return value


def parse_reward_scale(value: Any) -> float | str:
    """``agent.reward_scale``: ``"auto"``, or a number > 0 (returned as a float).

    Raises:
        ValueError: naming ``agent.reward_scale`` and the value, for anything else.
    """
    if value == "auto":
        return "auto"
    try:
        if isinstance(value, bool):
            raise ValueError
        scale = float(value)
    except (TypeError, ValueError):
        scale = float("nan")
    if not scale > 0 or not np.isfinite(scale):
        raise ValueError(f"agent.reward_scale must be 'auto' or a number > 0, got {value!r}")
    return scale


def largest_returns_to_go(ds: EpisodeDataset) -> tuple[float, float]:
    """``(max |return-to-go|, max |reward|)`` over the steps of ``ds`` (undiscounted, float64, raw units)."""

    rows = ds.flat_indices()
    return (float(np.abs(dataset_returns_to_go(ds)[rows]).max()),
            float(np.abs(np.asarray(ds.rewards)[rows]).max()))


def check_scaled_returns(ds: EpisodeDataset, scale: float, where: str | None = None) -> None:
    """Refuse a reward scale whose scaled returns-to-go or rewards are not finite in float32.

    The samplers divide every return-to-go and reward by the scale and hand the model float32
    (``RTG / scale``): a tiny scale (``agent.reward_scale=1e-40`` on returns in the thousands)
    overflows to inf there and makes the first loss NaN. Checked on the dataset's largest
    undiscounted |return-to-go| and |reward| (both float64, exact).

    Raises:
        ValueError: naming ``agent.reward_scale``, the dataset's largest |return-to-go| and
            |episode return|, and the smallest scale that works.
    """
    if ds.num_episodes == 0:
        return
    m_rtg, m_r = largest_returns_to_go(ds)
    m = max(m_rtg, m_r)
    limit = float(np.finfo(np.float32).max)
    with np.errstate(over="ignore"):
        scaled = np.float64(m) / np.float64(scale)
        ok = bool(np.isfinite(np.float32(scaled)))
    if not ok:
        ret = float(np.abs(ds.episode_returns).max())
        raise ValueError(
            f"agent.reward_scale={scale:g} is too small for the dataset {where or ds.metadata.location or '(in memory)'}: "
            f"returns-to-go and rewards are divided by it, and its largest |episode return| is {ret:g} (largest "
            f"|return-to-go| {m_rtg:g}, |reward| {m_r:g}): {m:g} / {scale:g} = {float(scaled):g} is not finite "
            f"in float32 (max {limit:g}), so training would see inf/NaN; use agent.reward_scale >= {m / limit:g} "
            f"('auto' picks the power of ten at or below the largest |episode return|, at most 1000)")


def _eval_env_spaces(info: DatasetInfo, where: str, source: str) -> tuple[gym.Space, gym.Space] | None:
    """The observation and action spaces of ``info``'s evaluation environment (made once and
    closed); None, with a warning, when its dependencies are not installed.

    Raises:
        ValueError: the id is not registered, or the environment cannot be made with its kwargs;
            MissingExtraError (a ValueError): a POPGym id without the ``popgym`` extra.
    """
    from rl_tformers.envs import memory_tasks  # noqa: F401 - registers the project's tasks

    name = str(info.env_id)
    register_env_id(name)  # POPGym's ids: registered by importing popgym (the popgym extra)
    fix = "set agent.env_id to the environment the data came from"
    try:
        if ":" in name:
            module, _, name = name.partition(":")
            importlib.import_module(module)
        gym.spec(name)
    except (gym.error.Error, ImportError) as exc:
        raise ValueError(f"{source}={info.env_id!r} is not a registered gymnasium environment ({exc}); "
                         f"{fix} (e.g. agent.env_id=Hopper-v5)") from exc
    try:
        env = info.make_env()()
    except (gym.error.DependencyNotInstalled, ImportError) as exc:
        logging.getLogger(__name__).warning(
            "cannot make the evaluation environment %s to check it against %s (%s); evaluation will fail "
            "until its dependencies are installed", info.env_id, where, exc)
        return None
    except Exception as exc:  # noqa: BLE001 - any failure of the env's constructor, reported with its config
        raise ValueError(f"{source}={info.env_id!r}: cannot make the evaluation environment with "
                         f"agent.env_kwargs={info.env_kwargs} ({type(exc).__name__}: {exc})") from exc
    try:
        obs_space, act_space = env.observation_space, env.action_space
    finally:
        env.close()
    return obs_space, act_space


def _check_env_spaces(info: DatasetInfo, ds: EpisodeDataset, obs_space: gym.Space, act_space: gym.Space,
                      where: str, source: str) -> None:
    """Refuse evaluation spaces that do not fit ``ds`` (see :meth:`DatasetInfo.check_env`)."""
    fix = "set agent.env_id to the environment the data came from"
    shape = tuple(ds.observation_shape)
    if not isinstance(obs_space, gym.spaces.Box) or tuple(obs_space.shape) != shape:
        pomdp = f" (masked by the dataset's POMDP record {info.pomdp})" if info.pomdp else ""
        env_obs = (f"observations of shape {tuple(obs_space.shape)}" if isinstance(obs_space, gym.spaces.Box)
                   else f"observation space {obs_space}, not a Box")
        raise ValueError(
            f"observations: {where} has observations of shape {shape} per step, but the evaluation "
            f"environment {info.env_id} ({source}){pomdp} has {env_obs}; {fix}")
    if isinstance(act_space, gym.spaces.Discrete) != ds.discrete_actions or (
            isinstance(act_space, gym.spaces.Box) and tuple(act_space.shape) != tuple(ds.action_shape)) or (
            ds.discrete_actions and int(act_space.start) != int(ds.action_space.start)) or (
            # the model picks among the dataset's n actions: the environment must have them all
            # (fewer in the data is fine: an action the behaviour policy never took)
            ds.discrete_actions and int(act_space.n) < int(ds.action_space.n)):
        raise ValueError(
            f"actions: {where} has actions in {ds.action_space}, but the evaluation environment "
            f"{info.env_id} ({source}) has action space {act_space}; {fix}")
