"""``rl-tformers sweep``: a grid of training runs (config values x seeds), run in parallel local
processes or as tasks of a Ray cluster, collected into one results table and one plot.

    rl-tformers sweep -c dt/hopper_medium --grid backbone.attention.kind=sdpa,performer \\
        --seeds 0,1,2 --jobs 3 --out runs/sweep-attn train.steps=20000

Each grid point x seed is one ordinary ``rl-tformers train`` process with its own run directory
``OUT/<point>/seed<k>`` (checkpoints, TensorBoard, metrics.jsonl, as for any run), so every run
can be inspected, evaluated or resumed on its own. Running the same command again skips the runs
that are complete and resumes those that stopped (crash, Ctrl-C, time limit): a sweep is
restartable at no extra cost. The results are read back from each run's ``metrics.jsonl``:

- ``OUT/results.csv`` / ``results.json`` / ``results.md``: one row per run (grid values, seed,
  status, steps, wall time, last logged training and evaluation scalars) and a summary per grid
  point (mean, standard deviation and count over seeds of ``--metric``);
- ``OUT/results.png``: ``--metric`` per grid point, mean with one standard deviation over seeds.

Why not a scheduler of our own: locally a ``concurrent.futures.ThreadPoolExecutor`` of
``--jobs`` workers, each waiting on one training subprocess (process isolation, a crash fails
one run only, each process gets ``--threads`` intra-op threads); on a cluster ``--launcher ray``
turns every run into a Ray task (``num_cpus=--threads``, ``num_gpus=--gpus-per-run``) and Ray
does the placement, queueing and retries (``ray.init()`` joins the cluster named by
``RAY_ADDRESS``, or starts a local one). The run directories must then be on a file system
every node sees (the usual NFS/Lustre home of a cluster).
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: Metrics tried, in order, when ``--metric`` is not given.
DEFAULT_METRICS = ("eval/normalized_score", "eval/return_mean", "eval/return", "train/loss")
LAUNCHERS = ("local", "ray")


class SweepError(ValueError):
    """A sweep cannot be set up (bad grid, unknown launcher, Ray not installed...)."""


@dataclass(frozen=True)
class SweepRun:
    """One run of a sweep.

    Attributes:
        name: ``<point>/seed<k>``, also its run directory relative to the sweep folder.
        point: grid values of this run, ``{dotted key: value string}`` (seed excluded).
        seed: the run's ``seed``.
        overrides: every ``KEY=VALUE`` of the run (common ones, the grid values, the seed).
        run_dir: the run directory.
    """

    name: str
    point: dict[str, str]
    seed: int
    overrides: tuple[str, ...]
    run_dir: Path

    @property
    def point_label(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.point.items()) or "(base)"


@dataclass
class RunOutcome:
    """What happened to one run: ``status`` is ``ok``, ``skipped`` (already complete),
    ``failed`` (exit code != 0; see ``log``) or ``not run``."""

    status: str
    returncode: int | None = None
    seconds: float = 0.0
    log: str = ""


@dataclass
class SweepResult:
    """Rows per run, summary per grid point, and the files written."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    summary: list[dict[str, Any]] = field(default_factory=list)
    metric: str | None = None
    files: list[str] = field(default_factory=list)


# -- grid ------------------------------------------------------------------------------------------

def split_values(text: str) -> list[str]:
    """``"a,b,[1,2],{k: v}"`` -> ``["a", "b", "[1,2]", "{k: v}"]``: commas inside brackets or
    braces do not split (so list- and dict-valued YAML options can be swept)."""
    out, depth, cur = [], 0, []
    for ch in text:
        if ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur).strip())
    return [v for v in out if v]


def parse_grid(items: Sequence[str]) -> dict[str, list[str]]:
    """``["backbone.attention.kind=sdpa,performer", "train.lr=1e-4,3e-4"]`` -> ``{key: [values]}``.

    Raises:
        SweepError: an item without ``=`` or values, a key given twice, or ``seed`` (use --seeds).
    """
    grid: dict[str, list[str]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip()
        if not sep or not key or not split_values(values):
            raise SweepError(f"--grid {item!r}: expected KEY=V1,V2,... (e.g. backbone.attention.kind=sdpa,performer)")
        if key == "seed":
            raise SweepError("sweep seeds with --seeds 0,1,2, not --grid seed=...")
        if key in grid:
            raise SweepError(f"--grid: {key} is given twice")
        grid[key] = split_values(values)
    return grid


def parse_seeds(text: str) -> list[int]:
    """``"0,1,2"`` or ``"0-4"`` (inclusive range) -> list of ints.

    Raises:
        SweepError: not integers, or a repeated seed.
    """
    seeds: list[int] = []
    try:
        for part in split_values(text):
            if re.fullmatch(r"\d+-\d+", part):
                lo, hi = (int(x) for x in part.split("-"))
                seeds += list(range(lo, hi + 1))
            else:
                seeds.append(int(part))
    except ValueError:
        raise SweepError(f"--seeds {text!r}: expected integers like 0,1,2 or 0-4") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise SweepError(f"--seeds {text!r}: give at least one seed, each once")
    return seeds


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=+-]+", "_", text).strip("_") or "x"


def expand(grid: dict[str, list[str]], seeds: Sequence[int], out_dir: str | os.PathLike,
           overrides: Sequence[str] = ()) -> list[SweepRun]:
    """Every grid point (cartesian product, in the order given) x every seed, as :class:`SweepRun`."""
    out = Path(out_dir)
    keys = list(grid)
    runs = []
    for values in itertools.product(*(grid[k] for k in keys)):
        point = dict(zip(keys, values))
        label = "__".join(f"{k.split('.')[-1] if _unique_suffix(keys, k) else k}={v}" for k, v in point.items())
        folder = _slug(label) if point else "base"
        for seed in seeds:
            name = f"{folder}/seed{seed}"
            ov = (*overrides, *(f"{k}={v}" for k, v in point.items()), f"seed={seed}")
            runs.append(SweepRun(name=name, point=point, seed=int(seed), overrides=ov, run_dir=out / name))
    return runs


def _unique_suffix(keys: Sequence[str], key: str) -> bool:
    last = key.split(".")[-1]
    return sum(k.split(".")[-1] == last for k in keys) == 1


# -- running ---------------------------------------------------------------------------------------

def run_state(run_dir: Path) -> str:
    """``new`` (nothing there), ``complete`` or ``partial`` (has a checkpoint, not finished)."""
    from rl_tformers.runtime import checkpoint as ckpt
    from rl_tformers.runtime.trainer import holds_run

    if not holds_run(run_dir):
        return "new"
    found = ckpt.list_checkpoints(run_dir)
    if not found:
        return "partial"
    try:
        state = ckpt.load_checkpoint(found[0][1])
        import yaml

        steps = int(yaml.safe_load(state["config"])["train"]["steps"])
        return "complete" if int(state["step"]) >= steps else "partial"
    except Exception:  # noqa: BLE001 - a damaged newest checkpoint: let --resume sort it out
        return "partial"


def train_command(run: SweepRun, config: str | None, state: str, device: str | None = None) -> list[str]:
    """The ``rl-tformers train`` command line of ``run`` (``--resume`` when it has a checkpoint)."""
    base = [sys.executable, "-m", "rl_tformers.cli", "train"]
    if state == "partial":
        return [*base, "--resume", str(run.run_dir), "train.progress=false"]
    cmd = [*base, "--run-dir", str(run.run_dir)]
    if config:
        cmd += ["--config", config]
    if device:
        cmd += ["--device", device]
    return [*cmd, *run.overrides, "train.progress=false"]


def _run_subprocess(cmd: list[str], env_updates: dict[str, str], log_path: str) -> tuple[int, float, str]:
    """Run ``cmd`` with its output in ``log_path``; returns (exit code, seconds, last lines of the log)."""
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        rc = subprocess.call(cmd, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, **env_updates})
    seconds = time.perf_counter() - t0
    tail = "".join(Path(log_path).read_text(errors="replace").splitlines(keepends=True)[-15:])
    return rc, seconds, tail


def thread_env(threads: int) -> dict[str, str]:
    """Environment giving a training process ``threads`` intra-op threads (OpenMP/MKL/PyTorch)."""
    n = str(max(1, int(threads)))
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "PYTHONUNBUFFERED": "1"}


def run_local(commands: Sequence[tuple[SweepRun, list[str]]], jobs: int, threads: int, log_dir: Path,
              echo: Callable[[str], None] = print) -> dict[str, RunOutcome]:
    """Run the commands ``jobs`` at a time in local subprocesses (a thread pool waits on them)."""
    outcomes: dict[str, RunOutcome] = {}

    def one(item: tuple[SweepRun, list[str]]) -> tuple[str, RunOutcome]:
        run, cmd = item
        rc, seconds, tail = _run_subprocess(cmd, thread_env(threads), str(log_dir / f"{_slug(run.name)}.log"))
        return run.name, RunOutcome("ok" if rc == 0 else "failed", rc, seconds, tail)

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for name, outcome in pool.map(one, commands):
            outcomes[name] = outcome
            echo(f"{outcome.status:7s} {name} ({outcome.seconds:.0f} s)")
    return outcomes


def import_ray() -> Any:
    """The ``ray`` module, or a :class:`SweepError` saying how to install it."""
    try:
        import ray
    except ImportError:
        raise SweepError(
            "--launcher ray needs Ray: pip install 'ray[default]' (and start or join a cluster: "
            "`ray start --head` on one node, `ray start --address HEAD:6379` on the others, then run the "
            "sweep with RAY_ADDRESS=HEAD:6379 or on the head node); --launcher local runs here without it"
        ) from None
    return ray


def run_ray(commands: Sequence[tuple[SweepRun, list[str]]], threads: int, gpus_per_run: float, log_dir: Path,
            echo: Callable[[str], None] = print) -> dict[str, RunOutcome]:
    """Run every command as a Ray task (``num_cpus=threads``, ``num_gpus=gpus_per_run``); Ray
    schedules them on the cluster. ``ray.init()`` joins ``RAY_ADDRESS`` or starts a local Ray."""
    ray = import_ray()
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS") or None)
    task = ray.remote(num_cpus=max(1, threads), num_gpus=gpus_per_run)(_run_subprocess)
    refs = {run.name: task.remote(cmd, thread_env(threads), str(log_dir / f"{_slug(run.name)}.log"))
            for run, cmd in commands}
    outcomes: dict[str, RunOutcome] = {}
    for name, ref in refs.items():
        rc, seconds, tail = ray.get(ref)
        outcomes[name] = RunOutcome("ok" if rc == 0 else "failed", rc, seconds, tail)
        echo(f"{outcomes[name].status:7s} {name} ({seconds:.0f} s)")
    return outcomes


# -- results ---------------------------------------------------------------------------------------

def last_scalars(run_dir: Path) -> dict[str, float]:
    """The last logged value of every scalar in ``run_dir/metrics.jsonl`` (plus ``step``)."""
    path = Path(run_dir) / "metrics.jsonl"
    out: dict[str, float] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut off by a crash
        for k, v in rec.items():
            if k != "time" and isinstance(v, (int, float)):
                out[k] = float(v)
    return out


def collect(runs: Sequence[SweepRun], outcomes: dict[str, RunOutcome]) -> list[dict[str, Any]]:
    """One row per run: name, grid values, seed, status, exit code, seconds, then its last scalars."""
    rows = []
    for run in runs:
        o = outcomes.get(run.name, RunOutcome("not run"))
        scalars = last_scalars(run.run_dir)
        row: dict[str, Any] = {"run": run.name, **run.point, "seed": run.seed, "status": o.status,
                               "returncode": o.returncode, "seconds": round(o.seconds, 2),
                               "step": int(scalars.pop("step")) if "step" in scalars else None}
        row.update({k: scalars[k] for k in sorted(scalars)})
        rows.append(row)
    return rows


def pick_metric(rows: Sequence[dict[str, Any]], metric: str | None) -> str | None:
    """``metric`` if given, else the first of :data:`DEFAULT_METRICS` that some run logged."""
    if metric:
        return metric
    return next((m for m in DEFAULT_METRICS if any(m in r for r in rows)), None)


def summarize(runs: Sequence[SweepRun], rows: Sequence[dict[str, Any]], metric: str | None) -> list[dict[str, Any]]:
    """Per grid point: mean, standard deviation (n - 1) and count over seeds of ``metric``."""
    by_run = {r["run"]: r for r in rows}
    points: dict[str, list[SweepRun]] = {}
    for run in runs:
        points.setdefault(run.point_label, []).append(run)
    out = []
    for label, rs in points.items():
        vals = [by_run[r.name][metric] for r in rs if metric and isinstance(by_run[r.name].get(metric), float)
                and math.isfinite(by_run[r.name][metric])]
        out.append({"point": label, **rs[0].point, "metric": metric, "n": len(vals), "of": len(rs),
                    "mean": statistics.fmean(vals) if vals else None,
                    "std": statistics.stdev(vals) if len(vals) > 1 else (0.0 if vals else None)})
    return out


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def markdown(rows: Sequence[dict[str, Any]], summary: Sequence[dict[str, Any]], metric: str | None) -> str:
    """Summary table (per grid point) then the per-run table, as Markdown."""
    lines = [f"## Summary: {metric or '(no metric logged)'} over seeds", "",
             "| grid point | mean | std | seeds |", "|---|---|---|---|"]
    lines += [f"| {s['point']} | {_fmt(s['mean'])} | {_fmt(s['std'])} | {s['n']}/{s['of']} |" for s in summary]
    cols = ["run", "seed", "status", "step", "seconds"]
    extra = [c for c in ("train/loss", metric) if c and c not in cols]
    lines += ["", "## Runs", "", "| " + " | ".join(cols + extra) + " |", "|" + "---|" * len(cols + extra)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols + extra) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def plot(summary: Sequence[dict[str, Any]], metric: str, path: Path, title: str = "") -> None:
    """Bar chart of ``metric`` per grid point: mean over seeds, error bar one standard deviation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [s for s in summary if s["mean"] is not None]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(pts) + 2), 4))
    ax.bar(range(len(pts)), [s["mean"] for s in pts], yerr=[s["std"] or 0.0 for s in pts], capsize=4,
           color="tab:blue", alpha=0.8)
    ax.set_xticks(range(len(pts)))
    ax.set_xticklabels([s["point"] for s in pts], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(metric)
    ax.set_title(title or f"{metric}: mean +- std over seeds")
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(out_dir: Path, runs: Sequence[SweepRun], outcomes: dict[str, RunOutcome],
                  metric: str | None = None) -> SweepResult:
    """Collect every run and write ``results.{csv,json,md,png}`` into ``out_dir``."""
    rows = collect(runs, outcomes)
    metric = pick_metric(rows, metric)
    summary = summarize(runs, rows, metric)
    res = SweepResult(rows=rows, summary=summary, metric=metric)
    out_dir.mkdir(parents=True, exist_ok=True)
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    with open(out_dir / "results.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)
    failed = {name: asdict(o) for name, o in outcomes.items() if o.status == "failed"}
    (out_dir / "results.json").write_text(json.dumps(
        {"metric": metric, "summary": summary, "runs": rows, "failed": failed}, indent=2))
    (out_dir / "results.md").write_text(markdown(rows, summary, metric))
    res.files = [str(out_dir / f"results.{ext}") for ext in ("csv", "json", "md")]
    if metric and any(s["mean"] is not None for s in summary):
        plot(summary, metric, out_dir / "results.png")
        res.files.append(str(out_dir / "results.png"))
    return res


def sweep(config: str | None, grid: dict[str, list[str]], seeds: Sequence[int], out_dir: str | os.PathLike,
          overrides: Sequence[str] = (), *, jobs: int = 1, threads: int = 1, launcher: str = "local",
          gpus_per_run: float = 0.0, device: str | None = None, metric: str | None = None,
          echo: Callable[[str], None] = print) -> SweepResult:
    """Run (or finish) a sweep and write its results; see the module docstring.

    Args:
        config: the base config (path or packaged name), shared by every run.
        grid: ``{dotted key: [values]}`` (:func:`parse_grid`).
        seeds: seeds of every grid point.
        out_dir: sweep folder (run directories, logs/, results.*).
        overrides: ``KEY=VALUE`` applied to every run (before the grid values).
        jobs: local runs at the same time (``launcher="local"``).
        threads: intra-op threads of each run (and Ray ``num_cpus``).
        launcher: ``local`` or ``ray``.
        gpus_per_run: Ray ``num_gpus`` of each run (fractions share a GPU).
        device: ``--device`` of every run.
        metric: the summary/plot metric (default: first of :data:`DEFAULT_METRICS` logged).

    Raises:
        SweepError: unknown launcher, or Ray missing with ``launcher="ray"`` (before any run starts).
    """
    if launcher not in LAUNCHERS:
        raise SweepError(f"--launcher {launcher!r}; use one of {', '.join(LAUNCHERS)}")
    if launcher == "ray":
        import_ray()
    out = Path(out_dir)
    runs = expand(grid, seeds, out, overrides)
    outcomes: dict[str, RunOutcome] = {}
    todo = []
    for run in runs:
        state = run_state(run.run_dir)
        if state == "complete":
            outcomes[run.name] = RunOutcome("skipped", 0)
            echo(f"skipped {run.name} (complete)")
        else:
            todo.append((run, train_command(run, config, state, device)))
    echo(f"sweep: {len(runs)} runs ({len(todo)} to run) over {len(runs) // max(1, len(seeds))} grid points x "
         f"{len(seeds)} seeds -> {out}")
    log_dir = out / "logs"
    if todo:
        if launcher == "local":
            outcomes.update(run_local(todo, jobs, threads, log_dir, echo))
        else:
            outcomes.update(run_ray(todo, threads, gpus_per_run, log_dir, echo))
    return write_results(out, runs, outcomes, metric)


SWEEP_HELP = """Run a grid of training runs (config values x seeds) in parallel and collect one results table and plot.

Every grid point x seed is an ordinary `rl-tformers train` run in OUT/<point>/seed<k>. Running the same command again skips complete runs and resumes unfinished ones. Results: OUT/results.csv, results.json, results.md (per run and mean/std over seeds per grid point) and results.png.

Examples:

  rl-tformers sweep -c dt/hopper_medium --grid backbone.attention.kind=sdpa,performer --seeds 0,1,2 --jobs 3 --out runs/sweep-attn train.steps=20000

  rl-tformers sweep -c toy --grid backbone.n_layers=1,2 --grid train.lr=1e-3,3e-3 --seeds 0-1 --out runs/sweep-toy

On a Ray cluster (run directories on a shared file system): add --launcher ray (RAY_ADDRESS=head:6379 to join a running cluster; --gpus-per-run 1 to give each run a GPU).
"""


def register(app) -> None:
    """Add ``sweep`` to the ``rl-tformers`` app."""
    import typer

    def sweep_command(
        overrides: list[str] = typer.Argument(None, metavar="[KEY=VALUE]...", help="Overrides applied to every run."),
        config: str = typer.Option(None, "--config", "-c", help="Base config: a path or a packaged name."),
        grid: list[str] = typer.Option(None, "--grid", "-g", metavar="KEY=V1,V2",
                                       help="A swept option and its values (repeat for a cartesian product)."),
        seeds: str = typer.Option("0", "--seeds", help="Seeds of every grid point: 0,1,2 or 0-4."),
        out: Path = typer.Option(None, "--out", "-o", help="Sweep folder (default runs/sweep-<time>)."),
        jobs: int = typer.Option(1, "--jobs", "-j", min=1, help="Local runs at the same time."),
        threads: int = typer.Option(0, "--threads", min=0,
                                    help="Intra-op threads per run (0: CPU cores / jobs, at least 1)."),
        launcher: str = typer.Option("local", "--launcher", help="local (subprocesses here) or ray (a Ray cluster)."),
        gpus_per_run: float = typer.Option(0.0, "--gpus-per-run", min=0.0, help="Ray only: GPUs per run."),
        device: str = typer.Option(None, "--device", help="Device of every run (auto | cpu | cuda...)."),
        metric: str = typer.Option(None, "--metric", help="Summary/plot metric (default: eval score, else train/loss)."),
    ) -> None:
        from datetime import datetime

        try:
            g = parse_grid(grid or [])
            s = parse_seeds(seeds)
            folder = out or Path("runs") / f"sweep-{datetime.now():%Y%m%d-%H%M%S}"
            n_threads = threads or max(1, (os.cpu_count() or 1) // jobs)
            res = sweep(config, g, s, folder, list(overrides or []), jobs=jobs, threads=n_threads, launcher=launcher,
                        gpus_per_run=gpus_per_run, device=device, metric=metric,
                        echo=lambda m: typer.echo(m, err=True))
        except SweepError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        typer.echo(markdown(res.rows, res.summary, res.metric))
        typer.echo("wrote " + ", ".join(res.files), err=True)
        if any(r["status"] == "failed" for r in res.rows):
            raise typer.Exit(1)

    app.command("sweep", help=SWEEP_HELP, no_args_is_help=True)(sweep_command)
