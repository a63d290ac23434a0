"""``rl-tformers train``: start or resume a run. (``sweep`` joins here: see ``register``.)

Heavy imports (torch, tensorboard, agents) happen inside the command, so ``rl-tformers --help``
stays fast.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import typer

TRAIN_HELP = """Train an agent from a config file plus KEY=VALUE overrides, or resume a run.

A config is a YAML path or a name under the packaged configs/ (e.g. dt/hopper_medium). Overrides use dotted keys and YAML values and are applied last. The run directory gets config.yaml (the fully resolved config), checkpoints/, TensorBoard event files and metrics.jsonl.

Examples:

  rl-tformers train --config toy train.steps=200

  rl-tformers train -c dt/hopper_medium backbone.attention.kind=performer

  rl-tformers train agent.kind=toy --run-dir runs/try1 --device cpu

  rl-tformers train -c toy --print-config   (show the resolved config)

Continue a run exactly where it stopped, optionally for longer:

  rl-tformers train --resume runs/try1

  rl-tformers train --resume runs/try1 train.steps=5000

Ctrl-C (SIGINT) or SIGTERM saves a checkpoint at the current step and exits with code 130/143; --resume continues from it. Exit code 2: bad config, checkpoint or run directory.
"""


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (test runners swap it)."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def _setup_logging() -> None:
    """INFO messages of the ``rl_tformers`` loggers and Python warnings, one line each, on stderr."""
    for name, fmt in (("rl_tformers", "%(message)s"), ("py.warnings", "warning: %(message)s")):
        logger = logging.getLogger(name)
        if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
            handler = _StderrHandler()
            handler.setFormatter(logging.Formatter(fmt))
            logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    logging.captureWarnings(True)


def _fail(msg: str) -> typer.Exit:
    typer.echo(f"error: {msg}", err=True)
    return typer.Exit(2)


def train(
    overrides: list[str] = typer.Argument(
        None, metavar="[KEY=VALUE]...", help="Dotted config overrides, e.g. train.steps=1000 backbone.n_layers=4."
    ),
    config: str = typer.Option(
        None, "--config", "-c", help="YAML config: a path, or a name in the packaged configs (e.g. dt/hopper_medium)."
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
    print_config: bool = typer.Option(False, "--print-config", help="Print the resolved config and exit."),
    list_agents: bool = typer.Option(False, "--list-agents", help="List the registered agent kinds and exit."),
) -> None:
    _setup_logging()
    from rl_tformers.registry import RegistryError
    from rl_tformers.runtime import agents as agent_registry
    from rl_tformers.runtime.checkpoint import CheckpointError
    from rl_tformers.runtime.config import (
        ConfigError,
        compose,
        config_display_name,
        resolve_config_path,
        to_yaml,
    )
    from rl_tformers.runtime.trainer import RunDirError, load_resume_config
    from rl_tformers.runtime.trainer import resume as resume_run
    from rl_tformers.runtime.trainer import train as train_run

    if list_agents:
        for kind in agent_registry.available_agents():
            typer.echo(f"{kind:16s} {agent_registry.get_agent(kind).description}")
        for mod, err in agent_registry.import_failures().items():
            typer.echo(f"(failed to import {mod}: {err})", err=True)
        return
    overrides = list(overrides or [])
    if device is not None:
        overrides.append(f"device={device}")
    try:
        if resume is not None:
            if config is not None or run_dir is not None:
                raise _fail("--resume takes its config and run directory from RUN_DIR; drop --config/--run-dir")
            if print_config:
                cfg, found, changes = load_resume_config(resume, overrides)
                typer.echo(f"# resuming {found.path}" + "".join(f"\n# changed: {c}" for c in changes))
                typer.echo(to_yaml(cfg), nl=False)
                return
            result = resume_run(resume, overrides, stop_at=stop_at)
        else:
            name = config_display_name(resolve_config_path(config)) if config is not None else None
            cfg = compose(config, overrides)
            if print_config:
                typer.echo(to_yaml(cfg), nl=False)
                return
            result = train_run(cfg, run_dir, config_name=name, stop_at=stop_at)
    except (ConfigError, RegistryError, CheckpointError, RunDirError) as exc:
        raise _fail(str(exc)) from None
    if result.interrupted is not None:
        raise typer.Exit(128 + int(result.interrupted))
    if result.complete:
        typer.echo(f"done: {result.step} steps in {result.run_dir} (view: tensorboard --logdir {result.run_dir})",
                   err=True)
    else:
        typer.echo(f"stopped at step {result.step} of {result.total_steps}; continue with: "
                   f"rl-tformers train --resume {result.run_dir}", err=True)


def register(app: typer.Typer) -> None:
    """Add ``train`` to the ``rl-tformers`` app. (Issue 9 adds ``sweep`` here, from ``runtime/sweep.py``.)"""
    app.command("train", help=TRAIN_HELP, no_args_is_help=False)(train)
