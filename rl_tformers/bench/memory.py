"""Peak-memory measurement shared by the benchmarks (CPU and CUDA).

- CUDA: ``torch.cuda.max_memory_allocated`` above what was allocated before the call.
- CPU: the PyTorch profiler's allocation events (``profile_memory=True``): every allocation
  and free made through PyTorch's CPU allocator while the function runs, in time order; the
  peak of the running sum is the peak memory the call added (activations, saved tensors,
  workspaces, gradients). Tensors freed by Python's garbage collector later than the call are
  counted as live, which is what a training step sees. Returns None when the installed
  PyTorch does not expose the events (not a stable public API).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile


@contextlib.contextmanager
def _stderr_silenced() -> Iterator[None]:
    """Send file descriptor 2 to /dev/null inside the block (C++ code writes there directly)."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


@contextlib.contextmanager
def quiet_profile(**kwargs: Any) -> Iterator[Any]:
    """``torch.profiler.profile(**kwargs)`` without Kineto's ``USDT: ... profiler_start`` /
    ``profiler_stop`` lines on stderr: only the profiler's own start and stop calls run with
    stderr silenced, so messages of the profiled code still reach the terminal."""

    prof = profile(**kwargs)
    with _stderr_silenced():
        prof.start()
    try:
        yield prof
    finally:
        with _stderr_silenced():
            prof.stop()


def cpu_peak_bytes(fn: Callable[[], Any]) -> int | None:
    """Peak of (allocated - freed) CPU bytes while ``fn()`` runs (profiler memory events)."""

    with quiet_profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    try:
        events = prof.profiler.kineto_results.events()
        mem = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    except AttributeError:
        return None
    cur = peak = 0
    for _, nbytes in mem:  # positive = allocation, negative = free
        cur += nbytes
        peak = max(peak, cur)
    return peak


def peak_bytes(fn: Callable[[], Any], device: torch.device) -> int | None:
    """Peak memory (bytes) ``fn()`` adds on ``device`` (see the module docstring)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    return cpu_peak_bytes(fn)
