"""Plugins: your own modules that register backbone kinds or agents, used like the built-in ones.

A researcher who writes a new attention (or position, memory, block, depth) kind, or a new
agent, registers it from a module of their own (``@ATTENTION.register("my_attn", ...)``,
``@register_agent("my_agent", ...)``, docs/backbone.md) and names that module in the run
config::

    plugins: [my_project.attention]          # or: rl-tformers train ... plugins=[my_attn]
    backbone: {attention: {kind: my_attn}}

``train`` (new runs, and the runs of a ``sweep``) imports the modules its config lists: that
config is the one you give. A run you open (``eval``, ``plot``, ``bench``, ``train --resume``,
:func:`~rl_tformers.runtime.loading.load_run`) records its ``plugins`` too, but they are code,
and a run directory may come from anyone: a module a run lists is imported only when you name it
(``--plugin MODULE``, the ``plugins`` argument of the Python loaders) or when it is an installed
entry point (:func:`named_plugins_only`); otherwise the command stops naming the option to give.
A fine-tuning agent (``odt``'s ``agent.init_from``, ``gtrxl_ppo``'s ``agent.init_checkpoint``)
only checks that the run it starts from lists no plugin this run lacks (:func:`check_source_plugins`).

A module is imported by its dotted name from ``sys.path`` (installed, or its folder on
``PYTHONPATH``), never from the current directory: its entries (``""``, ``.``, the directory's
own path, which ``python -m`` and ``PYTHONPATH=.`` add) are left out while plugins are imported,
so a file that came with a run directory or a dataset (``x.py`` next to where you run the
command) is never imported by its name.

The built-in agents are registered before any plugin is imported, so a plugin registering a
kind (agent or backbone) that is already taken fails to import with the name of the module
that holds it, whatever the order of imports. A module that fails to import leaves nothing
registered: the kinds, agents and inference loaders it registered before the error are removed
(and its modules forgotten, so a second import runs it again). Installed packages can also declare a ``rl_tformers.plugins``
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

import difflib
import importlib
import importlib.metadata
import os
import re
import sys
import traceback
import warnings
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rl_tformers.registry import REGISTRIES, SLOTS
from rl_tformers.runtime import agent_registry
from rl_tformers.runtime.agent_registry import discover_agents
from rl_tformers.runtime.errors import ConfigError

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
        ConfigError: ``value`` is not a list (a string or a mapping), or an entry is not a dotted Python module name
            (a file path, or a name ending in ``.py``, is refused with a hint), naming ``where[i]``.
    """
    if value is None:
        return []
    if isinstance(value, (str, Mapping)) or not isinstance(value, Iterable):
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

    The built-in agents are registered first (so a plugin's kind never silently replaces one);
    the current directory is left out of ``sys.path`` while ``names`` are imported (module
    docstring). A module that fails leaves nothing registered (:func:`_import_atomically`).
    Inside :func:`named_plugins_only`, a module not named there (and not imported already) is
    refused before anything of it runs.

    Args:
        names: dotted module names (checked by :func:`check_plugin_names`).
        where: the option's name for error messages (``plugins`` or ``--plugin``).

    Returns:
        The names imported (or already imported).

    Raises:
        ConfigError: a name is not a module name, is not named by the user inside
            :func:`named_plugins_only`, cannot be found (naming it and where it was looked for)
            or raises while it is imported (naming the exception and the plugin's line: a kind
            already registered names the module that registered it).
    """
    load_entry_point_plugins()
    names = check_plugin_names(list(names), where)
    if not names:
        return names
    named = _NAMED.get()
    if named is not None:
        for i, name in enumerate(names):
            if name not in named.names and name not in sys.modules:
                raise ConfigError(
                    f"{where}[{i}]={name!r} is not imported: a run's plugins are code, imported only when you "
                    f"name them ({named.option} {name}, if you trust that module) or install them as a "
                    f"{ENTRY_POINT_GROUP} entry point")
    _discover_builtin_agents()
    cwd = os.getcwd()
    saved = list(sys.path)
    searched = [p for p in saved if not _is_directory(p, cwd)]
    sys.path[:] = searched  # never a module of the current directory
    try:
        for i, name in enumerate(names):
            try:
                _import_atomically(name)
            except ModuleNotFoundError as exc:
                if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
                    raise ConfigError(
                        f"{where}[{i}]={name!r}: no module named {exc.name!r} (looked on sys.path, not in the "
                        f"current directory {cwd}; install it or add its folder to PYTHONPATH)") from exc
                raise ConfigError(f"{where}[{i}]={name!r} failed to import: {_plugin_trace(exc)}") from exc
            except Exception as exc:  # noqa: BLE001 - any import-time failure of user code, named
                raise ConfigError(f"{where}[{i}]={name!r} failed to import: {_plugin_trace(exc)}") from exc
    finally:
        added = [p for p in sys.path if p not in searched and p not in saved]
        sys.path[:] = saved + added  # as before, with what the plugins added (a vendored folder) after it
    return names


def _is_directory(entry: str, cwd: str) -> bool:
    """Whether the ``sys.path`` entry ``entry`` names the directory ``cwd`` (``""`` and ``.`` do)."""
    try:
        return os.path.realpath(entry or ".") == os.path.realpath(cwd)
    except (OSError, ValueError):
        return False


def check_env_modules(tree: Any, where: str) -> None:
    """Refuse an environment id of a run that would import a module not imported yet.

    gymnasium's ``gym.make("module:EnvId")`` imports ``module`` first; an id read from a run
    (its config or checkpoint) must not make a command import code the user did not name.

    Args:
        tree: plain nested mappings and lists (a config, a checkpoint's extra state).
        where: the dotted prefix of ``tree``'s keys in error messages.

    Raises:
        ConfigError: naming the key (``agent.env_id``) and the module, with the ``--plugin`` to
            give when that module is trusted.
    """
    if isinstance(tree, dict):
        for key, value in tree.items():
            name = f"{where}.{key}" if where else str(key)
            if str(key).endswith("env_id") and isinstance(value, str) and ":" in value:
                module = value.rpartition(":")[0]
                if module not in sys.modules:
                    raise ConfigError(
                        f"{name}={value!r} names the module {module!r}, which making the environment imports: a "
                        f"run's modules are imported only when you name them (--plugin {module}, if you trust it)")
            check_env_modules(value, name)
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            check_env_modules(value, f"{where}[{i}]")


def plugins_named_in(overrides: Iterable[str]) -> list[str]:
    """The modules a ``plugins=[...]`` command-line override names (the user's own naming).

    Args:
        overrides: ``KEY=VALUE`` strings; only ``plugins=`` ones are read (as YAML), others and
            values that are not a list of strings are skipped (composing the config reports them).
    """
    names: list[str] = []
    for item in overrides:
        key, _, value = str(item).partition("=")
        if key.strip() != "plugins":
            continue
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            continue
        if isinstance(parsed, list):
            names += [v for v in parsed if isinstance(v, str)]
    return names


@dataclass(frozen=True)
class _Named:
    names: frozenset[str]
    option: str


_NAMED: ContextVar[_Named | None] = ContextVar("rl_tformers_named_plugins", default=None)


@contextmanager
def named_plugins_only(names: Iterable[str] = (), option: str = "--plugin",
                       allowed: Iterable[str] = ()) -> Iterator[list[str]]:
    """Import the modules the user named, then let :func:`load_plugins` import only those.

    For opening a run that came from elsewhere: its config's ``plugins`` are imported inside
    this block only if named here (or imported already: an installed entry point, a module of
    this process), so a run directory never makes a command run a module it merely lists.

    Args:
        names: the modules the user named (``--plugin``), imported first (:func:`load_plugins`).
        option: the command-line option that names them, for error messages.
        allowed: modules the user named otherwise (a ``plugins=[...]`` override), not imported
            here but allowed inside the block.

    Yields:
        The names imported.

    Raises:
        ConfigError: as :func:`load_plugins` (a named module not found or failing), naming ``option``.
    """
    imported = load_plugins(names, option)
    token = _NAMED.set(_Named(frozenset(imported) | frozenset(allowed), option))
    try:
        yield imported
    finally:
        _NAMED.reset(token)


def check_source_plugins(source: Mapping[str, Any], plugins: Iterable[str] | None, where: str) -> None:
    """Refuse to start from another run (fine-tuning its checkpoint) whose ``plugins`` this run lacks.

    The model is rebuilt from the other run's backbone (and options), which may name kinds its
    plugins register: this run must list them too, so that they are imported by every command
    that rebuilds it (``eval``, ``plot``, ``--resume``, in another process) and recorded in its
    ``config.yaml`` and checkpoints.

    Args:
        source: the other run's config (plain mapping, as its checkpoint records it).
        plugins: this run's ``plugins``.
        where: the option naming that run, e.g. ``agent.init_from=runs/dt``.

    Raises:
        ValueError: naming ``where``, the modules missing from ``plugins`` and the value to give
            (``plugins=[mine,theirs]``); or naming ``where`` and the backbone kind of that run
            that no module registered here (e.g. an uninstalled entry point's).
    """
    theirs = check_plugin_names(source.get("plugins"), f"{where}: its plugins")
    ours = check_plugin_names(list(plugins or []), "plugins")
    missing = [m for m in theirs if m not in ours]
    if missing:
        raise ValueError(
            f"{where} was trained with plugins={theirs}: this run rebuilds that run's model, so list "
            f"{', '.join(missing)} in its plugins too (plugins=[{','.join(ours + missing)}]), which records "
            f"them for eval, plot and --resume")
    backbone = source.get("backbone")
    try:
        check_backbone_kinds(backbone if isinstance(backbone, Mapping) else {})
    except ConfigError as exc:
        raise ValueError(f"{where}: that run cannot be rebuilt here: {exc}") from None


def check_backbone_kinds(backbone: Mapping[str, Any]) -> None:
    """Refuse a ``backbone`` section naming a kind no module registered (yet).

    Args:
        backbone: the plain ``backbone:`` section (slot name -> ``{kind: ..., ...}``).

    Raises:
        ConfigError: naming ``backbone.<slot>.kind``, the closest registered kind, the registered
            ones and ``plugins`` (a kind of the user's own registers when its module is imported).
    """
    for slot in SLOTS:
        value = backbone.get(slot)
        if isinstance(value, Mapping) and "kind" in value and str(value["kind"]) not in REGISTRIES[slot].kinds():
            close = difflib.get_close_matches(str(value["kind"]), REGISTRIES[slot].kinds(), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(f"backbone.{slot}.kind={value['kind']!r}: unknown {slot} kind{hint} "
                              f"(registered: {', '.join(REGISTRIES[slot].kinds())}; see rl-tformers backbones; "
                              f"a kind of your own registers when its module is listed in plugins)")



def _discover_builtin_agents() -> None:
    """Register the built-in agents (and their inference loaders) before any plugin is imported."""
    discover_agents()


def _registrations() -> list[tuple[dict, dict]]:
    """``(live dict, copy)`` of every table a plugin registers into: the backbone slots' kinds,
    the agents and the inference loaders."""
    tables = [reg._entries for reg in REGISTRIES.values()] + [agent_registry._AGENTS]
    loading = sys.modules.get("rl_tformers.runtime.loading")
    if loading is not None:
        tables.append(loading._INFERENCE_LOADERS)
    return [(t, dict(t)) for t in tables]


def _import_atomically(name: str) -> None:
    """``importlib.import_module(name)``; when it raises, undo what the import registered.

    Every kind, agent and inference loader registered during the failed import is removed, and
    the modules it left in ``sys.modules`` that are part of ``name``'s top-level package or that
    defined a removed registration are forgotten, so that a later import runs them again.
    """
    if name in sys.modules:
        return
    before_modules = set(sys.modules)
    tables = _registrations()
    try:
        importlib.import_module(name)
    except BaseException:
        owners: set[str] = set()
        for live, saved in tables:
            for key in [k for k in live if k not in saved or live[k] is not saved[k]]:
                value = live[key]
                obj = getattr(value, "config_cls", None) or getattr(value, "builder", None) or value
                owners.add(getattr(obj, "__module__", "") or "")
            live.clear()
            live.update(saved)
        top = name.split(".")[0]
        for mod in set(sys.modules) - before_modules:
            if mod in owners or mod == top or mod.startswith(top + "."):
                sys.modules.pop(mod, None)
        raise


def _plugin_trace(exc: BaseException) -> str:
    """``"Error: message (file:line)"`` with the line of the plugin's own code that raised: the last
    frame outside this package and Python's import machinery (an error raised by this package's
    registry, a kind already taken, is located at the plugin's decorator), else the last frame."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = tuple(str(Path(d).resolve()) + os.sep for name in ("rl_tformers", "rl_tformers.agents", "rl_tformers.envs")
                 if name in sys.modules for d in getattr(sys.modules[name], "__path__", ()))
    own = [f for f in frames if not f.filename.startswith("<frozen ")
           and not str(Path(f.filename).resolve()).startswith(ours)]
    frame = (own or frames or [None])[-1]
    where = f" ({frame.filename}:{frame.lineno})" if frame is not None else ""
    return f"{type(exc).__name__}: {exc}{where}"


def load_entry_point_plugins() -> None:
    """Import every installed ``rl_tformers.plugins`` entry point, once per process.

    A failing entry point warns (:class:`PluginWarning`, naming the package and the error) and
    is skipped, so one broken package does not stop every command; what it registered before
    the error is removed (:func:`_import_atomically`), so nothing of it is listed or usable.
    """
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    eps = list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
    if eps:
        _discover_builtin_agents()
    for ep in eps:
        try:
            _import_atomically(ep.module)
            ep.load()
        except Exception as exc:  # noqa: BLE001 - report any failure of an installed plugin
            dist = getattr(ep.dist, "name", None) or "an installed package"
            warnings.warn(f"rl_tformers.plugins entry point {ep.name!r} ({ep.value}) of {dist} failed to import "
                          f"and is skipped: {_plugin_trace(exc)}", PluginWarning, stacklevel=2)


__all__ = ["ENTRY_POINT_GROUP", "PluginWarning", "check_env_modules", "check_plugin_names", "check_source_plugins",
           "load_entry_point_plugins", "load_plugins", "named_plugins_only", "plugins_named_in"]
