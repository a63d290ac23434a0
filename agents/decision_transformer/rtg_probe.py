"""Does a trained Decision Transformer use its return-to-go? A probe on the dataset's own windows.

For groups of episodes of the training data (e.g. the medium shard and the expert shard of a
medium-expert set) :func:`rtg_probe` takes the first window of K steps starting at episode step
``t0`` of each episode and reports

- ``fit``: the squared error between the model's actions and the data's actions with the true
  returns-to-go, summed over action dimensions and averaged over the K steps and the episodes
  (``agent.mode=last_action``: over the last step of each window, the only one the model
  predicts), in normalised action units ([-1, 1]); how well the model imitates that group;
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
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import typer
from omegaconf import OmegaConf
from rl_tformers.agents.common.offline import load_offline_dataset, plain
from rl_tformers.agents.decision_transformer.model import from_env_action
from rl_tformers.envs.dataset import EpisodeDataset
from rl_tformers.envs.trajectory import returns_to_go
from torch import Tensor

from rl_tformers.runtime.agent_registry import UnknownAgentError
from rl_tformers.runtime.checkpoint import CheckpointError, find_latest_valid
from rl_tformers.runtime.loading import load_run


def check_probe_options(t0s: Sequence[int], rtgs: Sequence[float]) -> None:
    """Refuse a negative or repeated ``t0`` and a non-finite or repeated ``R`` (``--t0``, ``--rtg``).

    Raises:
        ValueError: naming the option and the value.
    """
    for t0 in t0s:
        if int(t0) != t0 or t0 < 0:
            raise ValueError(f"--t0 {t0}: an episode step, an integer >= 0")
    if len(set(t0s)) != len(t0s):
        raise ValueError(f"--t0 {next(t for t in t0s if list(t0s).count(t) > 1)} is given twice")
    for r in rtgs:
        if not math.isfinite(float(r)):
            raise ValueError(f"--rtg {r}: the first return-to-go must be a finite number")
    if len({float(r) for r in rtgs}) != len(rtgs):
        raise ValueError(f"--rtg {next(r for r in rtgs if [float(x) for x in rtgs].count(float(r)) > 1)} is given twice")


def check_dataset_fits(agent, dataset: EpisodeDataset) -> None:
    """Refuse a dataset whose steps the run's model cannot take: other observation or action size,
    or discrete instead of continuous actions.

    Raises:
        ValueError: naming both shapes.
    """
    info = agent.info
    obs = int(np.prod(dataset.observation_shape))
    act = int(dataset.action_space.n) if dataset.discrete_actions else int(np.prod(dataset.action_shape))
    if dataset.discrete_actions != bool(info.discrete) or obs != int(info.obs_dim) or act != int(info.act_dim):
        kind = lambda d: "discrete" if d else "continuous"  # noqa: E731
        raise ValueError(
            f"the dataset does not fit the run: it has observations of shape {tuple(dataset.observation_shape)} "
            f"({obs} values) and {kind(dataset.discrete_actions)} actions of size {act}, but the run's model takes "
            f"{info.obs_dim} observation values and {kind(info.discrete)} actions of size {info.act_dim}")


def _check_probe(agent: Any, dataset: EpisodeDataset, groups: Mapping[str, Sequence[int]], t0s: Sequence[int],
                 rtgs: Sequence[float]) -> int:
    """Refuse what :func:`rtg_probe` cannot probe (its Raises); returns the context length K."""
    info, model = agent.info, agent.model
    k = getattr(getattr(model, "cfg", None), "context_len", None)
    if k is None or not hasattr(info, "reward_scale"):
        raise ValueError(f"rtg_probe: {type(agent).__name__} is not a Decision Transformer agent")
    if info.discrete:
        raise ValueError("rtg_probe: continuous actions only (the fit is a squared action error)")
    check_dataset_fits(agent, dataset)
    check_probe_options(t0s, rtgs)
    for name, idx in groups.items():
        bad = [i for i in idx if not 0 <= i < dataset.num_episodes]
        if bad:
            raise ValueError(f"rtg_probe: group {name!r} has episode indices {bad[:3]} outside 0..{dataset.num_episodes - 1}")
    longest = max((int(dataset.lengths[i]) for idx in groups.values() for i in idx), default=0)
    max_ep_len = int(model.cfg.max_ep_len)
    for t0 in t0s:
        if t0 + k > max_ep_len:
            raise ValueError(f"--t0 {t0}: a window of K={k} steps from step {t0} reaches step {t0 + k - 1}, past the "
                             f"run's agent.max_ep_len={max_ep_len} (the largest t0 is {max_ep_len - k})")
        if t0 + k > longest:
            most = (f"the largest useful t0 is {longest - k}" if longest >= k
                    else "fewer than K, so none holds a window at any t0")
            raise ValueError(f"--t0 {t0}: no episode of the groups holds a window of K={k} steps from step {t0} "
                             f"(the longest has {longest} steps; {most})")
    return k


def _probe_group(model: Any, info: Any, dataset: EpisodeDataset, name: str, idx: Sequence[int], t0: int,
                 rtgs: Sequence[float], bounds: tuple[Tensor, Tensor]) -> dict:
    """One row of :func:`rtg_probe`: the windows of K steps from ``t0`` of the episodes ``idx``
    long enough, their fit and their action shift under each first return-to-go in ``rtgs``."""
    k = int(model.cfg.context_len)
    dev = next(model.parameters()).device
    low, high = bounds
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
            base = model(obs, act, rtg, steps, mask).action  # (W, P, A), P = K or 1
            # P = 1 in last_action mode: the prediction is the window's last action only
            row["fit"] = float(((base - act[:, k - base.shape[1]:]) ** 2).sum(-1).mean())
            for r in rtgs:
                moved = model(obs, act, rtg - rtg[:, :1] + float(r), steps, mask).action
                row["shift"][float(r)] = float(((moved - base) ** 2).sum(-1).mean())
    return row


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
        ValueError (all before anything is computed): not a DT agent; discrete actions; a dataset
            whose observation or action size is not the model's (:func:`check_dataset_fits`);
            an episode index outside the dataset; a negative or repeated ``t0``, or one whose
            window would pass ``agent.max_ep_len``, or at which no episode of any group holds a
            window; a non-finite or repeated ``R`` (:func:`check_probe_options`).
    """
    info, model = agent.info, agent.model
    _check_probe(agent, dataset, groups, t0s, rtgs)
    dev = next(model.parameters()).device
    low, high = (torch.as_tensor(np.asarray(b, np.float32), device=dev) for b in (info.action_low, info.action_high))
    was_training = model.training
    model.eval()
    out = []
    try:
        for name, idx in groups.items():
            for t0 in t0s:
                row = _probe_group(model, info, dataset, name, idx, int(t0), rtgs, (low, high))
                out.append(row)
    finally:
        model.train(was_training)
    return out


def parse_groups(texts: Sequence[str]) -> dict[str, range]:
    """``["medium=0:20", "expert=247:267"]`` -> ``{"medium": range(0, 20), ...}``.

    Raises:
        ValueError: not ``NAME=FIRST:STOP``, an empty name, ``FIRST < 0``, an empty range
            (``STOP <= FIRST``) or a name given twice; the message names ``--group`` and the text.
    """
    out: dict[str, range] = {}
    for text in texts:
        name, eq, span = text.partition("=")
        first, colon, stop = span.partition(":")
        try:
            if not (eq and colon and name.strip()):
                raise ValueError
            r = range(int(first), int(stop))
        except ValueError:
            raise ValueError(f"--group {text!r}: expected NAME=FIRST:STOP (episode indices, e.g. medium=0:20)") from None
        if r.start < 0 or len(r) == 0:
            raise ValueError(f"--group {text!r}: FIRST:STOP must be a non-empty range of episode indices from 0 "
                             f"(FIRST >= 0, STOP > FIRST)")
        if name in out:
            raise ValueError(f"--group {name!r} is given twice ({name}={out[name].start}:{out[name].stop} and {text}); "
                             f"give each group its own name")
        out[name] = r
    return out


def _fail(msg: str) -> typer.Exit:
    typer.echo(f"error: {msg}", err=True)
    return typer.Exit(2)


def _load_dt_run(run_dir: Path, plugins: list[str] | None = None):
    """The run of ``run_dir`` if it is a Decision Transformer run with continuous actions (else an
    ``error:`` exit, before the model is built)."""


    if not run_dir.is_dir():
        what = "is not a directory" if run_dir.exists() else "does not exist"
        raise _fail(f"{run_dir} {what} (expected the run directory of a Decision Transformer trained by "
                    f"rl-tformers train)")
    try:
        found = find_latest_valid(run_dir)
        kind = OmegaConf.create(found.state["config"]).agent.kind
        if kind != "dt":
            raise _fail(f"{run_dir} is a {kind} run, not a Decision Transformer run")
        run = load_run(run_dir, checkpoint=found.path, plugins=plugins or ())
    except (CheckpointError, UnknownAgentError, TypeError, ValueError) as exc:
        raise _fail(str(exc)) from None
    if run.agent.info.discrete:
        raise _fail(f"{run_dir} is a Decision Transformer with discrete actions; the probe takes continuous "
                    f"actions only (the fit is a squared action error)")
    return run


def main(
    run_dir: Path = typer.Argument(..., help="Run directory of a trained DT."),
    group: list[str] = typer.Option(..., help="NAME=FIRST:STOP episode index range (repeat)."),
    t0: list[int] = typer.Option([0], help="Episode step at which windows start (repeat)."),
    rtg: list[float] = typer.Option([1.0, 4.0], help="First return-to-go of the shifted windows, scaled (repeat)."),
    dataset: str = typer.Option(None, help="Dataset spec (default: the run's dataset.path)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    plugin: list[str] = typer.Option([], "--plugin", metavar="MODULE",
                                     help="Import this module (repeatable): a module the run's plugins list is "
                                          "imported only when named here (it runs that module's code)."),
) -> None:
    """Print the fit and return-to-go sensitivity of a trained DT on its data's windows.

    Exit code 2 (one `error: ...` line): a bad option, a run that is not a continuous-action
    Decision Transformer, or a dataset that does not fit it.
    """

    try:  # the options first: nothing is loaded for a typo
        groups = parse_groups(group)
        check_probe_options(t0, rtg)
    except ValueError as exc:
        raise _fail(str(exc)) from None
    run = _load_dt_run(run_dir, plugin)
    spec = plain(run.cfg.dataset) if dataset is None else {**plain(run.cfg.dataset), "path": dataset}
    where = f"--dataset {dataset}" if dataset is not None else f"the run's dataset.path {spec.get('path')}"
    if not spec.get("path"):
        raise _fail(f"{run_dir}: the run's config has no dataset.path; give the data with --dataset")
    try:
        data = load_offline_dataset(spec)
    except (OSError, ValueError) as exc:  # FileNotFoundError, DatasetError, h5py's OSError
        msg = str(exc).removeprefix("dataset.path: ") if dataset is not None else str(exc)
        raise _fail(f"{where}: {msg}") from None
    try:
        check_dataset_fits(run.agent, data)
        rows = rtg_probe(run.agent, data, groups, t0, rtg)
    except ValueError as exc:
        msg = str(exc).removeprefix("rtg_probe: ")
        if msg.startswith("the dataset"):
            msg = f"{where}: {msg}"
        elif msg.startswith("group "):
            msg = f"--{msg} ({where} has {data.num_episodes} episodes)"
        raise _fail(msg) from None
    if as_json:
        typer.echo(json.dumps(rows))
        return
    for r in rows:
        shifts = "  ".join(f"R0->{k:g}: {v:.3f}" for k, v in r["shift"].items())
        fit = "-" if r["fit"] is None else f"{r['fit']:.3f}"
        typer.echo(f"{r['group']:>10} t0={r['t0']:<4} episodes {r['episodes']:>3}  fit {fit}  shift {shifts}")


app = typer.Typer(add_completion=False, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]})
app.command()(main)

if __name__ == "__main__":
    app()
