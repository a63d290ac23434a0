"""A Minari dataset opened lazily: counts from its metadata, episodes read when asked for.

:func:`rl_tformers.envs.loaders.open_minari` reads a dataset's ``metadata.json`` (spaces,
counts, reference scores, the project's own record) and nothing of its episode file; the
:class:`MinariEpisodes` it returns reads episodes only when they are asked for, through Minari's
own reader (``MinariStorage.get_episodes``, one open of ``main_data.hdf5`` per call):

* :attr:`~MinariEpisodes.num_episodes` / :attr:`~MinariEpisodes.num_steps`: Minari's metadata
  (``total_episodes`` / ``total_steps``), no episode read;
* :meth:`~MinariEpisodes.episodes` and :meth:`~MinariEpisodes.sample_episodes`: the episodes
  named or drawn, read and validated as an in-memory
  :class:`~rl_tformers.envs.dataset.EpisodeDataset` of those episodes only;
* :meth:`~MinariEpisodes.load`: every episode, the dataset training reads (its returns-to-go,
  normalisation statistics and reward scale need every step), built exactly as
  :func:`~rl_tformers.envs.loaders.load_minari` builds it (it is that function's reader).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import gymnasium as gym
import numpy as np
from rl_tformers.envs.dataset import (
    H5_READ_ERRORS,
    DatasetError,
    DatasetMetadata,
    EpisodeDataset,
    damaged_message,
    reading_hdf5,
)

#: the arrays of one episode group of Minari's ``main_data.hdf5``
EPISODE_FIELDS = ("observations", "actions", "rewards", "terminations", "truncations")


class MinariEpisodes:
    """The episodes of one Minari dataset, read on demand (see the module docstring).

    Args:
        md: the ``minari.MinariDataset`` (opening it reads ``metadata.json`` only).
        observation_space: the observation space of the returned datasets (flattened when
            ``flatten`` is given).
        action_space: the dataset's action space (``Box`` or ``Discrete``).
        metadata: the :class:`DatasetMetadata` every returned dataset carries.
        flatten: ``(L+1, ...) raw observations -> (L+1, D)`` for Dict/Tuple observation spaces,
            ``None`` for a Box.
        where: the dataset's folder, for messages.
    """

    def __init__(self, md, *, observation_space: gym.Space, action_space: gym.Space, metadata: DatasetMetadata,
                 flatten: Callable[[object], np.ndarray] | None, where: str):
        self.minari_dataset = md
        self.observation_space = observation_space
        self.action_space = action_space
        self.metadata = metadata
        self._flatten = flatten
        self._where = where
        self.num_episodes = int(md.total_episodes)  # E, from the metadata Minari read when opening: no episode read
        self.num_steps = int(md.total_steps)

    def __len__(self) -> int:
        return self.num_episodes

    def __repr__(self) -> str:
        return (f"MinariEpisodes({self._where}: {self.num_episodes} episodes, {self.num_steps} steps, "
                f"obs {tuple(self.observation_space.shape)}, actions {self.action_space!r})")

    # ------------------------------------------------------------------ reading
    def _read(self, indices: Sequence[int]) -> Iterator[dict]:
        """Minari-style episode dicts (observations flattened when needed) of ``indices``, in order."""
        for ep in self.minari_dataset.storage.get_episodes(indices):
            obs = ep["observations"]
            yield {"observations": self._flatten(obs) if self._flatten is not None else obs,
                   "actions": ep["actions"], "rewards": ep["rewards"],
                   "terminations": ep["terminations"], "truncations": ep["truncations"]}

    def _read_all(self, indices: Sequence[int]) -> list[dict]:
        """Every episode of ``indices`` (Minari's reader).

        Raises:
            DatasetError: an episode that cannot be read, naming the data file, the episode id
                and the field where h5py fails (:meth:`_unreadable`).
        """
        try:
            return list(self._read(indices))
        except DatasetError:
            raise
        except Exception as exc:  # an episode group or array missing from main_data.hdf5, unreadable data
            raise self._unreadable(indices, exc) from exc

    def _unreadable(self, indices: Sequence[int], exc: BaseException) -> DatasetError:
        """Why Minari could not read ``indices`` (it raised ``exc``): the first episode and field
        of its ``main_data.hdf5`` that h5py cannot read (a damaged object header or compressed
        chunk), each read again on its own; else ``exc`` itself, with the dataset's folder."""
        path = Path(self.minari_dataset.storage.data_path) / "main_data.hdf5"
        reason = " ".join(str(exc).split())  # one line: h5py's read errors hold a ctime() with its newline
        fallback = DatasetError(f"{self._where}: cannot read the episodes ({type(exc).__name__}: {reason})")
        if not path.is_file():
            what = "a directory" if path.is_dir() else "not a file" if path.exists() else "missing"
            return DatasetError(f"{path}: {what}; a Minari dataset keeps its episodes in this HDF5 file",
                                field="main_data.hdf5")
        import h5py  # noqa: PLC0415 - Minari's own dependency, needed only to name a damaged field

        try:
            with reading_hdf5(path, None), h5py.File(path, "r") as f:
                for i in map(int, indices):
                    if f"episode_{i}" not in f:
                        return DatasetError(f"{path}: episode {i}: no group 'episode_{i}' though metadata.json "
                                            f"counts it; the file is incomplete or damaged", episode=i)
                    group = f[f"episode_{i}"]
                    for key in EPISODE_FIELDS:
                        if key not in group:
                            return DatasetError(f"{path}: episode {i}: no array {key!r} in its group; the file is "
                                                f"incomplete or damaged", field=key, episode=i)
                        try:
                            _read_node(group[key])
                        except H5_READ_ERRORS as err:
                            return DatasetError(f"{damaged_message(path, key, err)} (episode {i})",
                                                field=key, episode=i)
        except DatasetError as err:  # the file itself cannot be opened
            return err
        return fallback

    def _build(self, episodes: list[dict], validate: bool, max_ep_len: int | None) -> EpisodeDataset:
        ds = EpisodeDataset.from_episodes(episodes, observation_space=self.observation_space,
                                          action_space=self.action_space, metadata=self.metadata, validate=False)
        if validate:
            ds.validate(max_ep_len=max_ep_len)
        return ds

    def load(self, *, validate: bool = True, max_ep_len: int | None = None) -> EpisodeDataset:
        """Every episode, in dataset order, in memory (what training and ``dataset info`` read).

        Raises:
            DatasetError: an episode that cannot be read, malformed data (see
                :meth:`EpisodeDataset.from_episodes` and :meth:`EpisodeDataset.validate`), or
                an episode table that disagrees with the metadata's ``total_steps``.
        """
        try:
            ds = self._build(self._read_all(range(self.num_episodes)), validate, max_ep_len)
        except DatasetError as exc:
            if str(exc).startswith(str(Path(self._where).parent)):
                raise
            raise DatasetError(f"{self._where}: {exc}", field=exc.field, episode=exc.episode, step=exc.step) from exc
        if validate and ds.num_steps != self.num_steps:
            raise DatasetError(f"{self._where}: metadata.json says total_steps={self.num_steps} but the "
                               f"{ds.num_episodes} episodes hold {ds.num_steps} steps", field="total_steps")
        return ds

    def episodes(self, indices: Sequence[int] | np.ndarray, *, validate: bool = True,
                 max_ep_len: int | None = None) -> EpisodeDataset:
        """The episodes ``indices`` (Minari episode ids, in the order given), read now.

        Only these episodes are read. They are validated (observation counts, flags,
        finiteness, action bounds: :meth:`EpisodeDataset.validate`); a message names the Minari
        episode id (the episodes are checked one by one once the whole set has failed).

        Returns:
            An :class:`EpisodeDataset` of ``len(indices)`` episodes, episode ``j`` of it being
            Minari episode ``indices[j]``.

        Raises:
            IndexError: an index outside ``[0, num_episodes)``, or no index.
            DatasetError: an episode that cannot be read or is malformed (naming its id).
        """
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size == 0:
            raise IndexError("no episode index given")
        out = idx[(idx < 0) | (idx >= self.num_episodes)]
        if out.size:
            raise IndexError(f"episode {int(out[0])} out of range for {self.num_episodes} episodes")
        eps = self._read_all(idx.tolist())
        try:
            return self._build(eps, validate, max_ep_len)
        except DatasetError:
            for i, ep in zip(idx.tolist(), eps):  # the first malformed episode, named by its Minari id
                try:
                    self._build([ep], True, max_ep_len)
                except DatasetError as exc:
                    raise _renumbered(exc, i, self._where) from exc
            raise

    def sample_indices(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """(n,) distinct episode ids drawn uniformly by ``rng.choice(num_episodes, n, replace=False)``
        (the draw of Minari's ``MinariDataset.sample_episodes``).

        Raises:
            ValueError: ``n`` < 1 or more than :attr:`num_episodes`.
        """
        if not 1 <= n <= self.num_episodes:
            raise ValueError(f"cannot sample {n} distinct episodes from {self.num_episodes}")
        return rng.choice(self.num_episodes, size=n, replace=False)

    def sample_episodes(self, n: int, rng: np.random.Generator, *, validate: bool = True) -> EpisodeDataset:
        """``n`` distinct episodes drawn uniformly (:meth:`sample_indices`), read now
        (:meth:`episodes`): the same draws as Minari's ``sample_episodes`` for the same generator."""
        return self.episodes(self.sample_indices(n, rng), validate=validate)


def check_counts(meta: dict, where: str) -> None:
    """Refuse ``metadata.json`` counts (``total_episodes``, ``total_steps``) that are not whole
    numbers >= 0, before Minari uses them (it would take ``total_episodes=2.5`` as 3 episodes
    and ``-1`` as none). An absent ``total_steps`` passes (Minari sums the episodes' own counts).

    Raises:
        DatasetError: field ``total_episodes`` or ``total_steps``, naming the value and ``where``.
    """
    for key in ("total_episodes", "total_steps"):
        value = meta.get(key)
        if value is None and key == "total_steps":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise DatasetError(f"{where}: metadata.json {key}={value!r} is not a count (a whole number >= 0); "
                               f"the metadata is damaged or was edited", field=key)


def _read_node(node) -> None:
    """Read every array under ``node`` (an h5py Dataset, or a Group of a Dict/Tuple space)."""
    if hasattr(node, "keys"):
        for key in node:
            _read_node(node[key])
    else:
        node[()]


def _renumbered(exc: DatasetError, episode: int, where: str) -> DatasetError:
    """``exc``, raised on a one-episode dataset (its episode 0), for Minari episode ``episode``."""
    message = re.sub(r"\bepisode 0\b", f"episode {episode}", str(exc))
    if "episode" not in message:
        message = f"episode {episode}: {message}"
    return DatasetError(f"{where}: {message}", field=exc.field, episode=episode, step=exc.step)
