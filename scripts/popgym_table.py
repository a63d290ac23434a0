"""The POPGym results of one task (scripts/results_popgym.sh): every run's evaluation curve, its
maximum (MMER) and final return, as JSON, a learning-curve figure and a markdown table row.

MMER, the mean max episodic reward of POPGym (Morad et al., ICLR 2023, *POPGym: Benchmarking
Partially Observable Reinforcement Learning*): for each run the largest mean episodic return
reached over training, then the mean over runs (seeds). The paper takes the maximum over its
training epochs of the mean episodic reward; here the maximum is over the run's periodic
evaluations (``eval/return_mean`` of metrics.jsonl, every ``eval.every`` updates and at the end),
the same curve for both agents. POPGym's returns lie in [-1, 1], so MMER does too.

Final return: ``return_mean`` of the run's eval.json (``eval.episodes`` episodes, reset seeds
0, 1, ..., the final policy), averaged over runs. Spreads are population std (ddof 0) over runs.

Usage: ``python scripts/popgym_table.py TASK [--out-root runs/results-popgym] [--doc docs/results/popgym]``
(TASK as in ``popgym-TASK-v0``). Exits 2 naming the folder when a task has no finished run.

With ``--variants xl,window,...`` (scripts/results_popgym_backbones.sh) it compares PPO-GTrXL's
backbone variants instead: the same MMER and final return per variant, plus its environment
steps per second while training (``train/env_steps`` between the first and last logged update
over the time between them: of the variant's short ``timing/`` run, measured back to back with
the other variants', else the mean over its runs) and its act() milliseconds per step at batch
1 and 16 (``act.json`` of ``rl-tformers bench act``, in-package path, first seed), written to
``DOC/backbones-<task>.json``, ``DOC/backbones-<task>.png`` and the task's rows of
``DOC/backbones.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import yaml

AGENTS = {"PPO-GTrXL": "gtrxl-{task}/base", "RecurrentPPO": "lstm-{task}"}


def env_steps_of(config: dict, step: int) -> int:
    """Environment steps collected by PPO-GTrXL-equivalent update ``step``: one rollout of
    ``n_envs x n_steps`` per ``n_epochs x n_minibatches`` updates, rounded up."""
    a = config["agent"]
    return math.ceil(step / (int(a["n_epochs"]) * int(a["n_minibatches"]))) * int(a["n_envs"]) * int(a["n_steps"])


def eval_curve(run: Path) -> tuple[list[int], list[float]]:
    """(steps, eval/return_mean) of ``run/metrics.jsonl`` in step order; a step logged twice (a
    resumed run repeats the steps after its last checkpoint) counts once, its last line."""
    points: dict[int, float] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if "eval/return_mean" in m:
            points[int(m["step"])] = float(m["eval/return_mean"])
    steps = sorted(points)
    return steps, [points[s] for s in steps]


def run_record(run: Path, seed: int, wall_s: float | None) -> dict:
    """One finished run: its curve (env steps, eval returns), MMER (the curve's max), final
    return (eval.json) and wall time (seconds of its training command, None when unknown)."""
    config = yaml.safe_load((run / "config.yaml").read_text())
    report = json.loads((run / "eval.json").read_text())
    steps, returns = eval_curve(run)
    final = report["results"][0]
    return {"seed": seed, "run_dir": str(run), "env_steps": env_steps_of(config, int(config["train"]["steps"])),
            "curve": {"env_steps": [env_steps_of(config, s) for s in steps], "return_mean": returns},
            "max_return": max(returns) if returns else None, "final_return_mean": float(final["return_mean"]),
            "final_return_std": float(final["return_std"]), "final_episodes": len(final["returns"]),
            "wall_s": wall_s}


def _sweep_seconds(folder: Path) -> dict[int, float]:
    """Seconds per seed of a sweep's results.json: its finished runs' training wall time, also
    when a later run of the sweep skipped them (the sweep keeps their time from its run logs)."""
    path = folder.parent / "results.json"
    if not path.exists():
        return {}
    return {int(r["seed"]): float(r["seconds"]) for r in json.loads(path.read_text())["runs"]
            if r.get("status") in ("ok", "skipped") and r.get("seconds")}


def agent_runs(folder: Path, peer: bool) -> list[dict]:
    """The finished runs (with an eval.json) under ``folder`` (``seed<N>/``), in seed order."""
    seconds = {} if peer else _sweep_seconds(folder)
    out = []
    for run in sorted(folder.glob("seed*"), key=lambda p: int(p.name[4:])):
        if (run / "eval.json").exists():
            seed = int(run.name[4:])
            wall = run / "wall_seconds"
            out.append(run_record(run, seed, float(wall.read_text()) if wall.exists() else seconds.get(seed)))
    return out


def summary(runs: list[dict]) -> dict:
    """MMER (mean over runs of each run's max), final return mean, their population stds, n."""
    maxes = [r["max_return"] for r in runs if r["max_return"] is not None]
    finals = [r["final_return_mean"] for r in runs]
    walls = [r["wall_s"] for r in runs if r["wall_s"] is not None]
    return {"n": len(runs), "mmer": float(np.mean(maxes)) if maxes else None,
            "mmer_std": float(np.std(maxes)) if maxes else None, "final_mean": float(np.mean(finals)),
            "final_std": float(np.std(finals)), "wall_s_mean": float(np.mean(walls)) if walls else None}


def table_row(task: str, agent: str, s: dict, env_steps: int) -> str:
    """One markdown row: task, agent, env steps, runs, MMER +- std, final +- std, wall time per run."""
    def pm(m, sd):
        return "-" if m is None else f"{m:.3f} +- {sd:.3f}"
    wall = "-" if s["wall_s_mean"] is None else f"{s['wall_s_mean'] / 60:.1f} min"
    return (f"| {task} | {agent} | {env_steps:,} | {s['n']} | {pm(s['mmer'], s['mmer_std'])} | "
            f"{pm(s['final_mean'], s['final_std'])} | {wall} |")


def variant_folder(variant: str, task: str) -> str:
    """``gtrxl-<task>/base`` for ``xl`` (the PPO-GTrXL of results_popgym.sh), else ``gtrxl-<variant>-<task>/base``."""
    return f"gtrxl-{task}/base" if variant == "xl" else f"gtrxl-{variant}-{task}/base"


def env_steps_per_second(run: Path) -> float | None:
    """Environment steps per second of a PPO-GTrXL run's training: ``train/env_steps`` between its
    first and last logged update over the wall time between them (evaluations included); None
    with fewer than two logged updates. A resumed run's repeated steps count once (the last)."""
    points: dict[int, tuple[float, float]] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if "train/env_steps" in m:
            points[int(m["step"])] = (float(m["train/env_steps"]), float(m["time"]))
    if len(points) < 2:
        return None
    (e0, t0), (e1, t1) = points[min(points)], points[max(points)]
    return (e1 - e0) / (t1 - t0) if t1 > t0 else None


def act_ms(run: Path) -> dict[int, float]:
    """act() milliseconds per step by batch size, in-package path, of ``run/act.json`` ({} without one)."""
    path = run / "act.json"
    if not path.exists():
        return {}
    return {int(r["batch"]): float(r["ms_per_step"]) for r in json.loads(path.read_text())["rows"]
            if r["path"] == "in-package"}


def variant_row(task: str, variant: str, res: dict) -> str:
    """One row of backbones.md: task, variant, env steps, runs, MMER, final return, env steps/s,
    act() ms at batch 1 and 16, wall time per run."""
    base = table_row(task, variant, res, res["runs"][0]["env_steps"]).rsplit(" | ", 1)
    rate = "-" if res["env_steps_per_s"] is None else f"{res['env_steps_per_s']:.0f}"
    ms = [f"{res['act_ms'][b]:.2f}" if b in res["act_ms"] else "-" for b in (1, 16)]
    return f"{base[0]} | {rate} | {ms[0]} | {ms[1]} | {base[1]}"


def variants_main(args: argparse.Namespace) -> int:
    """``--variants``: the backbone comparison of one task (see the module docstring)."""
    res = {}
    for v in [x for x in args.variants.split(",") if x]:
        folder = args.out_root / variant_folder(v, args.task)
        runs = agent_runs(folder, peer=False)
        if not runs:
            continue
        timing = folder.parent / "timing"
        if (timing / "metrics.jsonl").exists():  # the short run of every variant, back to back
            rate, source = env_steps_per_second(timing), str(timing)
        else:  # the training runs' own logs (each under the load of its time)
            rates = [r for r in (env_steps_per_second(Path(x["run_dir"])) for x in runs) if r is not None]
            rate, source = (float(np.mean(rates)) if rates else None), "the runs' metrics.jsonl"
        res[v] = {"folder": str(folder), **summary(runs), "env_steps_per_s": rate, "env_steps_per_s_from": source,
                  "act_ms": act_ms(Path(runs[0]["run_dir"])), "runs": runs}
    if not res:
        print(f"error: {args.out_root}: no finished run of {args.task} (eval.json) for the variants "
              f"{args.variants}", file=sys.stderr)
        return 2
    args.doc.mkdir(parents=True, exist_ok=True)
    (args.doc / f"backbones-{args.task}.json").write_text(json.dumps(
        {"task": args.task, "env_id": f"popgym-{args.task}-v0", "variants": res}, indent=1) + "\n")
    plot(args.task, res, args.doc / f"backbones-{args.task}.png")
    rows = [variant_row(args.task, v, r) for v, r in res.items()]
    header = ["| task | variant | env steps | runs | MMER | final return | env steps/s | act() ms, 1 env | "
              "act() ms, 16 envs | wall time per run |", "|---|---|--:|--:|---|---|--:|--:|--:|--:|"]
    _write_rows(args.doc / "backbones.md", header, args.task, rows)
    print("\n".join(rows))
    return 0


def _write_rows(table: Path, header: list[str], task: str, rows: list[str]) -> None:
    """Replace ``task``'s rows of the markdown ``table`` (other tasks' rows kept, sorted)."""
    kept = [line for line in (table.read_text().splitlines() if table.exists() else [])
            if line.startswith("| ") and not line.startswith(f"| {task} |") and not line.startswith("| task")]
    table.write_text("\n".join(header + sorted(kept + rows)) + "\n")


def plot(task: str, agents: dict, path: Path) -> None:
    """Every run's evaluation curve, one colour per agent, to ``path``."""
    import matplotlib  # optional plotting dependency: only when a figure is written

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for (name, res), colour in zip(agents.items(), ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")):
        for i, r in enumerate(res["runs"]):
            ax.plot(r["curve"]["env_steps"], r["curve"]["return_mean"], color=colour, marker="o", markersize=3,
                    label=name if i == 0 else None)
    ax.set(title=f"popgym-{task}-v0", xlabel="environment steps", ylabel="evaluation return (mean)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Write ``DOC/<task>.json``, ``DOC/<task>.png`` and the task's rows of ``DOC/table.md``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("task")
    p.add_argument("--out-root", type=Path, default=Path("runs/results-popgym"))
    p.add_argument("--doc", type=Path, default=Path("docs/results/popgym"))
    p.add_argument("--variants", default=None, help="comma-separated PPO-GTrXL backbone variants to compare")
    args = p.parse_args(argv)
    if args.variants is not None:
        return variants_main(args)
    agents = {}
    for name, pattern in AGENTS.items():
        folder = args.out_root / pattern.format(task=args.task)
        runs = agent_runs(folder, peer=name == "RecurrentPPO")
        if runs:
            agents[name] = {"folder": str(folder), **summary(runs), "runs": runs}
    if not agents:
        print(f"error: {args.out_root}: no finished run of {args.task} (eval.json) under "
              f"{', '.join(p.format(task=args.task) for p in AGENTS.values())}", file=sys.stderr)
        return 2
    args.doc.mkdir(parents=True, exist_ok=True)
    env_steps = {name: a["runs"][0]["env_steps"] for name, a in agents.items()}
    result = {"task": args.task, "env_id": f"popgym-{args.task}-v0", "agents": agents,
              "mmer": "mean over runs of each run's maximum evaluation return (POPGym's MMER over the eval curve)"}
    (args.doc / f"{args.task}.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(args.task, agents, args.doc / f"{args.task}.png")
    rows = [table_row(args.task, name, a, env_steps[name]) for name, a in agents.items()]
    header = ["| task | agent | env steps | runs | MMER | final return | wall time per run |",
              "|---|---|--:|--:|---|---|--:|"]
    _write_rows(args.doc / "table.md", header, args.task, rows)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
