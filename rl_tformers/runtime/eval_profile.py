"""Where the wall time of an evaluation goes: named spans, recorded only while a profile is active.

The evaluation loop (:mod:`rl_tformers.runtime.evaluation`) and the policies' ``act`` wrap their
parts in :func:`span`: ``env`` (stepping and resetting the environments), ``context`` (building
the model's input tensors: a DT's context window, GTrXL's tokens, BC's normalised observations),
``forward`` (the model's forward pass and the choice of the action in model units) and
``decode`` (the action mapped to the environment's space and copied to the host). What is not in
a span is the loop's Python bookkeeping (:meth:`EvalProfile.split`).

Off (no :func:`profiling` block active) a span is one global lookup and a shared do-nothing
context manager: no clock read, no tensor, no host-device synchronisation. On, each span reads
``time.perf_counter`` at both ends, synchronises the CUDA device first when the profile was
opened with ``sync=True`` (so that asynchronous kernels are charged to the span that launched
them) and opens a :func:`torch.profiler.record_function` range of the same name, so a
``torch.profiler`` trace taken around the evaluation shows the same parts.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

#: the parts of an evaluation step, in the order they are reported
PARTS = ("forward", "context", "env", "decode")


class EvalProfile:
    """Wall seconds spent in each span since the profile was opened.

    Args:
        sync: synchronise the current CUDA device at both ends of every span (only when CUDA
            is initialised; a CPU evaluation never synchronises).

    Attributes:
        seconds: {span name: wall seconds}, summed over every entry into the span.
        calls: {span name: number of entries}.
        total: wall seconds between :func:`profiling`'s start and end (set at the end).
    """

    def __init__(self, sync: bool = True) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(PARTS, 0.0)
        self.calls: dict[str, int] = dict.fromkeys(PARTS, 0)
        self.total = 0.0
        self._sync = bool(sync) and torch.cuda.is_available() and torch.cuda.is_initialized()

    def _barrier(self) -> None:
        if self._sync:
            torch.cuda.synchronize()

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        """Time the block under ``name`` (see the module docstring)."""
        self._barrier()
        t0 = time.perf_counter()
        try:
            with torch.profiler.record_function(name):
                yield
                self._barrier()
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
            self.calls[name] = self.calls.get(name, 0) + 1

    def split(self) -> dict[str, Any]:
        """``{"total_s", "<part>_s" for every part, "bookkeeping_s", "<part>_frac", "bookkeeping_frac"}``:
        seconds per part and their fractions of ``total``; bookkeeping is the rest of the wall time."""
        out: dict[str, Any] = {"total_s": self.total}
        for name in PARTS:
            out[f"{name}_s"] = self.seconds.get(name, 0.0)
        out["bookkeeping_s"] = max(0.0, self.total - sum(self.seconds.get(p, 0.0) for p in PARTS))
        for name in (*PARTS, "bookkeeping"):
            out[f"{name}_frac"] = out[f"{name}_s"] / self.total if self.total > 0 else 0.0
        return out


class _Off:
    """The span of an inactive profile: enters and leaves doing nothing."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_OFF = _Off()
_active: EvalProfile | None = None


def span(name: str) -> Any:
    """A context manager timing its block under ``name`` in the active profile, or doing nothing
    when no :func:`profiling` block is active (the default)."""
    return _OFF if _active is None else _active.span(name)


@contextlib.contextmanager
def profiling(sync: bool = True) -> Iterator[EvalProfile]:
    """Record the spans of the block into a new :class:`EvalProfile` (yielded; its ``total`` is
    the block's wall time). Profiles do not nest: an inner block records into its own profile
    and the outer one resumes after it."""
    global _active
    outer, prof = _active, EvalProfile(sync)
    _active = prof
    t0 = time.perf_counter()
    try:
        yield prof
    finally:
        prof.total = time.perf_counter() - t0
        _active = outer
