"""Benchmark: ``act()`` latency of a deployed policy (``rl-tformers bench act``).

The same policy acts through three paths on the same observations: the in-package policy
(``agent.policy()``, eager PyTorch), the exported TorchScript graph and the exported ONNX graph
under onnxruntime (both through :class:`rl_tformers.agents.export.Policy`, whose state between
steps is NumPy). Per batch size N in ``--batches``: the median milliseconds of an ``act()`` call
(one step of N environments: the DT's window written, one forward pass, the actions mapped to
the space) over ``--steps`` timed steps after ``--warmup`` steps (one episode of ``--steps +
--warmup`` steps, so the DT's window fills up and then slides), the three paths taking turns
step by step so that a change of the machine's load reaches them alike, and each path's median
over the in-package one's, measured in the same run.

The policy: a trained run given with ``--run``, or an untrained Decision Transformer of the
paper's size (128 dims, 3 layers, 1 head, K = 20) on Hopper's sizes (11 observations, 3
actions); the cost per step does not depend on the weights.

Command: ``nice -n 10 rl-tformers bench act --threads 1 --batches 1,32 --out bench_act.json``.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import typer

from rl_tformers.agents.decision_transformer.model import DecisionTransformer, DTConfig
from rl_tformers.agents.decision_transformer.policy import DTPolicy
from rl_tformers.agents.export import Policy
from rl_tformers.agents.export.exporters import ExportRefused, export_model, export_run
from rl_tformers.agents.export.folder import acting_spec
from rl_tformers.bench.options import first_repeat, run_checked
from rl_tformers.bench.train import machine_info
from rl_tformers.runtime.agent_registry import UnknownAgentError
from rl_tformers.runtime.checkpoint import CheckpointError
from rl_tformers.runtime.errors import ConfigError
from rl_tformers.runtime.loading import load_run


@dataclass
class Settings:
    """Benchmark settings."""

    run: str | None = None
    batches: tuple[int, ...] = (1, 32)
    steps: int = 200
    warmup: int = 20
    threads: int = 1
    seed: int = 0

    def check(self) -> None:
        """Raises ValueError naming the option: ``--batches`` empty, repeated or below 1, ``--steps``
        or ``--threads`` below 1, ``--warmup`` below 0."""
        if not self.batches or min(self.batches) < 1:
            raise ValueError(f"--batches: give batch sizes >= 1, e.g. 1,32 (got {','.join(map(str, self.batches))})")
        if (twice := first_repeat(self.batches)) is not None:
            raise ValueError(f"--batches: {twice} is given twice")
        for option, value, lo in (("--steps", self.steps, 1), ("--threads", self.threads, 1), ("--warmup", self.warmup, 0)):
            if value < lo:
                raise ValueError(f"{option} must be >= {lo}, got {value}")


@dataclass
class Result:
    settings: dict[str, Any]
    machine: dict[str, Any]
    policy: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "notes"}

    def table(self) -> str:
        m = self.machine
        lines = [f"*{m.get('cpu', 'CPU')}, {self.settings['threads']} thread(s), {m['date']}, load average "
                 f"{' '.join(map(str, m.get('loadavg_1_5_15', [])))}; {self.policy}.*", "",
                 "| batch | path | median ms per act() | / in-package |", "|---|---|---|---|"]
        for r in self.rows:
            lines.append(f"| {r['batch']} | {r['path']} | {r['ms_per_step']:.3f} | {r['ratio']:.2f}x |")
        return "\n".join(lines)


def untrained_dt() -> tuple[DTPolicy, Any]:
    """An untrained DT of the paper's size on Hopper's sizes, acting on unit statistics."""
    torch.manual_seed(0)
    model = DecisionTransformer(DTConfig(obs_dim=11, act_dim=3, context_len=20, max_ep_len=1000)).eval()
    return DTPolicy(model, np.zeros(11), np.ones(11), 1000.0, -np.ones(3), np.ones(3), default_target=3600.0), None


def _time(paths: dict[str, Any], n: int, s: Settings, target: float | None) -> dict[str, list[float]]:
    """Milliseconds of every timed ``act()`` call of each path for ``n`` rows: the paths take turns
    step by step on the same observations (so a change of the machine's load reaches all of them
    alike); ``--warmup`` untimed steps first."""
    rng = np.random.default_rng(s.seed)
    obs_dim = int(paths["onnx"].acting["obs_dim"])
    obs = rng.normal(size=(s.warmup + s.steps, n, obs_dim)).astype(np.float32)
    states = {k: p.initial_state(n, target) for k, p in paths.items()}
    reward, cont = np.zeros(n), np.zeros(n, bool)
    ms: dict[str, list[float]] = {k: [] for k in paths}
    for t in range(s.warmup + s.steps):
        start = np.ones(n, bool) if t == 0 else cont
        for k, p in paths.items():
            t0 = time.perf_counter()
            _, states[k] = p.act(obs[t], states[k], start, reward)
            if t >= s.warmup:
                ms[k].append(1000.0 * (time.perf_counter() - t0))
    return ms


def run_bench(s: Settings, log=lambda message: None) -> Result:
    """Export the policy to both formats in a temporary folder and time the three paths."""
    torch.set_num_threads(s.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "policy"
        if s.run:
            agent = load_run(s.run).agent
            policy = agent.policy(deterministic=True) if agent.__class__.__name__.startswith("GTrXL") else agent.policy()
            for fmt in ("torchscript", "onnx"):
                export_run(s.run, fmt, folder)
            name = f"the run {s.run}"
        else:
            policy, agent = untrained_dt()
            family, model, cfg, acting = acting_spec(policy, agent)
            for fmt in ("torchscript", "onnx"):
                export_model(family, model, cfg, acting, fmt, folder, kind="dt")
            name = "an untrained DT of the paper's size (128 dims, 3 layers, K = 20; 11 observations, 3 actions)"
        paths = {"in-package": policy, "torchscript": Policy.load(folder, "torchscript"),
                 "onnx": Policy.load(folder, "onnx", threads=s.threads)}
        target = paths["onnx"].acting.get("target_return")
        res = Result(settings=asdict(s), machine={**machine_info(torch.device("cpu")),
                                                  "date": time.strftime("%d %b %Y", time.gmtime())}, policy=name)
        for n in s.batches:
            log(f"batch {n}: timing {', '.join(paths)}")
            ms = {k: float(np.median(v)) for k, v in _time(paths, n, s, target).items()}
            res.rows += [{"batch": n, "path": k, "ms_per_step": v, "ratio": v / ms["in-package"]} for k, v in ms.items()]
    return res


def register(bench_app) -> None:
    """Add the ``act`` command to the ``bench`` Typer group."""

    def act(
        run_dir: str = typer.Option(None, "--run", help="Run directory of a trained agent (default: an untrained "
                                                        "DT of the paper's size)."),
        batches: str = typer.Option("1,32", help="Batch sizes N (environments per act() call), comma-separated."),
        steps: int = typer.Option(200, help="Timed act() calls per path and batch size."),
        warmup: int = typer.Option(20, help="Untimed act() calls first."),
        threads: int = typer.Option(1, help="torch intra-op threads and onnxruntime's."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON instead of the table."),
        out: str = typer.Option(None, "--out", help="Also write the JSON result to this file."),
    ) -> None:
        """act() latency per step: in-package eager vs TorchScript vs onnxruntime, at each batch size."""
        def settings() -> Settings:
            try:
                sizes = tuple(int(b) for b in batches.split(",") if b.strip())
            except ValueError:
                raise ValueError(f"--batches: {batches!r} is not a comma-separated list of integers") from None
            return Settings(run=run_dir, batches=sizes, steps=steps, warmup=warmup, threads=threads)

        run_checked(settings, run_bench, Result.table, out=out, as_json=as_json,
                    load_errors=(CheckpointError, UnknownAgentError, ConfigError, ExportRefused), source=f"--run {run_dir}")

    bench_app.command("act")(act)
