"""``rl-tformers agents [KIND]``: every registered agent kind's ``agent.*`` options, with their
defaults, one-line docs and allowed values, generated from the kind's config dataclass."""

from __future__ import annotations

import typer

from rl_tformers.runtime import agent_registry
from rl_tformers.runtime.errors import ConfigError
from rl_tformers.runtime.plugins import load_entry_point_plugins
from rl_tformers.typed_config import format_fields, repr_default


def agents(kind: str = typer.Argument(None, help="Only this agent kind (e.g. dt).")) -> None:
    """List the agent kinds and their agent.* options: key = default, doc (allowed values)."""
    load_entry_point_plugins()  # the agents of installed rl_tformers.plugins packages are listed too
    try:
        kinds = [agent_registry.get_agent(kind).kind] if kind else agent_registry.available_agents()
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    for i, name in enumerate(kinds):
        entry = agent_registry.get_agent(name)
        if i:
            typer.echo("")
        typer.echo(f"{name}: {entry.description}")
        if entry.config_cls is None:
            for line in _default_lines(entry):
                typer.echo(f"  {line}")
            continue
        for line in format_fields(entry.config_cls, "agent"):
            typer.echo(f"  {line}")


def _default_lines(entry: agent_registry.AgentEntry) -> list[str]:
    """``agent.KEY = DEFAULT`` lines of a kind without a typed config: the ``agent:`` keys of its
    registered defaults (every key it accepts), aligned, with a note that they are untyped."""
    section = dict(entry.defaults.get("agent") or {})
    section.pop("kind", None)
    if not section:
        return ["(no agent.* options)"]
    rows = [f"agent.{k} = {repr_default(v)}" for k, v in section.items()]
    width = max(len(r) for r in rows)
    return [f"{r:<{width}}  (registered default; no type or range declared)" for r in rows]


def register(app: typer.Typer) -> None:
    app.command("agents")(agents)
