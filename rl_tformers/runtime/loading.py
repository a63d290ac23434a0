"""Load any trained run for evaluation and plotting, whatever its agent kind.

``rl-tformers eval`` / ``plot`` call :func:`load_run`: it reads the newest valid checkpoint of
``RUN_DIR`` (or a given one), takes the agent kind from the checkpoint's config and rebuilds
the agent through the runtime's agent registry. Two ways, in order:

1. an *inference loader* registered for the kind with :func:`register_inference_loader`:
   ``loader(cfg, checkpoint_state, device) -> agent`` rebuilds the agent from the checkpoint
   alone (DT and BC do this: no dataset is read);
2. otherwise the kind's training builder ``builder(cfg, run_dir, device)`` (which may load the
   dataset), then ``model.load_state_dict`` and ``load_extra_state``.

The agent returned must offer the :class:`~rl_tformers.runtime.protocol.EvaluableAgent` members. Its extra state should hold
``env_id`` (normalised scores are looked up from it), and, for the plot, ``dataset_return_max``,
``dataset_return_mean`` and ``dataset_return_min`` (raw units).

Advice about the run's settings given when its backbone is built
(:class:`~rl_tformers.backbone_config.ConfigAdviceWarning`) is said once, when the run is trained; loading
it here does not repeat it.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from rl_tformers.backbone_config import ConfigAdviceWarning
from rl_tformers.runtime import checkpoint as ckpt
from rl_tformers.runtime.agent_registry import AgentEntry, get_agent
from rl_tformers.runtime.cpu_matmul import apply_cpu_matmul, resolve_cpu_matmul
from rl_tformers.runtime.errors import ConfigError
from rl_tformers.runtime.plugins import (
    check_backbone_kinds,
    check_env_modules,
    load_plugins,
    named_plugins_only,
)
from rl_tformers.runtime.protocol import EVALUABLE_METHODS, InferenceLoader

#: kind -> loader(cfg, checkpoint state, device) -> agent
_INFERENCE_LOADERS: dict[str, InferenceLoader] = {}


def register_inference_loader(kind: str):
    """Decorator: ``loader(cfg, state, device) -> agent`` used by :func:`load_run` for ``kind``."""

    def deco(fn):
        _INFERENCE_LOADERS[kind] = fn
        return fn

    return deco


class NotEvaluableError(ConfigError):
    """A run whose agent kind has no ``policy``/``make_env``/``default_targets`` (bad input of a
    command that evaluates it: exit 2)."""


@dataclass
class LoadedRun:
    """A run ready to evaluate.

    Attributes:
        agent: an :class:`~rl_tformers.runtime.protocol.EvaluableAgent` with the checkpoint's weights, in eval mode.
        cfg: the run's resolved config (OmegaConf, read-only).
        kind: ``cfg.agent.kind``.
        step: optimiser updates of the checkpoint.
        checkpoint: path of the checkpoint used.
        extra: the checkpoint's extra state (``env_id``, dataset return statistics...).
    """

    agent: Any
    cfg: Any
    kind: str
    step: int
    checkpoint: Path
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def env_id(self) -> str | None:
        """``extra["env_id"]``: the environment the run was trained for, or ``None``."""
        return self.extra.get("env_id")

    @property
    def dataset_return_max(self) -> float | None:
        """Largest episode return of the training dataset (raw units), or ``None``."""
        v = self.extra.get("dataset_return_max")
        return None if v is None else float(v)

    @property
    def dataset_return_min(self) -> float | None:
        """Smallest episode return of the training dataset (raw units), or ``None``."""
        v = self.extra.get("dataset_return_min")
        return None if v is None else float(v)

    @property
    def dataset_return_mean(self) -> float | None:
        """Mean episode return of the training dataset (raw units), or ``None``."""
        v = self.extra.get("dataset_return_mean")
        return None if v is None else float(v)


def _run_cpu_matmul(cfg: Any) -> str:
    """The library of the run's float32 CPU ``nn.Linear`` products (``cpu_matmul``, resolved when
    it was trained; ``mkl``, PyTorch's default, for a run saved before the option existed), or
    ``mkl`` with a warning where this PyTorch build lacks oneDNN's operator or does not know the
    recorded value (the same function, another float rounding)."""

    spec = str(cfg.get("cpu_matmul", "mkl"))
    try:
        return resolve_cpu_matmul(spec)
    except ValueError as exc:
        warnings.warn(f"{exc}; evaluating with mkl (PyTorch's default)", stacklevel=3)
        return "mkl"


def load_run(run_dir: str | os.PathLike, device: str | torch.device = "cpu",
             checkpoint: str | os.PathLike | None = None, plugins: Iterable[str] = ()) -> LoadedRun:
    """Rebuild the agent of ``run_dir`` from a checkpoint (see the module docstring).

    Nothing the run holds is run as code: the checkpoint is read with ``weights_only=True``
    (:func:`~rl_tformers.runtime.checkpoint.load_checkpoint`), and a module of the run's
    ``plugins`` is imported only when ``plugins`` names it (or it is an installed entry point:
    :func:`~rl_tformers.runtime.plugins.named_plugins_only`), never from the current directory.

    Args:
        run_dir: a run directory written by ``rl-tformers train``.
        device: where the model runs.
        checkpoint: a specific checkpoint file (default: the newest valid one).
        plugins: the modules the caller trusts (``--plugin``), imported first.

    Raises:
        CheckpointError: ``run_dir`` is not a directory, or no valid checkpoint (message names the files).
        UnknownAgentError: the run's agent kind is not registered here.
        ConfigError: a module of the run's ``plugins`` is not named in ``plugins`` (nor installed),
            is not found or fails to import, or the run's backbone names a kind that is not
            registered here (named).
        NotEvaluableError: the rebuilt agent lacks ``policy``/``make_env``/``default_targets``.
    """
    run_dir = Path(run_dir)
    path, state = _read_checkpoint(run_dir, checkpoint)
    cfg = OmegaConf.create(state["config"])
    OmegaConf.set_readonly(cfg, True)
    kind = str(cfg.agent.kind)
    _check_rebuildable(run_dir, cfg, state, plugins)
    entry = get_agent(kind)  # also imports every agent module (registers inference loaders)
    dev = torch.device(device)
    agent = _rebuild_agent(run_dir, cfg, state, entry, dev)
    missing = [m for m in EVALUABLE_METHODS if not callable(getattr(agent, m, None))]
    if missing:
        raise NotEvaluableError(f"agent {kind!r} cannot be evaluated: it lacks {', '.join(m + '()' for m in missing)}")
    agent.model.to(dev).eval()
    if dev.type == "cpu":
        apply_cpu_matmul(agent.model, _run_cpu_matmul(cfg))
    return LoadedRun(agent=agent, cfg=cfg, kind=kind, step=int(state["step"]), checkpoint=path,
                     extra=dict(state.get("extra") or {}))


def _read_checkpoint(run_dir: Path, checkpoint: str | os.PathLike | None) -> tuple[Path, dict[str, Any]]:
    """``(path, state)`` of ``checkpoint``, or of the newest valid checkpoint of ``run_dir``.

    Raises:
        CheckpointError: as :func:`load_run`.
    """
    if checkpoint is None and not run_dir.is_dir():
        what = "is not a directory" if run_dir.exists() else "does not exist"
        hint = ""
        if run_dir.is_file() and run_dir.parent.name == ckpt.CHECKPOINT_DIR:
            hint = (f"; it is a checkpoint of the run {run_dir.parent.parent}: pass that run directory "
                    f"(rl-tformers eval and plot take a specific checkpoint as --checkpoint FILE)")
        raise ckpt.CheckpointError(f"{run_dir} {what} (expected a run directory written by rl-tformers train){hint}")
    if checkpoint is not None:
        path = Path(checkpoint)
        return path, ckpt.load_checkpoint(path)
    found = ckpt.find_latest_valid(run_dir)
    return found.path, found.state


def _check_rebuildable(run_dir: Path, cfg: DictConfig, state: Mapping[str, Any], plugins: Iterable[str]) -> None:
    """Import the run's plugins that the caller named, and check that the environment modules and
    backbone kinds the run names are available here.

    Raises:
        ConfigError: as :func:`load_run`.
    """
    with named_plugins_only(plugins, "--plugin"):  # its own kinds first, if the caller named them
        load_plugins(cfg.get("plugins") or [], "plugins (of the checkpoint's config)")
    check_env_modules(OmegaConf.to_container(cfg, resolve=False), "")
    check_env_modules(state.get("extra") or {}, "extra (of the checkpoint)")
    try:
        backbone = cfg.get("backbone")  # an agent without a backbone (MLP BC) may have none or an empty one
        check_backbone_kinds(OmegaConf.to_container(backbone, resolve=True) if OmegaConf.is_config(backbone) else {})
    except ConfigError as exc:
        raise ConfigError(f"the run {run_dir} cannot be rebuilt here: {exc}") from None


def _rebuild_agent(run_dir: Path, cfg: DictConfig, state: Mapping[str, Any], entry: AgentEntry,
                   dev: torch.device) -> Any:
    """The agent of the checkpoint ``state``: built by the kind's inference loader when it has one,
    else by its builder with the checkpoint's weights and extra state loaded."""
    loader = _INFERENCE_LOADERS.get(str(cfg.agent.kind))
    with warnings.catch_warnings():
        # advice about the run's settings (attn_dropout unused by the kernel...) was given when the
        # run was trained; its config is fixed now, so it is not repeated at every eval / plot
        warnings.simplefilter("ignore", ConfigAdviceWarning)
        if loader is not None:
            return loader(cfg, state, dev)
        agent = entry.builder(cfg, run_dir, dev)
        agent.model.load_state_dict(state["model"])
        load_extra = getattr(agent, "load_extra_state", None)
        if callable(load_extra):
            load_extra(state["extra"])
    return agent
