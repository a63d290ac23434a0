"""Rollout collection of PPO-GTrXL: N vector environments stepped together with the live model.

:class:`EnvSpec` reads the spaces of the environment, :class:`RolloutCollector` keeps the N
running episodes (observation, backbone memory, a_{t-1}, r_{t-1}, step) and collects a rollout
of S steps into a :class:`RolloutBuffer`: one batched forward per step, the backbone state each
environment acted with stored per step, time-limit truncations bootstrapped with V(final
observation) under the finished episode's memory, and the advantages of
:func:`~rl_tformers.agents.gtrxl.ppo_update.compute_gae`. See :mod:`rl_tformers.agents.gtrxl.ppo`
for the whole algorithm.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
import rl_tformers.envs.memory_tasks  # noqa: F401  (registers the memory tasks with gymnasium)
import torch
import torch.distributed as dist
from rl_tformers.agents.decision_transformer.model import to_env_action
from rl_tformers.agents.gtrxl.model import GTrXLEncoder, GTrXLModel, record_attention
from rl_tformers.agents.gtrxl.ppo_update import PIXEL_KEY, STORE_KEYS, compute_gae, pad_memory, store_rows
from rl_tformers.envs.environments import make_task
from torch import Tensor

from rl_tformers.attention.base import attention_entropy
from rl_tformers.runtime.distributed import dist_info, is_active
from rl_tformers.runtime.run_config import ConfigError

log = logging.getLogger(__name__)

OBS_CLIP = 10.0  # normalised observations are clipped to [-10, 10] (as SB3's VecNormalize)
#: per-step tensors of every rollout, each stacked to (S, N, ...)
ROLLOUT_KEYS = ("x", "pos", "actions", "logp", "values", "rewards", "dones")
#: the backbone memory each step acted with (memory kinds xl and spalm): (S, N, L, M, D) slots,
#: (S, N, M) slot positions, validity and episode ids, (S, N) episode id of the row
MEMORY_KEYS = ("mem", "mem_pos", "mem_valid", "mem_seg", "episode")
#: the plain window each step acted with (agent.window W > 0, this step in slot W - 1): (S, N, W,
#: input_dim) inputs, (S, N, W) steps and validity (GTrXLEncoder.shift_window)
WINDOW_KEYS = ("window_x", "window_pos", "window_valid")


class RunningMeanStd:
    """Mean/variance of a stream of (K, O) batches (parallel Welford; Chan et al. 1979)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.mean = np.zeros(shape, np.float64)
        self.var = np.ones(shape, np.float64)
        self.count = 1e-4

    def update(self, x: np.ndarray) -> None:
        """Merge a batch ``x`` (..., *shape), flattened to (K, *shape), into the statistics."""
        x = np.asarray(x, np.float64).reshape(-1, *self.mean.shape)
        b_mean, b_var, b_n = x.mean(0), x.var(0), x.shape[0]
        delta = b_mean - self.mean
        tot = self.count + b_n
        self.mean = self.mean + delta * b_n / tot
        self.var = (self.var * self.count + b_var * b_n + delta**2 * self.count * b_n / tot) / tot
        self.count = tot

    @property
    def std(self) -> np.ndarray:
        """sqrt(var + 1e-8), the shape of the mean."""
        return np.sqrt(self.var + 1e-8)


class EpisodeLengthError(ConfigError):
    """An episode ran past ``backbone.max_position`` (learned positions) in an environment
    without a time limit: raised at the rollout step that would need the missing table row
    (:meth:`RolloutCollector.check_positions`). A :class:`~rl_tformers.runtime.run_config.ConfigError`,
    so ``rl-tformers train`` reports it as one ``error:`` line (exit status 2)."""


@dataclass(frozen=True)
class EnvSpec:
    """The spaces of one training environment, as PPO-GTrXL reads and writes them.

    Attributes:
        env_id, env_kwargs: ``make_task(env_id, **env_kwargs)`` (:mod:`~rl_tformers.envs.environments`:
            POPGym's ids resolved, non-Box observations one-hot, MultiDiscrete actions one Discrete).
        obs_dim: flat observation size O.
        obs_shape, obs_dtype: one observation's shape and dtype (uint8 ``(C, H, W)``: images).
        act_dim: number of discrete actions, or the flat size A of a Box action.
        discrete: Discrete actions (class index + ``action_start`` is the environment's action).
        action_start: the Discrete space's ``start`` (0 for Box actions).
        action_shape: one environment's action shape: () discrete, the Box's shape.
        low, high: (A,) float32 Box bounds (None for Discrete).
        time_limit: the registered ``max_episode_steps`` (None: no time limit).
    """

    env_id: str
    env_kwargs: dict[str, Any]
    obs_dim: int
    act_dim: int
    discrete: bool
    action_start: int
    action_shape: tuple[int, ...]
    low: np.ndarray | None
    high: np.ndarray | None
    time_limit: int | None
    obs_shape: tuple[int, ...] = ()
    obs_dtype: str = "float32"

    @classmethod
    def probe(cls, env_id: str, env_kwargs: dict[str, Any]) -> EnvSpec:
        """Make the environment once and read its spaces.

        Raises:
            ValueError: an observation space that cannot be encoded as a vector, or actions neither
                Discrete (MultiDiscrete) nor a bounded Box.
            MissingExtraError: a POPGym id without the ``popgym`` extra (a ValueError).
        """
        probe = make_task(env_id, **env_kwargs)
        obs_space, act_space = probe.observation_space, probe.action_space
        time_limit = None if probe.spec is None else probe.spec.max_episode_steps
        probe.close()
        if not isinstance(obs_space, gym.spaces.Box):
            raise ValueError(f"gtrxl_ppo: needs a Box observation space, {env_id} has {obs_space}")
        discrete = isinstance(act_space, gym.spaces.Discrete)
        if discrete:
            act_dim, shape, low, high = int(act_space.n), (), None, None
        elif (isinstance(act_space, gym.spaces.Box) and np.isfinite(act_space.low).all()
              and np.isfinite(act_space.high).all()):
            act_dim = int(np.prod(act_space.shape))
            shape = tuple(int(k) for k in act_space.shape)
            low = np.asarray(act_space.low, np.float32).reshape(-1)
            high = np.asarray(act_space.high, np.float32).reshape(-1)
        else:
            raise ValueError(f"gtrxl_ppo: needs Discrete or bounded Box actions, {env_id} has {act_space}")
        return cls(env_id=env_id, env_kwargs=env_kwargs, obs_dim=int(np.prod(obs_space.shape)), act_dim=act_dim,
                   discrete=discrete, action_start=int(act_space.start) if discrete else 0, action_shape=shape,
                   low=low, high=high, time_limit=time_limit, obs_shape=tuple(int(k) for k in obs_space.shape),
                   obs_dtype=np.dtype(obs_space.dtype).name)

    def make(self) -> gym.Env:
        """A new environment ``make_task(env_id, **env_kwargs)``."""
        return make_task(self.env_id, **self.env_kwargs)

    def to_env(self, a: Tensor) -> np.ndarray:
        """(N,) class indices or (N, A) normalised actions -> the environments' actions: (N,) int64
        or (N, *action_shape) float32 within the Box (a (2, 2) Box gets (N, 2, 2), not (N, 4))."""
        if self.discrete:
            return a.cpu().numpy().astype(np.int64) + self.action_start
        low, high = (torch.as_tensor(b, device=a.device) for b in (self.low, self.high))
        env_a = to_env_action(a.clamp(-1.0, 1.0), low, high).cpu().numpy().astype(np.float32)  # (N, A)
        return env_a.reshape(len(env_a), *self.action_shape)


def stored_inputs(model: GTrXLModel, obs: Tensor, x: Tensor) -> dict[str, Tensor]:
    """What a rollout keeps of a step's inputs ``x`` (N, input_dim) made from ``obs``: ``x`` itself,
    or, with an image encoder, the uint8 pixels ``obs`` (N, C, H, W) and the inputs besides the
    observation's features ``x[:, F:]`` (N, E): each update encodes the pixels again with the
    weights it trains (:func:`~rl_tformers.agents.gtrxl.ppo_update.minibatch_inputs`)."""
    if not model.encoder.pixels:
        return {"x": x}
    return {"x": x[:, model.cfg.obs_features:], PIXEL_KEY: obs}


def reset_memory(enc: GTrXLEncoder, memory: Any, start: Tensor) -> Any:
    """The running memory with the rows where ``start`` (N,) bool is True cleared (the plain
    window as it is: :func:`encode_step` clears those rows' older slots as it shifts)."""
    return enc.reset_state(memory, start) if enc.stateful else memory


def encode_step(enc: GTrXLEncoder, x: Tensor, t: Tensor, memory: Any, start: Tensor,
                **kwargs: Any) -> tuple[Tensor, Any, dict[str, Tensor]]:
    """One step of N rows through the encoder: inputs ``x`` (N, input_dim) at episode steps ``t``
    (N,) with the running ``memory`` (after :func:`reset_memory`; ``start`` (N,) bool marks the
    rows that begin an episode). ``kwargs`` go to the encoder (``need_weights``).

    Returns:
        features (N, D), the next running memory, and the rows a rollout keeps of what the step
        acted with: the backbone memory (:data:`MEMORY_KEYS`, plus the SPALM store; a compressive
        memory padded to its full width, :func:`~rl_tformers.agents.gtrxl.ppo_update.pad_memory`,
        before the step, so the step acts over exactly what the update recomputes it over), or in
        the plain-window mode the shifted window holding this step (:data:`WINDOW_KEYS`).
    """
    if not enc.stateful:
        win = enc.shift_window(memory, x[:, None], t, start)
        return enc.encode_window(win, **kwargs).features[:, -1], win, win
    # the compressive memory at its full width (others as they are), acted over as the update recomputes
    # it: attention kinds that group keys by slot (local, fixed) would see other blocks at another width
    full = pad_memory(enc, memory)
    out = enc(x[:, None], t[:, None], state=full, **kwargs)
    rows = {"mem": torch.stack([ls.memory for ls in full.layers], 1),  # (N, L, M, D)
            "mem_pos": full.pos, "mem_valid": full.valid, "mem_seg": full.seg, "episode": full.episode,
            **store_rows(full)}
    return out.features[:, 0], out.state, rows


class RolloutBuffer:
    """The per-step tensors of one rollout (:data:`ROLLOUT_KEYS`), each (N, ...) per step."""

    def __init__(self) -> None:
        self.steps: dict[str, list[Tensor]] = {k: [] for k in ROLLOUT_KEYS}

    def add(self, **step: Tensor) -> None:
        """Append one step: every key of :data:`ROLLOUT_KEYS`, those of :data:`MEMORY_KEYS` or of
        :data:`WINDOW_KEYS`, and the SPALM store's
        (:data:`~rl_tformers.agents.gtrxl.ppo_update.STORE_KEYS`) and the uint8 pixels
        (:data:`~rl_tformers.agents.gtrxl.ppo_update.PIXEL_KEY`) when given, (N, ...) each."""
        for k in ROLLOUT_KEYS:
            self.steps[k].append(step[k])
        for k in (*MEMORY_KEYS, *WINDOW_KEYS, *STORE_KEYS, PIXEL_KEY):
            if k in step:
                self.steps.setdefault(k, []).append(step[k])

    def stacked(self) -> dict[str, Tensor]:
        """Every key as one (S, N, ...) tensor."""
        return {k: torch.stack(v) for k, v in self.steps.items()}


def warn_window_past_time_limit(window: int, time_limit: int | None, env_id: str) -> None:
    """Warn on rank 0 when a plain window (``agent.window``, in steps; 0 = memory mode) is longer
    than ``time_limit`` (the environment's ``max_episode_steps``; None: no limit): its extra slots
    are always masked padding. Raises nothing."""
    if time_limit is not None and window > time_limit and dist_info().is_main:
        log.warning("gtrxl_ppo: agent.window=%d but %s episodes run at most %d steps, so the window never "
                    "holds more than %d valid steps and the other %d slots are masked padding; "
                    "agent.window=%d acts the same (up to rounding) re-encoding %d tokens per step instead of %d",
                    window, env_id, time_limit, time_limit, window - time_limit, time_limit, time_limit, window)


class RolloutCollector:
    """The N environments of one process, their running episodes, and rollout collection.

    Args:
        model: the live :class:`~rl_tformers.agents.gtrxl.model.GTrXLModel` (``critic="value"``).
        spec: the environment's spaces.
        device: where the model runs.
        n_envs, n_steps: N environments, S steps per rollout.
        seed: the run's seed (rank r resets its environments with the seeds after rank r - 1's).
        gamma, gae_lambda: discount and GAE lambda.
        reward_scale: multiplier of the learning rewards.
        normalize_obs: normalise (and clip to +-:data:`OBS_CLIP`) the inputs with ``obs_rms``.
        obs_rms: the observation statistics (shared with the agent's policy).
        rank, world_size: this process under DDP (1 process: 0, 1).
        position_limit: rows of the learned position table (None: no table).

    State: ``envs`` (None until the first rollout), the running episodes (``obs``, ``memory``,
    ``prev_a``, ``prev_r``, ``t``, ``start``, ``ep_ret``, ``ep_len``), the recent episode returns
    and lengths, and the counters ``env_steps`` (of this process) and ``rollouts``.
    ``input_reward_mult`` multiplies the r_{t-1} input; ``update_obs_stats`` says whether each
    rollout's observations update ``obs_rms``.
    """

    def __init__(self, model: GTrXLModel, spec: EnvSpec, device: torch.device, *, n_envs: int, n_steps: int,
                 seed: int, gamma: float, gae_lambda: float, reward_scale: float, normalize_obs: bool,
                 obs_rms: RunningMeanStd, rank: int, world_size: int, position_limit: int | None) -> None:
        self.model, self.spec, self.device = model, spec, device
        self.n_envs, self.n_steps, self.seed = n_envs, n_steps, seed
        self.gamma, self.gae_lambda, self.reward_scale = gamma, gae_lambda, reward_scale
        self.normalize_obs, self.obs_rms = normalize_obs, obs_rms
        self.update_obs_stats = True
        self.input_reward_mult = reward_scale
        self.rank, self.world_size, self.position_limit = rank, world_size, position_limit
        self.envs: gym.vector.SyncVectorEnv | None = None
        self.returns_window: deque[float] = deque(maxlen=20)
        self.lengths_window: deque[float] = deque(maxlen=20)
        self.env_steps = 0  # of this process (each process collects the same number)
        self.rollouts = 0

    # -- environments and running episodes ----------------------------------------------------------
    def vector_env(self, envs: list[gym.Env] | None = None) -> gym.vector.SyncVectorEnv:
        """The N environments stepped together: new ones, or ``envs`` (restored by a resume)."""
        fns = ([self.spec.make for _ in range(self.n_envs)] if envs is None else [lambda e=e: e for e in envs])
        return gym.vector.SyncVectorEnv(fns, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)

    def start_envs(self) -> None:
        """New environments, reset with this rank's seeds, and empty running episodes."""
        self.envs = self.vector_env()
        # under DDP each process runs its own N environments: rank r resets them with seeds after rank r - 1's
        first = self.seed * 10_000 + self.rank * self.n_envs
        obs, _ = self.envs.reset(seed=[first + i for i in range(self.n_envs)])
        for name, value in self.blank_running(obs, self.device).items():
            setattr(self, name, value)

    def blank_running(self, obs: np.ndarray, device: torch.device | str) -> dict[str, Any]:
        """The running episodes of N environments just reset to ``obs`` (N, ...): ``obs``,
        ``memory`` (the encoder's initial state, or its empty plain window: :func:`encode_step`), ``prev_a`` ((N,) long, or (N, act_dim) float32),
        ``prev_r``, ``t``, ``start`` ((N,) float32, long, bool), ``ep_ret``, ``ep_len`` ((N,)
        float64 and int64 NumPy arrays)."""
        n, discrete = self.n_envs, self.spec.discrete
        a_shape = (n,) if discrete else (n, self.model.cfg.act_dim)
        enc = self.model.encoder
        memory = enc.initial_state(n, device) if enc.stateful else enc.initial_window(n, device)
        return {"obs": obs, "memory": memory,
                "prev_a": torch.zeros(a_shape, dtype=torch.long if discrete else torch.float32, device=device),
                "prev_r": torch.zeros(n, device=device), "t": torch.zeros(n, dtype=torch.long, device=device),
                "start": torch.ones(n, dtype=torch.bool, device=device),
                "ep_ret": np.zeros(n), "ep_len": np.zeros(n, dtype=np.int64)}

    def check_time_limit(self, init_checkpoint: str | None = None) -> None:
        """Refuse a learned position table without a row for every step up to and including the
        environment's time limit; warn on rank 0 when there is no time limit, and when a plain
        window (``agent.window``) is longer than the time limit.

        Args:
            init_checkpoint: ``agent.init_checkpoint`` (named in the error: its table is the one used).

        Raises:
            ValueError: ``backbone.max_position`` <= the time limit (the final observation of a
                truncated episode is valued at step ``time limit``).
        """
        limit, time_limit, env_id = self.position_limit, self.spec.time_limit, self.spec.env_id
        # positions are episode steps 0..time_limit - 1, and a time-limit truncation bootstraps
        # V(final observation) at step time_limit: the table needs time_limit + 1 rows
        if limit is not None and time_limit is not None and time_limit >= limit:
            src = f" (the table of agent.init_checkpoint={init_checkpoint})" if init_checkpoint else ""
            raise ValueError(
                f"backbone.max_position={limit}{src} but {env_id} episodes run up to {time_limit} steps and "
                f"a truncated episode's final observation is valued at step {time_limit} (the bootstrap of "
                f"time-limit cuts): the positions are episode steps, and backbone.position.kind=learned has no "
                f"table row past step {limit - 1}; set backbone.max_position >= {time_limit + 1} or use a "
                f"relative position kind (xl_relative)")
        if limit is not None and time_limit is None and dist_info().is_main:
            log.warning("gtrxl_ppo: %s has no time limit and backbone.position.kind=learned has table rows for "
                        "episode steps 0..%d only (backbone.max_position=%d): an episode that runs longer stops "
                        "the run with an error; agent.env_kwargs.max_episode_steps=%d (or less) cuts the episodes "
                        "there (time-limit truncations, bootstrapped)", env_id, limit - 1, limit, limit - 1)
        warn_window_past_time_limit(self.model.encoder.cfg.window, time_limit, env_id)

    # -- model inputs -----------------------------------------------------------------------------
    def norm_obs(self, obs: np.ndarray) -> Tensor:
        """(N, *obs_shape) raw -> (N, O) float32 inputs: normalised and clipped to +-OBS_CLIP
        (:attr:`normalize_obs`), else the raw values; pixels stay uint8 (N, C, H, W)."""
        if self.model.encoder.pixels:
            return torch.as_tensor(np.asarray(obs, np.uint8), device=self.device)  # (N, C, H, W)
        o = np.asarray(obs, np.float64).reshape(len(obs), -1)
        if self.normalize_obs:
            o = np.clip((o - self.obs_rms.mean) / self.obs_rms.std, -OBS_CLIP, OBS_CLIP)
        return torch.as_tensor(o, dtype=torch.float32, device=self.device)

    def start_prev_a(self, prev_a: Tensor, keep: Tensor) -> Tensor:
        """a_{t-1} input with an episode start's ``keep`` False: zeros (continuous), action 0's index
        (discrete, as PPO from scratch always fed it) or -1, the zero vector, for an encoder built
        with ``prev_action_zero_at_start`` (fine-tuned from an offline run that learned that)."""
        if self.spec.discrete and self.model.cfg.prev_action_zero_at_start:
            return torch.where(keep, prev_a, torch.full_like(prev_a, -1))
        return prev_a * keep.to(prev_a.dtype)

    def step_inputs(self, obs: Tensor, prev_a: Tensor, prev_r: Tensor) -> Tensor:
        """(N, input_dim) encoder inputs of one step from :meth:`norm_obs`'s ``obs`` (N, O) or (N, C, H, W)."""
        return self.model.encoder.inputs(obs[:, None], None, prev_a[:, None], prev_r[:, None])[:, 0]


    def check_positions(self, pos: Tensor, rows: Tensor | None = None, final: bool = False) -> None:
        """Refuse episode steps past the learned position table, before the forward that would need them.

        Args:
            pos: (N,) the episode step (position) of each environment's next token.
            rows: (N,) bool, the rows that will be run (None: all).
            final: the positions are those of truncated episodes' final observations (the bootstrap).

        Raises:
            EpisodeLengthError: a row's step is ``>= backbone.max_position`` (only possible in an
                environment without a time limit: one with a limit was checked when the agent was
                built). The message names the option, the environment, the step reached and the fix.
        """
        limit = self.position_limit
        if limit is None:
            return
        over = pos >= limit
        if rows is not None:
            over = over & rows
        if not bool(over.any()):  # (one host sync per step; the environments step on the host anyway)
            return
        i = int(over.nonzero()[0, 0])
        raise self._episode_length_error(i, int(pos[i]), final)

    def _episode_length_error(self, i: int, step: int, final: bool) -> EpisodeLengthError:
        """The error of environment ``i`` reaching episode step ``step`` (logged here on ranks > 0)."""
        limit, env_id, time_limit = self.position_limit, self.spec.env_id, self.spec.time_limit
        env = f"environment {i} of {self.n_envs}" + (f" on rank {self.rank}" if self.world_size > 1 else "")
        what = (f"an episode of {env_id} ({env}) was truncated by the environment after {step} steps and its "
                f"final observation would be valued at episode step {step} (the bootstrap of truncations)" if final
                else f"an episode of {env_id} ({env}) reached episode step {step}")
        limits = ("has no time limit" if time_limit is None
                  else f"has a time limit of {time_limit} steps")  # (not reached: checked at build)
        msg = (f"gtrxl_ppo: {what} in rollout {self.rollouts + 1}, but backbone.position.kind=learned has table "
               f"rows for episode steps 0..{limit - 1} only (backbone.max_position={limit}) and {env_id} "
               f"{limits}. The run stopped before training on this rollout; the checkpoints it wrote are intact "
               f"(--resume continues exactly from the last one, and would meet this episode again). Fix it in a "
               f"new run: agent.env_kwargs.max_episode_steps={limit - 1} (or less: a time limit whose cuts are "
               f"bootstrapped), backbone.max_position > the longest episode, or a relative position kind "
               f"(backbone.position.kind=xl_relative)")
        if self.rank != 0:  # the command line prints rank 0's errors only
            log.error("%s", msg)
        return EpisodeLengthError(msg)

    # -- collection -------------------------------------------------------------------------------
    @torch.no_grad()
    def collect(self) -> dict[str, Any]:
        """One rollout of S steps in N environments with the current weights.

        Returns:
            dict of (S, N, ...) tensors (``x``, ``pos``, ``mem`` (S, N, L, M, D), ``mem_pos``,
            ``mem_valid``, ``mem_seg``, ``episode``, ``actions``, ``logp``, ``values``,
            ``rewards``, ``dones``) plus ``adv``/``returns`` from :func:`compute_gae` and
            ``stats`` (floats for logging).
        """
        if self.envs is None:
            self.start_envs()
        buf, raw_obs = RolloutBuffer(), []
        for _ in range(self.n_steps):  # one batched forward per step for all N environments
            raw_obs += [self.obs] if self.update_obs_stats else []  # no copy of pixel rollouts
            buf.add(**self._step())
        last_value, weights = self._last_value()
        ro: dict[str, Any] = buf.stacked()
        ro["adv"], ro["returns"] = compute_gae(
            ro["rewards"], ro["values"], ro["dones"], last_value, self.gamma, self.gae_lambda)
        self.env_steps += self.n_steps * self.n_envs
        self.rollouts += 1
        ro["stats"] = self._stats(weights)
        if self.update_obs_stats:
            self.obs_rms.update(self.rollout_observations(np.stack(raw_obs)))
        return ro

    def _step(self) -> dict[str, Tensor]:
        """Act in the N environments once; advance the running episodes. Returns the step's tensors."""
        model, dev, n = self.model, self.device, self.n_envs
        start = self.start
        memory = reset_memory(model.encoder, self.memory, start)
        keep = (~start).view(-1, *([1] * (self.prev_a.dim() - 1)))
        prev_a = self.start_prev_a(self.prev_a, keep)
        prev_r = self.prev_r * (~start)
        t = self.t * (~start)
        self.check_positions(t)
        obs_in = self.norm_obs(self.obs)  # (N, O) float32, or (N, C, H, W) uint8 pixels
        x = self.step_inputs(obs_in, prev_a, prev_r)  # (N, input_dim)
        h, after, rows = encode_step(model.encoder, x, t, memory, start)
        dist_ = model.actor.dist(h)
        action = dist_.sample()
        logp = dist_.log_prob(action) if self.spec.discrete else dist_.log_prob(action).sum(-1)
        value = model.state_value(h)
        # the a_{t-1} input is the action the environment took: the sample clamped to [-1, 1]
        # (as GTrXLPolicy.act feeds it); log-probabilities stay those of the unclamped sample
        taken = action if self.spec.discrete else action.clamp(-1.0, 1.0)
        obs, reward, term, trunc, info = self.envs.step(self.spec.to_env(action))
        r = torch.as_tensor(reward, dtype=torch.float32, device=dev) * self.reward_scale
        r_in = torch.as_tensor(reward, dtype=torch.float32, device=dev) * self.input_reward_mult  # r_t input
        trunc_t = torch.as_tensor(cut := np.asarray(trunc & ~term), device=dev)
        if cut.any():  # bootstrap time-limit cuts with V(final obs) and the episode's memory (host flags: no sync)
            final = obs.copy()
            idx = np.flatnonzero(info["_final_obs"])
            final[idx] = np.stack(info["final_obs"][idx])
            self.check_positions(t + 1, trunc_t, final=True)
            a_in = taken.view(n, *self.prev_a.shape[1:]).to(self.prev_a.dtype)
            xf = self.step_inputs(self.norm_obs(final), a_in, r_in)
            hf = encode_step(model.encoder, xf, t + 1, after, torch.zeros_like(start))[0]
            r = r + self.gamma * model.state_value(hf) * trunc_t
        done = torch.as_tensor(term | trunc, device=dev)
        self._count_episodes(reward, np.asarray(term | trunc))
        self.memory, self.prev_a, self.prev_r, self.t, self.start = after, taken, r_in, t + 1, done
        self.obs = obs
        return {**stored_inputs(model, obs_in, x), "pos": t, **rows,
                "actions": action, "logp": logp, "values": value, "rewards": r, "dones": done}

    def _count_episodes(self, reward: np.ndarray, done: np.ndarray) -> None:
        """Episode returns and lengths (numpy, vectorised over environments); finished ones go to the windows."""
        self.ep_ret += reward
        self.ep_len += 1
        self.returns_window.extend(self.ep_ret[done].tolist())
        self.lengths_window.extend(self.ep_len[done].astype(float).tolist())
        self.ep_ret[done] = 0.0
        self.ep_len[done] = 0

    def _last_value(self) -> tuple[Tensor, list[Tensor]]:
        """(N,) bootstrap value of the observation after the rollout, and each layer's attention weights there."""
        self.check_positions(self.t * (~self.start))
        memory = reset_memory(self.model.encoder, self.memory, self.start)
        keep = (~self.start).view(-1, *([1] * (self.prev_a.dim() - 1)))
        x = self.step_inputs(self.norm_obs(self.obs), self.start_prev_a(self.prev_a, keep), self.prev_r * (~self.start))
        with record_attention(self.model.encoder) as weights:
            h = encode_step(self.model.encoder, x, self.t * (~self.start), memory, self.start, need_weights=True)[0]
        return self.model.state_value(h), weights

    def _stats(self, weights: list[Tensor]) -> dict[str, float]:
        """The rollout's logged statistics: environment steps (of every process), recent episodes,
        attention entropy per layer at the last step."""
        stats = {"env_steps": float(self.env_steps * self.world_size)}  # of every process
        if self.returns_window:
            stats["episodic_return"] = float(np.mean(self.returns_window))
            stats["episodic_length"] = float(np.mean(self.lengths_window))
        for i, w in enumerate(weights):
            stats[f"attention_entropy/layer{i}"] = float(attention_entropy(w))
        return stats

    def counters_state(self) -> dict[str, Any]:
        """Step counters (environment steps, rollouts), recent episode returns/lengths and the
        reward input multiplier, checkpoint-safe (plain numbers and lists)."""
        return {
            "env_steps": int(self.env_steps), "rollouts": int(self.rollouts),
            "recent_returns": [float(x) for x in self.returns_window],
            "recent_lengths": [float(x) for x in self.lengths_window],
            "input_reward_mult": float(self.input_reward_mult),
        }

    def load_counters_state(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`counters_state` saved (a missing reward multiplier: ``reward_scale``;
        missing windows: empty)."""
        self.env_steps, self.rollouts = int(state["env_steps"]), int(state["rollouts"])
        self.input_reward_mult = float(state.get("input_reward_mult", self.reward_scale))
        self.returns_window.clear()
        self.returns_window.extend(float(x) for x in state.get("recent_returns", ()))
        self.lengths_window.clear()
        self.lengths_window.extend(float(x) for x in state.get("recent_lengths", ()))

    def rollout_observations(self, raw: np.ndarray) -> np.ndarray:
        """The observations the running statistics learn from: (S, N, *obs_shape) -> (S x N, O).

        Under DDP every rank's rollout, gathered in the order one process with ``W x n_envs``
        environments (rank r's after rank r - 1's) would see them: (S, W, N, O) flattened. So every
        rank keeps the same statistics, those of one process.
        """
        s, n = raw.shape[:2]
        flat = np.asarray(raw, np.float64).reshape(s, n, -1)  # (S, N, O)
        if not is_active():
            return flat.reshape(s * n, -1)
        mine = torch.as_tensor(flat, device=self.device)
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, mine)
        return torch.stack(parts, 1).reshape(-1, flat.shape[-1]).cpu().numpy()  # (S, W, N, O) -> (S W N, O)
