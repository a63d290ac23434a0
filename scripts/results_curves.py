"""One figure of learning curves: a panel per dataset, a curve per algorithm.

    python scripts/results_curves.py docs/results/hopper-v1 --out docs/results/hopper-v1/curves.png

Reads every ``<algo>-<task>-<dataset>.curves.json`` in the folder (the ``curves.json`` of a
``rl-tformers sweep``, copied by ``scripts/results_mujoco.sh``), and the d3rlpy peers' runs in
``peers-<task>-<dataset>.json`` that carry a learning curve (``crosscheck --eval-every``),
normalised with the reference scores that file records.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from rl_tformers.runtime.curves import plot_curve_panels, read_curves

ALGOS = {"dt": "DT", "bc": "BC", "bc10": "%BC (top 10%)"}
PEERS = {"iql": "d3rlpy IQL", "cql": "d3rlpy CQL"}


def peer_curves(path: Path) -> dict[str, dict]:
    """``{label: {steps, mean, std, n}}`` of the runs with a curve in a cross-check JSON: the
    normalised score (100 x (return - random) / (expert - random)) per evaluation, mean and std
    (ddof 0) over the seeds, at the steps every seed evaluated."""
    data = json.loads(path.read_text())
    lo, hi = data["reference_scores"]
    by_algo: dict[str, list[dict[int, float]]] = {}
    for run in data["runs"]:
        if run.get("curve"):
            by_algo.setdefault(run["algo"], []).append(
                {c["step"]: 100.0 * (float(np.mean(c["results"][0]["returns"])) - lo) / (hi - lo)
                 for c in run["curve"]})
    curves = {}
    for algo, runs in by_algo.items():
        steps = sorted(set.intersection(*(set(r) for r in runs)))
        vals = np.array([[r[s] for s in steps] for r in runs])
        curves[PEERS.get(algo, algo)] = {"steps": steps, "mean": vals.mean(0).tolist(),
                                         "std": vals.std(0).tolist(), "n": len(runs)}
    return curves


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    panels: dict[str, dict] = {}
    metric = None
    for f in sorted(args.folder.glob("*.curves.json")):
        algo, _, dataset = f.name.removesuffix(".curves.json").partition("-")
        metric, points = read_curves(f)
        for curve in points.values():  # one grid point per sweep here (seeds only)
            panels.setdefault(dataset, {})[ALGOS.get(algo, algo)] = curve
    for f in sorted(args.folder.glob("peers-*.json")):
        dataset = f.name.removesuffix(".json").removeprefix("peers-")
        if dataset in panels:
            panels[dataset].update(peer_curves(f))
    if not panels:
        print(f"error: no *.curves.json in {args.folder}", file=sys.stderr)
        return 2
    print(plot_curve_panels(dict(sorted(panels.items())), metric or "", args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
