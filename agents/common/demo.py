"""The quick-start job behind ``rl-tformers demo`` / ``make demo``.

Runs on a fresh machine with nothing but this package (no pretrained policies, no downloads):

1. builds a CartPole-v1 dataset with a scripted controller that balances until a random step
   and then lets the pole fall (:mod:`rl_tformers.agents.common.scripted`), and writes it as a
   D4RL-layout HDF5 file in ``RUN_DIR/data/``;
2. trains a Decision Transformer on it with the shared trainer (config ``dt/cartpole_demo``);
3. evaluates it at several target returns (``eval.json``, per-step rewards included);
4. draws the return-conditioning figure (``return_conditioning.png``, also in TensorBoard).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rl_tformers.agents.common.scripted import collect_delayed_expert
from rl_tformers.envs.loaders import save_d4rl_hdf5

from rl_tformers.runtime.evaluation import evaluate
from rl_tformers.runtime.loading import load_run
from rl_tformers.runtime.plots import log_figure, plot_return_conditioning, save_figure, summary_lines
from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.trainer import RunDirError, holds_run, train

DEMO_CONFIG = "dt/cartpole_demo"
DATA_FILE = "cartpole-delayed-expert.hdf5"
#: evaluation targets of the demo (CartPole-v1 returns are episode lengths, at most 500)
DEMO_TARGETS = [50.0, 140.0, 230.0, 320.0, 410.0, 500.0]
#: base reset seed of the demo's evaluation (episode j: EVAL_SEED + j)
EVAL_SEED = 1000


@dataclass
class DemoResult:
    """Paths and timings of a demo run."""

    run_dir: Path
    plot: Path
    eval_json: Path
    seconds: float
    results: list


def _collect_demo_data(n_episodes: int, data_path: Path, echo: Callable[[str], None]) -> np.ndarray:
    """Step 1: ``n_episodes`` scripted CartPole-v1 episodes written to ``data_path`` (D4RL layout).
    Returns their (n_episodes,) returns."""
    echo(f"[1/4] collecting {n_episodes} CartPole-v1 episodes with a scripted controller ...")
    ds = collect_delayed_expert(n_episodes, seed=0)
    save_d4rl_hdf5(ds, data_path)
    ret = ds.episode_returns
    echo(f"      {ds.num_steps} steps, episode return min {ret.min():.0f} / mean {ret.mean():.0f} / best {ret.max():.0f}"
         f" -> {data_path}")
    return ret


def _train_demo(cfg: Any, run_dir: Path, targets: list[float], eval_episodes: int,
                echo: Callable[[str], None]) -> None:
    """Step 2: train, echoing a line at each tenth of the updates.

    Raises:
        InterruptedError: training was stopped by SIGINT/SIGTERM (with the commands that continue it).
    """
    t_train = time.perf_counter()
    total = int(cfg.train.steps)
    marks = [max(1, round(total * k / 10)) for k in range(1, 10)]  # a line at each tenth (not the last)

    def progress(step: int, scalars: dict[str, float]) -> None:
        if marks and step >= marks[0]:
            while marks and step >= marks[0]:
                marks.pop(0)
            echo(f"[2/4] ... update {step}/{total}, loss {scalars.get('train/loss', float('nan')):.4f}, "
                 f"{time.perf_counter() - t_train:.0f} s")

    result = train(cfg, run_dir, config_name="demo", on_log=progress)
    if result.interrupted is not None:
        raise InterruptedError(
            f"training stopped by signal {result.interrupted} at update {result.step}; "
            f"continue it with: rl-tformers train --resume {run_dir} (it trains only: the demo's evaluation and "
            f"plot are then rl-tformers eval {run_dir} --seed {EVAL_SEED} --episodes {eval_episodes} and "
            f"rl-tformers plot {run_dir} --targets {','.join(f'{t:g}' for t in targets)} --seed {EVAL_SEED} "
            f"--episodes {eval_episodes} --out {run_dir / 'return_conditioning.png'})"
        )
    loss = result.last_train.get("train/loss", float("nan"))
    echo(f"      done in {time.perf_counter() - t_train:.0f} s, final training loss {loss:.4f}")


def _evaluate_and_plot(run_dir: Path, device: str, targets: list[float], eval_episodes: int, ret: np.ndarray,
                       echo: Callable[[str], None]) -> tuple[Path, Path, list[Any]]:
    """Steps 3 and 4: evaluate the saved run at ``targets`` (``eval.json``) and plot achieved vs
    target return against the dataset's episode returns ``ret``. Returns (plot, eval.json, results)."""
    run = load_run(run_dir, device)
    echo(f"[3/4] evaluating at targets {targets}, {eval_episodes} episodes each ...")
    n_envs = min(10, eval_episodes)
    report = evaluate(run.agent.policy(), run.agent.make_env(), targets, episodes=eval_episodes,
                      n_envs=n_envs, seed=EVAL_SEED, record_rewards=True, env_id=run.env_id)
    report.extra = {"run_dir": str(run_dir), "step": run.step, "kind": run.kind}
    eval_json = run_dir / "eval.json"
    eval_json.write_text(json.dumps(report.to_dict(with_rewards=True), indent=1))
    for line in summary_lines(report.results):
        echo("      " + line)
    echo(f"      (repeat: rl-tformers eval {run_dir} --seed {EVAL_SEED} --episodes {eval_episodes} --envs {n_envs})")

    echo("[4/4] plotting achieved vs target return ...")
    fig = plot_return_conditioning(report.results, dataset_max=float(ret.max()), dataset_mean=float(ret.mean()),
                                   dataset_min=float(ret.min()),
                                   title=f"Decision Transformer on CartPole-v1 ({run.step} updates)")
    log_figure(run_dir, "plot/return_conditioning", fig, run.step)
    plot = save_figure(fig, run_dir / "return_conditioning.png")
    return plot, eval_json, report.results


def run_demo(
    out_dir: str | Path | None = None,
    *,
    steps: int | None = None,
    n_episodes: int | None = None,
    eval_episodes: int = 10,
    targets: list[float] | None = None,
    threads: int | None = None,
    device: str = "cpu",
    extra_overrides: list[str] | None = None,
    echo: Callable[[str], None] = print,
) -> DemoResult:
    """Build data, train, evaluate and plot (see the module docstring).

    Args:
        out_dir: run directory (default ``runs/demo-<YYYYmmdd-HHMMSS>``); must not hold a run.
        steps: training updates (default: the config's).
        n_episodes: dataset episodes (default 300, about 75,000 steps).
        eval_episodes: episodes per target.
        targets: evaluation targets (default :data:`DEMO_TARGETS`).
        threads: ``torch.set_num_threads`` (default: leave torch's choice).
        device: training device.
        extra_overrides: more ``key=value`` config overrides (tests use them to shrink the run).
        echo: where progress lines go.

    Returns:
        :class:`DemoResult`.

    Raises:
        RunDirError: ``out_dir`` already holds a run (checked before anything is written).
        InterruptedError: training was stopped by SIGINT/SIGTERM (a checkpoint was saved).
    """


    t0 = time.perf_counter()
    if threads is not None:
        torch.set_num_threads(threads)
    run_dir = Path(out_dir) if out_dir is not None else Path("runs") / f"demo-{datetime.now():%Y%m%d-%H%M%S}"
    if holds_run(run_dir):
        raise RunDirError(f"{run_dir} already holds a run; pick another --out-dir")
    data_path = run_dir / "data" / DATA_FILE
    n_episodes = 300 if n_episodes is None else n_episodes

    ret = _collect_demo_data(n_episodes, data_path, echo)
    targets = list(DEMO_TARGETS if targets is None else targets)
    # the run's own agent.targets are the demo's, so `rl-tformers eval RUN_DIR` evaluates the same ones
    overrides = [f"dataset.path={data_path}", f"device={device}", "train.progress=false", "eval.at_end=false",
                 f"agent.targets=[{', '.join(f'{t:g}' for t in targets)}]"]
    if steps is not None:
        overrides.append(f"train.steps={steps}")
    cfg = compose(DEMO_CONFIG, overrides + list(extra_overrides or []))
    echo(f"[2/4] training a Decision Transformer for {cfg.train.steps} updates (config {DEMO_CONFIG}) ...")
    _train_demo(cfg, run_dir, targets, eval_episodes, echo)
    plot, eval_json, results = _evaluate_and_plot(run_dir, device, targets, eval_episodes, ret, echo)
    return DemoResult(run_dir=run_dir, plot=plot, eval_json=eval_json, seconds=time.perf_counter() - t0,
                      results=results)
