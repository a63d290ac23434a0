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

Runs are sequential, one thread each; a run already in ``--work`` (its per-run JSON) is reused,
so an interrupted cross-check resumes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from rl_tformers.bench.train import d4rl_arrays, default_peer_python

WORKER = Path(__file__).with_name("_peer_crosscheck.py")


def export_dataset(dataset, path: Path) -> dict[str, Any]:
    """Write ``dataset`` (an EpisodeDataset) to ``path`` (.npz, D4RL layout) and return its summary:
    ``steps``, ``episodes``, ``top_return`` (best episode return) and ``mean_return``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **d4rl_arrays(dataset))
    rets = np.asarray(dataset.episode_returns, dtype=np.float64)
    return {"steps": int(dataset.num_steps), "episodes": int(dataset.num_episodes),
            "top_return": float(rets.max()), "mean_return": float(rets.mean())}


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="d3rlpy DT / BC cross-check on one of our datasets")
    ap.add_argument("--dataset", default="rlt/hopper-v5/medium-expert-v0")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--algos", default="dt,bc")
    ap.add_argument("--extra-targets", default="", help="DT targets besides the dataset's top return, e.g. 3300")
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--episodes", type=int, default=10)
    ap.add_argument("--env", default="Hopper-v5")
    ap.add_argument("--python", default=None, help="the peers' python (default: .bench-venvs/peers/bin/python)")
    ap.add_argument("--work", default="runs/crosscheck/work", help="exported data, per-run JSON and logs")
    ap.add_argument("--out", default="runs/crosscheck/d3rlpy-hopper-medium-expert.json")
    args = ap.parse_args(argv)

    from rl_tformers.envs.loaders import load_dataset
    from rl_tformers.envs.scores import reference_scores

    python = args.python or default_peer_python()
    if not python:
        print("no peers' environment: run `rl-tformers bench train --build-peers` first", file=sys.stderr)
        return 2
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    ds = load_dataset(args.dataset)
    info = export_dataset(ds, work / "crosscheck_data.npz")
    ref = reference_scores(ds) or reference_scores(args.env)
    assert ref is not None, f"no reference scores for {args.dataset}"
    targets = [info["top_return"]] + [float(t) for t in args.extra_targets.split(",") if t.strip()]
    print(f"{args.dataset}: {info['steps']} steps, {info['episodes']} episodes, top return {info['top_return']:.1f}; "
          f"DT targets {targets}", file=sys.stderr)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONPATH", None)
    runs = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for algo in args.algos.split(","):
            out = work / f"{algo}-s{seed}.json"
            if out.exists():
                print(f"reusing {out}", file=sys.stderr)
            else:
                cmd = [os.path.abspath(python), str(WORKER), "--algo", algo, "--data", str((work / "crosscheck_data.npz").resolve()),
                       "--seed", str(seed), "--steps", str(args.steps), "--episodes", str(args.episodes),
                       "--env", args.env, "--out", str(out.resolve()) + ".tmp",
                       "--targets", ",".join(repr(t) for t in targets) if algo == "dt" else ""]
                t0 = time.perf_counter()
                with open(work / f"{algo}-s{seed}.log", "w") as log:
                    proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(work))
                if proc.returncode != 0:
                    tail = (work / f"{algo}-s{seed}.log").read_text(errors="replace").splitlines()[-20:]
                    print(f"{algo} seed {seed} failed ({proc.returncode}):\n" + "\n".join(tail), file=sys.stderr)
                    return 1
                Path(str(out) + ".tmp").rename(out)
                print(f"{algo} seed {seed}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
            run = json.loads(out.read_text())
            runs.append(run)
            for r in run["results"]:
                print(f"  {algo} s{seed} target {r['target']}: {np.mean(r['returns']):.1f} ± {np.std(r['returns']):.1f} "
                      f"(train {run['train_seconds']:.0f} s, eval {run['eval_seconds']:.0f} s)", file=sys.stderr)
    rows = summarise(runs, ref)
    result = {
        "dataset": args.dataset, "dataset_summary": info, "env": args.env, "reference_scores": list(ref),
        "targets": targets, "rows": rows, "runs": runs,
        "d3rlpy_version": runs[0]["versions"]["d3rlpy"] if runs else None,
        "command": " ".join(["python -m rl_tformers.bench.crosscheck", *(argv if argv is not None else sys.argv[1:])]),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("\n| d3rlpy | target | per seed (normalised) | normalised mean ± std | return mean ± std |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['algo']} | {'-' if r['target'] is None else round(r['target'])} | "
              f"{', '.join(f'{v:.1f}' for v in r['per_seed_normalised'])} | "
              f"{r['normalised_mean']:.1f} ± {r['normalised_std']:.1f} | {r['return_mean']:.0f} ± {r['return_std']:.0f} |")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
