"""What every ``rl-tformers bench`` command shares: option checks that end the command with one
``error:`` line, and the way a result is printed and written."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch
import typer

from rl_tformers.runtime.paths import blocking_file


def emit_result(data: Mapping[str, Any], table: str, notes: Iterable[str] = (), *, out: str | None = None,
                as_json: bool = False) -> None:
    """Print a benchmark's result the way every ``bench`` command does.

    Args:
        data: the JSON-serialisable result (``Result.as_dict()``).
        table: its markdown rendering, printed unless ``as_json``.
        notes: remarks printed to stderr as ``note: ...`` lines (peers left out, ...).
        out: also write ``data`` as indented JSON to this path (parent folders are created).
        as_json: print ``data`` as JSON instead of the table.
    """
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(data, indent=2))
    typer.echo(json.dumps(data, indent=2) if as_json else table)
    for note in notes:
        typer.echo(f"note: {note}", err=True)


def fail(message: str) -> NoReturn:
    """Print ``error: message`` to stderr and exit with status 2 (bad input)."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def check_out(out: str | None, option: str = "--out", example: str = "bench.json") -> None:
    """A file a bench command writes (``--out``, ``--plot``): refuse (``error: ...`` naming
    ``option``, exit 2) a directory or a path under a file before anything is measured."""
    if not out:
        return
    path = Path(out)
    if path.is_dir():
        fail(f"{option} {out} is a directory; give a file name, e.g. {path / example}")
    parent = blocking_file(path)
    if parent is not None:
        fail(f"{option} {out}: {parent} is a file, not a directory")


def check_device(device: str, option: str = "--device") -> None:
    """Refuse a ``--device`` the benchmark cannot run on (before anything is measured).

    Raises:
        ValueError: not a ``cpu``/``cuda`` torch device, or ``cuda`` without an available GPU.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{option} {device!r}: use cpu or cuda (e.g. cuda:0)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{option} {device}: CUDA is not available here (torch {torch.__version__}); use cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"{option} {device}: there are {torch.cuda.device_count()} CUDA devices")


def first_repeat(values: Sequence[Any]) -> Any | None:
    """The first entry of ``values`` that an earlier entry equals (``None`` when all differ), for
    the "given twice" errors of list options (``--lengths 8,8``)."""
    seen: list[Any] = []
    for v in values:
        if v in seen:
            return v
        seen.append(v)
    return None


def check_counts(*pairs: tuple[str, Any], lo: int = 1) -> None:
    """Refuse integer options below ``lo``: ``pairs`` are ``(option, value)``.

    Raises:
        ValueError: naming the first option below ``lo``.
    """
    for option, value in pairs:
        if int(value) < lo:
            raise ValueError(f"{option} must be >= {lo}, got {value}")


def run_checked(make_settings: Callable[[], Any], run: Callable[..., Any], markdown: Callable[[Any], str], *,
                out: str | None, as_json: bool, load_errors: tuple[type[BaseException], ...] = (),
                source: str = "") -> None:
    """The body of a ``bench`` command: settings, checks, run, print.

    ``make_settings()`` builds the benchmark's settings and ``.check()`` validates them; a
    ``ValueError`` from either is an ``error:`` line and exit 2, as is a bad ``--out``
    (:func:`check_out`), all before anything is measured. ``run(settings, log=...)`` then runs
    with progress on stderr; one of ``load_errors`` (loading the run or dataset named by
    ``source``, e.g. ``"--dataset rlt/hopper-v5/medium-v0"``) is an ``error: SOURCE: ...`` line
    and exit 2. The result goes through :func:`emit_result` (its ``as_dict()``, ``markdown(result)``
    and ``notes``).

    Raises:
        typer.Exit: status 2 on bad input, as described.
    """
    try:
        settings = make_settings()
        settings.check()
    except ValueError as exc:
        fail(str(exc))
    check_out(out)
    try:
        res = run(settings, log=lambda m: typer.echo(m, err=True))
    except load_errors as exc:
        fail(f"{source}: {exc}")
    emit_result(res.as_dict(), markdown(res), res.notes, out=out, as_json=as_json)
