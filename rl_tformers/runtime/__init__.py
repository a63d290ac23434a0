"""The training runtime shared by every agent: config loading, agent registry, trainer,
checkpoints, seeding, device handling, logging, and the ``rl-tformers train`` command.

Main entry points (imported lazily, so ``rl-tformers --help`` does not import torch)::

    from rl_tformers.runtime import compose, train, resume, register_agent, Trainable

    cfg = compose("toy", ["train.steps=200"])      # YAML + overrides -> resolved config
    result = train(cfg, run_dir="runs/toy-1")        # new run
    result = resume("runs/toy-1", ["train.steps=400"])  # continue it exactly

See ``docs/runtime.md`` for the config schema, run directory layout and checkpoint format, and
``rl_tformers.runtime.agent_registry`` for the protocol an agent implements.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "compose": "config",
    "ConfigError": "config",
    "RunConfig": "config",
    "TrainConfig": "config",
    "EvalConfig": "config",
    "register_agent": "agents",
    "available_agents": "agents",
    "get_agent": "agents",
    "Trainable": "agents",
    "UnknownAgentError": "agents",
    "Trainer": "trainer",
    "TrainResult": "trainer",
    "train": "trainer",
    "resume": "trainer",
    "CheckpointError": "checkpoint",
    "load_checkpoint": "checkpoint",
    "find_latest_valid": "checkpoint",
    "derive_seed": "seeding",
    "seed_everything": "seeding",
    "resolve_device": "device",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"rl_tformers.runtime.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'rl_tformers.runtime' has no attribute {name!r}")
