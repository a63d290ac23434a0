"""Export a trained run to a policy folder with a TorchScript or ONNX graph (``rl-tformers export``).

:func:`export_run` loads the run (:func:`~rl_tformers.runtime.loading.load_run`), takes its
in-package policy apart (:func:`~rl_tformers.agents.export.folder.acting_spec`), writes the
policy folder (:mod:`~rl_tformers.agents.export.folder`), traces the acting graph
(:mod:`~rl_tformers.agents.export.graphs`) with ``torch.jit.trace`` and saves it as TorchScript
(``policy.pt``) or through PyTorch's TorchScript-based ONNX exporter (``policy.onnx``, opset
:data:`OPSET`, the batch dimension dynamic).

A traced graph keeps the Python branches its example took. So that no such branch goes
unnoticed, every export is verified: the saved graph is run on a probe of episodes (the DT's
window filling up and sliding, a GTrXL's memory filling and rows starting new episodes
midway, at another batch size than the trace's) and must give the eager graph's outputs within
:data:`ATOL` (float32) and exactly for integer outputs (discrete actions, steps); otherwise the
export is refused (:class:`ExportRefused`) naming the backbone's kinds and the format. Kinds
known not to export are refused before anything is traced (:data:`REFUSED`, checked against
what export does by ``tests/export/test_export_kinds.py``).
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf
from rl_tformers.agents.export.folder import (
    GRAPH_FILES,
    SPEC_FILE,
    WEIGHTS_FILE,
    acting_model,
    acting_spec,
    initial_memory,
    make_graph,
    write_folder,
    write_spec,
)
from rl_tformers.agents.export.policy import Policy, onnx_runner, torch_runner, torchscript_runner
from torch import nn

from rl_tformers.registry import SLOTS
from rl_tformers.runtime.loading import load_run
from rl_tformers.runtime.protocol import policy_options

FORMATS = tuple(GRAPH_FILES)
OPSET = 17
#: largest difference of a float output of an exported graph from the eager graph's
ATOL = 1e-5

_UNFOLD = ("its blocks of keys are cut with Tensor.unfold, which PyTorch's ONNX exporter does not export here "
           "(the size of the unfolded tensor is not known to it)")
#: (slot, kind) -> {format: why it cannot be exported}; the kinds not named export to both
#: (docs/deployment.md lists them; tests/export/test_export_kinds.py checks both against export)
REFUSED: dict[tuple[str, str], dict[str, str]] = {
    **{("attention", k): {"onnx": _UNFOLD} for k in ("adaptive_span", "blockwise", "etc", "fixed", "local",
                                                     "longformer", "sliding_window", "strided")},
    ("attention", "bigbird"): dict.fromkeys(FORMATS, "its random block pattern is held in an unsigned integer "
                                                     "tensor, which the TorchScript tracer cannot hold"),
    ("attention", "lsh"): {"onnx": "its bucket sort uses aten::cummax, which has no ONNX operator at opset 17"},
    ("attention", "routing"): {"onnx": "its cluster assignment uses aten::searchsorted, which has no ONNX operator "
                                       "at opset 17"},
    ("memory", "compressive"): dict.fromkeys(FORMATS, "its memory grows until its compressed part is full, so the "
                                                      "memory tensors change shape between steps"),
    ("depth", "early_exit"): dict.fromkeys(FORMATS, "its layer loop stops once the deciding tokens are confident "
                                                    "(data-dependent), which a traced graph cannot follow"),
}


class ExportRefused(ValueError):
    """A run whose policy cannot be exported to a format; the message names the kind and format."""


def backbone_kinds(model_cfg: dict[str, Any]) -> dict[str, str]:
    """``{slot: kind}`` of the backbone in a model configuration dict (empty for BC)."""
    bb = model_cfg.get("backbone") or {}
    return {s: str((bb.get(s) or {}).get("kind")) for s in SLOTS if isinstance(bb.get(s), dict)}


def check_exportable(kinds: dict[str, str], fmt: str) -> None:
    """Refuse kinds of :data:`REFUSED` for ``fmt`` (message: ``backbone.<slot>.kind=<kind> cannot
    be exported to <format>: <why>``).

    Raises:
        ExportRefused: the first refused kind.
    """
    for slot, kind in kinds.items():
        why = REFUSED.get((slot, kind), {}).get(fmt)
        if why:
            raise ExportRefused(f"backbone.{slot}.kind={kind} cannot be exported to {fmt}: {why}")


def export_run(run_dir: str | Path, fmt: str, out: str | Path, plugins: Iterable[str] = ()) -> Path:
    """Write the policy folder of ``run_dir`` with its ``fmt`` graph into ``out``; returns ``out``.

    Exporting the other format into the same folder afterwards adds its graph beside the first
    (the weights are the same, checked by their SHA-256).

    Raises:
        ValueError: ``fmt`` not in :data:`FORMATS`.
        ExportRefused: a kind that cannot be exported to ``fmt``, or a graph whose outputs
            differ from the eager graph's (module docstring).
        CheckpointError, ConfigError: as :func:`~rl_tformers.runtime.loading.load_run`.
    """
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r}; use one of {', '.join(FORMATS)}")
    run = load_run(run_dir, plugins=plugins)
    backbone = OmegaConf.to_container(run.cfg.backbone, resolve=True) if run.cfg.get("backbone") else {}
    check_exportable(backbone_kinds({"backbone": backbone}), fmt)  # before the policy: early exit wraps it
    agent = run.agent
    policy = agent.policy(deterministic=True) if "deterministic" in policy_options(agent) else agent.policy()
    family, model, model_cfg, acting = acting_spec(policy, agent)
    return export_model(family, model, model_cfg, acting, fmt, Path(out), kind=run.kind, env_id=run.env_id)


def export_model(family: str, model: nn.Module, model_cfg: dict[str, Any], acting: dict[str, Any], fmt: str,
                 out: Path, *, kind: str = "", env_id: str | None = None, known_refusals: bool = True) -> Path:
    """:func:`export_run` from a trained model and its acting parameters (those of
    :func:`~rl_tformers.agents.export.folder.acting_spec`). ``known_refusals=False`` tries the
    kinds of :data:`REFUSED` too (how that table is checked). Raises as :func:`export_run`."""
    kinds = backbone_kinds(model_cfg)
    if known_refusals:
        check_exportable(kinds, fmt)
    m = acting_model(family, model, model_cfg)
    previous = _previous_graphs(out)
    spec = write_folder(out, kind, family, m, model_cfg, acting, env_id)
    spec["weights_sha256"] = _sha256(out / WEIGHTS_FILE)
    graph = make_graph(family, m, acting)
    probe = probe_inputs(spec, graph)
    path = out / GRAPH_FILES[fmt]
    try:
        _save(graph, probe[0], fmt, path, spec)
        run = torchscript_runner(path) if fmt == "torchscript" else onnx_runner(path, spec["inputs"], 1)
        bad = _first_difference(torch_runner(graph), run, probe, spec["outputs"])
    except Exception as exc:  # noqa: BLE001 - any failure of the exporter or the saved graph is a refusal
        bad = f"the exporter failed: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    if bad:
        path.unlink(missing_ok=True)
        what = ", ".join(f"backbone.{s}.kind={k}" for s, k in kinds.items()) or f"the {family} model"
        raise ExportRefused(f"{what} cannot be exported to {fmt}: {bad}")
    keep = previous if previous.get("weights_sha256") == spec["weights_sha256"] else {}
    spec["graphs"] = {**{f: p for f, p in keep.get("graphs", {}).items() if (out / p).is_file()}, fmt: path.name}
    write_spec(out, spec)
    return out


def _previous_graphs(out: Path) -> dict[str, Any]:
    """The ``policy.json`` already in ``out`` (its graphs and weights hash), or ``{}``."""
    try:
        return json.loads((out / SPEC_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _save(graph: nn.Module, example: list[np.ndarray], fmt: str, path: Path, spec: dict[str, Any]) -> None:
    """Trace ``graph`` on ``example`` and save it to ``path`` as ``fmt``."""
    args = tuple(torch.from_numpy(np.ascontiguousarray(x)) for x in example)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # tracer warnings: the verification decides
        if fmt == "torchscript":
            torch.jit.trace(graph, args, check_trace=False).save(str(path))
            return
        axes = {name: {0: "batch"} for name in [*spec["inputs"], *spec["outputs"]]}
        torch.onnx.export(graph, args, str(path), dynamo=False, opset_version=OPSET, input_names=spec["inputs"],
                          output_names=spec["outputs"], dynamic_axes=axes)


def probe_inputs(spec: dict[str, Any], graph: nn.Module, n: int = 3, seed: int = 0) -> list[list[np.ndarray]]:
    """The graph's inputs over a probe of episodes of ``n`` rows (the first at n - 1 rows, the
    trace's example): random observations around the normalisation's mean and random rewards,
    ``K + 3`` steps (DT: the window fills up and slides) or ``M + 3`` (GTrXL: memory M), row 1
    starting a new episode midway."""
    rng = np.random.default_rng(seed)
    acting = spec["acting"]
    mean, std = np.asarray(acting["obs_mean"], np.float32), np.asarray(acting["obs_std"], np.float32)
    span = int(acting.get("context_len") or _memory_len(spec)) + 3
    recorded: list[list[np.ndarray]] = []
    eager = torch_runner(graph)

    def record(inputs: list[np.ndarray]) -> list[np.ndarray]:
        recorded.append([x.copy() for x in inputs])
        return eager(inputs)

    target = acting.get("target_return")
    for rows, steps in ((n - 1, 2), (n, span)):
        policy = Policy(spec, record, "eager", [m.numpy() for m in _initial(spec, graph)])
        state = policy.initial_state(rows, 1.0 if target is None else None)
        reward = None
        for t in range(steps):
            start = np.zeros(rows, bool) if t else np.ones(rows, bool)
            if t == steps // 2 and rows > 1:
                start[1] = True
            obs = (mean + std * rng.normal(size=(rows, mean.size))).astype(np.float32)
            _, state = policy.act(obs, state, start, reward)
            reward = rng.normal(size=rows)
    return [recorded[1], *recorded[2:]]  # the trace's example first: n - 1 rows, a partly filled state


def _memory_len(spec: dict[str, Any]) -> int:
    """Memory slots M of a GTrXL backbone (its window W in window mode; 4 otherwise)."""
    model = spec["model"]
    mem = (model.get("backbone") or {}).get("memory") or {}
    return int(model.get("window") or mem.get("mem_len") or 4)


def _initial(spec: dict[str, Any], graph: nn.Module) -> list[torch.Tensor]:
    return initial_memory(graph.model) if spec["family"] == "gtrxl" else []


def _first_difference(eager, exported, probe: list[list[np.ndarray]], names: list[str]) -> str | None:
    """How the exported graph's outputs first differ from the eager graph's on ``probe``, or None."""
    for i, inputs in enumerate(probe):
        for name, want, got in zip(names, eager(inputs), exported(inputs)):
            got = np.asarray(got)
            if want.shape != got.shape:
                return f"output {name} has shape {got.shape} at probe step {i}, the eager graph's {want.shape}"
            if want.dtype.kind in "iub":
                same = np.array_equal(want, got.astype(want.dtype))
            else:
                same = np.allclose(want, got, rtol=0.0, atol=ATOL)
            if not same:
                diff = np.max(np.abs(want.astype(np.float64) - got.astype(np.float64)))
                return (f"its output {name} differs from the eager graph's by {diff:.3g} at probe step {i} "
                        f"(a data-dependent branch or operator the trace does not follow)")
    return None
