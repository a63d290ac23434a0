"""The error every layer of the runtime raises for an unusable config (the lowest runtime module:
it imports nothing of the package, so the run config, the agent registry and the plugins share it)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config cannot be used; the message names the dotted key or the file at fault."""
