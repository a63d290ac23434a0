"""GTrXL agent: offline training (BC, return-conditioned BC, IQL) and step-wise acting.

Pieces, in reading order:

- :class:`StepStream`: an :class:`~rl_tformers.envs.dataset.EpisodeDataset` laid out as one
  stream of steps in dataset order, in model units (normalised observations and actions,
  scaled rewards/returns-to-go, previous action/reward, episode-start flags, step index).
  :meth:`StepStream.sample` cuts B windows of ``burn_in + T`` consecutive steps from it,
  vectorised (one gather per field). Windows may cross episode boundaries; the flags make the
  backbone keep episodes apart, exactly as at acting time.
- :class:`GTrXLState` and :class:`GTrXLPolicy`: the recurrent inference API of
  :class:`~rl_tformers.agents.common.policy.Policy`. One call = one token per environment
  through the backbone with its memory (O(M) per step); rows whose episode starts are reset
  first, other rows are untouched.
- :class:`GTrXLAgent`: builds the model from a config and a dataset, runs the loss of the
  configured objective, keeps IQL's target network, and saves/loads everything a policy
  needs (normalisation statistics, scales, action bounds) in the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from rl_tformers.agents.gtrxl.loss import SegmentBatch
from rl_tformers.agents.gtrxl.model import GTrXLModel
from rl_tformers.envs.dataset import EpisodeDataset
from rl_tformers.envs.trajectory import dataset_returns_to_go
from torch import Tensor

from rl_tformers.types import BackboneState


# ---------------------------------------------------------------------------------------------
# dataset stream and segment sampling
# ---------------------------------------------------------------------------------------------
@dataclass
class StepStream:
    """Every step of a dataset, in dataset order, in model units (arrays of length N).

    Attributes:
        obs: (N, O) float32 normalised observations.
        actions: (N, A) float32 in [-1, 1] (continuous) or (N,) int64 (discrete).
        rewards: (N,) float32, raw reward times ``reward_mult``.
        rtg: (N,) float32, undiscounted return-to-go divided by ``rtg_scale``.
        prev_action: like ``actions``, a_{t-1} (zeros at an episode's first step).
        prev_reward: (N,) float32, ``rewards`` shifted by one step (0 at a first step).
        terminals: (N,) bool, the episode terminated after this step.
        episode_start: (N,) bool.
        timesteps: (N,) int64, step index within the episode.
    """

    obs: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    rtg: np.ndarray
    prev_action: np.ndarray
    prev_reward: np.ndarray
    terminals: np.ndarray
    episode_start: np.ndarray
    timesteps: np.ndarray

    @property
    def num_steps(self) -> int:
        return int(self.rewards.shape[0])

    @classmethod
    def from_dataset(
        cls,
        dataset: EpisodeDataset,
        *,
        obs_mean: np.ndarray,
        obs_std: np.ndarray,
        action_low: np.ndarray | None,
        action_high: np.ndarray | None,
        rtg_scale: float,
        reward_mult: float,
    ) -> StepStream:
        """Lay ``dataset`` out as a stream (reads lazy arrays once).

        Args:
            obs_mean, obs_std: (O,) normalisation statistics.
            action_low, action_high: (A,) Box bounds (``None`` for discrete actions).
            rtg_scale: divisor of the return-to-go input (DT convention, e.g. 1000).
            reward_mult: multiplier of rewards for the IQL targets and the r_{t-1} input.
        """
        flat = dataset.flat_indices()  # (N,) flat index of each step in dataset order
        obs = (np.asarray(dataset.observations[flat], np.float32).reshape(len(flat), -1) - obs_mean) / obs_std
        act = np.asarray(dataset.actions[flat])
        if dataset.discrete_actions:
            act = act.astype(np.int64).reshape(-1)
        else:
            act = act.astype(np.float32).reshape(len(flat), -1)
            act = np.clip(2.0 * (act - action_low) / (action_high - action_low) - 1.0, -1.0, 1.0).astype(np.float32)
        rew = dataset.rewards[flat]
        rtg = dataset_returns_to_go(dataset)[flat]  # the data layer's one definition of RTG
        start = np.zeros(len(flat), dtype=bool)
        start[dataset.cum_lengths[:-1]] = True
        ep = np.cumsum(start) - 1  # (N,) episode of each step
        timesteps = np.arange(len(flat)) - dataset.cum_lengths[:-1][ep]
        prev_act = np.roll(act, 1, axis=0)
        prev_act[start] = 0
        prev_rew = np.roll(rew, 1)
        prev_rew[start] = 0.0
        return cls(
            obs=obs.astype(np.float32),
            actions=act,
            rewards=(rew * reward_mult).astype(np.float32),
            rtg=(rtg / rtg_scale).astype(np.float32),
            prev_action=prev_act,
            prev_reward=(prev_rew * reward_mult).astype(np.float32),
            terminals=dataset.terminations[flat].copy(),
            episode_start=start,
            timesteps=timesteps.astype(np.int64),
        )

    def sample(self, rng: np.random.Generator, batch_size: int, seq_len: int, burn_in: int) -> SegmentBatch:
        """B windows of ``burn_in + seq_len`` consecutive steps.

        The first gradient step of each window is uniform over the stream; the burn-in steps
        precede it. Steps outside ``[0, N)`` are padding (mask False, zeros). The first real
        step of a window is flagged as an episode start when it is one.

        Returns:
            :class:`SegmentBatch` of CPU tensors, rows of length L = burn_in + seq_len.
        """
        n = self.num_steps
        first = rng.integers(0, n, size=batch_size)  # (B,) first gradient step
        idx = first[:, None] - burn_in + np.arange(burn_in + seq_len)  # (B, L)
        mask = (idx >= 0) & (idx < n)
        idx = np.clip(idx, 0, n - 1)

        def take(a: np.ndarray) -> Tensor:
            out = a[idx]  # (B, L, ...)
            out = np.where(mask.reshape(mask.shape + (1,) * (out.ndim - 2)), out, np.zeros((), out.dtype))
            return torch.from_numpy(np.ascontiguousarray(out))

        return SegmentBatch(
            obs=take(self.obs),
            actions=take(self.actions),
            rewards=take(self.rewards),
            rtg=take(self.rtg),
            prev_action=take(self.prev_action),
            prev_reward=take(self.prev_reward),
            terminals=take(self.terminals),
            episode_start=take(self.episode_start),
            timesteps=take(self.timesteps),
            mask=torch.from_numpy(mask),
            burn_in=burn_in,
        )


# ---------------------------------------------------------------------------------------------
# acting
# ---------------------------------------------------------------------------------------------
@dataclass
class GTrXLState:
    """Recurrent state of N environments (owned by the caller; never stored on the policy).

    Attributes:
        memory: the backbone's :class:`BackboneState` (per layer (N, M, D) plus bookkeeping).
        prev_action: (N, A) float in [-1, 1] or (N,) long: the last action taken.
        rtg: (N,) float64, remaining return in raw reward units (return-conditioned agents).
        t: (N,) long, step index of the next observation within its episode.
        target: target return in raw units (``None`` for unconditioned agents).
    """

    memory: BackboneState
    prev_action: Tensor
    rtg: Tensor
    t: Tensor
    target: float | None


class GTrXLPolicy:
    """Step-wise GTrXL inference for N environments (the :class:`Policy` protocol).

    Args:
        model: a trained :class:`GTrXLModel` (put in eval mode here).
        obs_mean, obs_std: (O,) observation normalisation.
        action_low, action_high: (A,) Box bounds, or ``None`` for discrete actions.
        rtg_scale: divisor of the return-to-go input.
        reward_mult: multiplier of the r_{t-1} input.
        deterministic: act with the mode (True) or sample from the actor.
        device: where the model runs.
    """

    def __init__(
        self,
        model: GTrXLModel,
        *,
        obs_mean: np.ndarray,
        obs_std: np.ndarray,
        action_low: np.ndarray | None = None,
        action_high: np.ndarray | None = None,
        rtg_scale: float = 1.0,
        reward_mult: float = 1.0,
        deterministic: bool = True,
        device: torch.device | str = "cpu",
    ) -> None:
        self.model = model.eval()
        self.device = torch.device(device)
        self.obs_mean = torch.as_tensor(np.asarray(obs_mean, np.float32), device=self.device)
        self.obs_std = torch.as_tensor(np.asarray(obs_std, np.float32), device=self.device)
        self.discrete = model.cfg.discrete
        self.low = None if action_low is None else torch.as_tensor(np.asarray(action_low, np.float32), device=self.device)
        self.high = None if action_high is None else torch.as_tensor(np.asarray(action_high, np.float32), device=self.device)
        self.rtg_scale, self.reward_mult = float(rtg_scale), float(reward_mult)
        self.deterministic = deterministic

    def initial_state(self, n_envs: int, target_return: float | None = None) -> GTrXLState:
        """Empty memory for ``n_envs`` environments; ``target_return`` in raw reward units.

        Raises:
            ValueError: a return-conditioned model without a target return.
        """
        if self.model.cfg.rtg_input and target_return is None:
            raise ValueError("gtrxl: this model is return-conditioned; pass a target return (eval --targets)")
        enc = self.model.encoder
        a_shape = (n_envs,) if self.discrete else (n_envs, self.model.cfg.act_dim)
        return GTrXLState(
            memory=enc.initial_state(n_envs, self.device),
            prev_action=torch.zeros(a_shape, dtype=torch.long if self.discrete else torch.float32, device=self.device),
            rtg=torch.full((n_envs,), float(target_return or 0.0), dtype=torch.float64, device=self.device),
            t=torch.zeros(n_envs, dtype=torch.long, device=self.device),
            target=target_return,
        )

    @torch.no_grad()
    def act(
        self,
        obs: np.ndarray,
        state: GTrXLState,
        episode_start: np.ndarray,
        last_reward: np.ndarray | None = None,
    ) -> tuple[np.ndarray, GTrXLState]:
        """One step for N environments: reset the rows that start an episode, then one token each.

        Args:
            obs: (N, O) raw observations.
            state: from :meth:`initial_state` or the previous call.
            episode_start: (N,) bool.
            last_reward: (N,) raw reward of the previous step (ignored where ``episode_start``).

        Returns:
            actions (N, A) float in the environment's bounds or (N,) int64, and the next state.
        """
        dev = self.device
        n = state.t.shape[0]
        start = torch.as_tensor(np.asarray(episode_start, dtype=bool).reshape(n), device=dev)
        r = torch.zeros(n, dtype=torch.float64, device=dev) if last_reward is None else (
            torch.as_tensor(np.asarray(last_reward, np.float64).reshape(n), device=dev))
        r = torch.where(start, torch.zeros_like(r), r)
        enc = self.model.encoder
        memory = enc.reset_state(state.memory, start)
        target = float(state.target or 0.0)
        rtg = torch.where(start, torch.full_like(state.rtg, target), state.rtg - r)  # R_t = R_{t-1} - r_{t-1}
        t = torch.where(start, torch.zeros_like(state.t), state.t)
        prev_a = torch.where(start.view(-1, *([1] * (state.prev_action.dim() - 1))),
                             torch.zeros_like(state.prev_action), state.prev_action)
        o = (torch.as_tensor(np.asarray(obs, np.float32), device=dev).reshape(n, -1) - self.obs_mean) / self.obs_std
        x = enc.inputs(
            o[:, None],  # (N, 1, O)
            (rtg / self.rtg_scale).float()[:, None],  # (N, 1)
            prev_a[:, None],
            (r * self.reward_mult).float()[:, None],
        )
        out = enc(x, t[:, None], state=memory)
        h = out.features[:, 0]  # (N, D)
        a = self.model.actor.mode(h) if self.deterministic else self.model.actor.dist(h).sample()
        if self.discrete:
            env_a = a.cpu().numpy().astype(np.int64)
        else:
            a = a.clamp(-1.0, 1.0)
            env_a = (self.low + 0.5 * (a + 1.0) * (self.high - self.low)).cpu().numpy()
        return env_a, GTrXLState(memory=out.state, prev_action=a, rtg=rtg, t=t + 1, target=state.target)
