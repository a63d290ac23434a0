"""The Decision Transformer's acting context: the window of the last K steps of N episodes.

The context of each environment lives in one preallocated ring buffer held in a
:class:`DTState` (owned by the caller, never by the policy): ``store`` (N, K, F) float32, one
row of F = obs_dim + action columns + 3 (return-to-go, timestep, mask) per step, and ``head``
(N,), the physical slot of each row's logical slot 0. A step writes one row per environment (one
host-to-device copy, one indexed write) and moves ``head`` by one where the window slides, so
no step copies the window; the model reads it in logical order (one gather; none while every
``head`` is 0). The logical layout is the one of the training windows (``align``):

- ``align="start"`` (the paper's sampler; causal mode only): step t of an episode is at slot
  ``min(t, K-1)``; once the window is full it slides by one slot per step, so it always holds the
  last K steps starting at slot 0, exactly like a training window that starts at
  ``max(0, t - K + 1)``; the prediction is read at slot ``min(t, K-1)``.
- ``align="end"`` (``last_action`` mode, or causal mode trained on end-aligned windows): every
  step slides the window by one and writes at slot K-1; slots before the episode's first step
  stay padding; the prediction is read at slot K-1.

The window is the one that concatenation (shift left, append the new step) would build, value
for value (tested in both phases: filling up and sliding).

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


#: timesteps are stored in the float32 ring buffer: exact up to 2**24
MAX_STORED_TIMESTEP = 2**24


@dataclass
class DTState:
    """Context of N environments: the ring buffer and its logical-order views (updated in place by
    :meth:`ContextWindow.advance`, :meth:`ContextWindow.write` and :meth:`ContextWindow.write_action`,
    through ``DTPolicy.act``).

    The five model inputs are views in logical order of the latest :meth:`ContextWindow.write`
    (the buffer itself while every ``head`` is 0, else a gathered copy): a write into
    ``obs``, ``actions`` or ``rtg`` reaches the model's next call only while the windows fill up
    from slot 0 (``align="start"``, fewer than K steps).

    Attributes:
        obs: (N, K, obs_dim) normalised observations.
        actions: (N, K, A) normalised actions in [-1, 1] (continuous) or (N, K) long (discrete).
        rtg: (N, K) returns-to-go fed to the model (raw / rtg_scale).
        timesteps: (N, K) long episode steps.
        mask: (N, K) bool, True = real step.
        t: (N,) int64 step of the current observation in its episode (-1 before the first).
        rtg_raw: (N,) float64 remaining return in raw reward units.
        target: (N,) float64 target return of each row (raw units).
        store: (N, K, F) float32 ring buffer (module docstring).
        head: (N,) int64 physical slot of logical slot 0 of each row.
        view: (N, K, F) the window in logical order (``store`` itself while every head is 0).
        phys: (N,) long physical slot of the latest written step of each row (None before a step).
    """

    obs: Tensor
    actions: Tensor
    rtg: Tensor
    timesteps: Tensor
    mask: Tensor
    t: np.ndarray
    rtg_raw: np.ndarray
    target: np.ndarray
    store: Tensor
    head: np.ndarray
    view: Tensor
    phys: Tensor | None = None


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

    Raises:
        ValueError: ``cfg.max_ep_len`` above :data:`MAX_STORED_TIMESTEP` (timesteps would not be
            exact in the float32 buffer).
    """

    def __init__(self, cfg: DTConfig, align: str, obs_mean: Tensor, obs_std: Tensor, rtg_scale: float,
                 timestep_overflow: str, device: torch.device) -> None:
        if cfg.max_ep_len > MAX_STORED_TIMESTEP:
            raise ValueError(f"Decision Transformer acting: agent.max_ep_len={cfg.max_ep_len} is above "
                             f"{MAX_STORED_TIMESTEP}, the largest timestep the float32 context buffer holds exactly")
        self.cfg, self.align, self.device = cfg, align, device
        self.obs_mean, self.obs_std = obs_mean, obs_std
        # the same float32 statistics on the host: the new step's row is built there (IEEE float32
        # subtraction and division, the same values as on the device)
        self._mean_np = obs_mean.detach().cpu().numpy().astype(np.float32)
        self._std_np = obs_std.detach().cpu().numpy().astype(np.float32)
        self.rtg_scale = rtg_scale
        self.timestep_overflow = timestep_overflow
        d = cfg.obs_dim
        self.n_act = 1 if cfg.discrete else cfg.act_dim  # action columns
        self.c_rtg, self.c_time, self.c_mask = d + self.n_act, d + self.n_act + 1, d + self.n_act + 2
        self.width = d + self.n_act + 3  # F
        self._rows: dict[int, Tensor] = {}  # arange(N) on the device, per N

    def rows(self, n: int) -> Tensor:
        """(n,) long ``arange(n)`` on the device (made once per n)."""
        r = self._rows.get(n)
        if r is None:
            r = self._rows[n] = torch.arange(n, device=self.device)
        return r

    def empty(self, n: int, target: float) -> DTState:
        """Empty buffers of ``n`` episodes conditioned on ``target`` (raw units), no step yet."""
        store = torch.zeros(n, self.cfg.context_len, self.width, device=self.device)
        state = DTState(obs=store, actions=store, rtg=store, timesteps=store, mask=store,
                        t=np.full(n, -1, dtype=np.int64), rtg_raw=np.full(n, float(target), dtype=np.float64),
                        target=np.full(n, float(target), dtype=np.float64), store=store,
                        head=np.zeros(n, dtype=np.int64), view=store)
        self._expose(state, store)
        return state

    def _expose(self, state: DTState, view: Tensor) -> None:
        """Point the five model inputs of ``state`` at ``view`` (N, K, F), the window in logical order."""
        state.view = view
        state.obs, state.actions, state.rtg, state.timesteps, state.mask = self.inputs(view)

    def inputs(self, view: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """The model inputs (obs, actions, rtg, timesteps, mask) of windows ``view`` (B, K, F) in
        logical order: views of its columns (a sub-batch ``state.view[rows]`` gives its rows the
        memory layout of the whole batch's inputs, so the same GEMM kernels and the same values)."""
        d = self.cfg.obs_dim
        actions = view[..., d].long() if self.cfg.discrete else view[..., d:d + self.n_act]
        return view[..., :d], actions, view[..., self.c_rtg], view[..., self.c_time].long(), view[..., self.c_mask].bool()

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
        """Clear starting rows, slide full windows (align start) or every continuing row (align
        end) by one slot, and write step t (observation, return-to-go, timestep; action 0 until
        decided) at its slot.

        Args:
            state: the buffers (``store`` and ``head`` updated in place; the views re-pointed).
            obs: (N, obs_dim) raw observations.
            start: (N,) bool, the rows that start an episode.
            t: (N,) int64 episode steps (:meth:`advance`).

        Returns:
            (rows (N,), slot (N,)) long tensors: where step t of each row sits (logical slot).
        """
        cfg, k, dev = self.cfg, self.cfg.context_len, self.device
        n = start.shape[0]
        head = state.head
        if start.any():  # a new episode: an empty window from physical slot 0
            state.store[torch.as_tensor(np.flatnonzero(start), device=dev)] = 0.0
            head[start] = 0
        slide = (t >= k) if self.align == "start" else ~start
        head[slide] = (head[slide] + 1) % k
        slot_np = np.minimum(t, k - 1) if self.align == "start" else np.full(n, k - 1)
        phys = (head + slot_np) % k
        row = np.empty((n, self.width), dtype=np.float32)  # the new step of every row
        d = cfg.obs_dim
        row[:, :d] = (np.asarray(obs, dtype=np.float32).reshape(n, d) - self._mean_np) / self._std_np
        row[:, d:self.c_rtg] = 0.0
        row[:, self.c_rtg] = state.rtg_raw / self.rtg_scale  # float64 -> float32, as the model's input
        row[:, self.c_time] = np.minimum(t, cfg.max_ep_len - 1)
        row[:, self.c_mask] = 1.0
        rows = self.rows(n)
        index = torch.as_tensor(np.stack([phys, slot_np]), device=dev)  # (2, N): physical, logical slot
        state.store[rows, index[0]] = torch.as_tensor(row, device=dev)
        if head.any():  # the window in logical order: slot j of row i is at (head[i] + j) % K
            ring = torch.as_tensor((head[:, None] + np.arange(k)) % k, device=dev)  # (N, K)
            view = state.store[rows[:, None], ring]  # (N, K, F)
        else:
            view = state.store
        self._expose(state, view)
        state.phys = index[0]
        return rows, index[1]

    def write_action(self, state: DTState, rows: Tensor, slot: Tensor, action: Tensor) -> None:
        """Write the decided ``action`` ((N, A) float, or (N,) long class indices) at the step of
        the latest :meth:`write` (``rows``, ``slot``: its return): into the ring buffer and into
        the state's logical views."""
        d = self.cfg.obs_dim
        a = action.to(torch.float32).reshape(rows.shape[0], self.n_act)  # (N, A) or (N, 1)
        state.store[rows, state.phys, d:d + self.n_act] = a
        if state.view is not state.store:
            state.view[rows, slot, d:d + self.n_act] = a
        if self.cfg.discrete:  # the long copy of the action column
            state.actions[rows, slot] = action
