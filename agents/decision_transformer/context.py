"""The Decision Transformer's acting context: the window of the last K steps of N episodes.

The context of each environment lives in preallocated (N, K, ...) buffers held in a
:class:`DTState` (owned by the caller, never by the policy), laid out like the training windows
(``align``; :class:`ContextWindow` writes it):

- ``align="start"`` (the paper's sampler; causal mode only): step t of an episode is written at
  slot ``min(t, K-1)``; once the window is full, the row is shifted left by one slot before
  writing, so the window always holds the last K steps starting at slot 0, exactly like a
  training window that starts at ``max(0, t - K + 1)``; the prediction is read at slot
  ``min(t, K-1)``.
- ``align="end"`` (``last_action`` mode, or causal mode trained on end-aligned windows): every
  step shifts the row left by one and writes at slot K-1; slots before the episode's first step
  stay padding; the prediction is read at slot K-1.

Return-to-go (Chen et al. 2021, algorithm 1): the first step of an episode is conditioned on the
target return, and after each reward ``R_{t+1} = R_t - r_t``, in raw units (float64); the model
sees ``R_t / rtg_scale``, the same scale as the training windows, whose RTG is the suffix sum
``sum_{t' >= t} r_{t'}`` (:func:`rl_tformers.envs.trajectory.returns_to_go`). The update is the
data layer's :func:`~rl_tformers.envs.trajectory.next_return_to_go`, that recursion solved for
``R_{t+1}``, so replaying a dataset trajectory with target = its return feeds exactly its
training-time RTG (tested).

Timesteps past ``max_ep_len`` (the size of the timestep embedding): ``timestep_overflow="error"``
(default) raises a ValueError naming the option; ``"clamp"`` reuses the last timestep index
``max_ep_len - 1`` for all later steps (documented, tested).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from rl_tformers.agents.decision_transformer.model import DTConfig
from rl_tformers.envs.trajectory import next_return_to_go
from torch import Tensor

OVERFLOW_POLICIES = ("error", "clamp")


@dataclass
class DTState:
    """Context buffers of N environments (updated in place by :meth:`ContextWindow.advance` and
    :meth:`ContextWindow.write`, through ``DTPolicy.act``).

    Attributes:
        obs: (N, K, obs_dim) normalised observations.
        actions: (N, K, A) normalised actions in [-1, 1] (continuous) or (N, K) long (discrete).
        rtg: (N, K) returns-to-go fed to the model (raw / rtg_scale).
        timesteps: (N, K) long episode steps.
        mask: (N, K) bool, True = real step.
        t: (N,) int64 step of the current observation in its episode (-1 before the first).
        rtg_raw: (N,) float64 remaining return in raw reward units.
        target: (N,) float64 target return of each row (raw units).
    """

    obs: Tensor
    actions: Tensor
    rtg: Tensor
    timesteps: Tensor
    mask: Tensor
    t: np.ndarray
    rtg_raw: np.ndarray
    target: np.ndarray


def acting_context_mask(mask: Tensor, slot: Tensor, context_steps: int | None) -> Tensor:
    """The context a DT reads when it decides at ``slot``: ``mask`` (N, K) bool, True = real
    step, cut to the last ``context_steps`` slots up to and including ``slot`` (N,) long
    (Online DT's evaluation context length, Zheng et al. 2022); ``None``: ``mask`` unchanged.
    Used alike by acting (``DTPolicy.act``), early-exit calibration and the kNN-LM datastore, so
    that all three see the same context."""
    if context_steps is None:
        return mask
    keep = torch.arange(mask.shape[1], device=mask.device)[None, :] > slot[:, None] - context_steps  # (N, K)
    return mask & keep


class ContextWindow:
    """Writes the steps of N episodes into their :class:`DTState` (module docstring).

    Args:
        cfg: the model's configuration (K, max_ep_len, obs_dim, act_dim, discrete).
        align: ``start`` or ``end`` (checked by the policy).
        obs_mean, obs_std: (obs_dim,) float32 observation statistics on ``device``.
        rtg_scale: divisor of returns-to-go (> 0).
        timestep_overflow: ``error`` or ``clamp``.
        device: where the buffers live.
    """

    def __init__(self, cfg: DTConfig, align: str, obs_mean: Tensor, obs_std: Tensor, rtg_scale: float,
                 timestep_overflow: str, device: torch.device) -> None:
        self.cfg, self.align, self.device = cfg, align, device
        self.obs_mean, self.obs_std = obs_mean, obs_std
        self.rtg_scale = rtg_scale
        self.timestep_overflow = timestep_overflow

    def empty(self, n: int, target: float) -> DTState:
        """Empty buffers of ``n`` episodes conditioned on ``target`` (raw units), no step yet."""
        cfg, dev, k = self.cfg, self.device, self.cfg.context_len
        act_shape = (n, k) if cfg.discrete else (n, k, cfg.act_dim)
        return DTState(
            obs=torch.zeros(n, k, cfg.obs_dim, device=dev),
            actions=torch.zeros(act_shape, device=dev, dtype=torch.long if cfg.discrete else torch.float32),
            rtg=torch.zeros(n, k, device=dev),
            timesteps=torch.zeros(n, k, dtype=torch.long, device=dev),
            mask=torch.zeros(n, k, dtype=torch.bool, device=dev),
            t=np.full(n, -1, dtype=np.int64),
            rtg_raw=np.full(n, float(target), dtype=np.float64),
            target=np.full(n, float(target), dtype=np.float64),
        )

    def advance(self, state: DTState, start: np.ndarray, last_reward: np.ndarray | None) -> np.ndarray:
        """Start rows at their target (step 0), move the others one step on (R_{t+1} = R_t - r_t).

        Args:
            state: the buffers (``t``, ``rtg_raw`` updated in place).
            start: (N,) bool, the rows that start an episode.
            last_reward: (N,) raw rewards of the previous step (ignored where a row starts).

        Returns:
            (N,) int64 episode steps now.

        Raises:
            ValueError: a row continues an episode that never started, or a step at or past
                ``max_ep_len`` with ``timestep_overflow="error"``.
        """
        cfg = self.cfg
        cont = ~start
        if (cont & (state.t < 0)).any():
            raise ValueError("DTPolicy.act: a row continues an episode that never started (episode_start must be True first)")
        if last_reward is not None:  # R_{t+1} = R_t - r_t (the data layer's recursion)
            r = np.asarray(last_reward, dtype=np.float64)
            state.rtg_raw = np.where(cont, next_return_to_go(state.rtg_raw, r), state.rtg_raw)
        state.rtg_raw[start] = state.target[start]
        state.t = np.where(start, 0, state.t + 1)
        t = state.t
        if int(t.max()) >= cfg.max_ep_len and self.timestep_overflow == "error":
            raise ValueError(
                f"Decision Transformer: episode step {int(t.max())} >= agent.max_ep_len={cfg.max_ep_len} "
                f"(the timestep embedding has no entry for it); evaluate on episodes of at most "
                f"{cfg.max_ep_len} steps, train with a larger agent.max_ep_len, or set "
                f"timestep_overflow='clamp' to reuse the last timestep index (agent.timestep_overflow=clamp "
                f"in the run config, `rl-tformers eval --timestep-overflow clamp`)"
            )
        return t

    def write(self, state: DTState, obs: np.ndarray, start: np.ndarray, t: np.ndarray) -> tuple[Tensor, Tensor]:
        """Shift full windows, clear starting rows and write step t (observation, return-to-go,
        timestep; action 0 until decided) at its slot.

        Args:
            state: the buffers (replaced by their shifted copies, then written in place).
            obs: (N, obs_dim) raw observations.
            start: (N,) bool, the rows that start an episode.
            t: (N,) int64 episode steps (:meth:`advance`).

        Returns:
            (rows (N,), slot (N,)) long tensors: where step t of each row sits.
        """
        cfg, k, dev = self.cfg, self.cfg.context_len, self.device
        n = start.shape[0]
        # shift rows whose window is full (align start) or that continue (align end) one slot left
        shift_np = (t >= k) if self.align == "start" else ~start
        shift = torch.as_tensor(shift_np, device=dev)
        st = torch.as_tensor(start, device=dev)
        for name in ("obs", "actions", "rtg", "timesteps", "mask"):
            buf = getattr(state, name)
            sh = shift.view((n,) + (1,) * (buf.dim() - 1))
            new = torch.where(sh, buf.roll(-1, dims=1), buf)
            new = torch.where(st.view_as(sh), torch.zeros_like(new), new)  # clear starting rows
            setattr(state, name, new)
        slot_np = np.minimum(t, k - 1) if self.align == "start" else np.full(n, k - 1)
        rows = torch.arange(n, device=dev)
        slot = torch.as_tensor(slot_np, device=dev)
        obs_t = torch.as_tensor(np.asarray(obs, dtype=np.float32), device=dev).reshape(n, cfg.obs_dim)
        state.obs[rows, slot] = (obs_t - self.obs_mean) / self.obs_std
        state.rtg[rows, slot] = torch.as_tensor(state.rtg_raw / self.rtg_scale, dtype=torch.float32, device=dev)
        state.timesteps[rows, slot] = torch.as_tensor(np.minimum(t, cfg.max_ep_len - 1), device=dev)
        state.mask[rows, slot] = True
        state.actions[rows, slot] = 0
        return rows, slot
