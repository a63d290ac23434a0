"""Forward-pass speed of a Decision Transformer with early exit, against the full model.

``python -m rl_tformers.agents.decision_transformer.early_exit_bench RUN_DIR [--threshold calibrate]
[--batch 1,10] [--repeats 200]`` loads a run trained with ``backbone.depth.kind=early_exit``,
calibrates its threshold on the held-out episodes (or takes a given one), draws contexts of K
steps from the held-out episodes (the training sampler, seed 777) in which only the last real
step decides (as when acting), and times ``model(...)`` with and without early exit,
round-robin (:func:`~rl_tformers.runtime.timing.interleaved_timing`) so that load changes
on a shared machine hit both alike. Prints one JSON object: per batch size the median
milliseconds of both, the speed-up (full / early), the mean exit layer and the fraction of
decisions that equal the full model's within ``agent.early_exit.tol``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import typer
from rl_tformers.agents.decision_transformer.agent import to_model_batch
from rl_tformers.agents.decision_transformer.context import acting_context_mask

from rl_tformers.runtime.loading import load_run
from rl_tformers.runtime.timing import interleaved_timing


def forward_timing(agent: Any, batch_sizes: list[int], repeats: int = 200, seed: int = 777) -> dict[str, Any]:
    """Time the DT forward pass at ``agent.inference.exit_threshold`` vs the full model (see module docstring).

    Args:
        agent: a :class:`~rl_tformers.agents.decision_transformer.agent.DTAgent` whose threshold
            is set (:meth:`set_exit_threshold` / :meth:`calibrate_early_exit`).
        batch_sizes: contexts per forward pass (N environments acting together).
        repeats: timed rounds per batch size.
    Returns:
        ``{"threshold": float | None, "batches": {N: {"full_ms", "early_ms", "speedup",
        "exit_mean_layer", "consistent"}}}`` (medians in milliseconds).
    """

    data = agent.inference.training_data(None)
    held = agent.inference.heldout_mask(data)
    sampler = agent.inference.sampler(data.select(held) if held.any() else data)
    dev = next(agent.model.parameters()).device
    model = agent.model.eval()
    out: dict[str, Any] = {"threshold": agent.inference.exit_threshold, "batches": {}}
    tol = float(agent.early_exit_options.tol)
    for n in batch_sizes:
        raw = sampler.sample(n, np.random.default_rng([seed, n]))
        b = to_model_batch({k: torch.as_tensor(v, device=dev) for k, v in raw.items()}, agent.info)
        mask = b["mask"]
        last = mask.shape[1] - 1 - mask.flip(1).long().argmax(1)  # (N,) slot of the last real step
        mask = acting_context_mask(mask, last, agent.eval_context_len)  # the context the policy reads
        decide = torch.zeros_like(mask)
        rows = torch.arange(n, device=dev)
        decide[rows, last] = True
        args = (b["obs"], b["actions"], b["rtg"], b["timesteps"], mask)
        with torch.no_grad():
            full = model.forward_early_exit(*args, exit_steps=decide, exit_threshold=float("inf"))
            early = model.forward_early_exit(*args, exit_steps=decide, exit_threshold=agent.inference.exit_threshold)
            thr = agent.inference.exit_threshold
            t = interleaved_timing({
                "full": lambda a=args, d=decide: model.forward_early_exit(*a, exit_steps=d, exit_threshold=float("inf")),
                "early": lambda a=args, d=decide, th=thr: model.forward_early_exit(*a, exit_steps=d, exit_threshold=th),
            }, repeats=repeats)
        a_full, a_early = full.action[rows, last], early.action[rows, last]
        agree = (a_full == a_early) if agent.model_cfg.discrete else ((a_full - a_early).abs().amax(-1) <= tol)
        out["batches"][str(n)] = {
            "full_ms": t["full"]["median_ms"], "early_ms": t["early"]["median_ms"],
            "speedup": t["full"]["median_ms"] / t["early"]["median_ms"],
            "exit_mean_layer": float(early.metrics["exit/mean_layer"]),
            "layers_run": float(early.metrics["exit/layers_run"]),
            "consistent": float(agree.float().mean()),
        }
    return out


def main(
    run_dir: Path = typer.Argument(..., help="Run directory of a DT trained with backbone.depth.kind=early_exit."),
    threshold: str = typer.Option("calibrate", help="'calibrate' or a threshold."),
    batch: str = typer.Option("1,10", help="Comma-separated contexts per forward pass."),
    repeats: int = typer.Option(200, min=1, help="Timed rounds per batch size."),
    threads: int = typer.Option(1, min=1, help="torch CPU threads."),
) -> None:
    """Print the JSON of :func:`forward_timing` (with the calibration when calibrating)."""

    torch.set_num_threads(threads)
    run = load_run(run_dir)
    info = run.agent.inference_setup(early_exit=threshold)
    res = forward_timing(run.agent, [int(x) for x in batch.split(",")], repeats=repeats)
    res["calibration"] = info.get("early_exit")
    typer.echo(json.dumps(res, indent=1))


if __name__ == "__main__":
    typer.run(main)
