"""Plugins: your own modules that register backbone kinds or agents, used like the built-in ones.

A researcher who writes a new attention (or position, memory, block, depth) kind, or a new
agent, registers it from a module of their own (``@ATTENTION.register("my_attn", ...)``,
``@register_agent("my_agent", ...)``, docs/backbone.md) and names that module in the run
config::

    plugins: [my_project.attention]          # or: rl-tformers train ... plugins=[my_attn]
    backbone: {attention: {kind: my_attn}}

Every command that builds a run imports the listed modules first: ``train`` (and its resume,
its DDP processes and the runs of a ``sweep``, which compose the same config), ``eval``,
``plot`` and ``bench`` (from the checkpoint's config, which records ``plugins``). A module is
imported by its dotted name, with the current directory first on ``sys.path`` (as ``python -m``
does), so ``my_attn.py`` next to where you run the command works; otherwise install it or put
its folder on ``PYTHONPATH``. Installed packages can also declare a ``rl_tformers.plugins``
entry point (``[project.entry-points."rl_tformers.plugins"] name = "pkg.module"``): those are
imported by every command without being listed (``rl-tformers backbones`` shows their kinds),
and one that fails to import is reported as a warning, not an error, so a broken package does
not stop unrelated commands. Listing a module in ``plugins`` is what makes a run reproducible
elsewhere: the run's ``config.yaml`` and checkpoints record it.

What it cannot do: a module is imported once per process (Python's module cache), so editing
a plugin while a sweep runs changes only the runs started afterwards; file paths are not
accepted (a module name is stable across machines, a path is not).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import sys
import warnings
from collections.abc import Iterable

from rl_tformers.runtime.agents import _short_trace
from rl_tformers.runtime.config import ConfigError

#: Entry-point group of installed packages imported by every command.
ENTRY_POINT_GROUP = "rl_tformers.plugins"

_MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_entry_points_loaded = False


class PluginWarning(UserWarning):
    """An installed ``rl_tformers.plugins`` entry point could not be imported."""


def check_plugin_names(value: object, where: str = "plugins") -> list[str]:
    """The module names of a ``plugins`` config value.

    Args:
        value: the config value: a list of dotted module names (``None`` counts as empty).
        where: the option's name for error messages.

    Returns:
        The names, in order, without repeats.

    Raises:
        ConfigError: ``value`` is not a list, or an entry is not a dotted Python module name
            (a file path, or a name ending in ``.py``, is refused with a hint), naming ``where[i]``.
    """
    if value is None:
        return []
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise ConfigError(f"{where} must be a list of Python module names (e.g. plugins=[my_attn]), got {value!r}")
    names: list[str] = []
    for i, name in enumerate(value):
        # "x.py" is read as a file, not as a submodule named py (which nobody names so)
        if not isinstance(name, str) or not _MODULE_NAME.fullmatch(name) or name.endswith(".py"):
            hint = ""
            if isinstance(name, str) and (name.endswith(".py") or os.sep in name or "/" in name):
                hint = ("; give the module's name, not its file (my_attn for my_attn.py in the current "
                        "directory, or put its folder on PYTHONPATH)")
            raise ConfigError(f"{where}[{i}]={name!r} is not a dotted Python module name{hint}")
        if name not in names:
            names.append(name)
    return names


def load_plugins(names: Iterable[str] = (), where: str = "plugins") -> list[str]:
    """Import the installed entry-point plugins (once per process) and the modules ``names``.

    Args:
        names: dotted module names (checked by :func:`check_plugin_names`).
        where: the option's name for error messages (``plugins`` or ``--plugin``).

    Returns:
        The names imported (or already imported).

    Raises:
        ConfigError: a name is not a module name, cannot be found (naming it and where it was
            looked for) or raises while it is imported (naming the exception and its line).
    """
    load_entry_point_plugins()
    names = check_plugin_names(list(names), where)
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)  # as `python -m` does: a module next to where the command runs
    for i, name in enumerate(names):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
                raise ConfigError(
                    f"{where}[{i}]={name!r}: no module named {exc.name!r} (looked in the current directory "
                    f"{cwd} and on sys.path; install it or add its folder to PYTHONPATH)") from exc
            raise ConfigError(f"{where}[{i}]={name!r} failed to import: {_short_trace(exc)}") from exc
        except Exception as exc:  # noqa: BLE001 - any import-time failure of user code, named
            raise ConfigError(f"{where}[{i}]={name!r} failed to import: {_short_trace(exc)}") from exc
    return names


def load_entry_point_plugins() -> None:
    """Import every installed ``rl_tformers.plugins`` entry point, once per process.

    A failing entry point warns (:class:`PluginWarning`, naming the package and the error) and
    is skipped, so one broken package does not stop every command.
    """
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
        except Exception as exc:  # noqa: BLE001 - report any failure of an installed plugin
            dist = getattr(ep.dist, "name", None) or "an installed package"
            warnings.warn(f"rl_tformers.plugins entry point {ep.name!r} ({ep.value}) of {dist} failed to import "
                          f"and is skipped: {_short_trace(exc)}", PluginWarning, stacklevel=2)


__all__ = ["ENTRY_POINT_GROUP", "PluginWarning", "check_plugin_names", "load_entry_point_plugins", "load_plugins"]
