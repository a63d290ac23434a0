"""Memory tasks: partially observed control and a recall task whose memory length is a knob.

Registered gymnasium ids (importing this module registers them; ``gym.make`` also accepts the
``"rl_tformers.envs.memory_tasks:<id>"`` form, which imports the module first):

==================================  ==========================================================
``rl_tformers/PositionOnlyCartPole-v1``  CartPole-v1 with the velocities hidden: obs (x, theta)
``rl_tformers/PositionOnlyPendulum-v1``  Pendulum-v1 without the angular velocity: obs (cos, sin)
``rl_tformers/PositionOnlyHopper-v5``    Hopper-v5 with qvel hidden: obs qpos[1:] (5 values)
``rl_tformers/Recall-v0``                repeat the symbol shown ``delay`` steps ago (kwargs)
``rl_tformers/Recall-d{d}-v0``           the same with d in 1, 2, 4, ..., 64, 4 symbols, d + 32 steps
==================================  ==========================================================

A memoryless policy cannot solve any of them: velocities must be inferred from successive
positions (the "velocity-masked" tasks of Parisotto et al. 2019 / POPGym, Morad et al. 2023),
and the recall answer is independent of the current observation.

The position-only wrappers are the data layer's observation mask
(:class:`rl_tformers.envs.pomdp.ObservationMaskWrapper`) with the indices of
:data:`POSITION_INDICES`; for Hopper they equal :func:`rl_tformers.envs.pomdp.position_indices`
(tested), so datasets recorded with ``rl-tformers collect --pomdp positions`` and these
evaluation environments hide exactly the same entries.

:func:`scripted_action` gives behaviour policies for building offline datasets of the recall
task (an oracle mixed with random actions) and of CartPole (a linear controller on the full
state, recorded through the position-only mask); :func:`collect_episodes` rolls them out and
:func:`scripted_dataset` makes a dataset of them. Command line (D4RL-layout HDF5 that every
agent's ``dataset.path`` accepts)::

    rl-tformers collect --memory-task recall --delay 8 --episodes 2000 --hdf5 data/memory/recall-d8.hdf5
    python -m rl_tformers.envs.memory_tasks recall --delay 8 --episodes 2000 --out data/memory/recall-d8.hdf5
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import typer
from gymnasium import spaces
from rl_tformers.envs.dataset import DatasetMetadata, EpisodeDataset
from rl_tformers.envs.loaders import save_d4rl_hdf5
from rl_tformers.envs.pomdp import ObservationMaskWrapper

#: Indices of the observation entries kept by the position-only variants (the rest are
#: velocities). CartPole-v1: (x, x_dot, theta, theta_dot); Pendulum-v1: (cos, sin, theta_dot);
#: Hopper-v5: qpos[1:] (5) then qvel (6).
POSITION_INDICES: dict[str, tuple[int, ...]] = {
    "CartPole-v1": (0, 2),
    "Pendulum-v1": (0, 1),
    "Hopper-v5": (0, 1, 2, 3, 4),
}


def position_only(env: gym.Env, base_id: str) -> gym.Env:
    """Wrap ``env`` (made from ``base_id``) so only its position entries are observed.

    Uses the data layer's :class:`~rl_tformers.envs.pomdp.ObservationMaskWrapper`; for MuJoCo
    tasks the indices are the data layer's :func:`~rl_tformers.envs.pomdp.position_indices`
    (what ``rl-tformers collect --pomdp positions`` records), checked against
    :data:`POSITION_INDICES`.

    Raises:
        KeyError: if ``base_id`` has no known position indices.
    """
    if base_id not in POSITION_INDICES:
        raise KeyError(f"no position-only mask for {base_id!r}; known: {', '.join(sorted(POSITION_INDICES))}")
    return ObservationMaskWrapper(env, POSITION_INDICES[base_id])


def _make_position_only(base_id: str, **kwargs: Any) -> gym.Env:
    return position_only(gym.make(base_id, **kwargs), base_id)


class RecallEnv(gym.Env):
    """Repeat the symbol observed ``delay`` steps ago.

    Each step shows a uniformly random symbol s_t in {0..K-1} as a one-hot vector (K,).
    From step ``delay`` on, the action (Discrete(K)) is scored: reward 1 if a_t == s_{t-delay},
    else 0. Actions before ``delay`` are not scored. The episode terminates after ``length``
    steps, so the best return is ``length - delay`` and a memoryless policy earns
    ``(length - delay) / K`` in expectation (s_{t-delay} is independent of s_t).

    The required memory length is exactly ``delay`` steps. ``info["target"]`` holds the
    answer for the current step (-1 before ``delay``), used by the scripted behaviour policy.

    Args:
        delay: d >= 1, how many steps back to recall.
        n_symbols: K >= 2.
        length: episode length (> delay).

    Raises:
        ValueError: for out-of-range arguments, or arguments that are not integers (bools and
            floats such as 2.0 included), naming the argument.
    """

    metadata = {"render_modes": []}

    def __init__(self, delay: int = 4, n_symbols: int = 4, length: int = 32) -> None:
        for name, value in (("delay", delay), ("n_symbols", n_symbols), ("length", length)):
            # an integer, never a bool or a float (2.0 from a YAML file would crash the first
            # scored step with numpy's "only integers ... are valid indices")
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"Recall: {name} must be an integer, got {value!r} ({type(value).__name__})")
        delay, n_symbols, length = int(delay), int(n_symbols), int(length)
        if delay < 1 or n_symbols < 2 or length <= delay:
            raise ValueError(
                f"Recall: need delay >= 1, n_symbols >= 2, length > delay; got {delay}, {n_symbols}, {length}"
            )
        self.delay, self.n_symbols, self.length = delay, n_symbols, length
        self.observation_space = spaces.Box(0.0, 1.0, (n_symbols,), dtype=np.float32)
        self.action_space = spaces.Discrete(n_symbols)
        self._symbols = np.zeros(length, dtype=np.int64)
        self._t = 0

    def _obs(self) -> np.ndarray:
        o = np.zeros(self.n_symbols, dtype=np.float32)
        o[self._symbols[self._t]] = 1.0
        return o

    def _target(self) -> int:
        return int(self._symbols[self._t - self.delay]) if self._t >= self.delay else -1

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        """Draw the episode's ``length`` symbols; returns (one-hot of s_0 (K,), {"target": -1})."""
        super().reset(seed=seed)
        self._symbols = self.np_random.integers(0, self.n_symbols, size=self.length)
        self._t = 0
        return self._obs(), {"target": self._target()}

    def step(self, action):
        """Score ``action`` (reward 1.0 or 0.0; see the class docstring) and show the next symbol;
        the last step (``length``) terminates with an all-zero observation and target -1."""
        target = self._target()
        reward = float(target >= 0 and int(action) == target)
        self._t += 1
        terminated = self._t >= self.length
        if terminated:
            return np.zeros(self.n_symbols, dtype=np.float32), reward, True, False, {"target": -1}
        return self._obs(), reward, False, False, {"target": self._target()}


RECALL_ID = "rl_tformers/Recall-v0"
#: Registered recall variants ``rl_tformers/Recall-d{d}-v0``: delay d, 4 symbols, d + 32 steps
#: (32 scored answers: chance return 8, best 32), so a dataset's ``env_id`` alone names its task.
RECALL_DELAYS = (1, 2, 4, 8, 16, 32, 64)
#: Prefix that makes ``gym.make`` import this module first (gymnasium's ``"module:id"`` form).
MODULE_PREFIX = "rl_tformers.envs.memory_tasks:"


def recall_id(delay: int) -> str:
    """Gymnasium id of the registered recall variant with this delay.

    Raises:
        ValueError: ``delay`` is not one of :data:`RECALL_DELAYS` (use ``Recall-v0`` with kwargs).
    """
    if delay not in RECALL_DELAYS:
        raise ValueError(f"no registered recall variant with delay {delay}; registered: {RECALL_DELAYS} "
                         f"(or gym.make({RECALL_ID!r}, delay=...))")
    return f"rl_tformers/Recall-d{delay}-v0"


TASK_IDS = {
    "rl_tformers/PositionOnlyCartPole-v1": "CartPole-v1",
    "rl_tformers/PositionOnlyPendulum-v1": "Pendulum-v1",
    "rl_tformers/PositionOnlyHopper-v5": "Hopper-v5",
}


def register_all() -> None:
    """Register the memory tasks with gymnasium (idempotent)."""
    for env_id, base in TASK_IDS.items():
        if env_id not in gym.registry:
            gym.register(env_id, entry_point=_make_position_only, kwargs={"base_id": base})
    if RECALL_ID not in gym.registry:
        gym.register(RECALL_ID, entry_point=RecallEnv)
    for d in RECALL_DELAYS:
        if recall_id(d) not in gym.registry:
            gym.register(recall_id(d), entry_point=RecallEnv, kwargs={"delay": d, "n_symbols": 4, "length": d + 32})


register_all()


# -- scripted behaviour policies and rollouts ---------------------------------------------------
def cartpole_controller(state: np.ndarray) -> np.ndarray:
    """Linear state-feedback controller for CartPole-v1 on the *full* state (N, 4) -> actions (N,).

    Pushes right when ``theta + 0.5 * theta_dot + 0.05 * x + 0.1 * x_dot > 0``; it balances
    the pole for the full 500 steps from the standard initial states.
    """
    s = np.asarray(state, dtype=np.float64)
    u = s[:, 2] + 0.5 * s[:, 3] + 0.05 * s[:, 0] + 0.1 * s[:, 1]
    return (u > 0).astype(np.int64)


def scripted_action(
    task: str, full_obs: np.ndarray, info: dict[str, Any], rng: np.random.Generator, epsilon: float
) -> np.ndarray:
    """Actions of the scripted behaviour policy of ``task`` for N environments.

    Args:
        task: ``"recall"`` (oracle answer from ``info["target"]``) or ``"cartpole"``
            (:func:`cartpole_controller` on the unmasked state).
        full_obs: (N, obs_dim) unmasked observation (unused for recall).
        info: the vector environment's info dict (recall needs ``target`` (N,)).
        rng: random generator for the epsilon mixing.
        epsilon: probability of a uniformly random action, per environment and step.

    Returns:
        (N,) int64 actions.

    Raises:
        ValueError: for an unknown task.
    """
    if task == "recall":
        target = np.asarray(info["target"], dtype=np.int64)
        n_sym = full_obs.shape[1]
        best = np.where(target >= 0, target, 0)
    elif task == "cartpole":
        best = cartpole_controller(full_obs)
        n_sym = 2
    else:
        raise ValueError(f"unknown scripted task {task!r}; use 'recall' or 'cartpole'")
    random_a = rng.integers(0, n_sym, size=best.shape[0])
    return np.where(rng.random(best.shape[0]) < epsilon, random_a, best)


def collect_episodes(
    task: str,
    n_episodes: int,
    *,
    epsilon: float = 0.2,
    seed: int = 0,
    n_envs: int = 8,
    env_kwargs: dict[str, Any] | None = None,
) -> list[dict[str, np.ndarray]]:
    """Roll out a scripted behaviour policy and return exactly ``n_episodes`` episodes.

    The environments are unmasked (``CartPole-v1`` / :class:`RecallEnv`); for CartPole the
    stored observations are the position-only ones (indices :data:`POSITION_INDICES`), i.e.
    the dataset of ``rl_tformers/PositionOnlyCartPole-v1``.

    Episodes are taken in order of completion across the ``n_envs`` vector environments
    (autoreset "next step" mode); once ``n_episodes`` have finished the rest are dropped.

    Returns:
        Minari-style episodes (:meth:`EpisodeDataset.from_episodes` reads them): dicts with
        ``observations`` (L + 1, obs_dim) float32 (the last is the final observation), ``actions`` (L,) int64,
        ``rewards`` (L,) float32, ``terminations`` (L,) bool, ``truncations`` (L,) bool.
    """
    kwargs = env_kwargs or {}
    if task == "recall":
        fns = [lambda: RecallEnv(**kwargs) for _ in range(n_envs)]
        keep = None
    elif task == "cartpole":
        fns = [lambda: gym.make("CartPole-v1", **kwargs) for _ in range(n_envs)]
        keep = np.asarray(POSITION_INDICES["CartPole-v1"])
    else:
        raise ValueError(f"unknown scripted task {task!r}; use 'recall' or 'cartpole'")
    env = gym.vector.SyncVectorEnv(fns, autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP)
    c = _scripted_steps(env, task, n_episodes, n_envs, epsilon, seed)
    if keep is not None:
        c["o"], c["final"] = c["o"][..., keep], c["final"][..., keep]  # next-step autoreset: nobs is final
    return _split_episodes(c, n_episodes, n_envs)


def _scripted_steps(env: gym.vector.VectorEnv, task: str, n_episodes: int, n_envs: int, epsilon: float,
                    seed: int) -> dict[str, np.ndarray]:
    """Step the scripted policy in ``env`` (closed after) until ``n_episodes`` episodes have
    finished; returns every step's fields stacked as (S, N, ...) arrays: ``o`` observations,
    ``a`` actions, ``r`` rewards, ``te`` / ``tr`` terminations / truncations, ``final`` the next
    observations and ``real`` (False at an autoreset step, which holds no data)."""
    rng = np.random.default_rng(seed)
    obs, info = env.reset(seed=seed)
    cols: dict[str, list[np.ndarray]] = {k: [] for k in ("o", "a", "r", "te", "tr", "final", "real")}
    skip = np.zeros(n_envs, dtype=bool)  # the step after a done is the autoreset step (no data)
    finished = 0
    while finished < n_episodes:
        act = scripted_action(task, obs, info, rng, epsilon)
        nobs, rew, term, trunc, ninfo = env.step(act)
        for k, v in (("o", obs), ("a", act), ("r", rew), ("te", term), ("tr", trunc), ("final", nobs), ("real", ~skip)):
            cols[k].append(np.asarray(v))
        finished += int(((term | trunc) & ~skip).sum())
        skip = term | trunc
        obs, info = nobs, ninfo
    env.close()
    return {k: np.stack(v) for k, v in cols.items()}  # (S, N, ...) per field


def _split_episodes(c: dict[str, np.ndarray], n_episodes: int, n_envs: int) -> list[dict[str, np.ndarray]]:
    """The first ``n_episodes`` episodes to finish in the steps ``c`` of :func:`_scripted_steps`,
    as :func:`collect_episodes` returns them."""
    done = (c["te"] | c["tr"]) & c["real"]  # (S, N)
    # episodes in order of completion (step, then environment), each a run of real steps of one env
    ends_t, ends_i = np.nonzero(done)
    episodes: list[dict[str, np.ndarray]] = []
    first = np.zeros(n_envs, dtype=np.int64)  # next unread step of each env
    for t, i in zip(ends_t[:n_episodes], ends_i[:n_episodes]):  # one iteration per episode
        steps = np.arange(first[i], t + 1)
        steps = steps[c["real"][steps, i]]
        first[i] = t + 1
        episodes.append({
            "observations": np.concatenate([c["o"][steps, i], c["final"][t, i][None]]).astype(np.float32),
            "actions": c["a"][steps, i].astype(np.int64),
            "rewards": c["r"][steps, i].astype(np.float32),
            "terminations": c["te"][steps, i].astype(bool),
            "truncations": c["tr"][steps, i].astype(bool),
        })
    return episodes


def scripted_dataset(
    task: str,
    n_episodes: int,
    *,
    epsilon: float = 0.2,
    seed: int = 0,
    delay: int = 8,
):
    """An :class:`~rl_tformers.envs.dataset.EpisodeDataset` from :func:`collect_episodes`.

    Args:
        task: ``"recall"`` (the registered ``Recall-d{delay}-v0``) or ``"cartpole"``
            (``PositionOnlyCartPole-v1``).
        n_episodes: episodes to collect.
        epsilon: random-action probability of the scripted behaviour policy.
        seed: collection seed (deterministic).
        delay: recall delay d (one of :data:`RECALL_DELAYS`).

    The metadata's ``env_id`` is the evaluation environment in gymnasium's ``"module:id"``
    form (``gym.make`` imports this module first, so any agent's evaluation finds it); the
    behaviour policy is described in ``metadata.extra["behaviour"]``.
    """

    if task == "recall":
        env_id = recall_id(delay)
        probe = gym.make(env_id).unwrapped
        kwargs = {"delay": probe.delay, "n_symbols": probe.n_symbols, "length": probe.length}
        eps = collect_episodes(task, n_episodes, epsilon=epsilon, seed=seed, env_kwargs=kwargs)
        obs_space, act_space = probe.observation_space, probe.action_space
        behaviour = f"oracle answer, epsilon={epsilon} random actions"
    elif task == "cartpole":
        env_id = "rl_tformers/PositionOnlyCartPole-v1"
        eps = collect_episodes(task, n_episodes, epsilon=epsilon, seed=seed)
        obs_space = gym.make(env_id).observation_space
        act_space = spaces.Discrete(2)
        behaviour = f"linear controller on the full state, epsilon={epsilon} random actions"
    else:
        raise ValueError(f"unknown scripted task {task!r}; use 'recall' or 'cartpole'")
    meta = DatasetMetadata(
        env_id=MODULE_PREFIX + env_id, source="memory", dataset_id=f"{env_id.split('/')[1]}-scripted",
        extra={"behaviour": behaviour, "seed": seed, "epsilon": epsilon},
    )
    return EpisodeDataset.from_episodes(eps, observation_space=obs_space, action_space=act_space, metadata=meta)


def main(
    task: str = typer.Argument(..., help="recall or cartpole"),
    out: Path = typer.Option(..., "--out", help="D4RL-layout .hdf5 file to write"),
    episodes: int = typer.Option(2000, help="episodes to collect"),
    epsilon: float = typer.Option(0.2, help="probability of a random action"),
    delay: int = typer.Option(8, help="recall delay d (1, 2, 4, 8, 16, 32 or 64)"),
    seed: int = typer.Option(0, help="collection seed"),
) -> None:
    """Write an offline dataset of a memory task (scripted behaviour policy) as D4RL HDF5."""

    ds = scripted_dataset(task, episodes, epsilon=epsilon, seed=seed, delay=delay)
    path = save_d4rl_hdf5(ds, out)
    r = ds.episode_returns
    typer.echo(f"{path}: {ds.num_episodes} episodes, {ds.num_steps} steps, return {r.mean():.2f} +- {r.std():.2f}, "
               f"env {ds.metadata.env_id}")


if __name__ == "__main__":  # python -m rl_tformers.envs.memory_tasks TASK --out FILE
    _app = typer.Typer(add_completion=False, context_settings={"help_option_names": ["-h", "--help"]})
    _app.command()(main)
    _app(prog_name="python -m rl_tformers.envs.memory_tasks")
