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

``cpu_matmul: auto`` is resolved into the config itself (``cpu_matmul: onednn``: a resume
computes with the library the run was trained with); the block records why
(:func:`cpu_matmul_values`): the GFLOP/s of each library measured on the run's shapes, the
thread count they were measured at and whether the measurement ran in this process or came
from the cache (:mod:`rl_tformers.runtime.cpu_matmul`)::

    #   cpu_matmul: mkl
    #   cpu_matmul.gflops_mkl: 131.2
    #   cpu_matmul.gflops_onednn: 128.9
    #   cpu_matmul.source: measured
    #   cpu_matmul.threads: 1
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from rl_tformers.runtime.cpu_matmul import recorded_choice

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


def read_resolved_file(path: str | os.PathLike) -> dict[str, Any]:
    """:func:`read_resolved` of the file ``path`` ({} when it cannot be read or has no block)."""
    try:
        return read_resolved(Path(path).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}


#: the ``cpu_matmul.*`` entries of the block (after ``cpu_matmul`` itself)
CPU_MATMUL_KEYS = ("cpu_matmul.gflops_mkl", "cpu_matmul.gflops_onednn", "cpu_matmul.source", "cpu_matmul.threads")


def cpu_matmul_values(cfg: Any, previous: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The block's record of ``cfg.cpu_matmul`` (:data:`CPU_MATMUL_KEYS`): the ``auto`` choice
    this process made for ``cfg``'s shapes at its thread count
    (:func:`~rl_tformers.runtime.cpu_matmul.recorded_choice`) when it picked ``cfg.cpu_matmul``;
    else those entries of ``previous`` (the run's earlier block: a resume keeps the record of
    the measurement its library came from) when it names the same library; else {} (a library
    given by name in a process that resolved no ``auto`` for the same shapes, a build without
    oneDNN)."""
    library = str(cfg.get("cpu_matmul", "mkl"))
    choice = recorded_choice(cfg)
    if choice is not None and choice.library == library and choice.gflops:
        return {"cpu_matmul.gflops_mkl": round(choice.gflops["mkl"], 1),
                "cpu_matmul.gflops_onednn": round(choice.gflops["onednn"], 1),
                "cpu_matmul.source": choice.source, "cpu_matmul.threads": choice.threads}
    previous = previous or {}
    if previous.get("cpu_matmul") == library and all(k in previous for k in CPU_MATMUL_KEYS):
        return {k: previous[k] for k in CPU_MATMUL_KEYS}
    return {}


__all__ = ["CPU_MATMUL_KEYS", "HEADER", "cpu_matmul_values", "read_resolved", "read_resolved_file", "resolved_block",
           "resolved_line", "split_resolved"]
