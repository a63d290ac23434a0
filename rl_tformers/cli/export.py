"""``rl-tformers export``: a trained run as a standalone policy folder with a TorchScript or ONNX
graph (:mod:`rl_tformers.agents.export`, docs/deployment.md)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import typer

from rl_tformers.cli.errors import fail

EXPORT_HELP = """Export a trained run's policy to a standalone policy folder.

The folder holds policy.json (spaces, observation normalisation, action scaling, context length, target return, versions), model.safetensors and the graph (policy.pt or policy.onnx); rl_tformers.Policy.load(DIR).act(obs, state) acts from it without the training config or the dataset, and nothing is unpickled. Export the other format into the same folder to add its graph. A backbone kind that cannot be exported to the format is refused, naming both.

Examples:

  rl-tformers export runs/dt-hopper --format torchscript --out policies/dt-hopper

  rl-tformers export runs/dt-hopper --format onnx --out policies/dt-hopper
"""


class Format(str, Enum):
    torchscript = "torchscript"
    onnx = "onnx"


#: help of ``--plugin`` (as ``eval``'s)
PLUGIN_HELP = ("Import this module (repeatable) before the run is rebuilt: a module the run's plugins list is "
               "imported only when named here (it runs that module's code) or installed as an entry point.")


def export_cmd(
    run_dir: Path = typer.Argument(..., help="A run directory written by rl-tformers train."),
    fmt: Format = typer.Option(..., "--format", help="The graph's format: torchscript or onnx."),
    out: Path = typer.Option(..., "--out", help="The policy folder to write (created; other files in it are kept)."),
    plugin: list[str] = typer.Option([], "--plugin", metavar="MODULE", help=PLUGIN_HELP),
) -> None:
    # the export stack (agents, torch.onnx) loads when the command runs, so --help stays fast
    from rl_tformers.agents.export import ExportRefused, export_run
    from rl_tformers.runtime.agent_registry import UnknownAgentError
    from rl_tformers.runtime.checkpoint import CheckpointError

    out = out.expanduser()
    if out.exists() and not out.is_dir():
        raise fail(f"--out {out}: is a file, not a folder")
    if fmt is Format.onnx:
        try:
            import onnx  # noqa: F401  (torch.onnx writes the graph with it)
            import onnxruntime  # noqa: F401  (the export is verified with it)
        except ImportError as exc:
            raise fail(f"--format onnx needs the onnx and onnxruntime packages ({exc}); "
                       f"pip install 'rl-tformers[onnx]'") from None
    try:
        folder = export_run(run_dir, fmt.value, out, plugins=plugin)
    except (ExportRefused, CheckpointError, UnknownAgentError, ValueError) as exc:
        raise fail(str(exc)) from None
    typer.echo(f"wrote {folder} ({fmt.value}); act with rl_tformers.Policy.load({str(folder)!r})")


def register(app: typer.Typer) -> None:
    """Add ``export`` to ``app``."""
    app.command("export", help=EXPORT_HELP)(export_cmd)
