"""Progress of long commands (``rl-tformers train``, ``rl-tformers collect``): a redrawn tqdm bar
on a terminal, plain lines elsewhere.

A tqdm bar redraws itself with carriage returns; written to a file (``nohup rl-tformers train
... > log``, a batch job's output, a sweep's run log) every redraw stays in it as a fragment
of one endless line. So :func:`progress_bar` draws the bar only when its stream is a terminal
and otherwise prints one ordinary line every :data:`PLAIN_INTERVAL_S` seconds or every
:data:`PLAIN_FRACTION` of the run, whichever comes first, and one at the end
(``train: 1200/5000 steps (24%), 41.3 steps/s, elapsed 29s, about 1m32s left, loss=0.0312``).

No heavy imports: tqdm is imported only for a terminal.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import IO, Any

from tqdm.auto import tqdm

#: Most seconds between two plain progress lines (when the stream is not a terminal).
PLAIN_INTERVAL_S = 10.0

#: Most progress, as a fraction of the total count, between two plain progress lines (5%:
#: about 20 lines over a run of known length, however fast it runs).
PLAIN_FRACTION = 0.05


def is_terminal(stream: Any) -> bool:
    """True if ``stream`` is an open interactive terminal (False for files, pipes, closed streams)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def _duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``."""
    s = int(round(max(seconds, 0.0)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class PlainProgress:
    """A progress report in plain lines, with the part of tqdm's interface the commands use
    (``update``, ``set_postfix``, ``close``, ``n``, ``disable``).

    A line is printed when :meth:`update` finds ``interval_s`` seconds passed since the last one
    or the count advanced by ``fraction`` of ``total`` (rounded up to a whole unit) since it,
    whichever comes first, and by :meth:`close` when the count moved since the last line (so a
    run of unknown length shorter than the interval prints one line, at its end). Nothing is
    printed when ``disable`` is True.

    Args:
        total: the count at completion (None: unknown; no percentage or time left; a count past
            it is shown alone).
        initial: the count at the start (a resumed run's step); rates count from it.
        desc: the line's prefix (``train``, a dataset id).
        unit: what is counted (``step``).
        file: the stream (default ``sys.stderr`` at the time of the call).
        interval_s: most seconds between two lines (default :data:`PLAIN_INTERVAL_S`).
        fraction: most progress between two lines, a fraction of ``total`` (default
            :data:`PLAIN_FRACTION`; not used when ``total`` is unknown).
        disable: print nothing.
        clock: the time source, in seconds (default ``time.monotonic``).
        echo: where the lines go instead of ``file`` (a command's ``echo``), when given.
    """

    def __init__(self, total: int | None = None, *, initial: int = 0, desc: str = "", unit: str = "step",
                 file: IO[str] | None = None, interval_s: float | None = None, fraction: float | None = None,
                 disable: bool = False, clock: Callable[[], float] = time.monotonic,
                 echo: Callable[[str], None] | None = None) -> None:
        self.total = total
        self.n = self._start = self._printed = int(initial)
        self.desc, self.unit = desc, unit
        self.file = file
        self.interval_s = PLAIN_INTERVAL_S if interval_s is None else float(interval_s)
        share = PLAIN_FRACTION if fraction is None else float(fraction)
        #: count between two lines (None: by time only)
        self.every = max(1, math.ceil(share * total)) if total and share > 0 else None
        self.disable = disable
        self.postfix: dict[str, Any] = {}
        self.postfix_str = ""
        self._postfix_at = self.n  # the count when the postfix was set (its values are from then)
        self._echo = echo
        self._clock = clock
        self._t0 = self._last = clock()
        self._closed = False

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.disable:
            return
        now = self._clock()
        if now - self._last >= self.interval_s or (self.every is not None and self.n - self._printed >= self.every):
            self._print(now)

    def set_postfix(self, ordered_dict: dict[str, Any] | None = None, refresh: bool = True, **kwargs: Any) -> None:
        """Values shown at the end of the next line (``loss=0.0312``); ``refresh`` is ignored."""
        self.postfix = {**(ordered_dict or {}), **kwargs}
        self._postfix_at = self.n

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        """Text shown at the end of the next line, after the ``set_postfix`` values (``running:
        ...``); ``refresh`` is ignored."""
        self.postfix_str = str(s)

    def poll(self) -> None:
        """Print a line if ``interval_s`` seconds passed since the last one (for a caller that
        waits between updates, such as a sweep waiting on its runs)."""
        if not self.disable and not self._closed:
            now = self._clock()
            if now - self._last >= self.interval_s:
                self._print(now)

    def close(self) -> None:
        if not self.disable and not self._closed and self.n != self._printed:
            self._print(self._clock())
        self._closed = True

    def line(self, now: float | None = None) -> str:
        """The progress line at ``now`` (a time of the clock; default: now)."""
        now = self._clock() if now is None else now
        elapsed = now - self._t0
        units = f"{self.unit}s"
        known = bool(self.total) and self.n <= self.total  # (SB3 may run past the steps asked for)
        text = f"{self.n}/{self.total} {units} ({100.0 * self.n / self.total:.0f}%)" if known else f"{self.n} {units}"
        done = self.n - self._start
        rate = done / elapsed if elapsed > 0 else 0.0
        if done > 0 and elapsed > 0:
            text += f", {rate:.3g} {units}/s"
        text += f", elapsed {_duration(elapsed)}"
        if self.total and rate > 0 and self.n < self.total:
            text += f", about {_duration((self.total - self.n) / rate)} left"
        if self.postfix:
            text += ", " + ", ".join(f"{k}={v}" for k, v in self.postfix.items())
            if self._postfix_at != self.n:  # e.g. the line printed on an interrupt, between two logs
                text += f" (as of {self.unit} {self._postfix_at})"
        if self.postfix_str:
            text += ", " + self.postfix_str
        return f"{self.desc}: {text}" if self.desc else text

    def _print(self, now: float) -> None:
        self._last, self._printed = now, self.n
        stream = self.file if self.file is not None else sys.stderr
        try:
            if self._echo is not None:
                self._echo(self.line(now))
            else:
                print(self.line(now), file=stream, flush=True)
        except (OSError, ValueError):  # a closed or broken stream: progress is not worth failing for
            pass

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def progress_bar(total: int | None, *, initial: int = 0, desc: str = "", unit: str = "step",
                 enabled: bool = True, file: IO[str] | None = None, **tqdm_options: Any) -> Any:
    """A tqdm bar when ``file`` (default ``sys.stderr``) is a terminal, else a :class:`PlainProgress`
    (plain lines, no carriage returns); a disabled :class:`PlainProgress` when not ``enabled``.

    ``tqdm_options`` go to tqdm only (``dynamic_ncols``, ``mininterval``, ``smoothing``...).
    """
    stream = sys.stderr if file is None else file
    if not enabled or not is_terminal(stream):
        return PlainProgress(total, initial=initial, desc=desc, unit=unit, file=stream, disable=not enabled)

    return tqdm(total=total, initial=initial, desc=desc or None, unit=unit, file=stream, **tqdm_options)
