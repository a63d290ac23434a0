"""What a deployed policy keeps between steps, in NumPy: the Decision Transformer's context
window (:class:`DTContext`) and the explicit memory of a GTrXL graph (:class:`GTrXLMemory`).

Both work with any backend of :class:`~rl_tformers.agents.export.policy.Policy` (eager PyTorch,
TorchScript, onnxruntime), and need nothing of PyTorch: a program that runs ``policy.onnx``
under onnxruntime can copy this file alone.

The DT's window has the layout of :mod:`~rl_tformers.agents.decision_transformer.context`
(``align="start"``: step t at slot ``min(t, K-1)``, full windows shifted left by one;
``align="end"``: every step shifts and writes at slot K-1), and the same return-to-go recursion
``R_{t+1} = R_t - r_t`` in float64 raw reward units (Chen et al. 2021, algorithm 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class DTContext:
    """The context window of N episodes for :class:`~rl_tformers.agents.export.graphs.DTGraph`.

    Attributes:
        returns_to_go: (N, K) float64 raw remaining return at each step.
        observations: (N, K, O) float32 raw observations.
        actions: (N, K, A) float32 normalised or (N, K) int64 class indices (the graph's
            ``context_action`` outputs).
        timesteps: (N, K) int64 episode steps (clamped to ``max_ep_len - 1``).
        mask: (N, K) bool, True = real step.
        t: (N,) int64 episode step of the current observation (-1 before the first).
        rtg: (N,) float64 remaining return now (raw units).
        target: (N,) float64 target return of each row.
    """

    returns_to_go: np.ndarray
    observations: np.ndarray
    actions: np.ndarray
    timesteps: np.ndarray
    mask: np.ndarray
    t: np.ndarray
    rtg: np.ndarray
    target: np.ndarray

    @classmethod
    def empty(cls, n: int, acting: dict[str, Any], target: float) -> DTContext:
        """Empty windows of ``n`` episodes conditioned on ``target`` (raw units); ``acting`` is the
        policy folder's ``acting`` section (``context_len``, ``obs_dim``, ``act_dim``, ``discrete``)."""
        k, o, a = int(acting["context_len"]), int(acting["obs_dim"]), int(acting["act_dim"])
        discrete = bool(acting["discrete"])
        return cls(
            returns_to_go=np.zeros((n, k)), observations=np.zeros((n, k, o), np.float32),
            actions=np.zeros((n, k), np.int64) if discrete else np.zeros((n, k, a), np.float32),
            timesteps=np.zeros((n, k), np.int64), mask=np.zeros((n, k), bool),
            t=np.full(n, -1, np.int64), rtg=np.full(n, float(target)), target=np.full(n, float(target)),
        )

    def step(self, obs: np.ndarray, start: np.ndarray, last_reward: np.ndarray | None,
             acting: dict[str, Any]) -> np.ndarray:
        """Advance every row one step and write ``obs`` (N, O) raw at its slot; returns the slots (N,).

        Starting rows are cleared and conditioned on their target; the others take
        ``R_{t+1} = R_t - r_t`` with ``last_reward`` (N,) raw.

        Raises:
            ValueError: a row continues an episode that never started, or a step at or past
                ``max_ep_len`` with ``timestep_overflow="error"`` (both named).
        """
        k, max_len = self.mask.shape[1], int(acting["max_ep_len"])
        if (~start & (self.t < 0)).any():
            raise ValueError("Policy.act: a row continues an episode that never started (episode_start must be True first)")
        if last_reward is not None:
            self.rtg = np.where(start, self.rtg, self.rtg - np.asarray(last_reward, np.float64))
        self.rtg[start] = self.target[start]
        self.t = np.where(start, 0, self.t + 1)
        if int(self.t.max()) >= max_len and acting["timestep_overflow"] == "error":
            raise ValueError(f"Policy.act: episode step {int(self.t.max())} >= max_ep_len={max_len} (the timestep "
                             f"embedding has no entry for it); load the policy with timestep_overflow='clamp' to "
                             f"reuse the last timestep index")
        shift = (self.t >= k) if acting["align"] == "start" else ~start
        for name in ("returns_to_go", "observations", "actions", "timesteps", "mask"):
            buf = getattr(self, name)
            sh = shift.reshape((-1,) + (1,) * (buf.ndim - 1))
            new = np.where(sh, np.roll(buf, -1, axis=1), buf)
            setattr(self, name, np.where(start.reshape(sh.shape), np.zeros_like(new), new))
        slot = np.minimum(self.t, k - 1) if acting["align"] == "start" else np.full(len(start), k - 1)
        rows = np.arange(len(start))
        self.observations[rows, slot] = np.asarray(obs, np.float32).reshape(len(start), -1)
        self.returns_to_go[rows, slot] = self.rtg
        self.timesteps[rows, slot] = np.minimum(self.t, max_len - 1)
        self.mask[rows, slot] = True
        self.actions[rows, slot] = 0
        return slot

    def inputs(self) -> list[np.ndarray]:
        """The graph's inputs, in order: returns_to_go, observations, actions, timesteps, mask."""
        return [self.returns_to_go, self.observations, self.actions, self.timesteps, self.mask]

    def record(self, slot: np.ndarray, context_action: np.ndarray) -> None:
        """Write the graph's ``context_action`` (N, ...) at each row's slot."""
        self.actions[np.arange(len(slot)), slot] = context_action


@dataclass
class GTrXLMemory:
    """The memory of N environments for :class:`~rl_tformers.agents.export.graphs.GTrXLGraph`.

    Attributes:
        tensors: the graph's memory inputs (each (N, ...)), in order.
        target: (N,) float64 target return of each row (raw units; 0 when unconditioned).
        started: (N,) bool, rows that have acted at least once.
    """

    tensors: list[np.ndarray]
    target: np.ndarray
    started: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))

    @classmethod
    def empty(cls, n: int, initial: list[np.ndarray], target: float | None) -> GTrXLMemory:
        """The memory of ``n`` fresh rows: each of the one-row ``initial`` tensors repeated n times."""
        return cls([np.repeat(x, n, axis=0) for x in initial], np.full(n, float(target or 0.0)), np.zeros(n, bool))


def episode_starts(episode_start: Any, started: np.ndarray, n: int) -> np.ndarray:
    """(N,) bool starts: ``episode_start`` as given, or, when it is ``None``, the rows that have
    not acted yet.

    Raises:
        ValueError: ``episode_start`` of another length than the N observations.
    """
    if episode_start is None:
        return ~started if started.shape == (n,) else np.ones(n, bool)
    start = np.asarray(episode_start, dtype=bool).reshape(-1)
    if start.shape != (n,):
        raise ValueError(f"Policy.act: episode_start has {start.shape[0]} rows but obs has {n}")
    return start
