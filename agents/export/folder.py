"""The policy folder: what a trained policy needs to act, without the training config or data.

A folder holds

- ``policy.json``: the format and its version, the agent kind and family (``bc``, ``dt``,
  ``gtrxl``), the model's configuration, the spaces (observation size, ``Box`` bounds or
  ``Discrete(n, start)``), the acting parameters (observation mean, std and clip, reward and
  return-to-go scales, context length K, window alignment, default target return...), the
  graphs' input and output names and the versions of rl-tformers, PyTorch and safetensors;
- ``model.safetensors``: the weights the policy acts with (a GTrXL's actor and encoder only);
- ``initial_memory.safetensors``: a GTrXL graph's memory of one fresh row;
- ``policy.pt`` / ``policy.onnx``: the exported graphs (:mod:`~rl_tformers.agents.export.exporters`).

Reading a folder (:func:`read_folder`) parses JSON and safetensors only: nothing is unpickled.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
import safetensors.torch
import torch
from rl_tformers.agents.bc.agent import BCPolicy
from rl_tformers.agents.bc.model import BCConfig, BCModel
from rl_tformers.agents.decision_transformer.model import DecisionTransformer, DTConfig
from rl_tformers.agents.decision_transformer.policy import DTPolicy
from rl_tformers.agents.export.graphs import BCGraph, DTGraph, GTrXLGraph, flatten_state
from rl_tformers.agents.gtrxl.agent import GTrXLPolicy, model_config_dict
from rl_tformers.agents.gtrxl.model import GTrXLConfig, GTrXLModel
from torch import nn

import rl_tformers
from rl_tformers.runtime.cpu_matmul import apply_cpu_matmul

FORMAT, FORMAT_VERSION = "rl-tformers-policy", 1
SPEC_FILE, WEIGHTS_FILE, MEMORY_FILE = "policy.json", "model.safetensors", "initial_memory.safetensors"
#: format -> file name of its graph in the folder
GRAPH_FILES = {"torchscript": "policy.pt", "onnx": "policy.onnx"}
#: family -> (input names, output names) of its graph (GTrXL adds memory_0.. / new_memory_0..)
GRAPH_IO = {
    "bc": (["observations"], ["action"]),
    "dt": (["returns_to_go", "observations", "actions", "timesteps", "mask"], ["action", "context_action"]),
    "gtrxl": (["observations", "episode_start", "last_reward", "target_return"], ["action"]),
}


class PolicyFolderError(ValueError):
    """A policy folder that cannot be read (missing file, another format or version, a bad
    field); the message names the file and field."""


def _floats(x: Any) -> list[float] | None:
    """A tensor or array as a flat list of Python floats (JSON), ``None`` for ``None``."""
    if x is None:
        return None
    return [float(v) for v in np.asarray(torch.as_tensor(x).detach().cpu(), np.float64).reshape(-1)]


def acting_spec(policy: Any, agent: Any) -> tuple[str, nn.Module, dict[str, Any], dict[str, Any]]:
    """``(family, model, model_config, acting)`` of an in-package policy (``agent.policy()``).

    Raises:
        ValueError: a policy of no exportable family (named), or a DT policy wrapped by an
            inference option (early exit, kNN-LM).
    """
    if isinstance(policy, DTPolicy):
        m = policy.model
        acting = dict(obs_mean=_floats(policy.window.obs_mean), obs_std=_floats(policy.window.obs_std),
                      rtg_scale=policy.rtg_scale, context_steps=policy.context_steps, align=policy.align,
                      timestep_overflow=policy.timestep_overflow, target_return=policy.default_target,
                      context_len=m.cfg.context_len, max_ep_len=m.cfg.max_ep_len)
        return "dt", m, m.cfg.to_dict(), _with_actions(acting, m.cfg, policy.action_start, getattr(policy, "low", None),
                                                          getattr(policy, "high", None), policy.action_shape)
    if isinstance(policy, BCPolicy):
        info = policy.info
        acting = dict(obs_mean=_floats(policy.mean), obs_std=_floats(policy.std))
        return "bc", policy.model, policy.model.cfg.to_dict(), _with_actions(
            acting, policy.model.cfg, info.action_start, getattr(policy, "low", None), getattr(policy, "high", None),
            None if info.discrete else info.action_shape)
    if isinstance(policy, GTrXLPolicy):
        m = policy.model
        targets = agent.default_targets() if hasattr(agent, "default_targets") else [None]
        acting = dict(obs_mean=_floats(policy.obs_mean), obs_std=_floats(policy.obs_std), obs_clip=policy.obs_clip,
                      rtg_scale=policy.rtg_scale, reward_mult=policy.reward_mult, return_conditioned=m.cfg.rtg_input,
                      target_return=targets[0])
        cfg = dict(model_config_dict(m.cfg), critic="none")  # the actor alone acts
        return "gtrxl", m, cfg, _with_actions(acting, m.cfg, policy.action_start, policy.low, policy.high,
                                             policy.action_shape)
    if hasattr(policy, "base") and policy.base is not policy:
        raise ValueError(f"the policy acts through {type(policy).__name__} (an inference option: early exit or the "
                         f"kNN-LM datastore), which is not exported")
    raise ValueError(f"a {type(policy).__name__} has no export (exportable: DTPolicy, BCPolicy, GTrXLPolicy)")


def _with_actions(acting: dict[str, Any], cfg: Any, start: int, low: Any, high: Any,
                  shape: Any) -> dict[str, Any]:
    """``acting`` plus the spaces: sizes, ``Discrete.start`` or the Box bounds and shape."""
    return dict(acting, obs_dim=int(cfg.obs_dim), act_dim=int(cfg.act_dim), discrete=bool(cfg.discrete),
                action_start=int(start), action_low=None if cfg.discrete else _floats(low),
                action_high=None if cfg.discrete else _floats(high),
                action_shape=None if shape is None else [int(k) for k in shape])


def build_model(family: str, model_cfg: dict[str, Any]) -> nn.Module:
    """The untrained model of ``family`` from its configuration dict (in eval mode)."""
    if family == "dt":
        return DecisionTransformer(DTConfig.from_dict(model_cfg)).eval()
    if family == "bc":
        return BCModel(BCConfig.from_dict(model_cfg)).eval()
    return GTrXLModel(GTrXLConfig(**model_cfg)).eval()


def acting_model(family: str, model: nn.Module, model_cfg: dict[str, Any]) -> nn.Module:
    """A copy of ``model`` with what acting uses (a GTrXL's encoder and actor), PyTorch's own
    ``nn.Linear`` (:func:`~rl_tformers.runtime.cpu_matmul.apply_cpu_matmul` ``mkl``), eval mode."""
    out = build_model(family, model_cfg)
    state = model.state_dict()
    if family == "gtrxl":
        state = {k: v for k, v in state.items() if k.startswith(("encoder.", "actor."))}
    out.load_state_dict(state)
    apply_cpu_matmul(out, "mkl")
    return out.eval()


def make_graph(family: str, model: nn.Module, acting: dict[str, Any]) -> nn.Module:
    """The acting graph (:mod:`~rl_tformers.agents.export.graphs`) of ``model``."""
    if family == "dt":
        return DTGraph(model, acting).eval()
    if family == "bc":
        return BCGraph(model, acting).eval()
    return GTrXLGraph(model, acting, initial_backbone_memory(model, 1)).eval()


def initial_backbone_memory(model: GTrXLModel, n: int) -> Any:
    """The backbone part of a GTrXL graph's memory for ``n`` fresh rows: its backbone state, or
    the plain window's (inputs, steps, validity) zeros."""
    enc, cfg = model.encoder, model.cfg
    if enc.stateful:
        return enc.initial_state(n, "cpu")
    w = cfg.window
    return (torch.zeros(n, w, cfg.input_dim), torch.zeros(n, w, dtype=torch.long), torch.zeros(n, w, dtype=torch.bool))


def initial_memory(model: GTrXLModel) -> list[torch.Tensor]:
    """The memory inputs of one fresh row of a GTrXL graph: return-to-go 0, previous action (-1 or
    zeros), step 0, then the backbone's (:class:`~rl_tformers.agents.export.graphs.GTrXLGraph`)."""
    cfg = model.cfg
    prev = torch.full((1,), -1, dtype=torch.long) if cfg.discrete else torch.zeros(1, cfg.act_dim)
    return [torch.zeros(1, dtype=torch.float64), prev, torch.zeros(1, dtype=torch.long),
            *flatten_state(initial_backbone_memory(model, 1))]


def graph_io(family: str, n_memory: int) -> tuple[list[str], list[str]]:
    """Input and output names of a family's graph with ``n_memory`` memory tensors."""
    ins, outs = GRAPH_IO[family]
    return ins + [f"memory_{i}" for i in range(n_memory)], outs + [f"new_memory_{i}" for i in range(n_memory)]


def write_folder(out: Path, kind: str, family: str, model: nn.Module, model_cfg: dict[str, Any],
                 acting: dict[str, Any], env_id: str | None) -> dict[str, Any]:
    """Write ``policy.json``, ``model.safetensors`` (and a GTrXL's ``initial_memory.safetensors``)
    into ``out`` (created); returns the JSON's dict. ``model`` is the :func:`acting_model`."""
    out.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_model(model, str(out / WEIGHTS_FILE), metadata={"format": FORMAT})
    n_memory = 0
    if family == "gtrxl":
        mem = initial_memory(model)
        safetensors.torch.save_file({f"memory_{i}": t.contiguous() for i, t in enumerate(mem)}, str(out / MEMORY_FILE))
        n_memory = len(mem)
    ins, outs = graph_io(family, n_memory)
    spec = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "agent": kind, "family": family, "env_id": env_id,
        "model": model_cfg, "acting": acting, "inputs": ins, "outputs": outs, "graphs": {},
        "versions": {"rl_tformers": rl_tformers.__version__, "torch": torch.__version__,
                     "safetensors": safetensors.__version__},
    }
    write_spec(out, spec)
    return spec


def write_spec(out: Path, spec: dict[str, Any]) -> None:
    """Write ``policy.json`` (sorted keys; non-finite bounds as JSON's ``Infinity``)."""
    (out / SPEC_FILE).write_text(json.dumps(_jsonable(spec), indent=2, sort_keys=True) + "\n")


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _jsonable(dataclasses.asdict(x))
    if isinstance(x, (np.generic,)):
        return x.item()
    if isinstance(x, float) and math.isnan(x):
        raise ValueError("a NaN in the policy's acting parameters")
    return x


def read_folder(path: Path) -> tuple[dict[str, Any], nn.Module, list[torch.Tensor]]:
    """``(spec, model, initial_memory)`` of a policy folder: JSON and safetensors, nothing unpickled.

    Raises:
        PolicyFolderError: not a folder, a missing or unreadable file, another format or a newer
            version, an unknown family, weights that do not fit the model (each names the file).
    """
    spec_path = path / SPEC_FILE
    if not spec_path.is_file():
        raise PolicyFolderError(f"{path}: no {SPEC_FILE} (expected a folder written by rl-tformers export)")
    try:
        spec = json.loads(spec_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PolicyFolderError(f"{spec_path}: not readable JSON ({exc})") from None
    if not isinstance(spec, dict) or spec.get("format") != FORMAT:
        raise PolicyFolderError(f"{spec_path}: format is {spec.get('format') if isinstance(spec, dict) else None!r}, "
                                f"not {FORMAT!r}")
    if not isinstance(spec.get("format_version"), int) or spec["format_version"] > FORMAT_VERSION:
        raise PolicyFolderError(f"{spec_path}: format_version {spec.get('format_version')!r} is newer than this "
                                f"rl-tformers reads ({FORMAT_VERSION})")
    if spec.get("family") not in GRAPH_IO:
        raise PolicyFolderError(f"{spec_path}: family {spec.get('family')!r} is not one of {', '.join(GRAPH_IO)}")
    try:
        model = build_model(spec["family"], spec["model"])
        missing, unexpected = safetensors.torch.load_model(model, str(path / WEIGHTS_FILE), strict=True)
        memory = []
        if spec["family"] == "gtrxl":
            mem = safetensors.torch.load_file(str(path / MEMORY_FILE))
            memory = [mem[f"memory_{i}"] for i in range(len(mem))]
    except (OSError, RuntimeError, KeyError, TypeError, ValueError, safetensors.SafetensorError) as exc:
        raise PolicyFolderError(f"{path}: the model cannot be rebuilt from {SPEC_FILE} and {WEIGHTS_FILE}: "
                                f"{str(exc).splitlines()[0]}") from None
    return spec, model.eval(), memory
