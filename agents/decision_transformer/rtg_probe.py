"""Does a trained Decision Transformer use its return-to-go? A probe on the dataset's own windows.

For groups of episodes of the training data (e.g. the medium shard and the expert shard of a
medium-expert set) :func:`rtg_probe` takes the first window of K steps starting at episode step
``t0`` of each episode and reports

- ``fit``: the squared error between the model's actions and the data's actions with the true
  returns-to-go, summed over action dimensions and averaged over the K steps and the episodes,
  in normalised action units ([-1, 1]); how well the model imitates that group;
- ``shift[R]``: the squared change of the model's actions when the window's returns-to-go are
  shifted so that its first one equals ``R`` (scaled units, i.e. return / ``reward_scale``;
  the rest of the window keeps its differences), same units. A model that conditions on the
  return moves its actions toward the other group's when asked for the other group's return;
  compare with the squared distance between the two groups' actions.

Continuous actions only. Command line (``--group NAME=FIRST:STOP`` episode index ranges)::

    python -m rl_tformers.agents.decision_transformer.rtg_probe runs/others/dt-walker2d-medium-expert-s0 \\
        --group medium=0:20 --group expert=247:267 --t0 0 --t0 100 --rtg 1.0 --rtg 4.0
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
import typer
from rl_tformers.agents.decision_transformer.model import from_env_action
from rl_tformers.envs.dataset import EpisodeDataset
from rl_tformers.envs.trajectory import returns_to_go


def rtg_probe(
    agent, dataset: EpisodeDataset, groups: Mapping[str, Sequence[int]], t0s: Sequence[int] = (0,),
    rtgs: Sequence[float] = (1.0, 4.0),
) -> list[dict]:
    """Fit and return-to-go sensitivity of a trained DT on its data's windows (module docstring).

    Args:
        agent: a trained :class:`~rl_tformers.agents.decision_transformer.agent.DTAgent`
            (``load_run(RUN_DIR).agent``); its stored observation statistics, reward scale and
            action bounds are used.
        dataset: the episodes to probe (usually the training set).
        groups: name -> episode indices.
        t0s: episode steps at which windows start; an episode shorter than ``t0 + K`` is skipped.
        rtgs: first returns-to-go of the shifted windows, scaled units.

    Returns:
        one dict per (group, t0): ``group``, ``t0``, ``episodes`` (how many were long enough),
        ``fit`` and ``shift`` (``{R: value}``), as described above; ``fit`` is ``None`` when no
        episode was long enough.

    Raises:
        ValueError: discrete actions; an episode index outside the dataset.
    """
    info, model = agent.info, agent.model
    if info.discrete:
        raise ValueError("rtg_probe: continuous actions only (the fit is a squared action error)")
    k = model.cfg.context_len
    dev = next(model.parameters()).device
    low, high = (torch.as_tensor(np.asarray(b, np.float32), device=dev) for b in (info.action_low, info.action_high))
    was_training = model.training
    model.eval()
    out = []
    try:
        for name, idx in groups.items():
            bad = [i for i in idx if not 0 <= i < dataset.num_episodes]
            if bad:
                raise ValueError(f"rtg_probe: group {name!r} has episode indices {bad[:3]} outside 0..{dataset.num_episodes - 1}")
            for t0 in t0s:
                wins = []
                for i in idx:
                    ep = dataset.episode(i)
                    if len(ep.rewards) < t0 + k:
                        continue
                    sl = slice(t0, t0 + k)
                    obs = (np.asarray(ep.observations[sl], np.float32).reshape(k, -1) - info.obs_mean) / info.obs_std
                    act = np.asarray(ep.actions[sl], np.float32).reshape(k, -1)
                    rtg = returns_to_go(np.asarray(ep.rewards, np.float64))[sl] / info.reward_scale
                    wins.append((obs, act, rtg))
                row = {"group": name, "t0": int(t0), "episodes": len(wins), "fit": None, "shift": {}}
                if wins:
                    obs, act, rtg = (torch.as_tensor(np.stack(x), dtype=torch.float32, device=dev) for x in zip(*wins))
                    act = from_env_action(act, low, high)  # the training batches' mapping to [-1, 1]
                    steps = (t0 + torch.arange(k, device=dev)).expand(len(wins), k)
                    mask = torch.ones(len(wins), k, dtype=torch.bool, device=dev)
                    with torch.no_grad():
                        base = model(obs, act, rtg, steps, mask).action
                        row["fit"] = float(((base - act) ** 2).sum(-1).mean())
                        for r in rtgs:
                            moved = model(obs, act, rtg - rtg[:, :1] + float(r), steps, mask).action
                            row["shift"][float(r)] = float(((moved - base) ** 2).sum(-1).mean())
                out.append(row)
    finally:
        model.train(was_training)
    return out


def _range(text: str) -> tuple[str, range]:
    name, _, span = text.partition("=")
    first, _, stop = span.partition(":")
    try:
        return name, range(int(first), int(stop))
    except ValueError:
        raise typer.BadParameter(f"{text!r}: expected NAME=FIRST:STOP (episode indices)", param_hint="--group") from None


def main(
    run_dir: Path = typer.Argument(..., help="Run directory of a trained DT."),
    group: list[str] = typer.Option(..., help="NAME=FIRST:STOP episode index range (repeat)."),
    t0: list[int] = typer.Option([0], help="Episode step at which windows start (repeat)."),
    rtg: list[float] = typer.Option([1.0, 4.0], help="First return-to-go of the shifted windows, scaled (repeat)."),
    dataset: str = typer.Option(None, help="Dataset spec (default: the run's dataset.path)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Print the fit and return-to-go sensitivity of a trained DT on its data's windows."""
    from rl_tformers.agents.common.loading import load_run
    from rl_tformers.agents.common.offline import load_offline_dataset, plain

    run = load_run(run_dir)
    spec = plain(run.cfg.dataset) if dataset is None else {**plain(run.cfg.dataset), "path": dataset}
    rows = rtg_probe(run.agent, load_offline_dataset(spec), dict(_range(g) for g in group), t0, rtg)
    if as_json:
        typer.echo(json.dumps(rows))
        return
    for r in rows:
        shifts = "  ".join(f"R0->{k:g}: {v:.3f}" for k, v in r["shift"].items())
        fit = "-" if r["fit"] is None else f"{r['fit']:.3f}"
        typer.echo(f"{r['group']:>10} t0={r['t0']:<4} episodes {r['episodes']:>3}  fit {fit}  shift {shifts}")


if __name__ == "__main__":
    typer.run(main)
