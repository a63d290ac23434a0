"""Import every module of a slot package so that its kinds register themselves."""

from __future__ import annotations

import importlib
import pkgutil
import sys


def import_submodules(package: str) -> None:
    """Import all direct submodules of ``package`` (files starting with ``_`` are skipped)."""
    pkg = sys.modules[package]
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"{package}.{info.name}")
