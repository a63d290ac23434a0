"""``rl-tformers backbones``: list every registered component with its paper, capabilities and
config fields (with their defaults), including the kinds of installed ``rl_tformers.plugins``
entry points and of the modules given with ``--plugin``."""

from __future__ import annotations

import json
import shutil
import textwrap

import typer


def backbones(
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list instead of a table."),
    slot: str = typer.Option(None, "--slot", help="Only this slot: attention, position, memory, block, depth."),
    plugin: list[str] = typer.Option([], "--plugin", metavar="MODULE",
                                     help="Import this module first (repeatable): its kinds are listed too."),
) -> None:
    """List registered backbone components: slot, kind, description, paper, capabilities, fields (with their defaults).

    Any kind of the attention, position and block slots may also be set per layer (backbone.layers).
    """
    from rl_tformers.registry import SLOTS, all_entries
    from rl_tformers.runtime.plugins import load_plugins
    from rl_tformers.runtime.run_config import ConfigError

    if slot is not None and slot not in SLOTS:
        raise typer.BadParameter(f"unknown slot {slot!r}; slots: {', '.join(SLOTS)}", param_hint="--slot")
    try:
        load_plugins(plugin, "--plugin")
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    entries = [e for e in all_entries() if slot is None or e.slot == slot]
    if as_json:
        typer.echo(json.dumps([e.as_dict() for e in entries], indent=2))
        return
    width = shutil.get_terminal_size((80, 24)).columns  # $COLUMNS, the terminal, else 80 (a pipe)
    if width >= TABLE_MIN_WIDTH:
        _print_table(entries, width)
    else:
        typer.echo("\n".join(component_lines(entries, width)))
    typer.echo("\n" + "\n".join(textwrap.wrap(LAYERS_NOTE, min(width, 100), break_on_hyphens=False)))


#: The closing note of the listing: per-layer stacks (rl_tformers.backbone_layers).
LAYERS_NOTE = ("Per-layer stacks: backbone.layers sets the attention, position and block kinds, and their fields, "
               "per layer (a list of n_layers entries, or a pattern repeated up the stack, each merged over the "
               "backbone-wide slots); memory and depth stay backbone-wide. See docs/backbone.md, "
               "'Per-layer stacks', and the configs dt/hopper_medium_sparse_interleaved, "
               "dt/hopper_medium_longformer_windows, gtrxl/recall_routing_top2 and gtrxl/recall_local_dense_top.")


#: Fewest columns the six-column table is drawn in; narrower output lists each component as a block.
TABLE_MIN_WIDTH = 140


def _fields_text(entry, sep: str) -> str:
    return sep.join(f"{k}={json.dumps(v)}" for k, v in entry.fields().items())


def _print_table(entries, width: int) -> None:
    """The components as a Rich table ``width`` columns wide."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="rl-tformers backbone components")
    for col in ("slot", "kind", "description", "paper", "capabilities", "fields (defaults)"):
        table.add_column(col, overflow="fold")
    for e in entries:
        table.add_row(e.slot, e.kind, e.description, e.paper, ", ".join(e.capabilities.flags()), _fields_text(e, "\n"))
    Console(width=width).print(table)


def component_lines(entries, width: int) -> list[str]:
    """The components as blocks of lines at most ``width`` wide (a word longer than a line is
    kept whole): ``slot/kind``, then the description, paper, capabilities and fields (defaults),
    each wrapped under a two-space indent; a blank line between components."""
    out = ["rl-tformers backbone components"]
    for e in entries:
        out += ["", f"{e.slot}/{e.kind}"]
        for label, text in (("", e.description), ("paper: ", e.paper),
                            ("capabilities: ", ", ".join(e.capabilities.flags()) or "none"),
                            ("fields: ", _fields_text(e, ", ") or "none")):
            out += textwrap.wrap(text, width, initial_indent="  " + label, subsequent_indent="    ",
                                 break_long_words=False, break_on_hyphens=False)
    return out


def register(app: typer.Typer) -> None:
    app.command("backbones")(backbones)
