"""``rl-tformers train``: start or resume a run (one process, or N data-parallel processes with
``--nproc``); ``rl-tformers sweep``: many runs over a grid (:mod:`rl_tformers.runtime.sweep`).

Heavy imports (torch, tensorboard, agents) happen inside the command, so ``rl-tformers --help``
stays fast.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import typer

from rl_tformers.cli.errors import fail

#: set once a ``train`` command of this process has saved a complete run: the console script
#: (:func:`rl_tformers.cli.main`) then ignores SIGINT while the interpreter shuts down
_FINISHED_RUN = False


class finished_run_signals:
    """While the summary of a complete run is printed, SIGINT and SIGTERM are recorded and
    ignored (the run is saved and complete, so the command still exits 0: a Ctrl-C just after
    the last update does not end it with status 130 as if the run had been cut short); the
    previous handlers come back on exit, and :func:`finished_run` turns true."""

    def __enter__(self) -> finished_run_signals:
        global _FINISHED_RUN
        _FINISHED_RUN = True
        self.saved = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self.saved[sig] = signal.signal(sig, lambda signum, frame: None)
            except (ValueError, OSError):  # not the main thread
                pass
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)


def finished_run() -> bool:
    """True once a ``train`` command of this process saved a complete run."""
    return _FINISHED_RUN


TRAIN_HELP = """Train an agent from a config file plus KEY=VALUE overrides, or resume a run.

A config is a YAML path or a name under the packaged configs/ (e.g. dt/hopper_medium; `rl-tformers configs` lists them). Overrides use dotted keys and YAML values and are applied last. The run directory gets config.yaml (the resolved config), checkpoints/, TensorBoard event files and metrics.jsonl.

Examples:

  rl-tformers train --config toy train.steps=200

  rl-tformers train -c dt/hopper_medium backbone.attention.kind=performer

  rl-tformers train agent.kind=toy --run-dir runs/try1 --device cpu

  rl-tformers train -c toy --print-config   (show the resolved config)

Continue a run where it stopped, optionally for longer; exactly (on-policy PPO too: its environments are checkpointed as plain data; one holding other state restarts, and the resume says so). Nothing of the run runs as code: its plugins are imported only when named with --plugin, and pickled environments are unpickled only with --unsafe-unpickle-envs:

  rl-tformers train --resume runs/try1

  rl-tformers train --resume runs/try1 train.steps=5000

Ctrl-C (SIGINT) or SIGTERM saves a checkpoint at the current step and exits with code 130/143; --resume continues from it. Before the first update it stops at once (nothing to save); a second Ctrl-C aborts at once (the run keeps its last checkpoint). During an evaluation the evaluation finishes first (the final one: the run then ends normally; stopped by a second Ctrl-C, --resume runs it). Exit code 2: bad config, agent option, dataset, checkpoint or run directory (one `error: ...` line names what is at fault; the agent and its data are checked before anything is trained or written). Exit code 1: training diverged (a NaN/inf loss; one `error: non-finite ...` line says what to try; the checkpoints written before it are kept).

Data-parallel training on N processes (DistributedDataParallel; gloo on CPU, NCCL with one GPU per process, so at most one process per GPU; train.batch_size is the global batch, split across the processes, so it must be divisible by N, except for PPO, whose processes train on their own rollouts; logs and checkpoints come from rank 0; the config, the GPU count and the run directory are checked before any process starts; --resume works the same):

  rl-tformers train --nproc 2 -c dt/hopper_medium

  rl-tformers train --nproc 2 --resume runs/dt-ddp

  torchrun --standalone --nproc-per-node 2 -m rl_tformers.cli train -c dt/hopper_medium --run-dir runs/dt-ddp   (the same, by hand)
"""


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (test runners swap it)."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


class _WarningFormatter(logging.Formatter):
    """A captured Python warning as one line: ``warning: MESSAGE``. The package's own warnings
    arrive already formatted so (:func:`rl_tformers.cli.short_warnings`) and get no second
    prefix (no ``warning: warning: ...``); the trailing newline of
    ``warnings.formatwarning`` is dropped."""

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage().rstrip()
        return text if text.startswith("warning: ") else f"warning: {text}"


class _LogFormatter(logging.Formatter):
    """A package log record as one line: INFO as it is, WARNING and above prefixed with its level
    (``warning: MESSAGE``, as captured Python warnings read)."""

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.levelno >= logging.WARNING:
            prefix = f"{record.levelname.lower()}: "
            text = text if text.startswith(prefix) else prefix + text
        if record.exc_info:  # log.exception: the traceback follows the line
            text += "\n" + self.formatException(record.exc_info)
        return text


def _setup_logging() -> None:
    """INFO messages of the ``rl_tformers`` loggers and Python warnings, one line each, on stderr."""
    for name, formatter in (("rl_tformers", _LogFormatter()), ("py.warnings", _WarningFormatter())):
        logger = logging.getLogger(name)
        if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
            handler = _StderrHandler()
            handler.setFormatter(formatter)
            logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    logging.captureWarnings(True)


_fail = fail


def train(
    overrides: list[str] = typer.Argument(
        None, metavar="[KEY=VALUE]...", help="Dotted config overrides, e.g. train.steps=1000 backbone.n_layers=4."
    ),
    config: str = typer.Option(
        None, "--config", "-c", help="YAML config: a path, or a name in the packaged configs (e.g. dt/hopper_medium; "
                                     "rl-tformers configs lists them)."
    ),
    resume: Path = typer.Option(
        None, "--resume", help="Continue RUN_DIR from its newest valid checkpoint (config comes from it).",
        metavar="RUN_DIR",
    ),
    run_dir: Path = typer.Option(None, "--run-dir", help="Where to write the run (default: runs/<config>-<time>)."),
    device: str = typer.Option(None, "--device", help="auto | cpu | cuda | cuda:N | mps (same as device=...)."),
    stop_at: int = typer.Option(
        None, "--stop-at", metavar="STEP", min=0,
        help="Stop after STEP updates with a checkpoint (for time-limited jobs); --resume continues.",
    ),
    nproc: int = typer.Option(
        1, "--nproc", min=1, metavar="N",
        help="Data-parallel processes on this machine (torchrun + DistributedDataParallel; gloo on CPU, NCCL on GPUs).",
    ),
    print_config: bool = typer.Option(False, "--print-config",
                                      help="Print the resolved config and exit (the backbone as built: every "
                                           "slot with its kind's defaults; config.yaml keeps the fields set)."),
    list_agents: bool = typer.Option(False, "--list-agents", help="List the registered agent kinds (installed plugins' too) and exit."),
    plugin: list[str] = typer.Option(
        [], "--plugin", metavar="MODULE",
        help="With --resume: import this module (repeatable); a module the run's plugins list is imported only "
             "when named here (it runs that module's code) or installed as an entry point; never from the "
             "current directory."),
    unsafe_unpickle_envs: bool = typer.Option(
        False, "--unsafe-unpickle-envs",
        help="With --resume: unpickle the checkpointed environments that are not plain data (PPO; the resume "
             "names them). UNSAFE: unpickling runs any code the checkpoint holds; only for runs you made or trust."),
) -> None:
    _setup_logging()
    if list_agents:
        _list_agents()
        return
    overrides = _checked_overrides(overrides, device, nproc, print_config, resume, plugin, unsafe_unpickle_envs)
    trusted = TrustedInputs(plugin, unsafe_unpickle_envs)
    if nproc > 1 and not print_config:
        raise typer.Exit(_launch_torchrun(nproc, overrides, config, resume, run_dir, stop_at, trusted))
    result, world_size = _train_here(overrides, config, resume, run_dir, stop_at, print_config, trusted)
    if result is not None:
        _report_result(result, world_size)


def _list_agents() -> None:
    """``--list-agents``: every registered agent kind with its description (installed plugins' too)."""
    # the command's imports, inside it so that `rl-tformers --help` stays fast
    from rl_tformers.runtime import agent_registry as agent_registry
    from rl_tformers.runtime.plugins import load_entry_point_plugins

    load_entry_point_plugins()  # the agents of installed rl_tformers.plugins packages are listed too
    for kind in agent_registry.available_agents():
        typer.echo(f"{kind:16s} {agent_registry.get_agent(kind).description}")
    for mod, err in agent_registry.import_failures().items():
        typer.echo(f"(failed to import {mod}: {err})", err=True)


def _checked_overrides(overrides: list[str] | None, device: str | None, nproc: int, print_config: bool,
                       resume: Path | None, plugin: list[str], unsafe_unpickle_envs: bool) -> list[str]:
    """The overrides with ``--device`` as ``device=...``, after the checks of the options that need
    no config: ``--nproc`` under torchrun, ``--plugin`` / ``--unsafe-unpickle-envs`` without
    ``--resume`` (``error:`` line, exit 2)."""
    overrides = list(overrides or [])
    if device is not None:
        overrides.append(f"device={device}")
    if nproc > 1 and not print_config and "WORLD_SIZE" in os.environ:
        # torchrun's variable in the environment: already a rank (torchrun ... train --nproc N),
        # or left over in the shell (WORLD_SIZE=1 would train one process, --nproc ignored)
        if os.environ.get("RANK", "0") != "0":
            raise typer.Exit(2)
        raise _fail(f"--nproc {nproc} starts its own processes, but WORLD_SIZE={os.environ['WORLD_SIZE']} is set in "
                    f"the environment (torchrun's variable): under torchrun drop --nproc (torchrun's "
                    f"--nproc-per-node sets the processes); otherwise unset WORLD_SIZE, RANK and LOCAL_RANK")
    if resume is None and (plugin or unsafe_unpickle_envs):
        given = "--plugin" if plugin else "--unsafe-unpickle-envs"
        raise _fail(f"{given} is for --resume RUN_DIR (a new run lists its modules in plugins=[...], which records "
                    f"them)")
    return overrides


def _train_here(overrides: list[str], config: str | None, resume: Path | None, run_dir: Path | None,
                stop_at: int | None, print_config: bool, trusted: TrustedInputs) -> tuple[Any, int]:
    """Train, resume or print the config in this process (alone, or as a rank under torchrun);
    returns ``(TrainResult or None after --print-config, number of processes)``. A failure
    exits: bad input 2 (one ``error:`` line from rank 0), divergence 1, a signal 128 + its
    number; an unexpected error propagates (a traceback)."""
    # the command's imports, inside it so that `rl-tformers --help` stays fast
    from rl_tformers.envs.dataset import DatasetError
    from rl_tformers.registry import RegistryError
    from rl_tformers.runtime.checkpoint import CheckpointError
    from rl_tformers.runtime.distributed import LAUNCHER_ENV, dist_info
    from rl_tformers.runtime.run_config import ConfigError
    from rl_tformers.runtime.trainer import (
        EvaluationInputError,
        GracefulInterrupt,
        Interrupted,
        NonFiniteLossError,
        RunDirError,
    )

    info = dist_info()
    # who reports a stop by SIGINT/SIGTERM: rank 0, unless `train --nproc` started this rank (it reports)
    report = info.is_main and not (info.distributed and LAUNCHER_ENV in os.environ)
    # a signal before the first update ends the start-up at once: one process raises Interrupted
    # (one line below), a rank of several ends silently even inside a collective (GracefulInterrupt)
    stop = GracefulInterrupt(announce=report, startup="default" if info.distributed else "raise")
    try:
        with stop, trusted.entered() if resume is not None else contextlib.nullcontext():
            return _start(overrides, config, resume, run_dir, stop_at, print_config, stop), info.world_size
    except typer.Exit:
        raise
    except (ConfigError, RegistryError, CheckpointError, RunDirError, EvaluationInputError) as exc:
        # EvaluationInputError: the run is saved; the message names the option at fault
        if os.environ.get("RANK", "0") != "0":
            raise typer.Exit(2) from None  # under torchrun every rank meets the same bad input: rank 0 says it
        raise _fail(str(exc)) from None
    except DatasetError as exc:
        # a dataset file that cannot be read while training (a lazy read of a damaged chunk);
        # the rank that read it says so (the others may not have met it); earlier checkpoints are kept
        raise _fail(str(exc)) from None
    except NonFiniteLossError as exc:  # diverged: the message says what to try; earlier checkpoints are kept
        if os.environ.get("RANK", "0") == "0":  # every rank sees the same reduced window: rank 0 says it
            typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    except Interrupted as exc:  # before the first update: nothing was trained or written
        if report:
            typer.echo(interrupted_line(exc.signum, resume, info.world_size), err=True)
        raise typer.Exit(1 if exc.signum is None else 128 + int(exc.signum)) from None
    except KeyboardInterrupt:  # aborted by a second signal; the trainer said where the run stands
        raise typer.Exit(128 + int(stop.aborted or stop.signum or signal.SIGINT)) from None
    except Exception as exc:
        status = _exit_after_failure(exc, stop, info)
        if status is None:
            raise
        raise status from None


def _start(overrides: list[str], config: str | None, resume: Path | None, run_dir: Path | None,
           stop_at: int | None, print_config: bool, stop: Any) -> Any:
    """Resume ``resume`` or start a run of ``config``, or print its config (returns None then)."""
    # the command's imports, inside it so that `rl-tformers --help` stays fast
    from rl_tformers.runtime.run_config import compose, config_display_name, display_yaml, resolve_config_path
    from rl_tformers.runtime.trainer import load_resume_config
    from rl_tformers.runtime.trainer import resume as resume_run
    from rl_tformers.runtime.trainer import train as train_run

    if resume is not None:
        if config is not None or run_dir is not None:
            raise _fail("--resume takes its config and run directory from RUN_DIR; drop --config/--run-dir")
        if print_config:
            cfg, found, changes = load_resume_config(resume, overrides)
            typer.echo(f"# resuming {found.path}" + "".join(f"\n# changed: {c}" for c in changes))
            typer.echo(display_yaml(cfg), nl=False)
            return None
        return resume_run(resume, overrides, stop_at=stop_at, interrupt=stop)
    name = config_display_name(resolve_config_path(config)) if config is not None else None
    cfg = compose(config, overrides)
    if print_config:
        typer.echo(display_yaml(cfg), nl=False)
        return None
    return train_run(cfg, run_dir, config_name=name, stop_at=stop_at, interrupt=stop)


def _exit_after_failure(exc: Exception, stop: Any, info: Any) -> typer.Exit | None:
    """How a rank ends after an unexpected ``exc``: the exit to raise, or None to let ``exc``
    propagate (a traceback: one process, or rank 0 without a stop signal)."""
    from rl_tformers.runtime.distributed import PeerFailure, peer_failed, wait_for_teardown

    if stop.signum is None and info.distributed and peer_failed(exc):
        # another rank failed first: it printed why and the launcher names it; this rank says
        # one line (nothing for rank 0's failed evaluation, which rank 0 reports) instead of
        # a traceback of the collective, and waits for torchrun to end it, so that torchrun
        # records the rank that failed first
        if not isinstance(exc, PeerFailure):
            typer.echo(f"rank {info.rank}: stopped: another process of the run failed or was killed "
                       f"({_first_line(exc)})", err=True)
        wait_for_teardown()
        return typer.Exit(1)
    if stop.signum is None or info.is_main:
        return None
    # a rank > 0 after a stop signal: the collective it was in failed because another rank
    # stopped or was killed; rank 0 (or the launcher) reports the stop, this rank only exits
    return typer.Exit(128 + int(stop.signum))


def _report_result(result: Any, world_size: int) -> None:
    """What ``rl-tformers train`` says when the run ended (rank 0 only): the run directory and
    final evaluation of a complete run, or how to continue a stopped one; a run stopped by a
    signal exits with 128 + its number."""
    if result.interrupted is not None:
        raise typer.Exit(128 + int(result.interrupted))
    if os.environ.get("RANK", "0") != "0":
        return  # under torchrun, rank 0 reports
    if result.complete:
        with finished_run_signals():  # the run is saved and complete: a late Ctrl-C changes nothing
            typer.echo(f"done: {result.step} steps in {result.run_dir} (view: tensorboard --logdir {result.run_dir})",
                       err=True)
            summary = eval_summary(result.last_eval)
            if summary:
                typer.echo(f"final evaluation at step {result.step}: {summary}", err=True)
                again = repeat_eval_command(result.run_dir, result.step)
                if again:
                    typer.echo(f"  (repeat it exactly: {again}; plain `rl-tformers eval {result.run_dir}` uses reset "
                               f"seeds 0..N-1, so its numbers differ within the spread)", err=True)
    else:
        from rl_tformers.runtime.trainer import resume_command

        typer.echo(f"stopped at step {result.step} of {result.total_steps}; continue with: "
                   f"{resume_command(result.run_dir, world_size)}", err=True)


def _first_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (gloo's messages run on with advice and a source path)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if text.startswith("[") and "] " in text:  # "[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer ..."
        text = text.split("] ", 1)[1]
    text = text.split(". ", 1)[0]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def interrupted_line(signum: int | None, resume: Path | None, world_size: int) -> str:
    """The line ``rl-tformers train`` prints when a signal stopped it before the first update.

    Args:
        signum: the signal (None: another process of the run stopped first).
        resume: the run directory of ``--resume``, or None for a new run.
        world_size: the number of processes (for the ``--nproc`` of the resume command).
    """
    name = signal.Signals(signum).name if signum is not None else "another process of the run"
    if resume is None:
        return (f"interrupted by {name} before the first update: nothing was trained or saved "
                "(nothing to resume)")
    from rl_tformers.runtime.trainer import resume_command

    return (f"interrupted by {name} before the first update: {resume} is unchanged; continue with: "
            f"{resume_command(resume, world_size)}")


def repeat_eval_command(run_dir: Path, step: int) -> str:
    """The ``rl-tformers eval`` line that repeats the in-training evaluation at ``step``.

    In-training evaluations reset episode j with seed ``eval_seed(seed, step) + j``
    (:func:`rl_tformers.runtime.evaluation.eval_seed`), ``eval.episodes`` episodes over
    ``eval.n_envs`` environments; ``rl-tformers eval`` takes the same three as ``--seed``,
    ``--episodes`` and ``--envs``. '' when ``RUN_DIR/config.yaml`` cannot be read.
    """
    from omegaconf import OmegaConf

    from rl_tformers.runtime.evaluation import eval_seed

    try:
        cfg = OmegaConf.load(Path(run_dir) / "config.yaml")
        seed, episodes, envs = int(cfg.seed), int(cfg.eval.episodes), int(cfg.eval.n_envs)
    except Exception:  # noqa: BLE001 - a hint only; the run itself is done
        return ""
    return f"rl-tformers eval {run_dir} --seed {eval_seed(seed, step)} --episodes {episodes} --envs {envs}"


def eval_summary(scalars: dict[str, float]) -> str:
    """One line of the headline evaluation scalars, '' when there are none: the per-target text
    of :func:`~rl_tformers.runtime.evaluation.targets_text` with ``±``."""
    from rl_tformers.runtime.evaluation import targets_text

    return targets_text(scalars, pm="±")


class TrustedInputs:
    """What the user trusts of a resumed run, named on the command line: the modules of its
    ``plugins`` to import (``--plugin``) and whether its pickled environments may be unpickled."""

    def __init__(self, plugins: list[str], unpickle_envs: bool) -> None:
        self.plugins, self.unpickle_envs = list(plugins), bool(unpickle_envs)

    @contextlib.contextmanager
    def entered(self):
        """The block in which the run is resumed (or checked): only these modules, and unpickling if asked."""
        from rl_tformers.runtime.checkpoint import allow_unpickling
        from rl_tformers.runtime.plugins import named_plugins_only

        with named_plugins_only(self.plugins, "--plugin"), allow_unpickling(self.unpickle_envs):
            yield

    def args(self) -> list[str]:
        """The same as command-line arguments (for the processes of ``--nproc``)."""
        return [a for m in self.plugins for a in ("--plugin", m)] + (
            ["--unsafe-unpickle-envs"] if self.unpickle_envs else [])


def _launch_torchrun(nproc: int, overrides: list[str], config: str | None, resume: Path | None,
                     run_dir: Path | None, stop_at: int | None, trusted: TrustedInputs | None = None) -> int:
    """Run this command again under torchrun on ``nproc`` processes; returns the exit status.

    Before any process starts, the command is checked as far as it can be without building the
    agent: the config composes, ``train.batch_size`` is divisible by ``nproc`` (not for agent
    kinds registered with ``local_batches=True``, e.g. PPO), a CUDA run has a GPU for every
    process (:func:`~rl_tformers.runtime.distributed.gpu_count_problem`), and the run
    directory can take a new run (:func:`~rl_tformers.runtime.trainer.new_run_problem`) or,
    with ``--resume``, holds a valid checkpoint whose config takes the overrides and nobody
    else is training it; a problem raises ``typer.Exit(2)`` after one ``error:`` line, and a
    Ctrl-C during the checks ``typer.Exit(130)`` after one line. A new run's directory is
    decided here (so every rank writes to the same place). Then :func:`_run_torchrun`.
    """
    from rl_tformers.runtime.distributed import gpu_count_problem, torchrun_command

    cfg, args, run_dir = _torchrun_args(nproc, overrides, config, resume, run_dir, trusted)
    gpus = gpu_count_problem(str(cfg.device), nproc)
    if gpus is not None:
        raise _fail(gpus)
    if stop_at is not None:
        args += ["--stop-at", str(stop_at)]
    steps = int(cfg.train.steps)
    end = steps if stop_at is None else min(int(stop_at), steps)
    return _run_torchrun(torchrun_command(nproc, [*args, *overrides]), nproc, Path(run_dir), steps, end,
                         new_dir=resume is None and not Path(run_dir).exists())


def _torchrun_args(nproc: int, overrides: list[str], config: str | None, resume: Path | None,
                   run_dir: Path | None, trusted: TrustedInputs | None) -> tuple[Any, list[str], Path]:
    """The checks of :func:`_launch_torchrun` that read the config and the run directory:
    returns ``(config, the ranks' arguments naming the config and run directory, run
    directory)``; a problem exits 2 after one ``error:`` line, a Ctrl-C 130."""
    # the command's imports, inside it so that `rl-tformers --help` stays fast
    from rl_tformers.registry import RegistryError
    from rl_tformers.runtime.checkpoint import CheckpointError
    from rl_tformers.runtime.run_config import (
        ConfigError,
        compose,
        config_display_name,
        default_run_dir,
        resolve_config_path,
    )
    from rl_tformers.runtime.runlock import RunBusyError, lock_holder
    from rl_tformers.runtime.trainer import check_world_size, load_resume_config, new_run_problem

    args: list[str] = []
    try:
        if resume is not None:
            if config is not None or run_dir is not None:
                raise _fail("--resume takes its config and run directory from RUN_DIR; drop --config/--run-dir")
            if Path(resume).is_dir() and (pid := lock_holder(resume)) is not None:
                raise _fail(str(RunBusyError(Path(resume), pid or None)))
            with (trusted or TrustedInputs([], False)).entered():
                cfg, _, _ = load_resume_config(resume, overrides, repair=False)  # reads, repairs nothing
            check_world_size(cfg, nproc)
            args += ["--resume", str(resume), *(trusted.args() if trusted is not None else [])]
            run_dir = Path(resume)
        else:
            cfg = compose(config, overrides)
            check_world_size(cfg, nproc)
            if run_dir is None:
                name = config_display_name(resolve_config_path(config)) if config is not None else None
                run_dir = Path(cfg.run_dir) if cfg.run_dir else default_run_dir(cfg, name)
            problem = new_run_problem(run_dir)
            if problem is not None:
                raise _fail(problem)
            if config is not None:
                args += ["--config", config]
            args += ["--run-dir", str(run_dir)]
    except (ConfigError, RegistryError, CheckpointError) as exc:
        raise _fail(str(exc)) from None
    except KeyboardInterrupt:
        typer.echo("interrupted by SIGINT before any process started: nothing was written", err=True)
        raise typer.Exit(128 + signal.SIGINT) from None
    return cfg, args, run_dir


def _run_torchrun(cmd: list[str], nproc: int, run_dir: Path, total_steps: int, end: int,
                  new_dir: bool = False) -> int:
    """Run ``cmd`` (:func:`~rl_tformers.runtime.distributed.torchrun_command`) and report a stop.

    torchrun runs in a session of its own, so a terminal's Ctrl-C reaches this process only,
    which forwards every SIGINT/SIGTERM it receives to it (see :mod:`rl_tformers.runtime.torchrun`
    for what torchrun then does with the ranks) and says what happens: the first signal makes
    every rank save at its next update boundary and stop, the second aborts them at once. It
    starts torchrun with both signals blocked (inherited), so one sent while torchrun starts
    waits for its handler instead of being lost or raising in an import; here they are blocked
    until torchrun runs and this process's handler is in place.

    The ranks do not report a stop (:data:`~rl_tformers.runtime.distributed.LAUNCHER_ENV`):
    once torchrun has returned, this process reports it once, from the run directory
    (:func:`stop_report`), so the message holds whatever state the ranks left. A run directory
    created for this run (``new_dir``) that a stop left holding nothing but the training lock
    file (rank 0 ended at once during its start-up) is removed again.

    Returns:
        torchrun's exit status without a signal; with one: 0 if the run reached ``end`` anyway
        (rank 0 said so), else 128 + the first signal's number.
    """
    rc, received = _run_forwarding_signals(cmd, nproc)
    if not received:
        return rc
    if new_dir:
        _remove_if_only_the_lock(run_dir)
    line, status = stop_report(run_dir, nproc, received, total_steps, end)
    if line:
        typer.echo(line, err=True)
    return status


def _run_forwarding_signals(cmd: list[str], nproc: int) -> tuple[int, list[int]]:
    """Run torchrun's ``cmd`` in a session of its own, forwarding every SIGINT/SIGTERM this
    process receives (blocked until torchrun runs, see :func:`_run_torchrun`); returns
    ``(torchrun's exit status, the signals received)``."""
    import subprocess

    from rl_tformers.runtime.distributed import LAUNCHER_ENV

    received: list[int] = []
    proc: subprocess.Popen | None = None

    def forward(signum: int, frame: object) -> None:
        received.append(signum)
        name = signal.Signals(signum).name
        if len(received) == 1:
            typer.echo(f"received {name}: stopping the {nproc} processes (once training, they finish the "
                       f"current update and save a checkpoint first; press Ctrl-C again to abort at once)", err=True)
        elif len(received) == 2:
            typer.echo(f"received {name} again: the processes stop at once; the run keeps its last checkpoint",
                       err=True)
        if proc is not None:
            proc.send_signal(signum)

    stops = (signal.SIGINT, signal.SIGTERM)
    blocking = hasattr(signal, "pthread_sigmask")
    previous = {s: signal.signal(s, forward) for s in stops}
    try:
        if blocking:
            signal.pthread_sigmask(signal.SIG_BLOCK, stops)
        typer.echo(f"launching {nproc} processes: torchrun {' '.join(cmd[3:])}", err=True)
        try:
            env = {**os.environ, LAUNCHER_ENV: str(os.getpid())}
            proc = subprocess.Popen(cmd, start_new_session=True, env=env)
        finally:
            if blocking:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)  # forwards a signal that came meanwhile
        rc = proc.wait()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return rc, received


def _remove_if_only_the_lock(run_dir: Path) -> None:
    """Remove ``run_dir`` if it holds nothing but the training lock file (nobody holds the lock)."""
    from rl_tformers.runtime.runlock import LOCK_FILE, lock_holder

    try:
        if [p.name for p in run_dir.iterdir()] == [LOCK_FILE] and lock_holder(run_dir) is None:
            (run_dir / LOCK_FILE).unlink()
            run_dir.rmdir()
    except OSError:
        pass  # gone already, or not ours to remove: the report below says what is there


def stop_report(run_dir: Path, nproc: int, received: list[int], total_steps: int,
                end: int) -> tuple[str, int]:
    """What ``rl-tformers train --nproc`` says after a stop by ``received`` signals, from what
    ``run_dir`` holds once every rank has exited, and its exit status.

    Args:
        run_dir: the run directory.
        nproc: the number of processes (the resume command's ``--nproc``).
        received: the signals the launcher received, in order (not empty).
        total_steps: ``train.steps`` of the run.
        end: the step the run was to stop at (``--stop-at``, else ``total_steps``).

    Returns:
        ``("", 0)`` when the newest checkpoint is at ``end`` (the run got there before the
        signal took effect, and rank 0 said so); else one line (where the run stands and the
        exact command that continues it, or that there is nothing to resume) and 128 + the
        first signal's number.
    """
    from rl_tformers.runtime.checkpoint import list_checkpoints
    from rl_tformers.runtime.trainer import holds_run, resume_command

    saved = list_checkpoints(run_dir) if run_dir.is_dir() else []  # newest first
    if saved and saved[0][0] >= end:
        return "", 0
    status = 128 + int(received[0])
    name = signal.Signals(received[0]).name
    if not saved:
        line = f"interrupted by {name} before the first checkpoint: nothing to resume"
        if run_dir.is_dir() and holds_run(run_dir):
            line += (f"; {run_dir} holds only the logs of its start: delete it, or pick another --run-dir, "
                     f"to start again")
        return line, status
    step, path = saved[0]
    cont = f"continue with: {resume_command(run_dir, nproc)}"
    if len(received) == 1:
        return f"stopped by {name} at step {step} of {total_steps}; checkpoint {path}; {cont}", status
    return (f"aborted by a second signal ({signal.Signals(received[1]).name}); last checkpoint: step {step} of "
            f"{total_steps} ({path}); {cont}"), status


def register(app: typer.Typer) -> None:
    """Add ``train`` and ``sweep`` to the ``rl-tformers`` app."""
    app.command("train", help=TRAIN_HELP, no_args_is_help=False)(train)
    from rl_tformers.runtime.sweep import register as register_sweep

    register_sweep(app)
