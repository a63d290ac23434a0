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
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
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
