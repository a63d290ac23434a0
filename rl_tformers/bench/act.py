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

The bare forward: at every step, right after the in-package ``act()``, the model's forward pass
alone on the inputs that step built (the DT's model on its context window; GTrXL's encoder on
the new tokens over its memory, then the actor), timed in the same turn; ``act / forward`` is
the in-package median over it, so ``act / forward - 1`` is what the bookkeeping around the
forward costs (context update, normalisation, action decoding).

The policies: a trained run given with ``--run``, or untrained policies of ``--policies``: the
Decision Transformer of the paper's size (128 dims, 3 layers, 1 head, K = 20) and GTrXL with
memory (128 dims, 3 layers, 4 heads, XL memory of 32 steps), on Hopper's sizes (11
observations, 3 actions); the cost per step does not depend on the weights.

Command: ``nice -n 10 rl-tformers bench act --threads 1 --batches 1,32 --out bench_act.json``.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import typer

from rl_tformers.agents.bc.agent import BCPolicy
from rl_tformers.agents.decision_transformer.model import DecisionTransformer, DTConfig
from rl_tformers.agents.decision_transformer.policy import DTPolicy
from rl_tformers.agents.export import Policy
from rl_tformers.agents.export.exporters import ExportRefused, export_model, export_run
from rl_tformers.agents.export.folder import acting_spec
from rl_tformers.agents.gtrxl.agent import GTrXLPolicy
from rl_tformers.agents.gtrxl.model import GTrXLConfig, GTrXLModel
from rl_tformers.bench.options import first_repeat, run_checked
from rl_tformers.bench.train import machine_info
from rl_tformers.runtime.agent_registry import UnknownAgentError
from rl_tformers.runtime.checkpoint import CheckpointError
from rl_tformers.runtime.errors import ConfigError
from rl_tformers.runtime.host import host_caption
from rl_tformers.runtime.loading import load_run

#: the untrained policies timed without --run
POLICIES = ("dt", "gtrxl")


@dataclass
class Settings:
    """Benchmark settings."""

    run: str | None = None
    policies: tuple[str, ...] = POLICIES
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
        bad = [p for p in self.policies if p not in POLICIES]
        if bad or not self.policies:
            raise ValueError(f"--policies: {bad[0] if bad else 'nothing'!r} is not a policy; use a comma-separated "
                             f"subset of {','.join(POLICIES)}")
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
        lines = [f"*{host_caption(m)}, {self.settings['threads']} thread(s), {m['date']}, load average "
                 f"{' '.join(map(str, m.get('loadavg_1_5_15', [])))} at the start, "
                 f"{' '.join(map(str, m.get('loadavg_end', [])))} at the end; {self.policy}.*", "",
                 "| policy | batch | path | median ms per act() | / in-package | bare forward ms | act / forward |",
                 "|---|---|---|---|---|---|---|"]
        lines += [row_line(r) for r in self.rows]
        return "\n".join(lines)


def row_line(r: dict[str, Any]) -> str:
    """One row of :meth:`Result.table` (the bare forward only on the in-package rows)."""
    fwd = (f"{r['forward_ms']:.3f} | {r['act_over_forward']:.2f}x" if "forward_ms" in r else "- | -")
    return f"| {r['policy']} | {r['batch']} | {r['path']} | {r['ms_per_step']:.3f} | {r['ratio']:.2f}x | {fwd} |"


def untrained_dt() -> tuple[DTPolicy, Any]:
    """An untrained DT of the paper's size on Hopper's sizes, acting on unit statistics."""
    torch.manual_seed(0)
    model = DecisionTransformer(DTConfig(obs_dim=11, act_dim=3, context_len=20, max_ep_len=1000)).eval()
    return DTPolicy(model, np.zeros(11), np.ones(11), 1000.0, -np.ones(3), np.ones(3), default_target=3600.0), None


def untrained_gtrxl() -> tuple[GTrXLPolicy, Any]:
    """An untrained GTrXL with memory (128 dims, 3 layers, 4 heads, XL memory of 32) on Hopper's sizes."""
    torch.manual_seed(0)
    model = GTrXLModel(GTrXLConfig(obs_dim=11, act_dim=3)).eval()
    return GTrXLPolicy(model, obs_mean=np.zeros(11), obs_std=np.ones(11), action_low=-np.ones(3),
                       action_high=np.ones(3)), None


#: what each untrained policy is called in the table
UNTRAINED = {"dt": (untrained_dt, "an untrained DT of the paper's size (128 dims, 3 layers, 1 head, K = 20)"),
             "gtrxl": (untrained_gtrxl, "an untrained GTrXL with memory (128 dims, 3 layers, 4 heads, XL memory 32)")}


def bare_forward(policy: Any, before: Any, obs: np.ndarray, start: np.ndarray, reward: np.ndarray,
                 after: Any) -> Callable[[], Any]:
    """The model's forward pass alone on the inputs of the step just acted (``before``: the state
    the step started from, ``after``: the one it returned), as a zero-argument call to time; the
    inputs are built here, untimed."""
    if isinstance(policy, DTPolicy):
        st = after  # the context window the step wrote (shapes and cost of the forward it ran)
        return lambda: policy.model(st.obs, st.actions, st.rtg, st.timesteps, st.mask)
    if isinstance(policy, GTrXLPolicy):
        x, t, memory, _, _ = policy._tokens(obs, before, start, reward)
        enc, actor = policy.model.encoder, policy.model.actor
        return lambda: actor(enc(x, t[:, None], state=memory).features[:, 0])
    if isinstance(policy, BCPolicy):
        x = (torch.as_tensor(np.asarray(obs, np.float32)).reshape(len(start), -1) - policy.mean) / policy.std
        return lambda: policy.model(x)
    raise ValueError(f"bench act: no bare forward for {type(policy).__name__}")


def _time(paths: dict[str, Any], n: int, s: Settings, target: float | None) -> dict[str, list[float]]:
    """Milliseconds of every timed ``act()`` call of each path for ``n`` rows, and of the bare
    forward (``"forward"``) after the in-package one: the paths take turns step by step on the same
    observations (so a change of the machine's load reaches all of them alike); ``--warmup``
    untimed steps first."""
    rng = np.random.default_rng(s.seed)
    obs_dim = int(next(iter(paths.values())).model.cfg.obs_dim)
    obs = rng.normal(size=(s.warmup + s.steps, n, obs_dim)).astype(np.float32)
    states = {k: p.initial_state(n, target) for k, p in paths.items()}
    reward, cont = np.zeros(n), np.zeros(n, bool)
    ms: dict[str, list[float]] = {k: [] for k in (*paths, "forward")}
    for t in range(s.warmup + s.steps):
        start = np.ones(n, bool) if t == 0 else cont
        for k, p in paths.items():
            before = states[k]
            with torch.inference_mode():
                t0 = time.perf_counter()
                _, states[k] = p.act(obs[t], before, start, reward)
                t1 = time.perf_counter()
                if k == "in-package":
                    forward = bare_forward(p, before, obs[t], start, reward, states[k])
                    t2 = time.perf_counter()
                    forward()
                    t3 = time.perf_counter()
            if t >= s.warmup:
                ms[k].append(1000.0 * (t1 - t0))
                if k == "in-package":
                    ms["forward"].append(1000.0 * (t3 - t2))
    return ms


def _paths(kind: str | None, s: Settings, folder: Path, log) -> tuple[dict[str, Any], str]:
    """The paths of one policy (``kind`` untrained, or ``--run`` when None): in-package, and
    TorchScript and ONNX when the policy exports (a note in the log otherwise)."""
    if kind is None:
        agent = load_run(s.run).agent
        policy = agent.policy(deterministic=True) if agent.__class__.__name__.startswith("GTrXL") else agent.policy()
        cfg = policy.model.cfg
        actions = f"{cfg.act_dim} discrete actions" if getattr(cfg, "discrete", False) else f"{cfg.act_dim} actions"
        name = f"the run {s.run} ({cfg.obs_dim} observations, {actions})"
    else:
        make, name = UNTRAINED[kind]
        policy, agent = make()
    paths: dict[str, Any] = {"in-package": policy}
    try:
        for fmt in ("torchscript", "onnx"):
            if kind is None:
                export_run(s.run, fmt, folder)
            else:
                family, model, cfg, acting = acting_spec(policy, agent)
                export_model(family, model, cfg, acting, fmt, folder, kind=family)
        paths["torchscript"] = Policy.load(folder, "torchscript")
        paths["onnx"] = Policy.load(folder, "onnx", threads=s.threads)
    except (ExportRefused, ValueError) as exc:
        log(f"{name}: in-package only ({exc})")
    return paths, name


def run_bench(s: Settings, log=lambda message: None) -> Result:
    """Export each policy to both formats in a temporary folder and time the paths and the bare forward."""
    torch.set_num_threads(s.threads)
    res = Result(settings=asdict(s), machine={**machine_info(torch.device("cpu")),
                                              "date": time.strftime("%d %b %Y", time.gmtime())}, policy="")
    names = []
    for kind in ([None] if s.run else s.policies):
        with tempfile.TemporaryDirectory() as tmp:
            paths, name = _paths(kind, s, Path(tmp) / "policy", log)
            names.append(name)
            onnx = paths.get("onnx")
            target = onnx.acting.get("target_return") if onnx is not None else getattr(
                paths["in-package"], "default_target", None)
            for n in s.batches:
                log(f"{kind or 'run'} batch {n}: timing {', '.join(paths)} and the bare forward")
                ms = {k: float(np.median(v)) for k, v in _time(paths, n, s, target).items()}
                for k in paths:
                    row = {"policy": kind or "run", "batch": n, "path": k, "ms_per_step": ms[k],
                           "ratio": ms[k] / ms["in-package"]}
                    if k == "in-package":
                        row.update(forward_ms=ms["forward"], act_over_forward=ms[k] / ms["forward"])
                    res.rows.append(row)
    res.policy = "; ".join(names) + ("" if s.run else " (11 observations, 3 actions)")  # (a run: its own sizes)
    res.machine["loadavg_end"] = [round(v, 2) for v in os.getloadavg()]
    return res


def register(bench_app) -> None:
    """Add the ``act`` command to the ``bench`` Typer group."""

    def act(
        run_dir: str = typer.Option(None, "--run", help="Run directory of a trained agent (default: an untrained "
                                                        "DT of the paper's size)."),
        batches: str = typer.Option("1,32", help="Batch sizes N (environments per act() call), comma-separated."),
        policies: str = typer.Option(",".join(POLICIES), help="Untrained policies timed without --run, a "
                                                              "comma-separated subset of dt,gtrxl."),
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
            return Settings(run=run_dir, policies=tuple(p.strip() for p in policies.split(",") if p.strip()),
                            batches=sizes, steps=steps, warmup=warmup, threads=threads)

        run_checked(settings, run_bench, Result.table, out=out, as_json=as_json,
                    load_errors=(CheckpointError, UnknownAgentError, ConfigError, ExportRefused), source=f"--run {run_dir}")

    bench_app.command("act")(act)
