"""Import a module of the repository's scripts/ folder in a test (the folder is not a package)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def script_module(name: str) -> ModuleType:
    """``scripts/<name>.py`` as a module (imported once, then cached in ``sys.modules``)."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)
