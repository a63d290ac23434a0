"""Per-step inference cost of any :class:`~rl_tformers.agents.common.policy.Policy`.

:class:`TimedPolicy` wraps a policy and measures the wall time of every ``act`` call (one
batched forward pass for N environments, plus the policy's own bookkeeping), so
``rl-tformers eval`` reports the per-step inference cost of the agent measured in the same run
as its returns (``extra.act_ms_per_step``), whatever the agent kind.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch


class TimedPolicy:
    """A :class:`Policy` that times ``act``.

    Args:
        policy: the wrapped policy (any object with ``initial_state`` and ``act``).

    ``stats()`` returns ``act_calls`` and ``act_ms_per_step`` (mean wall milliseconds per
    ``act`` call, i.e. per environment step of all N environments; CUDA is synchronised before
    the clock stops), merged with the wrapped policy's own ``stats()`` when it has one.
    """

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self.calls = 0
        self.seconds = 0.0

    def initial_state(self, n_envs: int, target_return: float | None = None) -> Any:
        """The wrapped policy's ``initial_state`` (not timed)."""
        return self.policy.initial_state(n_envs, target_return)

    def act(self, obs: np.ndarray, state: Any, episode_start: np.ndarray, last_reward: np.ndarray | None = None):
        """The wrapped policy's ``act``, its wall time (seconds) added to ``self.seconds``."""
        t0 = time.perf_counter()
        out = self.policy.act(obs, state, episode_start, last_reward)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out

    def stats(self) -> dict[str, float | int]:
        """``act_calls`` and, after a call, ``act_ms_per_step`` (see the class docstring)."""
        out: dict[str, float | int] = {"act_calls": int(self.calls)}  # a count: an int in the JSON
        if self.calls:
            out["act_ms_per_step"] = 1000.0 * self.seconds / self.calls
        inner = getattr(self.policy, "stats", None)
        if callable(inner):
            out.update(inner())
        return out

    def __getattr__(self, name: str) -> Any:  # other attributes of the wrapped policy
        return getattr(self.policy, name)


def interleaved_timing(fns: dict[str, Any], repeats: int = 50, warmup: int = 5, *, budget_s: float | None = None,
                       min_repeats: int = 1) -> dict[str, dict[str, float]]:
    """Wall time of zero-argument callables, measured round-robin so load changes hit all alike.

    Each round calls every function once (order rotated per round); after ``warmup`` rounds,
    ``repeats`` rounds are timed. With ``budget_s``, no round starts once ``budget_s`` seconds
    have passed since the first and ``min_repeats`` rounds are timed. Returns
    ``{name: {"median_ms", "mean_ms", "p10_ms", "p90_ms"}}``. CUDA is synchronised after each
    call when initialised.
    """
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    start = time.perf_counter()
    for r in range(warmup + repeats):
        if budget_s is not None and r >= warmup + min_repeats and time.perf_counter() - start > budget_s:
            break
        order = names[r % len(names):] + names[: r % len(names)]
        for n in order:
            t0 = time.perf_counter()
            fns[n]()
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
            if r >= warmup:
                times[n].append(1000.0 * (time.perf_counter() - t0))
    out = {}
    for n, ts in times.items():
        a = np.asarray(ts)
        out[n] = {"median_ms": float(np.median(a)), "mean_ms": float(a.mean()),
                  "p10_ms": float(np.percentile(a, 10)), "p90_ms": float(np.percentile(a, 90))}
    return out
