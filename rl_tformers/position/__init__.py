"""Positional encodings (one module per kind; all register in rl_tformers.registry.POSITION)."""

from rl_tformers._discover import import_submodules

import_submodules(__name__)
