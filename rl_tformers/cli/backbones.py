"""``rl-tformers backbones``: list every registered component with its paper, capabilities and
config fields (with their defaults), including the kinds of installed ``rl_tformers.plugins``
entry points and of the modules given with ``--plugin``."""

from __future__ import annotations

import json

import typer


def backbones(
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list instead of a table."),
    slot: str = typer.Option(None, "--slot", help="Only this slot: attention, position, memory, block, depth."),
    plugin: list[str] = typer.Option([], "--plugin", metavar="MODULE",
                                     help="Import this module first (repeatable): its kinds are listed too."),
) -> None:
    """List registered backbone components: slot, kind, description, paper, capabilities, fields (with their defaults)."""
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
    from rich.console import Console
    from rich.table import Table

    table = Table(title="rl-tformers backbone components")
    for col in ("slot", "kind", "description", "paper", "capabilities", "fields (defaults)"):
        table.add_column(col, overflow="fold")
    for e in entries:
        fields = "\n".join(f"{k}={json.dumps(v)}" for k, v in e.fields().items())
        table.add_row(e.slot, e.kind, e.description, e.paper, ", ".join(e.capabilities.flags()), fields)
    Console(width=200).print(table)


def register(app: typer.Typer) -> None:
    app.command("backbones")(backbones)
