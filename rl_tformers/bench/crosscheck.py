"""Cross-check of our DT / BC results with a reference implementation: d3rlpy 2.8's own
``DecisionTransformer`` and ``BC``, trained on the same dataset with our shortened settings and
evaluated in Hopper-v5 (see docs/dt.md, "Medium-expert: DT does not beat BC here, and why").

This driver runs in our environment: it exports the dataset (D4RL layout, :func:`d4rl_arrays`)
to an .npz, computes the dataset's top episode return (DT's default target), starts the worker
:mod:`rl_tformers.bench._peer_crosscheck` once per (algorithm, seed) in the peers' virtual
environment (``.bench-venvs/peers``; ``rl-tformers bench train --build-peers`` builds it) and
writes one JSON with every run, the per-seed and across-seed means and D4RL-normalised scores::

    OMP_NUM_THREADS=1 nice -n 10 python -m rl_tformers.bench.crosscheck \\
        --dataset rlt/hopper-v5/medium-expert-v0 --seeds 0,1,2 --extra-targets 3300 \\
        --out runs/crosscheck/d3rlpy-hopper-medium-expert.json

Every option is checked before anything is loaded, exported or started (errors are one
``error: ...`` line, exit code 2): the seeds, algorithms and targets, the peers' python (which
``--reuse-only`` does not need), the dataset (continuous actions; its environment is ``--env``,
which defaults to it; D4RL reference scores exist for it).

Runs are sequential, one thread each. A run already in ``--work`` (its per-run JSON) is reused,
so an interrupted cross-check resumes, but only when it was made with the same settings: the
worker records every option it ran with (``settings``) and the driver adds the dataset's content
fingerprint (``data.sha256``: SHA-256 of the exported arrays, whatever path the data came from).
A per-run JSON made with other settings or other data is refused before any run starts, naming
the file and the differing settings (as ``rl-tformers sweep`` refuses a run directory holding a
run with another config): use another ``--work`` or delete those files to run them again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from rl_tformers.bench import _peer_crosscheck as worker
from rl_tformers.bench.train import d4rl_arrays, default_peer_python
from rl_tformers.envs.loaders import load_dataset
from rl_tformers.envs.scores import reference_scores

WORKER = Path(__file__).with_name("_peer_crosscheck.py")


class CrosscheckError(ValueError):
    """A bad option, dataset or ``--work`` directory; the message names it."""


def export_dataset(dataset, path: Path, arrays: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    """Write ``dataset`` (an EpisodeDataset) to ``path`` (.npz, D4RL layout) and return its summary:
    ``steps``, ``episodes``, ``top_return`` (best episode return) and ``mean_return``.
    ``arrays``: ``d4rl_arrays(dataset)`` when already computed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **(arrays if arrays is not None else d4rl_arrays(dataset)))
    return dataset_summary(dataset)


def dataset_summary(dataset) -> dict[str, Any]:
    rets = np.asarray(dataset.episode_returns, dtype=np.float64)
    return {"steps": int(dataset.num_steps), "episodes": int(dataset.num_episodes),
            "top_return": float(rets.max()), "mean_return": float(rets.mean())}


def data_fingerprint(arrays: dict[str, np.ndarray]) -> str:
    """SHA-256 of the exported arrays (names, dtypes, shapes and bytes): what the workers train on."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _parse_list(text: str, option: str, convert, what: str) -> list:
    items = [t.strip() for t in text.split(",")]
    if not text.strip():
        return []
    out = []
    for item in items:
        try:
            value = convert(item)
        except ValueError:
            raise CrosscheckError(f"{option} {text!r}: {item!r} is not {what}") from None
        if value in out:
            raise CrosscheckError(f"{option} {text!r}: {item!r} is given twice")
        out.append(value)
    return out


def _seed(item: str) -> int:
    v = int(item)
    if v < 0:
        raise ValueError(item)
    return v


#: the peers' algorithms the cross-check runs (d3rlpy's DecisionTransformer, BC, IQL, CQL)
ALGOS = ("dt", "bc", "iql", "cql")


def _algo(item: str) -> str:
    if item not in ALGOS:
        raise ValueError(item)
    return item


def _target(item: str) -> float:
    v = float(item)
    if not math.isfinite(v):
        raise ValueError(item)
    return v


def parse_options(args: argparse.Namespace) -> tuple[list[int], list[str], list[float]]:
    """Seeds, algorithms and extra DT targets of the command line, checked.

    Raises:
        CrosscheckError: naming the option at fault.
    """
    seeds = _parse_list(args.seeds, "--seeds", _seed, "a seed (an integer >= 0)")
    if not seeds:
        raise CrosscheckError("--seeds is empty; give e.g. --seeds 0,1,2")
    algos = _parse_list(args.algos, "--algos", _algo, f"an algorithm ({', '.join(ALGOS)})")
    if not algos:
        raise CrosscheckError(f"--algos is empty; give some of {','.join(ALGOS)}")
    extra = _parse_list(args.extra_targets, "--extra-targets", _target, "a finite number")
    if extra and "dt" not in algos:
        raise CrosscheckError(f"--extra-targets {args.extra_targets!r}: targets are for dt, which --algos "
                              f"{args.algos!r} does not run")
    for option, value in (("--steps", args.steps), ("--episodes", args.episodes)):
        if value < 1:
            raise CrosscheckError(f"{option} must be >= 1, got {value}")
    if args.eval_every < 0 or (args.eval_every and args.steps % args.eval_every):
        raise CrosscheckError(f"--eval-every {args.eval_every} must be 0 (evaluate at the end only) or divide "
                              f"--steps {args.steps}")
    return seeds, algos, extra


def check_dataset_env(ds, env: str | None, spec: str) -> str:
    """The environment the peers evaluate in: ``--env``, else the dataset's. Refuses a dataset
    with discrete actions (d3rlpy's continuous DT and BC run here), an ``--env`` other than the
    dataset's, a dataset that names no environment without ``--env``, an unregistered id and an
    environment whose observation or action shapes are not the dataset's.

    Raises:
        CrosscheckError: naming ``--dataset`` or ``--env``.
    """

    if ds.discrete_actions:
        raise CrosscheckError(f"--dataset {spec}: discrete actions ({ds.action_space}); the cross-check runs "
                              f"d3rlpy's continuous-action DT and BC")
    own = ds.metadata.env_id
    if env is None:
        if not own:
            raise CrosscheckError(f"--dataset {spec} records no environment; name the one it came from with "
                                  f"--env (e.g. --env Hopper-v5)")
        env = str(own)
    elif own and str(own) != env:
        raise CrosscheckError(f"--env {env}, but --dataset {spec} comes from {own}; the peers would evaluate in "
                              f"the wrong environment (drop --env, or pass --env {own})")
    try:
        gym.spec(env)
    except gym.error.Error as exc:
        raise CrosscheckError(f"--env {env!r} is not a registered gymnasium environment ({exc})") from None
    try:
        e = gym.make(env)
    except (gym.error.DependencyNotInstalled, ImportError) as exc:
        print(f"warning: cannot make {env} here to check it against the dataset ({exc})", file=sys.stderr)
        return env
    try:
        obs_space, act_space = e.observation_space, e.action_space
    finally:
        e.close()
    if tuple(getattr(obs_space, "shape", None) or ()) != tuple(ds.observation_shape) or not isinstance(
            act_space, gym.spaces.Box) or tuple(act_space.shape) != tuple(ds.action_shape):
        raise CrosscheckError(
            f"--env {env} has observations {obs_space} and actions {act_space}, but --dataset {spec} has "
            f"observations of shape {tuple(ds.observation_shape)} and actions of shape {tuple(ds.action_shape)}")
    return env


def worker_argv(algo: str, seed: int, data: Path, out: Path, steps: int, episodes: int, env: str,
                targets: list[float], conservative_weight: float = 5.0, eval_every: int = 0) -> list[str]:
    """The worker's command-line options for one run."""
    return ["--algo", algo, "--data", str(data), "--seed", str(seed), "--steps", str(steps),
            "--episodes", str(episodes), "--env", env, "--out", str(out),
            "--targets", ",".join(repr(t) for t in targets) if algo == "dt" else "",
            *(["--conservative-weight", repr(conservative_weight)] if algo == "cql" else []),
            *(["--eval-every", str(eval_every)] if eval_every else [])]


def reuse_problem(path: Path, settings: dict[str, Any], sha256: str) -> str | None:
    """Why the per-run JSON ``path`` cannot stand for a run with ``settings`` on data ``sha256``
    (None: it can be reused). Differences read ``key: stored (stored) -> requested (requested)``.
    A run with a learning curve (``eval_every``) stands for the same run without one (the
    evaluations in between do not change training); the reverse is a difference."""
    try:
        run = json.loads(path.read_text())
        stored, data = dict(run["settings"]), dict(run.get("data") or {})
        if "eval_every" not in settings:
            stored.pop("eval_every", None)
        if not isinstance(run["results"], list):
            raise TypeError("'results' is not a list")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{path}: not a readable result of the cross-check worker ({type(exc).__name__}: {exc})"
    show = lambda d, k: repr(d[k]) if k in d else "<unset>"  # noqa: E731
    diffs = [f"{k}: {show(stored, k)} (stored) -> {show(settings, k)} (requested)"
             for k in sorted(set(stored) | set(settings)) if k not in stored or k not in settings or stored[k] != settings[k]]
    if data.get("sha256") != sha256:
        was = (f"{data.get('sha256')} ({data.get('dataset')})" if data.get("sha256")
               else "not recorded (made by an older cross-check)")
        diffs.append(f"dataset sha256: {was} (stored) -> {sha256} (requested)")
    return f"{path} was made with other settings: " + ", ".join(diffs) if diffs else None


def summarise(runs: list[dict[str, Any]], ref: tuple[float, float]) -> list[dict[str, Any]]:
    """Rows ``{algo, target, per_seed (mean return of each seed), mean, std, normalised per seed,
    normalised mean ± std}`` (std over seeds, population std as in our tables)."""
    lo, hi = ref
    norm = lambda r: 100.0 * (r - lo) / (hi - lo)  # noqa: E731
    groups: dict[tuple[str, Any], list[tuple[int, float]]] = {}
    for run in runs:
        for r in run["results"]:
            groups.setdefault((run["algo"], r["target"]), []).append((run["seed"], float(np.mean(r["returns"]))))
    rows = []
    for (algo, target), vals in groups.items():
        vals.sort()
        means = np.array([v for _, v in vals])
        rows.append({
            "algo": algo, "target": target, "seeds": [s for s, _ in vals], "per_seed_return": means.tolist(),
            "return_mean": float(means.mean()), "return_std": float(means.std()),
            "per_seed_normalised": [norm(m) for m in means],
            "normalised_mean": float(norm(means).mean()), "normalised_std": float(norm(means).std()),
        })
    return rows


def _fail(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python -m rl_tformers.bench.crosscheck``."""
    ap = argparse.ArgumentParser(description="d3rlpy DT / BC / IQL / CQL cross-check on one of our datasets")
    ap.add_argument("--dataset", default="rlt/hopper-v5/medium-expert-v0")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--algos", default="dt,bc")
    ap.add_argument("--extra-targets", default="", help="DT targets besides the dataset's top return, e.g. 3300")
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--episodes", type=int, default=10)
    ap.add_argument("--conservative-weight", type=float, default=5.0,
                    help="CQL's alpha (d3rlpy's reproduction script: 10 on medium sets, 5 otherwise)")
    ap.add_argument("--eval-every", type=int, default=0,
                    help="also evaluate every N updates, a learning curve in each run's JSON (N divides --steps)")
    ap.add_argument("--reuse-only", action="store_true",
                    help="run nothing (no peers' python needed): summarise the requested runs that --work holds, "
                         "naming the ones it lacks")
    ap.add_argument("--env", default=None, help="evaluation environment (default: the dataset's; must match it)")
    ap.add_argument("--python", default=None, help="the peers' python (default: .bench-venvs/peers/bin/python)")
    ap.add_argument("--work", default="runs/crosscheck/work", help="exported data, per-run JSON and logs")
    ap.add_argument("--out", default="runs/crosscheck/d3rlpy-hopper-medium-expert.json")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args, argv)
    except CrosscheckError as exc:
        return _fail(str(exc))


def _peer_python(given: str | None) -> str:
    """The interpreter of the peers' environment: ``--python``, else the one ``bench train
    --build-peers`` made.

    Raises:
        CrosscheckError: there is none, or it is not an executable file.
    """
    python = given or default_peer_python()
    if not python:
        raise CrosscheckError("no peers' environment: run `rl-tformers bench train --build-peers` first, or pass --python")
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise CrosscheckError(f"--python {python}: not an executable file")
    return python


def _plan(args: argparse.Namespace, seeds: list[int], algos: list[str], work: Path, data_path: Path, env_id: str,
          targets: list[float], sha256: str) -> list[tuple[str, int, Path, list[str], bool]]:
    """(algo, seed, result file, worker arguments, reuse) of every run; a result file in ``work``
    is reused when it holds the same settings and data.

    Raises:
        CrosscheckError: ``--work`` holds result files that cannot be reused (each named).
    """
    plan, problems, curve_only = [], [], True
    for seed in seeds:
        for algo in algos:
            out = work / f"{algo}-s{seed}.json"
            wargs = worker_argv(algo, seed, data_path, out.resolve().with_name(out.name + ".tmp"), args.steps,
                                args.episodes, env_id, targets, args.conservative_weight, args.eval_every)
            settings = worker.recorded_settings(worker.build_parser().parse_args(wargs))
            reuse = out.exists()
            if reuse:
                problem = reuse_problem(out, settings, sha256)
                if problem is not None:
                    problems.append(problem)
                    # the same run without the curve asked for would be reused
                    without_curve = {k: v for k, v in settings.items() if k != "eval_every"}
                    curve_only = curve_only and reuse_problem(out, without_curve, sha256) is None
            plan.append((algo, seed, out, wargs, reuse))
    if problems:
        raise CrosscheckError(
            f"--work {work} holds runs that cannot be reused: " + "; ".join(problems)
            + "; use another --work directory, or delete those files to run them again"
            + (" (or drop --eval-every to reuse them as they are, without a learning curve)" if curve_only else ""))
    return plan


def _run_worker(python: str, algo: str, seed: int, out: Path, wargs: list[str], work: Path, env: dict[str, str],
                record: dict[str, Any]) -> bool:
    """Run one worker in the peers' ``python`` (its log in ``work``) and move its result to
    ``out`` with the data ``record``. False (the log's tail printed) when the worker failed."""
    cmd = [os.path.abspath(python), str(WORKER), *wargs]
    t0 = time.perf_counter()
    with open(work / f"{algo}-s{seed}.log", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(work))
    if proc.returncode != 0:
        tail = (work / f"{algo}-s{seed}.log").read_text(errors="replace").splitlines()[-20:]
        print(f"{algo} seed {seed} failed ({proc.returncode}):\n" + "\n".join(tail), file=sys.stderr)
        return False
    tmp = out.with_name(out.name + ".tmp")
    result = json.loads(tmp.read_text())
    result["data"] = record  # what the reuse check compares, besides the worker's settings
    tmp.write_text(json.dumps(result, indent=1))
    tmp.rename(out)
    print(f"{algo} seed {seed}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return True


def _print_table(rows: list[dict[str, Any]]) -> None:
    """The summary rows as a Markdown table on stdout."""
    print("\n| d3rlpy | target | per seed (normalised) | normalised mean ± std | return mean ± std |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['algo']} | {'-' if r['target'] is None else round(r['target'])} | "
              f"{', '.join(f'{v:.1f}' for v in r['per_seed_normalised'])} | "
              f"{r['normalised_mean']:.1f} ± {r['normalised_std']:.1f} | {r['return_mean']:.0f} ± {r['return_std']:.0f} |")


def _reusable(plan: list[tuple[str, int, Path, list[str], bool]], work: Path) -> list:
    """``--reuse-only``: the runs of ``plan`` that ``work`` holds; the others named on stderr.

    Raises:
        CrosscheckError: ``work`` holds none of them.
    """
    missing = [f"{algo} seed {seed}" for algo, seed, *_, reuse in plan if not reuse]
    kept = [p for p in plan if p[-1]]
    if not kept:
        raise CrosscheckError(f"--reuse-only: --work {work} holds none of the requested runs")
    if missing:
        print(f"--reuse-only: not run, left out of the summary: {', '.join(missing)}", file=sys.stderr)
    return kept


def _run(args: argparse.Namespace, argv: list[str] | None) -> int:
    # every option first, then the dataset, then the --work directory: nothing is exported or
    # started before all of them are known to be right
    seeds, algos, extra = parse_options(args)
    python = None if args.reuse_only else _peer_python(args.python)  # --reuse-only starts no worker
    try:
        ds = load_dataset(args.dataset)
    except (OSError, ValueError) as exc:  # FileNotFoundError, DatasetError, h5py's OSError
        raise CrosscheckError(f"--dataset {args.dataset}: {exc}") from None
    env_id = check_dataset_env(ds, args.env, args.dataset)
    ref = reference_scores(ds) or reference_scores(env_id)
    if ref is None:
        raise CrosscheckError(f"no D4RL reference scores for --dataset {args.dataset} or --env {env_id}: the "
                              f"cross-check reports normalised scores")
    info = dataset_summary(ds)
    targets = [info["top_return"]] + extra
    if info["top_return"] in extra:
        raise CrosscheckError(f"--extra-targets {args.extra_targets!r}: {info['top_return']!r} is the dataset's top "
                              f"return, already a target")
    arrays = d4rl_arrays(ds)
    sha256 = data_fingerprint(arrays)
    work = Path(args.work)
    data_path = (work / "crosscheck_data.npz").resolve()
    plan = _plan(args, seeds, algos, work, data_path, env_id, targets, sha256)

    print(f"{args.dataset}: {info['steps']} steps, {info['episodes']} episodes, top return {info['top_return']:.1f}; "
          f"env {env_id}; DT targets {targets}; data sha256 {sha256[:12]}", file=sys.stderr)
    if args.reuse_only:
        plan = _reusable(plan, work)
    if not all(reuse for *_, reuse in plan):
        export_dataset(ds, data_path, arrays)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONPATH", None)
    record = {"dataset": args.dataset, "sha256": sha256, "steps": info["steps"], "episodes": info["episodes"]}
    runs = []
    for algo, seed, out, wargs, reuse in plan:
        if reuse:
            print(f"reusing {out} (same settings and data)", file=sys.stderr)
        elif not _run_worker(python, algo, seed, out, wargs, work, env, record):
            return 1
        run = json.loads(out.read_text())
        runs.append(run)
        for r in run["results"]:
            print(f"  {algo} s{seed} target {r['target']}: {np.mean(r['returns']):.1f} ± {np.std(r['returns']):.1f} "
                  f"(train {run['train_seconds']:.0f} s, eval {run['eval_seconds']:.0f} s)", file=sys.stderr)
    rows = summarise(runs, ref)
    result = {
        "dataset": args.dataset, "dataset_summary": info, "dataset_sha256": sha256, "env": env_id,
        "reference_scores": list(ref), "targets": targets, "rows": rows, "runs": runs,
        "d3rlpy_version": runs[0]["versions"]["d3rlpy"] if runs else None,
        "command": " ".join(["python -m rl_tformers.bench.crosscheck", *(argv if argv is not None else sys.argv[1:])]),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    _print_table(rows)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
