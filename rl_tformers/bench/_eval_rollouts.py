"""Part 1 of ``rl-tformers bench eval``: evaluation throughput, its profile and its growth with N.

- :func:`rollout` times one evaluation (:func:`rl_tformers.runtime.evaluation.run_episodes`, the
  loop of ``evaluate``) of a policy on N environments, under ``torch.inference_mode``; building
  and closing the environments is not timed. With ``profile`` the wall time is split into the
  spans of :mod:`rl_tformers.runtime.eval_profile` (policy forward, context tensors, environment
  stepping, action decoding, the rest: bookkeeping).
- :func:`compare` plays the same episodes one environment at a time and with each N, and checks
  that they are the same episodes (lengths equal, returns equal to 1e-6 relative: a GEMM of one
  row and one of N rows may round differently, so bitwise equality is not asserted).
- :func:`growth` fits the milliseconds of one loop step (one ``act`` for N environments and the
  N environment steps) against N: ``a + b N`` by least squares, with R^2, and the log-log
  slope of the largest two N.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from rl_tformers.bench._eval_policies import BenchPolicy
from rl_tformers.runtime import evaluation as ev
from rl_tformers.runtime.eval_profile import profiling

#: relative tolerance on returns of the same episode played with N and with 1 environment
RETURN_RTOL = 1e-6


class DifferentEpisodes(RuntimeError):
    """The batched and the one-at-a-time evaluations played different episodes."""


def loop_steps(lengths: list[int], n: int) -> int:
    """Iterations of the evaluation loop for episodes of ``lengths`` on ``n`` environments: episode
    j runs in environment j mod n, back to back, so the loop ends with the longest environment."""
    return max(sum(lengths[i::n]) for i in range(min(n, len(lengths))))


def rollout(bp: BenchPolicy, n_envs: int, episodes: int, seed: int, *, max_episode_steps: int | None = None,
            vector: str = "sync", profile: bool = False) -> dict[str, Any]:
    """One timed evaluation of ``episodes`` episodes on N = min(n_envs, episodes) environments.

    Returns:
        ``{"n_envs", "episodes", "env_steps", "loop_steps", "seconds", "env_steps_per_s",
        "ms_per_loop_step", "return_mean", "lengths", "returns"}``, and ``"split"``
        (:meth:`~rl_tformers.runtime.eval_profile.EvalProfile.split`) with ``profile``.
    """
    make = bp.make_env
    if max_episode_steps is not None:
        base = make

        def make() -> gym.Env:
            return gym.wrappers.TimeLimit(base(), max_episode_steps)

    n = min(n_envs, episodes)
    cls = gym.vector.AsyncVectorEnv if vector == "async" else gym.vector.SyncVectorEnv
    envs = cls([lambda: ev.with_raw_reward(make()) for _ in range(n)], autoreset_mode=gym.vector.AutoresetMode.DISABLED)
    split = None
    try:
        with torch.inference_mode(), (profiling() if profile else contextlib.nullcontext()) as prof:
            t0 = time.perf_counter()
            rec = ev.run_episodes(bp.policy, envs, bp.target, episodes, seed)
            seconds = time.perf_counter() - t0
        if prof is not None:
            split = prof.split()
    finally:
        envs.close()
    lengths = [int(x) for x in rec.lengths]
    steps, loops = sum(lengths), loop_steps(lengths, n)
    row = {"n_envs": n, "vector": vector, "episodes": episodes, "env_steps": steps, "loop_steps": loops,
           "seconds": seconds, "env_steps_per_s": steps / seconds, "ms_per_loop_step": 1e3 * seconds / loops,
           "return_mean": float(np.mean(rec.returns)), "lengths": lengths, "returns": [float(r) for r in rec.returns]}
    if split is not None:
        row["split"] = split
    return row


def same_episodes(a: dict[str, Any], b: dict[str, Any]) -> tuple[bool, float]:
    """(lengths equal and returns within :data:`RETURN_RTOL`, the largest relative return difference)."""
    worst = max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a["returns"], b["returns"])), default=0.0)
    return a["lengths"] == b["lengths"] and worst <= RETURN_RTOL, worst


def compare(bp: BenchPolicy, n_envs: tuple[int, ...], episodes: int, seed: int, *, max_episode_steps: int | None,
            vector: str, profile: bool, log=lambda m: None) -> list[dict[str, Any]]:
    """Rows of every N in ``n_envs`` (batched) then one environment at a time (sequential), each
    with ``over_sequential`` (its env steps/s over the sequential one's) and ``max_return_rel_diff``.

    Raises:
        DifferentEpisodes: some N played other episodes than the sequential evaluation (lengths
            differ, or returns by more than :data:`RETURN_RTOL`); the message names N.
    """
    seq = rollout(bp, 1, episodes, seed, max_episode_steps=max_episode_steps, profile=profile)
    seq["mode"] = "sequential"
    log(f"sequential: {seq['env_steps']} steps in {seq['seconds']:.1f} s, return {seq['return_mean']:.1f}")
    rows = []
    for n in n_envs:
        if min(n, episodes) == 1:
            continue
        row = rollout(bp, n, episodes, seed, max_episode_steps=max_episode_steps, vector=vector, profile=profile)
        row["mode"] = "batched"
        same, worst = same_episodes(row, seq)
        row["max_return_rel_diff"] = worst
        if not same:
            raise DifferentEpisodes(
                f"bench eval: {row['n_envs']} environments played other episodes than one at a time (lengths "
                f"{row['lengths']} vs {seq['lengths']}, largest relative return difference {worst:.3g})")
        row["over_sequential"] = row["env_steps_per_s"] / seq["env_steps_per_s"]
        log(f"batched (N={row['n_envs']}): {row['seconds']:.1f} s, {row['over_sequential']:.2f}x sequential")
        rows.append(row)
    seq["over_sequential"], seq["max_return_rel_diff"] = 1.0, 0.0
    return rows + [seq]


def growth(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Fit of ``ms_per_loop_step`` against N over ``rows`` (one per N; None with fewer than 3 N):
    ``{"n", "ms", "a_ms", "b_ms_per_env", "r2", "loglog_slope"}`` (``ms ~ a + b N``; the slope of
    log ms over log N between the two largest N: 1 is linear growth, 2 quadratic)."""
    pts = sorted({r["n_envs"]: r["ms_per_loop_step"] for r in rows}.items())
    if len(pts) < 3:
        return None
    n = np.array([p[0] for p in pts], dtype=np.float64)
    ms = np.array([p[1] for p in pts], dtype=np.float64)
    b, a = np.polyfit(n, ms, 1)
    resid = ms - (a + b * n)
    r2 = 1.0 - float(resid @ resid) / float(((ms - ms.mean()) ** 2).sum()) if len(ms) > 1 else 1.0
    slope = math.log(ms[-1] / ms[-2]) / math.log(n[-1] / n[-2])
    return {"n": n.astype(int).tolist(), "ms": ms.tolist(), "a_ms": float(a), "b_ms_per_env": float(b), "r2": r2,
            "loglog_slope": slope}


def plot_growth(fit: dict[str, Any], rows: list[dict[str, Any]], path: str, title: str) -> None:
    """Write the growth plot (PNG or any format matplotlib knows from ``path``'s suffix): ms per
    loop step against N with the linear fit, and env steps per second against N."""
    import matplotlib  # optional plotting dependency, only for --plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional plotting dependency, only for --plot

    by_n = {r["n_envs"]: r for r in rows}
    n = np.array(fit["n"], dtype=np.float64)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(n, fit["ms"], "o", label="measured")
    grid = np.linspace(n.min(), n.max(), 100)
    ax1.plot(grid, fit["a_ms"] + fit["b_ms_per_env"] * grid, "-",
             label=f"{fit['a_ms']:.2f} + {fit['b_ms_per_env']:.3f} N ms (R$^2$ {fit['r2']:.3f})")
    ax1.set_xlabel("environments N")
    ax1.set_ylabel("ms per loop step (one act + N env steps)")
    ax1.legend()
    ax2.plot(n, [by_n[int(k)]["env_steps_per_s"] for k in n], "o-")
    ax2.set_xlabel("environments N")
    ax2.set_ylabel("env steps / s")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
