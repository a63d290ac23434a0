"""Recording environment steps into a Minari dataset with Minari's own writer, without jax.

:class:`EpisodeRecorder` is a ``gymnasium.Wrapper`` that keeps every episode stepped through it
as NumPy arrays (one (L+1, ...) observation array and (L, ...) action, reward and flag arrays per
episode) and writes them with ``minari.create_dataset_from_buffers``, Minari's public route for
episodes built by the caller. It records what ``minari.DataCollector(env, record_infos=False)``
records (same arrays, dtypes, episode seeds and options, per-episode reward statistics, dataset
metadata; tested), without ``DataCollector``'s per-step ``EpisodeBuffer.add_step_data``, which
imports ``jax`` (``minari[create]``, several hundred MB) for one ``jax.tree_util.tree_map``.

Like ``DataCollector``: a ``reset()`` ends the episode in progress (marked truncated unless it
terminated); a ``reset()`` without a seed draws one with ``secrets.randbits(64)`` and records it;
steps after an episode's end without a ``reset()`` start a new episode from the last observation.
Finished episodes stay in memory until :meth:`EpisodeRecorder.create_dataset` (about the size of
the arrays: 110 MB for a million Hopper steps).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np

#: Bits of the seed drawn for a reset without one (``minari.DataCollector``'s ``AUTOSEED_BIT_SIZE``).
AUTOSEED_BITS = 64


def stack_steps(steps: list) -> Any:
    """Stack per-step values into arrays along a new first axis, keeping Dict/Tuple structure.

    A list of dicts becomes a dict (keys sorted, the order Minari's ``EpisodeBuffer`` gives them)
    of stacked leaves, a list of tuples a tuple; leaves are stacked with ``numpy.asarray`` (the
    conversion h5py applies to the lists ``DataCollector`` hands it).
    """
    first = steps[0]
    if isinstance(first, dict):
        return {k: stack_steps([s[k] for s in steps]) for k in sorted(first)}
    if isinstance(first, tuple):
        return tuple(stack_steps([s[i] for s in steps]) for i in range(len(first)))
    return np.asarray(steps)


def copy_leaves(value: Any) -> Any:
    """``value`` with every NumPy array in it (a Dict/Tuple space's leaves included) copied, so
    that an environment or policy that later writes into the array it handed over (one buffer
    reused every step) leaves the recorded step as it was."""
    if isinstance(value, dict):
        return {k: copy_leaves(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(copy_leaves(v) for v in value)
    return value.copy() if isinstance(value, np.ndarray) else value


def _layout(value: Any) -> Any:
    """The structure of a step's value: dict keys and tuple items down to each leaf's shape."""
    if isinstance(value, dict):
        return {k: _layout(v) for k, v in sorted(value.items())}
    if isinstance(value, tuple):
        return tuple(_layout(v) for v in value)
    return np.shape(value)


class EpisodeRecorder(gym.Wrapper):
    """Records the episodes stepped through ``env`` and writes them as a Minari dataset.

    Args:
        env: the environment (made by ``gym.make``: its spec is stored in the dataset).
        observation: maps each observation to the one recorded (e.g. a POMDP mask), or ``None``
            to record it unchanged; what the wrapper returns to its caller is never changed.
        observation_space: the space of the recorded observations (default ``env``'s).
    """

    def __init__(self, env: gym.Env, *, observation: Callable[[Any], Any] | None = None,
                 observation_space: gym.Space | None = None):
        super().__init__(env)
        self._record = observation if observation is not None else (lambda o: o)
        self.recorded_observation_space = observation_space if observation_space is not None else env.observation_space
        self.episodes: list = []  # finished minari EpisodeBuffers, in order
        self._start(None, None, None)

    def _start(self, first_obs, seed: int | None, options: dict | None) -> None:
        self._seed, self._options = seed, options
        self._obs = [] if first_obs is None else [first_obs]
        self._actions, self._rewards, self._terms, self._truncs = [], [], [], []

    def _finish(self) -> None:
        """Store the episode in progress (when it has a step), then start none."""
        from minari.data_collector import EpisodeBuffer  # optional heavy dependency, with the writer

        if self._rewards:
            self.episodes.append(EpisodeBuffer(
                id=len(self.episodes), seed=self._seed, options=self._options,
                observations=self._stacked("observation", self._obs), actions=self._stacked("action", self._actions),
                rewards=np.asarray(self._rewards), terminations=np.asarray(self._terms),
                truncations=np.asarray(self._truncs), infos={}))
        self._start(None, None, None)

    def _stacked(self, what: str, steps: list) -> Any:
        """:func:`stack_steps` of the episode's ``steps``.

        Raises:
            ValueError: a step whose value has another structure or shape than the episode's first
                (naming the episode and the step; observations count from the reset's, step 0).
        """
        try:
            return stack_steps(steps)
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            first = _layout(steps[0])
            t = next((i for i, v in enumerate(steps) if _layout(v) != first), None)
            if t is None:
                raise
            raise ValueError(f"EpisodeRecorder: episode {len(self.episodes)}: the {what} of step {t} has layout "
                             f"{_layout(steps[t])}, the episode's first {first}; every {what} of an episode must "
                             f"have one shape") from exc

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """End the episode in progress (truncated unless it terminated) and start one; a
        ``seed`` of ``None`` is drawn (``secrets.randbits(64)``) unless
        ``options["minari_autoseed"]`` is False, as ``minari.DataCollector`` does."""
        if self._rewards and not self._terms[-1]:
            self._truncs[-1] = True
        self._finish()
        if seed is None and ((not options) or options.get("minari_autoseed", True)):
            seed = secrets.randbits(AUTOSEED_BITS)
        obs, info = self.env.reset(seed=seed, options=options)
        self._start(copy_leaves(self._record(obs)), seed, options)
        return obs, info

    def step(self, action):
        """Step ``env`` and record the step; an episode's end stores it."""
        if not self._obs:
            raise RuntimeError("EpisodeRecorder.step before reset(): the episode has no first observation")
        obs, rew, terminated, truncated, info = self.env.step(action)
        recorded = copy_leaves(self._record(obs))
        self._obs.append(recorded)
        self._actions.append(copy_leaves(action))
        self._rewards.append(rew)
        self._terms.append(terminated)
        self._truncs.append(truncated)
        if terminated or truncated:
            self._finish()
            self._obs = [recorded]  # steps without a reset continue from here, as in DataCollector
        return obs, rew, terminated, truncated, info

    @property
    def total_steps(self) -> int:
        """Steps of the finished episodes."""
        return int(sum(len(e.rewards) for e in self.episodes))

    def create_dataset(self, dataset_id: str, *, eval_env=None, algorithm_name: str | None = None,
                       author: str | None = None, author_email: str | None = None, description: str | None = None,
                       ref_min_score: float | None = None, ref_max_score: float | None = None,
                       num_episodes_average_score: int = 100):
        """Write the recorded episodes (the one in progress ends truncated) as Minari dataset
        ``dataset_id`` under ``$MINARI_DATASETS_PATH``, with ``minari.create_dataset_from_buffers``
        and each episode's reward statistics (Minari's ``EpisodeMetadataCallback``, which
        ``DataCollector`` stores too). Keyword arguments as ``DataCollector.create_dataset``.

        Returns:
            The ``minari.MinariDataset``.

        Raises:
            ValueError: from Minari: the dataset exists, a malformed id.
        """
        import minari  # optional heavy dependency: only writing needs it
        from minari.data_collector.callbacks import EpisodeMetadataCallback

        if self._rewards and not self._terms[-1]:
            self._truncs[-1] = True
        self._finish()
        md = minari.create_dataset_from_buffers(
            dataset_id, self.episodes, env=self.env, eval_env=eval_env, algorithm_name=algorithm_name,
            author=author, author_email=author_email, description=description,
            observation_space=self.recorded_observation_space, action_space=self.env.action_space,
            ref_min_score=ref_min_score, ref_max_score=ref_max_score,
            num_episodes_average_score=num_episodes_average_score)
        md.storage.update_episode_metadata(md.storage.apply(EpisodeMetadataCallback()))
        return md
