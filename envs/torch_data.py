"""``torch.utils.data`` pipeline: batch ``s`` is a pure function of ``(seed, s)``.

:class:`StepBatchDataset` is map-style: ``ds[s]`` draws training batch ``s`` from
``numpy.random.default_rng([seed, s])`` with a sampler from :mod:`rl_tformers.envs.samplers`.
Consequences the trainer relies on:

* resuming at step ``s`` gives exactly the batches an uninterrupted run would have seen
  (:func:`make_dataloader` takes ``start_step``);
* ``num_workers > 0`` yields batches identical to ``num_workers = 0`` (no per-worker random
  state is involved), in step order;
* HDF5-backed datasets (``load_dataset(..., lazy=True)``) open their file lazily in each worker
  process; no h5py handle is pickled or shared across ``fork``.

:class:`DeviceSampler` holds a window or segment sampler's dataset as tensors on a device (the
GPU a run trains on) and gathers each batch there with torch indexing: only the batch's row
indices, drawn on the host from the same generator by the sampler's ``indices``, cross to the
device (one ``(3, B, L)`` int64 tensor per batch, non-blocking from pinned memory on CUDA), so
its batches equal the NumPy path's exactly. :meth:`StepBatchDataset.on_device` gives the
trainer's step-indexed stream of them (``train.data_on_device``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import numpy as np
import torch
from rl_tformers.envs.samplers import SampleIndex, SegmentSampler, WindowSampler
from torch.utils.data import DataLoader, Dataset


class BatchSampler(Protocol):
    """What :class:`StepBatchDataset` needs: ``sample(batch_size, rng) -> {key: array}``."""

    def sample(self, batch_size: int, rng: np.random.Generator) -> dict[str, np.ndarray]: ...


class StepBatchDataset(Dataset):
    """Map-style dataset of training batches indexed by training step.

    Args:
        sampler: a :class:`~rl_tformers.envs.samplers.WindowSampler`, :class:`SegmentSampler`
            or anything with ``sample(batch_size, rng) -> dict of arrays``.
        batch_size: B, rows per batch.
        seed: non-negative run seed.
        num_steps: number of training steps (``len(ds)``).

    ``ds[s]`` returns ``{key: torch.Tensor}`` with the sampler's shapes ((B, K, ...) etc.).

    Raises:
        IndexError: ``s`` outside ``[0, num_steps)``.
    """

    def __init__(self, sampler: BatchSampler, batch_size: int, *, seed: int, num_steps: int):
        if seed < 0 or batch_size < 1 or num_steps < 0:
            raise ValueError(f"need seed >= 0, batch_size >= 1, num_steps >= 0; got {seed}, {batch_size}, {num_steps}")
        self.sampler = sampler
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.num_steps = int(num_steps)

    def __len__(self) -> int:
        return self.num_steps

    def rng(self, step: int) -> np.random.Generator:
        """The generator of batch ``step``: ``numpy.random.default_rng([seed, step])``."""
        return np.random.default_rng([self.seed, int(step)])

    def __getitem__(self, step: int) -> dict[str, torch.Tensor]:
        if not 0 <= step < self.num_steps:
            raise IndexError(f"step {step} outside [0, {self.num_steps})")
        batch = self.sampler.sample(self.batch_size, self.rng(step))
        return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in batch.items()}

    def on_device(self, device: torch.device | str) -> DeviceStepBatches:
        """The same batches drawn by a :class:`DeviceSampler` on ``device`` (the dataset copied
        there once).

        Raises:
            TypeError: the sampler is not a :class:`WindowSampler` or :class:`SegmentSampler`.
        """
        return DeviceStepBatches(DeviceSampler(self.sampler, device), self)


class DeviceSampler:
    """A :class:`WindowSampler` or :class:`SegmentSampler` whose dataset lives on ``device``.

    At construction the dataset's columns are copied to ``device`` once (every flat row, also
    those of episodes the sampler does not draw): observations as float32 when they are floating
    point, else in their stored dtype (a pixel dataset's uint8 frames stay uint8, stacked per
    sampled step as :func:`~rl_tformers.envs.frames.stack_frames` stacks them; other integer
    observations become float32 per batch),
    actions as float32 (Box) or int64 (Discrete), rewards and returns-to-go already divided by
    ``reward_scale`` in float32, and for segments the termination and truncation flags. Per batch,
    :meth:`sample` draws the rows with the sampler's ``indices(batch_size, rng)`` on the host, sends
    them to the device as one int64 tensor and gathers there: the keys, shapes, dtypes and values
    of ``sampler.sample(batch_size, rng)``, as tensors on ``device``, with the same
    element-wise float32 arithmetic (so equal bit for bit).

    Memory: the dataset's columns at the dtypes above (a 1M-step Hopper set: about 110 MB).

    Raises:
        TypeError: ``sampler`` is not a :class:`WindowSampler` or :class:`SegmentSampler`.
    """

    def __init__(self, sampler: WindowSampler | SegmentSampler, device: torch.device | str):
        if not isinstance(sampler, (WindowSampler, SegmentSampler)):
            raise TypeError(f"a device sampler draws DT windows or GTrXL segments, not batches of a "
                            f"{type(sampler).__name__}")
        self.sampler = sampler
        self.device = torch.device(device)
        d = sampler.dataset
        obs = np.asarray(d.observations[:])  # (N, *obs_shape) every flat row (an HDF5 column is read)
        #: a pixel dataset's frames stay uint8 and are stacked per step (frame_stack k) per batch
        self.pixel = bool(getattr(d, "is_pixel", False))
        self.frame_stack = int(getattr(d, "frame_stack", 1))
        if np.issubdtype(obs.dtype, np.floating):
            obs = obs.astype(np.float32, copy=False)
        self.observations = self._put(obs)
        self.back = torch.arange(self.frame_stack - 1, -1, -1, device=self.device)  # (k,) oldest slot first
        stats = sampler.obs_stats
        self.obs_mean = None if stats is None else self._put(np.asarray(stats.mean, np.float32))
        self.obs_std = None if stats is None else self._put(np.asarray(stats.std, np.float32))
        act = np.asarray(d.actions[:])
        self.actions = self._put(act.astype(np.int64) if sampler.discrete else act.astype(np.float32, copy=False))
        rs = sampler.reward_scale
        self.rewards = self._put((np.asarray(d.rewards) / rs).astype(np.float32))  # (N,) as _gather scales them
        self.returns_to_go = self._put((sampler.rtg / rs).astype(np.float32))  # (N,)
        if isinstance(sampler, SegmentSampler):
            self.terminations = self._put(np.asarray(d.terminations, bool))
            self.truncations = self._put(np.asarray(d.truncations, bool))
            self.after_burn_in = torch.arange(sampler.length, device=self.device) >= sampler.burn_in  # (L,)

    def _put(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    def _rows(self, idx: SampleIndex) -> torch.Tensor:
        """``(3, B, L)`` int64 on the device: flat row, step in episode (-1 on padding), episode."""
        flat = idx.flat
        ep = idx.episode if idx.episode.ndim == 2 else np.broadcast_to(idx.episode[:, None], flat.shape)
        packed = torch.from_numpy(np.stack([flat, np.where(idx.mask, idx.steps, -1), ep]).astype(np.int64))
        if self.device.type == "cuda":
            return packed.pin_memory().to(self.device, non_blocking=True)
        return packed.to(self.device)

    def sample(self, batch_size: int, rng: np.random.Generator) -> dict[str, torch.Tensor]:
        """One batch, drawn from ``rng`` exactly as ``sampler.sample(batch_size, rng)``, as
        tensors on the device (see the sampler for the keys and shapes)."""
        rows = self._rows(self.sampler.indices(batch_size, rng))
        flat, steps, ep = rows[0], rows[1], rows[2]  # (B, L) each
        mask = steps >= 0  # (B, L)
        m = mask.to(torch.float32)
        if self.pixel:
            obs = self._frames(flat, steps)  # (B, L, k*C, H, W) uint8
        else:
            obs = self.observations[flat].to(torch.float32)  # (B, L, *obs_shape)
            if self.obs_mean is not None:
                obs = (obs - self.obs_mean) / self.obs_std
            obs = obs * m.view(*m.shape, *(1,) * (obs.dim() - 2))
        act = self.actions[flat]  # (B, L) int64 or (B, L, *act_shape) float32
        act = act * mask if self.sampler.discrete else act * m.view(*m.shape, *(1,) * (act.dim() - 2))
        out = {
            "observations": obs,
            "actions": act,
            "rewards": self.rewards[flat] * m,
            "returns_to_go": self.returns_to_go[flat] * m,
            "timesteps": steps.clamp_min(0),
            "mask": mask,
        }
        if isinstance(self.sampler, WindowSampler):
            out["episode"] = ep[:, 0]
            return out
        out["episode_start"] = steps == 0
        out["terminations"] = self.terminations[flat] & mask
        out["truncations"] = self.truncations[flat] & mask
        out["loss_mask"] = mask & self.after_burn_in
        out["episode"] = torch.where(mask, ep, -1)
        return out


    def _frames(self, flat: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """:func:`~rl_tformers.envs.frames.stack_frames` on the device: flat, steps ``(B, L)``
        (steps -1 on padding) -> ``(B, L, k * C, H, W)`` uint8, zeros before the episode start
        and on padding."""
        valid = steps[..., None] >= self.back  # (B, L, k); False on padding (step -1)
        rows = torch.where(valid, flat[..., None] - self.back, flat[..., None])  # (B, L, k)
        frames = self.observations[rows]  # (B, L, k, C, H, W)
        frames = frames * valid.view(*valid.shape, *(1,) * (frames.dim() - 3)).to(frames.dtype)
        return frames.reshape(*rows.shape[:2], -1, *frames.shape[4:])  # (B, L, k*C, H, W)


class DeviceStepBatches:
    """Training batches of a :class:`StepBatchDataset` drawn by a :class:`DeviceSampler`:
    ``batches[s]`` is batch ``s`` of the dataset (same generator ``default_rng([seed, s])``), as
    tensors on the device; :meth:`iter_from` yields the steps from ``start`` on. Not a torch
    ``Dataset``: no DataLoader (nor worker) reads it.

    Raises:
        IndexError: ``s`` outside ``[0, num_steps)``.
    """

    def __init__(self, sampler: DeviceSampler, steps: StepBatchDataset):
        self.sampler = sampler
        self.steps = steps

    def __len__(self) -> int:
        return self.steps.num_steps

    def __getitem__(self, step: int) -> dict[str, torch.Tensor]:
        if not 0 <= step < self.steps.num_steps:
            raise IndexError(f"step {step} outside [0, {self.steps.num_steps})")
        return self.sampler.sample(self.steps.batch_size, self.steps.rng(step))

    def iter_from(self, start: int) -> Iterator[dict[str, torch.Tensor]]:
        """Batches ``start, start + 1, ..., num_steps - 1``."""
        return (self[s] for s in range(start, self.steps.num_steps))


def _worker_init(_worker_id: int) -> None:
    torch.set_num_threads(1)


def make_dataloader(
    sampler: BatchSampler,
    batch_size: int,
    *,
    seed: int,
    num_steps: int,
    start_step: int = 0,
    num_workers: int = 0,
    pin_memory: bool = False,
    prefetch_factor: int | None = None,
) -> DataLoader:
    """DataLoader over training steps ``start_step, ..., num_steps - 1`` (one batch per step).

    Auto-batching is off (``batch_size=None``): each item already is a batch. Workers are
    started with one torch thread each. Batches are identical for any ``num_workers``.

    Raises:
        ValueError: ``start_step`` outside ``[0, num_steps]`` (a resume past the end would
            otherwise yield no batch, a negative one fail at the first batch), and the
            arguments :class:`StepBatchDataset` refuses.
    """
    if not 0 <= start_step <= num_steps:
        raise ValueError(f"start_step must be in [0, num_steps={num_steps}], got {start_step}")
    ds = StepBatchDataset(sampler, batch_size, seed=seed, num_steps=num_steps)
    kwargs = {}
    if num_workers > 0:
        kwargs["worker_init_fn"] = _worker_init
        if prefetch_factor is not None:
            kwargs["prefetch_factor"] = prefetch_factor
    return DataLoader(ds, batch_size=None, sampler=range(start_step, num_steps), num_workers=num_workers,
                      pin_memory=pin_memory, **kwargs)
