"""Building datasets: roll out behaviour policies and write Minari datasets
(:class:`~rl_tformers.envs.recording.EpisodeRecorder`: Minari's writer, without jax).

One dataset may hold several *behaviours* in sequence (a D4RL medium-expert set is a medium
shard followed by an expert shard). Every episode starts from ``env.reset(seed=s)`` with ``s``
drawn from ``numpy.random.default_rng([seed, 0])``, and each behaviour's noise uses its own
generator, so a build is a pure function of its arguments and ``seed``.

Partially observed datasets (``pomdp``): the behaviour policy acts on the full observation and
the recorder records the masked one, with the masked space as the
dataset's observation space and the masked environment as its evaluation environment
(``MinariDataset.recover_environment(eval_env=True)`` rebuilds it).

Pixel environments (:mod:`rl_tformers.envs.pixels`, built by
:func:`~rl_tformers.envs.environments.make_task` like every environment here): of a frame-stacked
observation ``(k * C, H, W)`` only its newest frame ``(C, H, W)`` is recorded, and the dataset's
metadata says ``frame_stack: k``; the samplers rebuild the stacks (:mod:`rl_tformers.envs.frames`),
so the data holds every frame once, as uint8.

Encoded observations (POPGym's tasks: :func:`~rl_tformers.envs.environments.make_task` one-hot
encodes a Discrete, MultiDiscrete or Tuple observation as one float32 vector,
:class:`~rl_tformers.envs.environments.OneHotObservation`): the encoded vector is recorded, the
dataset's metadata says how (``observation_encoding``: ``gymnasium.spaces.flatten`` of the
``source_space``), and its evaluation environment is the encoded one.

Trained runs as behaviour policies (:class:`RunPolicy`): a runtime policy (``initial_state`` /
``act`` on batches, state held by the caller) acts on one environment; the reward of each step
reaches it as its ``last_reward`` (a return-conditioned policy counts its return down).

Sizes: a behaviour with ``steps=N`` runs whole episodes until it has at least N steps (the last
episode is finished, not cut), so datasets hold complete episodes only.
"""

from __future__ import annotations

import importlib
import math
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
from rl_tformers.envs import recipes as R
from rl_tformers.envs.dataset import META_KEY
from rl_tformers.envs.environments import OneHotObservation, make_task
from rl_tformers.envs.frames import FRAME_STACK_KEY
from rl_tformers.envs.loaders import data_root, load_minari, minari_root, save_d4rl_hdf5
from rl_tformers.envs.pixels import frame_stack_of, is_pixel_id
from rl_tformers.envs.policies import (
    NoisyPolicy,
    RandomPolicy,
    SB3Policy,
    load_sb3_policy,
    train_sb3,
    until_return_callback,
)
from rl_tformers.envs.pomdp import ObservationMaskWrapper, pomdp_record
from rl_tformers.envs.recording import EpisodeRecorder
from rl_tformers.envs.scores import reference_scores
from rl_tformers.envs.stopping import check_stop

from rl_tformers.runtime.paths import blocking_file
from rl_tformers.runtime.progress import PlainProgress, is_terminal, progress_bar


@dataclass
class Behaviour:
    """One shard of a dataset: a policy run for ``steps`` (whole episodes) or ``episodes``.

    Attributes:
        policy: ``policy(obs) -> action`` with ``reset()`` (see :mod:`rl_tformers.envs.policies`).
        steps: run until at least this many steps (complete episodes); or
        episodes: run exactly this many episodes.
        label: description stored in the dataset metadata.
        info: extra JSON-serialisable facts stored with it (policy file, noise, ...).
    """

    policy: Any
    steps: int | None = None
    episodes: int | None = None
    label: str = ""
    info: dict = field(default_factory=dict)

    def __post_init__(self):
        if (self.steps is None) == (self.episodes is None):
            raise ValueError("give exactly one of steps / episodes")
        if (self.steps if self.steps is not None else self.episodes) < 0:
            raise ValueError("steps / episodes must be >= 0")


@dataclass
class CollectResult:
    """What a collection produced. ``episode_returns``/``episode_lengths`` are what the rollout
    saw, in dataset order; ``behaviour_slices[i]`` is the episode range of behaviour ``i``."""

    dataset_id: str
    path: Path
    episode_returns: np.ndarray
    episode_lengths: np.ndarray
    behaviour_slices: list[tuple[int, int]]
    hdf5_path: Path | None = None

    @property
    def num_steps(self) -> int:
        """Environment steps collected (sum of the episode lengths)."""
        return int(self.episode_lengths.sum())

    @property
    def num_episodes(self) -> int:
        """Episodes collected."""
        return int(self.episode_lengths.size)

    def summary(self) -> dict:
        """JSON-ready dict: id, path, episodes, steps, mean/std (population) of the raw episode
        returns (``None`` without episodes) and the HDF5 export path."""
        r = self.episode_returns
        return {"dataset_id": self.dataset_id, "path": str(self.path), "episodes": self.num_episodes,
                "steps": self.num_steps, "return_mean": float(r.mean()) if r.size else None,
                "return_std": float(r.std()) if r.size else None,
                "hdf5": None if self.hdf5_path is None else str(self.hdf5_path)}


class SeededResets(gym.Wrapper):
    """Give every ``reset()`` without a seed the next draw, in [0, 2**31 - 1), of a NumPy
    generator seeded from ``seed`` (``numpy.random.default_rng([seed, 7])``).

    The recorder (as ``minari.DataCollector``) draws a random seed from the OS when none is given; training loops
    (SB3's VecEnv auto-reset) reset without one. Putting this wrapper outside the collector
    makes recorded training data reproducible.
    """

    def __init__(self, env: gym.Env, seed: int):
        super().__init__(env)
        self._rng = np.random.default_rng([int(seed), 7])

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        """The wrapped reset, with the next generator seed when ``seed`` is None."""
        if seed is None:
            seed = int(self._rng.integers(2**31 - 1))
        return self.env.reset(seed=seed, options=options)


def dataset_folder(dataset_id: str, root: str | Path | None = None) -> Path:
    """Folder of a Minari dataset id under the data root (``<root>/<id>``)."""
    return data_root(root) / dataset_id


def check_dataset_id(dataset_id: str, option: str = "--dataset-id") -> None:
    """Refuse a malformed Minari id (``namespace/name-vN``), naming ``option``.

    Raises:
        ValueError: the id is empty, has no ``-vN`` version, or is otherwise malformed.
    """
    from minari.dataset.minari_dataset import parse_dataset_id

    try:
        _, _, version = parse_dataset_id(dataset_id)
    except (TypeError, ValueError):  # minari raises TypeError for an id without a version
        version = None
    if not dataset_id or version is None:
        raise ValueError(f"{option} {dataset_id!r} is not a Minari dataset id: use namespace/name-vN "
                         "(e.g. rlt/hopper-v5/medium-v0; the -vN version is required)")


def _prepare_target(dataset_id: str, root: Path, overwrite: bool) -> Path | None:
    """Check ``dataset_id`` and its folder; with ``overwrite`` move an existing dataset aside.

    Returns:
        The folder the existing dataset was moved to (restore it with :func:`_restore` if the
        new build fails or is interrupted, delete it once the new one is complete), or ``None``.
    """
    check_dataset_id(dataset_id)
    target = root / dataset_id
    if target.exists():
        if not overwrite:
            raise FileExistsError(f"dataset {dataset_id!r} already exists at {target}; pass overwrite=True "
                                  "(CLI: --overwrite) or choose another --dataset-id")
        # kept until the new dataset is complete: an interrupted --overwrite loses nothing
        backup = target.with_name(f".{target.name}.replaced-{os.getpid()}")
        if backup.exists():
            shutil.rmtree(backup)
        os.replace(target, backup)
        return backup
    return None


def _restore(backup: Path | None, target: Path) -> None:
    """Put the dataset moved aside by :func:`_prepare_target` back at ``target``."""
    if backup is not None and backup.exists():
        shutil.rmtree(target, ignore_errors=True)
        os.replace(backup, target)


def _new_dirs(target: Path, root: Path) -> Path | None:
    """The highest folder between ``root`` (exclusive) and ``target`` that does not exist yet."""
    top = None
    for p in [target, *target.parents]:
        if p == root or root not in p.parents:
            break
        if not p.exists():
            top = p
    return top


@contextmanager
def _dataset_build(dataset_id: str, root: Path, overwrite: bool) -> Iterator[None]:
    """The block that writes dataset ``dataset_id`` under ``root``: an existing dataset of that id
    is refused, or with ``overwrite`` kept aside (:func:`_prepare_target`) and removed once the
    block completes. A block that fails or is interrupted removes its half-written folder (a
    rerun would be refused as existing) and puts the dataset it was to replace back.

    Raises:
        FileExistsError: the dataset exists and ``overwrite`` is False.
    """
    backup = _prepare_target(dataset_id, root, overwrite)
    created = _new_dirs(root / dataset_id, root)
    try:
        yield
    except BaseException:  # never leave a half-written dataset behind
        _remove_partial(root / dataset_id, created)
        _restore(backup, root / dataset_id)  # --overwrite: the dataset it was to replace is back
        raise
    if backup is not None:
        shutil.rmtree(backup, ignore_errors=True)


def _remove_partial(target: Path, created: Path | None) -> None:
    """After a failed build: remove the half-written dataset folder ``target`` and the namespace
    folders created for it (``created``) when they hold nothing but Minari's namespace metadata."""
    shutil.rmtree(target, ignore_errors=True)
    if created is not None and created.is_dir() and all(
            f.name == "namespace_metadata.json" for f in created.rglob("*") if not f.is_dir()):
        shutil.rmtree(created, ignore_errors=True)


def check_hdf5_target(path: str | Path | None, overwrite: bool = False) -> None:
    """Refuse an HDF5 output path that cannot be written, before anything is collected.

    Called before the rollouts, so that a bad ``--hdf5`` does not fail only after the Minari
    dataset has been written (leaving it behind, and a rerun refused as "already exists").

    Raises:
        ValueError: ``path`` is a directory, a path component above it is an existing file, or
            no file can be created in its nearest existing folder.
        FileExistsError: ``path`` is an existing file and ``overwrite`` is False.
    """
    if path is None:
        return
    p = Path(path).expanduser()
    if p.is_dir():
        raise ValueError(f"--hdf5 {p} is a directory; give the .hdf5 file to write (e.g. {p / 'dataset.hdf5'})")
    if p.exists() and not overwrite:
        raise FileExistsError(f"--hdf5 {p} already exists; pass overwrite=True (CLI: --overwrite) to replace it, "
                              "or choose another file")
    parent = blocking_file(p)
    if parent is not None:
        raise ValueError(f"--hdf5 {p}: {parent} is a file, not a directory")
    folder = next(d for d in (p.parent, *p.parent.parents) if d.exists())  # the folders below it are created
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:  # read-only, no permission, a pseudo file system
        raise ValueError(f"--hdf5 {p}: cannot write in {folder} ({exc.strerror or exc})") from exc


class RunPolicy:
    """A runtime policy (``initial_state(n, target_return)``, ``act(obs, state, episode_start,
    last_reward) -> (action, state)`` on batches; :mod:`rl_tformers.runtime.protocol`) as a
    behaviour policy of one environment: ``policy(obs) -> action``, ``reset()`` at each episode
    start and :meth:`observe_reward` after each step.

    Args:
        policy: the runtime policy (e.g. ``load_run(run_dir).agent.policy()``).
        target_return: the return a return-conditioned policy is asked for (None otherwise).
        name: stored in the dataset metadata.
    """

    def __init__(self, policy: Any, target_return: float | None = None, name: str = "run") -> None:
        self.policy, self.target_return, self.name = policy, target_return, name
        self.reset()

    def reset(self) -> None:
        """Start a new episode: a fresh state, the next call marked as the episode's first step."""
        self._state = self.policy.initial_state(1, self.target_return)
        self._start, self._reward = True, 0.0

    def observe_reward(self, reward: float) -> None:
        """The reward of the step just taken (the next call's ``last_reward``)."""
        self._reward = float(reward)

    def __call__(self, obs: Any) -> Any:
        """One observation -> one action of the environment's action space (the batch of one removed)."""
        action, self._state = self.policy.act(np.asarray(obs)[None], self._state, np.array([self._start]),
                                              np.array([self._reward], np.float32))
        self._start = False
        return np.asarray(action)[0]


def _reward_hook(policy: Any) -> Any:
    """The ``observe_reward`` of ``policy`` or of the policy it wraps (``.policy``), else None."""
    while policy is not None:
        hook = getattr(policy, "observe_reward", None)
        if callable(hook):
            return hook
        policy = getattr(policy, "policy", None)
    return None


def observation_encoding(env: gym.Env) -> dict | None:
    """How ``env`` encodes its observations, for the dataset metadata: ``{"kind": "flatten",
    "by": "gymnasium.spaces.flatten", "source_space": repr of the task's own space, "dim": F}``
    when a :class:`~rl_tformers.envs.environments.OneHotObservation` is among its wrappers (one-hot
    per Discrete, concatenated over MultiDiscrete and Tuple components), else None."""
    e = env
    while isinstance(e, gym.Wrapper):
        if isinstance(e, OneHotObservation):
            return {"kind": "flatten", "by": "gymnasium.spaces.flatten", "source_space": repr(e.source_space),
                    "dim": int(e.observation_space.shape[0])}
        e = e.env
    return None


def _make_collector(env: gym.Env, pomdp: dict | None) -> EpisodeRecorder:
    """A recorder of ``env``'s steps; with ``pomdp`` it records the masked observations, of a
    frame-stacked environment (``FrameStackObservation``, k frames of C channels) the newest
    frame of each observation (its last C channels)."""
    k = frame_stack_of(env)
    if k > 1:
        space = env.observation_space
        c = space.shape[0] // k
        frame = gym.spaces.Box(space.low[-c:], space.high[-c:], dtype=space.dtype)
        return EpisodeRecorder(env, observation=lambda o: np.asarray(o)[-c:], observation_space=frame)
    if pomdp is None:
        return EpisodeRecorder(env)
    masked = ObservationMaskWrapper(gym.make(env.spec.id), pomdp["indices"])
    idx = np.asarray(pomdp["indices"], dtype=np.int64)
    return EpisodeRecorder(env, observation=lambda o: np.asarray(o)[idx], observation_space=masked.observation_space)


def registered_spec(env_id: str) -> gym.envs.registration.EnvSpec:
    """The registered spec of ``env_id``, also for gymnasium's ``"module:EnvId"`` form.

    ``gym.make`` imports ``module`` (which registers ``EnvId``) but ``gym.spec`` (what Minari
    calls on an ``eval_env`` string) does not accept the prefix, so it is resolved here.
    """
    module, _, name = env_id.rpartition(":")
    if module:
        importlib.import_module(module)
    return gym.spec(name)


def check_recordable(env: gym.Env) -> None:
    """Refuse an environment whose spec Minari cannot store as JSON, before anything is collected.

    Raises:
        ValueError: the spec is missing or holds a callable (an entry point or kwarg that is a
            function/class object rather than a ``"module:Attr"`` string).
    """
    spec = env.spec
    try:
        if spec is None:
            raise ValueError("it has no spec (not made by gym.make)")
        spec.to_json()
    except Exception as exc:  # gymnasium raises ValueError for callables, TypeError for other objects
        name = getattr(spec, "id", None) or type(env.unwrapped).__name__
        raise ValueError(f"environment {name!r} cannot be recorded in a Minari dataset: its spec is not "
                         f"JSON-serialisable ({exc}); register it with a string entry point "
                         "(gym.register(id, entry_point='module:Class')) and JSON-compatible kwargs") from None


def _eval_env(env_id: str, pomdp: dict | None, encoded: bool = False):
    if is_pixel_id(env_id) or encoded:  # the preprocessed or encoded environment (its wrappers are in the spec)
        env = make_task(env_id)
        env.close()
        return env.spec
    if pomdp is None:
        return registered_spec(env_id)
    return ObservationMaskWrapper(gym.make(env_id), pomdp["indices"]).spec


def _create(collector, dataset_id: str, env_id: str, pomdp: dict | None, description: str, record: dict):
    refs = reference_scores(env_id)
    k = frame_stack_of(collector.env)
    encoding = observation_encoding(collector.env)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*is set to None.*", category=UserWarning)
        md = collector.create_dataset(
            dataset_id=dataset_id, eval_env=_eval_env(env_id, pomdp, encoding is not None), algorithm_name=record.get("algorithm", "rl-tformers collect"),
            author="rl-tformers", description=description,
            ref_min_score=None if refs is None else refs[0], ref_max_score=None if refs is None else refs[1],
            num_episodes_average_score=0)
    md.storage.update_metadata({META_KEY: {**record, "pomdp": pomdp, **({FRAME_STACK_KEY: k} if k > 1 else {}),
                                           **({"observation_encoding": encoding} if encoding else {})}})
    return md


def collect(
    env_id: str,
    behaviours: Sequence[Behaviour],
    *,
    dataset_id: str,
    seed: int = 0,
    pomdp: dict | None = None,
    root: str | Path | None = None,
    hdf5: str | Path | None = None,
    overwrite: bool = False,
    progress: bool = True,
    description: str = "",
    record: dict | None = None,
    env_kwargs: dict | None = None,
) -> CollectResult:
    """Roll out ``behaviours`` in ``make_task(env_id)`` and write Minari dataset ``dataset_id``.

    Args:
        env_id: gymnasium id (e.g. ``"Hopper-v5"``).
        behaviours: shards run in order into one dataset.
        dataset_id: Minari id ``namespace/name-vN``; written to ``<root>/<dataset_id>``.
        seed: episode reset seeds come from ``default_rng([seed, 0])``.
        pomdp: a :func:`~rl_tformers.envs.pomdp.pomdp_record` to store masked observations.
        root: data root (default :func:`~rl_tformers.envs.loaders.data_root`).
        hdf5: also write a D4RL-layout HDF5 file there.
        overwrite: replace an existing dataset of that id.
        progress: show progress on stderr: a tqdm bar on a terminal, else a plain line every
            10 s or 5% of the steps and at the end (:func:`~rl_tformers.runtime.progress.progress_bar`).
        description: stored in the Minari metadata.
        record: extra JSON facts for the metadata (recipe name, policies...).
        env_kwargs: passed to :func:`~rl_tformers.envs.environments.make_task` (``gym.make``).

    Returns:
        :class:`CollectResult` with the returns and lengths the rollout saw.

    Raises:
        FileExistsError: the dataset or the ``hdf5`` file exists and ``overwrite`` is False.
        ValueError: malformed ``dataset_id``; ``hdf5`` a directory or below a file
            (:func:`check_hdf5_target`, checked before collecting); an environment whose spec
            Minari cannot store (:func:`check_recordable`).

    A build that fails or is interrupted removes its half-written dataset folder; with
    ``overwrite`` the dataset it was to replace is kept aside until the new one is complete and
    put back otherwise.
    """
    root_path = data_root(root)
    check_hdf5_target(hdf5, overwrite)
    check_stop()  # before an existing dataset is replaced
    with _dataset_build(dataset_id, root_path, overwrite):
        result = _collect(env_id, behaviours, dataset_id, seed, pomdp, root_path, progress, description, record,
                          env_kwargs)
    if hdf5 is not None:
        result.hdf5_path = save_d4rl_hdf5(load_minari(result.path), hdf5)
    return result


def _collect(env_id, behaviours, dataset_id, seed, pomdp, root_path, progress, description, record,
             env_kwargs) -> CollectResult:
    seeds = np.random.default_rng([int(seed), 0])
    returns: list[float] = []
    lengths: list[int] = []
    slices: list[tuple[int, int]] = []
    total = sum(b.steps or 0 for b in behaviours)
    with minari_root(root_path):
        env = make_task(env_id, **(env_kwargs or {}))
        try:
            check_recordable(env)
            collector = _make_collector(env, pomdp)
        except BaseException:
            env.close()
            raise
        # a bar on a terminal, plain lines in a log file (no carriage-return fragments)
        bar = progress_bar(total or None, unit="step", enabled=progress, desc=dataset_id)
        try:
            for b in behaviours:
                first = len(returns)
                done_steps = done_eps = 0
                while (b.steps is not None and done_steps < b.steps) or (b.episodes is not None and done_eps < b.episodes):
                    obs, _ = collector.reset(seed=int(seeds.integers(2**31 - 1)))
                    b.policy.reset()
                    observe = _reward_hook(b.policy)
                    ep_rewards: list[float] = []
                    while True:
                        check_stop()
                        obs, rew, terminated, truncated, _ = collector.step(b.policy(obs))
                        ep_rewards.append(float(rew))
                        if observe is not None:
                            observe(rew)
                        bar.update(1)
                        if terminated or truncated:
                            break
                    ep_ret, ep_len = math.fsum(ep_rewards), len(ep_rewards)
                    returns.append(ep_ret)
                    lengths.append(ep_len)
                    done_steps += ep_len
                    done_eps += 1
                    bar.set_postfix(episodes=len(returns), ret=f"{ep_ret:.0f}")
                slices.append((first, len(returns)))
            rec = {"env_id": env_id, "seed": int(seed), **(record or {}),
                   "behaviours": [{"label": b.label, **b.info, "episodes": [s, e],
                                   "return_mean": float(np.mean(returns[s:e])) if e > s else None}
                                  for b, (s, e) in zip(behaviours, slices)]}
            _create(collector, dataset_id, env_id, pomdp, description, rec)
        finally:
            bar.close()
            collector.close()
    return CollectResult(dataset_id, root_path / dataset_id, np.asarray(returns), np.asarray(lengths, np.int64),
                         slices)


class _CountSteps(gym.Wrapper):
    """Passes every step through unchanged and counts it in ``bar`` (the progress of a training run)."""

    def __init__(self, env: gym.Env, bar: Any) -> None:
        super().__init__(env)
        self._bar = bar

    def step(self, action):
        out = self.env.step(action)
        self._bar.update(1)
        return out


@contextmanager
def _training_progress(env: gym.Env, algo: str, steps: int, progress: bool) -> Iterator[tuple[gym.Env, bool]]:
    """``(env, sb3_progress_bar)`` for :func:`~rl_tformers.envs.policies.train_sb3`: on a terminal
    SB3's own bar; otherwise (a log file) no bar but plain progress lines on stderr
    (:class:`~rl_tformers.runtime.progress.PlainProgress`), counted by a pass-through wrapper."""
    if not progress or is_terminal(sys.stderr):
        yield env, progress
        return
    bar = PlainProgress(int(steps), desc=f"{algo} training", unit="step")
    try:
        yield _CountSteps(env, bar), False
    finally:
        bar.close()


def _train_recording(algo, env_id, steps, seed, replay_dataset_id, pomdp, progress, description, stop, record,
                     train_kwargs):
    """:func:`train_and_record`'s training with every transition recorded; writes the replay
    dataset (with ``stopped``: the step and evaluation return an early stop happened at)."""
    env = make_task(env_id)
    check_recordable(env)
    collector = _make_collector(env, pomdp)
    try:
        with _training_progress(SeededResets(collector, seed), algo, steps, progress) as (counted, sb3_bar):
            model = train_sb3(algo, counted, steps, seed=seed, progress=sb3_bar, callbacks=stop, **train_kwargs)
        rec = {"env_id": env_id, "seed": int(seed), "algorithm": f"{algo} training ({steps} steps)",
               "behaviours": [{"label": f"{algo} training replay", "train_steps": int(steps)}], **(record or {})}
        if stop:
            last = float(stop[0].last_mean_reward)  # -inf until the first evaluation
            rec["stopped"] = {"step": int(model.num_timesteps), "eval_return": last if math.isfinite(last) else None,
                              "until_return": float(stop[0].callback_on_new_best.reward_threshold)}
        _create(collector, replay_dataset_id, env_id, pomdp, description or
                f"{algo.upper()} training replay data ({steps} steps) on {env_id}", rec)
    finally:
        collector.close()
    return model


def train_and_record(
    algo: str,
    env_id: str,
    steps: int,
    *,
    seed: int = 0,
    replay_dataset_id: str | None = None,
    pomdp: dict | None = None,
    root: str | Path | None = None,
    hdf5: str | Path | None = None,
    overwrite: bool = False,
    progress: bool = True,
    description: str = "",
    until_return: float | None = None,
    record: dict | None = None,
    train_kwargs: dict | None = None,
):
    """Train an SB3 agent for ``steps`` environment steps; optionally record its training data.

    With ``replay_dataset_id`` the training environment is wrapped in an
    :class:`~rl_tformers.envs.recording.EpisodeRecorder`,
    so the dataset holds every transition the agent experienced while learning, in order:
    for SAC this is exactly its replay buffer (buffer size 1M >= steps), i.e. a D4RL-style
    *medium-replay* set. The episode running when training stops is kept, marked truncated.
    With ``until_return`` training stops early once the agent's deterministic evaluation return
    reaches it (:func:`~rl_tformers.envs.policies.until_return_callback`); the dataset's metadata
    records the step and the return it stopped at (``stopped``). ``record`` adds JSON facts to
    the metadata (a recipe's name and shards). ``train_kwargs`` go to the SB3 algorithm
    (:func:`~rl_tformers.envs.policies.train_sb3`: a pixel recipe's DQN settings). The
    environment is :func:`~rl_tformers.envs.environments.make_task`'s, so a DQN trained on a
    pixel task records its exploration (epsilon-greedy) transitions as the DQN-replay data do.

    Returns:
        ``(policy, replay_result)``: the trained agent as a deterministic
        :class:`~rl_tformers.envs.policies.SB3Policy` and a :class:`CollectResult` (or ``None``).
    """

    root_path = data_root(root)
    check_hdf5_target(hdf5, overwrite)
    check_stop()
    stop = [] if until_return is None else [until_return_callback(
        env_id, until_return, seed=seed, every=R.REPLAY_EVAL_EVERY, episodes=R.REPLAY_EVAL_EPISODES)]
    if replay_dataset_id is None:
        env = SeededResets(make_task(env_id), seed)
        with _training_progress(env, algo, steps, progress) as (counted, sb3_bar):
            model = train_sb3(algo, counted, steps, seed=seed, progress=sb3_bar, callbacks=stop, **(train_kwargs or {}))
        return SB3Policy(model, None, name=f"{algo}-trained-{model.num_timesteps}"), None
    with _dataset_build(replay_dataset_id, root_path, overwrite), minari_root(root_path):
        model = _train_recording(algo, env_id, steps, seed, replay_dataset_id, pomdp, progress, description, stop,
                                 record, dict(train_kwargs or {}))
    ds = load_minari(root_path / replay_dataset_id)
    result = CollectResult(replay_dataset_id, root_path / replay_dataset_id, ds.episode_returns, ds.lengths.copy(),
                           [(0, ds.num_episodes)])
    if hdf5 is not None:
        result.hdf5_path = save_d4rl_hdf5(ds, hdf5)
    return SB3Policy(model, None, name=f"{algo}-trained-{model.num_timesteps}"), result


def _recipe_record(recipe: R.Recipe) -> dict:
    """What a recipe build records in the dataset's metadata besides the rollout itself."""
    return {"recipe": recipe.name, "recipe_steps": recipe.base_steps, "recipe_version": recipe.version,
            "algorithm": f"recipe {recipe.name} v{recipe.version}"}


def _build_replay_recipe(recipe: R.Recipe, seed: int, root, hdf5, overwrite: bool, progress: bool):
    """A recipe whose one shard is a training replay (version 1 medium-replay)."""
    (s,) = recipe.shards
    pomdp = None
    if recipe.positions:
        env = gym.make(recipe.env_id)
        pomdp = pomdp_record(env, "positions")
        env.close()
    train_kwargs = R.train_kwargs(recipe, s)
    record = {**_recipe_record(recipe), "behaviours": [{"label": f"{s.policy} training replay",
                                                        **R.shard_record(recipe, s)}],
              **({"train_kwargs": train_kwargs} if train_kwargs else {})}
    _, result = train_and_record(s.policy, recipe.env_id, s.steps, seed=seed, replay_dataset_id=recipe.dataset_id,
                                 pomdp=pomdp, root=root, hdf5=hdf5, overwrite=overwrite, progress=progress,
                                 description=f"rl-tformers recipe {recipe.name} v{recipe.version}: {recipe.describe()}",
                                 until_return=s.until_return, record=record, train_kwargs=train_kwargs)
    return result


def build_recipe(recipe: R.Recipe, *, seed: int = 0, root=None, policies=None, hdf5=None, overwrite: bool = False,
                 progress: bool = True):
    """Collect one recipe into ``<root>/<recipe.dataset_id>``; returns a :class:`CollectResult`.

    Shard ``i`` draws its random actions, corruption and action samples from seed
    ``1000 * seed + i + 1``; a training shard trains with ``seed``."""
    if any(s.train for s in recipe.shards):
        return _build_replay_recipe(recipe, seed, root, hdf5, overwrite, progress)
    env = gym.make(recipe.env_id)
    behaviours = []
    for i, s in enumerate(recipe.shards):
        shard_seed = seed * 1000 + i + 1
        if s.policy == "random":
            pol = RandomPolicy(env.action_space, seed=shard_seed)
        else:
            pol = load_sb3_policy(R.policy_path(s.policy, recipe.env_id, policies), env, algo=s.policy,
                                  deterministic=not s.stochastic, seed=shard_seed)
            if s.epsilon > 0 or s.noise > 0:
                pol = NoisyPolicy(pol, env.action_space, noise_std=s.noise, epsilon=s.epsilon, seed=shard_seed)
        info = R.shard_record(recipe, s)
        behaviours.append(Behaviour(pol, steps=s.steps, label=info["policy"], info=info))
    pomdp = pomdp_record(env, "positions") if recipe.positions else None
    return collect(recipe.env_id, behaviours, dataset_id=recipe.dataset_id, seed=seed, pomdp=pomdp, root=root,
                   hdf5=hdf5, overwrite=overwrite, progress=progress,
                   description=f"rl-tformers recipe {recipe.name} v{recipe.version}: {recipe.describe()}",
                   record=_recipe_record(recipe))
