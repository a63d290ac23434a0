"""A deployed policy: ``rl_tformers.Policy.load(DIR).act(obs, state)`` on a policy folder.

:class:`Policy` follows the acting protocol of :class:`rl_tformers.runtime.protocol.Policy`
(``initial_state(n, target_return)``, ``act(obs, state, episode_start, last_reward)``) with the
state always the caller's, and runs the folder's acting graph with one of three backends:

- ``eager`` (default): the model rebuilt from ``policy.json`` and ``model.safetensors`` in
  PyTorch; nothing is unpickled;
- ``torchscript``: ``policy.pt`` through ``torch.jit.load``;
- ``onnx``: ``policy.onnx`` through onnxruntime (CPU; ``pip install onnxruntime``).

Between steps the state is NumPy (:mod:`~rl_tformers.agents.export.runtime`), the same for every
backend: the DT's context window, the GTrXL's memory tensors, ``None`` for BC.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rl_tformers.agents.export.folder import GRAPH_FILES, PolicyFolderError, make_graph, read_folder
from rl_tformers.agents.export.runtime import DTContext, GTrXLMemory, episode_starts

BACKENDS = ("eager", "torchscript", "onnx")

#: inputs (NumPy arrays, in the graph's order) -> outputs (NumPy arrays)
Runner = Callable[[list[np.ndarray]], list[np.ndarray]]


def torch_runner(module: Callable[..., Any]) -> Runner:
    """A runner of a PyTorch module or TorchScript function (no gradients)."""

    def run(inputs: list[np.ndarray]) -> list[np.ndarray]:
        with torch.no_grad():
            out = module(*(torch.from_numpy(np.ascontiguousarray(x)) for x in inputs))
        return [o.numpy() for o in out]

    return run


def torchscript_runner(path: Path) -> Runner:
    """A runner of a TorchScript graph file (``torch.jit.load`` on the CPU)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript is in maintenance; it still loads
        return torch_runner(torch.jit.load(str(path), map_location="cpu"))


def onnx_runner(path: Path, input_names: Sequence[str], threads: int | None = None) -> Runner:
    """A runner of an ONNX graph under onnxruntime's CPU provider (``threads``: its intra-op
    threads; ``None``: onnxruntime's default)."""
    import onnxruntime as ort  # optional dependency: only the onnx backend needs it

    opts = ort.SessionOptions()
    if threads is not None:
        opts.intra_op_num_threads, opts.inter_op_num_threads = int(threads), 1
    session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    used = {i.name for i in session.get_inputs()}  # the exporter drops inputs no output depends on
    names = list(input_names)

    def run(inputs: list[np.ndarray]) -> list[np.ndarray]:
        return session.run(None, {k: x for k, x in zip(names, inputs) if k in used})

    return run


class Policy:
    """A policy read from a policy folder (module docstring).

    Attributes:
        spec: the folder's ``policy.json``.
        family: ``bc``, ``dt`` or ``gtrxl``.
        backend: ``eager``, ``torchscript`` or ``onnx``.
        env_id: the environment the policy was trained for (``None`` if unknown).
    """

    def __init__(self, spec: dict[str, Any], run: Runner, backend: str, memory: list[np.ndarray]) -> None:
        self.spec, self.family, self.backend = spec, spec["family"], backend
        self.acting: dict[str, Any] = spec["acting"]
        self.env_id = spec.get("env_id")
        self._run, self._memory = run, memory

    @classmethod
    def load(cls, path: str | os.PathLike, backend: str = "eager", *, timestep_overflow: str | None = None,
             threads: int | None = None) -> Policy:
        """Read a policy folder written by ``rl-tformers export``.

        Args:
            path: the folder.
            backend: ``eager``, ``torchscript`` or ``onnx`` (module docstring).
            timestep_overflow: DT only: ``error`` or ``clamp`` past ``max_ep_len`` (default: the
                folder's, as the run was evaluated).
            threads: onnx only: onnxruntime's intra-op threads.

        Raises:
            PolicyFolderError: (a ValueError) as
                :func:`~rl_tformers.agents.export.folder.read_folder`, an unknown backend, or a
                folder without that backend's graph (named).
        """
        if backend not in BACKENDS:
            raise PolicyFolderError(f"backend={backend!r}; use one of {', '.join(BACKENDS)}")
        path = Path(path)
        spec, model, memory = read_folder(path)
        if timestep_overflow is not None:
            if timestep_overflow not in ("error", "clamp"):
                raise PolicyFolderError(f"timestep_overflow={timestep_overflow!r}; use error or clamp")
            spec["acting"]["timestep_overflow"] = timestep_overflow
        if backend == "eager":
            run = torch_runner(make_graph(spec["family"], model, spec["acting"]))
        else:
            graph = path / GRAPH_FILES[backend]
            if not graph.is_file():
                raise PolicyFolderError(f"{path}: no {GRAPH_FILES[backend]} (export it with rl-tformers export "
                                        f"--format {backend})")
            run = torchscript_runner(graph) if backend == "torchscript" else onnx_runner(graph, spec["inputs"], threads)
        return cls(spec, run, backend, [m.numpy() for m in memory])

    def initial_state(self, n_envs: int, target_return: float | None = None) -> Any:
        """State of ``n_envs`` fresh episodes: a :class:`DTContext` (DT), a :class:`GTrXLMemory`
        (GTrXL), ``None`` (BC). ``target_return``: raw reward units (default: the folder's).

        Raises:
            ValueError: a return-conditioned policy without a target (none given, none stored).
        """
        target = self.acting.get("target_return") if target_return is None else float(target_return)
        if self.family == "dt" or (self.family == "gtrxl" and self.acting["return_conditioned"]):
            if target is None:
                raise ValueError("this policy is return-conditioned: pass target_return (raw reward units)")
        if self.family == "dt":
            return DTContext.empty(n_envs, self.acting, float(target))
        if self.family == "gtrxl":
            return GTrXLMemory.empty(n_envs, self._memory, target)
        return None

    def act(self, obs: np.ndarray, state: Any, episode_start: np.ndarray | None = None,
            last_reward: np.ndarray | None = None) -> tuple[np.ndarray, Any]:
        """Actions for one step of N environments.

        Args:
            obs: (N, *obs_shape) raw observations.
            state: from :meth:`initial_state` or the previous call (updated in place).
            episode_start: (N,) bool, rows whose ``obs`` starts an episode; ``None``: the rows
                that have not acted yet.
            last_reward: (N,) raw rewards of the previous step (ignored where a row starts).

        Returns:
            actions (N, *action_shape) float32 within the Box, or (N,) int64 in
            ``[start, start + n)``; the state.

        Raises:
            ValueError: ``episode_start`` of the wrong length, a DT step past ``max_ep_len``
                with ``timestep_overflow="error"``, a non-finite action.
        """
        obs = np.asarray(obs, np.float32)
        n = obs.shape[0]
        obs = obs.reshape(n, -1)
        if self.family == "bc":
            action = self._run([obs])[0]
        elif self.family == "dt":
            start = episode_starts(episode_start, state.t >= 0, n)
            slot = state.step(obs, start, last_reward, self.acting)
            action, context_action = self._run(state.inputs())
            state.record(slot, context_action)
        else:
            start = episode_starts(episode_start, state.started, n)
            r = np.zeros(n) if last_reward is None else np.asarray(last_reward, np.float64).reshape(n)
            out = self._run([obs, start, r, state.target, *state.tensors])
            action, state.tensors, state.started = out[0], list(out[1:]), np.ones(n, bool)
        return self._env_actions(action, n), state

    def _env_actions(self, action: np.ndarray, n: int) -> np.ndarray:
        """(N, *action_shape) float32 or (N,) int64 from the graph's action output.

        Raises:
            ValueError: a non-finite continuous action.
        """
        if self.acting["discrete"]:
            return action.astype(np.int64)
        if not np.isfinite(action).all():
            raise ValueError("Policy.act: the model's action is not finite (NaN/inf)")
        shape = self.acting.get("action_shape")
        return action.astype(np.float32).reshape(n, *shape) if shape else action.astype(np.float32)
