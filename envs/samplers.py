"""Batch samplers over an :class:`~rl_tformers.envs.dataset.EpisodeDataset`.

Both samplers are pure functions of ``(rng, batch_size)``: ``sample(batch_size, rng)`` draws
everything from the ``numpy.random.Generator`` it is given, so a batch is reproducible from the
generator's seed (see :mod:`rl_tformers.envs.torch_data`, which seeds one generator per
training step). A sample costs O(B * K) array reads plus O(B log E) ``searchsorted`` calls on
precomputed cumulative lengths: it never touches every episode.

* :class:`WindowSampler`: Decision Transformer context windows (Chen et al. 2021), episodes
  drawn with probability proportional to their length, padded to K with a mask (on the right
  for start-aligned windows, on the left for end-aligned ones: the evaluation context's layout).
* :class:`SegmentSampler`: fixed-length runs of consecutive dataset steps for recurrent /
  memory agents (GTrXL, Parisotto et al. 2020), crossing episode boundaries with
  ``episode_start`` flags, with an optional burn-in prefix excluded from the loss.

Batch arrays (numpy; :mod:`~rl_tformers.envs.torch_data` turns them into tensors):
``observations (B, K, *obs_shape)`` float32 (a pixel dataset: ``(B, K, k * C, H, W)`` uint8, each
step's ``k = frame_stack`` frames stacked when drawn, zeros before its episode's first frame:
:func:`~rl_tformers.envs.frames.stack_frames`), ``actions (B, K, *act_shape)`` float32 for Box or
``(B, K)`` int64 for Discrete, ``rewards (B, K)`` float32, ``returns_to_go (B, K)`` float32,
``timesteps (B, K)`` int64 (step index inside the episode), ``mask (B, K)`` bool (True = real
step). Padded slots hold zeros everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from rl_tformers.envs.dataset import EpisodeDataset
from rl_tformers.envs.frames import stack_frames
from rl_tformers.envs.trajectory import ObsStats, dataset_returns_to_go


@dataclass(frozen=True)
class SampleIndex:
    """Which dataset rows a batch reads: everything a sampler draws from its generator.

    Attributes:
        flat: ``(B, L)`` int64, flat dataset row of each slot (some row of the same episode on
            padded slots: the gather reads it and zeroes it).
        mask: ``(B, L)`` bool, True on real steps.
        steps: ``(B, L)`` int64, step index inside the episode of each slot.
        episode: ``(B,)`` (window) or ``(B, L)`` (segment) int64, episode index of each row or
            slot (any episode on padded slots; the sampler's ``episode`` key holds -1 there).
    """

    flat: np.ndarray
    mask: np.ndarray
    steps: np.ndarray
    episode: np.ndarray


class _BaseSampler:
    def __init__(self, dataset: EpisodeDataset, *, gamma: float, reward_scale: float,
                 obs_stats: ObsStats | None):
        if dataset.num_episodes == 0:
            raise ValueError("cannot sample from a dataset with no episodes")
        if not (0 < reward_scale < float("inf")):  # NaN and inf too: they would make every batch NaN / 0
            raise ValueError(f"reward_scale must be a finite number > 0, got {reward_scale}")
        if obs_stats is not None and dataset.is_pixel and not (
                np.all(obs_stats.mean == 0) and np.all(obs_stats.std == 1)):
            raise ValueError("obs_stats: observation statistics are not applied to pixel frames (uint8 (C, H, W) "
                             "observations reach the encoder as they are); pass None or mean 0 and std 1")
        self.dataset = dataset
        self.gamma = float(gamma)
        self.reward_scale = float(reward_scale)
        self.obs_stats = obs_stats
        self.rtg = dataset_returns_to_go(dataset, gamma)  # (N_flat,) float64, raw units
        self.discrete = dataset.discrete_actions

    def _gather(self, flat: np.ndarray, mask: np.ndarray, timesteps: np.ndarray) -> dict[str, np.ndarray]:
        """Read rows ``flat (B, L)`` and zero the padded slots (``mask`` False)."""
        d = self.dataset
        m = mask.astype(np.float32)  # (B, L)
        if d.is_pixel:  # uint8 frames stacked per step, zero on padding; never converted to float
            obs = stack_frames(d.observations, flat, timesteps, d.frame_stack, mask)  # (B, L, k*C, H, W)
        else:
            obs = np.asarray(d.observations[flat], dtype=np.float32)  # (B, L, *obs_shape)
            if self.obs_stats is not None:
                obs = self.obs_stats.normalize(obs)
            obs *= m.reshape(m.shape + (1,) * (obs.ndim - 2))
        if self.discrete:
            act = np.asarray(d.actions[flat]).astype(np.int64) * mask  # (B, L)
        else:
            act = np.asarray(d.actions[flat], dtype=np.float32)  # (B, L, *act_shape)
            act *= m.reshape(m.shape + (1,) * (act.ndim - 2))
        return {
            "observations": obs,
            "actions": act,
            "rewards": (d.rewards[flat] / self.reward_scale).astype(np.float32) * m,
            "returns_to_go": (self.rtg[flat] / self.reward_scale).astype(np.float32) * m,
            "timesteps": np.where(mask, timesteps, 0).astype(np.int64),
            "mask": mask,
        }


class WindowSampler(_BaseSampler):
    """Decision Transformer training windows of ``K = context_len`` steps.

    Episodes are drawn with probability proportional to their length (a uniform virtual step
    located by ``searchsorted`` on the cumulative lengths). Within the episode (length L):

    * ``align="start"`` (default, the original DT sampler): start ``s`` uniform over
      ``[0, max(L - K, 0)]``, window ``[s, min(s + K, L))``; an episode shorter than K gives the
      whole episode;
    * ``align="end"``: the window's last step ``e`` uniform over ``[0, L)``, window
      ``[max(0, e - K + 1), e]`` (for training only on the last action of each context).

    Padding to K (``mask`` True on the ``n`` real steps) follows the evaluation context of the
    same alignment (:class:`~rl_tformers.agents.decision_transformer.policy.DTPolicy`), so that
    a model with absolute positions (``backbone.position.kind=learned`` or ``sinusoidal``) or an
    attention pattern laid over token indices (``fixed``, ``strided``...) sees in training the
    slots it acts with: ``align="start"`` puts the real steps in the first ``n`` slots (padding
    on the right, only for an episode shorter than K: step t at slot t, as when acting);
    ``align="end"`` in the last ``n`` (padding on the left: the window ends at slot K-1).
    Extra keys: ``episode (B,)`` int64, the episode index of each row.

    Args:
        dataset: the episodes.
        context_len: K, window length in steps (DT: 20 on MuJoCo).
        align: ``"start"`` or ``"end"`` (see above).
        gamma: discount of the returns-to-go (1.0 = DT).
        reward_scale: rewards and returns-to-go are divided by it (see
            :func:`~rl_tformers.envs.trajectory.reward_scale`).
        obs_stats: normalise observations with it when given (a pixel dataset takes none, or
            mean 0 and std 1: frames reach the encoder as uint8).
        max_ep_len: refuse datasets with longer episodes (the model's timestep table size).

    Raises:
        DatasetError: an episode longer than ``max_ep_len``.
        ValueError: bad ``context_len`` / ``align``; ``reward_scale`` not a finite number > 0
            (0, negative, NaN, inf); ``gamma`` outside (0, 1]; ``obs_stats`` other than mean 0
            and std 1 on a pixel dataset.
    """

    def __init__(self, dataset: EpisodeDataset, context_len: int, *, align: str = "start", gamma: float = 1.0,
                 reward_scale: float = 1.0, obs_stats: ObsStats | None = None, max_ep_len: int | None = None):
        if context_len < 1:
            raise ValueError(f"context_len must be >= 1, got {context_len}")
        if align not in ("start", "end"):
            raise ValueError(f"align must be 'start' or 'end', got {align!r}")
        if max_ep_len is not None:
            dataset.check_max_ep_len(max_ep_len)
        super().__init__(dataset, gamma=gamma, reward_scale=reward_scale, obs_stats=obs_stats)
        self.context_len = int(context_len)
        self.align = align

    def indices(self, batch_size: int, rng: np.random.Generator) -> SampleIndex:
        """The rows of one batch of ``batch_size`` windows drawn from ``rng``: everything
        :meth:`sample` draws (``flat``/``mask``/``steps`` of shape ``(B, K)``, ``episode (B,)``)."""
        d, k = self.dataset, self.context_len
        v = rng.integers(0, d.num_steps, size=batch_size)  # (B,) uniform virtual step
        ep, t = d.locate(v)  # episode ~ length; t uniform inside it
        length = d.lengths[ep]  # (B,)
        slot = np.arange(k)[None, :]  # (1, K)
        if self.align == "start":
            start = rng.integers(0, np.maximum(length - k, 0) + 1)  # (B,) uniform over [0, max(L-K, 0)]
            n_real = np.minimum(k, length - start)
            # real steps from slot 0, padding (an episode shorter than K) on the right: the layout
            # of the evaluation context (DTPolicy, align="start"), where step t sits at slot t
            # until the window is full
            mask = slot < n_real[:, None]  # (B, K)
            local = np.where(mask, start[:, None] + slot, start[:, None])  # (B, K) step in episode
        else:
            start = np.maximum(t - k + 1, 0)  # window ends at the uniform step t
            n_real = t - start + 1
            pad = (k - n_real)[:, None]  # (B, 1) padded slots on the left
            mask = slot >= pad  # (B, K)
            local = np.where(mask, start[:, None] + slot - pad, start[:, None])  # (B, K) step in episode
        flat = d.starts[ep][:, None] + local  # (B, K) flat row
        return SampleIndex(flat, mask, local, ep.astype(np.int64))

    def sample(self, batch_size: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """One batch of ``batch_size`` windows drawn from ``rng`` (see the class docstring)."""
        idx = self.indices(batch_size, rng)
        out = self._gather(idx.flat, idx.mask, idx.steps)
        out["episode"] = idx.episode
        return out


class SegmentSampler(_BaseSampler):
    """Runs of ``L = burn_in + seq_len`` consecutive dataset steps for recurrent agents.

    The first step is uniform over all ``N`` steps of the dataset (episode-table order); a run
    continues across episode boundaries (``episode_start`` is True at the first step of each
    episode inside the run, and only there: a run that begins mid-episode has no flag at
    slot 0, the agent's memory simply starts empty and the burn-in warms it). Slots past the
    end of the dataset are padding (``mask`` False).

    Loss coverage: dataset step ``j`` carries a loss in the runs that start at
    ``v0 in [j - L + 1, j - burn_in]``, so every step from ``L - 1`` on is drawn at the same rate,
    the steps before it less often, and the first ``burn_in`` steps of the dataset (the start of
    its first episode only; later episodes' starts are reached through the previous episode's
    tail) never: known limitation, a fraction ``burn_in / N`` of the data.

    Extra keys: ``episode_start (B, L)`` bool, ``terminations (B, L)`` bool, ``truncations (B, L)``
    bool, ``loss_mask (B, L)`` bool (``mask`` and slot >= ``burn_in``), ``episode (B, L)`` int64
    (-1 on padding).

    Args:
        dataset: the episodes.
        seq_len: T, steps that carry a loss.
        burn_in: steps before them used only to warm up the memory (R2D2-style burn-in).
        gamma, reward_scale, obs_stats: as in :class:`WindowSampler`.

    Raises:
        ValueError: ``seq_len < 1``, ``burn_in < 0``, or ``gamma`` / ``reward_scale`` as in
            :class:`WindowSampler`.
    """

    def __init__(self, dataset: EpisodeDataset, seq_len: int, *, burn_in: int = 0, gamma: float = 1.0,
                 reward_scale: float = 1.0, obs_stats: ObsStats | None = None):
        if seq_len < 1 or burn_in < 0:
            raise ValueError(f"need seq_len >= 1 and burn_in >= 0, got {seq_len}, {burn_in}")
        super().__init__(dataset, gamma=gamma, reward_scale=reward_scale, obs_stats=obs_stats)
        self.seq_len = int(seq_len)
        self.burn_in = int(burn_in)

    @property
    def length(self) -> int:
        """L = burn_in + seq_len."""
        return self.burn_in + self.seq_len

    def indices(self, batch_size: int, rng: np.random.Generator) -> SampleIndex:
        """The rows of one batch of ``batch_size`` segments drawn from ``rng``: everything
        :meth:`sample` draws (``flat``/``mask``/``steps``/``episode`` of shape ``(B, L)``)."""
        d, n = self.dataset, self.dataset.num_steps
        v0 = rng.integers(0, n, size=batch_size)  # (B,) first virtual step
        v = v0[:, None] + np.arange(self.length)[None, :]  # (B, L)
        mask = v < n
        ep, t = d.locate(np.minimum(v, n - 1))  # (B, L) episode and step inside it
        flat = d.starts[ep] + t  # (B, L)
        return SampleIndex(flat, mask, t, ep.astype(np.int64))

    def sample(self, batch_size: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """One batch of ``batch_size`` segments drawn from ``rng`` (see the class docstring)."""
        idx = self.indices(batch_size, rng)
        d, flat, mask, t = self.dataset, idx.flat, idx.mask, idx.steps
        out = self._gather(flat, mask, t)
        out["episode_start"] = (t == 0) & mask
        out["terminations"] = d.terminations[flat] & mask
        out["truncations"] = d.truncations[flat] & mask
        out["loss_mask"] = mask & (np.arange(self.length)[None, :] >= self.burn_in)
        out["episode"] = np.where(mask, idx.episode, -1).astype(np.int64)
        return out
