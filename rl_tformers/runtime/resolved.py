"""The effective values of the options a run resolves when it starts, as its ``config.yaml``,
first log line and TensorBoard hparams record them.

A config leaves some choices to the run: ``device: auto`` (the device found here),
``cpu_matmul: auto`` (resolved when the config is composed), ``agent.reward_scale: auto`` (a
power of ten from the dataset's returns), ``agent.align: auto``, the number of torch threads.
The trainer collects what each became (:meth:`~rl_tformers.runtime.trainer.Trainer.resolved_values`;
an agent adds its own with ``resolved_options()``) and writes them at the top of ``config.yaml``
as a block of YAML comments::

    # resolved at start (the values this run uses where its config leaves the choice to it;
    # recorded, never read back):
    #   agent.reward_scale: 1000.0
    #   device: cpu
    #   torch.num_threads: 2

Comments, so that ``config.yaml`` stays a config that composes as it did (``--config
RUN/config.yaml``, ``--resume``, sweeps) and the recorded values are never applied to another
run or machine. :func:`read_resolved` reads the block back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

#: The first line of the block in ``config.yaml``.
HEADER = ("# resolved at start (the values this run uses where its config leaves the choice to it;\n"
          "# recorded, never read back):\n")
_ITEM = "#   "


def _scalar(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("\n...").strip()


def resolved_block(values: Mapping[str, Any]) -> str:
    """The comment block of ``values`` (dotted key -> a YAML scalar), keys sorted; ``""`` when empty."""
    if not values:
        return ""
    return HEADER + "".join(f"{_ITEM}{k}: {_scalar(values[k])}\n" for k in sorted(values))


def split_resolved(text: str) -> tuple[str, str]:
    """``(block, config)``: the text of ``config.yaml`` cut after its resolved block (``""`` when it has none)."""
    if not text.startswith(HEADER):
        return "", text
    lines = text.splitlines(keepends=True)
    n = HEADER.count("\n")
    while n < len(lines) and lines[n].startswith(_ITEM):
        n += 1
    return "".join(lines[:n]), "".join(lines[n:])


def read_resolved(text: str) -> dict[str, Any]:
    """The values of the resolved block at the top of ``config.yaml``'s ``text`` ({} without one)."""
    block, _ = split_resolved(text)
    items = [line[len(_ITEM):] for line in block.splitlines(keepends=True)[HEADER.count("\n"):]]
    return dict(yaml.safe_load("".join(items)) or {}) if items else {}


def resolved_line(values: Mapping[str, Any]) -> str:
    """``key=value, ...`` of ``values``, keys sorted (the run's first log line)."""
    return ", ".join(f"{k}={_scalar(values[k])}" for k in sorted(values))


__all__ = ["HEADER", "read_resolved", "resolved_block", "resolved_line", "split_resolved"]
