"""Loading offline data into :class:`~rl_tformers.envs.dataset.EpisodeDataset`.

Sources:

* **Minari** datasets by id (``"rlt/hopper-v5/medium-v0"``, ``"mujoco/hopper/medium-v0"``) or by
  folder, read with ``minari.MinariDataset``. An id is looked up in the project's data root
  (:func:`data_root`: Minari's own root unless ``root`` or ``$RL_TFORMERS_DATA`` names another)
  and then in Minari's own root (``$MINARI_DATASETS_PATH`` or ``~/.minari/datasets``). Nothing
  is downloaded unless ``download=True`` is passed.
* **D4RL HDF5** files (``observations``, ``actions``, ``rewards``, ``terminals``, ``timeouts``,
  optional ``next_observations``), read with h5py. The ``d4rl`` package itself is not needed
  (and cannot be installed on current Python: it pins ``gym<0.25`` and ``mujoco-py``); its file
  layout and reference scores are supported instead. ``lazy=True`` keeps observations and
  actions on disk (:class:`~rl_tformers.envs.dataset.LazyH5Array`, opened per process).

Every loader validates the data (:meth:`EpisodeDataset.validate`) and raises
:class:`~rl_tformers.envs.dataset.DatasetError` on the first problem.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import json
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import gymnasium as gym
import numpy as np
from rl_tformers.envs.dataset import (
    META_KEY,
    DatasetError,
    DatasetMetadata,
    EpisodeDataset,
    LazyH5Array,
    check_next_observations,
    per_step_column,
    reading_hdf5,
    unbounded_box,
    unsupported_action_space,
)
from rl_tformers.envs.minari_episodes import MinariEpisodes, check_counts
from rl_tformers.envs.pomdp import POMDP_KINDS
from rl_tformers.envs.recipes import DEFAULT_VERSION, policies_dir, recipe_of_dataset
from rl_tformers.envs.scores import task_family

#: Environment variable naming another data root than Minari's own.
DATA_ROOT_ENV = "RL_TFORMERS_DATA"
#: gymnasium ids used for D4RL files of each task family (same observation/action shapes).
D4RL_ENV_IDS = {"hopper": "Hopper-v5", "halfcheetah": "HalfCheetah-v5", "walker2d": "Walker2d-v5"}

HDF5_SUFFIXES = (".hdf5", ".h5", ".hdf")


def data_root(root: str | os.PathLike | None = None) -> Path:
    """The folder where ``rl-tformers collect`` writes Minari datasets, searched first for ids.

    ``root`` if given, else ``$RL_TFORMERS_DATA``, else Minari's own root
    (:func:`minari_default_root`), where ``minari`` and other tools of the ecosystem find them.

    Raises:
        DatasetError: the root is a file or lies under one, or ``$MINARI_DATASETS_PATH`` is set
            but empty (field: the option or variable; an empty ``$RL_TFORMERS_DATA`` is unset).
    """
    if root is not None:
        return check_root(root, "data root (--root, dataset.root)")
    env = os.environ.get(DATA_ROOT_ENV)
    return check_root(env, f"${DATA_ROOT_ENV}") if env else minari_default_root()


def check_root(root: str | os.PathLike, source: str) -> Path:
    """``root`` (expanded) when it can be a folder of datasets: not empty, not a file, under no file.

    Raises:
        DatasetError: naming ``source`` (``root``, ``$RL_TFORMERS_DATA``, ``$MINARI_DATASETS_PATH``).
    """
    if not str(root).strip():
        raise DatasetError(f"{source} is set but empty; give a folder for the datasets, or unset it", field=source)
    path = Path(root).expanduser()
    for p in (path, *path.parents):
        if p.exists() and not p.is_dir():
            where = "is a file" if p == path else f"lies under {p}, which is a file"
            raise DatasetError(f"{source} {root}: a folder of datasets, but it {where}", field=source)
    return path


def minari_default_root() -> Path:
    """Minari's own dataset root as Minari computes it (``minari.storage.get_dataset_path``):
    ``$MINARI_DATASETS_PATH``, else ``~/.minari/datasets`` (Minari creates the folder).

    Raises:
        DatasetError: as :func:`check_root`, for ``$MINARI_DATASETS_PATH``.
    """
    from minari.storage import get_dataset_path  # minari loads h5py and its storage backends

    env = os.environ.get("MINARI_DATASETS_PATH")
    if env is not None:
        check_root(env, "$MINARI_DATASETS_PATH")
    return Path(get_dataset_path()).expanduser()


def local_dataset_ids(root: str | os.PathLike | None = None) -> list[str]:
    """Ids of the Minari datasets stored under ``root`` (:func:`data_root`) and Minari's own root
    (folders ``<namespace>/<name>-vN/data/metadata.json``), sorted."""
    ids = set()
    for base in (data_root(root), minari_default_root()):
        if base.is_dir():
            ids.update(m.parent.parent.relative_to(base).as_posix() for m in base.glob("**/data/metadata.json"))
    return sorted(ids)


def _close_local_ids(spec: str, root: str | os.PathLike | None) -> list[str]:
    """Up to 3 local dataset ids that resemble ``spec`` (a typo in an id, e.g. another version)."""

    return difflib.get_close_matches(spec, local_dataset_ids(root), n=3, cutoff=0.8)


@contextlib.contextmanager
def minari_root(root: str | os.PathLike) -> Iterator[Path]:
    """Point Minari (``MINARI_DATASETS_PATH``) at ``root`` inside the block, then restore it."""
    old = os.environ.get("MINARI_DATASETS_PATH")
    path = check_root(root, "data root (--root, dataset.root)").resolve()
    path.mkdir(parents=True, exist_ok=True)
    os.environ["MINARI_DATASETS_PATH"] = str(path)
    try:
        yield path
    finally:
        if old is None:
            os.environ.pop("MINARI_DATASETS_PATH", None)
        else:
            os.environ["MINARI_DATASETS_PATH"] = old


# ---------------------------------------------------------------------------------------- spaces
def flatten_batch(space: gym.Space, x) -> np.ndarray:
    """Batched ``gymnasium.spaces.flatten``: (L, ...) leaves -> (L, flatdim(space)).

    Same layout and values as calling ``gymnasium.spaces.flatten(space, x_t)`` for each step
    (tested): Box/MultiBinary reshaped, Discrete/MultiDiscrete one-hot, Dict in the space's key
    order, Tuple in order. Output dtype is ``flatten_space(space).dtype``.

    Raises:
        DatasetError: a leaf space other than Box, Discrete, MultiBinary, MultiDiscrete.
    """
    out = _flatten_batch(space, x)
    return out.astype(gym.spaces.flatten_space(space).dtype, copy=False)


def _flatten_batch(space: gym.Space, x) -> np.ndarray:
    if isinstance(space, gym.spaces.Dict):
        return np.concatenate([_flatten_batch(s, x[k]) for k, s in space.spaces.items()], axis=1)
    if isinstance(space, gym.spaces.Tuple):
        return np.concatenate([_flatten_batch(s, xi) for s, xi in zip(space.spaces, x)], axis=1)
    a = np.asarray(x)
    if isinstance(space, (gym.spaces.Box, gym.spaces.MultiBinary)):
        return a.reshape(a.shape[0], -1)  # (L, prod(shape))
    if isinstance(space, gym.spaces.Discrete):
        out = np.zeros((a.shape[0], int(space.n)), dtype=space.dtype)
        out[np.arange(a.shape[0]), a.reshape(-1) - int(space.start)] = 1
        return out
    if isinstance(space, gym.spaces.MultiDiscrete):
        nvec = np.asarray(space.nvec).reshape(-1)
        offsets = np.concatenate(([0], np.cumsum(nvec)[:-1]))
        rel = a.reshape(a.shape[0], -1) - np.asarray(space.start).reshape(-1)  # (L, n_components)
        out = np.zeros((a.shape[0], int(nvec.sum())), dtype=space.dtype)
        rows = np.repeat(np.arange(a.shape[0]), nvec.size)
        out[rows, (offsets[None, :] + rel).reshape(-1)] = 1
        return out
    raise DatasetError(f"observations: cannot flatten sub-space {space!r}", field="observations")


def _check_spaces(obs_space: gym.Space, act_space: gym.Space, flatten_observations: bool) -> gym.Space:
    """Observation space after optional flattening; refuses unsupported spaces by name."""
    if not isinstance(act_space, (gym.spaces.Box, gym.spaces.Discrete)):
        raise DatasetError(unsupported_action_space(act_space, minari=True), field="actions")
    if isinstance(obs_space, gym.spaces.Box):
        return obs_space
    if not flatten_observations:
        raise DatasetError(
            f"observations: observation space {obs_space!r} is not a Box; flatten it with "
            "gymnasium.spaces.flatten_space: dataset.flatten_observations=true in a run config (train), "
            "--flatten-observations for `rl-tformers dataset info/export`, flatten_observations=True in Python",
            field="observations")
    return gym.spaces.flatten_space(obs_space)


# ---------------------------------------------------------------------------------------- Minari
def resolve_minari(spec: str | os.PathLike, root: str | os.PathLike | None = None) -> Path | None:
    """Data folder (the one holding ``metadata.json``) of a Minari id or folder, or ``None``."""
    p = Path(spec).expanduser()
    for cand in (p, p / "data"):
        if (cand / "metadata.json").is_file():
            return cand
    if isinstance(spec, str) and not p.is_absolute():
        for base in (data_root(root), minari_default_root()):
            cand = base / spec / "data"
            if (cand / "metadata.json").is_file():
                return cand
    return None


def _not_found_where(spec: str, root: str | os.PathLike | None) -> str:
    """``Minari dataset 'ID' not found in ...``: the roots searched and the knobs that name them."""
    ours, minari_root_path = data_root(root), minari_default_root()
    knobs = f"dataset.root=DIR for train/sweep, --root DIR for collect/dataset, else ${DATA_ROOT_ENV}"
    if ours.resolve() == minari_root_path.resolve():
        return (f"Minari dataset {spec!r} not found in Minari's root {minari_root_path} ($MINARI_DATASETS_PATH; "
                f"another data root: {knobs})")
    return (f"Minari dataset {spec!r} not found in the data root {ours} ({knobs}) nor in Minari's root "
            f"{minari_root_path} ($MINARI_DATASETS_PATH)")


def _policies_hint() -> str:
    """`` --policies DIR`` when the default behaviour-policy folder is not found, else ``""``."""
    try:
        policies_dir()
    except FileNotFoundError:
        return " --policies DIR (the folder of the pretrained SB3 agents)"
    return ""


def _recipe_of(dataset_id: str) -> str:
    """The ``collect`` options of the recipe that builds ``dataset_id`` (``...`` when no recipe does):
    its name, with ``--recipe-version`` when it is not the default version."""
    r = recipe_of_dataset(dataset_id)
    if r is None:
        return "..."
    return r.name if r.version == DEFAULT_VERSION else f"{r.name} --recipe-version {r.version}"


def load_minari(
    spec: str | os.PathLike,
    *,
    download: bool = False,
    flatten_observations: bool = False,
    root: str | os.PathLike | None = None,
    max_ep_len: int | None = None,
    validate: bool = True,
) -> EpisodeDataset:
    """Load a Minari dataset (by id or folder) into memory: :func:`open_minari` then
    :meth:`MinariEpisodes.load() <rl_tformers.envs.minari_episodes.MinariEpisodes.load>`.

    Args:
        spec: Minari id (``"namespace/name-vN"``) or a dataset folder (its ``data/`` subfolder or
            the folder containing it).
        download: fetch the id from the Minari server into Minari's root when it is not
            found locally (needs network). Never done implicitly.
        flatten_observations: flatten Dict/Tuple (or Discrete) observations with
            ``gymnasium.spaces.flatten_space``; without it such spaces are refused.
        root: project data root to search first (default :func:`data_root`).
        max_ep_len: refuse episodes longer than this (a model's timestep-embedding size).
        validate: run :meth:`EpisodeDataset.validate` (default True).

    Returns:
        An :class:`EpisodeDataset` with ``final_observations`` set (Minari stores them) and the
        dataset's ``ref_min_score``/``ref_max_score`` when its metadata has them.

    Raises:
        FileNotFoundError, RuntimeError: as :func:`open_minari`.
        DatasetError: what :func:`open_minari` refuses, episodes that cannot be read (a missing
            episode group or array), malformed data (see :meth:`EpisodeDataset.validate` and
            :meth:`EpisodeDataset.from_episodes`), an episode whose observation count is not its
            action count + 1, or (``validate=True``) episodes holding another number of steps
            than the metadata's ``total_steps``.
    """
    return open_minari(spec, download=download, flatten_observations=flatten_observations, root=root).load(
        validate=validate, max_ep_len=max_ep_len)


def open_minari(
    spec: str | os.PathLike,
    *,
    download: bool = False,
    flatten_observations: bool = False,
    root: str | os.PathLike | None = None,
) -> MinariEpisodes:
    """Open a Minari dataset (by id or folder) without reading its episodes.

    Reads ``metadata.json`` only: spaces, ``total_episodes`` / ``total_steps``, reference
    scores and the project's own record. Episodes are read when asked for
    (:class:`~rl_tformers.envs.minari_episodes.MinariEpisodes`: ``episodes``,
    ``sample_episodes``, ``load``). Arguments as :func:`load_minari`.

    Raises:
        FileNotFoundError: id not found locally and ``download`` is False (the message says
            where it looked and how to download or build it).
        RuntimeError: ``download=True`` but the download failed (e.g. no network).
        DatasetError: a folder Minari cannot open (no ``main_data.hdf5``, ``metadata.json`` not
            JSON), an action space other than Box/Discrete, a Dict/Tuple observation space
            without ``flatten_observations``, metadata ``ref_min_score``/``ref_max_score`` that
            are not finite numbers with ``ref_max_score > ref_min_score``, or a malformed
            ``pomdp`` record (:func:`check_pomdp_record`).
    """
    import minari

    path = resolve_minari(spec, root)
    source = "minari-path" if Path(spec).expanduser().exists() else "minari"
    if path is None:
        if Path(spec).expanduser().exists():
            raise DatasetError(f"{spec}: not a Minari dataset folder (no metadata.json in it or in its data/)")
        if not download:
            recipe = _recipe_of(str(spec))
            # a typo hint only for ids no recipe builds: a recipe's own id is right, just not built yet
            close = _close_local_ids(str(spec), root) if recipe == "..." else []
            hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
            # name the knobs of both roots: a user whose datasets already exist elsewhere needs
            # them more than a build command
            where = _not_found_where(str(spec), root)
            if recipe != "...":  # this package's own id: built locally, published on no server
                raise FileNotFoundError(
                    f"{where}; build it (`rl-tformers collect --recipe {recipe}{_policies_hint()}`), or pass a folder "
                    f"or an .hdf5 file (this package's own recipe: built locally, on no server)")
            if str(spec).startswith("rlt/"):  # this package's namespace, but no recipe of it: a typo
                raise FileNotFoundError(
                    f"{where}{hint}; no recipe builds this id (`rl-tformers collect --list-recipes` lists them), "
                    "and the rlt/ namespace is on no server")
            raise FileNotFoundError(
                f"{where}{hint}; build it (`rl-tformers collect --recipe {recipe}{_policies_hint()}`), pass a folder or "
                "an .hdf5 file, or fetch it from the Minari server: dataset.download=true in a run config "
                "(train), --download for `rl-tformers dataset info/export`, download=True in Python")
        try:
            md = minari.load_dataset(str(spec), download=True)
        except Exception as exc:  # network errors, unknown remote ids
            raise RuntimeError(f"could not download Minari dataset {str(spec)!r}: {exc}") from exc
        path = Path(md.spec.data_path)
    else:
        try:
            md = minari.MinariDataset(path)
        except Exception as exc:  # no main_data.hdf5, metadata.json not JSON, unknown space, a count not a number...
            _check_counts_of(path)
            raise DatasetError(f"{path}: not a readable Minari dataset ({type(exc).__name__}: {exc})") from exc
    meta = md.storage.metadata
    check_counts(meta, str(path))
    obs_space = md.observation_space
    act_space = md.action_space
    flat_space = _check_spaces(obs_space, act_space, flatten_observations)
    needs_flatten = flat_space is not obs_space

    own = meta.get(META_KEY) or {}
    if isinstance(own, str):
        try:
            own = json.loads(own)
        except (ValueError, RecursionError) as exc:  # deep nesting recurses
            raise DatasetError(f"{path}: metadata {META_KEY!r} is not valid JSON ({exc})", field=META_KEY) from exc
    if not isinstance(own, dict):
        raise DatasetError(f"{path}: metadata {META_KEY!r} is a {type(own).__name__}, expected an object",
                           field=META_KEY)
    env_spec = md.env_spec
    env_id = getattr(env_spec, "id", None)
    recorded = own.get("env_id")
    if isinstance(recorded, str) and ":" in recorded and recorded.rpartition(":")[2] == env_id:
        env_id = recorded  # gymnasium's "module:EnvId": gym.make imports the module that registers EnvId
    metadata = DatasetMetadata(
        env_id=env_id,
        source=source,
        location=str(spec),
        dataset_id=md.spec.dataset_id,
        **_ref_scores(meta, f"Minari metadata of {spec}"),
        pomdp=check_pomdp_record(own.get("pomdp"), tuple(flat_space.shape), f"Minari metadata of {spec}"),
        extra={k: meta[k] for k in ("algorithm_name", "description") if k in meta} | {
            k: v for k, v in own.items() if k != "pomdp"},
    )
    return MinariEpisodes(md, observation_space=flat_space, action_space=act_space, metadata=metadata,
                          flatten=functools.partial(flatten_batch, obs_space) if needs_flatten else None,
                          where=str(path))


def _check_counts_of(path: Path) -> None:
    """:func:`check_counts` of the ``metadata.json`` in ``path`` when it is a readable JSON
    object (a folder Minari could not open: name the count at fault, when one is)."""
    try:
        meta = json.loads((Path(path) / "metadata.json").read_text())
    except (OSError, ValueError):
        return
    if isinstance(meta, dict):
        check_counts(meta, str(path))


def check_pomdp_record(record, obs_shape: tuple[int, ...], where: str) -> dict | None:
    """The ``pomdp`` record of a dataset's metadata, checked (``None`` when absent).

    A record (:func:`~rl_tformers.envs.pomdp.pomdp_record`) is ``{"kind": "positions" | "mask",
    "indices": [...], "source_shape": [D]}``: distinct integer indices in ``[0, D)``, one per
    recorded observation value. Evaluation masks the environment with it, so a malformed one
    would fail only there (or mask the wrong entries).

    Raises:
        DatasetError: field ``pomdp``, saying what is wrong and where (``where``).
    """

    if record is None:
        return None

    def bad(what: str) -> DatasetError:
        return DatasetError(f"pomdp: {what} in the {where}; a POMDP record is {{\"kind\": \"positions\" or "
                            f"\"mask\", \"indices\": [...], \"source_shape\": [D]}}", field="pomdp")

    if not isinstance(record, dict):
        raise bad(f"{record!r} is a {type(record).__name__}, not an object")
    if record.get("kind") not in POMDP_KINDS:
        raise bad(f"kind {record.get('kind')!r} is not one of {', '.join(POMDP_KINDS)}")

    def ints(key: str) -> list[int]:
        v = record.get(key)
        if not isinstance(v, list) or not v or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
            raise bad(f"{key} {v!r} is not a non-empty list of integers")
        return v

    indices, source = ints("indices"), ints("source_shape")
    if len(source) != 1 or source[0] < 1:
        raise bad(f"source_shape {source} is not the shape [D] of a 1-D observation")
    outside = [i for i in indices if not 0 <= i < source[0]]
    if outside:
        raise bad(f"indices {outside} are outside [0, {source[0]}) (source_shape {source})")
    if len(set(indices)) != len(indices):
        raise bad(f"indices {indices} repeat")
    if obs_shape != (len(indices),):
        raise bad(f"{len(indices)} indices, but the observations have shape {obs_shape}")
    return record


def _ref_scores(meta: dict, where: str) -> dict:
    """``{"ref_min_score": ..., "ref_max_score": ...}`` read from ``meta`` (floats or None).

    Raises:
        DatasetError: a score that is not a finite number, or both present with
            ``ref_max_score <= ref_min_score`` (normalised scores would divide by zero or flip sign).
    """
    lo = _opt_float(meta.get("ref_min_score"), "ref_min_score", where)
    hi = _opt_float(meta.get("ref_max_score"), "ref_max_score", where)
    if lo is not None and hi is not None and not hi > lo:
        raise DatasetError(f"ref_max_score: {hi!r} is not above ref_min_score {lo!r} in the {where}; normalised "
                           "scores 100 * (R - ref_min) / (ref_max - ref_min) need ref_max > ref_min",
                           field="ref_max_score")
    return {"ref_min_score": lo, "ref_max_score": hi}


def _opt_float(v, name: str = "value", where: str = "metadata") -> float | None:
    """``None`` or ``float(v)``.

    Raises:
        DatasetError: ``v`` is not a number (field ``name``; ``where`` says which metadata).
    """
    if v is None:
        return None
    try:
        out = float(v)
    except (TypeError, ValueError):
        raise DatasetError(f"{name}: {v!r} in the {where} is not a number", field=name) from None
    if not np.isfinite(out):
        raise DatasetError(f"{name}: {v!r} in the {where} is not finite", field=name)
    return out


# ---------------------------------------------------------------------------------------- D4RL
def load_d4rl_hdf5(
    path: str | os.PathLike,
    *,
    lazy: bool = False,
    env_id: str | None = None,
    observation_space: gym.Space | None = None,
    action_space: gym.Space | None = None,
    max_ep_len: int | None = None,
    validate: bool = True,
) -> EpisodeDataset:
    """Load a D4RL-layout HDF5 file.

    Episodes end where ``terminals OR timeouts`` is set; a last episode with neither flag is
    kept and marked truncated (``metadata.extra["unfinished_last_episode"] = True``). A file
    without ``timeouts`` (old D4RL versions) is read with all timeouts False.

    Spaces: the action space is ``action_space`` when given, else that of the ``env_id``
    argument's environment (when it can be made here and its shape matches the file's actions),
    else the file's ``action_space`` attribute (written by :func:`save_d4rl_hdf5`), else that of
    the file's ``env_id`` attribute or of the file name's task family (e.g.
    ``hopper-medium-v2.hdf5`` -> ``Hopper-v5``) when its shape matches, else it is inferred
    (:func:`~rl_tformers.envs.dataset.infer_action_space`: unbounded Box or Discrete). The
    observation space is the file's ``observation_space`` attribute, else an unbounded Box of
    the data's shape and dtype (:func:`unbounded_box`: integer observations get their dtype's
    range).

    Args:
        path: the .hdf5 file.
        lazy: keep ``observations``/``actions`` on disk (per-process h5py handles); rewards,
            flags and final observations are read into memory. Validation streams in chunks.
        env_id, observation_space, action_space: override what the file says.
        max_ep_len: refuse episodes longer than this.
        validate: run :meth:`EpisodeDataset.validate`.

    Raises:
        FileNotFoundError: no such file.
        DatasetError: the file is not a readable HDF5 file, a required key is missing or is a
            group rather than a dataset, observations/actions/rewards are not integers or
            floating point (strings, booleans), arrays disagree in length,
            ``rewards``/``terminals``/``timeouts`` hold more than one value per step, a key is a
            scalar dataset, flags are not 0/1, ``next_observations`` differs in per-step shape
            from ``observations`` or (``validate=True``) is not finite or differs from
            ``observations[t + 1]`` inside an episode
            (:func:`~rl_tformers.envs.dataset.check_next_observations`), the attributes
            ``rl_tformers_metadata`` / ``observation_space`` / ``action_space`` cannot be read or
            its ``pomdp`` record is malformed (:func:`check_pomdp_record`), the actions are stored in another shape than the environment's Box action space
            with as many values (e.g. ``(N, 4)`` for a ``Box(2, 2)``: never reshaped silently),
            or validation fails.
    """
    import h5py

    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"no such HDF5 file: {path}")
    try:
        f = h5py.File(path, "r")
    except OSError as exc:  # not HDF5 at all, truncated, unreadable
        raise DatasetError(f"{path}: not a readable HDF5 file ({exc})") from exc
    with f:
        with reading_hdf5(path, "the file's list of datasets"):
            keys = set(f.keys())
        for key in ("observations", "actions", "rewards", "terminals"):
            if key not in keys:
                raise DatasetError(f"{path}: missing dataset {key!r} (D4RL layout needs observations, actions, "
                                   "rewards, terminals, timeouts)", field=key)
        _check_h5_datasets(f, path, keys)
        rewards = per_step_column("rewards", _read(f, "rewards", path)).astype(np.float64)
        n = rewards.shape[0]
        terminals = per_step_column("terminals", _read(f, "terminals", path))
        timeouts = per_step_column("timeouts", _read(f, "timeouts", path)) if "timeouts" in keys else None
        for key in ("observations", "actions", "terminals", "timeouts", "next_observations"):
            if key in keys and f[key].shape[0] != n:
                raise DatasetError(f"{path}: {key}: {f[key].shape[0]} rows but rewards has {n}", field=key)
        with reading_hdf5(path, "the file's attributes"):
            attrs = dict(f.attrs)
        has_next = "next_observations" in keys
        if lazy:
            obs = LazyH5Array(path, "observations")
            act = LazyH5Array(path, "actions")
            nxt = LazyH5Array(path, "next_observations") if has_next else None
        else:
            obs = _read(f, "observations", path)
            act = _read(f, "actions", path)
            nxt = _read(f, "next_observations", path) if has_next else None
    own = _own_metadata(attrs, path)
    if observation_space is None and "observation_space" in attrs:
        observation_space = _attr_space(attrs, "observation_space", path)
    if action_space is None and env_id:
        # the task named by the caller (dataset.env_id) bounds the actions before anything the
        # file says: a file written from data without bounds stores an unbounded Box, which would
        # otherwise hide the task's bounds that dataset.env_id was given for
        action_space = _env_action_space(env_id, act, path)
    if action_space is None and "action_space" in attrs:
        action_space = _attr_space(attrs, "action_space", path)
    env_id = env_id or (_attr_str(attrs, "env_id", path) if "env_id" in attrs else None)
    if env_id is None:
        fam = task_family(path.stem)
        env_id = D4RL_ENV_IDS.get(fam) if fam else None
    if action_space is None and env_id is not None and not names_unimported_module(env_id):
        # an id the file names is made only if making it imports nothing new ("module:EnvId"
        # imports module: code the file would choose, e.g. a module next to it)
        action_space = _env_action_space(env_id, act, path)
    if observation_space is None:
        observation_space = unbounded_box(tuple(obs.shape[1:]), obs.dtype)
    where = f"{path} attribute rl_tformers_metadata"
    metadata = DatasetMetadata(
        env_id=env_id, source="d4rl-hdf5", location=str(path), dataset_id=own.get("dataset_id"),
        **_ref_scores(own, where),
        pomdp=check_pomdp_record(own.get("pomdp"), tuple(observation_space.shape or ()), where),
        extra={k: v for k, v in own.items() if k not in ("dataset_id", "ref_min_score", "ref_max_score", "pomdp")})
    try:
        ds = EpisodeDataset.from_flags(obs, act, rewards, terminals, timeouts, next_observations=nxt,
                                       observation_space=observation_space, action_space=action_space,
                                       metadata=metadata, validate=False)
        if validate:
            ds.validate(max_ep_len=max_ep_len)
            if nxt is not None:
                check_next_observations(ds, nxt)
    except DatasetError as exc:
        if str(exc).startswith(str(path)):
            raise
        raise DatasetError(f"{path}: {exc}", field=exc.field, episode=exc.episode, step=exc.step) from exc
    finally:
        for arr in (obs, act, nxt):
            if isinstance(arr, LazyH5Array):
                arr.close()  # no open handle is left to be inherited by forked workers
    return ds


def _read(f, key: str, path: Path) -> np.ndarray:
    """The whole dataset ``key`` of the open file ``f``.

    Raises:
        DatasetError: naming ``path`` and ``key`` when h5py cannot read it (a damaged object
            header or compressed chunk: :func:`~rl_tformers.envs.dataset.reading_hdf5`).
    """
    with reading_hdf5(path, key):
        return f[key][()]


def _own_metadata(attrs: dict, path: Path) -> dict:
    """The file's ``rl_tformers_metadata`` attribute (a JSON object), or ``{}`` when absent.

    Raises:
        DatasetError: the attribute is not JSON or not a JSON object (field ``rl_tformers_metadata``).
    """
    if "rl_tformers_metadata" not in attrs:
        return {}
    text = _attr_str(attrs, "rl_tformers_metadata", path)
    try:
        own = json.loads(text)
    except (ValueError, RecursionError) as exc:  # deep nesting recurses
        raise DatasetError(f"{path}: attribute rl_tformers_metadata is not valid JSON ({exc}); delete the attribute "
                           "or rewrite it", field="rl_tformers_metadata") from exc
    if not isinstance(own, dict):
        raise DatasetError(f"{path}: attribute rl_tformers_metadata is a JSON {type(own).__name__}, expected an "
                           "object", field="rl_tformers_metadata")
    return own


def _attr_space(attrs: dict, key: str, path: Path) -> gym.Space:
    """Deserialise the space stored in attribute ``key`` (Minari's JSON serialisation).

    Raises:
        DatasetError: the attribute cannot be read as a space (field ``key``).
    """
    from minari.serialization import deserialize_space

    text = _attr_str(attrs, key, path)
    try:
        return deserialize_space(text)
    except Exception as exc:  # json errors, unknown space types, missing fields
        raise DatasetError(f"{path}: attribute {key} is not a serialised gymnasium space ({type(exc).__name__}: "
                           f"{exc}); delete the attribute or pass {key}= explicitly", field=key) from exc


#: keys of a D4RL-layout file read as arrays, and whether they must hold numbers
_H5_KEYS = {"observations": True, "actions": True, "rewards": True, "next_observations": True,
            "terminals": False, "timeouts": False}


def _check_h5_datasets(f, path: Path, keys: set[str]) -> None:
    """Refuse D4RL keys that are HDF5 groups, and non-numeric observations/actions/rewards.

    Every key must hold one row per step (a scalar dataset is refused). Observations, actions,
    rewards and next observations must be integers or floating point (strings, booleans and
    compound types are refused); ``terminals``/``timeouts`` are checked
    by :func:`~rl_tformers.envs.dataset.binary_flags` (boolean or numeric 0/1).

    Every key's data must be stored in the file itself: an external link, a virtual dataset
    (its sources are other files) or external raw storage (any file of the reader's machine, read
    as numbers) is refused, so a file received from someone else reads nothing else.

    Raises:
        DatasetError: naming the file and the key (also when its object header cannot be read).
    """
    import h5py

    for key, numeric in _H5_KEYS.items():
        if key not in keys:
            continue
        with reading_hdf5(path, key):
            link = f.get(key, getlink=True)
            node = None if isinstance(link, h5py.ExternalLink) else f[key]
        outside = (f"an external link to {link.filename}:{link.path}" if node is None
                   else "a virtual dataset (its data is read from other files)" if getattr(node, "is_virtual", False)
                   else f"stored in external raw files ({', '.join(str(e[0]) for e in node.external)})"
                   if getattr(node, "external", None) else None)
        if outside is not None:
            raise DatasetError(f"{path}: {key!r} is {outside}; a dataset file must hold its own arrays (copy them "
                               f"into the file)", field=key)
        if not isinstance(node, h5py.Dataset):
            raise DatasetError(f"{path}: {key!r} is an HDF5 {type(node).__name__.lower()}, not a dataset; the D4RL "
                               f"layout stores each of {', '.join(_H5_KEYS)} as one array (dataset)", field=key)
        if node.ndim == 0:
            raise DatasetError(f"{key}: a scalar (shape ()) in {path}; the D4RL layout stores one row per step "
                               "(shape (N, ...))", field=key)
        dtype = node.dtype
        if numeric and not (np.issubdtype(dtype, np.integer) or np.issubdtype(dtype, np.floating)):
            raise DatasetError(f"{key}: dtype {dtype} is not numeric (integer or floating point) in {path}",
                               field=key)


def _attr_str(attrs: dict, key: str, path: Path) -> str:
    """The text of the file's attribute ``key``: a string, or bytes in UTF-8.

    Raises:
        DatasetError: any other value (a number, an array, opaque bytes), field ``key``.
    """
    value = attrs[key]
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode()
        except UnicodeDecodeError as exc:
            raise DatasetError(f"{path}: attribute {key} is bytes that are not UTF-8 text ({exc})", field=key) from exc
    if isinstance(value, str):
        return str(value)
    shape = f" of shape {value.shape}" if isinstance(value, np.ndarray) else ""
    raise DatasetError(f"{path}: attribute {key} is a {type(value).__name__}{shape} ({value!r:.60}), expected a "
                       f"string; delete the attribute or rewrite it", field=key)


def names_unimported_module(env_id: str) -> bool:
    """Whether ``gym.make(env_id)`` would import a module first (``"module:EnvId"``, module not imported)."""
    module = env_id.rpartition(":")[0]
    return bool(module) and module not in sys.modules


def _env_action_space(env_id: str, actions, path: Path) -> gym.Space | None:
    """The action space of ``env_id`` if it can be built and matches the data's shape (a
    ``Discrete`` space matches integer actions of shape ``(N,)`` or ``(N, 1)``: one per step).

    Raises:
        DatasetError: the space is a Box with as many values per step as the file's actions
            but another shape (e.g. actions stored flat, ``(N, 4)``, for a ``Box(2, 2)``): the
            actions must be stored in the space's shape; they are not reshaped silently.
    """
    try:
        env = gym.make(env_id)
    except Exception:
        return None
    space = env.action_space
    env.close()
    per_step = tuple(actions.shape[1:])
    if isinstance(space, gym.spaces.Box) and tuple(space.shape) == per_step:
        return space
    if isinstance(space, gym.spaces.Box) and per_step and math.prod(space.shape) == math.prod(per_step):
        raise DatasetError(
            f"actions: {path} stores actions of shape {per_step} per step, but the action space of its "
            f"environment {env_id} is a Box of shape {tuple(space.shape)}; store each action in the space's shape "
            f"(actions of shape (N, {', '.join(map(str, space.shape))}), e.g. written by save_d4rl_hdf5), "
            f"they are not reshaped silently", field="actions")
    if isinstance(space, gym.spaces.Discrete) and (
            per_step == () or (per_step == (1,) and np.issubdtype(np.dtype(actions.dtype), np.integer))):
        return space  # integer (N, 1): one action per step, stored as (N,) (see EpisodeDataset)
    return None


def save_d4rl_hdf5(dataset: EpisodeDataset, path: str | os.PathLike, *, compression: str | None = None) -> Path:
    """Write ``dataset`` in the D4RL layout (readable by :func:`load_d4rl_hdf5` and D4RL tools).

    Datasets: ``observations (N, *obs)``, ``actions``, ``rewards (N,)`` float64 (D4RL's own
    files use float32; float64 keeps collected rewards exact), ``terminals (N,)`` and ``timeouts (N,)``
    bool (from terminations / truncations), ``next_observations`` when final observations are
    known (not for a pixel dataset: a second copy of every frame; its ``(N, C, H, W)`` uint8
    frames are written once). Attributes: ``env_id``, serialised ``observation_space``/``action_space``
    (Minari's serialisation) and ``rl_tformers_metadata`` (JSON: dataset id, reference scores, POMDP
    mask, the other metadata such as a pixel dataset's ``frame_stack``).
    """
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    ds = dataset if (dataset.is_contiguous() and not dataset.is_lazy) else dataset.materialize()
    s0, n = int(ds.starts[0]), ds.num_steps
    obs = np.asarray(ds.observations[s0:s0 + n])
    # written to a temporary file beside ``path`` and renamed into place: an interrupted or
    # failed write never leaves a truncated file under the requested name
    tmp_name = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        _write_d4rl(tmp_name, ds, obs, s0, n, compression)
        os.replace(tmp_name, path)
    except BaseException:
        tmp_name.unlink(missing_ok=True)
        raise
    return path


def _write_d4rl(path: Path, ds: EpisodeDataset, obs: np.ndarray, s0: int, n: int, compression: str | None) -> None:
    import h5py
    from minari.serialization import serialize_space

    with h5py.File(path, "w") as f:
        f.create_dataset("observations", data=obs, compression=compression)
        f.create_dataset("actions", data=np.asarray(ds.actions[s0:s0 + n]), compression=compression)
        f.create_dataset("rewards", data=ds.rewards[s0:s0 + n])
        f.create_dataset("terminals", data=ds.terminations[s0:s0 + n])
        f.create_dataset("timeouts", data=ds.truncations[s0:s0 + n])
        if ds.final_observations is not None and not ds.is_pixel:  # frames: no second copy of every frame
            nxt = np.empty_like(obs)
            nxt[:-1] = obs[1:]
            ends = ds.starts - s0 + ds.lengths - 1  # (E,) last step of each episode
            nxt[ends] = ds.final_observations
            f.create_dataset("next_observations", data=nxt, compression=compression)
        m = ds.metadata
        if m.env_id:
            f.attrs["env_id"] = m.env_id
        f.attrs["observation_space"] = serialize_space(ds.observation_space)
        f.attrs["action_space"] = serialize_space(ds.action_space)
        f.attrs["rl_tformers_metadata"] = json.dumps({
            "dataset_id": m.dataset_id, "ref_min_score": m.ref_min_score, "ref_max_score": m.ref_max_score,
            "pomdp": m.pomdp, **{k: v for k, v in m.extra.items() if _jsonable(v)}})


def _jsonable(v) -> bool:
    try:
        json.dumps(v)
        return True
    except TypeError:
        return False


# ---------------------------------------------------------------------------------------- dispatch
def load_dataset(
    spec: str | os.PathLike,
    *,
    download: bool = False,
    flatten_observations: bool = False,
    lazy: bool = False,
    root: str | os.PathLike | None = None,
    max_ep_len: int | None = None,
    validate: bool = True,
    env_id: str | None = None,
    action_space: gym.Space | None = None,
) -> EpisodeDataset:
    """Load a Minari id, a Minari dataset folder or a D4RL .hdf5 file (chosen by what ``spec`` is).

    ``lazy``, ``env_id`` and ``action_space`` apply to HDF5 files (Minari data is read into
    memory and carries its own spaces); an explicit ``action_space`` replaces the one the
    bounds check would use. See :func:`load_minari` and :func:`load_d4rl_hdf5` for the other
    arguments and the errors raised.
    """
    if not str(spec).strip():
        raise DatasetError("the dataset spec is empty; give a Minari dataset id, folder or .hdf5 file")
    p = Path(spec).expanduser()
    if p.suffix.lower() in HDF5_SUFFIXES or p.is_file():
        return load_d4rl_hdf5(p, lazy=lazy, max_ep_len=max_ep_len, validate=validate, env_id=env_id,
                              action_space=action_space)
    return load_minari(spec, download=download, flatten_observations=flatten_observations, root=root,
                       max_ep_len=max_ep_len, validate=validate)
