"""Turning an agent's ``batches(start_step)`` into the stream of batches the trainer consumes."""

from __future__ import annotations

import signal
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler


class StepSampler(Sampler[int]):
    """Yields the update indices ``start, start + 1, ..., stop - 1`` (one index = one whole batch)."""

    def __init__(self, start: int, stop: int) -> None:
        if not 0 <= start <= stop:
            raise ValueError(f"StepSampler needs 0 <= start <= stop, got {start}, {stop}")
        self.start, self.stop = start, stop

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.stop))

    def __len__(self) -> int:
        return self.stop - self.start


def _worker_init(worker_id: int) -> None:
    # Ctrl-C reaches the whole process group; only the main process handles it (it saves a
    # checkpoint and shuts the workers down). Without this a worker dies on SIGINT/SIGTERM
    # and the DataLoader raises in the middle of the save.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def batch_stream(
    source: Dataset | Iterable[Any], start: int, stop: int, num_workers: int = 0, pin_memory: bool = False
) -> Iterable[Any]:
    """An iterable of the batches for updates ``start .. stop - 1``.

    Args:
        source: what the agent's ``batches(start)`` returned: a step-indexed ``Dataset``
            (read through a DataLoader with :class:`StepSampler`, ``batch_size=None``) or any
            iterable already positioned at ``start``.
        start, stop: update indices.
        num_workers: DataLoader worker processes (Dataset sources only; iterables ignore it).
        pin_memory: pin host memory for faster copies to CUDA.

    The DataLoader gets its own ``torch.Generator``, so creating it does not consume the global
    torch RNG (which must stay exactly where a resumed checkpoint put it).
    """
    if isinstance(source, Dataset):
        return DataLoader(
            source,
            batch_size=None,
            sampler=StepSampler(start, stop),
            num_workers=num_workers,
            pin_memory=pin_memory,
            worker_init_fn=_worker_init if num_workers > 0 else None,
            generator=torch.Generator(),
        )
    if isinstance(source, Iterable):
        return source
    raise TypeError(
        f"batches(start_step) must return a torch.utils.data.Dataset or an iterable, got {type(source).__name__}"
    )
