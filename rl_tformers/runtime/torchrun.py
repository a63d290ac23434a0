"""``python -m rl_tformers.runtime.torchrun ARGS``: PyTorch's ``torchrun`` (``torch.distributed.run``,
same arguments) as ``rl-tformers train --nproc N`` starts it, with plain exits instead of
torchrun's tracebacks.

torchrun reports every failed worker with a Python traceback of its own (``ChildFailedError``)
and a stop by SIGINT/SIGTERM with another (``SignalException``). Here the ranks have already
said what went wrong (rank 0 prints a bad input's ``error: ...`` line; a stop prints where the
checkpoint is), so:

- a worker that exited with status 2 (bad input, reported by rank 0) first: exit 2, nothing more;
- any other first failure: one ``error:`` line naming the rank and its exit status or signal
  (its own traceback is above it), exit 1 as torchrun does;
- SIGINT/SIGTERM: torchrun forwards the signal to every rank (each saves and stops), then exit
  128 + the signal number.

torchrun's own log lines (``Received 2 death signal...``, ``Sending process N closing
signal...``, ``failed (exitcode: 2)``) are silenced. ``torchrun ... -m rl_tformers.cli train ...`` by hand still works
and prints what torchrun prints.
"""

from __future__ import annotations

import logging
import signal
import sys


def _describe(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with status {exitcode}"


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with ``argv``; returns the exit status described in the module docstring."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    logging.disable(logging.ERROR)  # this process only runs torchrun: its log lines (the ranks are other processes)
    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        if failure.exitcode == 2:
            return 2
        print(f"error: rank {rank} {_describe(failure.exitcode)} (its output is above)", file=sys.stderr)
        return 1
    except SignalException as exc:
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
