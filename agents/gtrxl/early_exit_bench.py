"""Per-step forward speed of a GTrXL acting with early exit, against the full model.

``python -m rl_tformers.agents.gtrxl.early_exit_bench RUN_DIR [--threshold calibrate] [--batch 1,10]
[--repeats 200]`` loads an offline GTrXL run trained with ``backbone.depth.kind=early_exit``,
calibrates its threshold on the held-out episodes (or takes a given one), draws segments of
``agent.burn_in + agent.seq_len`` steps from the held-out episodes (seed 777), acts through all
but the last step one step at a time (the memory the policy would hold, with exits at the
threshold in use) and times the last step's encoder call over that memory, with and without
early exit, round-robin (:func:`~rl_tformers.runtime.timing.interleaved_timing`), so that load
changes on a shared machine hit both alike. Prints one JSON object: per batch size (environments
acting together) the median milliseconds of both, the speed-up (full / early), the mean exit
layer, the layers run and the fraction of decisions equal to the full model's (within
``agent.early_exit.tol`` when continuous).
"""

from __future__ import annotations

import json
import math
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import typer
from rl_tformers.agents.gtrxl.loss import SegmentBatch
from rl_tformers.agents.gtrxl.replay import exit_kwargs, replay

from rl_tformers.runtime.loading import load_run
from rl_tformers.runtime.timing import interleaved_timing


def _cut(seg: SegmentBatch, stop: int) -> SegmentBatch:
    """The first ``stop`` steps of every row."""
    kw = {f.name: getattr(seg, f.name) for f in fields(seg)}
    return SegmentBatch(**{k: v[:, :stop] if isinstance(v, torch.Tensor) else v for k, v in kw.items()})


def step_timing(agent: Any, batch_sizes: list[int], repeats: int = 200, seed: int = 777) -> dict[str, Any]:
    """Time one acting step at ``agent.inference.exit_threshold`` vs the full model (module docstring).

    Returns:
        ``{"threshold": float | None, "batches": {N: {"full_ms", "early_ms", "speedup",
        "exit_mean_layer", "layers_run", "consistent"}}}`` (medians in milliseconds).
    """
    inf = agent.inference
    data = inf.training_data()
    held = inf.heldout_mask(data.num_episodes)
    sampler = inf.sampler(data.select(held) if held.any() else data, agent.burn_in)
    model = agent.model.eval()
    enc = model.encoder
    dev = next(model.parameters()).device
    thr = inf.exit_threshold
    tol = float(agent.options.early_exit.tol)
    out: dict[str, Any] = {"threshold": thr, "batches": {}}
    for n in batch_sizes:
        raw = sampler.sample(n, np.random.default_rng([seed, n]))
        raw["mask"] = np.ones_like(raw["mask"])  # whole segments: no padding at the timed step
        seg = agent.to_segments({k: torch.as_tensor(v, device=dev) for k, v in raw.items()})
        last = seg.mask.shape[1] - 1
        x = enc.inputs(seg.obs, seg.rtg, seg.prev_action, seg.prev_reward)[:, last:]  # (N, 1, input_dim)
        pos = seg.timesteps[:, last:]  # (N, 1)
        start = seg.episode_start[:, last]
        deciding = torch.ones(n, 1, dtype=torch.bool, device=dev)
        states = {}
        for name, th in (("full", math.inf), ("early", thr)):
            _, mem = replay(model, _cut(seg, last), th, early_exit=True)
            states[name] = enc.reset_state(mem, start)
        kw = {"full": exit_kwargs(model, math.inf, deciding), "early": exit_kwargs(model, thr, deciding)}
        calls = {k: (lambda k=k, x=x, pos=pos, states=states, kw=kw: enc(x, pos, state=states[k], **kw[k]))
                 for k in ("full", "early")}
        with torch.no_grad():
            res = {k: call() for k, call in calls.items()}
            t = interleaved_timing(calls, repeats=repeats)
            a = {k: model.actor(r.features[:, 0]) for k, r in res.items()}
        if agent.model_cfg.discrete:
            agree = a["full"].argmax(-1) == a["early"].argmax(-1)
        else:
            agree = (a["full"] - a["early"]).abs().amax(-1) <= tol
        m = res["early"].metrics
        out["batches"][str(n)] = {
            "full_ms": t["full"]["median_ms"], "early_ms": t["early"]["median_ms"],
            "speedup": t["full"]["median_ms"] / t["early"]["median_ms"],
            "exit_mean_layer": float(m["exit/mean_layer"]), "layers_run": float(m["exit/layers_run"]),
            "consistent": float(agree.float().mean()),
        }
    return out


def main(
    run_dir: Path = typer.Argument(..., help="Run directory of a GTrXL trained with backbone.depth.kind=early_exit."),
    threshold: str = typer.Option("calibrate", help="'calibrate' or a threshold."),
    batch: str = typer.Option("1,10", help="Comma-separated environments acting together."),
    repeats: int = typer.Option(200, min=1, help="Timed rounds per batch size."),
    threads: int = typer.Option(1, min=1, help="torch CPU threads."),
) -> None:
    """Print the JSON of :func:`step_timing` (with the calibration when calibrating)."""
    torch.set_num_threads(threads)
    run = load_run(run_dir)
    info = run.agent.inference_setup(early_exit=threshold)
    res = step_timing(run.agent, [int(x) for x in batch.split(",")], repeats=repeats)
    res["calibration"] = info.get("early_exit")
    typer.echo(json.dumps(res, indent=1))


if __name__ == "__main__":
    typer.run(main)
