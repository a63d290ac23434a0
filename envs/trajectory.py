"""Trajectory utilities shared by the Decision Transformer and GTrXL agents.

* :func:`returns_to_go` is the one definition of return-to-go, used to build training batches;
  :func:`next_return_to_go` is its evaluation-time update (target minus rewards received); started
  from an episode's return with its rewards it reproduces ``returns_to_go`` exactly for
  integer-valued rewards and to float64 rounding (a few ulps of the return) otherwise (tested).
* :func:`observation_stats` / :class:`ObsStats`: per-feature mean and std for normalisation.
* :func:`reward_scale`: the divisor applied to rewards and returns-to-go (DT uses 1000 on MuJoCo).
* :func:`top_fraction`: keep the best episodes by return (the "%BC" filter of the DT paper).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from rl_tformers.envs.dataset import EpisodeDataset, iter_chunks


def returns_to_go(rewards: np.ndarray, gamma: float = 1.0) -> np.ndarray:
    """Return-to-go of one episode: ``RTG_t = sum_{t' >= t} gamma^(t'-t) r_t'``.

    Args:
        rewards: (L,) rewards of one episode, raw units.
        gamma: discount in (0, 1]; 1.0 is the undiscounted RTG of the Decision Transformer
            (Chen et al. 2021, Sec. 3).

    Returns:
        (L,) float64. Examples: ``[1,2,3,4,5] -> [15,14,12,9,5]``; ``[1,1,1]`` with
        ``gamma=0.5 -> [1.75, 1.5, 1.0]``.

    Precision: each ``RTG_t`` is the suffix sum accumulated from the episode's end in float64
    (``RTG_{L-1} = r_{L-1}`` exactly, a step with no reward left has RTG 0), exact for
    integer-valued rewards whose sums stay below 2**53, otherwise within float64 rounding of the
    true sum (``RTG_0`` may differ from :attr:`EpisodeDataset.episode_returns`, the exactly rounded
    ``math.fsum``, in the last bits). The evaluation-time update :func:`next_return_to_go`
    subtracts from the start instead, so it reproduces these values to float64 rounding (exactly
    for integer rewards). With ``gamma < 1`` the backward recursion ``RTG_t = r_t + gamma *
    RTG_{t+1}``. The samplers then divide by the reward scale and cast to float32, far coarser
    than any of these differences.

    Raises:
        ValueError: ``gamma`` outside (0, 1] (0, NaN and > 1 included), or ``rewards`` not of
            shape (L,) or (L, 1) (a scalar or an (L, 2) array is not flattened silently).
    """
    if not 0.0 < gamma <= 1.0:
        raise ValueError(f"gamma must be in (0, 1], got {gamma}")
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1 and not (r.ndim == 2 and r.shape[1] == 1):
        raise ValueError(f"rewards must have shape (L,) or (L, 1) (one episode), got {r.shape}")
    r = r.reshape(-1)
    if gamma == 1.0:
        return np.cumsum(r[::-1])[::-1].copy()
    out = np.empty_like(r)
    acc = 0.0
    for t in range(r.size - 1, -1, -1):  # the recursion RTG_t = r_t + gamma * RTG_{t+1}
        acc = float(r[t]) + gamma * acc
        out[t] = acc
    return out


def next_return_to_go(rtg: np.ndarray | float, reward: np.ndarray | float, gamma: float = 1.0) -> np.ndarray | float:
    """Evaluation-time RTG update after receiving ``reward``: ``RTG_{t+1} = (RTG_t - r_t) / gamma``.

    This is :func:`returns_to_go`'s recursion solved for ``RTG_{t+1}``: starting from the
    episode's return (``returns_to_go(rewards, gamma)[0]``) and applying it with the episode's
    rewards reproduces ``returns_to_go(rewards, gamma)``: exactly for integer-valued rewards and
    ``gamma=1``, otherwise to float64 rounding (a few ulps of the return for ``gamma=1``; the
    division by ``gamma < 1`` amplifies the rounding at each step). Works elementwise on (N,) arrays of N
    environments. Units are those of ``rtg`` (divide both by the same reward scale, or neither).
    """
    if not 0.0 < gamma <= 1.0:
        raise ValueError(f"gamma must be in (0, 1], got {gamma}")
    return (rtg - reward) / gamma


def dataset_returns_to_go(dataset: EpisodeDataset, gamma: float = 1.0) -> np.ndarray:
    """(N_flat,) float64 RTG of every flat step, computed per episode with :func:`returns_to_go`.

    Indexed like the flat arrays (``rtg[dataset.starts[e] + t]``); rows outside the episode
    table are 0.
    """
    out = np.zeros(dataset.rewards.shape[0], dtype=np.float64)
    for s, n in zip(dataset.starts, dataset.lengths):
        out[s: s + n] = returns_to_go(dataset.rewards[s: s + n], gamma)
    return out


@dataclass(frozen=True)
class ObsStats:
    """Per-feature observation statistics: ``mean (*obs_shape)``, ``std (*obs_shape)`` (float32).

    ``std`` as computed by :func:`observation_stats` is floored at ``eps`` so that constant
    features do not divide by zero (the class itself stores what it is given).
    """

    mean: np.ndarray
    std: np.ndarray

    def normalize(self, obs: np.ndarray) -> np.ndarray:
        """``(obs - mean) / std`` broadcasting over leading axes; returns float32."""
        return ((np.asarray(obs, np.float32) - self.mean) / self.std).astype(np.float32, copy=False)

    def to_dict(self) -> dict:
        """JSON-ready ``{"mean": list, "std": list}``; inverse of :meth:`from_dict`."""
        return {"mean": self.mean.tolist(), "std": self.std.tolist()}

    @classmethod
    def from_dict(cls, d: dict) -> ObsStats:
        """Read :meth:`to_dict`'s output (as float32 arrays)."""
        return cls(np.asarray(d["mean"], np.float32), np.asarray(d["std"], np.float32))


def observation_stats(dataset: EpisodeDataset, eps: float = 1e-6) -> ObsStats:
    """Mean and (population) std of the observations of every step of the dataset.

    Computed in float64, streaming over chunks for lazy (HDF5-backed) or filtered data (a
    numerically stable pairwise merge, so lazy and in-memory copies of the same data agree to
    float rounding); final observations are not included (the DT convention). ``std`` is
    floored at ``eps``.

    A pixel dataset (uint8 ``(C, H, W)`` frames, :attr:`EpisodeDataset.is_pixel`) gets mean 0 and
    std 1 without reading a frame: statistics are not computed over frames (an encoder scales
    pixels by 1/255; per-pixel statistics would also cost a float pass over every frame), and
    the samplers refuse any other statistics on frames.

    Returns:
        :class:`ObsStats` with ``mean`` and ``std`` of shape ``observation_shape``, float32.
    """
    if dataset.is_pixel:
        return ObsStats(np.zeros(dataset.observation_shape, np.float32), np.ones(dataset.observation_shape, np.float32))
    if dataset.is_contiguous() and not dataset.is_lazy:
        s0 = int(dataset.starts[0])
        x = np.asarray(dataset.observations[s0: s0 + dataset.num_steps], np.float64)
        mean = x.mean(axis=0)
        std = x.std(axis=0)
        return ObsStats(mean.astype(np.float32), np.maximum(std, eps).astype(np.float32))
    # Chunked: per-chunk mean and sum of squared deviations, merged with Chan et al.'s pairwise
    # update. Same numbers as the in-memory path up to rounding; E[x^2] - E[x]^2 would cancel
    # catastrophically for features with a large mean and a small spread.
    mean = np.zeros(dataset.observation_shape, np.float64)
    m2 = np.zeros(dataset.observation_shape, np.float64)
    n = 0
    covered = np.zeros(dataset.rewards.shape[0], bool)
    covered[dataset.flat_indices()] = True
    for off, chunk in iter_chunks(dataset.observations):
        c = np.asarray(chunk, np.float64)[covered[off: off + chunk.shape[0]]]
        k = c.shape[0]
        if k == 0:
            continue
        c_mean = c.mean(axis=0)
        c_m2 = ((c - c_mean) ** 2).sum(axis=0)
        delta = c_mean - mean
        total = n + k
        mean = mean + delta * (k / total)
        m2 = m2 + c_m2 + delta * delta * (n * k / total)
        n = total
    std = np.sqrt(m2 / max(n, 1))
    return ObsStats(mean.astype(np.float32), np.maximum(std, eps).astype(np.float32))


#: The largest scale :func:`reward_scale` picks: the Decision Transformer's reward scale on every
#: MuJoCo task (Chen et al. 2021, the official code's ``scale = 1000.``).
REWARD_SCALE_MAX = 1000.0


def reward_scale(dataset: EpisodeDataset) -> float:
    """Divisor for rewards and returns-to-go (``agent.reward_scale: auto``): the power of ten at or
    below the largest |episode return|, at most 1000.

    ``min(1000, 10 ** floor(log10(max_e |R_e|)))``: 1000 for every dataset whose returns reach
    the thousands, the scale the Decision Transformer used on all of MuJoCo (Hopper, Walker2d,
    HalfCheetah, expert returns above 10,000 included); 100 for returns in [100, 1000) (CartPole),
    0.1 for a largest |return| in [0.1, 1); 1.0 when every return is 0. Divide rewards by it
    for training and the evaluation target by the same number.
    """
    m = float(np.abs(dataset.episode_returns).max()) if dataset.num_episodes else 0.0
    if m == 0.0:
        return 1.0
    return min(REWARD_SCALE_MAX, float(10.0 ** math.floor(math.log10(m))))


def top_fraction(dataset: EpisodeDataset, fraction: float) -> EpisodeDataset:
    """Keep the best episodes by undiscounted return; ties at the threshold are kept.

    Keeps every episode whose return is >= the ``ceil(fraction * E)``-th largest return, in
    dataset order. ``fraction=1.0`` keeps all episodes; for returns ``[10, 20]``,
    ``fraction=0.5`` keeps the return-20 episode. The flat arrays are shared (no copy).

    Raises:
        ValueError: ``fraction`` outside (0, 1].
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    ret = dataset.episode_returns
    k = max(1, math.ceil(fraction * dataset.num_episodes - 1e-9))
    threshold = np.sort(ret)[::-1][k - 1]
    return dataset.select(ret >= threshold)
