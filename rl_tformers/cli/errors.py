"""The one way a command refuses bad input: one ``error: ...`` line on stderr, exit status 2."""

from __future__ import annotations

import typer


def error_line(message: str) -> str:
    """``error: message`` on one line: a message of several lines (an exception that carries a
    library's multi-line text) has its lines joined with a space."""
    return "error: " + " ".join(part.strip() for part in str(message).splitlines() if part.strip())


def fail(message: str) -> typer.Exit:
    """Print :func:`error_line` of ``message`` on stderr and return the ``typer.Exit(2)`` to raise."""
    typer.echo(error_line(message), err=True)
    return typer.Exit(2)
