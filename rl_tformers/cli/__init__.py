"""Command line: ``rl-tformers <command> [options] [key=value overrides]``.

Built with Typer (click underneath): typed options, ``--help`` on every command, shell-safe
parsing. Configs are YAML files merged with dotted ``key=value`` overrides by OmegaConf (see
``rl_tformers.runtime.run_config``).

Each command group lives in its own module and registers itself here through a
``register(app)`` function, so the command surface is assembled from the packages that own
the logic (training in ``runtime``, datasets in ``envs``, agents' eval/plot in ``agents``...).
Modules listed in ``COMMAND_MODULES`` that are not present yet are skipped.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from pathlib import Path

import typer
from typer.core import TyperGroup

from rl_tformers.runtime.host import retain_freed_memory

#: Exit status of bad input (arguments, configs, datasets, files): one ``error: ...`` line on
#: stderr names what is at fault. A failure inside the computation exits 1.
BAD_INPUT = 2


#: click's exception classes, as the click that Typer runs on raises them (Typer >= 0.29 ships its
#: own copy of click, whose classes are not those of the ``click`` package)
_CLICK_ERRORS = sys.modules[typer.BadParameter.__module__]
ClickException = _CLICK_ERRORS.ClickException
UsageError = _CLICK_ERRORS.UsageError
_HELP_REQUESTS = tuple(c for c in (getattr(_CLICK_ERRORS, "NoArgsIsHelpError", None),) if c is not None)


def usage_error_line(exc: ClickException) -> str:
    """A click usage error (unknown option, missing argument, ``typer.BadParameter``...) as one
    ``error: ...`` line: click's message, then the ``--help`` of the command it concerns."""
    text = " ".join(exc.format_message().split())  # one line: click may wrap or break it
    ctx = getattr(exc, "ctx", None)
    if isinstance(exc, UsageError) and ctx is not None:
        text += f" (see: {ctx.command_path} --help)"
    return f"error: {text}"


class OneLineErrors(TyperGroup):
    """The root command group: a click usage error of any command (parsing, a parameter
    callback, a ``typer.BadParameter`` raised by a command) prints one ``error: ...`` line on
    stderr (:func:`usage_error_line`) and exits with click's status (2 for a usage error), in
    place of click's usage block and boxed message. ``no_args_is_help`` still prints the help."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except ClickException as exc:
            raise _as_exit(exc) from None

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except ClickException as exc:
            raise _as_exit(exc) from None


def _as_exit(exc: ClickException) -> BaseException:
    """Print ``exc`` as one line and return the ``typer.Exit`` of its status; a request for
    help (a command given without its arguments) is returned unchanged."""
    if isinstance(exc, _HELP_REQUESTS):
        return exc
    typer.echo(usage_error_line(exc), err=True)
    return typer.Exit(exc.exit_code)


app = typer.Typer(
    cls=OneLineErrors,
    name="rl-tformers",
    help="Offline RL with Transformers: Decision Transformer and GTrXL on a swappable backbone library.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

#: Modules that own a part of the command line; each defines ``register(app: typer.Typer)``.
COMMAND_MODULES = (
    "rl_tformers.cli.train",  # train, sweep
    "rl_tformers.cli.evaluate",  # eval, plot, demo
    "rl_tformers.cli.data",  # collect, dataset
    "rl_tformers.cli.backbones",  # backbones
    "rl_tformers.cli.agents",  # agents
    "rl_tformers.cli.configs",  # configs
    "rl_tformers.cli.bench",  # bench
    "rl_tformers.cli.export",  # export
)


@app.callback()
def _root() -> None:
    """Offline RL with Transformers: Decision Transformer and GTrXL on a swappable backbone library."""


def _register_all() -> None:
    for name in COMMAND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and name.startswith(exc.name):
                continue  # that part of the CLI has not landed
            raise
        mod.register(app)


def readable_int(n: int) -> str:
    """An integer bound as people read it: ``2**64 - 1`` -> ``"2**64-1"``, ``2**32`` -> ``"2**32"``
    (a power of two, or one less, of at least 2**16); any other integer in decimal."""
    if n >= 2**16 and (n + 1) & n == 0:  # n + 1 is a power of two
        return f"2**{n.bit_length()}-1"
    if n >= 2**16 and n & (n - 1) == 0:
        return f"2**{n.bit_length() - 1}"
    return str(n)


#: An option whose upper bound is at least this gets it shown readably (:func:`_readable_ranges`).
BIG_BOUND = 2**31


def _parameter_infos(fn) -> list:
    """The Typer ``OptionInfo`` / ``ArgumentInfo`` objects of a command function's parameters
    (a default ``typer.Option(...)``, or one inside ``Annotated[...]``)."""
    import inspect

    from typer.models import ParameterInfo

    out = []
    for p in inspect.signature(fn).parameters.values():
        found = [p.default] + list(getattr(p.annotation, "__metadata__", ()))
        out += [x for x in found if isinstance(x, ParameterInfo)]
    return out


def _readable_ranges(typer_app: typer.Typer) -> None:
    """Show a huge integer upper bound readably in ``--help`` and in the error beyond it.

    Typer writes an option such as ``--seed`` with ``min=0, max=2**64 - 1`` as
    ``[0<=x<=18446744073709551615]`` and refuses a larger value with that number. For every
    option or argument of every command (sub-groups included) whose ``max`` is at least
    :data:`BIG_BOUND` and that has no callback of its own, the bound moves out of Typer's range
    into the help text (``At most 2**64-1.``; the range shown is ``x>=0``) and into a callback
    that refuses a larger value (``... is larger than 2**64-1 = 18446744073709551615, the
    largest value --seed takes``): the values accepted are the same.
    """
    for info in typer_app.registered_commands:
        if info.callback is None:
            continue
        for param in _parameter_infos(info.callback):
            big = getattr(param, "max", None)
            if not isinstance(big, int) or isinstance(big, bool) or big < BIG_BOUND or param.callback is not None:
                continue
            bound = readable_int(big)
            param.max = None
            param.help = f"{(param.help or '').rstrip()} At most {bound}.".lstrip()
            param.callback = _at_most(big, bound)
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            _readable_ranges(group.typer_instance)


def _at_most(limit: int, text: str):
    """A Typer parameter callback refusing values above ``limit`` (``text``: how it is written)."""

    def check(ctx: typer.Context, param: typer.CallbackParam, value):
        values = value if isinstance(value, (list, tuple)) else [value]
        for v in values:
            if v is not None and v > limit:
                name = (param.opts or [param.name])[0] if param is not None else "it"
                exact = f" = {limit}" if text != str(limit) else ""
                raise typer.BadParameter(f"{v} is larger than {text}{exact}, the largest value {name} takes")
        return value

    return check


_register_all()
_readable_ranges(app)


def _our_dirs() -> tuple[str, ...]:
    import rl_tformers
    import rl_tformers.agents
    import rl_tformers.envs

    return tuple(str(Path(d).resolve()) + os.sep
                 for m in (rl_tformers, rl_tformers.agents, rl_tformers.envs) for d in m.__path__)


def short_warnings() -> None:
    """Print the package's own warnings as one ``warning: MESSAGE`` line on stderr (no source
    file, line number or source text, which only help a developer); third-party warnings keep
    Python's format."""
    import warnings

    ours, plain = _our_dirs(), warnings.formatwarning

    def fmt(message, category, filename, lineno, line=None):
        if str(Path(filename).resolve()).startswith(ours):
            return f"warning: {message}\n"
        return plain(message, category, filename, lineno, line)

    warnings.formatwarning = fmt


def _run_finished() -> bool:
    """True once a ``train`` command of this process saved a complete run."""
    import sys

    train_commands = sys.modules.get("rl_tformers.cli.train")  # loaded only by commands that train
    return train_commands is not None and train_commands.finished_run()


def _interrupt_unless_finished(signum, frame) -> None:
    """SIGINT handler of the console script: Python's KeyboardInterrupt, except once a ``train``
    command has saved a complete run (the summary, then the interpreter's shutdown of torch and
    the environments: up to a second), when a Ctrl-C changes nothing and the exit status stays 0
    rather than 130."""
    if not _run_finished():
        raise KeyboardInterrupt


def _env_int(name: str) -> int:
    try:
        return int(os.environ.get(name) or 0)
    except ValueError:
        return 0


def main() -> None:
    import signal

    short_warnings()
    retain_freed_memory()  # activations freed on every call are served again without page faults
    # installed before the command runs, so no moment exists between "the run is saved" and
    # "a Ctrl-C is ignored" in which the default handler could still end the process
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupt_unless_finished)
    try:
        app()
    except (SystemExit, Exception) as exc:
        if _env_int("WORLD_SIZE") > 1:  # a torchrun rank: end it without the interpreter's shutdown
            from rl_tformers.runtime.distributed import exit_rank  # imported already by the rank's command

            if not isinstance(exc, SystemExit):
                traceback.print_exc()  # as Python prints an uncaught exception; its status is 1
            exit_rank(exc.code if isinstance(exc, SystemExit) else 1)
        raise
    finally:
        if _run_finished():  # the interpreter's shutdown resets Python-level handlers; SIG_IGN survives it
            signal.signal(signal.SIGINT, signal.SIG_IGN)


if __name__ == "__main__":
    main()
