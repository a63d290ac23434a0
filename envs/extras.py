"""Optional dependencies (extras of the package) an environment id may need, and the error
raised when one is missing."""

from __future__ import annotations

#: the command that installs POPGym with the package
POPGYM_INSTALL = "pip install 'rl-tformers[popgym]'"
#: the command that installs the Atari (ale-py with its ROMs, opencv-python-headless) and MinAtar
#: dependencies with the package
ATARI_INSTALL = "pip install 'rl-tformers[atari]'"


class MissingExtraError(ValueError):
    """An environment id needs an optional dependency (an extra of the package) that is not installed."""
