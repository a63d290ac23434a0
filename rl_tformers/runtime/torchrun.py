"""``python -m rl_tformers.runtime.torchrun ARGS``: PyTorch's ``torchrun`` (``torch.distributed.run``,
same arguments) as ``rl-tformers train --nproc N`` starts it, with plain exits instead of
torchrun's tracebacks, and a shutdown on SIGINT/SIGTERM that never interrupts a rank's start-up
with a traceback nor leaves a rank running.

Exit status. torchrun reports every failed worker with a Python traceback of its own
(``ChildFailedError``) and a stop by SIGINT/SIGTERM with another (``SignalException``). Here
the ranks have already said what went wrong (rank 0 prints a bad input's ``error: ...`` line;
the launcher reports a stop), so:

- a worker that exited with status 2 (bad input, reported by rank 0) first: exit 2, nothing more;
- any other first failure: one ``error:`` line naming the rank and its exit status or signal
  (its own traceback is above it), exit 1 as torchrun does;
- SIGINT/SIGTERM: exit 128 + the number of the first one, once every rank has exited.

Signals. The launcher (:func:`rl_tformers.cli.train._launch_torchrun`) starts this
process in a session of its own with SIGINT/SIGTERM blocked, and forwards each one it receives
(a terminal's Ctrl-C reaches the launcher only). Here:

- This module handles SIGINT/SIGTERM instead of torchrun's own handler (torchrun keeps SIGHUP
  and SIGQUIT). The first one starts torchrun's shutdown: it sends the signal to every rank
  (a rank still starting up stops at once; a training rank saves at its next update boundary
  and stops: :class:`~rl_tformers.runtime.trainer.GracefulInterrupt`) and waits for all of them,
  at most ``SHUTDOWN_TIMEOUT_S`` (then SIGKILL). The second one starts torchrun's second
  shutdown: SIGTERM to the ranks still running, which abort at once, and the same wait. Later
  ones change nothing: returning then would leave ranks running, unseen.
- The ranks start with SIGINT/SIGTERM blocked (this thread keeps them blocked, and child
  processes inherit the mask): a signal sent while a rank imports torch waits, pending, until
  ``rl-tformers train`` has its handler in place, instead of raising ``KeyboardInterrupt``
  inside an import. This process receives them in a helper thread, which alone leaves them
  unblocked; Python runs the handler in the main thread all the same.

torchrun's own log lines (``Received 2 death signal...``, ``Sending process N closing
signal...``, ``failed (exitcode: 2)``) are silenced. ``torchrun ... -m rl_tformers.cli train ...`` by hand still works
and prints what torchrun prints.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Any

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

#: The signals this module handles (torchrun handles the others it is told to).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: Seconds torchrun waits for the ranks after each shutdown signal before it SIGKILLs them (a
#: graceful stop waits for a running evaluation); torchrun's ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``
#: or ``--shutdown-timeout``, when set, take precedence.
SHUTDOWN_TIMEOUT_S = 300


def _describe(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with status {exitcode}"


class StopRequests:
    """The SIGINT/SIGTERM handler of this process (see the module docstring).

    Args:
        exception: what to raise for the first two signals: torchrun's ``SignalException``
            (called as ``exception(message, sigval=signal.Signals)``), which makes torchrun shut
            its ranks down.

    Attributes:
        received: the signals received, in order.
    """

    def __init__(self, exception: Any) -> None:
        self.exception = exception
        self.received: list[int] = []

    def __call__(self, signum: int, frame: Any) -> None:
        self.received.append(signum)
        if len(self.received) <= 2:
            raise self.exception(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))


def _receive_in_helper_thread() -> None:
    """Block SIGINT/SIGTERM in this (main) thread, which torchrun starts the ranks from, and
    receive them in a daemon thread instead (no-op without ``pthread_sigmask``)."""
    if not hasattr(signal, "pthread_sigmask"):
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)

    def receive() -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # a pending signal is delivered here
        threading.Event().wait()

    threading.Thread(target=receive, name="rl-tformers-signals", daemon=True).start()


def _with_our_settings(args: Any) -> Any:
    """torchrun's parsed arguments with SIGINT/SIGTERM left to this module and our shutdown
    timeout (arguments a torchrun version does not have are left alone)."""
    if hasattr(args, "signals_to_handle"):
        names = [n.strip() for n in str(args.signals_to_handle).split(",")]
        args.signals_to_handle = ",".join(n for n in names if n and n not in ("SIGINT", "SIGTERM"))
    if getattr(args, "shutdown_timeout", 0) is None and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in os.environ:
        args.shutdown_timeout = SHUTDOWN_TIMEOUT_S
    return args


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with ``argv``; returns the exit status described in the module docstring."""

    logging.disable(logging.ERROR)  # this process only runs torchrun: its log lines (the ranks are other processes)
    stops = StopRequests(SignalException)
    try:
        for s in STOP_SIGNALS:
            signal.signal(s, stops)
        _receive_in_helper_thread()
        run(_with_our_settings(parse_args(sys.argv[1:] if argv is None else argv)))
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        if failure.exitcode == 2:
            return 2
        print(f"error: rank {rank} {_describe(failure.exitcode)} (its output is above)", file=sys.stderr)
        return 1
    except SignalException as exc:
        return 128 + int(stops.received[0] if stops.received else exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
