"""The in-memory episode representation shared by every loader, sampler and agent.

Layout (chosen so that random access stays O(batch) at 1M+ steps):

* flat step arrays, one row per environment step ``t`` (the step *before* acting):
  ``observations (N, *obs_shape)``, ``actions (N, *act_shape)`` (``(N,)`` int64 for
  ``Discrete``), ``rewards (N,)`` float64, ``terminations (N,)`` bool, ``truncations (N,)`` bool;
* an episode table: ``starts (E,)`` and ``lengths (E,)`` (int64) into the flat arrays, plus
  ``final_observations (E, *obs_shape)``: the observation reached after the last action of each
  episode (Minari stores ``len(actions) + 1`` observations; that extra one lives here). ``None``
  when the source does not have it (a D4RL file without ``next_observations``);
* ``observation_space`` / ``action_space`` (gymnasium) and :class:`DatasetMetadata`.

Selecting episodes (``select``, ``top_fraction`` in :mod:`rl_tformers.envs.trajectory`) only
rewrites the episode table: the flat arrays are shared, never copied, so a filtered view of an
HDF5-backed dataset stays lazy. Episodes are therefore not required to be contiguous or in flat
order; the *dataset order* is the order of the episode table and ``cum_lengths`` maps a
"virtual" step ``v`` in ``[0, num_steps)`` of that order to its episode by ``searchsorted``.

The flat ``observations`` / ``actions`` may be numpy arrays or :class:`LazyH5Array` (an HDF5
dataset opened lazily in each process, see :mod:`rl_tformers.envs.loaders`); rewards, flags and
the episode table are always numpy arrays in memory (a few MB per million steps).

Pixel datasets store one ``(C, H, W)`` uint8 frame per step and say in their metadata how many
frames make an observation (``metadata.extra["frame_stack"]``, k); the observation space is the
stacked one the agents act on, ``Box(0, 255, (k * C, H, W), uint8)``, and the samplers stack the
frames when they draw a batch (:mod:`rl_tformers.envs.frames`), so no stacked or float copy of
the frames is ever stored.

Validation (:meth:`EpisodeDataset.validate`, run by every loader) raises :class:`DatasetError`
naming the field, the episode and the step of the first problem. Nothing is ever fixed silently.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import gymnasium as gym
import numpy as np
from rl_tformers.envs.frames import FRAME_STACK_KEY, MAX_FRAME_STACK, is_image_shape
from rl_tformers.envs.scores import normalized_score, reference_scores

ArrayLike = Any  # np.ndarray or LazyH5Array (indexable, has .shape/.dtype)

#: Steps per chunk when scanning lazy (HDF5-backed) arrays during validation and statistics.
SCAN_CHUNK = 1 << 16
#: Key of the project's own record inside a Minari dataset's metadata.json.
META_KEY = "rl_tformers"
#: Largest float32 magnitude: observations and actions beyond it (float64 data) are inf in the agents.
F32_MAX = float(np.finfo(np.float32).max)


class DatasetError(ValueError):
    """A dataset is malformed. The message names the field, the episode and the step.

    Attributes:
        field: array at fault (``"rewards"``, ``"observations"``, ...) or ``None``.
        episode: episode index (position in the episode table) or ``None``.
        step: step index inside that episode (0-based) or ``None``.
    """

    def __init__(self, message: str, *, field: str | None = None, episode: int | None = None,
                 step: int | None = None):
        super().__init__(_original_message(message))
        self.field = field
        self.episode = episode
        self.step = step


def _original_message(message: str) -> str:
    """``message``, or, for the copy a ``torch.utils.data.DataLoader`` worker's error is re-raised
    as in the main process ("Caught DatasetError in DataLoader worker process 0. Original
    Traceback ... DatasetError: MESSAGE"), the worker's own one-line MESSAGE."""
    head = f"Caught {DatasetError.__name__} in DataLoader worker"
    if isinstance(message, str) and message.startswith(head) and f"{DatasetError.__name__}: " in message:
        return message.rsplit(f"{DatasetError.__name__}: ", 1)[1].strip()
    return message


#: what h5py raises reading a damaged file: a broken object header (KeyError "Unable to open
#: object"), a chunk whose filter fails or a truncated file (OSError), a corrupt B-tree or heap
#: (RuntimeError)
H5_READ_ERRORS = (KeyError, OSError, RuntimeError)


@contextmanager
def reading_hdf5(path: str | os.PathLike, field: str | None) -> Iterator[None]:
    """Turn h5py's errors inside the block into one :class:`DatasetError` naming ``path`` and ``field``.

    Wraps every read of an HDF5 dataset file (eager, lazy, Minari's): a file with a flipped
    byte in an object header or a corrupted compressed chunk fails in one line, not in an h5py
    traceback.

    Raises:
        DatasetError: ``"{path}: cannot read {field}: the file is damaged ({h5py's error}); ..."``.
    """
    try:
        yield
    except DatasetError:
        raise
    except H5_READ_ERRORS as exc:
        raise DatasetError(damaged_message(path, field, exc), field=field) from exc


def damaged_message(path: str | os.PathLike, field: str | None, exc: BaseException) -> str:
    """The one line of :func:`reading_hdf5`: the file, the field and h5py's own reason."""
    reason = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
    reason = " ".join(str(reason).split()) or type(exc).__name__
    what = f"cannot read {field!r}" if field else "cannot read it"
    return (f"{os.fspath(path)}: {what}: the file is damaged ({type(exc).__name__}: {reason}); "
            f"re-create or re-download it")


@dataclass(frozen=True)
class DatasetMetadata:
    """Where a dataset came from and what it is about.

    Attributes:
        env_id: gymnasium id of the environment (``"Hopper-v5"``), or ``None`` when unknown.
        source: ``"minari"``, ``"minari-path"``, ``"d4rl-hdf5"`` or ``"memory"``.
        location: Minari id or filesystem path the data was read from (``None`` in memory).
        dataset_id: Minari dataset id when there is one.
        ref_min_score: dataset's own reference minimum return (Minari metadata), raw units.
        ref_max_score: dataset's own reference maximum return (Minari metadata), raw units.
        pomdp: ``{"kind": "positions" | "mask", "indices": [...], "source_shape": [...]}`` when
            observations were masked at collection time (see :mod:`rl_tformers.envs.pomdp`).
        extra: anything else worth keeping (algorithm, description, notes from the loader).
    """

    env_id: str | None = None
    source: str = "memory"
    location: str | None = None
    dataset_id: str | None = None
    ref_min_score: float | None = None
    ref_max_score: float | None = None
    pomdp: dict | None = None
    extra: dict = field(default_factory=dict)

    def replace(self, **changes: Any) -> DatasetMetadata:
        """Copy with ``changes`` (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)


class Episode(NamedTuple):
    """Views of one episode (numpy views for in-memory data; read on access for lazy data).

    observations (L, *obs_shape), actions (L, *act_shape), rewards (L,), terminations (L,),
    truncations (L,), final_observation (*obs_shape) or ``None``.
    """

    observations: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    terminations: np.ndarray
    truncations: np.ndarray
    final_observation: np.ndarray | None


class LazyH5Array:
    """Read-only array view of one HDF5 dataset, opened lazily once per process.

    No h5py handle is ever pickled: ``__getstate__`` drops it, and a handle inherited through
    ``fork`` is detected by its process id and replaced, so the object is safe in
    ``torch.utils.data.DataLoader`` workers (``num_workers > 0``).

    Indexing: ``a[i]``, ``a[i:j]`` and ``a[idx]`` with an integer array ``idx`` of any shape
    (result shape ``idx.shape + a.shape[1:]``). Integer arrays are served by reading each
    contiguous run of the sorted unique indices with one slice, which is what window samplers
    produce (B runs of K consecutive steps).
    """

    def __init__(self, path: str | os.PathLike, key: str):
        import h5py

        self.path = os.fspath(path)
        self.key = key
        with reading_hdf5(self.path, key), h5py.File(self.path, "r") as f:
            if key not in f:
                raise DatasetError(f"{self.path}: HDF5 file has no dataset {key!r}", field=key)
            d = f[key]
            self.shape: tuple[int, ...] = tuple(d.shape)
            self.dtype = np.dtype(d.dtype)
        self._h5 = None
        self._pid: int | None = None

    @property
    def ndim(self) -> int:
        """Number of axes of the HDF5 dataset."""
        return len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def _dataset(self):
        if self._h5 is None or self._pid != os.getpid():
            import h5py

            with reading_hdf5(self.path, self.key):
                self._h5 = h5py.File(self.path, "r")
            self._pid = os.getpid()
        with reading_hdf5(self.path, self.key):
            return self._h5[self.key]

    def close(self) -> None:
        """Close this process's handle (it reopens on the next access)."""
        if self._h5 is not None and self._pid == os.getpid():
            self._h5.close()
        self._h5 = None
        self._pid = None

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_h5"] = None
        state["_pid"] = None
        return state

    def __array__(self, dtype=None, copy=None):
        with reading_hdf5(self.path, self.key):
            out = self._dataset()[()]
        return out if dtype is None else out.astype(dtype)

    def __getitem__(self, idx):
        """Rows ``idx`` (see the class docstring).

        Raises:
            DatasetError: the file cannot be read there (damaged: :func:`reading_hdf5`).
            IndexError, TypeError: an index out of range or of another kind.
        """
        if isinstance(idx, (int, np.integer, slice)):
            with reading_hdf5(self.path, self.key):
                return self._dataset()[idx]
        idx = np.asarray(idx)
        if idx.dtype == bool or not np.issubdtype(idx.dtype, np.integer):
            raise TypeError(f"LazyH5Array supports int, slice or integer-array indices, got {idx.dtype}")
        flat = idx.reshape(-1)
        if flat.size == 0:
            return np.empty(idx.shape + self.shape[1:], dtype=self.dtype)
        uniq, inverse = np.unique(flat, return_inverse=True)
        if uniq[0] < 0 or uniq[-1] >= self.shape[0]:
            raise IndexError(f"index out of range for {self.key} with {self.shape[0]} rows")
        breaks = np.flatnonzero(np.diff(uniq) != 1) + 1  # run boundaries in uniq
        run_starts = np.concatenate(([0], breaks))
        run_ends = np.concatenate((breaks, [uniq.size]))
        d = self._dataset()
        with reading_hdf5(self.path, self.key):
            parts = [d[int(uniq[a]): int(uniq[b - 1]) + 1] for a, b in zip(run_starts, run_ends)]
        rows = np.concatenate(parts, axis=0)  # (U, *row_shape) rows of uniq in order
        return rows[inverse].reshape(idx.shape + self.shape[1:])

    def __repr__(self) -> str:
        return f"LazyH5Array({self.path!r}, {self.key!r}, shape={self.shape}, dtype={self.dtype})"


def iter_chunks(arr: ArrayLike, chunk: int = SCAN_CHUNK) -> Iterator[tuple[int, np.ndarray]]:
    """Yield ``(offset, arr[offset:offset+chunk])`` over the first axis (numpy or lazy array)."""
    n = arr.shape[0]
    for off in range(0, n, chunk):
        yield off, np.asarray(arr[off: min(off + chunk, n)])


def space_to_str(space: gym.Space) -> str:
    """Short description of a space for messages and ``dataset info``."""
    return repr(space)


def _flag_columns(observations: ArrayLike, rewards: np.ndarray, terminals: np.ndarray, timeouts: np.ndarray | None,
                  next_observations: ArrayLike | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The checks of :meth:`EpisodeDataset.from_flags`' per-step columns; returns ``(rewards,
    terminals, timeouts)`` as (N,) columns (the flags as bool; no ``timeouts``: all False).

    Raises:
        DatasetError: as :meth:`EpisodeDataset.from_flags`.
    """
    rewards = per_step_column("rewards", rewards)
    n = rewards.shape[0]
    terminals = per_step_column("terminals", terminals)
    timeouts = np.zeros(n, bool) if timeouts is None else per_step_column("timeouts", timeouts)
    if terminals.shape[0] != n or timeouts.shape[0] != n:
        raise DatasetError(f"terminals/timeouts have {terminals.shape[0]}/{timeouts.shape[0]} rows, rewards {n}",
                           field="terminals")
    terminals, timeouts = (binary_flags("terminals", terminals, other_ends=timeouts),
                           binary_flags("timeouts", timeouts, other_ends=terminals))
    if next_observations is not None:
        nxt_shape, obs_shape = tuple(next_observations.shape), tuple(observations.shape)
        if nxt_shape[0] != n:
            raise DatasetError(f"next_observations: {nxt_shape[0]} rows but rewards has {n}",
                               field="next_observations")
        if nxt_shape[1:] != obs_shape[1:]:
            raise DatasetError(f"next_observations: shape {nxt_shape[1:]} per step, but observations have "
                               f"{obs_shape[1:]}", field="next_observations")
    return rewards, terminals, timeouts


def _checked_episode(i: int, ep: dict, step_shapes: dict[str, tuple[int, ...]]) -> tuple[np.ndarray, np.ndarray, int]:
    """The checks of episode ``i`` of :meth:`EpisodeDataset.from_episodes` (``step_shapes``: the
    per-step shapes of episode 0, filled by it); returns ``(observations, actions, length)``.

    Raises:
        DatasetError: as :meth:`EpisodeDataset.from_episodes`.
    """
    obs = np.asarray(ep["observations"])
    act = np.asarray(ep["actions"])
    for key, arr in (("observations", obs), ("actions", act), ("rewards", np.asarray(ep["rewards"]))):
        _check_numeric(key, arr, episode=i)
    for key, arr in (("observations", obs), ("actions", act)):
        if arr.ndim == 0:
            raise DatasetError(f"{key}: episode {i}: a scalar (shape ()), expected one row per step",
                               field=key, episode=i)
        first = step_shapes.setdefault(key, tuple(arr.shape[1:]))
        if tuple(arr.shape[1:]) != first:
            raise DatasetError(f"{key}: episode {i} has shape {tuple(arr.shape[1:])} per step but episode 0 "
                               f"has {first}", field=key, episode=i)
    n_obs, n_act = obs.shape[0], act.shape[0]
    if n_obs != n_act + 1:
        raise DatasetError(
            f"episode {i}: observations has {n_obs} entries and actions has {n_act}; a Minari "
            f"episode must have len(observations) == len(actions) + 1 (the final observation)",
            field="observations", episode=i)
    for key in ("rewards", "terminations", "truncations"):
        k = np.asarray(ep[key]).shape[0]
        if k != n_act:
            raise DatasetError(f"episode {i}: {key} has {k} entries and actions has {n_act}",
                               field=key, episode=i)
    return obs, act, n_act


class _EpisodeConstructors:
    """The constructors of :class:`EpisodeDataset` from other layouts: D4RL-style flat data with
    episode-end flags (:meth:`from_flags`) and Minari-style episodes (:meth:`from_episodes`)."""

    @classmethod
    def from_flags(
        cls,
        observations: ArrayLike,
        actions: ArrayLike,
        rewards: np.ndarray,
        terminals: np.ndarray,
        timeouts: np.ndarray | None = None,
        *,
        next_observations: ArrayLike | None = None,
        observation_space: gym.Space | None = None,
        action_space: gym.Space | None = None,
        metadata: DatasetMetadata | None = None,
        validate: bool = True,
    ) -> EpisodeDataset:
        """Split D4RL-style flat data into episodes: an episode ends where ``terminals OR timeouts``.

        A last episode with neither flag (data stopped mid-episode) is kept and its last step
        is marked truncated; ``metadata.extra["unfinished_last_episode"]`` records it.

        Args:
            observations: (N, *obs_shape); actions: (N, *act_shape); rewards: (N,).
            terminals: (N,) 0/1 or bool; timeouts: (N,) 0/1 or bool, or ``None`` (all False).
            next_observations: (N, *obs_shape) or ``None``; when given, the final observation
                of each episode is ``next_observations[last step]``, and (``validate=True``) it
                is checked by :func:`check_next_observations`: finite everywhere and equal to
                ``observations[t + 1]`` inside episodes.

        Example: terminals ``[0,1,1,0,0,1]`` gives 3 episodes of lengths 2, 1, 3.

        Raises:
            DatasetError: ``rewards``/``terminals``/``timeouts`` not one value per step (shape
                ``(N,)`` or ``(N, 1)``); a flag other than 0/1 (NaN, 0.5, 2: naming the field,
                the episode and the dataset row); ``next_observations`` with another row count or
                per-step shape than ``observations``, or (``validate=True``) not finite or not
                equal to the next observation inside an episode; and everything :meth:`validate`
                checks.
        """
        rewards, terminals, timeouts = _flag_columns(observations, rewards, terminals, timeouts, next_observations)
        n = rewards.shape[0]
        ends = np.flatnonzero(terminals | timeouts)  # last step of each finished episode
        truncations = timeouts.copy()
        meta = metadata if metadata is not None else DatasetMetadata()
        if n > 0 and (ends.size == 0 or ends[-1] != n - 1):
            ends = np.append(ends, n - 1)
            truncations[n - 1] = True
            meta = meta.replace(extra={**meta.extra, "unfinished_last_episode": True})
        starts = np.concatenate(([0], ends[:-1] + 1)).astype(np.int64) if ends.size else np.zeros(0, np.int64)
        lengths = (ends + 1 - starts).astype(np.int64)
        final = None
        if next_observations is not None:
            final = np.asarray(next_observations[ends]) if ends.size else None
        if action_space is None:
            action_space = infer_action_space(actions, lengths)
        ds = cls(observations, actions, rewards, terminals, truncations, starts, lengths,
                 final_observations=final, observation_space=observation_space,
                 action_space=action_space, metadata=meta, validate=validate)
        if validate and next_observations is not None:
            check_next_observations(ds, next_observations)
        return ds

    @classmethod
    def from_episodes(
        cls,
        episodes: list[dict],
        *,
        observation_space: gym.Space | None = None,
        action_space: gym.Space | None = None,
        metadata: DatasetMetadata | None = None,
        validate: bool = True,
    ) -> EpisodeDataset:
        """Build from Minari-style episodes: dicts with ``observations`` (L+1, ...), ``actions``
        (L, ...), ``rewards`` (L,), ``terminations`` (L,), ``truncations`` (L,).

        Raises:
            DatasetError: an episode whose observation count is not its action count + 1
                (the message names the episode and both counts), whose per-step arrays
                disagree in length, whose observations/actions have another per-step shape than
                episode 0's, or whose observations/actions/rewards are not integers or floating
                point (strings, booleans, objects).
        """
        obs_parts, act_parts, rew_parts, term_parts, trunc_parts, finals, lengths = [], [], [], [], [], [], []
        step_shapes: dict[str, tuple[int, ...]] = {}  # per-step shape of episode 0
        for i, ep in enumerate(episodes):
            obs, act, n_act = _checked_episode(i, ep, step_shapes)
            obs_parts.append(obs[:-1])
            finals.append(obs[-1])
            act_parts.append(act)
            rew_parts.append(per_step_column("rewards", ep["rewards"], episode=i).astype(np.float64))
            term_parts.append(binary_flags("terminations", per_step_column("terminations", ep["terminations"], episode=i),
                                           episode=i))
            trunc_parts.append(binary_flags("truncations", per_step_column("truncations", ep["truncations"], episode=i),
                                            episode=i))
            lengths.append(n_act)
        if not obs_parts:
            raise DatasetError("dataset has no episodes", field="episodes")
        lengths_arr = np.asarray(lengths, dtype=np.int64)
        starts = np.concatenate(([0], np.cumsum(lengths_arr)[:-1])).astype(np.int64)
        actions = np.concatenate(act_parts, axis=0)
        if action_space is None:
            action_space = infer_action_space(actions, lengths_arr)
        return cls(np.concatenate(obs_parts, axis=0), actions, np.concatenate(rew_parts),
                   np.concatenate(term_parts), np.concatenate(trunc_parts), starts, lengths_arr,
                   final_observations=np.stack(finals, axis=0), observation_space=observation_space,
                   action_space=action_space, metadata=metadata, validate=validate)


class _EpisodeChecks:
    """The validation side of :class:`EpisodeDataset`: :meth:`validate`, the checks it runs in
    order, and :meth:`check_max_ep_len`. Reads the dataset's arrays, episode table and spaces."""

    def _where(self, flat_index: int) -> tuple[int, int]:
        """(episode, step) of a flat index (searches the episode table)."""
        hit = np.flatnonzero((self.starts <= flat_index) & (flat_index < self.starts + self.lengths))
        if hit.size == 0:
            return -1, -1
        e = int(hit[0])
        return e, int(flat_index - self.starts[e])

    def _fail(self, fieldname: str, flat_index: int, what: str) -> DatasetError:
        e, s = self._where(flat_index)
        return DatasetError(f"{fieldname}: episode {e}, step {s} (dataset row {flat_index}): {what}",
                            field=fieldname, episode=e, step=s)

    def validate(self, *, max_ep_len: int | None = None) -> None:
        """Check everything a sampler or agent relies on; raise on the first problem.

        Checks, in order: supported spaces; no empty episode; episodes inside the flat arrays;
        observation shape matches the observation space, with at least one value per step (a
        scalar per step, observations of shape ``(N,)``, is refused: store ``(N, 1)``) and Box
        actions with at least one value; finite observations, actions, rewards and final
        observations (no NaN/inf; observations, actions and final observations of a wider float
        dtype also inside float32's range, ``|x| <= F32_MAX``, since the agents compute in
        float32), and no episode whose sum of ``|rewards|`` overflows float64
        (its returns-to-go would be inf); flags only on an episode's last step and every last
        step flagged (terminated or truncated); actions inside the action space (``Box`` bounds
        inclusive; ``Discrete`` integers in ``[start, start + n)``); episode length <=
        ``max_ep_len`` when given.

        Raises:
            DatasetError: naming the field, the episode and the step (0-based inside the episode).
        """
        self._check_spaces()
        n = self.rewards.shape[0]
        self._check_episode_table(n)
        self._check_images()
        self._check_shapes()
        self._check_finite("observations", self.observations, float32=True)
        self._check_finite("actions", self.actions, float32=True)
        self._check_finite("rewards", self.rewards)
        self._check_return_overflow()
        self._check_final_observations()
        self._check_flags(n)
        self._check_actions()
        if max_ep_len is not None:
            self.check_max_ep_len(max_ep_len)

    def _check_spaces(self) -> None:
        """Supported spaces: a Box or Discrete action space, a Box observation space."""
        if not isinstance(self.action_space, (gym.spaces.Box, gym.spaces.Discrete)):
            raise DatasetError(unsupported_action_space(self.action_space), field="actions")
        if not isinstance(self.observation_space, gym.spaces.Box):
            raise DatasetError(f"observations: unsupported observation space {self.observation_space!r}; "
                               "flatten it when loading (dataset.flatten_observations=true, "
                               "--flatten-observations, flatten_observations=True)", field="observations")

    def _check_episode_table(self, n: int) -> None:
        """At least one episode, none empty, every one inside the ``n`` rows of data."""
        if self.num_episodes == 0:
            raise DatasetError("dataset has no episodes", field="lengths")
        empty = np.flatnonzero(self.lengths <= 0)
        if empty.size:
            e = int(empty[0])
            raise DatasetError(f"episode {e}: empty episode (length {int(self.lengths[e])})", field="lengths", episode=e)
        bad = np.flatnonzero((self.starts < 0) | (self.starts + self.lengths > n))
        if bad.size:
            e = int(bad[0])
            raise DatasetError(f"episode {e}: steps [{self.starts[e]}, {self.starts[e] + self.lengths[e]}) "
                               f"outside the {n} rows of data", field="lengths", episode=e)

    def _check_images(self) -> None:
        """Pixel observations: uint8 ``(C, H, W)`` frames; ``frame_stack`` an integer >= 1, and
        above 1 only on such frames. A float image, a frame of another rank (a grey frame
        without its channel axis, an RGB frame with a time axis) is refused, never converted."""
        k = _checked_frame_stack(self.metadata)
        first = int(self.starts[0]) if self.num_episodes else 0
        shape, dtype = self.frame_shape, np.dtype(self.observations.dtype)
        where = f"observations: episode 0, step 0 (dataset row {first})"
        if len(shape) > 3:
            raise DatasetError(f"{where}: rank {len(shape)} per step {shape}; image observations are stored as "
                               f"one (C, H, W) uint8 frame per step (stack frames with {FRAME_STACK_KEY}, "
                               "channels first)", field="observations", episode=0, step=0)
        if len(shape) == 3 and dtype != np.uint8:
            raise DatasetError(f"{where}: {dtype} images of shape {shape}; image observations are stored as "
                               "uint8 frames (0..255), not converted (a float copy is 4x the memory)",
                               field="observations", episode=0, step=0)
        if k > 1 and not (len(shape) == 3 and dtype == np.uint8):
            raise DatasetError(f"{where}: {FRAME_STACK_KEY}={k} needs uint8 (C, H, W) frames, got {dtype} of "
                               f"shape {shape} per step (rank {len(shape)})", field="observations", episode=0, step=0)

    def _check_shapes(self) -> None:
        """Observations of the observation space's shape (a pixel dataset: its frames of the
        space's shape with the channels of one frame), with at least one value per step (and
        Box actions with at least one)."""
        if tuple(self.observations.shape[1:]) != frame_shape_of(self.observation_space, self.frame_stack):
            raise DatasetError(f"observations: shape {tuple(self.observations.shape[1:])} per step does not match "
                               f"the observation space {self.observation_space!r}", field="observations")
        if len(self.observation_space.shape) == 0:
            raise DatasetError(
                f"observations: one scalar per step (array of shape {tuple(self.observations.shape)}, space "
                f"{self.observation_space!r}); agents read observations as (N, *obs_shape) vectors: store a scalar "
                "observation as shape (N, 1)", field="observations")
        if int(np.prod(self.observation_space.shape)) == 0:
            raise DatasetError(f"observations: {self.observation_space!r} holds no value per step", field="observations")
        if isinstance(self.action_space, gym.spaces.Box) and int(np.prod(self.action_space.shape)) == 0:
            raise DatasetError(f"actions: {self.action_space!r} holds no value per step", field="actions")

    def _check_final_observations(self) -> None:
        """Final observations (when stored) finite and inside float32's range."""
        if self.final_observations is not None:
            fin = self.final_observations.reshape(self.final_observations.shape[0], -1)
            rows = np.flatnonzero(~_in_float32_range(fin).all(axis=1))
            if rows.size:
                e = int(rows[0])
                what = ("is not finite" if not np.isfinite(fin[e]).all() else
                        f"has a value outside float32's range (|x| <= {F32_MAX:g}), inf in the agents' float32")
                raise DatasetError(f"final_observations: episode {e}, step {int(self.lengths[e])} (the observation "
                                   f"after the last action) {what}", field="final_observations",
                                   episode=e, step=int(self.lengths[e]))

    def _check_flags(self, n: int) -> None:
        """Termination/truncation flags only on an episode's last step, and every last step flagged."""
        last = self.starts + self.lengths - 1  # (E,) flat index of each episode's last step
        is_last = np.zeros(n, bool)
        is_last[last] = True
        edges = np.zeros(n + 1, np.int64)  # +1 at each episode start, -1 one past its end
        np.add.at(edges, self.starts, 1)
        np.add.at(edges, self.starts + self.lengths, -1)
        covered = np.cumsum(edges)[:n] > 0  # (N,) row belongs to an episode of the table
        for name, flags in (("terminations", self.terminations), ("truncations", self.truncations)):
            mid = np.flatnonzero(flags & ~is_last & covered)
            if mid.size:
                raise self._fail(name, int(mid[0]), "flag set before the episode's last step")
        unflagged = np.flatnonzero(~(self.terminations[last] | self.truncations[last]))
        if unflagged.size:
            e = int(unflagged[0])
            raise DatasetError(f"terminations/truncations: episode {e}, step {int(self.lengths[e]) - 1} "
                               "(its last step) is neither terminated nor truncated", field="terminations",
                               episode=e, step=int(self.lengths[e]) - 1)

    def _check_finite(self, name: str, arr: ArrayLike, *, float32: bool = False) -> None:
        """Refuse NaN/inf in a floating-point field (streamed over chunks of :data:`SCAN_CHUNK` rows).

        With ``float32`` (observations and actions, which every agent casts to float32), a finite
        value of a wider dtype outside float32's range (``|x| > F32_MAX``, e.g. a float64 1e300,
        which becomes inf in float32 and NaN once normalised) is refused too: nothing is clipped.

        Raises:
            DatasetError: naming the field, the episode, the step and the component at fault.
        """
        dtype = np.dtype(arr.dtype)
        if not np.issubdtype(dtype, np.floating):
            return
        wide = float32 and dtype.itemsize > 4  # float64 (or wider) can hold finite values float32 cannot
        for off, chunk in iter_chunks(arr):
            if chunk.size == 0:
                continue
            lo, hi = chunk.min(), chunk.max()  # NaN propagates; no temporary array (the common case)
            if (-F32_MAX <= lo and hi <= F32_MAX) if wide else (np.isfinite(lo) and np.isfinite(hi)):
                continue
            flat = chunk.reshape(chunk.shape[0], -1)
            ok = (_in_float32_range(flat) if wide else np.isfinite(flat)).all(axis=1)
            if not ok.all():
                row = off + int(np.flatnonzero(~ok)[0])
                value = np.asarray(arr[row]).reshape(-1)
                if not np.isfinite(value).all():
                    raise self._fail(name, row, f"value {value[~np.isfinite(value)][0]} is not finite")
                j = int(np.flatnonzero(~_in_float32_range(value))[0])
                raise self._fail(
                    name, row, f"component {j} = {value[j].item()!r} is outside float32's range (|x| <= {F32_MAX:g}): "
                    f"the agents compute in float32, where it is inf; rescale {name} (nothing is clipped)")

    def _check_return_overflow(self) -> None:
        """Refuse episodes whose sum of ``|rewards|`` is not finite in float64 (every reward finite).

        That sum bounds every return and return-to-go (any ``gamma <= 1``), so past this check
        none of them is ``inf`` and :attr:`episode_returns` (``math.fsum``) cannot overflow.
        """
        absr = np.abs(self.rewards)
        with np.errstate(over="ignore"):
            if np.isfinite(absr.sum()):
                return
            sums = np.array([absr[s:s + n].sum() for s, n in zip(self.starts.tolist(), self.lengths.tolist())])
        bad = np.flatnonzero(~np.isfinite(sums))
        if bad.size:
            e = int(bad[0])
            raise DatasetError(f"rewards: episode {e}: the sum of |rewards| over its {int(self.lengths[e])} steps "
                               "overflows float64 (its return and returns-to-go would be inf)",
                               field="rewards", episode=e)

    def _check_actions(self) -> None:
        space = self.action_space
        if isinstance(space, gym.spaces.Discrete):
            if self.actions.ndim != 1:
                raise DatasetError(f"actions: Discrete actions must have shape (N,), got {self.actions.shape}",
                                   field="actions")
            lo, hi = int(space.start), int(space.start + space.n)
            for off, chunk in iter_chunks(self.actions):
                bad = (chunk != np.round(chunk)) | (chunk < lo) | (chunk >= hi)
                if bad.any():
                    row = off + int(np.flatnonzero(bad)[0])
                    raise self._fail("actions", row, f"action {chunk[row - off]} outside {space!r}")
            return
        if tuple(self.actions.shape[1:]) != tuple(space.shape):
            raise DatasetError(f"actions: shape {tuple(self.actions.shape[1:])} per step does not match "
                               f"the action space {space!r}", field="actions")
        low = np.asarray(space.low, np.float64).reshape(-1)
        high = np.asarray(space.high, np.float64).reshape(-1)
        for off, chunk in iter_chunks(self.actions):
            c = chunk.reshape(chunk.shape[0], -1).astype(np.float64)
            bad = ((c < low) | (c > high)).any(axis=1)
            if bad.any():
                row = off + int(np.flatnonzero(bad)[0])
                a = c[row - off]
                j = int(np.flatnonzero((a < low) | (a > high))[0])
                raise self._fail("actions", row, f"component {j} = {float(a[j])!r} outside the action space bounds "
                                 f"[{float(low[j])!r}, {float(high[j])!r}]")

    def check_max_ep_len(self, max_ep_len: int, option: str = "max_ep_len") -> None:
        """Refuse episodes longer than a model's ``max_ep_len`` (timestep embedding size).

        ``option``: how the limit is named in the message (``"agent.max_ep_len"`` for a run's
        config option).

        Raises:
            ValueError: ``max_ep_len`` < 1.
            DatasetError: naming the first episode with ``length > max_ep_len`` and its length.
        """
        if max_ep_len < 1:
            raise ValueError(f"{option} must be >= 1, got {max_ep_len}")
        too_long = np.flatnonzero(self.lengths > max_ep_len)
        if too_long.size:
            e = int(too_long[0])
            raise DatasetError(
                f"lengths: episode {e} has {int(self.lengths[e])} steps, more than the model's {option}="
                f"{max_ep_len} (step {max_ep_len} has no timestep embedding); raise {option}",
                field="lengths", episode=e, step=max_ep_len)


class EpisodeDataset(_EpisodeConstructors, _EpisodeChecks):
    """Offline episodes as flat step arrays plus an episode table (see the module docstring).

    Args:
        observations: (N, *obs_shape) observation at each step, before the action.
        actions: (N, *act_shape) float for ``Box``; (N,) integer for ``Discrete``. Discrete
            actions given as ``(N, 1)`` are stored as ``(N,)``: one action per step either way,
            so this is a layout, not a change of values (like rewards of shape ``(N, 1)``);
            lazy ones are then read into memory (N integers).
        rewards: (N,) reward after each action (raw units; stored as float64).
        terminations: (N,) bool, True at the last step of an episode that reached a terminal
            state. Only an episode's last step may carry a flag.
        truncations: (N,) bool, True at the last step of an episode cut by a time limit (or by
            the end of data collection).
        starts: (E,) flat index of each episode's first step.
        lengths: (E,) number of steps (actions) per episode, all > 0.
        final_observations: (E, *obs_shape) observation after the last action, or ``None``.
        observation_space: a ``gym.spaces.Box`` (Dict/Tuple are flattened by the loaders); for a
            pixel dataset (``metadata.extra["frame_stack"]`` = k > 1) the space of one stored
            frame ``(C, H, W)`` or the stacked one ``(k * C, H, W)`` (kept as the stacked one).
        action_space: ``gym.spaces.Box`` or ``gym.spaces.Discrete``.
        metadata: :class:`DatasetMetadata`.
        validate: run :meth:`validate` now (loaders do; views created by ``select`` skip it).

    Raises:
        DatasetError: on inconsistent shapes, observations/actions/rewards that are not
            integers or floating point (bool, strings), or (``validate=True``) any problem
            listed in :meth:`validate`.

    Without ``observation_space`` the observations get the widest Box of their dtype
    (:func:`unbounded_box`: ``[-inf, inf]`` for floats, the dtype's range for integers, so
    ``uint8`` images work).
    """

    def __init__(
        self,
        observations: ArrayLike,
        actions: ArrayLike,
        rewards: np.ndarray,
        terminations: np.ndarray,
        truncations: np.ndarray,
        starts: np.ndarray,
        lengths: np.ndarray,
        *,
        final_observations: np.ndarray | None = None,
        observation_space: gym.Space | None = None,
        action_space: gym.Space | None = None,
        metadata: DatasetMetadata | None = None,
        validate: bool = True,
    ):
        _check_numeric("observations", observations)
        _check_numeric("actions", actions)
        if isinstance(action_space, gym.spaces.Discrete) and tuple(actions.shape[1:]) == (1,):
            actions = per_step_column("actions", np.asarray(actions))  # one action per step: a layout, as for rewards
        self.observations = observations
        self.actions = actions
        rewards = per_step_column("rewards", rewards)
        _check_numeric("rewards", rewards)
        self.rewards = rewards.astype(np.float64, copy=False)
        self.terminations = binary_flags("terminations", per_step_column("terminations", terminations))
        self.truncations = binary_flags("truncations", per_step_column("truncations", truncations))
        self.starts = np.asarray(starts, dtype=np.int64).reshape(-1)
        self.lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        self.final_observations = None if final_observations is None else np.asarray(final_observations)
        self.metadata = metadata if metadata is not None else DatasetMetadata()
        n = self.rewards.shape[0]
        for name, arr in (("observations", observations), ("actions", actions),
                          ("terminations", self.terminations), ("truncations", self.truncations)):
            if arr.shape[0] != n:
                raise DatasetError(f"{name}: {arr.shape[0]} rows but rewards has {n}", field=name)
        if self.starts.shape != self.lengths.shape:
            raise DatasetError(f"episode table: {self.starts.size} starts but {self.lengths.size} lengths",
                               field="lengths")
        if self.final_observations is not None and self.final_observations.shape[0] != self.starts.size:
            raise DatasetError(
                f"final_observations: {self.final_observations.shape[0]} rows for {self.starts.size} episodes",
                field="final_observations")
        space = observation_space if observation_space is not None else unbounded_box(
            tuple(observations.shape[1:]), observations.dtype)
        if tuple(space.shape) == tuple(observations.shape[1:]):  # a frame's space: the observation stacks k
            space = stacked_space(space, _checked_frame_stack(self.metadata))
        self.observation_space = space
        if action_space is None:
            raise DatasetError("action_space is required", field="actions")
        self.action_space = action_space
        self.cum_lengths = np.concatenate(([0], np.cumsum(self.lengths))).astype(np.int64)  # (E+1,)
        self._returns: np.ndarray | None = None
        if validate:
            self.validate()

    # ------------------------------------------------------------------ basic properties
    @property
    def num_episodes(self) -> int:
        """E, number of episodes."""
        return int(self.starts.size)

    @property
    def num_steps(self) -> int:
        """Total steps (actions) over the episodes of the table."""
        return int(self.cum_lengths[-1])

    def __len__(self) -> int:
        return self.num_episodes

    @property
    def observation_shape(self) -> tuple[int, ...]:
        """Shape of one observation as the samplers hand it to an agent (the step axis dropped;
        a pixel dataset's stacked ``(k * C, H, W)``): the observation space's shape."""
        return tuple(self.observation_space.shape)

    @property
    def frame_shape(self) -> tuple[int, ...]:
        """Shape of one stored step, ``observations.shape[1:]`` (a pixel dataset's ``(C, H, W)``
        frame; the observation itself when ``frame_stack`` is 1)."""
        return tuple(self.observations.shape[1:])

    @property
    def frame_stack(self) -> int:
        """Frames per observation (``metadata.extra["frame_stack"]``, 1 when absent). Not
        checked here: the constructor refuses a value that is not an integer in ``[1, MAX_FRAME_STACK]``."""
        k = self.metadata.extra.get(FRAME_STACK_KEY, 1)
        return k if isinstance(k, int) and not isinstance(k, bool) and k >= 1 else 1

    @property
    def is_pixel(self) -> bool:
        """uint8 ``(C, H, W)`` frames (:mod:`rl_tformers.envs.frames`)."""
        return is_image_shape(self.frame_shape) and np.dtype(self.observations.dtype) == np.uint8

    @property
    def action_shape(self) -> tuple[int, ...]:
        """Shape of one action: ``()`` for discrete actions stored as integers."""
        return tuple(self.actions.shape[1:])

    @property
    def discrete_actions(self) -> bool:
        """True when ``action_space`` is a ``gymnasium.spaces.Discrete``."""
        return isinstance(self.action_space, gym.spaces.Discrete)

    @property
    def is_lazy(self) -> bool:
        """True when observations or actions are read from disk on access (not NumPy arrays)."""
        return not (isinstance(self.observations, np.ndarray) and isinstance(self.actions, np.ndarray))

    @property
    def episode_returns(self) -> np.ndarray:
        """(E,) undiscounted return of each episode (raw reward units, float64; cached).

        Each sum is exactly rounded (``math.fsum``), so it does not depend on summation order:
        the returns a rollout accumulated with ``math.fsum`` are reproduced bit for bit.
        """
        if self._returns is None:
            r = self.rewards.tolist()
            self._returns = np.array([math.fsum(r[s:s + n]) for s, n in zip(self.starts.tolist(), self.lengths.tolist())],
                                     dtype=np.float64)
        return self._returns

    def is_contiguous(self) -> bool:
        """True when episodes tile ``[starts[0], starts[0] + num_steps)`` in flat order."""
        return bool(self.num_episodes > 0 and np.array_equal(self.starts[1:], self.starts[:-1] + self.lengths[:-1]))

    def episode(self, i: int) -> Episode:
        """Views of episode ``i`` (position in the episode table)."""
        if not -self.num_episodes <= i < self.num_episodes:
            raise IndexError(f"episode {i} out of range for {self.num_episodes} episodes")
        i = i % self.num_episodes
        s, n = int(self.starts[i]), int(self.lengths[i])
        return Episode(
            np.asarray(self.observations[s:s + n]), np.asarray(self.actions[s:s + n]), self.rewards[s:s + n],
            self.terminations[s:s + n], self.truncations[s:s + n],
            None if self.final_observations is None else self.final_observations[i])

    def __iter__(self) -> Iterator[Episode]:
        for i in range(self.num_episodes):
            yield self.episode(i)

    def flat_indices(self) -> np.ndarray:
        """(N,) flat index of every step in dataset order (episode table order)."""
        if self.is_contiguous():
            return np.arange(self.starts[0], self.starts[0] + self.num_steps, dtype=np.int64)
        ep = np.repeat(np.arange(self.num_episodes), self.lengths)
        return self.starts[ep] + (np.arange(self.num_steps) - self.cum_lengths[ep])

    def locate(self, virtual_steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Map virtual steps ``v`` (any shape, 0 <= v < num_steps) to ``(episode, step_in_episode)``.

        O(log E) per entry (``searchsorted`` on the cumulative lengths); never touches the data.
        """
        v = np.asarray(virtual_steps, dtype=np.int64)
        ep = np.searchsorted(self.cum_lengths, v, side="right") - 1
        return ep, v - self.cum_lengths[ep]

    def select(self, episodes: np.ndarray) -> EpisodeDataset:
        """A dataset holding the given episodes (indices or bool mask), sharing the flat arrays."""
        idx = np.asarray(episodes)
        if idx.dtype == bool:
            idx = np.flatnonzero(idx)
        idx = idx.astype(np.int64)
        out = EpisodeDataset(
            self.observations, self.actions, self.rewards, self.terminations, self.truncations,
            self.starts[idx], self.lengths[idx],
            final_observations=None if self.final_observations is None else self.final_observations[idx],
            observation_space=self.observation_space, action_space=self.action_space,
            metadata=self.metadata, validate=False)
        if self._returns is not None:
            out._returns = self._returns[idx]
        return out

    def materialize(self) -> EpisodeDataset:
        """An in-memory, contiguous copy (reads lazy arrays)."""
        flat = self.flat_indices()
        obs = np.asarray(self.observations[flat])
        act = np.asarray(self.actions[flat])
        starts = self.cum_lengths[:-1].copy()
        out = EpisodeDataset(obs, act, self.rewards[flat], self.terminations[flat], self.truncations[flat],
                             starts, self.lengths.copy(), final_observations=self.final_observations,
                             observation_space=self.observation_space, action_space=self.action_space,
                             metadata=self.metadata, validate=False)
        return out

    # ------------------------------------------------------------------ summaries
    def summary(self) -> dict:
        """The ``rl-tformers dataset info`` record (JSON-serialisable)."""
        ret = self.episode_returns
        last = self.starts + self.lengths - 1  # (E,) each episode's last step
        term, trunc = self.terminations[last], self.truncations[last]
        out = {
            "dataset": self.metadata.location,
            "source": self.metadata.source,
            "dataset_id": self.metadata.dataset_id,
            "env_id": self.metadata.env_id,
            "episodes": self.num_episodes,
            "steps": self.num_steps,
            "return_mean": float(ret.mean()),
            "return_std": float(ret.std()),
            "return_min": float(ret.min()),
            "return_max": float(ret.max()),
            "length_min": int(self.lengths.min()),
            "length_max": int(self.lengths.max()),
            "length_mean": float(self.lengths.mean()),
            # each episode counted once: one whose last step is flagged both terminal and truncated
            # (a terminal state reached on the time limit's last step) is a termination, as in
            # gymnasium (terminated decides: no bootstrapping) and the offline agents, which read
            # the terminal flag; the data keeps both flags, and the last key counts such episodes
            "terminations": int(term.sum()),
            "truncations": int((trunc & ~term).sum()),
            "terminated_and_truncated": int((term & trunc).sum()),
            # the data stopped mid-episode: its last episode was cut and marked truncated by the loader
            "unfinished_last_episode": bool(self.metadata.extra.get("unfinished_last_episode", False)),
            "observation_shape": list(self.observation_shape),
            "observation_dtype": str(np.dtype(self.observations.dtype)),
            "frame_stack": self.frame_stack,
            "observation_bytes": int(np.dtype(self.observations.dtype).itemsize * math.prod(self.observations.shape)),
            "observation_space": space_to_str(self.observation_space),
            "action_shape": list(self.action_shape),
            "action_space": space_to_str(self.action_space),
            "has_final_observations": self.final_observations is not None,
            "normalized_return_mean": None,
            "ref_min_score": None,
            "ref_max_score": None,
            "pomdp": self.metadata.pomdp,
        }
        refs = reference_scores(self)
        if refs is not None:
            out["ref_min_score"], out["ref_max_score"] = float(refs[0]), float(refs[1])
            out["normalized_return_mean"] = float(normalized_score(self, float(ret.mean())))
        return out

    def __repr__(self) -> str:
        return (f"EpisodeDataset({self.metadata.location or 'in memory'}: {self.num_episodes} episodes, "
                f"{self.num_steps} steps, obs {self.observation_shape}, actions {self.action_space!r})")


def check_next_observations(dataset: EpisodeDataset, next_observations: ArrayLike) -> None:
    """Check a D4RL ``next_observations`` column against the episodes of ``dataset``.

    ``next_observations (N, *obs_shape)`` is indexed like the flat arrays of ``dataset``
    (``dataset.observations``). Every row must be finite, and inside an episode (each step but
    its last) it must equal the next step's observation: ``next_observations[r] ==
    observations[r + 1]``, exactly (in the less precise of the two float dtypes when they
    differ). A mismatch means the flags miss an episode boundary (old D4RL files without
    ``timeouts`` run episodes together) or the columns are misaligned. Without this check it
    would pass unseen: the data layer reads ``observations`` inside episodes and
    ``next_observations`` only at episode ends (:attr:`EpisodeDataset.final_observations`).
    Streams over chunks of :data:`SCAN_CHUNK` rows (lazy arrays stay on disk).

    Raises:
        DatasetError: field ``next_observations``, with the episode, the step and the dataset row
            of the first non-finite value or mismatch.
    """
    obs = dataset.observations
    n = int(obs.shape[0])
    if int(next_observations.shape[0]) != n:
        raise DatasetError(f"next_observations: {next_observations.shape[0]} rows but observations has {n}",
                           field="next_observations")
    inside = np.zeros(n + 1, np.int64)  # +1 over the steps of an episode that have a next step in it
    np.add.at(inside, dataset.starts, 1)
    np.add.at(inside, dataset.starts + dataset.lengths - 1, -1)
    inside = np.cumsum(inside)[:n] > 0  # (N,) row r is in an episode and r + 1 is in the same one
    od, nd = np.dtype(obs.dtype), np.dtype(next_observations.dtype)
    cmp = None
    if od != nd and np.issubdtype(od, np.floating) and np.issubdtype(nd, np.floating):
        cmp = od if od.itemsize <= nd.itemsize else nd
    for off, nxt in iter_chunks(next_observations):
        rows = nxt.shape[0]
        flat_n = nxt.reshape(rows, -1)
        if np.issubdtype(nd, np.floating):
            ok = np.isfinite(flat_n).all(axis=1)
            if not ok.all():
                r = off + int(np.flatnonzero(~ok)[0])
                v = flat_n[r - off]
                raise dataset._fail("next_observations", r, f"value {v[~np.isfinite(v)][0]} is not finite")
        check = inside[off: off + rows]
        if not check.any():
            continue
        following = np.asarray(obs[off + 1: min(off + rows + 1, n)])  # observations[r + 1]
        m = following.shape[0]  # rows - 1 at the very end of the data (its last row is never inside)
        a, b = flat_n[:m], following.reshape(m, -1)
        if cmp is not None:
            a, b = a.astype(cmp), b.astype(cmp)
        bad = check[:m] & ~(a == b).all(axis=1)
        if bad.any():
            j = int(np.flatnonzero(bad)[0])
            k = int(np.flatnonzero(a[j] != b[j])[0])
            raise dataset._fail(
                "next_observations", off + j,
                f"component {k} = {a[j][k].item()!r} but the next step's observation has {b[j][k].item()!r}; inside "
                "an episode next_observations[t] must equal observations[t + 1]: the terminals/timeouts flags miss "
                "an episode end here (old D4RL files have no timeouts), or the columns are misaligned")


def _checked_frame_stack(metadata: DatasetMetadata) -> int:
    """``metadata.extra["frame_stack"]`` (1 when absent).

    Raises:
        DatasetError: (field ``frame_stack``) a value that is not an integer in
            ``[1, MAX_FRAME_STACK]``.
    """
    k = metadata.extra.get(FRAME_STACK_KEY, 1)
    if not (isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= MAX_FRAME_STACK):
        raise DatasetError(f"{FRAME_STACK_KEY}: {k!r} in the metadata is not an integer in [1, {MAX_FRAME_STACK}] "
                           "(frames per observation)", field=FRAME_STACK_KEY)
    return k


def frame_shape_of(space: gym.Space, frame_stack: int) -> tuple[int, ...]:
    """The shape of one stored frame of observations in ``space`` stacked ``frame_stack`` times on
    the channel axis: ``(k * C, H, W)`` -> ``(C, H, W)``; the space's shape when ``k`` is 1."""
    shape = tuple(space.shape)
    if frame_stack == 1 or len(shape) != 3 or shape[0] % frame_stack:
        return shape
    return (shape[0] // frame_stack, *shape[1:])


def stacked_space(space: gym.Space, frame_stack: int) -> gym.Space:
    """The observation space of ``frame_stack`` frames of ``space`` stacked on the channel axis:
    ``Box(0, 255, (C, H, W), uint8)`` -> ``Box(0, 255, (k * C, H, W), uint8)``; ``space`` itself
    when ``k`` is 1 or ``space`` is not a ``(C, H, W)`` Box."""
    if frame_stack == 1 or not isinstance(space, gym.spaces.Box) or len(space.shape) != 3:
        return space
    low = np.concatenate([space.low] * frame_stack, axis=0)
    high = np.concatenate([space.high] * frame_stack, axis=0)
    return gym.spaces.Box(low, high, dtype=space.dtype)


def _in_float32_range(a: np.ndarray) -> np.ndarray:
    """Elementwise ``|a| <= F32_MAX`` (False for NaN/inf): the value is finite in float32."""
    with np.errstate(invalid="ignore"):
        return np.abs(a) <= F32_MAX


def unbounded_box(shape: tuple[int, ...], dtype) -> gym.spaces.Box:
    """The widest ``Box`` of ``shape`` and ``dtype``: ``[-inf, inf]`` for floats, the dtype's
    ``[min, max]`` for integers (``gymnasium.spaces.Box`` refuses infinite bounds for unsigned
    integers, e.g. ``uint8`` image observations)."""
    dtype = np.dtype(dtype)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return gym.spaces.Box(info.min, info.max, shape=shape, dtype=dtype)
    return gym.spaces.Box(-np.inf, np.inf, shape=shape, dtype=dtype)


def _check_numeric(name: str, arr: np.ndarray, *, episode: int | None = None) -> None:
    """Refuse arrays that are not integers or floating point (bool, bytes, str, object)."""
    dtype = np.dtype(arr.dtype)
    if not (np.issubdtype(dtype, np.integer) or np.issubdtype(dtype, np.floating)):
        where = f"episode {episode}: " if episode is not None else ""
        raise DatasetError(f"{name}: {where}dtype {dtype} is not numeric (integer or floating point)",
                           field=name, episode=episode)


def per_step_column(name: str, values: ArrayLike, *, episode: int | None = None) -> np.ndarray:
    """``values`` as an (N,) array: one scalar per step, given as shape ``(N,)`` or ``(N, 1)``.

    Raises:
        DatasetError: any other shape (e.g. rewards of shape (N, 2)), naming ``name`` and the shape.
    """
    a = np.asarray(values)
    if a.ndim == 0 or (a.ndim > 1 and int(np.prod(a.shape[1:])) != 1):
        where = f"episode {episode}: " if episode is not None else ""
        raise DatasetError(f"{name}: {where}shape {a.shape}, expected one value per step (shape (N,))",
                           field=name, episode=episode)
    return a.reshape(-1)


def binary_flags(name: str, flags: ArrayLike, *, episode: int | None = None,
                 other_ends: ArrayLike | None = None) -> np.ndarray:
    """(N,) flags as bool, refusing anything but 0/1 (or bool): NaN, 0.5 or 2 are not read as True.

    Args:
        name: the field, for the message (``terminals``, ``timeouts``, ``terminations``...).
        flags: (N,) bool or numbers.
        episode: the episode these flags belong to (Minari episodes), or None for flat D4RL
            columns (the message then gives the dataset row and the episode it falls in,
            counting episodes by the flags set to 1 before it).
        other_ends: (N,) the other end-of-episode column of flat data (``timeouts`` for
            ``terminals`` and vice versa), so that the episode count in the message is right.

    Raises:
        DatasetError: naming the field, the episode, the step and the offending value.
    """
    a = np.asarray(flags).reshape(-1)
    if a.dtype == bool:
        return a
    if not (np.issubdtype(a.dtype, np.number) or a.dtype == object):
        raise DatasetError(f"{name}: dtype {a.dtype} is not boolean or numeric", field=name, episode=episode)
    with np.errstate(invalid="ignore"):
        ok = (a == 0) | (a == 1)
    if not ok.all():
        row = int(np.flatnonzero(~ok)[0])
        if episode is not None:
            ep, step, where = episode, row, f"episode {episode}, step {row}"
        else:
            end = a[:row] == 1
            if other_ends is not None:
                end = end | (np.asarray(other_ends).reshape(-1)[:row] == 1)
            ends = np.flatnonzero(end)
            ep = int(ends.size)
            step = row - (int(ends[-1]) + 1 if ends.size else 0)
            where = f"dataset row {row} (episode {ep}, step {step}, counting episodes by the flags before it)"
        value = a[row].item() if isinstance(a[row], np.generic) else a[row]
        raise DatasetError(f"{name}: {where}: value {value!r} is not 0 or 1 (flags must be binary; "
                           f"nothing is rounded)", field=name, episode=ep, step=step)
    return a == 1


#: What to do with multi-dimensional discrete actions, which no agent takes (see :func:`unsupported_action_space`).
MULTI_DISCRETE_FIXES = (
    "to train on them, either treat the actions as continuous values with a Box action space of their "
    "per-step shape (an HDF5 file: action_space=gym.spaces.Box(low, high, shape) for load_dataset, or "
    "dataset.env_id / the file's env_id attribute naming an environment whose action space is that Box; "
    "evaluation then needs such an environment, agent.env_id), or encode each action as one Discrete index "
    "(numpy.ravel_multi_index over the components' sizes) and store actions of shape (N,)")


def unsupported_action_space(space: gym.Space, minari: bool = False) -> str:
    """The ``actions:`` message refusing an action space other than ``Box`` / ``Discrete``; for
    ``MultiDiscrete`` / ``MultiBinary`` it says that multi-dimensional discrete actions are not
    supported and what to do instead (:data:`MULTI_DISCRETE_FIXES`; ``minari``: the space is a
    Minari dataset's own, which no option replaces, so the data must be rewritten first)."""
    if isinstance(space, (gym.spaces.MultiDiscrete, gym.spaces.MultiBinary)):
        convert = ("a Minari dataset carries its own action space: write its episodes to a D4RL-layout .hdf5 file "
                   "(observations, actions, rewards, terminals, timeouts) and load that; " if minari else "")
        return (f"actions: action space {space!r}: multi-dimensional discrete actions (MultiDiscrete/MultiBinary) "
                f"are not supported (the agents take one Discrete action per step or a Box); {convert}"
                f"{MULTI_DISCRETE_FIXES}")
    return f"actions: unsupported action space {space!r}; supported: Box, Discrete"


def infer_action_space(actions: ArrayLike, lengths: np.ndarray | None = None) -> gym.Space:
    """Action space when the source stores none: ``Discrete(max + 1)`` for integer actions of
    shape ``(N,)`` or ``(N, 1)`` (one integer per step: :class:`EpisodeDataset` stores them as
    ``(N,)``), an unbounded ``Box`` for float actions (the bounds check is then a no-op; pass
    the real space to the loader when you know it).

    Args:
        actions: (N, *act_shape) flat actions.
        lengths: (E,) lengths of the episodes, which tile the rows in order from row 0 (as in
            :meth:`EpisodeDataset.from_flags` / :meth:`EpisodeDataset.from_episodes`), so that
            an error names the episode and the step; ``None``: it names the dataset row only.

    Raises:
        DatasetError: integer actions with more than one value per step (multi-dimensional
            discrete actions), or a negative integer action (an inferred Discrete space starts
            at 0; the message names the episode and the step, and how to give the space).
    """
    dtype = np.dtype(actions.dtype)
    if np.issubdtype(dtype, np.integer):
        shape = tuple(actions.shape)
        if len(shape) != 1 and not (len(shape) == 2 and shape[1] == 1):
            raise DatasetError(
                f"actions: integer actions of shape {shape} and no action space: one Discrete action "
                f"per step is an integer array of shape (N,); {shape[1:]} integers per step are "
                f"multi-dimensional discrete actions (MultiDiscrete/MultiBinary), which are not supported; "
                f"{MULTI_DISCRETE_FIXES}", field="actions")
        a = np.asarray(actions).reshape(-1)
        if a.size and a.min() < 0:
            row = int(np.flatnonzero(a < 0)[0])
            where, ep, step = f"dataset row {row}", None, None
            if lengths is not None:
                ends = np.cumsum(np.asarray(lengths, np.int64))
                ep = int(np.searchsorted(ends, row, side="right"))
                step = row - (int(ends[ep - 1]) if ep else 0)
                where = f"episode {ep}, step {step} ({where})"
            raise DatasetError(
                f"actions: {where}: negative integer action {int(a[row])} and no action space to check it against "
                f"(a Discrete space inferred from the data starts at 0); name the task the data comes from, whose "
                f"action space is then used: dataset.env_id=<gymnasium id> in a run config, or the HDF5 file's "
                f"env_id attribute (or its action_space attribute, written by save_d4rl_hdf5 / `rl-tformers dataset "
                f"export`); in Python, pass action_space= to load_dataset, e.g. gym.spaces.Discrete(n, start=-1)",
                field="actions", episode=ep, step=step)
        return gym.spaces.Discrete(int(a.max()) + 1 if a.size else 1)
    return gym.spaces.Box(-np.inf, np.inf, shape=tuple(actions.shape[1:]), dtype=dtype)
