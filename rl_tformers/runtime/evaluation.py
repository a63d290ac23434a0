"""Evaluation of any :class:`~rl_tformers.runtime.protocol.Policy` in gymnasium vector envs.

One loop serves every agent (Decision Transformer, GTrXL, BC): per environment step it makes
**one** ``policy.act`` call for all N environments (one batched forward pass), so the cost of
the model is paid once per step, not once per environment.

Counting without bias. Taking "the first ``episodes`` episodes that finish" over-represents
short episodes (they finish first). Instead episode ``j`` (0 <= j < episodes) is assigned in
advance to environment ``j % N`` and reset with seed ``seed + j``; an environment that has
finished its quota is not stepped any more (its row of the policy's batch is still acted on, with
``episode_start`` at every step, and its actions are discarded). A vector environment that can
only step all its environments at once (:class:`gymnasium.vector.AsyncVectorEnv`) keeps stepping
it through unseeded filler episodes, whose context restarts at every step, so a filler episode
longer than every counted one cannot stop the evaluation at a policy's limit (a Decision
Transformer's ``max_ep_len``). The result is the same set of (seed, episode) pairs whatever the
episode lengths, and the same seeds are used for every target return, so targets are compared on
the same initial states.

Profiling. The loop wraps environment stepping in the ``env`` span of
:mod:`rl_tformers.runtime.eval_profile` (the policies wrap their parts); inside a
:func:`~rl_tformers.runtime.eval_profile.profiling` block the wall time of an evaluation is split
into them, and outside one the spans cost nothing.

Stochastic policies. A policy that samples its actions with torch's global random number
generator (GTrXL with ``agent.deterministic=false``) draws them, for every target, from that
generator seeded with ``seed``; the generator's previous state is restored afterwards (CPU and
the initialised CUDA devices), so an evaluation inside a training run does not shift the
training's random stream. The same ``seed``, ``episodes`` and ``n_envs`` give the same returns.

Raw returns. The reward reported is the one the *innermost* environment returns: a wrapper
(:class:`RawRewardInfo`) is inserted directly above the unwrapped environment and writes it into
``info["raw_reward"]``, so reward-scaling or normalising wrappers stacked by ``make_env`` do not
change reported returns. The same raw reward is passed to ``policy.act`` as ``last_reward``.

Finite numbers only. An action with a NaN or inf (a Decision Transformer conditioned on a
target far beyond what its float32 embedding holds, a diverged model) is never sent to the
environment: evaluation stops with a :class:`NonFiniteError` naming the target, the episode, its
seed and the step. A non-finite reward from the environment stops it the same way. So every
reported return is a finite number and the results serialise as strict JSON
(:func:`strict_json`).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from rl_tformers.runtime.eval_profile import span
from rl_tformers.runtime.protocol import Policy
from rl_tformers.runtime.seeding import derive_seed

RAW_REWARD_KEY = "raw_reward"

EnvFactory = Callable[[], gym.Env]


class NonFiniteError(ValueError):
    """The policy produced a non-finite action, or the environment a non-finite reward."""


class EnvironmentBuildError(ValueError):
    """The evaluation environment cannot be built here (an id gymnasium does not know, a missing
    dependency such as MuJoCo, a bad keyword argument); the message names the environment."""


#: Largest base reset seed: the seed of torch's global generator too (``torch.manual_seed`` takes
#: integers in ``[0, 2**64 - 1]``, :data:`rl_tformers.runtime.seeding.MAX_SEED`).
MAX_EVAL_SEED = 2**64 - 1


def finite_or_none(obj: Any) -> Any:
    """``obj`` with every non-finite float (NaN, +-inf) replaced by ``None`` (JSON ``null``),
    in nested dicts, lists and tuples; other values unchanged."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    if isinstance(obj, np.floating):
        return finite_or_none(float(obj))
    return obj


def strict_json(obj: Any, **kwargs: Any) -> str:
    """``json.dumps`` that never writes the non-standard ``NaN`` / ``Infinity`` tokens: non-finite
    floats become ``null`` (:func:`finite_or_none`), then ``allow_nan=False``."""
    return json.dumps(finite_or_none(obj), allow_nan=False, **kwargs)


class RawRewardInfo(gym.Wrapper):
    """Writes the reward of the wrapped (innermost) environment into ``info["raw_reward"]``."""

    def step(self, action):
        """The wrapped step; a copy of ``info`` holds ``float(reward)`` under ``raw_reward``."""
        obs, reward, terminated, truncated, info = self.env.step(action)
        info = dict(info)
        info[RAW_REWARD_KEY] = float(reward)
        return obs, reward, terminated, truncated, info


def with_raw_reward(env: gym.Env) -> gym.Env:
    """Insert :class:`RawRewardInfo` directly above the unwrapped environment of ``env``.

    Wrappers above it (reward scaling, normalisation, time limits) keep working; only the
    innermost link of the chain changes. Returns the (outermost) environment.
    """
    if not isinstance(env, gym.Wrapper):
        return RawRewardInfo(env)
    w = env
    while isinstance(w.env, gym.Wrapper):
        w = w.env
    w.env = RawRewardInfo(w.env)
    return env


def make_env_factory(env_id: str, **kwargs: Any) -> EnvFactory:
    """``gym.make(env_id, **kwargs)`` as a zero-argument factory."""

    def make() -> gym.Env:
        return gym.make(env_id, **kwargs)

    return make


def max_episode_steps(make_env: EnvFactory) -> int | None:
    """The time limit of the environment ``make_env`` builds (``None`` when it has none)."""
    env = make_env()
    try:
        spec = env.spec
        return None if spec is None else spec.max_episode_steps
    finally:
        env.close()


@dataclass
class TargetResult:
    """Episodes of one target return.

    Attributes:
        target_return: the conditioning return (raw units) or ``None`` for unconditioned agents.
        returns: (episodes,) raw undiscounted returns, in episode order j = 0..episodes-1.
        lengths: (episodes,) episode lengths in steps.
        seeds: (episodes,) reset seed of each episode.
        normalized: (episodes,) D4RL-normalised scores (100 * (R - random) / (expert - random))
            or ``None`` when the environment has no reference returns.
        rewards: per-episode raw reward sequences (only when recorded), for the RTG traces.
    """

    target_return: float | None
    returns: list[float]
    lengths: list[int]
    seeds: list[int]
    normalized: list[float] | None = None
    rewards: list[list[float]] | None = None

    @property
    def return_mean(self) -> float:
        """Mean raw return over the episodes."""
        return float(np.mean(self.returns))

    @property
    def return_std(self) -> float:
        """Population standard deviation (``np.std``, ddof 0) of the raw returns."""
        return float(np.std(self.returns))

    @property
    def normalized_score(self) -> float | None:
        """Mean D4RL-normalised score, or ``None`` without reference returns."""
        return None if self.normalized is None else float(np.mean(self.normalized))

    @property
    def normalized_score_std(self) -> float | None:
        """Population standard deviation of the D4RL-normalised scores, or ``None``."""
        return None if self.normalized is None else float(np.std(self.normalized))

    def summary(self) -> dict[str, float | None]:
        """The scalars of this target, by name: ``return_mean``, ``return_std`` (raw units),
        ``normalized_score``, ``normalized_score_std`` (None without reference returns).

        The one list of a target's scalars: :meth:`to_dict` writes them into ``eval --json``
        and :func:`report_logs` into the training logs, so a new scalar is one line here.
        """
        return {
            "return_mean": self.return_mean,
            "return_std": self.return_std,
            "normalized_score": self.normalized_score,
            "normalized_score_std": self.normalized_score_std,
        }

    def to_dict(self, with_rewards: bool = False) -> dict[str, Any]:
        """JSON-ready dict: ``target_return``, ``returns``, the scalars of :meth:`summary`,
        ``lengths``, ``seeds`` (and ``rewards`` with ``with_rewards`` when recorded)."""
        out = {
            "target_return": self.target_return,
            "returns": [float(r) for r in self.returns],
            **self.summary(),
            "lengths": [int(n) for n in self.lengths],
            "seeds": [int(s) for s in self.seeds],
        }
        if with_rewards and self.rewards is not None:
            out["rewards"] = self.rewards
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TargetResult:
        """The inverse of :meth:`to_dict` (normalised scores are not read back).

        Raises:
            KeyError: no ``target_return`` or ``returns``.
            TypeError: ``d`` is not a dict.
            ValueError: ``returns`` not a list, a target or return that is not a finite number
                (``NaN`` in an old file),
                no returns, ``lengths`` / ``seeds`` that are not one integer per return, or
                ``rewards`` that are not one list of finite numbers per return, each summing to
                its episode's return (and as long as its length, when lengths are given); the
                message names the field and the episode.
        """
        if not isinstance(d, dict):
            raise TypeError(f"expected an object, got {type(d).__name__}")
        t, returns = d["target_return"], d["returns"]
        if not isinstance(returns, list):
            raise ValueError(f"returns must be a list of numbers, got {returns!r}")
        values = ([] if t is None else [t]) + returns
        if not all(_finite_number(v) for v in values):
            raise ValueError(f"target_return {t!r} and returns {returns!r} must be finite numbers")
        if not returns:
            raise ValueError("returns is empty: a result needs at least one episode")
        n = len(returns)
        lengths, seeds, rewards = d.get("lengths", []), d.get("seeds", []), d.get("rewards")
        for name, xs in (("lengths", lengths), ("seeds", seeds)):
            if xs and not (isinstance(xs, list) and len(xs) == n
                           and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in xs)):
                raise ValueError(f"{name} must be {n} non-negative integers (one per return), got {xs!r}")
        if rewards is not None:
            if not isinstance(rewards, list) or len(rewards) != n:
                raise ValueError(f"rewards must be {n} lists (one per return), got "
                                 f"{len(rewards) if isinstance(rewards, list) else type(rewards).__name__}")
            for j, ep in enumerate(rewards):
                if not (isinstance(ep, list) and all(_finite_number(x) for x in ep)):
                    raise ValueError(f"rewards of episode {j} must be a list of finite numbers")
                if lengths and len(ep) != lengths[j]:
                    raise ValueError(f"rewards of episode {j}: {len(ep)} rewards, but its length is {lengths[j]}")
                if not math.isclose(math.fsum(ep), returns[j], rel_tol=1e-9, abs_tol=1e-6):
                    raise ValueError(f"rewards of episode {j} sum to {math.fsum(ep)!r}, but its return is "
                                     f"{returns[j]!r}")
        return cls(
            target_return=t, returns=list(returns), lengths=list(lengths), seeds=list(seeds), normalized=None,
            rewards=None if rewards is None else [list(ep) for ep in rewards],
        )


def _finite_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class EvalReport:
    """All targets of one evaluation call, plus its settings and wall time.

    Attributes:
        results: one :class:`TargetResult` per target, in the order given.
        env_id: the environment evaluated (when known).
        episodes: episodes per target; n_envs: parallel environments used (N).
        seed: base reset seed (episode j: ``seed + j``).
        seconds: wall-clock time of the whole call, in seconds.
        extra: caller-specific additions (written as they are by :meth:`to_dict`).
    """

    results: list[TargetResult]
    env_id: str | None = None
    episodes: int = 0
    n_envs: int = 0
    seed: int = 0
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self, with_rewards: bool = False) -> dict[str, Any]:
        """JSON-ready dict of the settings and ``results`` (:meth:`TargetResult.to_dict`)."""
        d = {k: v for k, v in asdict(self).items() if k != "results"}
        d["results"] = [r.to_dict(with_rewards) for r in self.results]
        return d


#: prefix of every evaluation key in the training logs (TensorBoard, ``metrics.jsonl``)
EVAL_PREFIX = "eval/"


def target_suffix(k: int) -> str:
    """Key suffix of the ``k``-th target of a report: ``""`` for the first, ``_target{k}`` after."""
    return "" if k == 0 else f"_target{k}"


def report_logs(report: EvalReport) -> dict[str, float]:
    """The log scalars of an evaluation: the one mapping from a report to log keys.

    For the ``k``-th target (suffix :func:`target_suffix`): ``eval/<name><suffix>`` for every
    scalar of :meth:`TargetResult.summary` that is not None, and ``eval/target<suffix>`` (raw
    units) for a return-conditioned target. Example, one unconditioned target without
    reference returns: ``{"eval/return_mean": ..., "eval/return_std": ...}``.
    """
    out: dict[str, float] = {}
    for k, r in enumerate(report.results):
        sfx = target_suffix(k)
        for name, value in r.summary().items():
            if value is not None:
                out[f"{EVAL_PREFIX}{name}{sfx}"] = float(value)
        if r.target_return is not None:
            out[f"{EVAL_PREFIX}target{sfx}"] = float(r.target_return)
    return out


def targets_text(logs: Mapping[str, float], pm: str = "+-") -> str:
    """The per-target part of an evaluation's console line, '' when ``logs`` hold no
    ``eval/return_mean``: ``target 3600: return 1234.5 +- 20.1, normalised score 38.2; target
    1800: ...`` (one entry per suffix of :func:`target_suffix`, in order; ``pm`` joins mean and
    standard deviation)."""
    parts: list[str] = []
    k = 0
    while f"{EVAL_PREFIX}return_mean{target_suffix(k)}" in logs:
        sfx = target_suffix(k)
        text = f"return {logs[f'{EVAL_PREFIX}return_mean{sfx}']:.1f}"
        if f"{EVAL_PREFIX}return_std{sfx}" in logs:
            text += f" {pm} {logs[f'{EVAL_PREFIX}return_std{sfx}']:.1f}"
        if f"{EVAL_PREFIX}normalized_score{sfx}" in logs:
            text += f", normalised score {logs[f'{EVAL_PREFIX}normalized_score{sfx}']:.1f}"
        if f"{EVAL_PREFIX}target{sfx}" in logs:
            text = f"target {logs[f'{EVAL_PREFIX}target{sfx}']:g}: {text}"
        parts.append(text)
        k += 1
    return "; ".join(parts)


def logs_line(step: int, logs: Mapping[str, float]) -> str:
    """One console line for the evaluation logged at ``step`` (the keys of :func:`report_logs`):
    ``eval at step 1000: target 3600: return 1234.5 +- 20.1, normalised score 38.2; target 1800:
    ...``, then ``(4.2 s)`` when ``eval/time_s`` is there. An evaluation without
    ``eval/return_mean`` (an agent's own scalars) lists its ``eval/`` scalars (``name=value``)."""
    text = targets_text(logs) or ", ".join(f"{key.removeprefix(EVAL_PREFIX)}={value:.4g}" for key, value in logs.items()
                                         if key.startswith(EVAL_PREFIX) and key != f"{EVAL_PREFIX}time_s")
    line = f"eval at step {step}: {text or 'no scalars'}"
    seconds = logs.get(f"{EVAL_PREFIX}time_s")
    return line if seconds is None else f"{line} ({seconds:.1f} s)"


def eval_seed(seed: int, step: int) -> int:
    """Base reset seed of the evaluation at training step ``step`` of a run seeded ``seed``:
    ``derive_seed(seed, "eval", step) mod 2**31`` (31 bits, as gymnasium's ``reset`` takes).
    Episode ``j`` resets with ``eval_seed(seed, step) + j``, as ``rl-tformers eval --seed`` does."""
    return derive_seed(seed, "eval", step) % (2**31)


def evaluate(
    policy: Policy,
    make_env: EnvFactory,
    targets: Sequence[float | None] = (None,),
    *,
    episodes: int = 10,
    n_envs: int = 10,
    seed: int = 0,
    record_rewards: bool = False,
    normalize: Callable[[np.ndarray], np.ndarray | None] | None = None,
    env_id: str | None = None,
    progress: Any = None,
) -> EvalReport:
    """Run ``episodes`` episodes per target with N = min(n_envs, episodes) vector environments.

    Args:
        policy: any :class:`Policy`; ``initial_state(N, target)`` is called once per target.
        make_env: zero-argument factory of one (possibly wrapped) environment.
        targets: target returns in raw reward units (``None`` for unconditioned agents).
        episodes: exact number of episodes per target (episode j uses env j % N, seed seed + j).
        n_envs: number of parallel environments.
        seed: base reset seed, an integer in ``[0, 2**64 - 1]``; also the seed of torch's
            global generator while each target is evaluated (restored after), for policies that
            sample their actions.
        record_rewards: keep each episode's raw reward sequence (for RTG traces).
        normalize: maps raw returns (E,) to normalised scores, or returns ``None``.
        env_id: recorded in the report.
        progress: told of finished episodes, ``progress.update(k)`` (a
            :func:`~rl_tformers.runtime.progress.progress_bar` of ``len(targets) * episodes``).

    Returns:
        :class:`EvalReport` with one :class:`TargetResult` per target, in the given order.

    Raises:
        ValueError: ``episodes`` or ``n_envs`` < 1, ``seed`` not an integer in
            ``[0, 2**64 - 1]``, no target given, or a NaN/inf target.
        EnvironmentBuildError: (a ValueError) ``make_env`` cannot build the environment here;
            the message names ``env_id`` and the cause.
        NonFiniteError: (a ValueError) the policy returned a NaN/inf action (not sent to the
            environment) or the environment a NaN/inf reward; the message names the target,
            episode, seed and step.
        RuntimeError: the raw reward is missing from ``info`` (a wrapper dropped it).
    """
    seed = _checked_eval_args(episodes, n_envs, seed, targets)
    t0 = time.perf_counter()
    n = min(n_envs, episodes)
    envs = _vector_env(make_env, n, env_id)
    try:
        results = []
        for target in targets:
            # a sampling policy's draws (see the module docstring); no autograd bookkeeping in the loop
            with seeded_torch_rng(seed), torch.inference_mode():
                results.append(_run_target(policy, envs, target, episodes, seed, record_rewards, progress))
    finally:
        envs.close()
    if normalize is not None:
        for r in results:
            scores = normalize(np.asarray(r.returns, dtype=np.float64))
            r.normalized = None if scores is None else [float(s) for s in scores]
    return EvalReport(results, env_id=env_id, episodes=episodes, n_envs=n, seed=seed, seconds=time.perf_counter() - t0)


def _checked_eval_args(episodes: int, n_envs: int, seed: Any, targets: Sequence[float | None]) -> int:
    """The checks of :func:`evaluate`'s arguments; returns ``seed`` as an ``int``.

    Raises:
        ValueError: as :func:`evaluate`.
    """
    if episodes < 1 or n_envs < 1:
        raise ValueError(f"evaluate: episodes and n_envs must be >= 1, got {episodes}, {n_envs}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= int(seed) <= MAX_EVAL_SEED:
        raise ValueError(f"evaluate: seed {seed!r} is not an integer in [0, 2**64 - 1] (--seed: the base reset "
                         f"seed, also torch's generator seed)")
    seed = int(seed)
    if len(targets) == 0:
        raise ValueError("evaluate: give at least one target return (None for unconditioned agents)")
    bad = [t for t in targets if t is not None and not math.isfinite(float(t))]
    if bad:
        raise ValueError(f"evaluate: target returns must be finite numbers, got {bad} (agent.targets / --targets)")
    return seed


def _vector_env(make_env: EnvFactory, n: int, env_id: str | None) -> gym.vector.SyncVectorEnv:
    """``n`` environments of ``make_env`` (each :func:`with_raw_reward`) in one vector
    environment with autoreset disabled.

    Raises:
        EnvironmentBuildError: an environment cannot be built (those built already are closed).
    """
    built: list[gym.Env] = []

    def build() -> gym.Env:
        env = with_raw_reward(make_env())
        built.append(env)
        return env

    try:
        return gym.vector.SyncVectorEnv([build for _ in range(n)], autoreset_mode=gym.vector.AutoresetMode.DISABLED)
    except (gym.error.Error, ImportError, TypeError) as exc:
        for env in built:  # the ones made before the failure
            env.close()
        what = f"the evaluation environment {env_id!r}" if env_id else "the evaluation environment"
        raise EnvironmentBuildError(f"evaluate: cannot build {what} here ({type(exc).__name__}: {exc}); the run "
                                    f"was trained with it: install what it needs or register it, then "
                                    f"evaluate again") from exc


@contextlib.contextmanager
def seeded_torch_rng(seed: int):
    """Run the block with torch's global generators seeded with ``seed``; restore them after.

    The CPU generator and those of the CUDA devices already initialised are saved and restored
    (``torch.random.fork_rng``); other devices' generators are only seeded.
    """

    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(int(seed))
        yield


@dataclass
class EpisodeRecord:
    """What :func:`run_episodes` recorded, in episode order j = 0..E-1.

    Attributes:
        returns: (E,) float64 raw undiscounted returns (the running sum of the raw rewards).
        lengths: (E,) int64 episode lengths in steps.
        terminated: (E,) bool: the episode ended by termination (False: truncated by the
            environment or cut at ``max_steps``).
        rewards: E arrays (L_j,) float64 of raw rewards, when recorded.
        observations: E arrays (L_j, *obs_shape), the observation before each action, when
            trajectories are recorded.
        actions: E arrays (L_j, *act_shape) in environment units, when trajectories are recorded.
    """

    returns: np.ndarray
    lengths: np.ndarray
    terminated: np.ndarray
    rewards: list[np.ndarray] | None = None
    observations: list[np.ndarray] | None = None
    actions: list[np.ndarray] | None = None


def run_episodes(
    policy: Policy,
    envs: gym.vector.VectorEnv,
    target: float | None,
    episodes: int,
    seed: int,
    *,
    record_rewards: bool = False,
    record_trajectories: bool = False,
    max_steps: int | None = None,
    who: str = "evaluate",
    on_finished: Callable[[int], None] | None = None,
    step_finished: bool = False,
) -> EpisodeRecord:
    """Run exactly ``episodes`` episodes of ``policy`` on the N environments of ``envs``.

    The loop behind :func:`evaluate` and the Online DT's exploration rounds
    (:func:`~rl_tformers.agents.decision_transformer.online.collect_episodes`): one
    ``policy.act`` call (one batched forward pass) per step for all N environments; episode j
    runs in environment j mod N with reset seed ``seed + j``; an environment past its quota is
    not stepped any more (a :class:`gymnasium.vector.SyncVectorEnv`'s environments are stepped
    one by one, only those still running a counted episode), and the policy is told
    ``episode_start`` for its row at every step (its context restarts; its actions are
    discarded). Another vector environment (:class:`gymnasium.vector.AsyncVectorEnv`) steps all
    N environments at every step, those past their quota running unseeded filler episodes (see
    the module docstring). Either way the counted episodes, their returns and lengths are the
    same. Torch's generators are not touched here (:func:`evaluate` seeds them).

    Args:
        policy: any :class:`Policy`; ``initial_state(N, target)`` is called once.
        envs: a vector environment with autoreset disabled whose environments carry the raw
            reward in ``info`` (:func:`with_raw_reward`).
        target: return-to-go the episodes are conditioned on (raw units), or ``None``.
        episodes: how many episodes (E >= 1).
        seed: base reset seed (episode j: ``seed + j``).
        record_rewards: keep each episode's raw rewards.
        record_trajectories: keep each episode's rewards, observations and actions.
        max_steps: cut (truncate) an episode after this many steps; ``None``: the environment's
            own limits only.
        who: the prefix of error messages (``evaluate``, ``online rollout``).
        on_finished: called with the number of counted episodes that ended at a step (a
            progress report's ``update``).
        step_finished: step the environments past their quota too (filler episodes), as any
            vector environment other than a ``SyncVectorEnv`` does; the counted episodes are the
            same either way.

    Returns:
        :class:`EpisodeRecord`.

    Raises:
        NonFiniteError: (a ValueError) the policy returned a NaN/inf action (not sent to the
            environment) or the environment a NaN/inf reward; the message names the target,
            episode, seed and step.
        RuntimeError: the raw reward is missing from ``info`` (a wrapper dropped it).
    """
    return _EpisodeRun(envs.num_envs, episodes, record_rewards or record_trajectories, record_trajectories,
                       max_steps).run(policy, envs, target, seed, who, on_finished, step_finished)


class _EpisodeRun:
    """The loop of :func:`run_episodes` and its bookkeeping: which episode each of the N
    environments runs (``job``; episode j -> env j % N), the running episodes' returns and
    lengths, the step buffers of the recorded ones, and the finished episodes' records."""

    def __init__(self, n: int, episodes: int, record_rewards: bool, record_trajectories: bool,
                 max_steps: int | None) -> None:
        self.n, self.episodes, self.max_steps = n, episodes, max_steps
        self.record_rewards, self.record_trajectories = record_rewards, record_trajectories
        self.rows = np.arange(n)
        # quota: episode j -> env j % n; job[i] is the index j of the episode env i is running
        self.job = self.rows.copy()
        self.active = self.job < episodes
        self.remaining = episodes
        self.returns = np.zeros(episodes, dtype=np.float64)
        self.lengths = np.zeros(episodes, dtype=np.int64)
        self.ended = np.zeros(episodes, dtype=bool)
        # per episode j, filled as it finishes
        self.rewards: list[Any] | None = [None] * episodes if record_rewards else None
        self.observations: list[Any] | None = [None] * episodes if record_trajectories else None
        self.actions: list[Any] | None = [None] * episodes if record_trajectories else None
        self.ep_ret = np.zeros(n, dtype=np.float64)
        self.ep_len = np.zeros(n, dtype=np.int64)
        cap = 1024 if max_steps is None else min(1024, int(max_steps))
        # (N, cap) rewards of the running episodes
        self.rew_buf = np.zeros((n, cap), dtype=np.float64) if record_rewards else None
        self.obs_buf: np.ndarray | None = None  # (N, cap, *obs_shape) observations before each action
        self.act_buf: np.ndarray | None = None  # (N, cap, *act_shape), allocated at the first action

    def run(self, policy: Policy, envs: gym.vector.VectorEnv, target: float | None, seed: int, who: str,
            on_finished: Callable[[int], None] | None, step_finished: bool = False) -> EpisodeRecord:
        """Step the environments until each counted episode has finished; see :func:`run_episodes`."""
        n = self.n
        with span("env"):
            obs, _ = envs.reset(seed=[seed + int(j) for j in self.job])
        obs = np.array(obs)  # (N, *obs_shape)
        stepper = _Stepper(envs, obs, full=step_finished, who=who)
        if self.record_trajectories:
            self.obs_buf = np.zeros((n, self.rew_buf.shape[1], *obs.shape[1:]), obs.dtype)
        state = policy.initial_state(n, target)
        episode_start = np.ones(n, dtype=bool)
        last_reward: np.ndarray | None = None
        # a policy that keeps per-decision statistics (DTPolicy: exit layers, kNN hits) is told which
        # rows run counted episodes, so the rows past their quota, whose decisions are discarded, do not enter them
        count_rows = getattr(policy, "count_rows", None)
        try:
            while self.remaining > 0:
                # a row past its quota restarts its (discarded) context at every step: when its environment
                # still steps (filler episodes, which may outlast every counted one), it never reaches a policy
                # limit (a DT's max_ep_len) that no counted episode reaches
                if count_rows is not None:
                    count_rows(self.active.copy())
                actions, state = policy.act(obs, state, episode_start | ~self.active, last_reward)
                actions = np.asarray(actions)
                _check_finite(actions, "the policy returned a non-finite action",
                              "it was not sent to the environment", target, self.job, self.ep_len, seed, self.episodes, who)
                self._store_step(obs, actions)
                with span("env"):
                    stepped, terminated, truncated, raw = stepper.step(actions, self.active)
                obs = stepper.obs
                last_reward = self._add_rewards(raw, stepped, target, seed, who)
                done = terminated | truncated
                if self.max_steps is not None:
                    done |= stepped & (self.ep_len >= self.max_steps)
                episode_start = done
                if not done.any():
                    continue
                finished = self._finish(done, terminated)
                if on_finished is not None and finished:
                    on_finished(finished)
                if self.remaining > 0:
                    with span("env"):
                        stepper.reset(done, self.active, [seed + int(j) for j in self.job])
                    obs = stepper.obs
        finally:  # also when an error stops the loop: later calls count every row again
            if count_rows is not None:
                count_rows(None)
        return EpisodeRecord(self.returns, self.lengths, self.ended, self.rewards, self.observations, self.actions)

    def _store_step(self, obs: np.ndarray, actions: np.ndarray) -> None:
        """Record the observations (N, ...) before this step's actions (N, ...) (trajectories
        only), growing the buffers when an episode outgrows them."""
        if self.record_rewards and int(self.ep_len.max()) >= self.rew_buf.shape[1]:  # grow the buffers (doubling)
            self.rew_buf = _grow(self.rew_buf)
            if self.record_trajectories:
                self.obs_buf, self.act_buf = _grow(self.obs_buf), _grow(self.act_buf)
        if self.record_trajectories:
            if self.act_buf is None:
                self.act_buf = np.zeros((self.n, self.rew_buf.shape[1], *actions.shape[1:]), actions.dtype)
            self.obs_buf[self.rows, self.ep_len] = obs
            self.act_buf[self.rows, self.ep_len] = actions

    def _add_rewards(self, raw: np.ndarray, stepped: np.ndarray, target: float | None, seed: int,
                     who: str) -> np.ndarray:
        """Add the step's raw rewards (N,) float64 (0 where an environment was not stepped,
        ``stepped`` (N,) bool) to the running episodes; returns them.

        Raises:
            NonFiniteError: a reward is NaN/inf.
        """
        _check_finite(raw, "the environment returned a non-finite reward", "", target, self.job, self.ep_len, seed,
                      self.episodes, who)
        if self.record_rewards:
            self.rew_buf[self.rows, self.ep_len] = raw
        self.ep_ret += raw
        self.ep_len += stepped
        return raw

    def _finish(self, done: np.ndarray, terminated: np.ndarray) -> int:
        """Record the counted episodes that ended at this step (``done``, (N,) bool) and move
        every ended environment to its next episode; returns the number of counted episodes."""
        finished = np.flatnonzero(done & self.active)  # per finished episode, not per step
        for i in finished:
            j, length = int(self.job[i]), int(self.ep_len[i])
            self.returns[j], self.lengths[j], self.ended[j] = self.ep_ret[i], length, terminated[i]
            if self.record_rewards:
                self.rewards[j] = self.rew_buf[i, :length].copy()
            if self.record_trajectories:
                self.observations[j] = self.obs_buf[i, :length].copy()
                self.actions[j] = self.act_buf[i, :length].copy()
        self.remaining -= len(finished)
        self.job[done] += self.n
        self.active = self.job < self.episodes
        self.ep_ret[done] = 0.0
        self.ep_len[done] = 0
        return len(finished)


class _Stepper:
    """Steps and resets the environments of a vector environment with autoreset disabled.

    A :class:`gymnasium.vector.SyncVectorEnv` whose observations are one array (N, ...) is driven
    environment by environment, only the rows asked for: the same calls its own ``step`` and
    ``reset`` make for each environment, without stepping the others. Any other vector
    environment (or ``full``) is stepped as a whole, every row at every step.

    Args:
        envs: the vector environment (its sub-environments carry the raw reward in ``info``).
        obs: (N, ...) the observations after the first reset; :meth:`step` and :meth:`reset` leave
            the next ones in :attr:`obs` (a new array each time, the rows not stepped copied over).
        full: step every environment at every step.
        who: the prefix of error messages.
    """

    def __init__(self, envs: gym.vector.VectorEnv, obs: np.ndarray, *, full: bool, who: str) -> None:
        self.vec, self.obs, self.who = envs, obs, who
        subs = getattr(envs, "envs", None)
        self.subs = None if full or not isinstance(envs, gym.vector.SyncVectorEnv) or subs is None else list(subs)
        n = envs.num_envs
        self.all_rows = np.ones(n, dtype=bool)

    def step(self, actions: np.ndarray, active: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Step the environments with ``actions`` (N, ...): only the ``active`` (N,) bool rows in
        the per-environment mode, all of them otherwise.

        Returns:
            ``(stepped, terminated, truncated, raw_reward)``: (N,) bool, bool, bool, float64;
            rows not stepped are False / False / False / 0.0 and keep their observation.

        Raises:
            RuntimeError: the raw reward is missing from ``info`` (a wrapper dropped it).
        """
        n = actions.shape[0]
        self.obs = self.obs.copy()  # a new array per step: the caller's (and a policy's) earlier ones stay as they were
        if self.subs is None:
            obs, _, terminated, truncated, info = self.vec.step(actions)
            self.obs[...] = np.asarray(obs)
            if RAW_REWARD_KEY not in info:
                raise self._missing()
            raw = np.asarray(info[RAW_REWARD_KEY], dtype=np.float64)  # (N,)
            return self.all_rows, np.asarray(terminated, dtype=bool), np.asarray(truncated, dtype=bool), raw
        terminated, truncated = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
        raw = np.zeros(n, dtype=np.float64)
        for i in np.flatnonzero(active):
            self.obs[i], _, terminated[i], truncated[i], info = self.subs[i].step(actions[i])
            if RAW_REWARD_KEY not in info:
                raise self._missing()
            raw[i] = info[RAW_REWARD_KEY]
        return active.copy(), terminated, truncated, raw

    def reset(self, done: np.ndarray, active: np.ndarray, seeds: list[int]) -> None:
        """Reset the environments whose episode ended (``done``, (N,) bool): with ``seeds[i]``
        where row i runs a counted episode next (``active``), unseeded otherwise (a filler
        episode; the per-environment mode resets only the active ones)."""
        self.obs = self.obs.copy()
        if self.subs is None:
            mask = done.copy()
            new_obs, _ = self.vec.reset(seed=[seeds[i] if done[i] and active[i] else None for i in range(len(done))],
                                        options={"reset_mask": mask})
            self.obs[done] = np.asarray(new_obs)[done]
            return
        for i in np.flatnonzero(done & active):
            # the options SyncVectorEnv.reset passes on with a reset mask: the dict it popped the mask from
            self.obs[i], _ = self.subs[i].reset(seed=seeds[i], options={})

    def _missing(self) -> RuntimeError:
        return RuntimeError(
            f"{self.who}: info has no {RAW_REWARD_KEY!r}: a wrapper of the environment drops info keys "
            f"(wrap the innermost environment with with_raw_reward)"
        )


def _grow(buf: np.ndarray | None) -> np.ndarray | None:
    """Double the step axis (axis 1) of an (N, cap, ...) buffer, keeping its contents."""
    return None if buf is None else np.concatenate([buf, np.zeros_like(buf)], axis=1)


def _run_target(
    policy: Policy, envs: gym.vector.VectorEnv, target: float | None, episodes: int, seed: int, record: bool,
    progress: Any = None,
) -> TargetResult:
    """Episodes of one target on ``envs`` (N envs); see :func:`evaluate`."""
    rec = run_episodes(policy, envs, target, episodes, seed, record_rewards=record,
                       on_finished=None if progress is None else progress.update)
    return TargetResult(
        target_return=None if target is None else float(target),
        returns=rec.returns.tolist(),
        lengths=rec.lengths.tolist(),
        seeds=[int(seed + j) for j in range(episodes)],
        rewards=None if rec.rewards is None else [r.tolist() for r in rec.rewards],
    )


def _check_finite(values: np.ndarray, what: str, note: str, target: float | None, job: np.ndarray,
                  ep_len: np.ndarray, seed: int, episodes: int, who: str = "evaluate") -> None:
    """Raise :class:`NonFiniteError` if a float array (N, ...) of one step holds NaN/inf.

    Names the first bad row's target, episode (``job``), reset seed and step (``ep_len``: steps
    already taken in that episode, so the 0-based index of this step). A row past its quota
    (``job >= episodes``, an unseeded filler episode) is named as such; ``who`` prefixes the message.
    """
    if values.dtype.kind not in "fc" or np.isfinite(values).all():
        return
    bad = ~np.isfinite(values.reshape(values.shape[0], -1)).all(axis=1)
    i = int(np.flatnonzero(bad)[0])
    j = int(job[i])
    tgt = "" if target is None else f" for target return {float(target):g}"
    where = (f"episode {j} (env {i}, reset seed {seed + j})" if j < episodes
             else f"a filler episode of env {i} (past its quota, unseeded)")
    raise NonFiniteError(
        f"{who}: {what}{tgt} at step {int(ep_len[i])} of {where}: {np.asarray(values[i]).tolist()}"
        + (f"; {note}" if note else "")
    )


def repeated_target(targets: Sequence[float]) -> tuple[int, int] | None:
    """``(i, j)``, ``i < j``, for the first target equal to an earlier one (``100`` and ``1e2``,
    ``0`` and ``-0`` are equal), or ``None`` when every target is distinct. Each target is
    evaluated on the same episodes (reset seeds) and is one point of a plot, so ``eval``,
    ``plot`` and ``agent.targets`` refuse a repeated one, naming where it came from."""
    first: dict[float, int] = {}
    for j, t in enumerate(targets):
        i = first.setdefault(float(t), j)
        if i != j:
            return i, j
    return None


def parse_targets(text: str | None) -> list[float] | None:
    """``"3600,1800"`` -> ``[3600.0, 1800.0]``; ``None`` (option not given) -> ``None``.

    Raises:
        ValueError: an empty or blank text (``--targets ""``), or a value that is not a finite
            number (``nan``, ``inf``, an empty item as in ``100,``: the message quotes it).
    """
    if text is None:
        return None
    if not text.strip():
        raise ValueError(f"--targets: {text!r} is empty; give target returns like 3600,1800 "
                         f"(or leave the option out for the default targets)")
    out = []
    for part in text.split(","):
        part = part.strip()
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"--targets: {part!r} is not a number (expected e.g. 3600,1800)") from None
        if not math.isfinite(value):
            raise ValueError(f"--targets: {part!r} is not a finite number (a target return, e.g. 3600,1800)")
        out.append(value)
    return out
