"""Stop signals for long collection runs: SIGINT/SIGTERM inside :func:`stop_signals` are recorded
and :func:`check_stop` raises ``KeyboardInterrupt`` at the next safe point (between environment
steps); a second signal raises at once."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class _StopRequests:
    """The stop-signal handler of :func:`stop_signals`: records signals; a second one raises."""

    def __init__(self) -> None:
        self.received: list[int] = []

    def __call__(self, signum: int, frame: Any) -> None:
        self.received.append(signum)
        if len(self.received) > 1:  # asked twice: stop now, wherever the process is
            raise KeyboardInterrupt


_STOP: _StopRequests | None = None


def check_stop() -> None:
    """Raise ``KeyboardInterrupt`` at this safe point (between environment steps) when a stop
    signal has arrived inside :func:`stop_signals`; otherwise do nothing."""
    if _STOP is not None and _STOP.received:
        raise KeyboardInterrupt


@contextmanager
def stop_signals() -> Iterator[list[int]]:
    """SIGINT, SIGTERM and SIGHUP stop a build at its next environment step (``rl-tformers collect``).

    Python's defaults are unsafe here: SIGTERM/SIGHUP end the process without running ``finally``
    blocks (leaving a half-written dataset folder behind), and the ``KeyboardInterrupt`` of SIGINT
    can land inside a garbage-collection callback, where Python prints and drops it and the
    collection goes on. Here a
    signal is only recorded, and the rollout loops (:func:`collect`, :func:`train_and_record`
    through an SB3 callback) raise ``KeyboardInterrupt`` at their next step, from where the
    build's cleanup runs; a dataset already complete is kept. A second signal raises at once.
    Yields the list of received signal numbers. Outside the main thread: a no-op.
    """
    global _STOP
    if threading.current_thread() is not threading.main_thread() or _STOP is not None:
        yield [] if _STOP is None else _STOP.received
        return
    handler = _StopRequests()
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    _STOP = handler
    try:
        yield handler.received
    finally:
        _STOP = None
        for s, h in previous.items():
            signal.signal(s, h)
